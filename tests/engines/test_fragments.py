"""Fragmented recomputation along the batch (``checkpoint(fragments=k)``): each
checkpointed block runs its forward and its recomputation in ``k`` pieces of the batch
(:mod:`leangrad.engines.checkpoint._fragments`). Held to autograd: the same gradients
(parameters and inputs), the same loss, ``on_grad`` once per parameter, buffers and RNG as
autograd leaves them; blocks that couple their examples run whole and are named with the
reason. Nothing here asserts a time."""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from fuzz_models import DropPath, Sampled  # DropPath: stochastic depth as timm writes it
from helpers import next_token_loss, reference_step, resnet_problem, tiny_gpt2
from leangrad import zoo
from leangrad.engines.checkpoint import _fragments
from leangrad.engines.checkpoint._fragments import fragment_edges
from leangrad.measure import compare_grads, profile_step

LossFn = Callable[[Any], torch.Tensor]
Grads = dict[str, torch.Tensor]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


# ---------------------------------------------------------------------------------------
# helpers


def _grads(model: nn.Module) -> Grads:
    """The ``.grad`` the step left (those that are not None), then cleared."""
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return got


def _check(model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: LossFn, *,
           seed: int | None = None, **options: Any) -> leangrad.StepResult:  # fmt: skip
    """One ``checkpoint`` step with ``options``, held to autograd (``seed``: reseed the global
    RNG before each, for layers that draw): the same parameters get a ``.grad`` (None stays
    None), within :data:`TOL`, and the same loss."""
    dtype = next(model.parameters()).dtype
    if seed is not None:
        torch.manual_seed(seed)
    ref_loss, ref = reference_step(model, xs, loss_fn)
    if seed is not None:
        torch.manual_seed(seed)
    res = leangrad.engine("checkpoint", **options).backward(model, xs, loss_fn)
    got = _grads(model)
    assert set(got) == set(ref), f"grads on {sorted(set(got) ^ set(ref))} differ from autograd"
    cmp = compare_grads(got, ref)
    assert cmp.max_rel_err <= TOL[dtype], (cmp.max_rel_err, cmp.worst_param)
    torch.testing.assert_close(res.loss.detach(), ref_loss, rtol=TOL[dtype], atol=0)
    return res


def _check_rng(model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: LossFn, *,
               seed: int, **options: Any) -> leangrad.StepResult:  # fmt: skip
    """:func:`_check`, and the global RNG after the step where autograd's step leaves it."""
    torch.manual_seed(seed)
    reference_step(model, xs, loss_fn)
    after_autograd = torch.get_rng_state()
    res = _check(model, xs, loss_fn, seed=seed, **options)
    assert torch.equal(torch.get_rng_state(), after_autograd)
    return res


class _Spy:
    """What the fragmented blocks ran: per call, the fragments' row ranges and each tensor
    argument's shape and whether it was cut along the batch."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[int, int]]] = []
        self.args: list[list[tuple[tuple[int, ...], bool]]] = []


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _Spy:
    seen = _Spy()
    apply = _fragments._apply

    def recording(call: Any, tensors: list[torch.Tensor], params: list[nn.Parameter]) -> Any:
        seen.edges.append(list(call.edges))
        seen.args.append([(tuple(t.shape), s) for t, s in zip(tensors, call.split, strict=True)])
        return apply(call, tensors, params)

    monkeypatch.setattr(_fragments, "_apply", recording)
    return seen


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """transformers warns about tiny configs; not findings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Residual(nn.Module):
    """``x + f(x)``, recording the batch size of every call (``seen``)."""

    def __init__(self, f: nn.Module) -> None:
        super().__init__()
        self.f = f
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return x + self.f(x)


def _mlp(dim: int) -> Residual:
    return Residual(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)))


def _mse(target: torch.Tensor) -> LossFn:
    return lambda out: F.mse_loss(out, target)


def _sequential(*middle: nn.Module, dim: int = 8, batch: int = 7,
                dtype: torch.dtype = torch.float64
                ) -> tuple[nn.Sequential, torch.Tensor, LossFn]:  # fmt: skip
    """``Sequential(mlp, *middle, mlp, mlp)`` with a batch and an MSE loss."""
    torch.manual_seed(0)
    model = nn.Sequential(_mlp(dim), *middle, _mlp(dim), _mlp(dim)).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, dim, generator=gen).to(dtype)
    return model, x, _mse(torch.randn(batch, dim, generator=gen).to(dtype))


ZOO = ("gpt", "bert", "vit", "lstm_lm", "gru_lm")


def _zoo(name: str, batch: int, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, LossFn]:
    torch.manual_seed(0)
    models: dict[str, Callable[[], nn.Module]] = {
        "gpt": lambda: zoo.gpt(vocab=64, dim=16, layers=2, heads=2, context=8),
        "bert": lambda: zoo.bert(vocab=64, dim=16, layers=2, heads=2, context=8),
        "vit": lambda: zoo.vit(image=8, patch=4, dim=16, layers=2, heads=2),
        "lstm_lm": lambda: zoo.rnn_lm("lstm", vocab=32, embed=16, hidden=16),
        "gru_lm": lambda: zoo.rnn_lm("gru", vocab=32, embed=16, hidden=16),
    }
    model = models[name]().to(dtype)
    x, loss_fn = zoo.batch(name, model, batch, length=6, image=8)
    return model, (x.to(dtype) if x.is_floating_point() else x), loss_fn


def _sizes(rows: int, k: int) -> list[int]:
    return [b - a for a, b in fragment_edges(rows, k)]


# ---------------------------------------------------------------------------------------
# 1. exact gradients where every block can be split


def test_fragment_edges_are_contiguous_near_equal_and_one_row_at_least() -> None:
    assert fragment_edges(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert fragment_edges(5, 2) == [(0, 2), (2, 5)]
    assert fragment_edges(3, 8) == [(0, 1), (1, 2), (2, 3)]  # fewer rows than fragments
    for rows in range(1, 12):
        for k in (2, 3, 8):
            edges = fragment_edges(rows, k)
            assert edges[0][0] == 0 and edges[-1][1] == rows
            assert all(b == c for (_, b), (c, _) in itertools.pairwise(edges))
            sizes = [b - a for a, b in edges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
            assert len(edges) == min(k, rows)


@pytest.mark.parametrize("k", [2, 3, 8])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_exact_in_float64(name: str, k: int, spy: _Spy) -> None:
    batch = 5
    model, x, loss_fn = _zoo(name, batch, torch.float64)
    res = _check(model, (x,), loss_fn, fragments=k)
    assert res.info["whole"] == {}
    assert res.engine == f"checkpoint(fragments={k})"
    # the blocks really ran in fragments (not whole): k pieces of the 5 rows (one row
    # each where k > 5)
    assert spy.edges, "no block ran in fragments"
    assert all(e == fragment_edges(batch, k) for e in spy.edges)
    assert len(spy.edges[0]) == min(k, batch)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_exact_in_float32(name: str, spy: _Spy) -> None:
    model, x, loss_fn = _zoo(name, 7, torch.float32)
    res = _check(model, (x,), loss_fn, fragments=3)
    assert res.info["whole"] == {}
    assert spy.edges


def test_lstm_state_outputs_have_their_batch_second(spy: _Spy) -> None:
    """An ``nn.LSTM`` returns ``(out, (h, c))`` with ``h`` and ``c`` of shape ``(layers, N,
    H)``: the probe finds their batch dimension and the fragments are stitched along it."""
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cells = nn.ModuleList(nn.LSTM(6, 6, batch_first=True) for _ in range(2))
            self.head = nn.Linear(12, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hs = []
            for cell in self.cells:
                x, (h, c) = cell(x)
                hs.append(h[-1] + c[-1])
            return self.head(torch.cat(hs, -1)) + x.mean(1)[:, :3]

    model = Stack().double()
    x = torch.randn(5, 4, 6, dtype=torch.float64)
    res = _check(model, (x,), _mse(torch.randn(5, 3, dtype=torch.float64)), fragments=2)
    assert res.info["whole"] == {}
    assert len(spy.edges) == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_time_first_layers_are_cut_along_their_second_dimension(
    spy: _Spy, dtype: torch.dtype
) -> None:
    """Time-first recurrent layers (``(T, N, H)``: ``nn.GRU`` without ``batch_first``,
    leangrad's ``GRULayer`` in a ``HighwayNet``) mix along their first dimension (time), so
    the probe refuses it and tries the second, where their examples are: cut there, exact,
    none run whole."""
    from leangrad.highway import GRULayer

    torch.manual_seed(0)

    class TimeFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.ModuleList([nn.GRU(6, 6), nn.GRU(6, 6)])
            self.cell = nn.ModuleList([GRULayer(6, 6)])
            self.head = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, T, 6)
            h = x.transpose(0, 1)
            for g in self.gru:
                h = g(h)[0] + h
            h = self.cell[0](h)
            return self.head(h.mean(0))

    model = TimeFirst().to(dtype)
    x = torch.randn(6, 5, 6, dtype=dtype)
    names = ["gru.0", "gru.1", "cell.0"]
    res = _check(model, (x,), _mse(torch.randn(6, 3, dtype=dtype)), fragments=3, blocks=names)
    assert res.info["whole"] == {}
    assert spy.edges and all(e == [(0, 2), (2, 4), (4, 6)] for e in spy.edges)  # N = 6, T = 5


@pytest.mark.parametrize("segments", [None, 2])
@pytest.mark.parametrize("k", [2, 3, 8])
def test_sequential_of_mlp_blocks_are_exact_and_recomputed_in_pieces(
    k: int, segments: int | None
) -> None:
    """An ``nn.Sequential`` of residual MLP blocks, one block holding a layer the loss never
    uses: exact, that layer's ``.grad`` stays None, and a recomputed block never sees the
    whole batch of 7 — after its probes (1 row: does it write its input in place; then
    2 rows, each alone) it runs the fragments twice (the forward, then the recomputation in
    the backward)."""
    unused, spare = _mlp(8), nn.Linear(8, 8)
    unused.spare = spare  # registered, never called
    model, x, loss_fn = _sequential(unused, batch=7)
    res = _check(model, (x,), loss_fn, fragments=k, segments=segments)
    assert res.info["whole"] == {}
    assert spare.weight.grad is None and spare.bias.grad is None
    blocks: list[Residual] = list(model)  # type: ignore[arg-type]
    recomputed = blocks[:3] if segments is None else blocks[:2]  # the last segment is plain
    pieces = _sizes(7, k)
    for block in recomputed:
        # autograd's forward (7), then the engine's probes (in-place writes; both, then
        # each alone) and two passes of fragments
        assert block.seen == [7, 1, 2, 1, 1, *pieces, *pieces], block.seen
    for block in blocks[len(recomputed) :]:
        assert block.seen == [7, 7]  # autograd's forward, then the engine's, whole
    if segments is None:
        assert res.info["segments"] == 4
    else:
        assert res.info["segments"] == 2


def test_second_step_with_another_batch_size_adds_to_grad(spy: _Spy) -> None:
    """The probe's verdict is kept per kind of call, not per batch size: a later step with 5
    rows instead of 7 is exact and adds to ``.grad`` as ``loss.backward()`` does."""
    model, x, loss_fn = _sequential(batch=7)
    _, ref7 = reference_step(model, (x,), loss_fn)
    x5, y5 = x[:5].clone(), torch.randn(5, 8, dtype=torch.float64)
    _, ref5 = reference_step(model, (x5,), _mse(y5))
    eng = leangrad.engine("checkpoint", fragments=3)
    eng.backward(model, x, loss_fn)
    res = eng.backward(model, x5, _mse(y5))
    got = _grads(model)
    assert compare_grads(got, {n: ref7[n] + ref5[n] for n in ref7}).max_rel_err <= 1e-10
    assert res.info["whole"] == {}
    assert spy.edges[-1] == fragment_edges(5, 3)


def test_trace_and_fragments_together() -> None:
    model, x, loss_fn = _sequential(batch=5)
    res = _check(model, (x,), loss_fn, fragments=2, trace=True)
    assert res.info["whole"] == {}


# ---------------------------------------------------------------------------------------
# 2. input gradients


def test_input_gradient_of_a_conv_net_with_groupnorm(spy: _Spy) -> None:
    torch.manual_seed(0)

    def conv_block(c: int) -> Residual:
        return Residual(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c),
                                      nn.SiLU(), nn.Conv2d(c, c, 3, padding=1)))  # fmt: skip

    model = nn.Sequential(conv_block(4), conv_block(4), conv_block(4),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, 6, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 3, (5,), generator=gen)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    _, ref = reference_step(model, (x,), loss_fn)
    x_ref = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    res = leangrad.engine("checkpoint", fragments=3).backward(model, x, loss_fn)
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_ref, rtol=1e-10, atol=1e-12)
    assert res.info["whole"] == {}
    # the first block's input is x itself: cut along the batch, its gradient stitched
    assert spy.args[0][0] == ((5, 4, 6, 6), True)


def test_input_gradient_of_vit() -> None:
    model, x, loss_fn = _zoo("vit", 5, torch.float64)
    x.requires_grad_(True)
    _, ref = reference_step(model, (x,), loss_fn)
    x_ref = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    leangrad.engine("checkpoint", fragments=2).backward(model, x, loss_fn)
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_ref, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------------------------------
# 3. blocks that cannot be split run whole, named with the reason


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def _resnet_batch(dtype: torch.dtype = torch.float64, batch: int = 5
                  ) -> tuple[nn.Module, torch.Tensor, LossFn]:  # fmt: skip
    torch.manual_seed(0)
    model = zoo.resnet(10, width=4).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 8, 8, generator=gen).to(dtype)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    return model, x, loss_fn


@pytest.mark.parametrize("k", [2, 3, 5])
def test_batchnorm_blocks_run_in_fragments_exactly_with_running_stats_as_autograd(
        k: int, spy: _Spy) -> None:  # fmt: skip
    """Training-mode BatchNorm: the forward keeps each call's statistics, fragments are
    recomputed with them frozen and the backward's whole-batch sums gathered in passes
    (_fragments_bn); the running statistics advance once, as under autograd."""
    model, x, loss_fn = _resnet_batch()
    start = copy.deepcopy(model.state_dict())
    _, ref = reference_step(model, (x,), loss_fn)
    ref_buffers = _buffers(model)
    model.load_state_dict(start)
    res = leangrad.engine("checkpoint", fragments=k).backward(model, x, loss_fn)
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
    assert res.info["whole"] == {}
    assert spy.edges  # the blocks really ran in pieces
    after = _buffers(model)
    assert after["stem.1.num_batches_tracked"] == 1  # advanced once, as under autograd
    for n, b in ref_buffers.items():
        torch.testing.assert_close(after[n], b, rtol=1e-12, atol=0, msg=n)


def test_batchnorm_fragments_in_float32_and_with_input_gradients() -> None:
    model, x, loss_fn = _resnet_batch(torch.float32, batch=6)
    x.requires_grad_(True)
    _, ref = reference_step(model, (x,), loss_fn)
    assert x.grad is not None
    ref_x = x.grad.clone()
    x.grad = None
    leangrad.engine("checkpoint", fragments=3).backward(model, x, loss_fn)
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-4
    torch.testing.assert_close(x.grad, ref_x, rtol=1e-4, atol=1e-6)


class BnMlp(nn.Module):
    """Linear, BatchNorm1d (options varied), ReLU, Linear, BatchNorm1d: two BatchNorms in
    series, on ``(N, C)`` inputs (no spatial dimensions)."""

    def __init__(self, dim: int, **bn: Any) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.n1, self.n2 = nn.BatchNorm1d(dim, **bn), nn.BatchNorm1d(dim, **bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.n2(self.b(torch.relu(self.n1(self.a(x)))))


@pytest.mark.parametrize("bn", [{}, {"momentum": None}, {"affine": False},
                                {"track_running_stats": False}])  # fmt: skip
def test_batchnorm1d_options_in_fragments(bn: dict[str, Any]) -> None:
    model, x, loss_fn = _sequential(BnMlp(8, **bn).double(), batch=7)
    start = copy.deepcopy(model.state_dict())
    _, ref = reference_step(model, (x,), loss_fn)
    ref_buffers = _buffers(model)
    model.load_state_dict(start)
    res = leangrad.engine("checkpoint", fragments=3).backward(model, x, loss_fn)
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
    assert res.info["whole"] == {}
    after = _buffers(model)
    for n, b in ref_buffers.items():
        torch.testing.assert_close(after[n], b, rtol=1e-12, atol=0, msg=n)


def test_batchnorm_beside_dropout_runs_in_fragments_with_the_draws_replayed() -> None:
    """The BatchNorm passes recompute each fragment several times; every time it gets its
    rows of the one mask the forward drew for the whole batch."""
    block = Residual(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.4),
                                   nn.Linear(8, 8)))  # fmt: skip
    model, x, loss_fn = _sequential(block, batch=7)
    res = _check_rng(model, (x,), loss_fn, seed=2, fragments=2)
    assert res.info["whole"] == {}


def test_batchnorm_fragments_lower_the_peak() -> None:
    model, x, loss_fn = resnet_problem(width=8, batch=16, side=16)
    plain = profile_step(leangrad.engine("checkpoint"), model, x, loss_fn, repeats=0)
    cut = profile_step(leangrad.engine("checkpoint", fragments=4), model, x, loss_fn, repeats=0)
    assert cut.peak_bytes <= 0.9 * plain.peak_bytes


def test_a_dropout_block_runs_in_fragments_too(spy: _Spy) -> None:
    drop = Residual(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8)))
    model, x, loss_fn = _sequential(drop, batch=7)
    res = _check(model, (x,), loss_fn, seed=3, fragments=2)
    assert res.info["whole"] == {}
    assert len(spy.edges) == 3  # blocks 0, 1 and 2 (block 3 is the plain last segment)
    model.eval()
    res = _check(model, (x,), loss_fn, fragments=2)
    assert res.info["whole"] == {}


def test_a_draw_that_cannot_be_replayed_runs_whole_named() -> None:
    model, x, loss_fn = _sequential(Sampled(8, residual=True).double(), batch=6)
    res = _check_rng(model, (x,), loss_fn, seed=6, fragments=2)
    assert set(res.info["whole"]) == {"1"}
    assert "bernoulli.default" in res.info["whole"]["1"]
    assert "depends on its input's values" in res.info["whole"]["1"]


class Centered(nn.Module):
    """Subtracts the batch mean: mixes the examples with no module saying so."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return x + (h - h.mean(0, keepdim=True))


def test_a_block_that_mixes_examples_is_found_by_the_probe() -> None:
    model, x, loss_fn = _sequential(Centered(8).double(), batch=7)
    res = _check(model, (x,), loss_fn, fragments=3)
    assert set(res.info["whole"]) == {"1"}
    assert "mixes" in res.info["whole"]["1"]
    # the verdict is kept: a second step runs it whole again, still exact
    res = _check(model, (x,), loss_fn, fragments=3)
    assert "mixes" in res.info["whole"]["1"]


def test_a_mixing_block_is_not_hidden_by_two_equal_first_examples() -> None:
    model, x, loss_fn = _sequential(Centered(8).double(), batch=7)
    x[1] = x[0]
    res = _check(model, (x,), loss_fn, fragments=3)
    assert "1" in res.info["whole"]


class Reader(nn.Module):
    """Reads the weight of a Linear it does not own (a plain reference, not a submodule)."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.lin = nn.Linear(other.in_features, other.in_features)
        object.__setattr__(self, "other", other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        other: nn.Linear = self.__dict__["other"]
        return x + torch.tanh(self.lin(x) + F.linear(x, other.weight))


def test_a_block_reading_another_modules_parameter_runs_whole() -> None:
    torch.manual_seed(0)
    ext = nn.Linear(8, 8)
    model = nn.Sequential(Reader(ext), _mlp(8), Reader(ext), ext).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    loss_fn = _mse(torch.randn(5, 8, generator=gen, dtype=torch.float64))
    _, ref = reference_step(model, (x,), loss_fn)
    res = leangrad.engine("checkpoint", fragments=2).backward(model, x, loss_fn)
    got = _grads(model)
    assert compare_grads(got, ref).max_rel_err <= 1e-10
    # the outside weight: read by both readers and run as the last block
    torch.testing.assert_close(got["3.weight"], ref["3.weight"], rtol=1e-10, atol=0)
    whole = res.info["whole"]
    assert set(whole) == {"0", "2"}
    assert all("1 parameter(s) that are not the block's" in w for w in whole.values())


class Counting(nn.Module):
    """Counts its forward calls in a buffer, in place."""

    calls: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.lin(x))


def test_a_block_updating_a_buffer_runs_whole_and_the_buffer_advances_once() -> None:
    counting = Counting(8).double()
    model, x, loss_fn = _sequential(counting, batch=5)
    reference_step(model, (x,), loss_fn)
    assert int(counting.calls) == 1  # autograd: one forward
    eng = leangrad.engine("checkpoint", fragments=2)
    for step in (2, 3):  # the first step probes, the second reuses the verdict
        _, ref = reference_step(copy.deepcopy(model), (x,), loss_fn)
        res = eng.backward(model, x, loss_fn)
        assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
        assert int(counting.calls) == step
        assert set(res.info["whole"]) == {"1"}
        why = res.info["whole"]["1"]
        assert "buffer" in why and "calls" in why


def test_a_batch_of_one_runs_whole() -> None:
    model, x, loss_fn = _zoo("gpt", 1, torch.float64)
    res = _check(model, (x,), loss_fn, fragments=4)
    assert set(res.info["whole"]) == {"blocks.0", "blocks.1"}
    assert all("one example" in w for w in res.info["whole"].values())


# ---------------------------------------------------------------------------------------
# 4. shared parameters and on_grad


class Tied(nn.Module):
    """A residual block around a Linear it shares with another block."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(shared.out_features, shared.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.own(torch.tanh(self.shared(x)))


def _on_grad_check(model: nn.Module, x: torch.Tensor, loss_fn: LossFn, **options: Any) -> None:
    """Exact, and ``on_grad`` called once per parameter with its final gradient."""
    _, ref = reference_step(model, (x,), loss_fn)
    calls: dict[str, list[torch.Tensor]] = {}

    def on_grad(name: str, p: nn.Parameter) -> None:
        assert p.grad is not None
        calls.setdefault(name, []).append(p.grad.clone())

    res = leangrad.engine("checkpoint", **options).backward(model, x, loss_fn, on_grad=on_grad)
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
    assert set(calls) == set(ref)
    assert all(len(v) == 1 for v in calls.values()), {n: len(v) for n, v in calls.items()}
    assert compare_grads({n: v[0] for n, v in calls.items()}, ref).max_rel_err <= 1e-10
    assert res.info["whole"] == {}


@pytest.mark.parametrize("k", [2, 8])
def test_a_linear_shared_by_two_blocks_of_a_sequential(k: int) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(8, 12)
    model = nn.Sequential(Tied(shared), _mlp(8), Tied(shared), _mlp(8)).double()
    x = torch.randn(5, 8, dtype=torch.float64)
    _on_grad_check(model, x, _mse(torch.randn(5, 8, dtype=torch.float64)), fragments=k)


def test_a_block_called_twice_by_a_model_as_written() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            block = _mlp(8)
            self.inp = nn.Linear(8, 8)
            self.blocks = nn.ModuleList([block, _mlp(8), block])  # one block, two places
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    torch.manual_seed(0)
    model = Twice().double()
    x = torch.randn(7, 8, dtype=torch.float64)
    _on_grad_check(model, x, _mse(torch.randn(7, 3, dtype=torch.float64)), fragments=3)


# ---------------------------------------------------------------------------------------
# 5. keyword arguments, tensors without a batch dimension


class MaskedBlock(nn.Module):
    """Self-attention with an additive mask ``(1, 1, T, T)`` broadcast over the batch, a
    padding mask ``(N, T)`` and a position bias ``(T, D)`` (all keyword arguments)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, pad: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x + bias)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads) + mask
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, d)
        return x + self.proj(out) * pad[..., None]


class MaskedNet(nn.Module):
    def __init__(self, dim: int = 8, length: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.1)  # reaches the blocks as `bias`
        self.blocks = nn.ModuleList(MaskedBlock(dim, 2) for _ in range(2))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        h = self.inp(x)
        bias = self.pos * 2.0  # not a leaf: its gradient must come out of the fragments
        for block in self.blocks:
            h = block(h, mask=mask, pad=pad, bias=bias)
        return self.head(h)


def test_keyword_arguments_with_and_without_a_batch_dimension(spy: _Spy) -> None:
    torch.manual_seed(0)
    model = MaskedNet().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, 4, generator=gen, dtype=torch.float64)
    pad = (torch.rand(5, 6, generator=gen) > 0.3).double()
    loss_fn = _mse(torch.randn(5, 6, 3, generator=gen, dtype=torch.float64))
    res = _check(model, (x, pad), loss_fn, fragments=3)
    assert res.info["whole"] == {}
    assert len(spy.args) == 2
    for args in spy.args:  # the batch-shaped ones cut, the others whole to every fragment
        assert sorted(args) == sorted([((5, 6, 8), True), ((1, 1, 6, 6), False),
                                       ((5, 6), True), ((6, 8), False)])  # fmt: skip


def test_hugging_face_gpt2_with_an_attention_mask(spy: _Spy) -> None:
    gpt2 = tiny_gpt2(dim=32, layers=2)

    class WithMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = self.gpt2(input_ids=ids, attention_mask=mask).logits
            return logits

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (5, 8), generator=gen)
    mask = torch.ones(5, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding on two rows
    mask[3, :2] = 0
    res = _check(WithMask(), (ids, mask), next_token_loss(ids), fragments=2)
    assert res.info["whole"] == {}
    assert len(spy.edges) == 2 and all(e == fragment_edges(5, 2) for e in spy.edges)


# ---------------------------------------------------------------------------------------
# 6. options


@pytest.mark.parametrize("bad", [1, 0, -2, True, False, "2", 2.0])
def test_bad_fragments_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="fragments must be an int >= 2"):
        leangrad.engine("checkpoint", fragments=bad)


def test_label() -> None:
    assert leangrad.engine("checkpoint", fragments=4).label == "checkpoint(fragments=4)"
    assert leangrad.engine("checkpoint", fragments=None).label == "checkpoint"


def test_explain_names_fragmented_and_whole_blocks() -> None:
    model, _, _ = _sequential(nn.BatchNorm1d(8), nn.Dropout(0.1), batch=5)
    lines = leangrad.explain(leangrad.engine("checkpoint", fragments=2), model).lines
    rows = {line.split()[0]: line for line in lines[1:6]}  # block name -> its line
    assert set(rows) == {"0", "1", "2", "3", "4"}
    for name in ("0", "3"):
        assert "in 2 fragments of the batch" in rows[name]
    assert "in 2 fragments" in rows["1"] and "BatchNorm: its statistics frozen" in rows["1"]
    assert "in 2 fragments" in rows["2"]  # dropout: its draws replayed
    assert "fragments" not in rows["4"]  # the plain last segment


# ---------------------------------------------------------------------------------------
# 7. composition


@pytest.mark.parametrize("name", ["checkpoint+fad", "checkpoint+chunked_ce",
                                  "checkpoint+chunked_ce+fad"])  # fmt: skip
def test_composed_with_transforms(name: str, spy: _Spy) -> None:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=1024, dim=16, layers=2, heads=2, context=8).double()
    x, loss_fn = zoo.batch("gpt", model, 5, length=8)
    ref_loss, ref = reference_step(model, (x,), loss_fn)
    eng = leangrad.engine(name, fragments=2)
    assert eng.label.startswith("checkpoint(fragments=2)+")
    res = eng.backward(model, x, loss_fn)
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
    torch.testing.assert_close(res.loss.detach(), ref_loss, rtol=1e-12, atol=0)
    assert res.info["whole"] == {}
    assert len(spy.edges) == 2
    if "chunked_ce" in name:  # the head was really swapped
        assert "head" in res.info["chunked_ce"]["model"]["swapped"]


# ---------------------------------------------------------------------------------------
# 8. memory


def test_peak_falls_with_fragments() -> None:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=64, dim=64, layers=2, heads=2, context=64)
    x, loss_fn = zoo.batch("gpt", model, 8, length=64)
    peaks = {k: profile_step(leangrad.engine("checkpoint", fragments=k), model, x, loss_fn,
                             repeats=0).peak_bytes for k in (None, 4)}  # fmt: skip
    assert peaks[4] <= 0.9 * peaks[None], peaks


# ---------------------------------------------------------------------------------------
# 9. RNG


def test_the_probe_leaves_the_global_rng_as_it_found_it() -> None:
    """The probe runs each block extra times; none of that moves the global RNG, neither
    on a model that draws nothing nor on a block drawing noise without a module (whose
    draws the fragments then replay: the step draws exactly what autograd draws)."""
    model, x, loss_fn = _zoo("gpt", 5, torch.float64)
    before = torch.get_rng_state()
    res = leangrad.engine("checkpoint", fragments=2).backward(model, x, loss_fn)
    model.zero_grad(set_to_none=True)
    assert res.info["whole"] == {}
    assert torch.equal(torch.get_rng_state(), before)

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.lin(x) + 0.1 * torch.randn_like(x)

    model2, x2, loss_fn2 = _sequential(Noisy().double(), batch=5)
    res = _check_rng(model2, (x2,), loss_fn2, seed=7, fragments=2)
    assert res.info["whole"] == {}


# ---------------------------------------------------------------------------------------
# bugs found while writing this module


class PositionBias(nn.Module):
    """``tanh(lin(x)) + pos`` with a learned ``(1, D)`` bias: on a one-row fragment the
    bias's gradient is the block's output gradient itself, not a copy."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.pos = nn.Parameter(torch.randn(1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.pos


class ParentResidual(nn.Module):
    """``h = h + block(h)`` written in the parent: the block's output gradient is the same
    tensor autograd hands the residual branch."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(PositionBias(dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return h




@pytest.mark.parametrize("reduction", ["mean_square", "sum"])
@pytest.mark.parametrize(("batch", "k"), [
    (6, 2),  # fragments of 3 rows: the bias's gradient is a sum, a tensor of its own
    (3, 2),  # 1, 2 rows: the first fragment's gradient is a view of the output's
    (3, 8),  # 1 row each
])  # fmt: skip
def test_a_bias_parameter_on_a_one_row_fragment(batch: int, k: int, reduction: str) -> None:
    torch.manual_seed(0)
    model = ParentResidual().double()
    x = torch.randn(batch, 4, dtype=torch.float64)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.sum() if reduction == "sum" else out.pow(2).mean()

    _check(model, (x,), loss_fn, fragments=k)


class WithNone(nn.Module):
    """Returns ``(h, None)``, as blocks that return an optional cache or attention map do."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + torch.tanh(self.lin(x)), None


def test_a_block_returning_none_beside_its_output() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(WithNone(8) for _ in range(2))
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x, nothing = block(x)
                assert nothing is None
            return self.head(x)

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(5, 8, dtype=torch.float64)
    res = _check(model, (x,), _mse(torch.randn(5, 3, dtype=torch.float64)), fragments=2)
    assert res.info["whole"] == {}


@pytest.mark.parametrize("opts", [{"sequence_fragments": 4},
                                  {"sequence_fragments": 3, "fragments": 2}])  # fmt: skip
def test_sequence_fragments_are_exact_and_leave_attention_whole(opts: dict[str, int]) -> None:
    """``sequence_fragments``: the token-wise children of each block (the MLP) run in pieces
    of the sequence; attention mixes positions, so its probe runs it whole."""
    from leangrad.engines.checkpoint._engine import Checkpoint, _ByPosition

    torch.manual_seed(0)
    model = zoo.gpt(vocab=32, dim=16, layers=2, heads=2, context=16).double()
    x, loss_fn = zoo.batch("gpt", model, 2, length=11)
    _check(model, (x,), loss_fn, **opts)
    eng = leangrad.engine("checkpoint", **opts)
    assert isinstance(eng, Checkpoint)
    eng.backward(model, x, loss_fn)
    wrapped = eng._wrapped.get(model, lambda m: m)  # the prepared copy the step ran
    split = [m.fragmenter.last for m in wrapped.modules() if isinstance(m, _ByPosition)]
    assert split == [None, None]  # each block's MLP (the only child with two layers)


def test_sequence_fragments_refuse_bad_counts() -> None:
    for bad in (1, 0, True, "4"):
        with pytest.raises(ValueError):
            leangrad.engine("checkpoint", sequence_fragments=bad)


class ConvBnAct(nn.Module):
    """conv → BatchNorm → an activation written in place (``nn.ReLU(inplace=True)``, as in
    torchvision's and timm's ResNets; ``F.silu(inplace=True)`` as timm's BatchNormAct2d),
    twice, with a residual: the normalised output is overwritten before the block ends."""

    def __init__(self, ch: int, act: str) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv2d(ch, ch, 3, padding=1)
        self.n1, self.n2 = nn.BatchNorm2d(ch), nn.BatchNorm2d(ch)
        self.act = act

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "relu":
            return F.relu(x, inplace=True)
        if self.act == "silu":
            return F.silu(x, inplace=True)
        return F.hardswish(x, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._act(self.n1(self.c1(x)))
        return self._act(self.n2(self.c2(h)) + x)


def _off_init(model: nn.Module) -> nn.Module:
    """Norm weights ~U(0.5, 1.5), biases ~N(0, 0.1): off the initial symmetries that hide
    wrong gradients (BatchNorm's γ = 1, β = 0)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if name.endswith("weight")
                        else torch.randn(p.shape, generator=gen) * 0.1)  # fmt: skip
    return model


@pytest.mark.parametrize("act", ["relu", "silu", "hardswish"])
@pytest.mark.parametrize("k", [2, 3])
def test_batchnorm_followed_by_an_in_place_activation_stays_exact(act: str, k: int,
                                                                   spy: _Spy) -> None:  # fmt: skip
    """The recomputation hands the block a copy of each BatchNorm output it overwrites in
    place, so the whole-batch sums are of BatchNorm's own output gradient (they were of the
    activation's: relative error 0.18 on two such blocks)."""
    torch.manual_seed(0)
    model = _off_init(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ConvBnAct(4, act),
                                    ConvBnAct(4, act), ConvBnAct(4, act), nn.Flatten(),
                                    nn.Linear(4 * 36, 5))).double()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (6,), generator=gen)
    start = copy.deepcopy(model.state_dict())
    _, ref = reference_step(model, (x,), lambda out: F.cross_entropy(out, y))
    ref_buffers = _buffers(model)
    model.load_state_dict(start)
    res = leangrad.engine("checkpoint", fragments=k).backward(
        model, x, lambda out: F.cross_entropy(out, y))  # fmt: skip
    assert compare_grads(_grads(model), ref).max_rel_err <= 1e-10
    assert res.info["whole"] == {} and spy.edges  # really in fragments
    for n, b in _buffers(model).items():
        torch.testing.assert_close(b, ref_buffers[n], rtol=1e-12, atol=0, msg=n)


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_stochastic_depth_is_found_by_watching_its_draws_and_replayed(p: float) -> None:
    """Whatever the probe's own draws happen to drop (p=0.05 on two examples seldom drops
    one), the block's draws are found and replayed in its fragments: the step is
    autograd's under the same seed, leaving the global RNG where autograd's step leaves
    it."""
    block = Residual(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), DropPath(p)))
    model, x, loss_fn = _sequential(block, batch=6)
    res = _check_rng(model, (x,), loss_fn, seed=4, fragments=2)
    assert res.info["whole"] == {}


def test_functional_dropout_inside_a_forward_runs_in_fragments() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + F.dropout(torch.tanh(self.lin(x)), 0.3, self.training)

    model, x, loss_fn = _sequential(Block(), batch=6)
    res = _check(model, (x,), loss_fn, seed=5, fragments=3)
    assert res.info["whole"] == {}
    model.eval()  # the verdict follows the training flags
    res = _check(model, (x,), loss_fn, fragments=3)
    assert res.info["whole"] == {}
