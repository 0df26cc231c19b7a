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
        lines += str(base.blocks(model)).splitlines()
    if isinstance(eng, Composed):
        _, report = eng.prepare(model)
        for t in eng.transforms:
            for part, what in report[t.name].items():
                lines += _explain_part(t.name, part, what)
    return Explanation(eng.label, tuple(lines))


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
        return [f"{name} on {part}: nothing to swap"]
    out = [f"{name} on {part}: swapped {len(swapped)}"]
    out += [f"  {k}: {v}" for k, v in swapped.items()]
    out += [f"  left exact: {k} (no randomized version)" for k in what.get("left_exact", [])]
    return out
