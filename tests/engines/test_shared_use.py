"""Modules used at two places of one model, and tied weights (classes 1, 2, 6).

- Class 1: a module listed twice (``nn.Sequential(lin, nn.Tanh(), lin)``) is two blocks;
  checkpointing (every option) runs both uses, and block discovery resolves every name.
- Class 2: the forward-mode engines leave the user's Parameters in place (``functional_call``
  swapped a module registered under two names twice and put a stand-in back).
- Class 6: ``group_norm`` under the forward-mode engines, where ``vmap`` hands it a
  non-contiguous (or channels-last) input: the engine runs and its gradient is autograd's.
- Tied weights (GPT-2's output layer tied to its token embedding) stay exact under
  checkpoint (every option), forward, projforward (it runs; the estimate lands on the
  Parameter) and backprop.

Tolerances: exact engines 1e-10 relative in float64 (summation order only), 1e-4 in
float32; buffers 1e-12 in float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import leangrad
from leangrad import layers as L
from leangrad import zoo
from leangrad.engines import engine_class
from shared_models import CallsTwice, SharedList

LossFn = Callable[[Any], torch.Tensor]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _square(y: torch.Tensor) -> torch.Tensor:
    return (y**2).sum()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _check(
    model: nn.Module,
    x: torch.Tensor,
    loss_fn: LossFn,
    name: str,
    *,
    exact: bool | None = None,
    **options: Any,
) -> None:
    """``engine(name, **options)`` on ``model`` against ``loss_fn(model(x)).backward()`` on a
    deep copy (which keeps the sharing): loss, every ``.grad`` (None-ness and value), the
    buffers, and the user's Parameter objects and module tree left as they were."""
    dt = next(model.parameters()).dtype
    model.zero_grad(set_to_none=True)  # (deepcopy does not copy a Parameter's .grad)
    ref = copy.deepcopy(model)
    want_loss = loss_fn(ref(x))
    want_loss.backward()
    want = dict(ref.named_parameters(remove_duplicate=False))
    params = list(model.named_parameters(remove_duplicate=False))
    mods = list(model.named_modules(remove_duplicate=False))
    eng = leangrad.engine(name, **options)
    exact = engine_class(name.split("+")[0]).exact if exact is None else exact
    res = eng.backward(model, x, loss_fn)
    assert [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)] == [
        (n, id(p)) for n, p in params
    ], "the engine replaced a Parameter of the user's model"
    assert [(n, id(m)) for n, m in model.named_modules(remove_duplicate=False)] == [
        (n, id(m)) for n, m in mods
    ], "the engine changed the user's module tree"
    for n, p in model.named_parameters(remove_duplicate=False):
        assert isinstance(p, nn.Parameter), n
        assert (p.grad is None) == (want[n].grad is None), n
    if exact:
        assert _rel(res.loss, want_loss.detach()) <= TOL[dt], (res.loss, want_loss)
        for n, p in model.named_parameters(remove_duplicate=False):
            g = want[n].grad
            if g is not None:
                assert p.grad is not None
                assert _rel(p.grad, g) <= TOL[dt], (name, options, n, _rel(p.grad, g))
    for (n, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        if b.is_floating_point():
            assert _rel(b, b_ref) <= max(TOL[dt], 1e-12), n
        else:
            assert torch.equal(b, b_ref), n


# ---------------------------------------------------------------------- shared modules
def _flat(dt: torch.dtype) -> nn.Module:
    lin = nn.Linear(3, 3)
    return nn.Sequential(lin, nn.Tanh(), lin).to(dt)


def _nested(dt: torch.dtype) -> nn.Module:
    lin = nn.Linear(3, 3)
    return nn.Sequential(nn.Sequential(lin, nn.Tanh()), lin).to(dt)


def _shared_batchnorm(dt: torch.dtype) -> nn.Module:
    """A shared Linear and a shared training-mode BatchNorm (its statistics move twice)."""
    lin, bn = nn.Linear(3, 3), nn.BatchNorm1d(3)
    return nn.Sequential(lin, bn, nn.Tanh(), nn.Linear(3, 3), lin, bn, nn.Tanh()).to(dt)


def _shared_list() -> SharedList:
    return SharedList(nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
                      nn.Sequential(nn.Linear(3, 3), nn.Tanh()), 3, 2)  # fmt: skip


SEQUENTIAL: dict[str, Callable[[torch.dtype], nn.Module]] = {
    "flat": _flat,
    "nested": _nested,
    "shared_batchnorm": _shared_batchnorm,
}
CHECKPOINT_OPTIONS: list[dict[str, Any]] = [
    {},
    {"segments": 2},
    {"segments": "sqrt"},
    {"segments": "auto"},
    {"trace": True},
    {"segments": 2, "trace": True},
    {"blocks": ["0"]},
    {"levels": 2},
    {"fragments": 2},
    {"levels": 2, "fragments": 2},
]


@pytest.mark.parametrize("dt", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("options", CHECKPOINT_OPTIONS, ids=str)
@pytest.mark.parametrize("kind", list(SEQUENTIAL))
def test_checkpoint_runs_every_use_of_a_shared_module(
    kind: str, options: dict[str, Any], dt: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = SEQUENTIAL[kind](dt)
    _check(model, torch.randn(4, 3, dtype=dt), _square, "checkpoint", **options)


@pytest.mark.parametrize(
    "name", ["backprop", "forward", "checkpoint+fad", "checkpoint+bits", "checkpoint+rad"]
)
@pytest.mark.parametrize("kind", list(SEQUENTIAL))
def test_other_engines_on_a_shared_module(kind: str, name: str) -> None:
    torch.manual_seed(0)
    model = SEQUENTIAL[kind](torch.float64)
    options = {"fraction": 1.0, "seed": 0} if name.endswith("rad") else {}
    _check(model, torch.randn(4, 3, dtype=torch.float64), _square, name, **options)


@pytest.mark.parametrize(
    "options",
    [{}, {"trace": True}, {"blocks": ["a"]}, {"levels": 2}, {"fragments": 2},
     {"levels": 2, "fragments": 2}],
    ids=str,
)  # fmt: skip
def test_checkpoint_on_a_model_calling_a_module_twice(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = CallsTwice().double()
    _check(model, torch.randn(4, 3, dtype=torch.float64), _square, "checkpoint", **options)


@pytest.mark.parametrize(
    ("name", "options"),
    [("checkpoint", {}), ("checkpoint", {"trace": True}), ("checkpoint", {"blocks": ["layers"]}),
     ("checkpoint", {"levels": 2}), ("checkpoint", {"fragments": 2}),
     ("checkpoint", {"levels": 2, "fragments": 2}), ("checkpoint+fad", {}), ("forward", {})],
    ids=str,
)  # fmt: skip
def test_a_list_holding_a_block_twice(name: str, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = _shared_list().double()
    _check(model, torch.randn(4, 3, dtype=torch.float64), _square, name, **options)


def test_blocks_and_explain_name_every_use() -> None:
    lin = nn.Linear(3, 3)
    flat = nn.Sequential(lin, nn.Tanh(), lin)
    found = leangrad.blocks(flat)
    assert found.names == ("0", "1", "2")
    assert found.modules["2"] is lin
    nested = nn.Sequential(nn.Sequential(lin, nn.Tanh()), lin)
    found = leangrad.blocks(nested)
    assert found.names == ("0", "1") and found.modules["1"] is lin
    assert leangrad.blocks(nested, names=["1"]).modules["1"] is lin
    text = str(leangrad.explain("checkpoint", nested))
    assert "2 blocks (nn.Sequential children)" in text
    text = str(leangrad.explain(leangrad.engine("checkpoint", trace=True), flat))
    assert "3 blocks" in text
    assert "fad on 1" in str(leangrad.explain("checkpoint+fad", nested))
    # a container reached by two names holds each block once
    shared = leangrad.blocks(_shared_list())
    assert shared.names == ("layers.0", "layers.1", "layers.2")


def test_checkpoint_blocks_listing_a_layer_twice() -> None:
    """A leangrad Chain holding one layer twice: ``checkpoint_blocks()`` lists it at both
    places; each gets its own name."""
    torch.manual_seed(0)
    act = L.LeakyReLU(0.5)
    lin = L.SubmersiveLinear(3, 3)
    chain = L.Chain(lin, act, lin).double()
    found = leangrad.blocks(chain)
    assert len(found.names) == len(set(found.names)) == 5
    assert found.modules[found.names[1]] is found.modules[found.names[3]] is lin
    for options in ({}, {"segments": 2}, {"trace": True}):
        _check(chain, torch.randn(4, 3, dtype=torch.float64), _square, "checkpoint", **options)


def test_time_chunks_with_a_shared_recurrent_module() -> None:
    class First(nn.Module):
        def forward(self, out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return out[0]

    torch.manual_seed(0)
    gru = nn.GRU(3, 3, batch_first=True)
    model = nn.Sequential(gru, First(), nn.Linear(3, 3), gru, First()).double()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    for options in ({"time_chunks": 3}, {"time_chunks": 2, "trace": True}):
        _check(model, x, _square, "checkpoint", **options)


@pytest.mark.parametrize("name", ["forward", "projforward"])
@pytest.mark.parametrize("kind", ["flat", "nested"])
def test_forward_mode_keeps_the_users_parameters(kind: str, name: str) -> None:
    """Class 2: ``lin.weight`` stays the user's Parameter and gets its ``.grad``."""
    torch.manual_seed(0)
    model = SEQUENTIAL[kind](torch.float64)
    lin = model[-1]
    weight, bias = lin.weight, lin.bias
    options = {"samples": 3, "seed": 0} if name == "projforward" else {}
    _check(model, torch.randn(4, 3, dtype=torch.float64), _square, name, **options)
    assert lin.weight is weight and lin.bias is bias
    assert weight.grad is not None and bias.grad is not None


def test_projforward_finds_a_tied_weight_used_only_through_its_second_module() -> None:
    class SecondOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(x)

    torch.manual_seed(0)
    model = SecondOnly().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    _check(model, x, _square, "projforward", samples=2, seed=0)
    assert model.a.weight.grad is not None
    _check(model, x, _square, "forward")


# ------------------------------------------------------- class 6: group_norm under vmap
def _conv_then_groupnorm(dt: torch.dtype) -> nn.Module:
    """The issue's case: a conv whose (masked) weight vmap batches, then a coupling that
    splits the channels and normalises one half: GroupNorm gets a non-contiguous input."""
    return L.Chain(L.SubmersiveConv2d(4, 4, 1), L.AdditiveCoupling(nn.GroupNorm(1, 2))).to(dt)


def _stem_then_groupnorm(dt: torch.dtype) -> nn.Module:
    return L.Chain(
        L.AdditiveCoupling(nn.Sequential(nn.GroupNorm(2, 2), nn.Conv2d(2, 2, 3, padding=1))),
        stem=nn.Conv2d(2, 4, 3, padding=1),
        head=nn.Flatten(),
    ).to(dt)


def _plain_groupnorm(dt: torch.dtype) -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh()).to(dt)


GROUPNORM = {"conv_groupnorm": (_conv_then_groupnorm, 4), "stem": (_stem_then_groupnorm, 2),
             "plain": (_plain_groupnorm, 2)}  # fmt: skip


@pytest.mark.parametrize("dt", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", list(GROUPNORM))
def test_forward_engine_through_groupnorm(
    kind: str, batch: int, channels_last: bool, dt: torch.dtype
) -> None:
    torch.manual_seed(0)
    build, c = GROUPNORM[kind]
    model = build(dt)
    x = torch.randn(batch, c, 6, 6, dtype=dt)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    _check(model, x, _square, "forward")
    _check(model, x, _square, "projforward", samples=2, seed=0)


# ------------------------------------------------------------------------ tied weights
def _tied_gpt(dt: torch.dtype = torch.float64) -> tuple[nn.Module, torch.Tensor, LossFn]:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=12, dim=8, layers=2, heads=2, context=8).to(dt)
    model.head.weight = model.tok.weight
    x, loss_fn = zoo.batch("gpt", model, 2, length=6)
    return model, x, loss_fn


def _tied_sequential(dt: torch.dtype) -> tuple[nn.Module, torch.Tensor, LossFn]:
    """Embedding -> ... -> Linear with the output weight tied to the embedding, as one
    nn.Sequential (so every segments= option applies)."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Tanh(), nn.Linear(6, 6), nn.GELU(), nn.LayerNorm(6), head)
    model = model.to(dt)
    x = torch.randint(0, 10, (3, 5))
    y = torch.randint(0, 10, (3 * 5,))
    return model, x, lambda out: nn.functional.cross_entropy(out.flatten(0, 1), y)


GPT_RUNS: list[tuple[str, dict[str, Any]]] = [
    ("backprop", {}),
    ("checkpoint", {}),
    ("checkpoint", {"trace": True}),
    ("checkpoint", {"blocks": ["blocks"]}),
    ("checkpoint", {"blocks": ["tok", "blocks.1", "head"]}),
    ("checkpoint+fad", {}),
    ("forward", {"chunk_size": 64}),
]


@pytest.mark.parametrize(("name", "options"), GPT_RUNS, ids=str)
def test_tied_gpt(name: str, options: dict[str, Any]) -> None:
    model, x, loss_fn = _tied_gpt()
    _check(model, x, loss_fn, name, **options)
    assert model.head.weight is model.tok.weight


def test_tied_gpt_projforward_runs_and_lands_on_the_parameter() -> None:
    model, x, loss_fn = _tied_gpt()
    weight = model.tok.weight
    _check(model, x, loss_fn, "projforward", samples=3, seed=0)
    assert model.head.weight is weight and model.tok.weight is weight
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize("dt", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("options", [*CHECKPOINT_OPTIONS[:-1], {"blocks": ["0", "5"]}], ids=str)
def test_tied_sequential_checkpoint(options: dict[str, Any], dt: torch.dtype) -> None:
    model, x, loss_fn = _tied_sequential(dt)
    _check(model, x, loss_fn, "checkpoint", **options)
    assert model[-1].weight is model[0].weight


@pytest.mark.parametrize("name", ["forward", "backprop", "checkpoint+bits"])
def test_tied_sequential_other_engines(name: str) -> None:
    model, x, loss_fn = _tied_sequential(torch.float64)
    _check(model, x, loss_fn, name)
    assert model[-1].weight is model[0].weight


def test_coupling_check_keeps_a_shared_module_in_place() -> None:
    """``AdditiveCoupling.check`` runs F with stand-in tensors (``functional_call``): a module
    F holds twice must get its own Parameters back, not the meta stand-ins."""
    torch.manual_seed(0)
    lin = nn.Linear(2, 2).double()
    weight = lin.weight
    coupling = L.AdditiveCoupling(nn.Sequential(lin, nn.Tanh(), lin))
    coupling.check(torch.randn(3, 4, dtype=torch.float64))
    assert lin.weight is weight and lin.weight.device.type == "cpu"
    chain = L.Chain(coupling)
    x = torch.randn(3, 4, dtype=torch.float64)
    for name in ("backprop", "checkpoint", "forward"):
        _check(chain, x, _square, name)


@pytest.mark.parametrize("options", [{}, {"segments": 2}, {"trace": True}], ids=str)
def test_moving_a_shared_module_is_seen(options: dict[str, Any]) -> None:
    """An engine prepares a model once; putting a module already in the model at another
    place changes no set of objects, but changes the blocks: the engine sees it."""
    torch.manual_seed(0)
    lin, act = nn.Linear(3, 3).double(), nn.Tanh()
    model = nn.Sequential(lin, act, lin, act)
    x = torch.randn(4, 3, dtype=torch.float64)
    eng = leangrad.engine("checkpoint", **options)
    eng.backward(model, x, _square)
    model[2] = act  # now lin, tanh, tanh, tanh
    model.zero_grad(set_to_none=True)
    want = _square(copy.deepcopy(model)(x))
    assert _rel(eng.backward(model, x, _square).loss, want.detach()) <= TOL[torch.float64]
