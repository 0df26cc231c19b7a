"""``leangrad.explain(engine, model)``: what an engine does to a model as written, in one
printable place — the blocks it checkpoints, and per transform and part what it changed
and what it left alone, and why."""

from __future__ import annotations

import dataclasses

from torch import nn

from ._base import Engine
from .checkpoint._explain import LAST_SEGMENT

__all__ = ["LAST_SEGMENT", "Explanation", "explain"]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What an engine does to a model, printable: the blocks it checkpoints, and for each
    transform and part what it changed and what it left alone, and why."""

    engine: str
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join([f"engine {self.engine}", *self.lines])


def explain(eng: Engine | str, model: nn.Module) -> Explanation:
    """Say what ``eng`` (an engine or a name) does to ``model``, in one place: what the
    engine itself prints (:meth:`~leangrad.engines._base.Engine.explain_lines`: a
    checkpointing engine its blocks, a composition what each transform changed)."""
    from ._registry import engine as make

    eng = make(eng) if isinstance(eng, str) else eng
    if (why := eng.supports(model)) is not None:
        return Explanation(eng.label, (f"cannot run this model: {why}",))
    return Explanation(eng.label, tuple(eng.explain_lines(model)))
