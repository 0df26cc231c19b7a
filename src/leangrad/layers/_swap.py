"""``SwapHalves``: exchange the two channel halves, so stacked couplings alternate.

A RevNet (Gomez et al. 2017) alternates which half of the channels a coupling
updates; with :class:`~leangrad.layers.AdditiveCoupling` (y₂ = x₂ + F(x₁)) that is a
coupling, a swap, a coupling. The swap is an orthogonal permutation: it stores
nothing, and its vjp, vijp and inverse are all the same swap.
"""

from __future__ import annotations

import torch

from ._base import ChainLayer, LayerConditionError

__all__ = ["SwapHalves"]

ODD_CHANNELS = "{layer}: dimension {dim} has odd size {size}; halves need an even size"
DIM_OUT_OF_RANGE = (
    "{layer}: swaps halves along dim {dim}, but the input has shape {shape}; "
    "pass dim= naming the channel dimension"
)
BAD_DIM = "SwapHalves(dim={dim!r}): dim must be an int (the dimension to swap halves of)"


class SwapHalves(ChainLayer):
    """``(x₁, x₂) -> (x₂, x₁)`` along ``dim`` (channels by default)."""

    submersive = True
    invertible = True
    vijp_needs_input = False  # a fixed permutation

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise LayerConditionError(BAD_DIM.format(dim=dim))
        self.dim = dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}"

    def _swap(self, t: torch.Tensor) -> torch.Tensor:
        if not -t.dim() <= self.dim < t.dim():
            raise LayerConditionError(
                DIM_OUT_OF_RANGE.format(layer=self._describe(), dim=self.dim, shape=tuple(t.shape))
            )
        size = t.shape[self.dim]
        if size % 2:
            raise LayerConditionError(
                ODD_CHANNELS.format(layer=self._describe(), dim=self.dim, size=size)
            )
        a, b = t.split(size // 2, dim=self.dim)
        return torch.cat((b, a), dim=self.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._swap(x)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> None:
        del x, y

    def vjp_input(self, res: object, h_out: torch.Tensor) -> torch.Tensor:
        del res
        return self._swap(h_out)

    def vijp(self, x: torch.Tensor | None, h_in: torch.Tensor) -> torch.Tensor:
        del x
        return self._swap(h_in)

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del h_out
        return self._swap(x), {}

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return self._swap(y)

    def check(self, x: torch.Tensor | None = None) -> None:
        if x is not None:
            self._swap(x[:0] if x.dim() > 0 else x)
