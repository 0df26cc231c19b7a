"""Tests of leangrad.engines: every exact engine against autograd, on_grad, the
forward-gradient estimator's statistics, input validation and the registry.

Tolerances: exact engines must agree with ``torch.autograd.grad`` to a max-norm
relative error of 1e-10 in float64 (they differ only in summation order, errors
~1e-15) and 1e-4 in float32 (unit roundoff 6e-8, times the modest depth and
fan-in of these models).
"""

from __future__ import annotations

import copy
import math
import os
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import leangrad
from helpers import MODEL_KINDS, draw_problem, make_problem, reference_grads, trainable
from leangrad import _errors as E
from leangrad import models
from leangrad.engines import engine_class
from leangrad.engines._blocks import NO_BLOCKS
from leangrad.engines._forward import BAD_CHUNK
from leangrad.engines._projforward import BAD_DISTRIBUTION
from leangrad.engines.checkpoint._engine import BAD_SEGMENTS
from leangrad.measure import compare_grads, estimator_stats, grads_of

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
CORE = ("backprop", "checkpoint", "forward", "projforward")

# Option variants of the exact engines. checkpoint: one segment per block (None),
# a fixed count and ⌈√L⌉; forward: the default chunk and a chunk of 7 directions,
# which never divides these parameter sizes evenly, so partial chunks are exercised.
VARIANTS: dict[str, list[dict[str, object]]] = {
    "checkpoint": [{}, {"segments": 2}, {"segments": "sqrt"}, {"segments": 2, "trace": True}],
    "forward": [{}, {"chunk_size": 7}],
    "moonwalk": [
        {},
        {"segments": 2},
        {"mode": "pure", "chunk_size": 7},
        {"mode": "pure", "per_example": True},
        {"stem_chunks": 2},
        {"fragment": 3},
        {"fragment": "full"},
        {"fragment": 4, "segments": 2},
    ],
}


def _supported(name: str, kind: str) -> str | None:
    """Why engine ``name`` cannot run on model ``kind`` (``None`` when it can)."""
    return leangrad.engine(name).supports(make_problem(kind, torch.float64).model)


# Compositions (base engine + transforms), and rad where it is exact (fraction=1).
EXACT_COMBOS: list[tuple[str, dict[str, object]]] = [
    ("rad", {"fraction": 1.0, "seed": 0}),
    ("checkpoint+fad", {"segments": 2}),
    ("checkpoint+rad", {"fraction": 1.0, "seed": 0}),
    ("moonwalk+fad", {}),
    ("moonwalk+rad", {"fraction": 1.0, "seed": 0}),
    ("checkpoint+bits", {"segments": 2}),
]


def _exact_configs() -> list[object]:
    configs = []
    named = [(n, o) for n in leangrad.available(exact=True) for o in VARIANTS.get(n, [{}])]
    for name, opts in named + EXACT_COMBOS:
        label = ",".join(f"{k}={v}" for k, v in opts.items())
        eng = leangrad.engine(name, **opts)
        for kind in MODEL_KINDS:
            if eng.supports(make_problem(kind, torch.float64).model) is None:
                ident = f"{name}({label})-{kind}" if opts else f"{name}-{kind}"
                # fx tracing and forward mode by chunks of coordinates are the slowest
                # variants: two models here, every one in test-all
                costly = opts.get("trace") or (name == "forward" and "chunk_size" in opts)
                slow = costly and kind not in ("mlp", "cnn")
                configs.append(pytest.param(name, opts, kind, id=ident,
                                            marks=[pytest.mark.slow] if slow else []))
    return configs


EXACT_CONFIGS = _exact_configs()
EXAMPLES = 5 if os.environ.get("LEANGRAD_TEST_ALL") else 3
"""Drawn problems per engine, model and dtype: 5 in ``make test-all``, 3 in ``make test``
and so in CI (the same first three: the draws are derandomized)."""


def test_every_exact_engine_is_tested_on_some_model() -> None:
    """The reference test covers every exact engine; chain engines skip plain models only
    with a reason naming leangrad.Chain (the fix)."""
    covered = {p.values[0] for p in EXACT_CONFIGS}
    assert covered == set(leangrad.available(exact=True)) | {n for n, _ in EXACT_COMBOS}
    for name in ("moonwalk", "revbackprop"):
        reason = _supported(name, "mlp")
        assert reason is not None and "leangrad.Chain" in reason
    assert _supported("revbackprop", "subcnn") is not None  # strided convs are not invertible


def _mlp_problem(dtype: torch.dtype = torch.float64, **sizes: int):  # type: ignore[no-untyped-def]
    return make_problem("mlp", dtype, sizes={"batch": 4, "features": 5, "width": 6, **sizes})


# --- 1. the reference test ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(("name", "options", "kind"), EXACT_CONFIGS)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_exact_engine_matches_autograd(
    name: str, options: dict[str, object], kind: str, dtype: torch.dtype, data: st.DataObject
) -> None:
    """Loss and gradients equal autograd's; a second call accumulates like ``backward()``."""
    prob = draw_problem(data, kind, dtype)
    model = prob.model
    ref_loss, ref = reference_grads(model, prob.inputs, prob.loss_fn)
    eng = leangrad.engine(name, **options)

    result = eng.backward(model, prob.inputs, prob.loss_fn)
    assert result.engine == eng.label
    assert result.loss.shape == () and result.loss.dtype == dtype
    assert not result.loss.requires_grad
    torch.testing.assert_close(result.loss, ref_loss, rtol=TOL[dtype], atol=0)
    cmp = compare_grads(grads_of(model), ref)
    assert cmp.max_rel_err <= TOL[dtype], (cmp.worst_param, cmp.per_param)

    # No zero_grad in between: .grad now holds the sum of both steps, like loss.backward().
    eng.backward(model, prob.inputs, prob.loss_fn)
    cmp2 = compare_grads(grads_of(model), {n: 2 * g for n, g in ref.items()})
    assert cmp2.max_rel_err <= TOL[dtype], (cmp2.worst_param, cmp2.per_param)


def test_step_info_counts() -> None:
    """info records the work done: one jvp per coordinate (forward), one per sample
    (projforward), and the number of checkpoint segments (⌈√L⌉ for "sqrt", capped at L)."""
    prob = _mlp_problem(depth=8)  # 9 blocks: 8 hidden + head
    n_coords = sum(p.numel() for p in prob.model.parameters())
    run = lambda name, **o: leangrad.engine(name, **o).backward(  # noqa: E731
        prob.model, prob.inputs, prob.loss_fn
    )
    assert run("forward", chunk_size=7).info["jvps"] == n_coords
    assert run("projforward", samples=5, chunk_size=2).info["jvps"] == 5
    assert run("checkpoint").info["segments"] == 9
    assert run("checkpoint", segments="sqrt").info["segments"] == 3
    assert run("checkpoint", segments=4).info["segments"] == 4
    assert run("checkpoint", segments=50).info["segments"] == 9


class _Blocks(nn.Module):
    """Not a Sequential, but declares its blocks for the checkpoint engine."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def checkpoint_blocks(self) -> list[nn.Module]:
        return list(self.layers)


def test_checkpoint_uses_checkpoint_blocks() -> None:
    torch.manual_seed(0)
    model = _Blocks().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    _, ref = reference_grads(model, (x,), loss_fn)
    leangrad.engine("checkpoint").backward(model, x, loss_fn)
    assert compare_grads(grads_of(model), ref).max_rel_err <= TOL[torch.float64]


class _PickOutput(nn.Module):
    """Takes an LSTM's ``(output, (h, c))`` tuple and returns the last output step."""

    def forward(self, out: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return out[0][:, -1]


@pytest.mark.parametrize("segments", [None, 3])
def test_checkpoint_passes_tuple_outputs_like_sequential(segments: int | None) -> None:
    """A block's tuple output reaches the next block as one argument, as in nn.Sequential,
    whether or not a segment boundary lies between them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LSTM(3, 4, batch_first=True), _PickOutput(), nn.Linear(4, 2))
    model = model.double()
    x, y = torch.randn(2, 5, 3, dtype=torch.float64), torch.tensor([0, 1])
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    _, ref = reference_grads(model, (x,), loss_fn)
    leangrad.engine("checkpoint", segments=segments).backward(model, x, loss_fn)
    assert compare_grads(grads_of(model), ref).max_rel_err <= TOL[torch.float64]


# --- 2. on_grad ----------------------------------------------------------------------


@pytest.mark.parametrize("name", leangrad.available())
def test_on_grad_called_once_per_trainable_parameter(name: str) -> None:
    """Called exactly once per trainable parameter, with the model's own parameter object
    whose ``.grad`` already holds its final gradient; frozen parameters are skipped."""
    prob = _on_grad_problem(name)
    model = prob.model
    frozen = list(trainable(model))[1]
    model.get_parameter(frozen).requires_grad_(False)
    params = trainable(model)
    seen: list[str] = []
    handed: dict[str, torch.Tensor] = {}

    def on_grad(n: str, p: nn.Parameter) -> None:
        assert p is params[n]
        assert p.grad is not None and p.grad.shape == p.shape
        seen.append(n)
        handed[n] = p.grad.clone()

    leangrad.engine(name).backward(model, prob.inputs, prob.loss_fn, on_grad=on_grad)
    assert sorted(seen) == sorted(params)
    assert model.get_parameter(frozen).grad is None
    # The gradient handed over is final: nothing is added after on_grad returns.
    for n, p in params.items():
        assert torch.equal(handed[n], p.grad)


def _sgd_on_grad(lr: float):  # type: ignore[no-untyped-def]
    def on_grad(_: str, p: nn.Parameter) -> None:
        with torch.no_grad():
            p.sub_(lr * p.grad)
        p.grad = None

    return on_grad


def _chain_problem():  # type: ignore[no-untyped-def]
    return make_problem("revchain", torch.float64, sizes={"channels": 2, "height": 4})


def _highway_problem():  # type: ignore[no-untyped-def]
    """A GRU read at every step (highway needs a leangrad.highway.HighwayNet)."""
    from helpers import Problem
    from leangrad.highway import GRULayer, HighwayNet

    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(5, 3), nn.Flatten(0, 1))  # (steps*batch, classes)
    model = HighwayNet(nn.Linear(4, 5), [GRULayer(5, 5)], head).double()
    x = torch.randn(6, 2, 4, dtype=torch.float64)
    return Problem(model, (x,), torch.randint(0, 3, (12,)))


def _on_grad_problem(name: str):  # type: ignore[no-untyped-def]
    """The mlp where the engine supports it, a HighwayNet for highway, else a chain."""
    if _supported(name, "mlp") is None:
        return _mlp_problem(depth=3)
    return _highway_problem() if name == "highway" else _chain_problem()


@pytest.mark.parametrize(
    ("name", "kind"),
    [(n, k) for n in leangrad.available(exact=True) for k in ("mlp", "rnn", "revchain", "subcnn")
     if _supported(n, k) is None],
)  # fmt: skip
def test_on_grad_sgd_step_matches_optimizer_step(name: str, kind: str) -> None:
    """A per-parameter SGD step inside on_grad (then ``grad = None``) gives the weights of
    one ``optimizer.step()`` on the full gradient: the step must not disturb the
    gradients of parameters handled after it. float64, so 1e-12 is ~1e4 ulps."""
    lr = 0.5
    prob = make_problem(kind, torch.float64, sizes={"depth": 3, "width": 6})
    ref_model = copy.deepcopy(prob.model)
    opt = torch.optim.SGD(ref_model.parameters(), lr=lr)
    prob.loss_fn(ref_model(*prob.inputs)).backward()
    opt.step()

    leangrad.engine(name).backward(prob.model, prob.inputs, prob.loss_fn, on_grad=_sgd_on_grad(lr))
    for (n, p), q in zip(prob.model.named_parameters(), ref_model.parameters(), strict=True):
        assert p.grad is None, n
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12, msg=n)


# --- 3. projforward statistics ----------------------------------------------------------


def _stat_problem():  # type: ignore[no-untyped-def]
    """An MLP with d = 212 parameters (8 -> 16 -> 4), float64."""
    prob = make_problem("mlp", torch.float64, sizes={"batch": 8, "features": 8, "width": 16,
                                                     "depth": 1, "classes": 4})  # fmt: skip
    _, exact = reference_grads(prob.model, prob.inputs, prob.loss_fn)
    return prob, exact


def _drawer(eng: leangrad.Engine, prob):  # type: ignore[no-untyped-def]
    def draw() -> dict[str, torch.Tensor]:
        prob.model.zero_grad(set_to_none=True)
        eng.backward(prob.model, prob.inputs, prob.loss_fn)
        return grads_of(prob.model)

    return draw


def _theory_total_variance(exact: dict[str, torch.Tensor], distribution: str) -> float:
    """Σ_j Var(ĝ_j) for one draw: Var_j = ‖g‖² + g_j² (Gaussian v: E v_j⁴ = 3) or
    ‖g‖² − g_j² (Rademacher v: v_j² = 1), so the total is (d ± 1)‖g‖²."""
    g = torch.cat([t.reshape(-1) for t in exact.values()])
    sign = 1 if distribution == "gaussian" else -1
    return float((g.norm() ** 2 * g.numel() + sign * g.norm() ** 2).item())


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_projforward_is_unbiased(distribution: str) -> None:
    """N = 200 draws, each the mean of k = 64 samples, against the exact gradient (d = 212).

    - z_j = (mean_j − g_j)/(s_j/√N) is ~ t with N−1 dof, E z² = (N−1)/(N−3) ≈ 1.01.
      Coordinates are correlated (Cov = ‖g‖²I ± diag(g²) + g gᵀ), but tr(R²) ≤ d + 1,
      so mean(z²) has std ≈ √(2/d) = 0.097. Allowed: 1 ± (5√(2/d) + 0.05).
    - max|z| over d coordinates: P(max > 5.5) ≤ d·P(|t₁₉₉| > 5.5) ≈ 2e-5.
    - ‖mean − g‖² should be Σ Var_j/(kN) = (d ± 1)‖g‖²/(kN), relative std
      √(2 tr C²)/tr C ≈ √(2/d), same tolerance. A 20% scale error in the estimator adds
      0.04·kN/d ≈ 2.4 to this ratio (and ~1.4 to mean(z²)), so it fails both.
    - total sample variance vs theory/k: relative std ≈ √(2/(kN)) ≈ 1.3%, allowed 10%.
    """
    prob, exact = _stat_problem()
    d = sum(t.numel() for t in exact.values())
    k, n = 64, 200
    eng = leangrad.engine("projforward", samples=k, distribution=distribution, seed=1234)
    stats = estimator_stats(_drawer(eng, prob), exact, draws=n)

    tol = 5 * math.sqrt(2 / d) + 0.05
    assert abs(stats.z_mean_square - 1) <= tol, stats.z_mean_square
    assert stats.max_abs_z <= 5.5
    theory = _theory_total_variance(exact, distribution)
    g_norm2 = sum(float(t.pow(2).sum()) for t in exact.values())
    predicted_bias2 = theory / (k * n) / g_norm2
    assert abs(stats.rel_bias**2 / predicted_bias2 - 1) <= tol, (stats.rel_bias, predicted_bias2)
    assert stats.variance / (theory / k) == pytest.approx(1, rel=0.10)


@pytest.mark.parametrize("mode", ["different", "same", "project"])
def test_rad_engine_is_unbiased(mode: str) -> None:
    """The ``rad`` engine (backprop + randomized AD) at fraction 0.3: N = 400 draws against
    the exact gradient of the MLP's weights (biases are exact by construction, so they
    are left out: their z would be 0/0).

    - z_j = (mean_j − g_j)/(s_j/√N) ~ t₃₉₉, E z² ≈ 1.005. The coordinates are not
      independent: every entry of a weight column is scaled by the same sample of its
      input feature ("same" makes them identical), so mean(z²) behaves like χ²/d_eff with
      d_eff = 24 input features: std √(2/24) ≈ 0.29, allowed 1 ± 5·0.29 (seen: 0.9–1.7).
      A 20% scale error adds 0.04·N·g²/Var_j ≈ 0.04·400/2.3 ≈ 7 to it: caught.
    - max|z| over d = 192 coordinates: P(max > 5.5) ≤ d·P(|t₃₉₉| > 5.5) ≈ 1e-5.
    - the mean converges: cosine to the exact gradient ≥ 0.99.
    - the seeded engine makes the test deterministic.
    """
    prob, exact = _stat_problem()
    weights = {n: g for n, g in exact.items() if n.endswith("weight")}
    eng = leangrad.engine("rad", fraction=0.3, mode=mode, seed=5)

    def draw() -> dict[str, torch.Tensor]:
        prob.model.zero_grad(set_to_none=True)
        eng.backward(prob.model, prob.inputs, prob.loss_fn)
        return {n: g for n, g in grads_of(prob.model).items() if n in weights}

    stats = estimator_stats(draw, weights, draws=400)
    assert abs(stats.z_mean_square - 1) <= 5 * math.sqrt(2 / 24), stats.z_mean_square
    assert stats.max_abs_z <= 5.5
    assert stats.cosine_of_mean >= 0.99
    assert stats.variance > 0  # it does sample: not the exact gradient in disguise
    # biases (and the loss) are exact
    prob.model.zero_grad(set_to_none=True)
    eng.backward(prob.model, prob.inputs, prob.loss_fn)
    for n, g in grads_of(prob.model).items():
        if n.endswith("bias"):
            torch.testing.assert_close(g, exact[n], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_projforward_per_coordinate_variance(distribution: str) -> None:
    """Per-coordinate variance ‖g‖² + g_j² (Gaussian) vs ‖g‖² − g_j² (Rademacher).

    A linear model with g = (3, 2, 1): the predictions differ by up to 4x between the
    two laws (coordinate 0: 23 vs 5), so a 25% tolerance separates them. Each draw is a
    mean of k = 8 samples (kurtosis ≤ 3 + 12/8), so a sample variance over N = 1500
    draws has relative std ≤ √(3.5/1500) ≈ 5%: 25% is 5σ.
    """
    model = nn.Linear(2, 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -0.5]]))
        model.bias.zero_()
    x = torch.tensor([[3.0, 2.0]], dtype=torch.float64)
    loss_fn = lambda out: out.sum()  # noqa: E731 - gradient (x, 1) = (3, 2, 1)
    g = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    k, n = 8, 1500
    eng = leangrad.engine("projforward", samples=k, distribution=distribution, seed=7)
    draws = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        eng.backward(model, x, loss_fn)
        draws.append(torch.cat([model.weight.grad.reshape(-1), model.bias.grad]))
    sample_var = torch.stack(draws).var(dim=0)
    sign = 1 if distribution == "gaussian" else -1
    theory = (g.norm() ** 2 + sign * g**2) / k
    torch.testing.assert_close(sample_var, theory, rtol=0.25, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_projforward_variance_falls_with_samples(distribution: str) -> None:
    """samples=16 has ~1/16 the variance of samples=1, and the bias of the mean shrinks
    like 1/√draws.

    Variance totals: samples=1 over 800 draws has relative std ≈ √(2/800) = 5% (the
    total is ≈ d‖g‖²χ²₁ per draw), samples=16 over 250 draws ≈ 2%; 25% is > 4σ.
    rel_bias at 800 vs 50 draws: expected ratio √16 = 4, asserted > 2.
    """
    prob, exact = _stat_problem()
    one = lambda: leangrad.engine("projforward", distribution=distribution, seed=99)  # noqa: E731
    few = estimator_stats(_drawer(one(), prob), exact, draws=50)
    single = estimator_stats(_drawer(one(), prob), exact, draws=800)
    eng16 = leangrad.engine("projforward", samples=16, distribution=distribution, seed=5)
    sixteen = estimator_stats(_drawer(eng16, prob), exact, draws=250)
    assert single.variance / sixteen.variance == pytest.approx(16, rel=0.25)
    assert single.rel_bias < few.rel_bias / 2
    # The single-sample variance itself matches theory (d ± 1)‖g‖², 5% std: allow 25%.
    assert single.variance == pytest.approx(_theory_total_variance(exact, distribution), rel=0.25)


def test_projforward_seed_reproducible() -> None:
    prob = _mlp_problem()
    grads = []
    for _ in range(2):
        prob.model.zero_grad(set_to_none=True)
        leangrad.engine("projforward", samples=3, seed=11).backward(
            prob.model, prob.inputs, prob.loss_fn
        )
        grads.append(grads_of(prob.model))
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


# --- 4. bad inputs -----------------------------------------------------------------------


def test_unknown_engine_lists_known_names() -> None:
    msg = E.UNKNOWN_NAME.format(kind="engine", name="nope", known=", ".join(leangrad.available()))
    with pytest.raises(E.UnknownNameError, match=re.escape(msg)) as info:
        leangrad.engine("nope")
    assert isinstance(info.value, KeyError)
    for name in CORE:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "option", "known"),
    [("checkpoint", "segment", "segments"), ("backprop", "segments", "(none)"),
     ("forward", "chunks", "chunk_size, chunk_bytes")],
)  # fmt: skip
def test_unknown_option_lists_known_options(name: str, option: str, known: str) -> None:
    msg = E.UNKNOWN_OPTION.format(engine=name, option=option, known=known)
    with pytest.raises(E.UnknownNameError, match=re.escape(msg)):
        leangrad.engine(name, **{option: 1})


def test_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        engine_class("checkpoint")(2)  # type: ignore[misc]


BAD_LOSSES = [
    pytest.param(lambda out: 1.0, E.LOSS_NOT_TENSOR.format(type="float"), id="float"),
    pytest.param(lambda out: out, E.LOSS_NOT_SCALAR.format(shape=(4, 3)), id="not-scalar"),
    pytest.param(
        lambda out: out.sum().long(), E.LOSS_NOT_FLOAT.format(dtype=torch.int64), id="integer"
    ),
]


@pytest.mark.parametrize("name", CORE)
@pytest.mark.parametrize(("loss_fn", "message"), BAD_LOSSES)
def test_bad_loss(name: str, loss_fn, message: str) -> None:  # type: ignore[no-untyped-def]
    prob = _mlp_problem()
    with pytest.raises(E.EngineInputError, match=re.escape(message)):
        leangrad.engine(name).backward(prob.model, prob.inputs, loss_fn)


@pytest.mark.parametrize("name", ["backprop", "checkpoint"])
def test_loss_without_graph(name: str) -> None:
    prob = _mlp_problem()
    with pytest.raises(E.EngineInputError, match=re.escape(E.LOSS_NO_GRAD)):
        leangrad.engine(name).backward(prob.model, prob.inputs, lambda out: torch.tensor(1.0))


@pytest.mark.parametrize("name", CORE)
def test_model_without_trainable_parameters(name: str) -> None:
    prob = _mlp_problem()
    prob.model.requires_grad_(False)
    msg = E.NO_PARAMETERS.format(model="Sequential")
    with pytest.raises(E.EngineInputError, match=re.escape(msg)):
        leangrad.engine(name).backward(prob.model, prob.inputs, prob.loss_fn)


@pytest.mark.parametrize("name", CORE)
def test_inputs_not_tensors(name: str) -> None:
    prob = _mlp_problem()
    msg = E.INPUT_NOT_TENSOR.format(type="list", index=1)
    with pytest.raises(E.EngineInputError, match=re.escape(msg)):
        leangrad.engine(name).backward(prob.model, (prob.inputs[0], [1.0]), prob.loss_fn)


@pytest.mark.parametrize("name", CORE)
def test_wrong_input_shape_names_engine_and_shapes(name: str) -> None:
    prob = _mlp_problem()  # expects 5 features
    eng = leangrad.engine(name)
    x = torch.randn(4, 7, dtype=torch.float64, device=prob.inputs[0].device)
    prefix = E.FORWARD_FAILED.format(engine=eng.label, shapes=[(4, 7)], error="")
    with pytest.raises(E.EngineInputError, match=re.escape(prefix)) as info:
        eng.backward(prob.model, x, prob.loss_fn)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("name", CORE)
def test_wrong_input_dtype(name: str) -> None:
    prob = _mlp_problem(torch.float64)
    msg = E.INPUT_DTYPE.format(index=0, input_dtype=torch.float32, param_dtype=torch.float64)
    with pytest.raises(E.EngineInputError, match=re.escape(msg)):
        leangrad.engine(name).backward(prob.model, prob.inputs[0].float(), prob.loss_fn)


def test_checkpoint_names_the_fix_when_no_blocks_repeat() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    msg = NO_BLOCKS.format(model="Net")
    with pytest.raises(E.EngineInputError, match=re.escape(msg)):
        leangrad.engine("checkpoint").backward(Net(), torch.randn(2, 3), lambda out: out.sum())
    # naming the block works: the model as written, that block checkpointed
    leangrad.engine("checkpoint", blocks=["fc"]).backward(
        Net(), torch.randn(2, 3), lambda out: out.sum()
    )


@pytest.mark.parametrize("segments", [0, -2, True, 2.5, "cbrt"])
def test_checkpoint_bad_segments(segments: object) -> None:
    with pytest.raises(ValueError, match=re.escape(BAD_SEGMENTS.format(value=segments))):
        leangrad.engine("checkpoint", segments=segments)


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [("forward", "chunk_size", 0), ("forward", "chunk_size", -1), ("forward", "chunk_size", 2.5),
     ("forward", "chunk_bytes", 0), ("projforward", "chunk_size", 0),
     ("projforward", "samples", 0), ("projforward", "samples", "4")],
)  # fmt: skip
def test_bad_chunk_options(name: str, option: str, value: object) -> None:
    with pytest.raises(ValueError, match=re.escape(BAD_CHUNK.format(name=option, value=value))):
        leangrad.engine(name, **{option: value})


def test_projforward_bad_distribution() -> None:
    with pytest.raises(ValueError, match=re.escape(BAD_DISTRIBUTION.format(value="uniform"))):
        leangrad.engine("projforward", distribution="uniform")


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)
    ).double()


def _bn_data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(4, 1, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1])


def test_checkpoint_updates_training_batchnorm_once() -> None:
    """Recomputation would update the running statistics a second time; the engine puts
    back their post-forward values, so they equal one autograd step's, with no warning."""
    model, ref_model, (x, y) = _bn_model(), _bn_model(), _bn_data()
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    loss_fn(ref_model(x)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        leangrad.engine("checkpoint").backward(model, x, loss_fn)
    for (n, b), r in zip(model.named_buffers(), ref_model.buffers(), strict=True):
        assert torch.equal(b, r), n
    assert compare_grads(grads_of(model), grads_of(ref_model)).max_rel_err <= 1e-10


# --- 5. BatchNorm under the forward-mode engines -----------------------------------------


@pytest.mark.parametrize(
    ("name", "options"),
    [("forward", {"chunk_size": 7}), ("projforward", {"samples": 5, "chunk_size": 2, "seed": 0})],
)
def test_forward_mode_engines_with_training_batchnorm(
    name: str, options: dict[str, object]
) -> None:
    """Gradients (forward) and loss equal autograd's, and running statistics equal those
    after one plain forward+backward: updated exactly once although many directions
    (chunks of the vmap) ran the forward pass."""
    (x, y), ref_model, model = _bn_data(), _bn_model(), _bn_model()
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    ref_loss = loss_fn(ref_model(x))
    ref_loss.backward()

    result = leangrad.engine(name, **options).backward(model, x, loss_fn)
    torch.testing.assert_close(result.loss, ref_loss.detach(), rtol=1e-12, atol=0)
    if engine_class(name).exact:
        assert compare_grads(grads_of(model), grads_of(ref_model)).max_rel_err <= 1e-10
    for (n, b), r in zip(model.named_buffers(), ref_model.buffers(), strict=True):
        torch.testing.assert_close(b, r, rtol=1e-12, atol=0, msg=n)


# --- 6. registry -----------------------------------------------------------------------


def test_registry_names() -> None:
    names = leangrad.available()
    exact, inexact = leangrad.available(exact=True), leangrad.available(exact=False)
    assert set(CORE) <= set(names)
    assert names == sorted(names)
    assert sorted(exact + inexact) == names and not set(exact) & set(inexact)
    # Among the core engines only the forward gradient is an estimator. (Equality with the
    # whole list would break as soon as another estimating engine is registered.)
    assert [n for n in inexact if n in CORE] == ["projforward"]
    for name in names:
        cls = engine_class(name)
        assert cls.name == name and cls.exact == (name in exact)


@pytest.mark.parametrize(
    ("name", "options", "label"),
    [
        ("backprop", {}, "backprop"),
        ("checkpoint", {}, "checkpoint"),
        ("checkpoint", {"segments": 4}, "checkpoint(segments=4)"),
        ("checkpoint", {"segments": "sqrt"}, "checkpoint(segments=sqrt)"),
        ("forward", {}, "forward"),
        ("projforward", {}, "projforward"),
        ("projforward", {"samples": 8}, "projforward(samples=8)"),
        ("projforward", {"samples": 8, "distribution": "rademacher"},
         "projforward(samples=8,distribution=rademacher)"),
    ],
)  # fmt: skip
def test_labels(name: str, options: dict[str, object], label: str) -> None:
    eng = leangrad.engine(name, **options)
    assert eng.label == label
    assert label in repr(eng)
    prob = _mlp_problem()
    assert eng.backward(prob.model, prob.inputs, prob.loss_fn).engine == label


def test_inputs_may_be_a_sequence() -> None:
    """``inputs`` may be a list of tensors; float32 models give a float32 StepResult."""
    model = models.mlp(3, 4, 1, 2)
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    res = leangrad.engine("backprop").backward(model, [x], lambda out: F.cross_entropy(out, y))
    assert isinstance(res, leangrad.StepResult) and res.loss.dtype == torch.float32
