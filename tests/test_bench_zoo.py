"""The ``zoo`` suite's machinery on tiny sizes (seconds): its methods and the max-batch
search. Nothing here asserts a time."""

from __future__ import annotations

import pytest
import torch

from leangrad.bench._zoo_batch import NOT_ESTIMABLE, estimable, footprint, max_batch
from leangrad.bench._zoo_methods import Method, build, leangrad_methods, pytorch_methods

GPT = {"vocab": 32, "dim": 24, "layers": 4, "heads": 2, "context": 32, "batch": 8}
LSTM = {"vocab": 1024, "embed": 8, "hidden": 16, "layers": 2, "length": 12, "batch": 4}


def test_max_batch_search_is_exact_and_monotone_in_budget() -> None:
    """Against a brute-force scan, over every budget, for totals with a jump and a plateau."""

    def total(b: int) -> int:
        return 1000 + 37 * b + (b // 5) * 11 + (500 if b > 40 else 0)

    last = -1
    for budget in range(900, 3400, 7):
        got = max_batch(total, budget, start=6, limit=64)
        want = max([b for b in range(1, 65) if total(b) <= budget], default=0)
        assert got.batch == want and got.batch >= last
        assert all(total(b) == t for b, t in got.probes.items())
        last = got.batch
    assert max_batch(total, 10**9, start=6, limit=64).capped


def test_max_batch_on_real_estimates_is_monotone_in_budget() -> None:
    ck = Method("checkpoint", "leangrad", True, {"engine": "checkpoint", "options": {}})
    totals = {b: footprint("gpt", GPT, ck, b, estimate=True).total for b in range(1, 13)}
    assert all(totals[b] < totals[b + 1] for b in range(1, 12))
    budgets = [totals[1] - 1, *range(totals[1], totals[12], 1_000), totals[12], totals[12] + 1]
    found = [max_batch(totals.__getitem__, b, start=4, limit=12).batch for b in budgets]
    assert found == sorted(found) and found[0] == 0 and found[-2:] == [12, 12]
    for budget, got in zip(budgets, found, strict=True):
        assert got == max([b for b, t in totals.items() if t <= budget], default=0)


def test_estimate_equals_tracker_for_checkpointing_a_gpt() -> None:
    ck = Method("checkpoint", "leangrad", True, {"engine": "checkpoint", "options": {}})
    est, real = (footprint("gpt", GPT, ck, 4, estimate=e) for e in (True, False))
    assert est.estimate and not real.estimate
    assert (est.baseline, est.peak, est.kept) == (real.baseline, real.peak, real.kept)


def test_forward_mode_engines_are_not_estimated() -> None:
    fwd = Method("projforward", "leangrad", False, {"engine": "projforward", "options": {}})
    assert estimable(fwd) == NOT_ESTIMABLE.format(engine="projforward")
    with pytest.raises(ValueError, match="not estimated on fake tensors"):
        footprint("gpt", GPT, fwd, 4, estimate=True)


def test_methods_cover_every_engine_and_composition() -> None:
    wl = build("gpt", GPT)
    methods, skipped = leangrad_methods(wl.model, options={}, skip={}, forward_max_params=0)
    labels = {m.label for m in methods} | {s.label for s in skipped}
    assert {"backprop", "checkpoint+fad+bits", "moonwalk+rad", "highway+fad"} <= labels
    assert len(labels) == len(methods) + len(skipped)
    torch_methods, _ = pytorch_methods(wl.model, segments=[2, 9], chunks=[4])
    assert [m.label for m in torch_methods] == [
        "torch bf16 autocast",
        "torch per-block",
        "torch selective",
        "checkpoint_sequential(2)",
    ]


@pytest.mark.parametrize(("kind", "arg"), [("rnn", None), ("chunks", 1), ("chunks", 5)])
def test_time_chunks_give_autograds_gradient_in_float64(kind: str, arg: int | None) -> None:
    """Checkpointing the recurrent module, whole or in time chunks with the state carried,
    is the same computation: float64 gradients agree to 1e-12."""
    for cell in ("lstm_lm", "gru_lm"):
        wl = build(cell, LSTM)
        model = wl.model.double()
        model.zero_grad(set_to_none=True)
        wl.loss_fn(model(wl.inputs)).backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        Method("m", "pytorch", True, {"torch": kind, "arg": arg}).make().backward(
            model, wl.inputs, wl.loss_fn
        )
        for g, w in zip([p.grad for p in model.parameters()], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
