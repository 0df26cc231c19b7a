"""Engines under ``torch.autocast``: each engine either computes what
autograd computes under the same autocast, or refuses naming why. Exactness under
autocast is "equal to autograd under the same autocast": bitwise where the engine runs
autograd's own ops (backprop, checkpoint), within reduced-precision rounding where it
splits them (fragments, chunks, micro-batches)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
import leangrad._step
from helpers import resnet_problem
from leangrad import zoo
from leangrad._errors import EngineInputError
from leangrad.loss import per_example
from leangrad.measure import compare_grads

AUTOCAST = [("backprop", {}), ("checkpoint", {}), ("checkpoint", {"fragments": 3}),
            ("checkpoint", {"sequence_fragments": 2}), ("chunked_ce", {}),
            ("checkpoint+chunked_ce", {"fragments": 2}), ("accumulate", {"micro_batches": 2}),
            ("checkpoint+accumulate", {"micro_batches": 3})]  # fmt: skip
"""Engines checked under autocast."""
BITWISE = {"backprop", "checkpoint"}
"""Those that run autograd's own ops on the whole batch: equal bit for bit."""


def _gpt() -> tuple[nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=1024, dim=32, layers=2, heads=2, context=16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1024, (6, 16), generator=gen)
    y = torch.randint(0, 1024, (6, 16), generator=gen)
    return model, x, per_example(lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), y)


def _under_autocast(fn: Any) -> Any:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(("name", "opts"), AUTOCAST, ids=[f"{n}{o}" for n, o in AUTOCAST])
def test_checked_engines_equal_autograd_under_the_same_autocast(name: str,
                                                                 opts: dict[str, Any]) -> None:
    model, x, loss_fn = _gpt()
    _under_autocast(lambda: loss_fn(model(x)).backward())
    ref = _grads(model)
    eng = leangrad.engine(name, **opts)
    assert eng.autocast_why() is None
    res = _under_autocast(lambda: eng.backward(model, x, loss_fn))
    got = _grads(model)
    assert set(got) == set(ref)
    assert res.loss.dtype == torch.float32  # the loss autocast leaves in float32
    if name in BITWISE and not opts:
        for n, g in ref.items():
            assert torch.equal(got[n], g), n
    else:
        cmp = compare_grads(got, ref)
        assert cmp.cosine >= 0.999, cmp  # bf16 rounding of split ops, not another gradient


def test_batchnorm_fragments_under_autocast_stay_close() -> None:
    model, x, loss_fn = resnet_problem(width=4, batch=6, side=8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _under_autocast(lambda: loss_fn(model(x)).backward())
    ref = _grads(model)
    ref_buffers = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    res = _under_autocast(lambda: leangrad.engine("checkpoint", fragments=3).backward(
        model, x, loss_fn))  # fmt: skip
    assert res.info["whole"] == {}
    assert compare_grads(_grads(model), ref).cosine >= 0.999
    for k, v in model.state_dict().items():  # running statistics advanced once
        torch.testing.assert_close(v, ref_buffers[k], rtol=2e-2, atol=1e-3, msg=k)


REFUSING = ["forward", "projforward", "fad", "rad", "bits", "checkpoint+fad"]


@pytest.mark.parametrize("name", REFUSING)
def test_unchecked_engines_refuse_under_autocast_naming_why(name: str) -> None:
    model, x, loss_fn = _gpt()
    eng = leangrad.engine(name)
    assert eng.autocast_why() is not None
    with pytest.raises(EngineInputError, match=r"torch\.autocast"):
        _under_autocast(lambda: eng.backward(model, x, loss_fn))
    assert all(p.grad is None for p in model.parameters())


def test_every_registered_engine_declares_whether_it_runs_under_autocast() -> None:
    checked = {n for n, _ in AUTOCAST}
    for name in leangrad.available():
        why = leangrad.engine(name).autocast_why()
        assert (why is None) == (name in checked), (name, why)


def test_plan_under_autocast_measures_and_records_it() -> None:
    model, x, loss_fn = _gpt()
    full = leangrad.measure.profile_step(leangrad.engine("backprop"), model, x, loss_fn,
                                         repeats=0)  # fmt: skip
    budget = full.baseline_bytes + full.peak_bytes
    result = leangrad.plan(model, x, loss_fn, budget=budget, repeats=1,
                           engines=[("backprop", {}), ("checkpoint", {}), ("forward", {})],
                           autocast=torch.bfloat16)  # fmt: skip
    assert result.engine is not None and result.made_for is not None
    assert result.made_for["autocast"] == "bfloat16"
    forward = next(c for c in result.table if c.name == "forward")
    assert forward.verdict.startswith("n/a") and "torch.autocast" in forward.verdict
    with pytest.raises(ValueError, match="autocast"):
        leangrad.plan(model, x, loss_fn, budget=budget, autocast=torch.int8)


def test_plan_under_autocast_counts_each_steps_cast_weights() -> None:
    """A training loop enters autocast once per step, so each step makes its bfloat16
    copies of the weights and holds them until the step ends. The plan measures each step
    in a context of its own: a wide layer's row counts its 2 MiB cast copy (the peak equals
    a ``Step`` under autocast, run cold), where one context around the whole plan kept the
    copy cached from the first step and no later step counted it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                                torch.nn.Linear(1024, 4))  # fmt: skip
    x, y = torch.randn(2, 1024), torch.randint(0, 4, (2,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    p = leangrad.plan(model, x, loss_fn, budget=1 << 30, repeats=1,
                      engines=[("backprop", {})], autocast=torch.bfloat16)  # fmt: skip
    [row] = p.table
    step = leangrad._step.Step(leangrad.engine("backprop"), autocast=torch.bfloat16)
    alone = leangrad.measure.profile_step(step, model, x, loss_fn, repeats=0)
    assert row.peak_bytes == alone.total_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):  # one context: the copies cached
        cached = leangrad.measure.profile_step(leangrad.engine("backprop"), model, x, loss_fn,
                                               repeats=0)  # fmt: skip
    cast = 2 * sum(p.numel() for p in model.parameters() if p.dim() > 1)  # bfloat16 copies
    assert row.peak_bytes - cached.total_bytes >= cast - 2 * 4 * 1024  # the 2 MiB, counted
    assert all(p.grad is None for p in model.parameters())


def test_train_and_plan_under_bf16_from_the_command_line(tmp_path: Any, capsys: Any) -> None:
    """``leangrad train --precision bf16`` runs each step under autocast (an engine not
    checked under it exits 2 with the reason); ``leangrad plan --precision bf16`` plans it."""
    from leangrad.cli import main

    base = ["train", "--model", "mlp", "--data", "synthetic", "--data-opt", "n=96",
            "--batch-size", "32", "--no-progress", "--no-plots", "--max-steps", "2"]  # fmt: skip
    assert main([*base, "--precision", "bf16", "--out", str(tmp_path / "a")]) == 0
    assert "precision=bf16" in capsys.readouterr().out
    assert main([*base, "--precision", "bf16", "--engine", "fad",
                 "--out", str(tmp_path / "b")]) == 2  # fmt: skip
    assert "torch.autocast" in capsys.readouterr().err
    plan = ["plan", "--model", "mlp", "--batch-size", "8", "--engines", "backprop,forward",
            "--repeats", "1", "--no-progress", "--budget", "2GiB", "--precision", "bf16"]
    assert main(plan) == 0
    out = capsys.readouterr().out
    assert "precision=bf16" in out and "chosen: " in out and "torch.autocast" in out


def test_fit_refuses_an_unknown_precision_before_any_work() -> None:
    from leangrad import train
    from leangrad._errors import OptionError

    with pytest.raises(OptionError, match="precision must be one of float32, bf16, fp16"):
        train.fit("mlp", data="synthetic", precision="int8", progress=False)
