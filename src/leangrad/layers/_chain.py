"""``Chain``: ``head(layers(stem(x)))``, the model shape Moonwalk and RevBackprop work on."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .._errors import EngineInputError
from ._base import ChainLayer

__all__ = ["NOT_A_MODULE", "NO_RULES", "Chain"]

NOT_A_MODULE = (
    "Chain: {what} is a {type}, not an nn.Module; wrap a function in a module "
    "(e.g. leangrad.fad.elementwise(fn) for an element-wise one)"
)

NO_RULES = (
    "chain layer {index} ({layer}) has no chain rules (it is not a leangrad ChainLayer); "
    "{engine} needs them: use a layer from leangrad.layers, subclass "
    "leangrad.layers.ChainLayer, or move it into the chain's stem or head"
)


class Chain(nn.Module):
    """A network ``head(layers(stem(*inputs)))`` whose middle carries layer rules.

    Stem and head are any modules and are differentiated by autograd; the
    layers are :class:`~leangrad.layers.ChainLayer` instances (one tensor in,
    one out) on which an engine such as ``moonwalk`` or ``revbackprop`` works.
    Any engine runs on a Chain; ``checkpoint`` treats stem, each layer and head
    as blocks.

    Args:
        *layers: the chain layers, in order.
        stem: module applied to the inputs first (default: identity).
        head: module applied last, before the loss (default: identity).
    """

    def __init__(
        self, *layers: nn.Module, stem: nn.Module | None = None, head: nn.Module | None = None
    ) -> None:
        super().__init__()
        named = [(f"layer {i}", m) for i, m in enumerate(layers)]
        for what, m in [*named, ("stem", stem), ("head", head)]:
            if m is not None and not isinstance(m, nn.Module):
                raise EngineInputError(NOT_A_MODULE.format(what=what, type=type(m).__name__))
        self.stem = stem if stem is not None else nn.Identity()
        self.layers = nn.ModuleList(layers)
        self.head = head if head is not None else nn.Identity()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        x = self.stem(*inputs)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def checkpoint_blocks(self) -> list[nn.Module]:
        """Blocks for the ``checkpoint`` engine: stem, each layer, head."""
        return [self.stem, *self.layers, self.head]

    def rule_layers(self, engine: str) -> list[ChainLayer]:
        """The layers, checked to carry rules; raises naming the first that does not."""
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, ChainLayer):
                raise EngineInputError(
                    NO_RULES.format(index=i, layer=type(layer).__name__, engine=engine)
                )
        return list(self.layers)  # type: ignore[arg-type]

    def check(self, *inputs: torch.Tensor) -> None:
        """Run every layer's ``check`` on the input it would see (no gradients)."""
        with torch.no_grad():
            x = self.stem(*inputs) if inputs else None
            for layer in self.layers:
                if isinstance(layer, ChainLayer):
                    layer.check(x)
                if x is not None:
                    x = layer(x)

    def iter_params(self, module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """Trainable parameters of a sub-module, named as in ``self.named_parameters()``."""
        prefix = next(n for n, m in self.named_modules() if m is module)
        for n, p in module.named_parameters():
            if p.requires_grad:
                yield (f"{prefix}.{n}" if prefix else n), p
