"""Tests of leangrad.highway and the ``highway`` engine: exactness at k = L for every
built-in decomposition (Theorem 2), the CumSumProd scans against the loop of eq. 9, and
the errors for bad input.

Tolerances (the issue's targets): at k = L the engine must equal autograd to a max-norm
relative error of 1e-12 in float64 and 1e-5 in float32, both engines run in the same
dtype (they differ only in summation order: hand-written vjps, batched matmuls, scans).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.engines._highway import BAD_BASELINE, BAD_K, BAD_SCAN, BAD_TOL
from leangrad.highway import (
    GRULayer,
    HighwayBlock,
    HighwayError,
    HighwayNet,
    LSTMLayer,
    PostLNSublayer,
    PostReLUBlock,
    PreActBlock,
    PreLNSublayer,
    ResidualStack,
    cumsumprod,
    cumsumprod_parallel,
    cumsumprod_sequential,
)
from leangrad.layers._highway import (
    BAD_GAMMA,
    BAD_K_SHAPE,
    BAD_K_STRUCTURE,
    MISMATCHED_SIZES,
    NOT_HIGHWAY,
    SHORT_SEQUENCE,
)
from leangrad.measure import compare_grads, grads_of

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
VOCAB, STEPS, BATCH, HIDDEN = 7, 9, 3, 5


def _rnn_problem(kind: str, *, steps: int = STEPS, layers: int = 2):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cls = GRULayer if kind == "gru" else LSTMLayer
    stacks = [cls(HIDDEN, HIDDEN, residual=i > 0) for i in range(layers)]
    net = HighwayNet(nn.Embedding(VOCAB, HIDDEN), stacks, nn.Linear(HIDDEN, VOCAB))
    tokens = torch.randint(0, VOCAB, (steps, BATCH))
    targets = torch.randint(0, VOCAB, (steps, BATCH))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:  # per-step losses (language modelling)
        return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))

    return net, (tokens,), loss_fn, steps


def _deep_problem(kind: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    if kind in ("preact", "postrelu"):
        blk = PreActBlock if kind == "preact" else PostReLUBlock
        stack = ResidualStack([blk(3) for _ in range(4)])
        net = HighwayNet(
            nn.Conv2d(2, 3, 3, padding=1), [stack], nn.Sequential(nn.Flatten(), nn.Linear(48, 4))
        )
        x, y = torch.randn(4, 2, 4, 4), torch.randint(0, 4, (4,))
        return net, (x,), lambda out: F.cross_entropy(out, y), 4
    blk_cls, gamma = {
        "preln": (PreLNSublayer, 0.0), "preln-gamma": (PreLNSublayer, 0.2),
        "postln": (PostLNSublayer, 0.0), "postln-gamma": (PostLNSublayer, 0.8),
    }[kind]  # fmt: skip
    blocks = [blk_cls(6, 2, kind=k, gamma=gamma) for k in ("attention", "mlp") * 2]
    net = HighwayNet(nn.Linear(3, 6), [ResidualStack(blocks)], nn.Linear(6, 2))
    x, y = torch.randn(2, 5, 3), torch.randn(2, 5, 2)
    return net, (x,), lambda out: F.mse_loss(out, y), 4


KINDS = ("gru", "lstm", "preact", "postrelu", "preln", "preln-gamma", "postln", "postln-gamma")


def _problem(kind: str):  # type: ignore[no-untyped-def]
    return _rnn_problem(kind) if kind in ("gru", "lstm") else _deep_problem(kind)


def _grads(engine: leangrad.engines.Engine, net: nn.Module, inputs, loss_fn):  # type: ignore[no-untyped-def]
    net.zero_grad(set_to_none=True)
    engine.backward(net, inputs, loss_fn)
    return grads_of(net)


def _cast(inputs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


@pytest.mark.parametrize("baseline", ["highway", "fpi"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_exact_at_k_equal_L(kind: str, dtype: torch.dtype, baseline: str) -> None:
    """Theorem 2: after k = L iterations w^k is the exact gradient, for every built-in."""
    net, inputs, loss_fn, length = _problem(kind)
    net = net.to(dtype)
    inputs = _cast(inputs, dtype)
    ref = _grads(leangrad.engine("backprop"), copy.deepcopy(net), inputs, loss_fn)
    got = _grads(leangrad.engine("highway", k=length, baseline=baseline), net, inputs, loss_fn)
    assert compare_grads(got, ref).max_rel_err <= TOL[dtype]


@pytest.mark.parametrize("kind", ["gru", "preact", "postln"])
def test_approximation_improves_and_is_exact_from_L_minus_1(kind: str) -> None:
    """k = 0 is an approximation (paths through no block); k = L − 1 is already exact
    (w^k_i is exact for k ≥ L − i) and more iterations change nothing; both scans agree."""
    net, inputs, loss_fn, length = _problem(kind)
    net, inputs = net.double(), _cast(inputs, torch.float64)
    ref = _grads(leangrad.engine("backprop"), copy.deepcopy(net), inputs, loss_fn)
    errs = {
        k: compare_grads(
            _grads(leangrad.engine("highway", k=k), copy.deepcopy(net), inputs, loss_fn), ref
        ).max_rel_err
        for k in (0, length - 1)
    }
    assert errs[0] > 1e-3
    assert errs[length - 1] <= 1e-12
    seq = _grads(leangrad.engine("highway", k=1, scan="sequential"), copy.deepcopy(net),
                 inputs, loss_fn)  # fmt: skip
    par = _grads(leangrad.engine("highway", k=1, scan="parallel"), copy.deepcopy(net),
                 inputs, loss_fn)  # fmt: skip
    assert compare_grads(seq, par).max_rel_err <= 1e-12


@pytest.mark.parametrize("baseline", ["highway", "fpi"])
@pytest.mark.parametrize("scan", ["sequential", "parallel"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_lstm_scans_only_where_k_acts(k: int, scan: str, baseline: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """K = diag([f, 0]) moves only c, and the loss's direct gradients reach only h: the
    engine scans the c half alone and skips eq. 10's scan — the same gradient, at every k,
    as scanning the whole state."""
    net, inputs, loss_fn, _ = _rnn_problem("lstm")
    net, inputs = net.double(), _cast(inputs, torch.float64)
    eng = leangrad.engine("highway", k=k, scan=scan, baseline=baseline)
    part = _grads(eng, copy.deepcopy(net), inputs, loss_fn)
    prepare = LSTMLayer.prepare

    def whole_state_k(self: LSTMLayer, trace) -> None:  # type: ignore[no-untyped-def]
        prepare(self, trace)
        if trace.k.shape[-1] == self.hidden_size:  # K on the whole state: [f, 0]
            trace.k = torch.cat([trace.k, torch.zeros_like(trace.k)], -1)

    monkeypatch.setattr(LSTMLayer, "prepare", whole_state_k)
    monkeypatch.setattr(LSTMLayer, "k_support", lambda self: None)
    monkeypatch.setattr(LSTMLayer, "direct_off_support", False)
    whole = _grads(eng, copy.deepcopy(net), inputs, loss_fn)
    assert compare_grads(part, whole).max_rel_err <= 1e-12


def test_step_info_reports_iterations_and_adaptive_stop() -> None:
    """info counts iterations per stack (capped at L − 1); with tol the loop stops once an
    update's relative norm is below tol, and every update but the last is above it."""
    net, inputs, loss_fn, length = _rnn_problem("gru")
    net = net.double()
    res = leangrad.engine("highway", k=100).backward(net, inputs, loss_fn)
    assert res.info["iterations"] == [length - 1, length - 1]
    res = leangrad.engine("highway", k=100, tol=1e-3).backward(net, inputs, loss_fn)
    for iters, updates in zip(res.info["iterations"], res.info["updates"], strict=True):
        assert len(updates) == iters
        assert all(u >= 1e-3 for u in updates[:-1])
        assert updates[-1] < 1e-3 or iters == length - 1


# --- CumSumProd ------------------------------------------------------------------------


def _loop(v: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
    """Eq. 12 written out: u[t] = Σ_{j≥t} v[j] k[j] … k[t+1]."""
    out = torch.zeros_like(v)
    for t in range(v.shape[0]):
        for j in range(t, v.shape[0]):
            term = v[j].clone()
            for m in range(j, t, -1):
                term = term * (1 if k is None else k[m])
            out[t] += term
    return out


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("structure", ["identity", "scalar", "diagonal"])
def test_cumsumprod_scans_match_eq_12(length: int, structure: str) -> None:
    torch.manual_seed(length)
    v = torch.randn(length, 2, 3, dtype=torch.float64)
    k = {
        "identity": None,
        "scalar": torch.rand(length, 1, 1, dtype=torch.float64),
        "diagonal": torch.rand(length, 2, 3, dtype=torch.float64),
    }[structure]
    want = _loop(v, k)
    for fn in (cumsumprod_parallel, cumsumprod_sequential):
        torch.testing.assert_close(fn(v, k), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cumsumprod(v, k, scan="auto"), want, rtol=1e-12, atol=1e-12)


# --- bad input -------------------------------------------------------------------------


class _DenseK(HighwayBlock):
    k_structure = "dense"

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def r(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x + z

    def r_z_vjp(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w


class _WrongShapeK(_DenseK):
    k_structure = "diagonal"

    def k_factor(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x[..., :1]


def test_unsupported_k_structure_is_rejected() -> None:
    msg = BAD_K_STRUCTURE.format(
        block="_DenseK", known="identity, scalar, diagonal", value="dense"
    )
    with pytest.raises(HighwayError, match=re.escape(msg)):
        ResidualStack([_DenseK()])


def test_k_factor_of_wrong_shape_is_rejected() -> None:
    stack = ResidualStack([_WrongShapeK()])
    msg = BAD_K_SHAPE.format(
        block="ResidualStack.blocks[0] (_WrongShapeK)", structure="diagonal", want="(2, 3)",
        got="(2, 1)",
    )  # fmt: skip
    with pytest.raises(HighwayError, match=re.escape(msg)):
        leangrad.engine("highway").backward(stack, torch.randn(2, 3), lambda y: y.sum())


@pytest.mark.parametrize("k", [-1, 1.5, True])
def test_bad_k_is_rejected(k: object) -> None:
    with pytest.raises(HighwayError, match=re.escape(BAD_K.format(value=k))):
        leangrad.engine("highway", k=k)


def test_bad_options_are_rejected() -> None:
    with pytest.raises(HighwayError, match=re.escape(BAD_SCAN.format(
            known="parallel, sequential, auto", value="fast"))):  # fmt: skip
        leangrad.engine("highway", scan="fast")
    with pytest.raises(HighwayError, match=re.escape(BAD_BASELINE.format(value="bp"))):
        leangrad.engine("highway", baseline="bp")
    with pytest.raises(HighwayError, match=re.escape(BAD_TOL.format(value=0))):
        leangrad.engine("highway", tol=0)


@pytest.mark.parametrize("length", [0, 1])
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_sequences_of_length_0_or_1_are_rejected(kind: str, length: int) -> None:
    net, inputs, _, _ = _rnn_problem(kind, steps=max(length, 1), layers=1)
    tokens = inputs[0][:length]
    name = "GRULayer" if kind == "gru" else "LSTMLayer"
    # An empty input is refused by every engine before any work (the engine contract),
    # naming the empty dimension: the sequence, not the batch (class 9).
    msg = SHORT_SEQUENCE.format(where=name, length=length) if length else (
        "input 0 has sequence length 0"
    )
    error = HighwayError if length else leangrad.EngineInputError
    with pytest.raises(error, match=re.escape(msg)):
        leangrad.engine("highway").backward(net, (tokens,), lambda out: out.sum())


@pytest.mark.parametrize("cls", [PreLNSublayer, PostLNSublayer])
@pytest.mark.parametrize("gamma", [-0.1, 1.5])
def test_gamma_outside_unit_interval_is_rejected(cls: type, gamma: float) -> None:
    with pytest.raises(HighwayError, match=re.escape(BAD_GAMMA.format(
            block=cls.__name__, gamma=gamma))):  # fmt: skip
        cls(4, gamma=gamma)


def test_mismatched_hidden_sizes_are_rejected() -> None:
    msg = MISMATCHED_SIZES.format(
        where="GRULayer(residual=True)", detail="input_size 3 != hidden_size 4"
    )
    with pytest.raises(HighwayError, match=re.escape(msg)):
        GRULayer(3, 4, residual=True)
    msg = MISMATCHED_SIZES.format(
        where="HighwayNet.stacks[0] -> stacks[1]", detail="hidden_size 4 feeds input_size 5"
    )
    with pytest.raises(HighwayError, match=re.escape(msg)):
        HighwayNet(None, [LSTMLayer(3, 4), LSTMLayer(5, 5)], None)
    layer = GRULayer(3, 4)
    msg = MISMATCHED_SIZES.format(
        where="GRULayer", detail="expected input (L, batch, 3), got (5, 2, 6)"
    )
    with pytest.raises(HighwayError, match=re.escape(msg)):
        layer(torch.randn(5, 2, 6))


def test_non_highway_model_is_refused_with_the_fix() -> None:
    eng = leangrad.engine("highway")
    model = nn.Sequential(nn.Linear(2, 2))
    reason = eng.supports(model)
    assert reason == NOT_HIGHWAY.format(model="Sequential")
    with pytest.raises(leangrad.EngineInputError, match=re.escape(reason)):
        eng.backward(model, torch.randn(3, 2), lambda y: y.sum())


# --- diagnostics -----------------------------------------------------------------------


def test_convergence_reaches_exact_and_shares_sum_to_the_gradient() -> None:
    """Cosine 1 and zero error at k = L − 1; the iteration steps g_k − g_{k−1} telescope,
    so their norms bound the gradient's norm (triangle inequality: Σ shares ≥ 1)."""
    from leangrad.highway import convergence, suggest_k

    net, inputs, loss_fn, length = _rnn_problem("gru", layers=1)
    net = net.double()
    before = {n: p.grad for n, p in net.named_parameters()}
    pts = convergence(net, inputs, loss_fn, ks=range(length))
    assert [p.k for p in pts] == list(range(length))
    assert pts[-1].cosine == pytest.approx(1.0, abs=1e-12)
    assert pts[-1].rel_err <= 1e-12
    assert sum(p.step_share for p in pts) >= 1 - 1e-12
    assert all(p.grad is before[n] for n, p in net.named_parameters())
    k = suggest_k(net, inputs, loss_fn, target_cosine=0.999, k_max=length - 1)
    assert pts[k].cosine >= 0.999 and all(p.cosine < 0.999 for p in pts[:k])


def test_k_schedule_rises_from_start_to_end_and_rejects_bad_bounds() -> None:
    from leangrad.highway import KSchedule
    from leangrad.highway._diagnostics import BAD_SCHEDULE

    lin = KSchedule(start=0, end=4, steps=100)
    ks = [lin(s) for s in range(0, 121, 10)]
    assert ks[0] == 0 and ks[-1] == 4 and ks == sorted(ks)
    step = KSchedule(start=1, end=3, steps=10, kind="step")
    assert [step(s) for s in (0, 4, 5, 20)] == [1, 1, 3, 3]
    msg = BAD_SCHEDULE.format(start=3, end=1, steps=10, kind="linear")
    with pytest.raises(HighwayError, match=re.escape(msg)):
        KSchedule(start=3, end=1, steps=10)


@pytest.mark.parametrize("rows", [3, 7])
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_chunked_vjps_are_exact(kind: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GRU/LSTM J-vjp and parameter vjp run over chunks of steps (1 and 2 steps of
    batch 3 here, with a ragged last chunk): still exact at k = L."""
    import leangrad.highway._recurrent as rec

    monkeypatch.setattr(rec, "CHUNK_ROWS", rows)
    net, inputs, loss_fn, length = _rnn_problem(kind)
    net = net.double()
    ref = _grads(leangrad.engine("backprop"), copy.deepcopy(net), inputs, loss_fn)
    got = _grads(leangrad.engine("highway", k=length), net, inputs, loss_fn)
    assert compare_grads(got, ref).max_rel_err <= 1e-12


def test_k0_is_the_residual_path_only_gradient() -> None:
    """Theorem 2 at k = 0, pre-activation ResNet (K = I): every block sees the head's
    cotangent at its output, i.e. autograd of x + Σ_t g_t(h_t) with each block's input
    h_t detached (only paths through no other block)."""
    net, inputs, loss_fn, _ = _deep_problem("preact")
    net = net.double().eval()  # BatchNorm in eval mode: the same function twice
    inputs = _cast(inputs, torch.float64)
    got = _grads(leangrad.engine("highway", k=0), net, inputs, loss_fn)
    net.zero_grad(set_to_none=True)
    x = net.stem(*inputs).detach()
    h, total = x, x
    for blk in net.stacks[0].blocks:
        z = blk.g(h.detach())
        total = total + z
        h = (h + z).detach()
    loss_fn(net.head(total)).backward()
    want = grads_of(net)
    blocks = [n for n in want if n.startswith("stacks.")]
    assert blocks
    cmp = compare_grads({n: got[n] for n in blocks}, {n: want[n] for n in blocks})
    assert cmp.max_rel_err < 1e-12
