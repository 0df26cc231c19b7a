"""The headline guard: every figure of ``headlines.toml`` recomputed from today's code
equals the committed quick results within the stated tolerances, and the guard fails
when a headline moves (a Moonwalk that holds one activation too long)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from leangrad.engines._moonwalk import Moonwalk
from leangrad_bench._headlines import Figure, Tolerance, check_figure, load_figures, moved

RESULTS = Path(__file__).resolve().parents[2] / "results"
FIGURES, TOLERANCE = load_figures()


def test_the_guard_covers_the_papers_memory_headlines() -> None:
    suites = {f.suite for f in FIGURES}
    assert {"moonwalk-v2-cnn", "fragmental-1d", "moonwalk-v1-revnet"} <= suites
    assert Tolerance(memory=0.02, grad_error=4.0) == TOLERANCE


@pytest.mark.parametrize("figure", FIGURES, ids=[f.name for f in FIGURES])
def test_headline_figures_match_the_committed_results(figure: Figure) -> None:
    checks = check_figure(figure, RESULTS, tolerance=TOLERANCE)
    assert len(checks) == 3 * len(figure.engines)
    assert not moved(checks), (
        "a headline moved; re-run `leangrad bench "
        f"{figure.suite} --quick --out results` and commit the results with the change:\n"
        + "\n".join(moved(checks))
    )


def test_the_guard_fails_when_a_headline_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reintroduce a regression the guard exists for: Moonwalk's seed keeps a second
    reference to x1 through Phases I and II (0.42x -> 0.45x of backprop's peak here)."""
    phase_one_two = Moonwalk._phase_one_two

    def holding(self: Moonwalk, run: Any, layers: Any, handed: list[Any], **kw: Any) -> Any:
        held = list(handed)
        try:
            return phase_one_two(self, run, layers, handed, **kw)
        finally:
            del held

    monkeypatch.setattr(Moonwalk, "_phase_one_two", holding)
    figure = Figure("moonwalk-v2-cnn", "repeat-stem", 6, ("backprop", "moonwalk"))
    checks = check_figure(figure, RESULTS, tolerance=TOLERANCE)
    failed = {(c.engine, c.what) for c in checks if not c.ok}
    assert failed == {("moonwalk", "peak"), ("moonwalk", "kept")}
    peak = next(c for c in checks if (c.engine, c.what) == ("moonwalk", "peak"))
    assert peak.committed is not None and peak.now is not None
    assert peak.now > 1.05 * peak.committed


def test_rad_saved_bytes_match_the_committed_results() -> None:
    """RAD App. A's headline ("saved 8.2x" at batch 150, fraction 0.1): every rad-variance
    record's saved bytes, measured again by today's code, as a ratio to the exact batch-150
    step's within the memory tolerance."""
    from leangrad_bench._rad import _load, _network, memory_of, randomized

    records = [r for r in json.loads((RESULTS / "rad-variance.json").read_text())
               if r.get("kind") == "rad-variance"]  # fmt: skip
    train, _ = _load(records[0]["config"]["dataset"], records[0]["config"]["seed"])
    moved_rows = []
    for kind in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == kind]
        seed = rows[0]["config"]["seed"]
        base = _network(kind, train.x.shape[-1], seed, "cpu")
        ref = next(r for r in rows if r["fraction"] is None and r["batch"] == 150)
        now: dict[int, int] = {}
        for i, r in enumerate(rows):
            model = randomized(base, r["fraction"], r["mode"], seed + 1)
            now[i] = memory_of(model, train.x[: r["batch"]], train.y[: r["batch"]])["saved_bytes"]
        ref_now = now[rows.index(ref)]
        for i, r in enumerate(rows):
            committed, measured = r["saved_bytes"] / ref["saved_bytes"], now[i] / ref_now
            if abs(measured - committed) > TOLERANCE.memory * committed:
                moved_rows.append(f"{kind} {r['engine']}: {committed:.4f} -> {measured:.4f}")
    assert not moved_rows, moved_rows
    rad01 = next(r for r in records if r["model"] == "mlp" and r["fraction"] == 0.1)
    mlp150 = next(r for r in records if r["model"] == "mlp" and r["fraction"] is None
                  and r["batch"] == 150)  # fmt: skip
    assert mlp150["saved_bytes"] / rad01["saved_bytes"] > 8  # the headline itself
