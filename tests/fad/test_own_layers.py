"""fad's own layers inside fad (class 7).

Every layer :mod:`leangrad.fad` exports (``Swish``, ``GELU`` in both forms, ``Mish``, a
:class:`~leangrad.fad.FusedChain` of any program, :func:`~leangrad.fad.elementwise`) must be
accepted by both modes — the ``torch.fx`` pass ``fad.nest`` and the eager ``fad.nested()`` —
stay one fused unit, and give autograd's gradients (float64 to 1e-10, float32 loosely); by
the ``fad`` engine and ``checkpoint+fad`` too. Errors must name what really happened.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import leangrad
import leangrad.fad as fad
from fad_cases import Double, Lambda, rel
from leangrad.fad import _errors as E
from leangrad.measure import saved_tensor_bytes

TOL64 = 1e-10
TOL32 = 1e-5


def _two_outputs() -> fad.FusedChain:
    b = fad.Builder("tanh-and-square")
    t = b.op("tanh", b.source)
    return fad.FusedChain(b.build(t, b.op("mul", t, t)))


LAYERS: dict[str, Callable[[], nn.Module]] = {
    "Swish": fad.Swish,
    "GELU": fad.GELU,
    "GELU-tanh": lambda: fad.GELU(approximate="tanh"),
    "Mish": fad.Mish,
    "FusedChain": lambda: fad.FusedChain(fad.gelu_program("tanh")),
    "elementwise": lambda: fad.elementwise(lambda h: h * torch.tanh(F.softplus(h))),
}
"""Every single-output layer fad exports, by name."""

REFERENCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Swish": F.silu,
    "GELU": F.gelu,
    "GELU-tanh": lambda h: F.gelu(h, approximate="tanh"),
    "Mish": F.mish,
    "FusedChain": lambda h: F.gelu(h, approximate="tanh"),
    "elementwise": F.mish,
}
"""The same activation written with PyTorch's own operators (the autograd reference)."""


class Mixed(nn.Module):
    """fad layers after, before and between ordinary element-wise chains, and a two-output
    FusedChain whose outputs go separate ways."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.act, self.two = act, _two_outputs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(torch.tanh(self.a(x)) * 0.5 + 0.1)  # a chain flowing into the layer
        h = torch.sigmoid(h) * h  # ... and a chain flowing out of it
        t, sq = self.two(self.b(h))
        return self.c(t - 0.3 * sq)


def _reference_run(model: Mixed, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` run with its fad layers swapped for PyTorch's operators (same parameters)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        act, two = model.act, model.two
        model.act = Lambda(REFERENCE[name])
        model.two = Lambda(lambda h: (torch.tanh(h), torch.tanh(h) * torch.tanh(h)))  # type: ignore[arg-type,return-value]
        try:
            return model(x)
        finally:
            model.act, model.two = act, two

    return run


def _grads(run: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter],
           x: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    x = x.detach().requires_grad_()
    return list(torch.autograd.grad(run(x).square().sum(), [*params, x]))


def _nested_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    with fad.nested():
        loss = model(x).square().sum()
    return list(torch.autograd.grad(loss, [*model.parameters(), x]))


def _check(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert rel(a, b) < tol


# -- the issue's reproductions ---------------------------------------------------------------
def test_issue_nest_of_sequential_with_swish() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), fad.Swish()).double()
    gm = fad.nest(model)
    kept = [m for m in gm.modules() if isinstance(m, fad.Swish)]
    assert kept == [gm.get_submodule("1")]  # the layer itself, one call_module node
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "call_module",
                                              "output"]  # fmt: skip
    x = torch.randn(4, 3, dtype=torch.float64)
    ref = _grads(lambda x: F.silu(model[0](x)), list(model.parameters()), x)
    _check(_grads(gm, list(model.parameters()), x), ref, TOL64)


@pytest.mark.parametrize("backward_inside", [True, False])
def test_issue_nested_swish_after_a_chain(backward_inside: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with fad.nested(trace=True) as stats:
        loss = fad.Swish()(lin(x) * 0.5 + 0.1).sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    # the chain goes on through the layer (one operator, "swish") and ends in one node
    assert stats.trace[:5] == [("NN", "linear"), ("NY", "mul"), ("YY", "add"), ("YY", "swish"),
                           ("YN", "sum")]  # fmt: skip
    assert stats.attached == 1
    w, b = lin.weight.detach().requires_grad_(), lin.bias.detach().requires_grad_()
    gw, gb = torch.autograd.grad(F.silu(F.linear(x, w, b) * 0.5 + 0.1).sum(), [w, b])
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert rel(lin.weight.grad, gw) < TOL64 and rel(lin.bias.grad, gb) < TOL64


# -- both modes, every layer, float64 and float32 ------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(LAYERS))
def test_every_own_layer_in_both_modes(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    model = Mixed(LAYERS[name]()).to(dtype)
    x = torch.randn(7, 5, dtype=dtype) * 2
    params = list(model.parameters())
    ref = _grads(_reference_run(model, name), params, x)
    tol = TOL64 if dtype == torch.float64 else TOL32
    gm = fad.nest(model)
    modules = list(gm.modules())
    assert model.two in modules  # a two-output layer stays as written
    if isinstance(model.act, fad.FusedChain):  # joins the chain around it, whole
        assert model.act not in modules
        ops = ("tanh", "mul", "add", model.act.program.name, "sigmoid", "mul")
        assert [r.ops for r in gm.fad_regions if r.name is not None] == [ops]
    else:  # fad.elementwise (a Python function): stays as written
        assert model.act in modules
    _check(_grads(gm, params, x), ref, tol)
    _check(_nested_grads(model, x), ref, tol)
    _check(_nested_grads(gm, x), ref, tol)  # the nested model under the eager mode too


@pytest.mark.parametrize("name", list(LAYERS))
def test_own_layer_as_the_whole_model(name: str) -> None:
    """A model that *is* one fad layer: nest keeps it; the eager mode runs it as the chain."""
    layer = LAYERS[name]()
    gm = fad.nest(layer)
    assert layer in list(gm.modules()) and gm.fad_regions == []
    x = torch.randn(6, dtype=torch.float64) * 3
    ref = _grads(REFERENCE[name], [], x)
    _check(_grads(gm, [], x), ref, TOL64)
    scaled = _grads(lambda t: REFERENCE[name](t) * 1.5, [], x)
    _check(_nested_grads(Lambda(lambda t: layer(t) * 1.5), x), scaled, TOL64)


def test_nest_joins_a_layer_to_the_chain_around_it() -> None:
    """tanh -> Swish -> Mish: one chain, one saved derivative, where keeping the layers
    apart would save tanh's output and one derivative per layer (three tensors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), fad.Swish(), fad.Mish(),
                          nn.Linear(8, 2)).double()  # fmt: skip
    gm = fad.nest(model)
    assert [(r.name, r.ops) for r in gm.fad_regions] == [
        ("fad_chain_0", ("tanh", "swish", "mish"))]  # fmt: skip
    assert [type(m) for m in gm.modules() if isinstance(m, fad.FusedChain)] == [fad.FusedChain]
    x = torch.randn(4, 8, dtype=torch.float64)
    params = list(model.parameters())
    with saved_tensor_bytes(x, *params) as s:
        out = gm(x)
    assert s.bytes == 2 * 4 * 8 * 8  # the chain's derivative and the last Linear's input
    (g,) = torch.autograd.grad(out.sum(), model[0].weight)
    (gr,) = torch.autograd.grad(model(x).sum(), model[0].weight)
    assert rel(g, gr) < TOL64
    with pytest.raises(fad.FadDtypeError):  # as the user's layers would: no silent fallback
        gm.fad_chain_0(torch.ones(3, dtype=torch.long))


def test_nest_keeps_a_lone_layer_and_a_second_nest_changes_nothing() -> None:
    """A layer with no chain next to it stays the user's module, and nesting a nested
    model again changes nothing."""
    model = nn.Sequential(nn.Linear(3, 3), fad.GELU(), nn.Linear(3, 3), nn.Tanh(),
                          fad.Swish())  # fmt: skip
    once = fad.nest(model)
    assert once.get_submodule("1") is model[1] and [r.ops for r in once.fad_regions] == [
        ("tanh", "swish")]  # fmt: skip
    twice = fad.nest(once)
    assert twice.fad_regions == []
    x = torch.randn(2, 3)
    assert torch.equal(twice(x), once(x)) and torch.allclose(once(x), model(x), atol=1e-6)


def test_plain_fx_trace_keeps_fad_layers_as_leaves() -> None:
    """Any torch.fx tracer (the checkpoint engine's, the block discovery's, the user's own)
    records a fad layer as one call_module node instead of failing on a Proxy's dtype."""
    model = nn.Sequential(nn.Linear(3, 3), fad.Mish(), _two_outputs())
    gm = fx.symbolic_trace(model)
    calls = [(n.op, n.target) for n in gm.graph.nodes if n.op != "placeholder"]
    assert calls[:3] == [("call_module", "0"), ("call_module", "1"), ("call_module", "2")]
    split = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert split == [operator.getitem] * 2  # the two outputs, split by index
    x = torch.randn(2, 3)
    for a, b in zip(gm(x), model(x), strict=True):
        assert torch.equal(a, b)


def test_eager_mode_saves_one_tensor_through_an_own_layer() -> None:
    """tanh -> Swish: autograd would keep tanh's output and Swish's input (or derivative);
    the eager mode keeps one derivative for the whole chain, the layer inside it."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with saved_tensor_bytes(x, *lin.parameters()) as s, fad.nested() as stats:
        out = fad.Swish()(torch.tanh(lin(x))).sum(1)
    assert stats.attached == 1 and s.bytes == 4 * 8 * 8  # one (4, 8) float64 derivative
    (g,) = torch.autograd.grad(out.sum(), lin.weight)
    (gr,) = torch.autograd.grad(F.silu(torch.tanh(lin(x))).sum(), lin.weight)
    assert rel(g, gr) < TOL64


def test_own_layer_without_a_gradient_in_the_eager_mode() -> None:
    with fad.nested() as stats:
        y = fad.GELU()(torch.randn(3, dtype=torch.float64))
    assert not y.requires_grad and stats.attached == 0
    with torch.no_grad(), fad.nested() as stats:
        y = fad.Swish()(torch.randn(3, requires_grad=True))
    assert not y.requires_grad and stats.states == {}


def test_own_layers_inside_elementwise() -> None:
    """fad.elementwise of a function that calls fad's layers: each is one element-wise op."""
    act = fad.elementwise(lambda h: fad.Swish()(h) * 2.0 + fad.Mish()(torch.tanh(h)))
    x = torch.randn(9, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(act(x).sum(), x)
    (gr,) = torch.autograd.grad((F.silu(x) * 2.0 + F.mish(torch.tanh(x))).sum(), x)
    assert rel(g, gr) < TOL64
    t, sq = fad.elementwise(lambda h: _two_outputs()(h * 3.0))(x)
    (g,) = torch.autograd.grad((t + sq).sum(), x)
    tr = torch.tanh(x * 3.0)
    (gr,) = torch.autograd.grad((tr + tr * tr).sum(), x)
    assert rel(g, gr) < TOL64


# -- the engines -----------------------------------------------------------------------------
def _engine_model(dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 6), fad.Swish(), Lambda(lambda h: torch.tanh(h) * 0.5), fad.Mish(),
        nn.Linear(6, 6), fad.elementwise(lambda h: h * torch.sigmoid(h)), nn.Linear(6, 5),
        Mixed(fad.GELU(approximate="tanh")),
    ).to(dtype)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("name", "opts"), [
    ("fad", {}), ("fad", {"mode": "fx"}), ("fad", {"mode": "eager"}),
    ("checkpoint+fad", {}), ("checkpoint+fad", {"segments": 2}),
    ("checkpoint+fad", {"fad_mode": "eager"}),
])  # fmt: skip
def test_engines_on_a_model_of_own_layers(name: str, opts: dict[str, object],
                                          dtype: torch.dtype) -> None:  # fmt: skip
    torch.manual_seed(2)
    model = _engine_model(dtype)
    x = torch.randn(4, 5, dtype=dtype)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().mean()

    ref_loss = loss_fn(model(x))
    ref = torch.autograd.grad(ref_loss, list(model.parameters()))
    result = leangrad.engine(name, **opts).backward(model, (x,), loss_fn)
    tol = TOL64 if dtype == torch.float64 else TOL32
    assert rel(result.loss.detach(), ref_loss.detach()) < tol
    for p, r in zip(model.parameters(), ref, strict=True):
        assert p.grad is not None and rel(p.grad, r) < tol
    info = result.info["fad"]
    assert "cannot trace" not in str(info) and "Proxy" not in str(info)


@pytest.mark.parametrize(("name", "opts"), [
    ("checkpoint", {}), ("checkpoint", {"trace": True}), ("checkpoint+fad", {}),
])  # fmt: skip
def test_block_discovery_cuts_through_own_layers(name: str, opts: dict[str, object]) -> None:
    """A model that runs its own forward is cut into blocks on its torch.fx graph; fad's
    layers used to make that trace fail (no blocks found at all)."""
    torch.manual_seed(4)
    model = Mixed(fad.Swish()).double()
    x = torch.randn(4, 5, dtype=torch.float64)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().sum()

    ref = torch.autograd.grad(loss_fn(model(x)), list(model.parameters()))
    result = leangrad.engine(name, **opts).backward(model, (x,), loss_fn)
    assert result.info["blocks"] > 1
    for p, r in zip(model.parameters(), ref, strict=True):
        assert p.grad is not None and rel(p.grad, r) < TOL64


@pytest.mark.parametrize("layer", ["elementwise", "Swish"])
@pytest.mark.parametrize(("name", "opts"), [("forward", {}), ("moonwalk", {"mode": "pure"})])
def test_forward_mode_runs_through_own_layers(name: str, opts: dict[str, object],
                                              layer: str) -> None:  # fmt: skip
    """Without a gradient to record (inside torch.func.jvp) a fad layer runs its operators
    as called: no derivative kernels (``tanh_backward_out`` has no forward-mode rule)."""
    from leangrad.layers import AdditiveCoupling, LeakyReLU

    torch.manual_seed(3)
    model = leangrad.Chain(
        AdditiveCoupling(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), LAYERS[layer](),
                                       nn.Conv2d(2, 2, 1))),
        LeakyReLU(0.2),
        stem=nn.Conv2d(2, 4, 1),
        head=nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 3), LAYERS[layer]()),
    ).double()  # fmt: skip
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().sum()

    ref = torch.autograd.grad(loss_fn(model(x)), list(model.parameters()))
    leangrad.engine(name, **opts).backward(model, (x,), loss_fn)
    for p, r in zip(model.parameters(), ref, strict=True):
        assert p.grad is not None and rel(p.grad, r) < TOL64


# -- errors that name what happened ------------------------------------------------------------
def _message(template: str) -> str:
    return template.split("{ops}")[0]


def test_unseen_consumer_inside_the_block_is_named() -> None:
    x = torch.randn(5, requires_grad=True)
    with fad.nested():
        loss = Double.apply(torch.tanh(x) * 2).sum()  # the chain value dies in the block
    with pytest.raises(fad.FadError) as err:
        loss.backward()
    assert str(err.value) == E.UNSEEN_CONSUMER.format(ops=["tanh", "mul"])
    with fad.nested():  # backward inside the block: the consumer can only be inside it
        y = torch.tanh(x) * 2
        with pytest.raises(fad.FadError) as err:
            Double.apply(y).sum().backward()
    assert str(err.value) == E.UNSEEN_CONSUMER.format(ops=["tanh", "mul"])


def test_value_outliving_the_block_is_named() -> None:
    x = torch.randn(5, requires_grad=True)
    with fad.nested():
        y = fad.Swish()(x * 1.0)
    with pytest.raises(fad.FadError) as err:
        y.sum().backward()
    assert str(err.value) == E.ESCAPED.format(ops=["mul", "swish"])


def test_trace_errors_do_not_blame_a_proxy_dtype() -> None:
    class Untraceable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = fad.Swish()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(x) if x.sum() > 0 else x

    with pytest.raises(fad.FadTraceError) as err:
        fad.nest(Untraceable())
    assert "cannot be used as inputs to control flow" in str(err.value)  # fx's own reason
    assert "dtype Proxy" not in str(err.value)


def test_primitive_with_unsupported_arguments_is_not_called_unknown() -> None:
    act = fad.elementwise(lambda h: torch.div(h, 2.0, rounding_mode="floor"))
    with pytest.raises(fad.FadOpError) as err:
        act(torch.randn(3, requires_grad=True))
    assert str(err.value).startswith("fad.elementwise: operator 'div' is a FAD primitive, but")
    assert "rounding_mode='floor'" in str(err.value)
    assert "is not a FAD-compatible" not in str(err.value)


def test_inplace_messages_name_the_written_tensor() -> None:
    with pytest.raises(fad.FadOpError) as err:
        fad.elementwise(lambda h: h.mul_(2))(torch.randn(3, requires_grad=True))
    assert str(err.value) == E.INPLACE_INPUT.format(op="mul_", target="the function's input")
    c = torch.ones(3)
    with pytest.raises(fad.FadOpError) as err:
        fad.elementwise(lambda h: c.add_(h))(torch.randn(3, requires_grad=True))
    assert "writes into a tensor outside the chain" in str(err.value)


@pytest.mark.parametrize(("ret", "what"), [
    ((), "an empty tuple"), (lambda h: (h, 3), "a tuple holding int"), (None, "NoneType"),
])  # fmt: skip
def test_not_one_tensor_says_what_came_back(ret: object, what: str) -> None:
    fn = ret if callable(ret) else (lambda h: ret)
    with pytest.raises(fad.FadOpError) as err:
        fad.elementwise(fn)(torch.randn(3, requires_grad=True))
    assert str(err.value) == E.NOT_ONE_TENSOR.format(what=what)


@pytest.mark.parametrize("layer", [fad.Swish, lambda: fad.elementwise(torch.sigmoid)])
def test_non_tensor_input_is_named(layer: Callable[[], nn.Module]) -> None:
    with pytest.raises(fad.FadOpError, match="the input must be a tensor, got list"):
        layer()([1.0])


def test_joined_chain_keeps_the_layers_dtype_behaviour() -> None:
    """A chain that took in a layer raising on dtypes without rules raises too; one that
    took in only falling-back layers (what nest inserts) still falls back."""
    z = torch.randn(3, dtype=torch.complex128)
    strict = fad.nest(nn.Sequential(nn.Tanh(), fad.Swish()))
    with pytest.raises(fad.FadDtypeError, match=r"rule for dtype torch\.complex128"):
        strict(z)
    lenient = fad.nest(nn.Sequential(nn.Tanh(), fad.FusedChain(fad.swish_program(),
                                                               fallback=True)))  # fmt: skip
    with pytest.warns(UserWarning, match=r"cannot be nested \(no forward-mode rule"):
        out = lenient(z)
    assert torch.allclose(out, F.silu(torch.tanh(z)))


def test_builder_and_options_raise_leangrad_errors() -> None:
    with pytest.raises(fad.FadOpError, match=r"fad.Builder.op: 'gelu' is not a FAD primitive"):
        fad.Builder("x").op("gelu", fad.Builder("x").source)
    with pytest.raises(fad.FadOptionError) as err:
        fad.GELU(approximate="erf")
    assert isinstance(err.value, (leangrad.LeangradError, ValueError))
    assert str(err.value) == E.BAD_APPROXIMATE.format(value="erf")


def test_gelu_tanh_constant_is_the_papers() -> None:  # guards the REFERENCE table above
    x = torch.linspace(-4, 4, 9, dtype=torch.float64)
    y = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert torch.allclose(fad.GELU(approximate="tanh")(x), y, rtol=0, atol=1e-15)
