"""Two-level checkpointing (``checkpoint(levels=2)``): outer segments of
block calls keep only their first input through the forward; the other inputs are rebuilt
in the backward
(:mod:`leangrad.engines.checkpoint._two_level`). Held to autograd: the same gradients
(parameters and inputs), the same loss, ``.grad`` None-ness, dropout masks, BatchNorm
statistics advancing once, the global RNG as autograd leaves it; alone and with
``fragments=``. Nothing here asserts a time."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from helpers import next_token_loss, tiny_gpt2
from leangrad import _errors as E
from leangrad import zoo
from leangrad.engines.checkpoint import _fragments
from leangrad.engines.checkpoint._two_level import BAD_LEVELS, LEVELS_AND_AUTO, outer_segments
from leangrad.measure import compare_grads, profile_step

LossFn = Callable[[Any], torch.Tensor]
Grads = dict[str, torch.Tensor]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """transformers warns about tiny configs; not findings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _reference(model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: LossFn,
               seed: int) -> tuple[torch.Tensor, Grads, dict[str, torch.Tensor],
                                   torch.Tensor, list[torch.Tensor | None]]:  # fmt: skip
    """Autograd from a copy of ``model``: loss, gradients, buffers after, RNG state after,
    the inputs' gradients."""
    ref = copy.deepcopy(model)
    xs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in xs)
    torch.manual_seed(seed)
    loss = loss_fn(ref(*xs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    bufs = {n: b.clone() for n, b in ref.named_buffers()}
    return (loss.detach(), grads, bufs, torch.get_rng_state(),
            [None if x.grad is None else x.grad.clone() for x in xs])  # fmt: skip


def _check(model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: LossFn, *, seed: int = 0,
           **options: Any) -> leangrad.StepResult:  # fmt: skip
    """One ``checkpoint(levels=2, **options)`` step held to autograd (same seed before
    both): loss, the same parameters with a ``.grad`` (None stays None) within
    :data:`TOL`, buffers, the global RNG state, inputs' gradients."""
    dtype = next(model.parameters()).dtype
    ref_loss, ref, ref_bufs, ref_rng, ref_xgrads = _reference(model, xs, loss_fn, seed)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    res = leangrad.engine("checkpoint", levels=2, **options).backward(model, xs, loss_fn)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert set(got) == set(ref), f"grads on {sorted(set(got) ^ set(ref))} differ from autograd"
    cmp = compare_grads(got, ref)
    assert cmp.max_rel_err <= TOL[dtype], (cmp.max_rel_err, cmp.worst_param)
    torch.testing.assert_close(res.loss, ref_loss, rtol=TOL[dtype], atol=0)
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, ref_bufs[n], rtol=1e-12, atol=1e-14, msg=n)
    assert torch.equal(torch.get_rng_state(), ref_rng), "the RNG stream advanced differently"
    for x, g in zip(xs, ref_xgrads, strict=True):
        assert (x.grad is None) == (g is None)
        if g is not None:
            torch.testing.assert_close(x.grad, g, rtol=TOL[dtype], atol=TOL[dtype] * 1e-2)
            x.grad = None
    return res


def _zoo(name: str, dtype: torch.dtype, *, layers: int = 5,
         batch: int = 4) -> tuple[nn.Module, torch.Tensor, LossFn]:  # fmt: skip
    torch.manual_seed(0)
    models: dict[str, Callable[[], nn.Module]] = {
        "gpt": lambda: zoo.gpt(vocab=64, dim=16, layers=layers, heads=2, context=8),
        "llama": lambda: zoo.llama(vocab=64, dim=16, layers=layers, heads=2, context=8),
        "bert": lambda: zoo.bert(vocab=64, dim=16, layers=layers, heads=2, context=8),
        "vit": lambda: zoo.vit(image=8, patch=4, dim=16, layers=layers, heads=2),
        "resnet": lambda: zoo.resnet(18, width=4),  # 8 blocks, training-mode BatchNorm
    }
    model = models[name]().to(dtype).train()
    x, loss_fn = zoo.batch(name, model, batch, length=6, image=8)
    return model, (x.to(dtype) if x.is_floating_point() else x), loss_fn


ZOO = ("gpt", "llama", "bert", "vit", "resnet")


# ---------------------------------------------------------------------------------------
# 1. exact on the zoo's models as written, alone and with fragments


@pytest.mark.parametrize("fragments", [None, 2])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_exact_in_float64(name: str, fragments: int | None) -> None:
    model, x, loss_fn = _zoo(name, torch.float64)
    res = _check(model, (x,), loss_fn, fragments=fragments)
    n = res.info["blocks"]
    assert res.engine.startswith("checkpoint(") and "levels=2" in res.engine
    assert res.info["levels"] == 2 and res.info["checkpointed"] == n
    # ⌈√n⌉ outer segments, every input but each segment's first dropped, and rebuilt
    assert res.info["segments"] == outer_segments(n, None)
    assert res.info["dropped"] == n - res.info["segments"]
    assert res.info["rebuilt"] == res.info["dropped"]
    if fragments is not None:
        assert res.info["whole"] == {}  # BatchNorm too: frozen statistics


@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_exact_in_float32(name: str) -> None:
    model, x, loss_fn = _zoo(name, torch.float32)
    res = _check(model, (x,), loss_fn, fragments=2, segments=2)
    assert res.info["segments"] == 2 and res.info["dropped"] == res.info["blocks"] - 2


def test_input_gradient_of_vit_with_fragments() -> None:
    model, x, loss_fn = _zoo("vit", torch.float64)
    x.requires_grad_(True)
    _check(model, (x,), loss_fn, fragments=2)


def test_resnet_batchnorm_statistics_advance_once() -> None:
    """Training-mode BatchNorm: the rebuild runs the blocks again, which moves their
    running statistics; they end as autograd leaves them (checked by _check), and the
    counters advanced once."""
    model, x, loss_fn = _zoo("resnet", torch.float64)
    _check(model, (x,), loss_fn)
    counts = {n: int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
    assert counts and set(counts.values()) == {1}


# ---------------------------------------------------------------------------------------
# 2. dropout: the rebuild draws the forward's masks


def _gpt2(dropout: float) -> tuple[nn.Module, torch.Tensor, LossFn]:
    gpt2 = tiny_gpt2(dim=16, layers=5, dropout=dropout)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = self.gpt2(input_ids=ids).logits
            return logits

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return LM(), ids, next_token_loss(ids)


@pytest.mark.parametrize("fragments", [None, 2])
def test_hugging_face_gpt2_with_dropout(fragments: int | None) -> None:
    """GPT-2 with dropout in its blocks (Hugging Face: blocks take keyword arguments and
    return tuples): exact only if every rebuilt block draws the forward's masks."""
    model, ids, loss_fn = _gpt2(0.2)
    res = _check(model, (ids,), loss_fn, seed=3, fragments=fragments)
    assert res.info["dropped"] == 5 - 3 and res.info["rebuilt"] == 2
    if fragments is not None:  # each fragment gets its rows of the whole batch's masks
        assert res.info["whole"] == {}


class DropBlock(nn.Module):
    """A residual MLP with dropout inside, and a layer drawing from a generator of its own
    (as leangrad.rad's layers do)."""

    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.3)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=self.gen, dtype=x.dtype)
        return x + self.drop(torch.tanh(self.lin(x))) * noise


class DropNet(nn.Module):
    def __init__(self, dim: int = 6, layers: int = 7) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(DropBlock(dim, i) for i in range(layers))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _mse_problem(build: Callable[[], nn.Module], features: int,
                 outputs: int) -> tuple[nn.Module, torch.Tensor, LossFn]:  # fmt: skip
    """``build()`` in float64 from seed 0, a batch of 5 that wants its gradient and an MSE
    loss against random targets."""
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(5, features, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, outputs, dtype=torch.float64)
    return model, x, lambda out: F.mse_loss(out, y)


def test_dropout_and_layer_generators_replayed_and_left_where_autograd_leaves_them() -> None:
    model, x, loss_fn = _mse_problem(DropNet, 4, 3)
    ref = copy.deepcopy(model)
    res = _check(model, (x,), loss_fn, seed=5)
    assert res.info["segments"] == 3 and res.info["dropped"] == 4
    for a, b in zip(model.blocks, ref.blocks, strict=True):  # one draw each, as autograd
        torch.rand((5, 6), generator=b.gen, dtype=torch.float64)
        assert torch.equal(a.gen.get_state(), b.gen.get_state())


# ---------------------------------------------------------------------------------------
# 3. sequences of blocks, .grad None-ness, where inputs cannot be dropped


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"segments": 3},
        {"fragments": 3},
        {"fragments": 2, "sequence_fragments": 2, "trace": True},
    ],
)
def test_sequential_exact_with_an_unused_parameter(opts: dict[str, Any]) -> None:
    torch.manual_seed(0)
    spare = _Spare(8)
    model = nn.Sequential(*(Residual(8) for _ in range(4)), spare, Residual(8)).double()
    x = torch.randn(7, 5, 8, dtype=torch.float64)
    y = torch.randn(7, 5, 8, dtype=torch.float64)
    res = _check(model, (x,), lambda out: F.mse_loss(out, y), **opts)
    assert spare.unused.weight.grad is None
    assert res.info["segments"] == opts.get("segments", 3)
    assert res.info["dropped"] == 6 - res.info["segments"]


class _Spare(Residual):
    """A block holding a layer it never calls (autograd leaves its ``.grad`` None)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.unused = nn.Linear(dim, dim)


class Between(nn.Module):
    """Blocks with something computed between them (``h * 2``) and a block called twice:
    those inputs are not a block's output, so they are kept, and the step stays exact."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(6) for _ in range(6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                h = h * 2
            if i == 3:
                h = block(h)  # blocks.3 again
        return self.head(h)


def test_inputs_that_are_not_the_previous_output_are_kept() -> None:
    model, x, loss_fn = _mse_problem(Between, 6, 2)
    res = _check(model, (x,), loss_fn, segments=1)
    # one outer segment by count, cut where blocks.2 takes h * 2: 7 calls in 2 chains, 5
    # inputs dropped (blocks.3's second call takes its first call's output: rebuilt by
    # running that call again)
    assert res.info["segments"] == 2 and res.info["dropped"] == 5


class InPlace(nn.Module):
    """Changes the kept input of the first outer segment in place after the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        out = self.blocks[1](self.blocks[0](h))
        h.mul_(3)  # the kept input of blocks.0, changed
        return self.blocks[3](self.blocks[2](out))


def test_a_kept_input_changed_in_place_is_refused() -> None:
    torch.manual_seed(0)
    model = InPlace().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    eng = leangrad.engine("checkpoint", levels=2, segments=2)
    with pytest.raises(
        E.EngineInputError,
        match=r"block call 0 \(blocks.0\): its input, .* "
        r"changed in place .*or use levels=1",
    ):
        eng.backward(model, x, lambda out: out.square().mean())


# ---------------------------------------------------------------------------------------
# 4. options, label, explain


@pytest.mark.parametrize("bad", [0, 3, True, "2", 2.0])
def test_bad_levels_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="levels must be 1"):
        leangrad.engine("checkpoint", levels=bad)
    assert "{value!r}" in BAD_LEVELS


def test_auto_segments_and_time_chunks_are_refused_with_two_levels() -> None:
    with pytest.raises(ValueError, match="segments='auto'") as err:
        leangrad.engine("checkpoint", levels=2, segments="auto")
    assert str(err.value) == LEVELS_AND_AUTO
    with pytest.raises(ValueError, match="time_chunks= and levels=2"):
        leangrad.engine("checkpoint", levels=2, time_chunks=4)


def test_label_and_segments_on_a_model_as_written() -> None:
    assert leangrad.engine("checkpoint", levels=2).label == "checkpoint(levels=2)"
    assert leangrad.engine("checkpoint", levels=1).label == "checkpoint"
    model, _, _ = _zoo("gpt", torch.float64)
    # one level: segments= needs a sequence; two levels: outer segments of any model
    assert leangrad.engine("checkpoint", segments=2).supports(model) is not None
    assert leangrad.engine("checkpoint", levels=2, segments=2).supports(model) is None


def test_outer_segments() -> None:
    assert [outer_segments(n, None) for n in (1, 2, 4, 5, 8, 9, 16, 17)] == \
        [1, 2, 2, 3, 3, 3, 4, 5]  # fmt: skip
    assert outer_segments(8, "sqrt") == 3 and outer_segments(8, 2) == 2
    assert outer_segments(3, 10) == 3


def test_explain_shows_the_two_levels() -> None:
    model, _, _ = _zoo("gpt", torch.float64)
    text = str(leangrad.explain(leangrad.engine("checkpoint", levels=2, fragments=2), model))
    rows = {line.split()[0]: line for line in text.splitlines()[2:7]}
    assert set(rows) == {f"blocks.{i}" for i in range(5)}
    for name in ("blocks.0", "blocks.2", "blocks.3"):  # 5 blocks: outer segments 2, 1, 2
        assert "input kept" in rows[name], rows[name]
    for name in ("blocks.1", "blocks.4"):
        assert "input rebuilt" in rows[name], rows[name]
    assert "outer segment 3/3" in rows["blocks.4"]
    assert all("in 2 fragments of the batch" in r for r in rows.values())
    assert "two levels: 3 outer segments" in text


# ---------------------------------------------------------------------------------------
# 5. memory: where the boundaries dominate, two levels lower the peak


@pytest.mark.slow
def test_peak_falls_below_plain_checkpoint_on_a_deep_narrow_gpt() -> None:
    """16 layers of width 16 on 16 x 32 tokens: each block's input (32 KiB) is small
    beside its internals, but sixteen of them are most of what per-block checkpointing
    keeps. Two levels keep 4 and rebuild at most 4 at a time."""
    torch.manual_seed(0)
    model = zoo.gpt(vocab=32, dim=16, layers=16, heads=2, context=32)
    x, loss_fn = zoo.batch("gpt", model, 16, length=32)
    peaks, kept = {}, {}
    for label, opts in {"plain": {}, "two": {"levels": 2}, "frag": {"fragments": 4},
                        "two+frag": {"levels": 2, "fragments": 4}}.items():  # fmt: skip
        prof = profile_step(leangrad.engine("checkpoint", **opts), model, x, loss_fn, repeats=0)
        peaks[label], kept[label] = prof.peak_bytes, prof.kept_bytes
    boundary = 16 * 32 * 16 * 4
    assert kept["plain"] - kept["two"] >= 12 * boundary, kept  # 16 inputs kept -> 4
    assert peaks["two"] <= peaks["plain"] - 4 * boundary, peaks
    assert peaks["two+frag"] <= 0.8 * peaks["frag"], peaks
    assert peaks["two+frag"] < peaks["two"] < peaks["plain"]


def test_rebuild_runs_blocks_in_the_forwards_fragments(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fragments, a rebuilt block runs in the same pieces of the batch as its forward
    did (never the whole block's internals at once)."""
    seen: list[list[tuple[int, int]]] = []
    apply = _fragments._apply

    def recording(call: Any, tensors: list[torch.Tensor], params: list[nn.Parameter]) -> Any:
        seen.append(list(call.edges))
        return apply(call, tensors, params)

    monkeypatch.setattr(_fragments, "_apply", recording)
    model, x, loss_fn = _zoo("gpt", torch.float64)
    res = _check(model, (x,), loss_fn, fragments=2)
    # 5 forward calls, then 2 rebuilt boundaries, each a call in the same 2 pieces
    assert len(seen) == 5 + res.info["rebuilt"] == 7
    assert all(e == seen[0] and len(e) == 2 for e in seen)


# ---------------------------------------------------------------------------------------
# 6. autocast: the rebuild runs under the forward's autocast


@pytest.mark.parametrize("fragments", [None, 3])
def test_under_autocast_equal_to_autograd_under_the_same_autocast(fragments: int | None) -> None:
    """bfloat16 autocast on the CPU: without fragments bit for bit (the rebuilt boundaries
    are the forward's, computed by the same ops); with fragments within bf16 rounding of
    the split ops, as ``fragments`` alone."""
    model, x, loss_fn = _zoo("gpt", torch.float32, batch=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(model(x)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    eng = leangrad.engine("checkpoint", levels=2, fragments=fragments)
    assert eng.autocast_why() is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = eng.backward(model, x, loss_fn)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref) and res.info["rebuilt"] == 2
    if fragments is None:
        for n, g in ref.items():
            assert torch.equal(got[n], g), n
    else:
        assert compare_grads(got, ref).cosine >= 0.999
