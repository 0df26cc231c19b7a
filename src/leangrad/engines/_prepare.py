"""Prepared copies of a user's model: the same tensors, another module structure.

Engines and transforms that change *how* a model runs (checkpoint wrappers around its
blocks, rad's randomized layers, fad's fused chains) work on a copy of its module tree
that shares every ``Parameter`` and buffer object with the original — so ``.grad`` and
running statistics land on the user's tensors and the user's module is never modified.
A copy is made once per model and made again only when the model's parameters, modules
(by every name they are registered under) or train/eval modes change.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch import nn

__all__ = ["PreparedCache", "Wrapper", "share_copy", "step_scope"]

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
        self._cache: weakref.WeakKeyDictionary[
            nn.Module, tuple[list[nn.Module], Any, T, int]] = weakref.WeakKeyDictionary()

    def get(self, model: nn.Module, build: Callable[[nn.Module], T]) -> T:
        hit = self._cache.get(model)
        token = _STEP.token if _STEP.depth else -1
        if hit is not None and ((token >= 0 and hit[3] == token)
                                or _structure(hit[0]) == hit[1]):  # fmt: skip
            if token >= 0 and hit[3] != token:
                self._cache[model] = (*hit[:3], token)
            return hit[2]
        value = build(model)
        modules = list(model.modules())
        self._cache[model] = (modules, _structure(modules), value, token)
        return value


class _Step:
    """The engine step under way (:func:`step_scope`): inside one, a cache checked once is
    not checked again (an engine asks several times per step what a model's modules are,
    and they do not change in the middle of it); outside, every call checks."""

    def __init__(self) -> None:
        self.depth = 0
        self.token = 0


_STEP = _Step()


@contextlib.contextmanager
def step_scope() -> Iterator[None]:
    """One engine step (nested steps, such as a composition's runner, share it)."""
    if _STEP.depth == 0:
        _STEP.token += 1
    _STEP.depth += 1
    try:
        yield
    finally:
        _STEP.depth -= 1


def _structure(modules: list[nn.Module]) -> tuple[Any, ...]:
    """Every module's children and parameters (names and objects) and train/eval mode.
    Checked on the modules the model had when the cache was filled: any change to the
    tree is a change to some module's own ``_modules`` (a module listed twice,
    ``nn.Sequential(lin, act, lin)``, is two entries there), so this sees what a walk of
    the whole tree would, at a fifth of its cost (no names are joined)."""
    return tuple((m.training, tuple((k, id(v)) for k, v in m._modules.items()),
                  tuple((k, id(v)) for k, v in m._parameters.items()))
                 for m in modules)  # fmt: skip
