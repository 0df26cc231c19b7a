"""Every fragment kind on shared modules and tied weights: ``checkpoint`` with
``fragment_blocks`` (a number, sized on fake tensors, and names), ``sequence_fragments``
and ``levels=2``, alone and combined, on a module used at two places, a list holding one
block twice, a model calling one submodule twice (fx split), a block with training-mode
BatchNorm used twice, the tied GPT (its output layer is its token embedding) and the GPT
with one block at two places and an MLP shared between blocks and the head; the zoo U-Net's
stages in fragments with weights tied within a stage, across stages and with a mid block,
and with a whole block used twice; ``Compiled(regions="checkpoint")`` on a model with a
tied head and a block used twice.

Held to ``loss.backward()`` on a deep copy (which keeps the sharing): each parameter's
gradient within 1e-10 (float64) or 1e-4 (float32) of autograd's, relative to its largest
entry (floored at 1% of the model's largest gradient: a bias before BatchNorm has an
exactly zero gradient, which both sides compute as rounding noise); ``.grad`` None where
autograd leaves None; BatchNorm's running statistics as autograd leaves them (they advance
once per use); the user's Parameters, ties and module tree left as they were. Each case
also checks that the blocks asked for really ran in pieces (the fragments' autograd
function is recorded), so no case passes by running whole. Nothing here asserts a time.

Found while writing this: ``fragment_blocks=n`` on a model holding a module under two names
left the user's model with fake Parameters (the fake-tensor sizing swapped it twice) and
the step failed; and a module of one block reached under a second name outside it
(``self.extra = blocks[0].mlp``) became a block inside that block, which gave ``levels=2``
a wrong gradient and made ``trace=True`` fail. Both are fixed and tested below.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import zoo
from leangrad.engines._blocks import blocks
from leangrad.engines.checkpoint import _fragments
from leangrad.engines.checkpoint._offers import stage_modules
from leangrad.planner import _compile as pc
from leangrad.planner._plan import candidates
from shared_models import CallsTwice, SharedList, SharedMLP, beside_autograd

LossFn = Callable[[Any], torch.Tensor]
Case = tuple[nn.Module, torch.Tensor, LossFn]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
FLOOR = 1e-2  # of the model's largest gradient: the denominator of a ~zero gradient


def _square(y: torch.Tensor) -> torch.Tensor:
    return (y**2).sum()


@pytest.fixture
def pieces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, set[int]]]:
    """Per call of the fragments' autograd function: the dimension cut (0 the batch, 1 the
    sequence) and the ids of the parameters it differentiates."""
    seen: list[tuple[int, set[int]]] = []
    apply = _fragments._apply

    def recording(call: Any, tensors: list[torch.Tensor], params: list[nn.Parameter]) -> Any:
        seen.append((call.dim, {id(p) for p in params}))
        return apply(call, tensors, params)

    monkeypatch.setattr(_fragments, "_apply", recording)
    return seen


def _check(model: nn.Module, x: torch.Tensor, loss_fn: LossFn,
           **options: Any) -> leangrad.StepResult:  # fmt: skip
    """``checkpoint(**options)`` on ``model`` against autograd on a deep copy (module
    docstring); the step's result."""
    dt = next(model.parameters()).dtype
    eng = leangrad.engine("checkpoint", **options)
    res, want_loss, ref = beside_autograd(model, x, loss_fn,
                                          lambda: eng.backward(model, x, loss_fn))
    want = dict(ref.named_parameters(remove_duplicate=False))
    tol = TOL[dt]
    assert abs(res.loss.item() - want_loss.item()) <= tol * max(1.0, abs(want_loss.item()))
    top = max(float(p.grad.abs().max()) for p in want.values() if p.grad is not None)
    for n, p in model.named_parameters(remove_duplicate=False):
        g = want[n].grad
        assert (p.grad is None) == (g is None), (n, options)
        if g is not None:
            assert p.grad is not None
            err = float((p.grad - g).abs().max()) / max(float(g.abs().max()), FLOOR * top)
            assert err <= tol, (n, options, err)
    for (n, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        if b.is_floating_point():
            torch.testing.assert_close(b, b_ref, rtol=tol, atol=1e-12, msg=n)
        else:  # num_batches_tracked: once per use, as autograd
            assert torch.equal(b, b_ref), n
    return res


# ------------------------------------------------------------------------------ models
class Residual(nn.Module):
    """A block with a child of two parametrized layers (``sequence_fragments`` cuts it
    along the sequence) and, where asked, a layer its forward never uses (its ``.grad``
    stays None)."""

    def __init__(self, dim: int, *, unused: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.unused = nn.Linear(dim, dim) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _seq_twice(dt: torch.dtype) -> Case:
    """One residual block at two places of an ``nn.Sequential``."""
    torch.manual_seed(0)
    res = Residual(4, unused=True)
    model = nn.Sequential(res, nn.Tanh(), Residual(4), res, nn.Tanh()).to(dt)
    return model, torch.randn(6, 5, 4, dtype=dt), _square


def _shared_list(dt: torch.dtype) -> Case:
    torch.manual_seed(0)
    model = SharedList(Residual(4, unused=True), Residual(4), 4, 3)
    return model.to(dt), torch.randn(6, 5, 4, dtype=dt), _square


def _calls_twice(dt: torch.dtype) -> Case:
    torch.manual_seed(0)
    return CallsTwice().to(dt), torch.randn(6, 3, dtype=dt), _square


def _shared_batchnorm(dt: torch.dtype) -> Case:
    """A Linear and a training-mode BatchNorm each used twice (the statistics move twice)."""
    torch.manual_seed(0)
    lin, bn = nn.Linear(3, 3), nn.BatchNorm1d(3)
    model = nn.Sequential(lin, bn, nn.Tanh(), nn.Linear(3, 3), lin, bn, nn.Tanh()).to(dt)
    return model, torch.randn(6, 3, dtype=dt), _square


def _batchnorm_block_twice(dt: torch.dtype) -> Case:
    """A block holding training-mode BatchNorm at two places (fragments freeze its
    statistics per call; the running statistics advance once per use)."""
    torch.manual_seed(0)
    blk = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh())
    model = nn.Sequential(blk, nn.Linear(3, 3), blk, nn.Linear(3, 3)).to(dt)
    return model, torch.randn(6, 3, dtype=dt), _square


def _gpt(dt: torch.dtype, *, tie: bool = True, block_twice: bool = False) -> Case:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=12, dim=8, layers=3, heads=2, context=8).to(dt)
    if tie:
        model.head.weight = model.tok.weight
    if block_twice:
        model.blocks[2] = model.blocks[0]
    x, loss_fn = zoo.batch("gpt", model, 4, length=6)
    return model, x, loss_fn


def _shared_mlp(dt: torch.dtype) -> Case:
    model = SharedMLP(dt)
    x, loss_fn = zoo.batch("gpt", model.g, 4, length=6)
    return model, x, loss_fn


# name -> (builder, a block named in fragment_blocks=[...] (recomputed at both levels), the
# block the shared module is, whether the inputs have a sequence dimension)
MODELS: dict[str, tuple[Callable[[torch.dtype], Case], str, bool]] = {
    "seq_twice": (_seq_twice, "3", True),
    "shared_list": (_shared_list, "layers.2", True),
    "calls_twice": (_calls_twice, "submod_2", False),
    "shared_batchnorm": (_shared_batchnorm, "4", False),
    "batchnorm_block_twice": (_batchnorm_block_twice, "2", False),
    "tied_gpt": (lambda dt: _gpt(dt), "blocks.1", True),
    "gpt_block_twice": (lambda dt: _gpt(dt, block_twice=True), "blocks.2", True),
    "shared_mlp": (_shared_mlp, "g.blocks.1", True),
}
NAMED = "named"  # stands for the model's named block in OPTIONS
OPTIONS: list[dict[str, Any]] = [
    {"fragments": 2, "fragment_blocks": 1},
    {"fragments": 3, "fragment_blocks": 2},
    {"fragments": 2, "fragment_blocks": NAMED},
    {"fragments": 2, "fragment_blocks": 1, "levels": 2},
    {"fragments": 2, "fragment_blocks": NAMED, "levels": 2},
    {"fragments": 2, "fragment_blocks": 1, "trace": True},
    {"sequence_fragments": 2},
    {"sequence_fragments": 3, "levels": 2},
    {"fragments": 2, "fragment_blocks": 1, "sequence_fragments": 2},
    {"fragments": 2, "fragment_blocks": NAMED, "sequence_fragments": 2, "levels": 2},
]
FLOAT32 = [0, 4, 7, 9]  # the OPTIONS also run in float32


def _cases() -> list[Any]:
    out = []
    for name, (_, _, sequence) in MODELS.items():
        for i, options in enumerate(OPTIONS):
            if "sequence_fragments" in options and not sequence:
                continue  # nothing position-wise to cut: covered by the models that have it
            for dt in (torch.float64, torch.float32) if i in FLOAT32 else (torch.float64,):
                out.append(pytest.param(name, options, dt,
                                        id=f"{name}-{options}-{str(dt)[6:]}"))  # fmt: skip
    return out


@pytest.mark.parametrize(("kind", "options", "dt"), _cases())
def test_fragment_options_on_shared_modules_and_tied_weights(
    kind: str, options: dict[str, Any], dt: torch.dtype, pieces: list[tuple[int, set[int]]]
) -> None:
    build, named, _ = MODELS[kind]
    model, x, loss_fn = build(dt)
    options = {k: [named] if v == NAMED else v for k, v in options.items()}
    weights = [(m, id(m.weight)) for m in model.modules()
               if isinstance(getattr(m, "weight", None), nn.Parameter)]  # fmt: skip
    res = _check(model, x, loss_fn, **options)
    assert all(id(m.weight) == w for m, w in weights), "a tie was broken"
    chosen = options.get("fragment_blocks")
    if chosen is not None:  # the blocks chosen ran in pieces of the batch, the others whole
        n = chosen if isinstance(chosen, int) else len(chosen)
        assert len(res.info["fragmented"]) == n, res.info
        assert not set(res.info["fragmented"]) & set(res.info["whole"]), res.info
        assert all("fragment_blocks" in why or "largest" in why
                   for why in res.info["whole"].values()), res.info  # fmt: skip
        assert any(d == 0 for d, _ in pieces), "no block ran in fragments of the batch"
        if not isinstance(chosen, int):
            assert res.info["fragmented"] == chosen
            if named in dict(model.named_modules()):  # (not a piece of an fx split)
                own = {id(p) for p in model.get_submodule(named).parameters()}
                assert any(d == 0 and own <= ids for d, ids in pieces)
    if "sequence_fragments" in options:  # the blocks' MLPs ran in pieces of the sequence
        assert any(d == 1 for d, _ in pieces), "nothing ran in pieces of the sequence"
    if options.get("levels") == 2:
        assert res.info["levels"] == 2 and res.info["dropped"] > 0 and res.info["rebuilt"] > 0


def test_a_block_used_twice_is_sized_once_per_call_and_the_model_left_real() -> None:
    """``fragment_blocks=n`` sizes the blocks on fake tensors. A module registered under two
    names (``nn.Sequential(res, act, other, res, act)``) was swapped to its fake twice by
    ``torch.func.functional_call``, which then put the first fake back: the user's model
    kept fake Parameters and the step failed. Now every name of it gets its largest call's
    bytes, and the model holds its own tensors."""
    from leangrad.engines.checkpoint._engine import _Segment
    from leangrad.engines.checkpoint._segments import saved_inside

    model, x, _ = _seq_twice(torch.float64)
    before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    mods = {n: model.get_submodule(n) for n in ("0", "2", "3")}
    sizes = saved_inside(model, _Segment(list(model)), mods, (x,))
    assert {n: p for n, p in model.named_parameters(remove_duplicate=False)} == before
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert sizes["0"] == sizes["3"] == sizes["2"] > 0  # the same block at each place


SHARED_MLP_BLOCKS = ("g.blocks.0", "g.blocks.1", "g.blocks.2")


@pytest.mark.parametrize("options", [{"levels": 2}, {"trace": True}, {"levels": 2, "trace": True},
                                     {"fragments": 2, "levels": 2}], ids=str)  # fmt: skip
def test_a_block_reached_inside_another_by_a_second_name_is_left_to_it(
    options: dict[str, Any],
) -> None:
    """``self.extra = blocks[0].mlp`` makes the finder list ``extra.0`` .. ``extra.2`` as
    blocks too, and checkpointing them in place wrapped them inside ``blocks.0``: nested
    block calls gave ``levels=2`` a wrong gradient (``pos`` 61% off) and made ``trace=True``
    fail. They are now left to the block holding them, and the step is exact."""
    model, x, loss_fn = _shared_mlp(torch.float64)
    found = leangrad.engine("checkpoint").blocks(model)
    assert found.names == SHARED_MLP_BLOCKS
    assert "left to the blocks holding them: extra.0 (in g.blocks.0)" in found.how
    res = _check(model, x, loss_fn, **options)
    assert res.info["checkpointed"] == len(SHARED_MLP_BLOCKS)


def test_two_levels_do_not_chain_a_block_call_nested_in_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chain's own guard, with the nested blocks left in (as before the finder's
    fix): a block called inside another is no link of the chain, so no boundary is
    rebuilt from it, and the gradient is exact."""
    from leangrad.engines import _blocks

    monkeypatch.setattr(_blocks, "outermost", lambda _model, found, given: found)
    model, x, loss_fn = _shared_mlp(torch.float64)
    assert len(leangrad.engine("checkpoint").blocks(model)) == 6  # extra.0 .. 2 kept
    res = _check(model, x, loss_fn, levels=2)
    assert res.info["dropped"] > 0


def test_blocks_given_one_inside_another_by_a_second_name() -> None:
    """Named by ``blocks=``: refused where the inner block's slot is inside the outer
    block (``extra.0``); accepted where only the module is (``extra`` itself, whose slot is
    the model's: its wrapper runs beside the blocks, not inside one), and exact."""
    from leangrad.engines.checkpoint._engine import ALIASED_BLOCKS

    model, x, loss_fn = _shared_mlp(torch.float64)
    with pytest.raises(leangrad.EngineInputError) as err:
        leangrad.engine("checkpoint", blocks=["g.blocks.1", "extra.0"]).blocks(model)
    assert str(err.value) == ALIASED_BLOCKS.format(inner="extra.0", outer="g.blocks.1")
    res = _check(model, x, loss_fn, blocks=["g.blocks", "extra"], levels=2, fragments=2)
    assert res.info["checkpointed"] == 4 and res.info["whole"] == {}
    # the planner's offers name no block inside another ("extra" itself is offered as a
    # stem beside the blocks: its slot is the model's, accepted above)
    offers = [o["blocks"] for n, o in candidates(model, exact=True)
              if n == "checkpoint" and "blocks" in o]  # fmt: skip
    assert offers and not any(b.startswith("extra.") for names in offers for b in names)


# ------------------------------------------------------------------ U-Net stages, tied
STAGES = ["down.0", "down.1", "down.2", "mid.0", "mid.1", "mid.2", "up.0", "up.1", "up.2", "out"]


def _unet(tie: str, dt: torch.dtype = torch.float64) -> Case:
    """The zoo U-Net of tests/engines/test_unet_fragments.py with one weight tied or one
    block shared."""
    torch.manual_seed(0)
    model = zoo.unet(image=16, widths=(8, 16, 32), groups=4, attention_at=(32,), head_dim=8)
    model = model.to(dt)
    down = [m for m in model.down if isinstance(m, zoo.UNetDown)]
    up = [m for m in model.up if isinstance(m, zoo.UNetUp)]
    mid = model.mid
    if tie == "across_stages":  # an (8, 8, 3, 3) conv of the first down and last up stage
        up[2].blocks[0].conv2.weight = down[0].blocks[0].conv2.weight
    elif tie == "within_a_stage":
        down[0].blocks[0].conv2.weight = down[0].blocks[0].conv1.weight
    elif tie == "stage_and_mid_block":
        mid[0].conv1.weight = up[0].blocks[0].conv2.weight
    elif tie == "mid_block_twice":
        mid[2] = mid[0]
    elif tie == "attention_in_two_stages":
        up[0].blocks[1] = down[2].blocks[1]
    x, loss_fn = zoo.batch("unet", model, 4, image=16)
    return model, x, loss_fn


UNET_TIES = ["across_stages", "within_a_stage", "stage_and_mid_block", "mid_block_twice",
             "attention_in_two_stages"]  # fmt: skip
UNET_OPTIONS: list[dict[str, Any]] = [
    {"fragments": 2},
    {"fragments": 2, "levels": 2},
    {"fragments": 2, "fragment_blocks": 2},
    {"fragments": 2, "fragment_blocks": ["down.0", "mid.0", "mid.2", "up.2"], "levels": 2},
]


@pytest.mark.parametrize("options", UNET_OPTIONS, ids=str)
@pytest.mark.parametrize("tie", UNET_TIES)
def test_unet_stages_in_fragments_with_a_tied_weight_or_a_shared_block(
    tie: str, options: dict[str, Any], pieces: list[tuple[int, set[int]]]
) -> None:
    """Each stage's parameters are its own (a weight tied into another stage, or a block
    held by two, is in both), so the stage's fragments hand its gradient on and autograd
    adds the two uses: exact, no stage left whole but those ``fragment_blocks`` leaves."""
    model, x, loss_fn = _unet(tie)
    assert stage_modules(model, blocks(model)) == STAGES[:-1]  # sharing keeps the stages
    res = _check(model, x, loss_fn, blocks=STAGES, **options)
    chosen = options.get("fragment_blocks")
    if chosen is None:
        assert res.info["whole"] == {}
        assert len(pieces) >= len(STAGES)
    else:
        n = chosen if isinstance(chosen, int) else len(chosen)
        assert len(res.info["fragmented"]) == n and len(res.info["whole"]) == len(STAGES) - n


def test_unet_with_a_tied_weight_in_float32_and_offered_by_the_planner() -> None:
    model, x, loss_fn = _unet("across_stages", torch.float32)
    res = _check(model, x, loss_fn, blocks=STAGES, fragments=4, levels=2)
    assert res.info["whole"] == {}
    got = candidates(model, exact=True, loss_fn=loss_fn)
    assert ("checkpoint", {"blocks": STAGES, "fragments": 4}) in got


# ------------------------------------------------------------- regional compilation
class TiedLM(nn.Module):
    """Embedding, a block at two places of a ModuleList, an output layer tied to the
    embedding: the smallest model with both kinds of sharing (its block compiles fast)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 6)
        blk = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.blocks = nn.ModuleList([blk, nn.Sequential(nn.Linear(6, 6), nn.Tanh()), blk])
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.slow
def test_regional_compile_under_checkpoint_with_a_tied_head_and_a_block_twice() -> None:
    """One compile (~25 s on 2 cores): ``Compiled(regions="checkpoint")`` compiles each
    block in a copy sharing the model's tensors; the block at two places and the tied head
    get autograd's gradients (inductor reorders float64 arithmetic: 1e-10 holds), the tie
    and the model's modules are kept, ``on_grad`` names each parameter once."""
    torch.manual_seed(0)
    model = TiedLM().double()
    x = torch.randint(0, 10, (3, 5))
    y = torch.randint(0, 10, (15,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y)

    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    modules = list(model.modules())
    seen: list[str] = []
    eng = pc.Compiled(regions="checkpoint")
    res = eng.backward(model, x, loss_fn, on_grad=lambda n, _p: seen.append(n))
    assert res.info["checkpointed"] == 3
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())
    assert model.head.weight is model.tok.weight and model.blocks[2] is model.blocks[0]
    assert list(model.modules()) == modules
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, n
        assert float((p.grad - q.grad).abs().max() / q.grad.abs().max()) <= 1e-10, n
