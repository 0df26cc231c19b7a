"""Highway errors that name the real condition (class 9).

- A time-first input (``(L, batch, …)``, recurrent stacks) of sequence length 0 is
  refused by every engine as a sequence of length 0, not as "an empty batch"; a batch of
  0 sequences still is an empty batch.
- A :class:`ResidualStack` whose blocks have different widths names the block, the width
  it expects and the width it receives, instead of PyTorch's ``running_mean should
  contain 4 elements not 8`` from inside the block: at construction for blocks that
  declare their width (every shipped block), at run time for the others.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import EngineInputError
from leangrad import highway as hw
from leangrad.engines._contract import EMPTY_BATCH
from leangrad.highway._blocks import block_width
from leangrad.measure import compare_grads, grads_of

ENGINES = ["highway", "backprop", "checkpoint"]


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


# -- sequence length 0 ------------------------------------------------------------------


def _recurrent_nets() -> list[tuple[str, nn.Module, torch.Tensor]]:
    return [
        ("GRULayer(4, 4", hw.HighwayNet(None, [hw.GRULayer(4, 4)], None), torch.randn(0, 2, 4)),
        ("LSTMLayer(4, 5", hw.LSTMLayer(4, 5), torch.randn(0, 3, 4)),  # a bare stack
        (
            "GRULayer(6, 6",
            hw.HighwayNet(nn.Embedding(10, 6), [hw.GRULayer(6, 6)], nn.Linear(6, 10)),
            torch.zeros(0, 3, dtype=torch.long),  # token ids (L, batch)
        ),
    ]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", range(3))
def test_sequence_length_0_is_named_as_such(engine: str, case: int) -> None:
    name, net, x = _recurrent_nets()[case]
    with pytest.raises(EngineInputError) as info:
        leangrad.engine(engine).backward(net, x, _sum)
    msg = str(info.value)
    assert msg.startswith(f"input 0 has sequence length 0 (shape {tuple(x.shape)}): {name}")
    assert "time-first" in msg and "skip empty sequences" in msg
    assert "empty batch" not in msg


@pytest.mark.parametrize("engine", ENGINES)
def test_a_batch_of_no_sequences_is_still_an_empty_batch(engine: str) -> None:
    net = hw.HighwayNet(None, [hw.GRULayer(4, 4)], None)
    x = torch.randn(5, 0, 4)
    msg = EMPTY_BATCH.format(index=0, shape=(5, 0, 4))
    with pytest.raises(EngineInputError, match=re.escape(msg)):
        leangrad.engine(engine).backward(net, x, _sum)


def test_an_unknown_stem_leaves_the_generic_message() -> None:
    """A stem that may reorder dimensions: the net cannot say which one is empty."""
    net = hw.HighwayNet(nn.Linear(4, 4), [hw.GRULayer(4, 4)], None)
    x = torch.randn(0, 2, 4)
    with pytest.raises(EngineInputError, match=re.escape("an empty batch")):
        leangrad.engine("highway").backward(net, x, _sum)


# -- ResidualStack widths ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("blocks", "index", "want", "got"),
    [
        (lambda: [hw.PreActBlock(4), hw.PreActBlock(8)], 1, 8, 4),
        (lambda: [hw.PostReLUBlock(3), hw.PostReLUBlock(3), hw.PostReLUBlock(5)], 2, 5, 3),
        (lambda: [hw.PreLNSublayer(8), hw.PostLNSublayer(6)], 1, 6, 8),
    ],
    ids=["preact", "postrelu", "transformer"],
)
def test_declared_widths_are_checked_at_construction(blocks, index, want, got) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(hw.HighwayError) as info:
        hw.ResidualStack(blocks())
    msg = str(info.value)
    assert f"block {index} (" in msg
    assert f"expects width {want} but receives width {got}" in msg
    assert f"the output of block {index - 1}" in msg
    assert f"build block {index} with width {got}" in msg
    assert "running_mean" not in msg


class _UserBlock(hw.HighwayBlock):
    """A block that does not declare its width: BatchNorm first, as in PreActBlock."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.relu(self.bn(x)))

    def r(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x + z

    def r_z_vjp(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w


def _width_error(engine: str, blocks: list[nn.Module], x: torch.Tensor, msg: str, *,
                 fix: str) -> hw.HighwayError:  # fmt: skip
    """The error ``engine``'s step on a stack of ``blocks`` raises on ``x``, which must
    say ``msg`` and name the ``fix``."""
    net = hw.HighwayNet(None, [hw.ResidualStack(blocks)], None)
    with pytest.raises(hw.HighwayError, match=re.escape(msg)) as info:
        leangrad.engine(engine).backward(net, x, _sum)
    assert fix in str(info.value)
    return info.value


@pytest.mark.parametrize("engine", ENGINES)
def test_undeclared_widths_are_named_when_the_block_fails(engine: str) -> None:
    """The issue's case: PyTorch's ``running_mean should contain 4 elements not 8``."""
    err = _width_error(engine, [_UserBlock(4), _UserBlock(8)], torch.randn(2, 4, 6, 6),
                       "ResidualStack: block 1 (_UserBlock) expects width 8 but receives "
                       "width 4 (the output of block 0 (_UserBlock), shape (2, 4, 6, 6))",
                       fix="build block 1 with width 4 like block 0")
    assert isinstance(err.__cause__, RuntimeError)  # PyTorch's error, kept as cause


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stack_input_of_another_width_names_block_0(engine: str) -> None:
    _width_error(engine, [hw.PreActBlock(4), hw.PreActBlock(4)], torch.randn(2, 8, 6, 6),
                 "ResidualStack: block 0 (PreActBlock) expects width 4 but receives width 8 "
                 "(the stack's input, shape (2, 8, 6, 6))", fix="give the stack inputs of width 4")


def test_other_block_failures_are_not_blamed_on_widths() -> None:
    class Broken(_UserBlock):
        def g(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("something else")

    stack = hw.ResidualStack([Broken(4)])
    with pytest.raises(RuntimeError, match="something else"):
        stack(torch.randn(2, 4, 6, 6))


def test_block_width_reads_declared_then_guesses() -> None:
    assert block_width(hw.PreActBlock(5)) == (5, 1)
    assert block_width(hw.PreLNSublayer(6)) == (6, -1)
    assert block_width(_UserBlock(3)) == (3, 1)  # BatchNorm2d(3): channels at dim 1
    assert block_width(_UserBlock(3), declared_only=True) is None
    assert block_width(nn.ReLU()) is None


def test_matching_widths_still_match_autograd() -> None:
    """The checks change nothing for a valid stack: float64 gradients equal autograd's."""
    torch.manual_seed(0)
    stack = hw.ResidualStack([hw.PreActBlock(3), _UserBlock(3), hw.PostReLUBlock(3)]).double()
    net = hw.HighwayNet(None, [stack], nn.Flatten()).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    ref = copy.deepcopy(net)
    _sum(ref(x)).backward()
    leangrad.engine("highway", k=3).backward(net, x, _sum)
    assert compare_grads(grads_of(net), grads_of(ref)).max_rel_err <= 1e-10
