"""The planner: :func:`plan` finds the fastest way to train a model in a memory budget
and returns a :class:`Plan` (the chosen engine, the table it decided from, save and
load). Its private modules, one concern each: ``_plan`` (the search), ``_measure``
(running a candidate), ``_choice`` (the fastest within noise), ``_verify`` (the chosen
engine re-checked against the whole-batch step), ``_compile`` and ``_regional``
(``torch.compile`` candidates), ``_ranks`` and ``_parallel`` (DDP and FSDP2 per-rank
budgets), ``_io`` (the plan's record)."""

from ._io import Candidate, Plan
from ._plan import candidates, plan

__all__ = ["Candidate", "Plan", "candidates", "plan"]
