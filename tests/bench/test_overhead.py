"""The ``overhead`` suite's pairs: each PyTorch twin computes the gradients its engine
computes (the same arithmetic, so their host time and ops compare the overhead alone), the
op counter splits a step at the forward's end for both, and a quick run writes records
the report renders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import leangrad
from leangrad._errors import LeangradError
from leangrad_bench._models import build
from leangrad_bench._overhead import count_ops, render, run_overhead, twins
from leangrad_bench._suites import RunSettings, load_suite

SIZES = {
    "gpt": {"vocab": 64, "dim": 16, "layers": 3, "heads": 2, "context": 16},
    "resnet": {"depth": 18, "width": 4, "image": 8},
    "lstm_lm": {"vocab": 64, "embed": 16, "hidden": 16, "layers": 2},
}


def _grads(model: torch.nn.Module, step: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step(None)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(SIZES))
def test_each_twin_computes_its_engines_gradients(name: str) -> None:
    wl = build(name, SIZES[name], batch=4)
    model, loss_fn = wl.model.double(), wl.loss_fn
    xs = tuple(x.double() if x.is_floating_point() else x
               for x in (wl.inputs if isinstance(wl.inputs, tuple) else (wl.inputs,)))  # fmt: skip
    hands = twins(model, xs, loss_fn, micro_batches=2)
    assert {"backprop", "accumulate", "chunked_ce"} <= set(hands)
    for pair, twin in hands.items():
        eng = leangrad.engine("accumulate", micro_batches=2) if pair == "accumulate" else \
            leangrad.engine(pair)
        try:
            ours = _grads(model, lambda _c, e=eng: e.backward(model, xs, loss_fn))
        except LeangradError as err:  # accumulate on a BatchNorm net: refused, named
            assert pair == "accumulate" and "BatchNorm" in str(err)
            continue
        theirs = _grads(model, twin)
        assert ours.keys() == theirs.keys()
        for n, g in ours.items():
            torch.testing.assert_close(g, theirs[n], rtol=1e-9, atol=1e-12, msg=f"{pair} {n}")


def test_the_counter_splits_at_the_forwards_end() -> None:
    wl = build("gpt", SIZES["gpt"], batch=4)
    model, xs = wl.model, (wl.inputs,)
    eng = leangrad.engine("checkpoint")
    eng.backward(model, xs, wl.loss_fn)  # the first step probes the blocks: steady state after
    fwd, bwd = count_ops(lambda _c: eng.backward(model, xs, wl.loss_fn))
    twin = twins(model, xs, wl.loss_fn, micro_batches=2)["checkpoint"]
    tf, tb = count_ops(twin)
    assert fwd > 0 and bwd > fwd  # the backward recomputes the blocks
    assert fwd == tf and abs(bwd - tb) <= 10  # the same ops, up to a stated constant


@pytest.mark.slow  # 101 timed repeats per row: make test-slow
def test_a_quick_run_writes_records_the_report_renders(tmp_path: Path) -> None:
    suite = load_suite("overhead")
    records = run_overhead(suite, RunSettings(quick=True, progress=False))
    assert {r["pair"] for r in records} >= {"backprop", "checkpoint", "accumulate"}
    for r in records:
        assert r["seconds"] > 0 and r["twin_seconds"] > 0 and r["ratio"] > 0
        assert r["ops_forward"] > 0 and r["twin_ops_backward"] > 0
    lines = render("overhead", records, tmp_path)
    assert any("tiny_gpt" in line and "checkpoint" in line for line in lines)
