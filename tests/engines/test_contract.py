"""The contract of every engine: ``engine.backward(model, inputs, loss_fn)`` leaves the
model, its buffers, the RNG streams, the inputs and every ``.grad`` exactly as
``loss_fn(model(*inputs)).backward()`` would — or raises an error naming the condition.

One parametrized test over every registered engine (and its option variants) × every
model it supports, each model in training mode with BatchNorm running statistics, dropout
and a parameter the loss never uses. A new engine gets this test for free: it is listed
by ``leangrad.available()``.

Tolerances: exact engines 1e-10 relative (float64; they differ only in summation order);
buffers to 1e-12 (counters exactly: one update per step) and RNG states exactly.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from fuzz_models import MOONWALK_VARIANTS
from helpers import StepHead
from leangrad import _errors as E
from leangrad import models
from leangrad.engines import engine_class
from leangrad.highway import GRULayer, HighwayNet
from leangrad.layers import AdditiveCoupling, LeakyReLU, SpaceToDepth, Tanh
from leangrad.loss import per_example

DT = torch.float64
TOL = 1e-10

# Option variants worth a contract check of their own (different code paths).
VARIANTS: dict[str, list[dict[str, object]]] = {
    "checkpoint": [{}, {"segments": 2}, {"trace": True}, {"fragments": 2},
                   {"fragments": 3, "sequence_fragments": 2}, {"levels": 2},
                   {"levels": 2, "fragments": 2}, {"fragments": 2, "fragment_blocks": 1}],
    "forward": [{"chunk_size": 7}],
    "projforward": [{"samples": 3, "chunk_size": 2, "seed": 0}],
    "moonwalk": MOONWALK_VARIANTS,
    "highway": [{"k": 10}],  # k >= L - 1: exact (Theorem 2)
    # Seeded: rad's samples come from a generator of its own, so the global stream must
    # advance as under autograd (seed=None draws them from the global stream, as
    # dropout does: documented). fraction=1 is exact.
    "rad": [{"fraction": 0.5, "seed": 0}, {"fraction": 1.0, "seed": 0}],
    "fad": [{}, {"mode": "eager"}],
}


def _stem() -> nn.Module:
    """A stem with a trainable conv, training-mode BatchNorm and dropout."""
    return nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Dropout(0.25))


def _generic() -> tuple[nn.Module, tuple[int, ...]]:
    m = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3),
    )  # fmt: skip
    return m, (5, 4)


def _plain() -> tuple[nn.Module, tuple[int, ...]]:
    """No layer couples the examples or draws: what gradient accumulation takes."""
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
    return m, (5, 4)


def _subcnn() -> tuple[nn.Module, tuple[int, ...]]:
    m = models.submersive_cnn(2, 3, depth=2, classes=3)
    m.stem = _stem()
    return m, (3, 2, 8, 8)


def _subcnn_paramfree_stem() -> tuple[nn.Module, tuple[int, ...]]:
    """Moonwalk's h1-seed path: a stem without trainable parameters (but with statistics)."""
    m = models.submersive_cnn(2, 3, depth=2, classes=3)
    m.stem = nn.Sequential(models.RepeatChannels(3), nn.BatchNorm2d(3, affine=False))
    return m, (3, 2, 8, 8)


def _revchain() -> tuple[nn.Module, tuple[int, ...]]:
    def f() -> nn.Module:
        return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 1))

    m = leangrad.Chain(
        AdditiveCoupling(f()), LeakyReLU(0.2), SpaceToDepth(2),
        AdditiveCoupling(nn.Sequential(nn.Conv2d(8, 8, 1), nn.Tanh())), Tanh(),
        stem=nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.Dropout(0.25)),
        head=nn.Sequential(nn.Flatten(), nn.Linear(16 * 2 * 2, 3)),
    )  # fmt: skip
    return m, (3, 2, 4, 4)


def _highway() -> tuple[nn.Module, tuple[int, ...]]:
    stem = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.25))
    return HighwayNet(stem, [GRULayer(5, 5)], StepHead()), (6, 2, 4)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[int, ...]]]] = {
    "generic": _generic,
    "plain": _plain,
    "subcnn": _subcnn,
    "subcnn_paramfree_stem": _subcnn_paramfree_stem,
    "revchain": _revchain,
    "highway": _highway,
}


def _build(kind: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, Callable]:  # type: ignore[type-arg]
    torch.manual_seed(seed)
    model, shape = MODELS[kind]()
    model = model.to(DT).train()
    # A parameter the loss never uses: autograd leaves its .grad None.
    model.register_parameter("unused", nn.Parameter(torch.randn(3, dtype=DT)))
    x = torch.randn(*shape, dtype=DT)
    n_out = x.shape[0] * (x.shape[1] if kind == "highway" else 1)
    y = torch.randint(0, 3, (n_out,))
    if kind == "highway":  # time-major: rows of the output are not the batch's examples
        return model, x, lambda out: F.cross_entropy(out, y)
    return model, x, per_example(F.cross_entropy, y)


# Compositions (base engine + transforms) keep the same contract.
COMBOS: list[tuple[str, dict[str, object]]] = [
    ("checkpoint+fad", {"segments": 2}),
    ("checkpoint+rad", {"fraction": 1.0, "seed": 0}),
    ("checkpoint+rad", {"fraction": 0.5, "seed": 0}),
    ("moonwalk+fad", {}),
    ("moonwalk+rad", {"fraction": 1.0, "seed": 0}),
    ("revbackprop+fad", {}),
    ("highway+fad", {"k": 10}),
    ("fad+rad", {"fraction": 1.0, "seed": 0}),
    ("checkpoint+bits", {"segments": 2}),
    ("moonwalk+bits", {}),
    ("fad+bits", {}),
    ("checkpoint+accumulate", {"micro_batches": 3}),
]


def _configs() -> list[object]:
    out = []
    named = [(n, o) for n in leangrad.available() for o in VARIANTS.get(n, [{}])]
    for name, opts in named + COMBOS:
        for kind in MODELS:
            if kind == "highway" and "accumulate" in name:
                continue  # time-major: its loss cannot be declared per example
            model, _, _ = _build(kind)
            if leangrad.engine(name, **opts).supports(model) is None:
                label = ",".join(f"{k}={v}" for k, v in opts.items())
                out.append(pytest.param(name, opts, kind, id=f"{name}({label})-{kind}"))
    return out


CONFIGS = _configs()


def test_every_engine_and_combination_has_a_contract_case() -> None:
    assert {p.values[0] for p in CONFIGS} == set(leangrad.available()) | {c for c, _ in COMBOS}


def _exact(name: str, opts: dict[str, object]) -> bool:
    parts = name.split("+")
    exact = True
    for part in parts:
        if part == "highway":
            exact &= opts.get("k", 0) >= 5
        elif part == "rad":
            exact &= opts.get("fraction") == 1.0
        elif part not in ("fad", "bits"):
            exact &= engine_class(part).exact
    return exact


def _reference(model: nn.Module, x: torch.Tensor, loss_fn: Callable, seed: int):  # type: ignore[no-untyped-def, type-arg]
    """What plain autograd does: grads (None kept), buffers, RNG state, input grad."""
    torch.manual_seed(seed)
    loss = loss_fn(model(x))
    loss.backward()
    return (
        {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        {n: b.clone() for n, b in model.named_buffers()},
        torch.get_rng_state(),
        None if x.grad is None else x.grad.clone(),
    )


def _prefill(model: nn.Module) -> None:
    """One used parameter starts with a gradient (accumulation), the rest with None."""
    first = next(model.parameters())
    first.grad = torch.full_like(first, 0.5)


@pytest.mark.parametrize(("name", "opts", "kind"), CONFIGS)
@pytest.mark.parametrize("input_grad", [False, True], ids=["x", "x_requires_grad"])
def test_engine_keeps_the_backward_contract(
    name: str, opts: dict[str, object], kind: str, input_grad: bool
) -> None:
    check_backward_contract(name, opts, kind, input_grad=input_grad)


def check_backward_contract(name: str, opts: dict[str, object], kind: str, *,
                            input_grad: bool) -> None:  # fmt: skip
    """One engine's step on the ``kind`` model against autograd's: the same gradients
    (``None`` kept, accumulation), buffers, RNG stream and input gradient."""
    model, x, loss_fn = _build(kind)
    ref_model = copy.deepcopy(model)
    _prefill(model)
    _prefill(ref_model)
    xr = x.clone().requires_grad_(input_grad)
    ref_grads, ref_bufs, ref_rng, ref_xgrad = _reference(ref_model, xr, loss_fn, seed=7)

    xe = x.clone().requires_grad_(input_grad)
    eng = leangrad.engine(name, **opts)
    torch.manual_seed(7)
    if input_grad and not eng.input_gradients:
        with pytest.raises(E.EngineInputError, match="input gradient"):
            eng.backward(model, xe, loss_fn)
        return
    eng.backward(model, xe, loss_fn)

    for n, p in model.named_parameters():
        ref = ref_grads[n]
        assert (p.grad is None) == (ref is None), f"{n}: .grad None-ness differs from autograd"
        if ref is not None and _exact(name, opts):
            torch.testing.assert_close(p.grad, ref, rtol=TOL, atol=TOL, msg=n)
    for n, b in model.named_buffers():
        # Integer counters equal; statistics equal up to the reduction order of a
        # vmapped forward (forward-mode engines), ~1e-16.
        torch.testing.assert_close(b, ref_bufs[n], rtol=1e-12, atol=1e-14, msg=n)
    assert torch.equal(torch.get_rng_state(), ref_rng), "the RNG stream advanced differently"
    if input_grad:
        assert xe.grad is not None, "an input with requires_grad=True got no .grad"
        if _exact(name, opts):
            torch.testing.assert_close(xe.grad, ref_xgrad, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(("name", "opts", "kind"), CONFIGS)
@pytest.mark.parametrize(
    "loss_fn",
    [lambda out: out.detach().sum(), lambda out: torch.tensor(1.0, dtype=DT)],
    ids=["detached", "constant"],
)
def test_loss_independent_of_the_model_raises(
    name: str, opts: dict[str, object], kind: str, loss_fn: Callable  # type: ignore[type-arg]
) -> None:
    """The same error, for every engine, and nothing written to any .grad or buffer."""
    model, x, _ = _build(kind)
    if kind != "highway":  # declared per example, as _build's losses are
        fn = loss_fn
        loss_fn = per_example(lambda out, _: fn(out), torch.zeros(x.shape[0]))
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(E.EngineInputError, match=re.escape(E.LOSS_NO_GRAD)):
        leangrad.engine(name, **opts).backward(model, x, loss_fn)
    assert all(p.grad is None for p in model.parameters())
    del bufs  # buffers may have advanced: the forward ran before the loss was seen


@pytest.mark.parametrize(("name", "opts", "kind"), CONFIGS)
def test_empty_batch_is_refused(name: str, opts: dict[str, object], kind: str) -> None:
    model, x, loss_fn = _build(kind)
    empty = x[:, :0] if kind == "highway" else x[:0]
    with pytest.raises(E.EngineInputError, match="empty batch"):
        leangrad.engine(name, **opts).backward(model, empty, loss_fn)


@pytest.mark.parametrize(("name", "opts", "kind"), CONFIGS)
def test_non_finite_inputs_give_autograd_result(
    name: str, opts: dict[str, object], kind: str
) -> None:
    """A NaN in the input: NaN exactly where autograd has NaN, the same numbers elsewhere
    (masked weight entries stay exact zeros) — or, for the forward-mode engines, which
    would multiply zero tangents by NaN, an error naming the input."""
    model, x, loss_fn = _build(kind)
    for m in model.modules():  # BatchNorm would spread one NaN over the whole batch
        m.eval()
    x = x.clone()
    x.view(-1)[1] = float("nan")
    if name in ("forward", "projforward"):
        with pytest.raises(E.EngineInputError, match="input 0 holds NaN or Inf"):
            leangrad.engine(name, **opts).backward(model, x, loss_fn)
        return
    if not _exact(name, opts):
        pytest.skip("estimators: no entry-wise reference")
    ref_model = copy.deepcopy(model)
    loss_fn(ref_model(x)).backward()
    leangrad.engine(name, **opts).backward(model, x, loss_fn)
    for (n, p), r in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if r.grad is None:
            assert p.grad is None, n
            continue
        assert torch.equal(p.grad.isnan(), r.grad.isnan()), f"{n}: NaN pattern differs"
        torch.testing.assert_close(p.grad, r.grad, rtol=TOL, atol=TOL, equal_nan=True, msg=n)


# --- documented preconditions, enforced ------------------------------------------------


def _expect(name: str, opts: dict[str, object], kind: str, pattern: str, edit=None) -> None:  # type: ignore[no-untyped-def]
    model, x, loss_fn = _build(kind)
    if edit is not None:
        edit(model)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with pytest.raises(E.EngineInputError, match=pattern):
        leangrad.engine(name, **opts).backward(model, x, loss_fn)
    # Refused before any gradient was written.
    assert all(
        (p.grad is None) if g is None else torch.equal(p.grad, g)
        for p, g in zip(model.parameters(), grads, strict=True)
    )


def test_stem_chunks_with_a_batch_coupling_stem_is_refused() -> None:
    """Chunking a training-mode BatchNorm stem gave ~5% wrong gradients silently."""
    _expect("moonwalk", {"stem_chunks": 2}, "subcnn_paramfree_stem",
            r"stem_chunks=2 .* BatchNorm2d '1' in training mode; use stem_chunks=1")  # fmt: skip


def test_stem_chunks_with_dropout_in_the_stem_is_refused() -> None:
    def edit(m: nn.Module) -> None:
        m.stem = nn.Sequential(models.RepeatChannels(3), nn.Dropout(0.5))

    _expect("moonwalk", {"stem_chunks": 2}, "subcnn_paramfree_stem", r"Dropout '1'", edit)


def test_stem_chunks_with_an_eval_mode_stem_is_exact() -> None:
    model, x, loss_fn = _build("subcnn_paramfree_stem")
    model.stem.eval()
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    leangrad.engine("moonwalk", stem_chunks=2).backward(model, x, loss_fn)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (r.grad is None)
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, rtol=TOL, atol=TOL)


def test_per_example_with_batchnorm_in_the_chain_is_refused() -> None:
    def edit(m: nn.Module) -> None:
        m.layers[0] = AdditiveCoupling(nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)))
        m.layers[0].double()

    _expect("moonwalk", {"mode": "pure", "per_example": True}, "revchain",
            r"per_example=True .* chain layer 0 has BatchNorm2d", edit)  # fmt: skip


def test_pure_mode_with_training_batchnorm_in_the_head_is_refused() -> None:
    def edit(m: nn.Module) -> None:
        m.head = nn.Sequential(nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(32, 3)).double()

    _expect("moonwalk", {"mode": "pure"}, "revchain", r"mode='pure' .* the head has BatchNorm2d",
            edit)  # fmt: skip


@pytest.mark.parametrize("name", ["moonwalk", "revbackprop"])
def test_dropout_inside_a_chain_layer_is_refused(name: str) -> None:
    def edit(m: nn.Module) -> None:
        m.layers[0] = AdditiveCoupling(nn.Sequential(nn.Conv2d(2, 2, 1), nn.Dropout(0.5)))
        m.layers[0].double()

    _expect(name, {}, "revchain", r"chain layer 0 has Dropout '.*' in training mode", edit)


# --- forward hooks on modules an engine reruns -----------------------------------------


def _hooked(kind: str, where: Callable[[nn.Module], nn.Module]):  # type: ignore[no-untyped-def, type-arg]
    model, x, loss_fn = _build(kind)
    calls: list[int] = []
    where(model).register_forward_hook(lambda _m, _i, _o: calls.append(1))
    return model, x, loss_fn, calls


@pytest.mark.parametrize(
    ("name", "opts", "kind", "where"),
    [
        ("checkpoint", {}, "generic", lambda m: m[0]),
        ("forward", {}, "generic", lambda m: m[4]),
        ("projforward", {}, "generic", lambda m: m[4]),
        ("moonwalk", {}, "subcnn", lambda m: m.stem[0]),
        ("revbackprop", {}, "revchain", lambda m: m.layers[0]),
    ],
    ids=["checkpoint", "forward", "projforward", "moonwalk", "revbackprop"],
)
def test_hooks_on_rerun_modules_are_refused(name, opts, kind, where) -> None:  # type: ignore[no-untyped-def]
    model, x, loss_fn, calls = _hooked(kind, where)
    with pytest.raises(E.EngineInputError, match=r"more than once per step, so its forward hook"):
        leangrad.engine(name, **opts).backward(model, x, loss_fn)
    assert calls == []  # refused before anything ran


@pytest.mark.parametrize(
    ("name", "kind", "where"),
    [("backprop", "generic", lambda m: m[0]), ("checkpoint", "generic", lambda m: m[6]),
     ("moonwalk", "subcnn", lambda m: m.head)],
    ids=["backprop", "checkpoint-last-segment", "moonwalk-head"],
)  # fmt: skip
def test_hooks_on_modules_run_once_fire_once(name, kind, where) -> None:  # type: ignore[no-untyped-def]
    model, x, loss_fn, calls = _hooked(kind, where)
    leangrad.engine(name).backward(model, x, loss_fn)
    assert calls == [1]


class _Counter(nn.Module):
    """A stateful module: counts its training-mode calls in a buffer (version-tracked)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return x


def test_any_buffer_a_rerun_updates_advances_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Counter(), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=DT)
    leangrad.engine("checkpoint").backward(model, x, lambda out: out.square().mean())
    assert int(model[1].calls) == 1


# --- the transforms keep the same contract (rad/fad change what autograd saves) --------


def _transformed(transform: str, model: nn.Module) -> nn.Module:
    from leangrad import fad, rad

    if transform == "fad.nest":
        return fad.nest(model)
    rad.randomize(model, fraction=0.5, mode="different", seed=0)
    return model


@pytest.mark.filterwarnings("ignore:randomize left .* exact")  # BatchNorm, Dropout, Tanh
@pytest.mark.parametrize("transform", ["fad.nest", "rad.randomize"])
@pytest.mark.parametrize("input_grad", [False, True], ids=["x", "x_requires_grad"])
def test_transforms_keep_the_backward_contract(transform: str, input_grad: bool) -> None:
    """Same .grad None-ness, statistics, RNG and input gradient as the plain model; values
    exact for fad (an exact rewrite), and for rad where they do not depend on sampling
    (input gradients and biases are exact by construction)."""
    model, x, loss_fn = _build("generic")
    ref_model = copy.deepcopy(model)
    xr = x.clone().requires_grad_(input_grad)
    ref_grads, ref_bufs, ref_rng, ref_xgrad = _reference(ref_model, xr, loss_fn, seed=7)

    net = _transformed(transform, model)
    xe = x.clone().requires_grad_(input_grad)
    torch.manual_seed(7)
    loss_fn(net(xe)).backward()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (ref_grads[n] is None), n
        exact_value = transform == "fad.nest" or n.endswith("bias")
        if ref_grads[n] is not None and exact_value:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=TOL, atol=TOL, msg=n)
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, ref_bufs[n], rtol=1e-12, atol=1e-14, msg=n)
    if transform == "fad.nest":  # rad draws its own samples from a seeded generator
        assert torch.equal(torch.get_rng_state(), ref_rng)
    if input_grad:
        assert xe.grad is not None
        torch.testing.assert_close(xe.grad, ref_xgrad, rtol=TOL, atol=TOL)
