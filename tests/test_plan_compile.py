"""``plan(..., compile=True)``: torch.compile as a candidate, measured in a fresh process.

Two compiles in all (each 20+ s on 2 cores): one setting's worker inside a plan, and the
plan's engine compiling on its first backward. Everything else runs no compile (regional
compilation's rows: tests/test_plan_regional.py)."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.cli import _parser
from leangrad.measure import profile_step
from leangrad.planner import _compile as pc
from leangrad.planner._io import fingerprint
from leangrad.planner._plan import Candidate, Plan


def _mlp(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor, Any]:
    """Big enough that an eager step raises the worker's resident set by MiBs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 10)).to(dtype)  # fmt: skip
    x, y = torch.randn(512, 128, dtype=dtype), torch.randint(0, 10, (512,))
    return model, x, functools.partial(F.cross_entropy, target=y)  # picklable


@pytest.mark.slow
def test_plan_with_compile_has_compiled_rows_and_a_chosen_row_within_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pc, "COMPILE_BUDGETS", (0.5,))  # one compile: ~25 s here
    monkeypatch.setattr(pc, "COMPILE_REGIONS", ())
    model, x, loss_fn = _mlp()
    full = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0).total_bytes
    budget = int(1.5 * full)
    p = leangrad.plan(model, x, loss_fn, budget=budget, repeats=1, compile=True,
                      engines=[("backprop", {}), ("checkpoint", {})])  # fmt: skip
    rows = {c.label: c for c in p.table}
    row = rows["compile(activation_memory_budget=0.5)"]
    assert row.name == pc.COMPILE_NAME and row.options == {"activation_memory_budget": 0.5}
    assert row.compile_seconds is not None and row.compile_seconds > 0
    assert row.peak_bytes is not None and row.peak_bytes > 0
    assert "(RSS-scaled)" in row.verdict
    assert row.seconds is not None  # scaled from backprop's median: not asserted on
    assert "compile s" in str(p) and f"{row.compile_seconds:.1f}" in str(p)
    assert p.engine is not None and p.peak_bytes is not None and p.peak_bytes <= budget
    assert sum(c.verdict.startswith("chosen") for c in p.table) == 1


def test_compiled_engine_matches_autograd_and_compiles_once() -> None:
    model, x, loss_fn = _mlp(torch.float64)
    loss_fn(model(x)).backward()
    ref = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    eng = pc.Compiled(activation_memory_budget=0.5)
    assert eng.label == "compile(activation_memory_budget=0.5)" and eng.exact
    for _ in range(2):  # the second step reuses the compiled model
        model.zero_grad(set_to_none=True)
        eng.backward(model, x, loss_fn)
    assert eng.compiled(model) is eng.compiled(model)
    for n, q in model.named_parameters():
        assert q.grad is not None
        torch.testing.assert_close(q.grad, ref[n], rtol=1e-9, atol=1e-12)


def test_compile_budget_option_is_checked() -> None:
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="activation_memory_budget"):
            pc.Compiled(activation_memory_budget=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile must be True or False"):
        leangrad.plan(*_mlp(), budget=1 << 30, compile="yes")  # type: ignore[arg-type]


def _rows(p: Plan) -> dict[str, Candidate]:
    return {c.label: c for c in p.table if c.name == pc.COMPILE_NAME}


def test_unpicklable_loss_or_model_gives_rows_saying_why() -> None:
    model, x, loss_fn = _mlp()
    p = leangrad.plan(model, x, lambda out: loss_fn(out), budget=1 << 30, repeats=1,
                      engines=[("backprop", {})], compile=True)  # fmt: skip
    rows = _rows(p)
    assert set(rows) == {"compile", "compile(activation_memory_budget=0.5)",
                         "compile(regions=blocks)", "compile(regions=checkpoint)"}  # fmt: skip
    for row in rows.values():
        assert row.verdict.startswith("n/a: compile runs in a fresh process, and the loss_fn "
                                      "cannot be pickled")  # fmt: skip
        assert row.peak_bytes is None and row.compile_seconds is None
    assert p.engine is not None and p.engine.label == "backprop"

    class Local(nn.Module):  # a class pickle cannot name
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)  # type: ignore[no-any-return]

    p = leangrad.plan(Local(), x, loss_fn, budget=1 << 30, repeats=1,
                      engines=[("backprop", {})], compile=True)  # fmt: skip
    assert all("the model cannot be pickled" in r.verdict for r in _rows(p).values())


def test_compile_with_an_optimizer_is_a_row_saying_why() -> None:
    model, x, loss_fn = _mlp()
    p = leangrad.plan(model, x, loss_fn, budget=1 << 30, repeats=1, engines=[("backprop", {})],
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), compile=True)  # fmt: skip
    assert all(r.verdict == f"n/a: {pc.WITH_OPTIMIZER}" for r in _rows(p).values())


def test_a_failed_or_timed_out_worker_is_a_failed_row_and_the_plan_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from leangrad.measure import _rss

    answers: list[Any] = [subprocess.TimeoutExpired("worker", pc.COMPILE_TIMEOUT_S),
                          {"failed": "BackendCompilerFailed: inductor raised\nmore"},
                          RuntimeError("Traceback ...\nSegmentation fault\n"),
                          {"failed": "Unsupported: a graph break"}]  # fmt: skip
    regions: list[Any] = []

    def fake(module: str, payload: dict[str, Any], *, timeout: float) -> Any:
        assert module == pc.WORKER and Path(payload["path"]).is_file()
        regions.append(payload["regions"])
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(_rss, "run_json_worker", fake)
    model, x, loss_fn = _mlp()
    p = leangrad.plan(model, x, loss_fn, budget=1 << 30, repeats=1, engines=[("backprop", {})],
                      compile=True)  # fmt: skip
    rows = _rows(p)
    assert rows["compile"].verdict == pc.TIMED_OUT.format(seconds=pc.COMPILE_TIMEOUT_S)
    assert rows["compile(activation_memory_budget=0.5)"].verdict == (
        "failed: BackendCompilerFailed: inductor raised"
    )
    assert regions == [None, None, "blocks", "checkpoint"]
    assert rows["compile(regions=blocks)"].verdict == pc.WORKER_FAILED.format(
        why="Segmentation fault")
    assert rows["compile(regions=checkpoint)"].verdict == "failed: Unsupported: a graph break"
    assert p.engine is not None and p.engine.label == "backprop"


def test_a_plan_that_chose_compile_saves_and_loads(tmp_path: Path) -> None:
    model, x, _ = _mlp()
    chosen = Candidate("compile(activation_memory_budget=0.5)", True, 1000, 0.01,
                       "chosen (RSS-scaled)", pc.COMPILE_NAME, {"activation_memory_budget": 0.5},
                       compile_seconds=21.5)  # fmt: skip
    other = Candidate("backprop", True, 2000, 0.02, "over budget", "backprop", {})
    made_for = fingerprint(model, x)
    p = Plan(pc.Compiled(activation_memory_budget=0.5), 1000, 0.01, True, 1500,
             (other, chosen), "chosen: compile", made_for=made_for)  # fmt: skip
    path = p.save(tmp_path / "plan.json")
    doc = json.loads(path.read_text())
    assert "compile_seconds" not in doc["table"][0] and doc["table"][1]["compile_seconds"] == 21.5
    back = Plan.load(path, model=model, inputs=x)
    assert isinstance(back.engine, pc.Compiled) and back.engine.budget == 0.5
    assert back.table == p.table


def test_cli_plan_compile_flag() -> None:
    assert _parser().parse_args(["plan", "--compile"]).compile is True
    assert _parser().parse_args(["plan"]).compile is False


def test_a_step_too_small_for_rss_is_not_compiled() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(8, 4)
    loss_fn = functools.partial(F.cross_entropy, target=torch.randint(0, 2, (8,)))
    p = leangrad.plan(model, x, loss_fn, budget=1 << 30, repeats=1, engines=[("backprop", {})],
                      compile=True)  # fmt: skip
    rows = _rows(p)
    assert len(rows) == 4 and all(
        r.verdict.startswith("n/a: backprop's step allocates") and r.compile_seconds is None
        for r in rows.values())  # fmt: skip


def test_training_rebuilds_a_compiled_plans_engine() -> None:
    """``train --plan`` / ``fit(plan=)`` name the plan's engine; a compiled one is not
    registered, and is rebuilt as the plan's :class:`~leangrad.planner._compile.Compiled`
    (nothing compiles until its first backward)."""
    from leangrad.train._fit import _engine_for

    eng = _engine_for(pc.COMPILE_NAME, {"activation_memory_budget": 0.5})
    assert isinstance(eng, pc.Compiled) and eng.budget == 0.5
    assert _engine_for("checkpoint", {"fragments": 2}).label == "checkpoint(fragments=2)"
