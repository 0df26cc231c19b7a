"""Keyword inputs, as Hugging Face passes a batch: ``model(**{"input_ids": ..., "labels": ...})``.

Every engine, :func:`leangrad.plan` and :func:`leangrad.measure.profile_step` take their
inputs positionally (``model(*inputs)``), and the transforms split them along the batch.
A mapping of inputs is turned into that form once, at the entry: its tensors become the
positional inputs, in the mapping's order, and the model is seen through a
:class:`KeywordCall` that puts them back under their names (values that are not tensors,
such as ``use_cache=False``, and 0-d tensors that need no gradient, such as the Trainer's
``num_items_in_batch``, are passed unchanged on every call, and are not split).

A :class:`KeywordCall` is a *view* of the model, not a wrapper: it shares the model's
submodules, parameters and buffers under the same names (``named_parameters()`` is the
model's, so ``on_grad`` names and saved plans read the same), and it calls the model
itself, so the hooks on the model and in it run as they would.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import _errors as errors

__all__ = ["KeywordCall", "positional", "underlying"]

NO_TENSOR = (
    "the keyword inputs hold no tensor ({keys}): give the batch's tensors, e.g. "
    "{{'input_ids': ids, 'labels': labels}}"
)
BAD_KEY = "keyword inputs must be named by strings, got {key!r}"


class KeywordCall(nn.Module):
    """``model`` called as ``model(**{name: tensor, ..., **constants})`` from positional
    tensors. See the module docstring."""

    keyword_model: nn.Module

    def __init__(self, model: nn.Module, names: tuple[str, ...],
                 constants: Mapping[str, Any]) -> None:  # fmt: skip
        super().__init__()
        # Shared dicts, not a child module: the view's names are the model's own.
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        object.__setattr__(self, "keyword_model", model)
        self.names, self.constants = names, dict(constants)
        self.training = model.training

    def forward(self, *tensors: torch.Tensor) -> Any:
        if len(tensors) != len(self.names):
            raise errors.EngineInputError(
                f"{len(tensors)} inputs for the {len(self.names)} named {self.names}"
            )
        return self.keyword_model(**dict(zip(self.names, tensors, strict=True)),
                                  **self.constants)  # fmt: skip

    def train(self, mode: bool = True) -> KeywordCall:
        self.keyword_model.train(mode)
        self.training = mode
        return self

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        # The model itself in the view's place, so that its hooks are seen and it is
        # counted once: the view holds nothing the model does not.
        yield from self.keyword_model.named_modules(memo, prefix, remove_duplicate)

    def extra_repr(self) -> str:
        return f"names={self.names}"


def positional(
    model: nn.Module, inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any]
) -> tuple[nn.Module, torch.Tensor | Sequence[torch.Tensor]]:
    """``(model, inputs)`` unchanged unless ``inputs`` is a mapping; then the
    :class:`KeywordCall` view of ``model`` and the mapping's tensors, in order."""
    if not isinstance(inputs, Mapping):
        return model, inputs
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    constants: dict[str, Any] = {}
    for key, value in inputs.items():
        if not isinstance(key, str):
            raise errors.EngineInputError(BAD_KEY.format(key=key))
        if isinstance(value, torch.Tensor) and (value.dim() or value.requires_grad):
            names.append(key)
            tensors.append(value)
        else:
            constants[key] = value
    if not tensors:
        raise errors.EngineInputError(NO_TENSOR.format(keys=", ".join(inputs) or "empty"))
    if isinstance(model, KeywordCall):  # already a view: look at the model behind it
        model = model.keyword_model
    return KeywordCall(model, tuple(names), constants), tuple(tensors)


def underlying(model: nn.Module) -> nn.Module:
    """The model a :class:`KeywordCall` views, or ``model`` itself."""
    return model.keyword_model if isinstance(model, KeywordCall) else model
