"""Gradient accumulation (``accumulate``): micro-batches whose gradients
add up to the whole batch's — exact against autograd where the loss is declared a mean or
sum over examples (:func:`leangrad.loss.per_example`) and no layer couples them; refused,
naming why, everywhere else. Nothing here asserts a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from fuzz_models import DropPath, Sampled  # DropPath: stochastic depth as timm writes it
from helpers import reference_step
from leangrad import zoo
from leangrad._errors import EngineInputError
from leangrad.loss import PerExample, per_example
from leangrad.measure import compare_grads, profile_step
from leangrad.planner._plan import candidates

ENGINES = ("accumulate", "checkpoint+accumulate")


def _gpt(batch: int = 5, dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.Tensor,
                                                                     PerExample]:  # fmt: skip
    torch.manual_seed(0)
    model = zoo.gpt(vocab=64, dim=16, layers=2, heads=2, context=8).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (batch, 8), generator=gen)
    y = torch.randint(0, 64, (batch, 8), generator=gen)
    return model, x, per_example(lambda out, t: zoo.GPT.loss(out, t), y)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("name", ENGINES)
def test_exact_against_autograd_with_uneven_micro_batches(name: str, k: int) -> None:
    model, x, loss_fn = _gpt(batch=5)
    ref_loss, ref = reference_step(model, (x,), loss_fn)
    res = leangrad.engine(name, micro_batches=k).backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    assert compare_grads(got, ref).max_rel_err <= 1e-10
    torch.testing.assert_close(res.loss, ref_loss, rtol=1e-12, atol=0)
    assert res.info["micro_batches"] == k


def test_sum_reduction_and_several_inputs_and_targets() -> None:
    """Two inputs, two targets, a summed loss; input gradients as autograd's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.net(a * b)

    model = Two()
    a = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (7,))
    w = torch.rand(7, dtype=torch.float64)
    loss_fn = per_example(
        lambda out, t, s: (F.cross_entropy(out, t, reduction="none") * s).sum(), y, w,
        reduction="sum")  # fmt: skip
    ref_loss, ref = reference_step(model, (a, b), loss_fn)
    a_ref = a.grad.clone()  # type: ignore[union-attr]
    a.grad = None
    res = leangrad.engine("accumulate", micro_batches=3).backward(model, (a, b), loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-10
    torch.testing.assert_close(a.grad, a_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(res.loss, ref_loss, rtol=1e-12, atol=0)


def test_adds_to_an_existing_grad_and_calls_on_grad_once_with_the_whole_gradient() -> None:
    model, x, loss_fn = _gpt(batch=4)
    _, ref = reference_step(model, (x,), loss_fn)
    seen: dict[str, torch.Tensor] = {}

    def on_grad(name: str, p: nn.Parameter) -> None:
        assert name not in seen, f"on_grad twice for {name}"
        assert p.grad is not None
        seen[name] = p.grad.clone()

    leangrad.engine("checkpoint+accumulate", micro_batches=4).backward(model, x, loss_fn,
                                                                     on_grad=on_grad)  # fmt: skip
    assert set(seen) == set(ref)
    assert compare_grads(seen, ref).max_rel_err <= 1e-10
    # a second step adds to .grad, as loss.backward() does
    leangrad.engine("accumulate", micro_batches=2).backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, {n: 2 * g for n, g in ref.items()}).max_rel_err <= 1e-10


def test_with_chunked_cross_entropy_inside_each_micro_batch() -> None:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=2048, dim=16, layers=2, heads=2, context=8).double()
    x = torch.randint(0, 2048, (4, 8))
    loss_fn = per_example(lambda out, t: zoo.GPT.loss(out, t), torch.randint(0, 2048, (4, 8)))
    _, ref = reference_step(model, (x,), loss_fn)
    eng = leangrad.engine("checkpoint+chunked_ce+accumulate", micro_batches=2)
    eng.backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-10


def test_peak_falls_with_micro_batches() -> None:
    model, x, loss_fn = _gpt(batch=16, dtype=torch.float32)
    peaks = {k: profile_step(leangrad.engine("accumulate", micro_batches=k), model, x, loss_fn,
                             repeats=0).peak_bytes for k in (1, 4)}  # fmt: skip
    assert peaks[4] < 0.6 * peaks[1], peaks


def test_refuses_batchnorm_in_training_and_names_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    eng = leangrad.engine("accumulate")
    why = eng.supports(model)
    assert why is not None and "'1' (BatchNorm1d) couples the examples" in why
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    with pytest.raises(EngineInputError, match="BatchNorm1d"):
        eng.backward(model, x, per_example(F.cross_entropy, y))
    model.eval()  # running statistics: no coupling
    assert eng.supports(model) is None


def test_dropout_is_offered_for_its_draws_are_replayed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 2))
    assert leangrad.engine("accumulate").supports(model) is None
    assert leangrad.engine("checkpoint+accumulate").supports(model) is None


def test_refuses_a_loss_not_declared_per_example() -> None:
    model, x, loss_fn = _gpt(batch=4)
    y = loss_fn.targets[0]
    with pytest.raises(EngineInputError, match=r"leangrad\.loss\.per_example"):
        leangrad.engine("accumulate").backward(model, x, lambda out: zoo.GPT.loss(out, y))


def test_a_short_batch_runs_one_example_per_micro_batch_and_rows_must_match() -> None:
    model, x, loss_fn = _gpt(batch=3)
    _, ref = reference_step(model, (x,), loss_fn)
    res = leangrad.engine("accumulate", micro_batches=4).backward(model, x, loss_fn)
    assert res.info["micro_batches"] == 3
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-10
    with pytest.raises(EngineInputError, match="input 0 has 2 rows"):
        leangrad.engine("accumulate").backward(model, x[:2], loss_fn)


@pytest.mark.parametrize("base", ["forward", "projforward", "moonwalk", "revbackprop",
                                  "highway"])  # fmt: skip
def test_bases_that_do_not_take_it_refuse(base: str) -> None:
    with pytest.raises(EngineInputError, match=f"'{base}\\+accumulate' cannot work"):
        leangrad.engine(f"{base}+accumulate")


def test_bad_options_and_declarations() -> None:
    with pytest.raises(ValueError):
        leangrad.engine("accumulate", micro_batches=0)
    with pytest.raises(ValueError):
        per_example(F.cross_entropy, torch.zeros(3), reduction="none")
    with pytest.raises(EngineInputError, match="give the targets"):
        per_example(F.cross_entropy)
    with pytest.raises(EngineInputError, match="target 1 has 2 rows"):
        per_example(F.cross_entropy, torch.zeros(3), torch.zeros(2))


def test_plan_offers_it_only_where_exact() -> None:
    model, _, loss_fn = _gpt(batch=8, dtype=torch.float32)
    names = [(n, o.get("micro_batches")) for n, o in candidates(model, loss_fn=loss_fn)]
    assert ("accumulate", 8) in names and ("checkpoint+accumulate", 2) in names
    plain = [n for n, _ in candidates(model, loss_fn=lambda out: loss_fn(out))]
    assert not any("accumulate" in n for n in plain)
    coupled = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert not any("accumulate" in n for n, _ in candidates(
        coupled, loss_fn=per_example(F.mse_loss, torch.zeros(8, 4))))  # fmt: skip


def test_plan_offers_pytorchs_per_block_loop_and_it_is_exact() -> None:
    """Every block but the last checkpointed inside each micro-batch — what PyTorch's
    per-block loop does — is a candidate in a model run as written, and exact."""
    model, x, loss_fn = _gpt(batch=5)
    but_last = ["blocks.0"]  # of two blocks
    offered = [o for n, o in candidates(model, loss_fn=loss_fn) if n == "checkpoint+accumulate"]
    assert {"blocks": but_last, "micro_batches": 4} in offered
    assert {"blocks": but_last} in [o for n, o in candidates(model, loss_fn=loss_fn)
                                     if n == "checkpoint"]  # fmt: skip
    _, ref = reference_step(model, (x,), loss_fn)
    eng = leangrad.engine("checkpoint+accumulate", micro_batches=3, blocks=but_last)
    res = eng.backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref) and compare_grads(got, ref).max_rel_err <= 1e-10
    assert res.info["checkpointed"] == 1 and res.info["micro_batches"] == 3


@pytest.mark.slow
def test_plan_chooses_it_at_a_budget_only_micro_batches_meet() -> None:
    model, x, loss_fn = _gpt(batch=16, dtype=torch.float32)
    bp = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0)
    plan = leangrad.plan(model, x, loss_fn, budget=bp.baseline_bytes + bp.peak_bytes // 4,
                         repeats=1)  # fmt: skip
    assert plan.engine is not None and "accumulate" in plan.engine.label, str(plan)
    _, ref = reference_step(model, (x,), loss_fn)
    plan.engine.backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-5


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_plan_offers_time_chunks_inside_micro_batches_and_they_are_exact(cell: str) -> None:
    """A fused ``nn.LSTM``/``nn.GRU`` checkpointed in time chunks inside each micro-batch
    (what fits the zoo's recurrent LMs below ⅛ of backprop's peak, where 16 chunks alone
    stop at 0.14×) is a candidate, and exact with uneven micro-batches and chunks."""
    torch.manual_seed(0)
    model = zoo.rnn_lm(cell, vocab=16, embed=6, hidden=10).double()
    x, loss_fn = zoo.batch(f"{cell}_lm", model, 5, length=11)
    offered = [o for n, o in candidates(model, loss_fn=loss_fn) if n == "checkpoint+accumulate"]
    assert {"time_chunks": 16, "micro_batches": 4} in offered
    assert {"time_chunks": 4, "micro_batches": 2} in offered
    _, ref = reference_step(model, (x,), loss_fn)
    eng = leangrad.engine("checkpoint+accumulate", time_chunks=4, micro_batches=3)
    res = eng.backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref) and compare_grads(got, ref).max_rel_err <= 1e-10
    assert res.info["micro_batches"] == 3


def _padded(batch: int = 5) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The GPT with labels padded per example (-100 past each example's own length), as a
    Hugging Face collator pads a batch of texts of different lengths."""
    model, x, _ = _gpt(batch=batch)
    gen = torch.Generator().manual_seed(2)
    y = torch.randint(0, 64, (batch, 8), generator=gen)
    lengths = torch.tensor([8, 2, 5, 1, 7][:batch])
    y[torch.arange(8) >= lengths[:, None]] = -100
    return model, x, y


def _token_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("name", ENGINES)
def test_a_mean_over_tokens_weighs_each_micro_batch_by_its_counted_tokens(
        name: str, k: int) -> None:  # fmt: skip
    """Padded labels: each micro-batch's mean runs over its own non-ignored tokens, so its
    share of the batch's mean is its share of those tokens, not of the examples."""
    model, x, y = _padded()
    loss_fn = per_example(_token_mean, y, ignore_index=-100)
    ref_loss, ref = reference_step(model, (x,), loss_fn)
    res = leangrad.engine(name, micro_batches=k).backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-10
    torch.testing.assert_close(res.loss, ref_loss, rtol=1e-12, atol=0)


def test_a_micro_batch_without_a_counted_token_adds_nothing() -> None:
    model, x, y = _padded()
    y[1:3] = -100  # micro-batch 1 of 5 x 1 holds no counted token: its own mean is 0/0
    loss_fn = per_example(_token_mean, y, ignore_index=-100)
    _, ref = reference_step(model, (x,), loss_fn)
    res = leangrad.engine("accumulate", micro_batches=5).backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-10
    assert torch.isfinite(res.loss)


def test_padded_labels_declared_per_example_only_are_refused_not_weighted_wrongly() -> None:
    model, x, y = _padded()
    with pytest.raises(EngineInputError, match=r"-100 .*unequal numbers.*ignore_index=-100"):
        leangrad.engine("accumulate", micro_batches=2).backward(
            model, x, per_example(_token_mean, y))  # fmt: skip
    assert all(p.grad is None for p in model.parameters())  # refused before any micro-batch
    with pytest.raises(EngineInputError, match=r"one number per example"):
        per_example(_token_mean, y, counts=torch.ones(3))


class _Residual(nn.Module):
    def __init__(self, dim: int, p: float, functional: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = DropPath(p)
        self.p, self.functional = p, functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        h = F.dropout(h, self.p, self.training) if self.functional else self.drop(h)
        return x + h


class _Noisy(nn.Module):
    """Every kind of draw a forward makes: stochastic depth (one number per example),
    ``F.dropout`` on a channels-last activation, ``nn.Dropout`` and a noise vector shared by
    every example."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.drop = nn.Dropout(0.3)
        self.path = DropPath(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last)))
        h = F.dropout(h, 0.4, self.training)
        h = self.drop(h) + 0.1 * torch.randn(3, 1, 1, dtype=h.dtype)
        return x + self.path(h)


@pytest.mark.parametrize("functional", [False, True], ids=["drop-path", "F.dropout"])
@pytest.mark.parametrize("name", ENGINES)
def test_random_draws_are_replayed_as_the_whole_batch_draws_them(name: str,
                                                                 functional: bool) -> None:
    """Stochastic depth and ``F.dropout`` inside a ``forward``, found by watching: the
    micro-batches are handed the rows of what one forward of the whole batch draws, so the
    gradient and the RNG stream after the step are autograd's, also with uneven
    micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(_Residual(6, 0.5, functional), _Residual(6, 0.5, functional),
                          nn.Linear(6, 3)).double()  # fmt: skip
    x = torch.randn(7, 6, dtype=torch.float64)
    loss_fn = per_example(lambda out, t: F.cross_entropy(out, t), torch.arange(7) % 3)
    for k in (2, 3, 7):
        torch.manual_seed(5)
        _, ref = reference_step(model, (x,), loss_fn)
        after = torch.get_rng_state()
        torch.manual_seed(5)
        leangrad.engine(name, micro_batches=k).backward(model, x, loss_fn)
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert compare_grads(got, ref).max_rel_err <= 1e-10, k
        assert torch.equal(torch.get_rng_state(), after), k
        model.zero_grad(set_to_none=True)
    torch.manual_seed(6)  # another draw: another gradient (the draws matter)
    _, other = reference_step(model, (x,), loss_fn)
    assert compare_grads(other, ref).max_rel_err > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ENGINES)
def test_every_kind_of_draw_is_replayed(name: str, dtype: torch.dtype) -> None:
    """Per-example, elementwise on a channels-last tensor, ``nn.Dropout`` and a draw shared
    by the batch, stacked: autograd's gradient (float32: to rounding), input gradient and
    RNG stream."""
    torch.manual_seed(0)
    model = nn.Sequential(_Noisy(), _Noisy(), nn.Flatten(), nn.Linear(48, 3)).to(dtype)
    x = torch.randn(6, 3, 4, 4, dtype=dtype, requires_grad=True)
    loss_fn = per_example(lambda out, t: F.cross_entropy(out, t), torch.arange(6) % 3)
    torch.manual_seed(3)
    _, ref = reference_step(model, (x,), loss_fn)
    ref_x, x.grad = x.grad, None
    after = torch.get_rng_state()
    torch.manual_seed(3)
    leangrad.engine(name, micro_batches=3).backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert compare_grads(got, ref).max_rel_err <= tol
    torch.testing.assert_close(x.grad, ref_x, rtol=tol, atol=tol)
    assert torch.equal(torch.get_rng_state(), after)


class _OwnCheckpoint(nn.Module):
    """A block the model checkpoints itself, with dropout inside."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda h: self.drop(torch.tanh(self.fc(h))), x, use_reentrant=False)


def test_draws_that_cannot_be_replayed_are_refused_naming_the_module() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 0, 1])
    loss_fn = per_example(F.cross_entropy, y)
    model = nn.Sequential(nn.Linear(4, 4), Sampled(4), nn.Linear(4, 2))
    with pytest.raises(EngineInputError, match=r"'1' draws random numbers with bernoulli"
                                               r".*depends on its input's values"):
        leangrad.engine("accumulate").backward(model, x, loss_fn)
    assert all(p.grad is None for p in model.parameters())
    own = nn.Sequential(_OwnCheckpoint(), nn.Linear(4, 2))  # recomputed outside leangrad
    with pytest.raises(EngineInputError, match=r"during the backward pass outside leangrad"):
        leangrad.engine("accumulate").backward(own, x, loss_fn)
