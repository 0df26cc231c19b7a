"""Blocks that write their own inputs in place, found by watching their first call.

A checkpointed block keeps its inputs and recomputes from them; a block whose ``forward``
overwrites an input (a lone ``nn.ReLU(inplace=True)`` taken as a block, a stem ending in an
in-place activation of its argument) would leave the kept input changed, and
``torch.utils.checkpoint`` stops the backward with "modified by an inplace operation"
(fragments' pieces are views of the input, so the same). :class:`InputWrites` wraps the
function a checkpoint runs: on the first call of each kind it hands the block copies of its
batch-shaped arguments and watches their version counters; a block that wrote one keeps
getting copies (made inside the recomputed function, so the kept input stays the caller's,
unchanged, and each recomputation copies again), every other block runs on its arguments
as before. No extra forward runs and nothing the user sees changes but the copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["InputWrites"]


def _batch_shaped(args: Any) -> Callable[[Any], bool]:
    """Which leaves are copied: tensors of two or more dimensions sharing the first tensor
    argument's first dimension, not parameters (a BatchNorm's running statistics handed in
    as arguments, a mask of shape ``(1, 1, T, T)``, are left alone)."""
    first = next((t for t in pytree.tree_leaves(args)
                  if isinstance(t, torch.Tensor) and t.dim() >= 2), None)  # fmt: skip
    rows = first.shape[0] if first is not None else -1

    def pick(v: Any) -> bool:
        return (isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
                and v.dim() >= 2 and v.shape[0] == rows)  # fmt: skip

    return pick


class InputWrites:
    """Per kind of call, whether a block writes a batch-shaped argument in place (module
    docstring); :meth:`wrap` gives the function to checkpoint."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self._seen: dict[Any, bool] = {}
        self.last = False
        """Whether the last call's block writes its input (and so runs on copies)."""

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return (tuple((tuple(t.shape[1:]), t.dtype, t.device)
                      for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)),
                tuple(m.training for root in self.modules for m in root.modules()))

    def wrap(self, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[Callable[..., Any], Callable[[], None]]:  # fmt: skip
        """``(the function to run, a callback to call once the first run returned)``."""
        key = self._key(args, kwargs)
        known = self._seen.get(key)
        self.last = bool(known)
        if known is False:
            return fn, _nothing
        pick = _batch_shaped((args, kwargs))
        watched: list[tuple[torch.Tensor, int]] = []
        first = [known is None]

        def copied(*a: Any, **kw: Any) -> Any:
            def copy(v: Any) -> Any:
                if not pick(v):
                    return v
                c = v.clone()
                if first[0]:
                    watched.append((c, c._version))
                return c

            a, kw = pytree.tree_map(copy, (a, kw))
            return fn(*a, **kw)

        def settle() -> None:
            if first[0]:
                first[0] = False
                self._seen[key] = self.last = any(c._version != v for c, v in watched)
                watched.clear()

        return copied, settle


def _nothing() -> None:
    return None
