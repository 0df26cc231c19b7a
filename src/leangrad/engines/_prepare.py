"""Prepared copies of a user's model: the same tensors, another module structure.

Engines and transforms that change *how* a model runs (checkpoint wrappers around its
blocks, rad's randomized layers, fad's fused chains) work on a copy of its module tree
that shares every ``Parameter`` and buffer object with the original — so ``.grad`` and
running statistics land on the user's tensors and the user's module is never modified.
A copy is made once per model and made again only when the model's parameters, modules
(by every name they are registered under) or train/eval modes change.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch import nn

__all__ = ["PreparedCache", "Wrapper", "share_copy"]

T = TypeVar("T")


def share_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module``'s structure that shares its parameters and buffers
    (the same tensor objects), so changing the copy's modules leaves the original alone."""
    memo: dict[int, Any] = {id(t): t for t in module.parameters()}
    memo.update({id(t): t for t in module.buffers()})
    # a layer's own generator (rad.RandLinear(seed=...)) is shared too: the copy draws
    # from the user's stream, which then advances as under autograd
    memo.update({id(g): g for m in module.modules() for g in vars(m).values()
                 if isinstance(g, torch.Generator)})  # fmt: skip
    for m in module.modules():  # what a Wrapper's reads reach holds the same tensors
        seen = m.__dict__.get("_looks_like") if isinstance(m, Wrapper) else None
        if seen is not None:
            memo.update({id(t): t for t in [*seen.parameters(), *seen.buffers()]})
    return copy.deepcopy(module, memo)


class Wrapper(nn.Module):
    """A module standing in for ``inner`` inside a prepared copy (a checkpointed block, a
    block run under fad's eager mode or as fad's fx code). It must pass for the module it
    replaces where the model's own code meets it: ``forward`` takes any positional and
    keyword arguments and returns ``inner``'s output as it is, and an attribute the
    wrapper does not have is read from ``looks_like`` (default: ``inner``) — a parent's
    ``forward`` may read its blocks' attributes (diffusers' ``UNet2DModel`` reads
    ``len(block.resnets)`` and ``hasattr(block, "skip_conv")``). ``looks_like`` is the
    module an fx trace stands for: the trace keeps only the submodules it calls, as plain
    modules, so those reads must reach the module as written."""

    def __init__(self, inner: nn.Module, *, looks_like: nn.Module | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.__dict__["_looks_like"] = looks_like  # not registered: its tensors are inner's
        # its mode, not a new module's (a Module with __len__ may be falsy: no `or`)
        self.training = (inner if looks_like is None else looks_like).training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            d = self.__dict__
            source = d.get("_looks_like")
            if source is None:
                source = d.get("_modules", {}).get("inner")
            if source is None or name in ("inner", "_looks_like"):
                raise
            return getattr(source, name)


class PreparedCache(Generic[T]):
    """``get(model, build)``: ``build(model)`` once per model, again when its parameters,
    modules or train/eval modes change (a weak reference: dropped with the model)."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[nn.Module, tuple[Any, T]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, model: nn.Module, build: Callable[[nn.Module], T]) -> T:
        # Every name of every module and parameter: a module listed twice
        # (``nn.Sequential(lin, act, lin)``) is two blocks, and swapping one of its places
        # for another module already in the model changes no set of objects.
        key = (
            tuple((n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)),
            tuple((n, id(m), m.training) for n, m in model.named_modules(remove_duplicate=False)),
        )
        hit = self._cache.get(model)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = build(model)
        self._cache[model] = (key, value)
        return value
