"""Regional compilation (``compile(regions=...)``): each block compiled, under plain autograd
or checkpointing, as ``plan(..., compile=True)``'s rows and the plan's engine.

Two compiles in all (each 20-30 s on 2 cores): the engine's blocks in this process (one
graph for every block, both settings), and one setting's worker inside a plan."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.measure import profile_step
from leangrad.planner import _compile as pc
from leangrad.planner import _regional as pr
from leangrad.planner._io import fingerprint
from leangrad.planner._plan import Candidate, Plan

WIDTH = 16


def _block(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh())


class Stacked(nn.Module):
    """A model written the ordinary way: stem, repeated blocks, head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(_block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _named(seen: list[str], name: str, param: nn.Parameter) -> None:
    del param
    seen.append(name)


def test_regional_engines_match_autograd_in_float64_and_leave_the_model_alone() -> None:
    torch.manual_seed(0)
    ordinary = Stacked().double()
    sequence = nn.Sequential(*[_block() for _ in range(3)]).double()
    for model, x in ((ordinary, torch.randn(4, 8, dtype=torch.float64)),
                     (sequence, torch.randn(4, WIDTH, dtype=torch.float64))):  # fmt: skip
        modules = list(model.modules())
        loss_fn = functools.partial(F.mse_loss, target=torch.zeros(4, model(x).shape[1],
                                                                   dtype=torch.float64))
        loss_fn(model(x)).backward()
        ref = _grads(model)
        for regions in ("blocks", "checkpoint"):
            eng = pc.Compiled(regions=regions)
            assert eng.label == f"compile(regions={regions})" and eng.exact
            names: list[str] = []
            for _ in range(2):  # the second step reuses the prepared copy
                model.zero_grad(set_to_none=True)
                out = eng.backward(model, x, loss_fn, on_grad=functools.partial(_named, names))
            assert sorted(names) == sorted(list(ref) * 2)  # under the model's own names
            got = _grads(model)
            assert got.keys() == ref.keys()
            for n, g in got.items():
                torch.testing.assert_close(g, ref[n], rtol=1e-9, atol=1e-12)
            copy = eng.compiled(model)
            assert isinstance(copy, nn.Module) and copy is eng.compiled(model)
            assert copy is not model
            blocks = [m for m in copy.modules() if isinstance(m, pr.CompiledBlock)]
            assert len(blocks) == 3
            if regions == "blocks":  # compiled on first call; checkpoint runs a copy's
                assert all("_compiled" in b.__dict__ for b in blocks)
            else:  # each block checkpointed (a sequence's last one kept, as checkpoint does)
                assert out.info.get("checkpointed", out.info.get("segments")) == 3
        assert list(model.modules()) == modules  # nothing replaced in the user's module
        assert not any(isinstance(m, pr.CompiledBlock) for m in model.modules())


def test_regions_option_is_checked_and_a_model_without_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="regions must be None, 'blocks' or 'checkpoint'"):
        pc.Compiled(regions="layers")
    label = pc.Compiled(activation_memory_budget=0.5, regions="checkpoint").label
    assert label == "compile(activation_memory_budget=0.5,regions=checkpoint)"
    lone = nn.Linear(4, 2)
    eng = pc.Compiled(regions="blocks")
    why = eng.supports(lone)
    assert why is not None and why.startswith("regional compilation compiles each")
    assert pc.Compiled().supports(lone) is None
    with pytest.raises(leangrad.EngineInputError, match="regional compilation"):
        eng.backward(lone, torch.randn(2, 4), lambda out: out.sum())


def _sequence() -> tuple[nn.Module, torch.Tensor, Any]:
    """Repeated blocks of torch's own modules (the worker unpickles them), big enough that
    an eager step raises its resident set by MiBs."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_block(256) for _ in range(3)], nn.Linear(256, 10))
    x, y = torch.randn(512, 256), torch.randint(0, 10, (512,))
    return model, x, functools.partial(F.cross_entropy, target=y)


@pytest.mark.slow
def test_plan_measures_a_regional_row_in_a_fresh_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pc, "COMPILE_BUDGETS", ())  # one compile: the regional row's
    monkeypatch.setattr(pc, "COMPILE_REGIONS", ("checkpoint",))
    model, x, loss_fn = _sequence()
    full = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0).total_bytes
    p = leangrad.plan(model, x, loss_fn, budget=2 * full, repeats=1, compile=True,
                      engines=[("backprop", {})])  # fmt: skip
    row = next(c for c in p.table if c.name == pc.COMPILE_NAME)
    assert row.label == "compile(regions=checkpoint)" and row.options == {"regions": "checkpoint"}
    assert row.compile_seconds is not None and row.compile_seconds > 0, row.verdict
    assert row.peak_bytes is not None and row.peak_bytes > 0
    assert "(RSS-scaled)" in row.verdict and row.seconds is not None
    assert f"{row.compile_seconds:.1f}" in str(p)
    assert sum(c.verdict.startswith("chosen") for c in p.table) == 1


def test_a_model_without_repeated_blocks_has_regional_rows_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pc, "COMPILE_BUDGETS", ())  # no compile at all
    torch.manual_seed(0)
    model, x = nn.Linear(256, 256), torch.randn(2048, 256)
    p = leangrad.plan(model, x, lambda out: out.square().mean(), budget=1 << 30, repeats=1,
                      engines=[("backprop", {})], compile=True)  # fmt: skip
    rows = [c for c in p.table if c.name == pc.COMPILE_NAME]
    assert [r.label for r in rows] == ["compile(regions=blocks)", "compile(regions=checkpoint)"]
    for row in rows:  # (a lambda loss: n/a before the blocks are looked at)
        assert row.verdict.startswith("n/a: ") and row.peak_bytes is None

    loss_fn = functools.partial(F.mse_loss, target=torch.zeros(2048, 256))
    p = leangrad.plan(model, x, loss_fn, budget=1 << 30, repeats=1,
                      engines=[("backprop", {})], compile=True)  # fmt: skip
    rows = [c for c in p.table if c.name == pc.COMPILE_NAME]
    assert len(rows) == 2 and all(
        r.verdict.startswith("n/a: regional compilation compiles each of the model's repeated "
                             "blocks") and r.compile_seconds is None for r in rows)  # fmt: skip
    assert p.engine is not None and p.engine.label == "backprop"


def test_a_plan_that_chose_a_regional_compile_saves_loads_and_trains(tmp_path: Path) -> None:
    from leangrad.train._fit import _engine_for

    model, x, _ = _sequence()
    opts = {"regions": "checkpoint"}
    chosen = Candidate("compile(regions=checkpoint)", True, 1000, 0.01, "chosen (RSS-scaled)",
                       pc.COMPILE_NAME, opts, compile_seconds=12.5)  # fmt: skip
    other = Candidate("backprop", True, 2000, 0.02, "over budget", "backprop", {})
    p = Plan(pc.Compiled(regions="checkpoint"), 1000, 0.01, True, 1500, (other, chosen),
             "chosen: compile(regions=checkpoint)", made_for=fingerprint(model, x))  # fmt: skip
    path = p.save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["table"][1]["options"] == opts
    back = Plan.load(path, model=model, inputs=x)
    assert isinstance(back.engine, pc.Compiled) and back.engine.regions == "checkpoint"
    assert back.engine.label == chosen.label and back.table == p.table
    eng = _engine_for(pc.COMPILE_NAME, {"regions": "blocks"})  # train --plan's rebuild
    assert isinstance(eng, pc.Compiled) and eng.regions == "blocks" and eng.budget is None
