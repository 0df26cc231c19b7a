"""One training loop for the training suites: lanes trained side by side, round by round.

A *lane* is one model trained by one engine (or one variant of a model); a *round*
is one step or one epoch. Every round, each lane still running is advanced, then
measured; a lane that raises gets a record with ``failed`` set and stops, the
others go on. What a round means — train one batch, one epoch, nothing at round 0
— and what a record holds is a :class:`Curves` config of the suite; the loop and
the failure rule are shared here.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Curves", "Lane", "make_optimizer", "same_start", "train_side_by_side"]


@dataclasses.dataclass(eq=False)
class Lane:
    """One model trained by one engine beside the others.

    Attributes:
        label: Display label of the lane (its records' ``engine``).
        model: The model it trains (its own copy).
        opt: The optimizer over ``model``'s parameters.
        fields: What every record of this lane carries besides the suite's fields.
        engine: The engine computing its gradients (``None``: the suite's own rule).
        failed: Why the lane stopped (``None`` while it runs).
        seconds: Training time spent so far.
    """

    label: str
    model: nn.Module
    opt: torch.optim.Optimizer
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: Any = None
    failed: str | None = None
    seconds: float = 0.0


class Curves(abc.ABC):
    """What a training suite does in each round of :func:`train_side_by_side`."""

    unit: str = "step"
    """Names the round in failure messages (``"step 3: ..."``)."""

    failure_records: bool = True
    """A failed lane gets a record saying why (``False``: its curve just ends)."""

    @abc.abstractmethod
    def record(self, lane: Lane, r: int) -> dict[str, Any]:
        """The record of ``lane`` at round ``r`` before anything is measured."""

    @abc.abstractmethod
    def advance(self, lane: Lane, r: int, batch: Any) -> Any:
        """Train ``lane`` for round ``r``; raise to stop it. Returns what :meth:`measure` needs."""

    @abc.abstractmethod
    def measure(self, lane: Lane, r: int, batch: Any, out: Any) -> dict[str, Any] | None:
        """The measured fields of round ``r``'s record; ``None``: no record this round."""

    def end_round(self, lanes: Sequence[Lane], r: int) -> None:  # noqa: B027 (optional hook)
        """After every running lane's round (``lanes``: those still running)."""


def train_side_by_side(
    lanes: Sequence[Lane], rounds: Iterable[tuple[int, Any]], curves: Curves
) -> list[dict[str, Any]]:
    """Train ``lanes`` round by round on the same ``(round, batch)`` stream; their records.

    A lane whose :meth:`Curves.advance` raises stops; with ``curves.failure_records``
    it gets one record with ``failed`` set (``"<unit> <round>: <error type>: <message>"``).
    A lane failed before the first round gets no record at all.
    """
    records: list[dict[str, Any]] = []
    for r, batch in rounds:
        for lane in lanes:
            if lane.failed is not None:
                continue
            rec = curves.record(lane, r)
            try:
                out = curves.advance(lane, r, batch)
            except Exception as err:  # record what happened, stop this lane
                lane.failed = f"{curves.unit} {r}: {type(err).__name__}: {err}"
                if curves.failure_records:
                    rec["failed"] = lane.failed
                    records.append(rec)
                continue
            fields = curves.measure(lane, r, batch, out)
            if fields is not None:
                rec.update(fields)
                records.append(rec)
        curves.end_round([lane for lane in lanes if lane.failed is None], r)
    return records


def make_optimizer(
    name: str, params: Iterable[Any], lr: float, *, momentum: float = 0.9
) -> torch.optim.Optimizer:
    """``"adam"`` or ``"sgd"`` (with ``momentum``) over ``params``."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


def same_start(model: nn.Module, labels: Iterable[str], optimizer: str, lr: float) -> list[Lane]:
    """One lane per label, each training its own copy of ``model`` (the same initialisation)
    with its own ``optimizer`` (:func:`make_optimizer`) at ``lr``."""
    lanes = []
    for label in labels:
        mine = copy.deepcopy(model)
        lanes.append(Lane(label, mine, make_optimizer(optimizer, mine.parameters(), lr)))
    return lanes
