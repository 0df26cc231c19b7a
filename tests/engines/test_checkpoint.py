"""``checkpoint(trace=True)``: recomputed blocks run as torch.fx code, whose intermediates
die at their last use — and only where that is safe. Behaviour by bytes (the tracker) and
by gradients against autograd, never by time."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import leangrad
from leangrad import zoo
from leangrad.engines.checkpoint._engine import traced
from leangrad.measure import profile_step


def _autograd(model: nn.Module, x: torch.Tensor, loss_fn) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _check_exact(eng: leangrad.Engine, model: nn.Module, x: torch.Tensor, loss_fn) -> None:  # type: ignore[no-untyped-def]
    ref = _autograd(model, x, loss_fn)
    model.zero_grad(set_to_none=True)
    eng.backward(model, x, loss_fn)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-10, atol=1e-12, msg=n)
    model.zero_grad(set_to_none=True)


def test_traced_resnet_blocks_peak_one_activation_lower_and_exact() -> None:
    """ResNet basic blocks (``h = bn2(conv2(h))`` keeps the first ReLU's output alive
    through bn2 in Python): the traced recomputation peaks at least one block activation
    lower; float64 gradients equal autograd's."""
    torch.manual_seed(0)
    model = zoo.ResNet((2, 2), width=8, in_channels=3, classes=10)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    on = profile_step(leangrad.engine("checkpoint", trace=True), model, x, loss_fn, repeats=0)
    off = profile_step(leangrad.engine("checkpoint"), model, x, loss_fn, repeats=0)
    activation = 16 * 8 * 16 * 16 * 4  # one first-stage block activation, float32
    assert on.peak_bytes <= off.peak_bytes - activation
    model, x = model.double(), x.double()
    _check_exact(leangrad.engine("checkpoint", trace=True), model, x, loss_fn)


class _Counting(nn.Module):
    """A block with a Python side effect in forward: tracing would bake it in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x)) * self.calls


class _Seeded(nn.Module):
    """A block drawing a seed from a generator it holds (as leangrad.rad's layers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(torch.rand((), generator=self.generator))
        return torch.tanh(self.lin(x)) * scale


class _Flagged(nn.Module):
    """A block whose forward reads a flag and the training mode (read once by a trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.skip = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.training:
            h = h * 2.0
        return h + x if self.skip else h


class _Optional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h if scale is None else h * scale


def test_a_block_with_a_side_effect_is_run_as_written_and_the_effect_undone() -> None:
    block = _Counting()
    assert traced(block) is block and block.calls == 0
    seeded = _Seeded()
    state = seeded.generator.get_state()
    rng = torch.get_rng_state()
    assert traced(seeded) is seeded
    assert torch.equal(seeded.generator.get_state(), state)
    assert torch.equal(torch.get_rng_state(), rng)


def test_optional_arguments_are_not_traced_and_a_plain_block_is() -> None:
    assert traced(_Optional()) is not None and not isinstance(traced(_Optional()), fx.GraphModule)
    assert isinstance(traced(_Flagged()), fx.GraphModule)


@pytest.mark.parametrize("make", [_Counting, _Seeded, _Flagged, _Optional])
def test_checkpointed_sequences_of_such_blocks_equal_autograd(make) -> None:  # type: ignore[no-untyped-def]
    """Side effects happen as under autograd (once per forward and once per recompute,
    as with trace=False), and the gradients are autograd's."""
    torch.manual_seed(0)
    model = nn.Sequential(make(), make(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    if make is _Counting:  # the count is part of the function: compare like with like
        twin = copy.deepcopy(model)
        leangrad.engine("checkpoint", trace=True).backward(model, x, loss_fn)
        leangrad.engine("checkpoint").backward(twin, x, loss_fn)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        assert [m.calls for m in model[:2]] == [m.calls for m in twin[:2]]
        return
    if make is _Seeded:
        twin = copy.deepcopy(model)
        leangrad.engine("checkpoint", trace=True).backward(model, x, loss_fn)
        leangrad.engine("checkpoint").backward(twin, x, loss_fn)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        return
    _check_exact(leangrad.engine("checkpoint", trace=True), model, x, loss_fn)


def test_a_changed_flag_or_mode_is_traced_again() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Flagged(), _Flagged(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    eng = leangrad.engine("checkpoint", trace=True)
    _check_exact(eng, model, x, loss_fn)
    model[0].skip = False
    _check_exact(eng, model, x, loss_fn)
    model.eval()
    _check_exact(eng, model, x, loss_fn)


def test_trace_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="trace must be True or False, got 'yes'"):
        leangrad.engine("checkpoint", trace="yes")


class _DeepStem(nn.Module):
    """timm's ResNet-D stem as written: a Sequential of layers with in-place ReLUs (so its
    layers are found as repeated units, and a lone ReLU(inplace=True) is a block writing its
    own input), then residual blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4),
                                   nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1),
                                   nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                                   nn.Conv2d(4, 4, 3, padding=1))  # fmt: skip
        self.act = nn.ReLU(inplace=True)
        self.layers = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(2))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.conv1(x))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("options", [{}, {"fragments": 2}])
def test_a_block_writing_its_input_in_place_runs_on_a_copy_and_stays_exact(
        options: dict[str, int]) -> None:  # fmt: skip
    """Checkpointing ``ReLU(inplace=True)`` as a block used to stop the backward ("modified
    by an inplace operation"): its first call is watched, and it runs on a copy of its
    input from then on; BatchNorm statistics advance once."""
    torch.manual_seed(0)
    model = _DeepStem().double()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0])
    start = copy.deepcopy(model.state_dict())
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    for _ in range(2):  # the first call watched, the second on copies
        model.load_state_dict(start)
        model.zero_grad(set_to_none=True)
        res = leangrad.engine("checkpoint", **options).backward(
            model, x, lambda out: F.cross_entropy(out, y))  # fmt: skip
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)
        for (n, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
            torch.testing.assert_close(b, c, rtol=1e-12, atol=0, msg=n)
        assert "conv1.2" in res.info["input_copied"]
