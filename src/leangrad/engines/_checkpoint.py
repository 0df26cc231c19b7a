"""``checkpoint``: activation checkpointing over a sequence of blocks (non-reentrant).

Chen et al., "Training deep nets with sublinear memory cost" (2016): keep only
the inputs of ``s`` segments during the forward pass and recompute each
segment's activations during the backward pass. With ``s ≈ √L`` memory grows as
O(√L) instead of O(L), for one extra forward pass.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _errors as E
from ._backprop import grad_hooks
from ._base import Engine, LossFn, OnGrad, StepResult, forward_loss
from ._registry import register

__all__ = ["Checkpoint", "model_blocks", "split_segments"]

NOT_SEQUENTIAL = (
    "the checkpoint engine needs a model made of blocks run one after another: an "
    "nn.Sequential, or a module with a `checkpoint_blocks()` method returning its blocks "
    "in order; {model} is neither. Wrap the blocks in nn.Sequential"
)
BAD_SEGMENTS = "segments must be a positive int, 'sqrt' or None (one per block), got {value!r}"


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a Sequential-like model, in execution order."""
    blocks_fn = getattr(model, "checkpoint_blocks", None)
    if callable(blocks_fn):
        return list(blocks_fn())
    if isinstance(model, nn.Sequential):
        return list(model)
    raise E.EngineInputError(NOT_SEQUENTIAL.format(model=type(model).__name__))


def split_segments(n_blocks: int, segments: int) -> list[range]:
    """Split ``range(n_blocks)`` into ``segments`` contiguous, near-equal ranges."""
    segments = max(1, min(segments, n_blocks))
    bounds = [round(i * n_blocks / segments) for i in range(segments + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


@register("checkpoint")
class Checkpoint(Engine):
    """Checkpointing over the blocks of an ``nn.Sequential``-like model.

    Args:
        segments: number of segments. ``None`` (default) checkpoints every block;
            ``"sqrt"`` uses ⌈√L⌉ segments for L blocks (memory O(√L)); an int
            uses that many. Every segment but the last is checkpointed: the
            last one's activations are the first the backward pass needs, so
            recomputing them would cost time and save no peak memory
            (as ``torch.utils.checkpoint.checkpoint_sequential``).

    Trade-off: one extra forward pass of the checkpointed segments; exact
    gradients (RNG state is restored for dropout). BatchNorm running statistics
    advance once per step, as under autograd: the recomputation's update is undone
    (:class:`~leangrad.engines._contract.BufferGuard`). Modules that are recomputed
    may not carry forward hooks (they would fire twice; the error names the module).
    """

    exact = True
    reruns = True

    def __init__(self, *, segments: int | Literal["sqrt"] | None = None) -> None:
        ok = segments is None or segments == "sqrt"
        ok = ok or (isinstance(segments, int) and not isinstance(segments, bool) and segments > 0)
        if not ok:
            raise ValueError(BAD_SEGMENTS.format(value=segments))
        super().__init__(segments=segments)
        self.segments = segments

    def supports(self, model: nn.Module) -> str | None:
        try:
            model_blocks(model)
        except E.EngineInputError as err:
            return str(err)
        return None

    def _groups(self, n: int) -> list[range]:
        if self.segments is None:
            s = n
        elif self.segments == "sqrt":
            s = math.ceil(math.sqrt(n))
        else:
            s = int(self.segments)
        return split_segments(n, s)

    def rerun_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Every module of the checkpointed segments (all but the last): recomputed."""
        blocks = model_blocks(model)
        groups = self._groups(len(blocks))
        return [
            (n, m)
            for group in groups[:-1]
            for j in group
            for n, m in blocks[j].named_modules(prefix=f"block{j}")
        ]

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: dict[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        blocks = model_blocks(model)
        groups = self._groups(len(blocks))

        def run(xs: tuple[torch.Tensor, ...]) -> object:
            # The first block takes the engine's inputs unpacked; every later block
            # takes the previous output whole (a tuple stays one argument), as
            # nn.Sequential does.
            out: object = None
            for i, group in enumerate(groups):
                seg = _Segment([blocks[j] for j in group])
                args = xs if i == 0 else (out,)
                if i < len(groups) - 1:
                    out = checkpoint(seg, *args, use_reentrant=False)
                else:
                    out = seg(*args)
            return out

        loss = forward_loss(self.label, lambda *xs: run(xs), inputs, loss_fn)
        with grad_hooks(params, on_grad):
            loss.backward()
        return self._result(loss, segments=len(groups))


class _Segment:
    """Consecutive blocks run as one function (what ``checkpoint`` recomputes)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.blocks = blocks

    def __call__(self, *xs: object) -> object:
        out: object = self.blocks[0](*xs)
        for block in self.blocks[1:]:
            out = block(out)
        return out
