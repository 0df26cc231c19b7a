"""``leangrad.explain(engine, model)``: what an engine does to a model as written, in one
printable place — the blocks it checkpoints, and per transform and part what it changed
and what it left alone, and why."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ._base import Engine
from ._checkpoint import Checkpoint
from ._compose import Composed

__all__ = ["Explanation", "explain"]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What an engine does to a model, printable: the blocks it checkpoints, and for each
    transform and part what it changed and what it left alone, and why."""

    engine: str
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join([f"engine {self.engine}", *self.lines])


def explain(eng: Engine | str, model: nn.Module) -> Explanation:
    """Say what ``eng`` (an engine or a name) does to ``model``, in one place."""
    from ._registry import engine as make

    eng = make(eng) if isinstance(eng, str) else eng
    lines: list[str] = []
    if (why := eng.supports(model)) is not None:
        return Explanation(eng.label, (f"cannot run this model: {why}",))
    base = eng.base if isinstance(eng, Composed) else eng
    if isinstance(base, Checkpoint):
        lines += _block_lines(base, model)
    if isinstance(eng, Composed):
        _, report = eng.prepare(model)
        for t in eng.transforms:
            for part, what in report[t.name].items():
                lines += _explain_part(t.name, part, what)
    return Explanation(eng.label, tuple(lines))


LAST_SEGMENT = "left plain: the last segment, whose activations the backward needs first"


def _block_lines(base: Checkpoint, model: nn.Module) -> list[str]:
    """The blocks, each marked checkpointed or left plain (and why); with ``trace=True``,
    whether each checkpointed block runs as torch.fx code, and why not where it does not."""
    from ._checkpoint import position_children, trace_block
    from ._fragments import split_reason, static_reason

    found = base.blocks(model)
    text = str(found).splitlines()
    if not found.names:
        return text
    recomputed = set(base._checkpointed(found))
    status: dict[str, str] = {}
    traced: list[str] = []
    written: list[str] = []
    for name in found.names:
        if name not in recomputed:
            status[name] = LAST_SEGMENT
        elif not base.trace:
            status[name] = "checkpointed"
        else:
            _, why = trace_block(found.modules[name])
            status[name] = "checkpointed, " + ("as torch.fx code" if why is None
                                               else f"as written: {why}")  # fmt: skip
            (traced if why is None else written).append(name)
    if base.fragments is not None:
        for name in recomputed:
            block = [found.modules[name]]
            why = split_reason(block)
            if why is not None:
                status[name] += f", whole: {why}"
                continue
            status[name] += f", in {base.fragments} fragments of the batch"
            if static_reason(block) is not None:  # BatchNorm: frozen statistics
                status[name] += (" (training-mode BatchNorm: its statistics frozen, its "
                                 "backward's batch sums gathered in extra passes)")  # fmt: skip
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


def _two_level_lines(base: Checkpoint, names: tuple[str, ...], status: dict[str, str]) -> list[str]:
    """With ``levels=2``: each block's outer segment and whether its input is kept through
    the forward or rebuilt in the backward (added to ``status``), and a line on the two
    levels."""
    from ._two_level import TwoLevel, outer_segments

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


def _explain_part(name: str, part: str, what: dict[str, Any]) -> list[str]:
    if name == "fad":
        if what.get("used") == "eager":
            return [f"fad on {part} (eager fallback): {what['why']}"]
        how = "fx pass" if what["used"] == "fx" else "fx pass per block, eager where it fails"
        out = [f"fad on {part} ({how}): {len(what['fused'])} chain(s) fused"]
        out += [f"  fused: {f}" for f in what["fused"]]
        out += [f"  left: {f}" for f in what["left"]]
        return out
    swapped = what.get("swapped", {})
    if not swapped:
        why = what.get("why")
        return [f"{name} on {part}: nothing to swap" + (f" ({why})" if why else "")]
    out = [f"{name} on {part}: swapped {len(swapped)}"]
    out += [f"  {k}: {v}" for k, v in swapped.items()]
    out += [f"  left exact: {k} (no randomized version)" for k in what.get("left_exact", [])]
    return out
