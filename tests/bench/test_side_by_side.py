"""train_side_by_side: the one loop of the training suites — rounds, records, the failure rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from leangrad_bench._side_by_side import Curves, Lane, make_optimizer, train_side_by_side


class _Toy(Curves):
    """Lane "bad" raises at round 2; every round is recorded; end_round sees live lanes."""

    def __init__(self, *, failure_records: bool) -> None:
        self.failure_records = failure_records
        self.ended: list[tuple[int, list[str]]] = []

    def record(self, lane: Lane, r: int) -> dict[str, Any]:
        return {"engine": lane.label, "x": r, "failed": None}

    def advance(self, lane: Lane, r: int, batch: Any) -> int:
        if lane.label == "bad" and r == 2:
            raise FloatingPointError("batch loss is nan")
        return batch * 10

    def measure(self, lane: Lane, r: int, batch: Any, out: Any) -> dict[str, Any] | None:
        return None if r == 1 else {"out": out}

    def end_round(self, lanes: Sequence[Lane], r: int) -> None:
        self.ended.append((r, [ln.label for ln in lanes]))


def _lanes() -> list[Lane]:
    model = nn.Linear(2, 2)
    return [Lane(lb, model, make_optimizer("sgd", model.parameters(), 0.1)) for lb in
            ("good", "bad", "skipped")]  # fmt: skip


@pytest.mark.parametrize("failure_records", [True, False])
def test_a_failing_lane_stops_and_says_why_the_others_go_on(failure_records: bool) -> None:
    lanes = _lanes()
    lanes[2].failed = "not applicable: no"
    curves = _Toy(failure_records=failure_records)
    recs = train_side_by_side(lanes, [(r, r) for r in range(4)], curves)
    got = [(r["engine"], r["x"], r.get("out"), r["failed"]) for r in recs]
    fail = [("bad", 2, None, "step 2: FloatingPointError: batch loss is nan")]
    assert got == [("good", 0, 0, None), ("bad", 0, 0, None), ("good", 2, 20, None),
                   *(fail if failure_records else []), ("good", 3, 30, None)]  # fmt: skip
    assert curves.ended == [(0, ["good", "bad"]), (1, ["good", "bad"]), (2, ["good"]),
                            (3, ["good"])]  # fmt: skip


def test_make_optimizer_names_the_choices() -> None:
    params = [nn.Parameter(torch.zeros(1))]
    assert isinstance(make_optimizer("adam", params, 1e-3), torch.optim.Adam)
    assert make_optimizer("sgd", params, 1e-3, momentum=0.0).defaults["momentum"] == 0.0
    with pytest.raises(ValueError, match="'adam' or 'sgd'"):
        make_optimizer("rmsprop", params, 1e-3)
