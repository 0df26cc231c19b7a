"""Blocks that write their own inputs in place, found by watching their first call.

A checkpointed block keeps its inputs and recomputes from them; a block whose ``forward``
overwrites an input (a lone ``nn.ReLU(inplace=True)`` taken as a block, a stem ending in an
in-place activation of its argument) would leave the kept input changed, and
``torch.utils.checkpoint`` stops the backward with "modified by an inplace operation"
(fragments' pieces are views of the input, so the same). :class:`InputWrites` wraps the
function a checkpoint runs: before the first call of each kind it runs the block once on
copies of one example (no autograd, RNG forked, buffers put back) and watches their
version counters; a block that wrote one gets copies of its batch-shaped arguments from
then on (made inside the recomputed function, so the kept input stays the caller's,
unchanged, and each recomputation copies again), every other block runs on its arguments
as before. The probe costs one forward of one example per block and kind of call; the
step's peak is unchanged (a copy of the whole input on the first step, the way this was
first written, put one block input on the first step's peak: +2.3% on ConvNeXt-T).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from ._draws import aside
from ._generators import layer_generators

__all__ = ["InputWrites"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
"""Arguments the probe may pass as they are; with any other object (a Hugging Face cache,
which a call appends to) the block is not probed and runs as before."""


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
             kwargs: dict[str, Any]) -> Callable[..., Any]:  # fmt: skip
        """The function to run: ``fn`` itself, or ``fn`` on copies of its batch-shaped
        arguments where it writes them in place (probed on the first call of a kind)."""
        key = self._key(args, kwargs)
        known = self._seen.get(key)
        if known is None:
            known = self._seen[key] = self._probe(fn, args, kwargs)
        self.last = known
        if not known:
            return fn
        pick = _batch_shaped((args, kwargs))

        def copied(*a: Any, **kw: Any) -> Any:
            a, kw = pytree.tree_map(lambda v: v.clone() if pick(v) else v, (a, kw))
            return fn(*a, **kw)

        return copied

    def _probe(self, fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> bool:  # fmt: skip
        """Whether ``fn`` wrote a batch-shaped argument in place, run once on copies of one
        example (every argument copied: a BatchNorm's running statistics handed in as
        arguments stay as they were), without autograd, the RNG streams forked and the
        modules' buffers and their layers' own generators put back."""
        pick = _batch_shaped((args, kwargs))
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(pick(v) for v in leaves):
            return False
        if any(not isinstance(v, (torch.Tensor, *_PLAIN)) for v in leaves):
            return False  # an object the probe's call could change (a key/value cache)
        watched: list[tuple[torch.Tensor, int]] = []

        def copy(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            c = (v[:1] if pick(v) else v).detach().clone()
            if pick(v):
                watched.append((c, c._version))
            return c

        a, kw = pytree.tree_map(copy, (args, kwargs))
        buffers = [b for root in self.modules for b in root.buffers()]
        saved = [b.detach().clone() for b in buffers]
        gens = layer_generators(self.modules)  # a layer's own stream: the probe draws none
        states = [g.get_state() for g in gens]
        devices = sorted({c.device.index or 0 for c, _ in watched if c.device.type == "cuda"})
        try:
            with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.no_grad(), \
                    aside():
                fn(*a, **kw)
        except Exception:  # cannot run on one example (BatchNorm1d in training): as before
            return False
        finally:
            with torch.no_grad():
                for b, value in zip(buffers, saved, strict=True):
                    if is_fake(b) or not torch.equal(b, value):
                        b.copy_(value)
            for g, st in zip(gens, states, strict=True):
                g.set_state(st)
        return any(c._version != v for c, v in watched)
