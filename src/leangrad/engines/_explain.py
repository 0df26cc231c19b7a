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
        lines += _traced_lines(base, model)
    if isinstance(eng, Composed):
        _, report = eng.prepare(model)
        for t in eng.transforms:
            for part, what in report[t.name].items():
                lines += _explain_part(t.name, part, what)
    return Explanation(eng.label, tuple(lines))


def _traced_lines(base: Checkpoint, model: nn.Module) -> list[str]:
    """Which recomputed blocks run as torch.fx code (intermediates die at last use)."""
    from ._checkpoint import traced

    if not base.trace:
        return ["recomputed blocks run as written (trace=False)"]
    found = base.blocks(model)
    names = base._checkpointed(found)
    fx_code = [n for n in names if traced(found.modules[n]) is not found.modules[n]]
    as_written = [n for n in names if n not in fx_code]
    out = [f"recomputed as torch.fx code (intermediates freed at last use): "
           f"{', '.join(fx_code) or 'none'}"]  # fmt: skip
    if as_written:
        out.append(f"recomputed as written (untraceable, optional arguments or a Python side "
                   f"effect): {', '.join(as_written)}")  # fmt: skip
    return out


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
