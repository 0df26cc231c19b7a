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

from torch import nn

__all__ = ["PreparedCache", "share_copy"]

T = TypeVar("T")


def share_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module``'s structure that shares its parameters and buffers
    (the same tensor objects), so changing the copy's modules leaves the original alone."""
    memo: dict[int, Any] = {id(t): t for t in module.parameters()}
    memo.update({id(t): t for t in module.buffers()})
    return copy.deepcopy(module, memo)


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
