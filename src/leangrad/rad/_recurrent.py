"""Randomized recurrent cells: a new sample of the weight Jacobians at every time step.

Randomized AD, section 4.3 and Appendix A ("RNN training details"): the IRNN
(``h' = relu(W_ih x + b_ih + W_hh h + b_hh)``, ``W_hh`` initialised to the
identity) is trained with "different activations/random matrices sampled at
every time-step of the unrolled RNN". Each call of a cell is one time step and
draws fresh samples for both weight Jacobians (``∂/∂W_ih`` needs ``x``,
``∂/∂W_hh`` needs ``h``); the ReLU keeps 1 bit per unit. The GRU cell applies
the same sampling to its two matrix products; its gates are differentiated
exactly from r, z, n, W_hn h + b_hn and h (5H numbers per example and step),
which RAD cannot sample away, so its saving is smaller than the IRNN's.
"""

from __future__ import annotations

from typing import Any, Unpack, cast

import torch
from torch import nn

from . import _errors as errors
from ._linear import LayerOptions, SampledLayer, adopted
from ._relu import _BitReLUFn
from ._sampling import SampleSpec

__all__ = ["RandGRUCell", "RandRNNCell", "irnn_cell"]


_CELL_SHARED = ("input_size", "hidden_size", "bias", "weight_ih", "weight_hh", "bias_ih", "bias_hh")
"""What a randomized cell takes from the ``nn`` cell it replaces: sizes and parameters."""


def _step_inputs(cell: SampledLayer, x: torch.Tensor, hx: torch.Tensor | None,
                 hidden_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(W_ih x + b_ih, W_hh h + b_hh, h)``, each product with a fresh sample; ``h = 0``
    when ``hx`` is ``None``."""
    if hx is None:
        hx = x.new_zeros(*x.shape[:-1], hidden_size)
    c = cast(Any, cell)
    return (cell._rand_linear(x, c.weight_ih, c.bias_ih),
            cell._rand_linear(hx, c.weight_hh, c.bias_hh), hx)  # fmt: skip


class RandRNNCell(SampledLayer, nn.RNNCell):
    """``nn.RNNCell`` (``relu`` or ``tanh``) with RAD weight gradients, fresh samples per step.

    Args:
        input_size, hidden_size, bias, nonlinearity: as ``nn.RNNCell``.
        fraction, mode, replace, seed: as :class:`~leangrad.rad.RandLinear`; both
            products ``W_ih x`` and ``W_hh h`` draw an independent sample per call.

    ``relu`` saves its derivative as 1 bit per unit; ``tanh`` keeps its output.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        nonlinearity: str = "tanh",
        **options: Unpack[LayerOptions],
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):  # nn.RNNCell checks only in its forward
            raise errors.RadInputError(errors.BAD_NONLINEARITY.format(value=nonlinearity))
        super().__init__(input_size, hidden_size, bias, nonlinearity, **options)

    @classmethod
    def from_cell(
        cls, cell: nn.RNNCell, *, spec: SampleSpec, generator: torch.Generator | None = None
    ) -> RandRNNCell:
        """A ``RandRNNCell`` sharing ``cell``'s parameters."""
        return adopted(cls, cell, (*_CELL_SHARED, "nonlinearity"), spec, generator)

    def forward(self, x: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        gi, gh, _ = _step_inputs(self, x, hx, self.hidden_size)
        pre = gi + gh
        if self.nonlinearity == "relu":
            return _BitReLUFn.apply(pre)
        return torch.tanh(pre)


def irnn_cell(
    input_size: int,
    hidden_size: int,
    *,
    fraction: float = 0.1,
    mode: str = "different",
    replace: bool = False,
    seed: int | None = None,
    init_std: float = 0.001,
) -> RandRNNCell:
    """The paper's IRNN cell: ReLU, ``W_hh = I``, ``W_ih ~ N(0, init_std)``, zero biases.

    Appendix A: "W_hh is initialised with the identity matrix, W_ih ... with a random
    matrix where each element is drawn independently from N(0, 0.001) ... biases zero".
    """
    cell = RandRNNCell(
        input_size, hidden_size, nonlinearity="relu", fraction=fraction, mode=mode,
        replace=replace, seed=seed,
    )  # fmt: skip
    with torch.no_grad():
        cell.weight_hh.copy_(torch.eye(hidden_size))
        cell.weight_ih.normal_(0.0, init_std)
        cell.bias_ih.zero_()
        cell.bias_hh.zero_()
    return cell


class _GRUGatesFn(torch.autograd.Function):
    """``h' = n + z (h - n)`` from the two pre-activations; saves r, z, n, h_n and h only.

    Plain autograd on the same expression would also keep the whole ``W_hh h`` output
    (3H, for the ``r * h_n`` product) and ``h - n``; the fused ``nn.GRUCell`` keeps a
    5H workspace. The derivative needs exactly r, z, n, h_n and h.
    """

    @staticmethod
    def forward(ctx: Any, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        ctx.save_for_backward(r, z, n, h_n.contiguous(), h)
        return n + z * (h - n)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        r, z, n, h_n, h = ctx.saved_tensors
        d_n = g * (1 - z) * (1 - n * n)  # through n, then tanh'
        d_z = g * (h - n) * z * (1 - z)
        d_r = d_n * h_n * r * (1 - r)
        return torch.cat([d_r, d_z, d_n], -1), torch.cat([d_r, d_z, d_n * r], -1), g * z


class RandGRUCell(SampledLayer, nn.GRUCell):
    """``nn.GRUCell`` whose two matrix products get RAD weight gradients, fresh per step.

    Same gate equations as ``nn.GRUCell``; only ``∂/∂W_ih`` (needs ``x``) and
    ``∂/∂W_hh`` (needs ``h``) are sampled. Gate derivatives are exact and keep
    r, z, n, h_n and h (5H per example), the floor of what this cell can save.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        **options: Unpack[LayerOptions],
    ) -> None:
        super().__init__(input_size, hidden_size, bias, **options)

    @classmethod
    def from_cell(
        cls, cell: nn.GRUCell, *, spec: SampleSpec, generator: torch.Generator | None = None
    ) -> RandGRUCell:
        """A ``RandGRUCell`` sharing ``cell``'s parameters."""
        return adopted(cls, cell, _CELL_SHARED, spec, generator)

    def forward(self, x: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        gi, gh, hx = _step_inputs(self, x, hx, self.hidden_size)
        return _GRUGatesFn.apply(gi, gh, hx)
