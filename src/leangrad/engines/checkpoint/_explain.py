"""What :func:`leangrad.explain` prints about checkpointing on a model (its
:meth:`~leangrad.engines._base.Engine.explain_lines`): the blocks, each marked
checkpointed or left plain and why; with ``trace=True`` whether each runs as torch.fx
code; fragments of the batch or the sequence; the two levels' outer segments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn

from .._blocks import Blocks
from ._fragments import split_reason, static_reason
from ._two_level import TwoLevel, outer_segments

__all__ = ["LAST_SEGMENT", "CheckpointLike", "block_lines"]

LAST_SEGMENT = "left plain: the last segment, whose activations the backward needs first"


class CheckpointLike(Protocol):
    """What :func:`block_lines` reads of a checkpointing engine."""

    @property
    def trace(self) -> bool: ...

    @property
    def fragments(self) -> int | None: ...

    @property
    def sequence_fragments(self) -> int | None: ...

    @property
    def levels(self) -> int: ...

    @property
    def fragment_blocks(self) -> list[str] | int | None: ...

    def fragment_choice(self, model: nn.Module) -> tuple[set[str] | None, dict[str, str]]: ...

    @property
    def segments(self) -> int | str | None: ...

    def blocks(self, model: nn.Module) -> Blocks: ...

    def recomputed(self, found: Blocks) -> list[str]: ...


def block_lines(base: CheckpointLike, model: nn.Module, *,
                trace_why: Callable[[nn.Module], str | None],
                position_children: Callable[[nn.Module], list[str]]) -> list[str]:  # fmt: skip
    """The blocks, each marked checkpointed or left plain (and why); with ``trace=True``,
    whether each checkpointed block runs as torch.fx code, and why not where it does not
    (``trace_why``: why a block cannot be traced; ``position_children``: a block's
    position-wise children)."""
    found = base.blocks(model)
    text = str(found).splitlines()
    if not found.names:
        return text
    recomputed = set(base.recomputed(found))
    status: dict[str, str] = {}
    traced: list[str] = []
    written: list[str] = []
    for name in found.names:
        if name not in recomputed:
            status[name] = LAST_SEGMENT
        elif not base.trace:
            status[name] = "checkpointed"
        else:
            why = trace_why(found.modules[name])
            status[name] = "checkpointed, " + ("as torch.fx code" if why is None
                                               else f"as written: {why}")  # fmt: skip
            (traced if why is None else written).append(name)
    if base.fragments is not None:
        _fragment_status(base, model, found, recomputed, status)
    if base.sequence_fragments is not None:
        for name in recomputed:
            kids = position_children(found.modules[name])
            status[name] += (f"; {', '.join(kids)} in {base.sequence_fragments} pieces of the "
                             "sequence where position-wise" if kids
                             else "; no child to cut along the sequence")  # fmt: skip
    if base.fragments is not None or base.sequence_fragments is not None:
        status = {n: v + (" (the first step's probe may still run a piece whole)"
                          if n in recomputed else "") for n, v in status.items()}  # fmt: skip
    levels = _two_level_lines(base, found.names, status)
    out = [text[0]] + [f"{row}  {status[n]}" for row, n in zip(text[1:], found.names,
                                                                strict=True)]  # fmt: skip
    out += levels
    if not base.trace:
        return [*out, "recomputed blocks run as written (trace=False)"]
    out.append(f"recomputed as torch.fx code (intermediates freed at last use): "
               f"{', '.join(traced) or 'none'}")  # fmt: skip
    if written:
        out.append(f"recomputed as written (reasons above; a block called with keyword "
                   f"arguments runs as written too): {', '.join(written)}")  # fmt: skip
    return out


def _fragment_status(base: CheckpointLike, model: nn.Module, found: Blocks,
                     recomputed: set[str], status: dict[str, str]) -> None:
    """With ``fragments``: each recomputed block's status gains whether it runs in
    fragments of the batch, and why not where it runs whole."""
    chosen, whole = base.fragment_choice(model)
    for name in recomputed:
        if name in whole:  # fragment_blocks left it out
            status[name] += f", whole: {whole[name]}"
            continue
        block = [found.modules[name]]
        split = split_reason(block)
        if split is not None:
            status[name] += f", whole: {split}"
            continue
        status[name] += f", in {base.fragments} fragments of the batch"
        if isinstance(base.fragment_blocks, int) and chosen is None:
            status[name] += (f" if among the {base.fragment_blocks} blocks saving the most "
                             "bytes inside (sized on fake tensors at the first step)")
        elif isinstance(base.fragment_blocks, int):
            status[name] += f" (among the {base.fragment_blocks} largest)"
        if static_reason(block, random=False) is not None:  # BatchNorm: frozen statistics
            status[name] += (" (training-mode BatchNorm: its statistics frozen, its "
                             "backward's batch sums gathered in extra passes)")  # fmt: skip


def _two_level_lines(base: CheckpointLike, names: tuple[str, ...],
                     status: dict[str, str]) -> list[str]:  # fmt: skip
    """With ``levels=2``: each block's outer segment and whether its input is kept through
    the forward or rebuilt in the backward (added to ``status``), and a line on the two
    levels."""
    if base.levels != 2:
        return []
    chain = TwoLevel(len(names), outer_segments(len(names), base.segments))
    for i, name in enumerate(names):
        seg = chain.segment_of(i)
        first = i == 0 or chain.segment_of(i - 1) != seg
        kept = "input kept" if first else "input rebuilt in the backward"
        status[name] += f"; outer segment {seg + 1}/{chain.segments}, {kept}"
    return [
        f"two levels: {chain.segments} outer segments of consecutive block calls (in the "
        "order above, assumed to be the order the model calls them): each keeps only its "
        "first block's input through the forward; the others are dropped, rebuilt from it "
        "without keeping a graph when that segment's backward begins, and freed block by "
        "block; an input that is not the previous block call's output, unchanged, is kept"
    ]
