"""A block's submodule reached under a second name outside the block.

``self.extra = self.g.blocks[0].mlp`` (the tied GPT) or ``self.alias = self.layers[1].fc``
(an MLP whose blocks hold an ``nn.Sequential``), called once more after the blocks: the
alias is a container that repeats a type, so the module tree shows its children as
repeated units too, though they sit inside a block. :func:`leangrad.blocks` left them in
and ``checkpoint(levels=2)`` chained the nested block calls (a gradient 61% off, silently).
The block finder now leaves such units to the block holding them (``how`` says so) and
refuses them when named by ``blocks=`` (:data:`leangrad.engines._blocks.ALIASED_BLOCKS`),
so every user of the finder sees the same blocks: ``checkpoint`` and its compositions,
:meth:`Engine.blocks <leangrad.engines.Engine.blocks>` for the others (FSDP units, the
planner's rank model), :func:`leangrad.explain`, the planner's offers and regional
compilation.

Every registered engine and the compositions of the contract test, on both models:
the gradient within 1e-10 of autograd's in float64 (relative to each parameter's largest
entry), ``.grad`` None where autograd leaves None, the user's Parameters and module tree
left as they were — or a refusal naming why. The randomized engines (``rad`` below
fraction 1, ``projforward``) are only run (no crash, finite, the same ``.grad`` None-ness).
Nothing here asserts a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import zoo
from leangrad.engines._blocks import ALIASED_BLOCKS
from leangrad.loss import per_example
from leangrad.planner import _compile as pc
from leangrad.planner._plan import candidates
from leangrad.planner._regional import CompiledBlock, Regional, regions_why
from shared_models import SharedMLP, beside_autograd

LossFn = Callable[[Any], torch.Tensor]
Case = tuple[nn.Module, torch.Tensor, LossFn]
DT = torch.float64
TOL = 1e-10


# ------------------------------------------------------------------------------ models
class Block(nn.Module):
    """A residual block whose ``fc`` is an ``nn.Sequential`` repeating ``nn.Linear``, and
    a layer its forward never uses (its ``.grad`` stays None)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.unused = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class AliasMLP(nn.Module):
    """Three blocks, the second one's ``fc`` reached as ``alias`` and called again after
    them (outside every block)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 6)
        self.layers = nn.ModuleList([Block(6) for _ in range(3)])
        self.alias = self.layers[1].fc
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(torch.tanh(x + self.alias(x)))


def _gpt() -> Case:
    model = SharedMLP()
    x, loss_fn = zoo.batch("gpt", model.g, 4, length=6)
    return model, x, loss_fn


def _mlp() -> Case:
    model = AliasMLP().to(DT)
    torch.manual_seed(1)
    x = torch.randn(8, 4, dtype=DT)
    return model, x, per_example(F.cross_entropy, torch.randint(0, 3, (8,)))


MODELS: dict[str, Callable[[], Case]] = {"gpt": _gpt, "mlp": _mlp}
# model -> (the blocks, the inner units left, the block holding them)
FOUND = {
    "gpt": (("g.blocks.0", "g.blocks.1", "g.blocks.2"), ("extra.0", "extra.1", "extra.2"),
            "g.blocks.0"),
    "mlp": (("layers.0", "layers.1", "layers.2"), ("alias.0", "alias.1", "alias.2"),
            "layers.1"),
}  # fmt: skip

# Every registered engine (option variants where they take other paths) and the
# compositions of tests/engines/test_contract.py; the last field: exact.
ENGINES: list[tuple[str, dict[str, Any], bool]] = [
    ("backprop", {}, True),
    ("forward", {}, True),
    ("projforward", {"samples": 2, "seed": 0}, False),
    ("rad", {"fraction": 1.0, "seed": 0}, True),
    ("rad", {"fraction": 0.5, "seed": 0}, False),
    ("fad", {}, True),
    ("fad", {"mode": "eager"}, True),
    ("bits", {}, True),
    ("accumulate", {"micro_batches": 2}, True),
    ("chunked_ce", {}, True),
    ("moonwalk", {}, True),
    ("revbackprop", {}, True),
    ("highway", {"k": 10}, True),
    ("checkpoint", {}, True),
    ("checkpoint", {"trace": True}, True),
    ("checkpoint", {"levels": 2}, True),
    ("checkpoint", {"levels": 2, "trace": True}, True),
    ("checkpoint", {"fragments": 2}, True),
    ("checkpoint", {"levels": 2, "fragments": 2}, True),
    ("checkpoint", {"fragments": 2, "fragment_blocks": 1}, True),
    ("checkpoint", {"sequence_fragments": 2, "levels": 2}, True),
    ("checkpoint+fad", {}, True),
    ("checkpoint+bits", {}, True),
    ("checkpoint+rad", {"fraction": 1.0, "seed": 0}, True),
    ("checkpoint+rad", {"fraction": 0.5, "seed": 0}, False),
    ("checkpoint+accumulate", {"micro_batches": 2}, True),
    ("checkpoint+chunked_ce", {}, True),
    ("moonwalk+fad", {}, True),
    ("revbackprop+fad", {}, True),
    ("highway+fad", {"k": 10}, True),
    ("fad+rad", {"fraction": 1.0, "seed": 0}, True),
    ("fad+bits", {}, True),
    ("moonwalk+bits", {}, True),
]
REFUSED = ("moonwalk", "revbackprop", "highway")  # need a leangrad Chain / HighwayNet


def _check(model: nn.Module, x: torch.Tensor, loss_fn: LossFn, eng: leangrad.Engine, *,
           exact: bool) -> leangrad.StepResult:  # fmt: skip
    """``eng`` on ``model`` against ``loss_fn(model(x)).backward()`` on a deep copy (which
    keeps the sharing): every ``.grad`` (None-ness; the value where ``exact``), and the
    user's Parameters and module tree left as they were."""
    res, want_loss, ref = beside_autograd(model, x, loss_fn,
                                          lambda: eng.backward(model, x, loss_fn))
    want = dict(ref.named_parameters(remove_duplicate=False))
    if exact:
        assert abs(res.loss.item() - want_loss.item()) <= TOL * max(1.0, abs(want_loss.item()))
    for n, p in model.named_parameters(remove_duplicate=False):
        g = want[n].grad
        assert (p.grad is None) == (g is None), (eng.label, n)
        if g is None:
            continue
        assert p.grad is not None and bool(p.grad.isfinite().all()), (eng.label, n)
        if exact:
            err = float((p.grad - g).abs().max()) / max(float(g.abs().max()), 1e-300)
            assert err <= TOL, (eng.label, n, err)
    return res


# ----------------------------------------------------------------------------- finder
@pytest.mark.parametrize("kind", list(MODELS))
def test_the_finder_lists_no_block_inside_another(kind: str) -> None:
    """:func:`leangrad.blocks`, every engine's :meth:`blocks` (backprop's: the FSDP units)
    and ``checkpoint``'s agree: the outer blocks only, and ``how`` names the units left to
    the block holding them."""
    model, _, _ = MODELS[kind]()
    outer, inner, holder = FOUND[kind]
    found = leangrad.blocks(model)
    assert found.names == outer
    left = ", ".join(f"{n} (in {holder})" for n in inner)
    assert found.how.endswith(f"; left to the blocks holding them: {left}")
    for name in ("backprop", "checkpoint", "checkpoint+fad", "accumulate"):
        assert leangrad.engine(name).blocks(model).names == outer, name
    text = str(leangrad.explain("checkpoint", model))
    assert f"left to the blocks holding them: {inner[0]} (in {holder})" in text
    rows = [line.split()[0] for line in text.splitlines() if line.endswith("checkpointed")]
    assert rows == list(outer)


@pytest.mark.parametrize("kind", list(MODELS))
def test_named_blocks_one_inside_another_are_refused(kind: str) -> None:
    """Named by ``blocks=``: a unit whose slot is inside a named block is refused (by the
    finder and by ``checkpoint``); the alias itself, whose slot is the model's, runs beside
    the blocks (not inside one) and is exact at both levels."""
    model, x, loss_fn = MODELS[kind]()
    outer, inner, holder = FOUND[kind]
    alias = inner[0].split(".")[0]
    want = ALIASED_BLOCKS.format(inner=inner[0], outer=holder)
    with pytest.raises(leangrad.EngineInputError) as err:
        leangrad.blocks(model, names=[holder, inner[0]])
    assert str(err.value) == want
    with pytest.raises(leangrad.EngineInputError) as err:
        _check(model, x, loss_fn, leangrad.engine("checkpoint", blocks=[*outer, inner[0]]),
               exact=True)  # fmt: skip
    assert str(err.value) == want
    container = outer[0].rpartition(".")[0]
    eng = leangrad.engine("checkpoint", blocks=[container, alias], levels=2)
    assert eng.blocks(model).names == (*outer, alias)
    res = _check(model, x, loss_fn, eng, exact=True)
    assert res.info["checkpointed"] == len(outer) + 1


# ---------------------------------------------------------------------------- engines
def _cases() -> list[Any]:
    return [pytest.param(name, options, exact, kind, id=f"{name}{options or ''}-{kind}")
            for name, options, exact in ENGINES for kind in MODELS]  # fmt: skip


def test_every_registered_engine_has_a_case() -> None:
    assert {n for n, _, _ in ENGINES if "+" not in n} == set(leangrad.available())


@pytest.mark.parametrize(("name", "options", "exact", "kind"), _cases())
def test_every_engine_is_exact_or_refuses(name: str, options: dict[str, Any], exact: bool,
                                          kind: str) -> None:  # fmt: skip
    model, x, loss_fn = MODELS[kind]()
    eng = leangrad.engine(name, **options)
    why = eng.supports(model)
    if name.split("+")[0] in REFUSED:
        assert why is not None and "needs" in why, why
        with pytest.raises(leangrad.EngineInputError):
            eng.backward(model, x, loss_fn)
        return
    assert why is None, why
    res = _check(model, x, loss_fn, eng, exact=exact)
    if name.startswith("checkpoint"):  # the outer blocks recomputed, no unit inside one
        assert res.info["checkpointed"] == len(FOUND[kind][0]), res.info
    if options.get("levels") == 2:
        assert res.info["dropped"] > 0 and res.info["rebuilt"] > 0, res.info


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_plan_offer_is_exact(kind: str) -> None:
    """What :func:`leangrad.plan` may choose among (exact and randomized offers, gradient
    accumulation included: the loss is declared per example): each offer's step exact,
    the randomized ones run; no offer names a unit inside a block."""
    model, x, loss_fn = MODELS[kind]()
    inner = FOUND[kind][1]
    offers = candidates(model, exact=False, loss_fn=loss_fn)
    assert any(n == "checkpoint" for n, _ in offers)
    for name, options in offers:
        assert not set(options.get("blocks", ())) & set(inner), options
        randomized = ("rad" in name and options.get("fraction", 1.0) < 1) or "projforward" in name
        _check(model, x, loss_fn, leangrad.engine(name, **options), exact=not randomized)


def test_regional_compile_compiles_the_outer_blocks_only() -> None:
    """``Compiled(regions="blocks")``: one compiled region per outer block (none inside
    another), and the step exact (inductor may reassociate: float64 keeps it ≤ 1e-10)."""
    model, x, loss_fn = _mlp()
    assert regions_why(model) is None
    new, _, sequential = Regional("blocks").prepared(model)
    assert not sequential
    compiled = [n for n, m in new.named_modules() if isinstance(m, CompiledBlock)]
    assert compiled == list(FOUND["mlp"][0])
    _check(model, x, loss_fn, pc.Compiled(regions="blocks"), exact=True)
