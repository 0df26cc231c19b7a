"""The headline guard: the machine-independent figures behind the docs' headlines
(``headlines.toml``), recomputed from today's code and compared with the committed
results.

Each figure is one configuration of a sweep suite (a series at one swept value) and the
engines whose numbers a headline quotes. :func:`check_figure` measures them as the suite
does — one tracked step each, gradients against float64 autograd, no timing and no RSS —
and compares, per engine, the tracker peak and kept bytes (ratios to the suite's
reference engine; the reference's own in bytes) and the float32 gradient error with the
quick run's records in ``results/SUITE.json``. Memory must agree within
``tolerance.memory`` of the committed value either way (a zero stays zero; a saving that
grew is a stale headline too); an error may fall, but not rise past
``tolerance.grad_error`` times the committed one.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from ._runner import measure_config
from ._suites import load_suite

__all__ = ["Check", "Figure", "Tolerance", "check_figure", "compare", "load_figures", "moved"]

ERROR_FLOOR = 1e-7
"""Errors this small pass whatever the factor (float32 rounding of a few ulps)."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    memory: float = 0.02
    grad_error: float = 4.0


@dataclasses.dataclass(frozen=True)
class Figure:
    """A configuration a headline quotes: ``suite``'s ``series`` at swept value ``x``."""

    suite: str
    series: str
    x: Any
    engines: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.suite}/{self.series}/{self.x}"


@dataclasses.dataclass(frozen=True)
class Check:
    """One guarded number: committed, recomputed, and whether they agree."""

    figure: str
    engine: str
    what: str  # "peak", "kept" (ratios to the reference; bytes for the reference) or "error"
    committed: float | None
    now: float | None
    ok: bool

    def describe(self) -> str:
        def num(v: float | None) -> str:
            return "none" if v is None else f"{v:.6g}"

        verdict = "ok" if self.ok else "MOVED"
        return (f"{self.figure} {self.engine} {self.what}: committed {num(self.committed)}, "
                f"now {num(self.now)} ({verdict})")  # fmt: skip


def load_figures(text: str | None = None) -> tuple[list[Figure], Tolerance]:
    """The figures and tolerances of ``headlines.toml`` (or of ``text``)."""
    if text is None:
        text = (resources.files("leangrad_bench") / "headlines.toml").read_text()
    data = tomllib.loads(text)
    figures = [Figure(f["suite"], f["series"], f["x"], tuple(f["engines"]))
               for f in data.get("figure", [])]  # fmt: skip
    return figures, Tolerance(**data.get("tolerance", {}))


def committed_records(figure: Figure, results: Path) -> dict[str, dict[str, Any]]:
    """The quick run's records of ``figure``'s configuration, by engine label."""
    records = json.loads((Path(results) / f"{figure.suite}.json").read_text())
    return {r["engine"]: r for r in records
            if r.get("series") == figure.series and r.get("x") == figure.x
            and r.get("quick", True)}  # fmt: skip


def recompute(figure: Figure, *, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """``figure``'s records measured by today's code (memory and gradients only)."""
    suite = load_suite(figure.suite)
    series = next(s for s in suite.series if s.name == figure.series)
    by_label = {spec.display: spec for spec in suite.engines_for(series)}
    missing = [e for e in figure.engines if e not in by_label]
    if missing:
        raise ValueError(f"{figure.name}: the suite has no engines {missing}")
    config = {**series.config, suite.sweep: figure.x}
    specs = [by_label[e] for e in figure.engines]
    records = measure_config(config, specs, reference=suite.reference, repeats=0, rss=False,
                             device=device)  # fmt: skip
    return {r["engine"]: r for r in records}


def _ratios(records: Mapping[str, dict[str, Any]], reference: str, key: str
            ) -> dict[str, float | None]:  # fmt: skip
    ref = next(r for r in records.values() if r["engine_name"] == reference)
    out: dict[str, float | None] = {}
    for label, r in records.items():
        v = r.get(key)
        if r is ref or v is None or not ref.get(key):
            out[label] = v
        else:
            out[label] = v / ref[key]
    return out


def compare(figure: Figure, committed: Mapping[str, dict[str, Any]],
            now: Mapping[str, dict[str, Any]], *, reference: str,
            tolerance: Tolerance) -> list[Check]:  # fmt: skip
    """Every guarded number of ``figure``: ``committed`` against ``now`` records."""
    checks: list[Check] = []
    for what, key in (("peak", "peak_bytes"), ("kept", "saved_bytes")):
        old, new = _ratios(committed, reference, key), _ratios(now, reference, key)
        for engine in figure.engines:
            a, b = old.get(engine), new.get(engine)
            ok = a is not None and b is not None and abs(b - a) <= tolerance.memory * abs(a)
            checks.append(Check(figure.name, engine, what, a, b, ok))
    for engine in figure.engines:
        a = committed.get(engine, {}).get("grad_max_rel_err")
        b = now.get(engine, {}).get("grad_max_rel_err")
        ok = a is not None and b is not None and b <= a * tolerance.grad_error + ERROR_FLOOR
        checks.append(Check(figure.name, engine, "error", a, b, ok))
    return checks


def check_figure(figure: Figure, results: str | Path, *, tolerance: Tolerance,
                 device: str = "cpu") -> list[Check]:  # fmt: skip
    """Recompute ``figure`` and compare it with ``results/SUITE.json``."""
    committed = committed_records(figure, Path(results))
    absent = [e for e in figure.engines if e not in committed]
    if absent:
        raise ValueError(f"{figure.name}: {results}/{figure.suite}.json has no quick "
                         f"records of {absent}; run the suite's quick run")  # fmt: skip
    reference = load_suite(figure.suite).reference
    return compare(figure, committed, recompute(figure, device=device), reference=reference,
                   tolerance=tolerance)  # fmt: skip


def moved(checks: Sequence[Check]) -> list[str]:
    """The lines of the checks that failed."""
    return [c.describe() for c in checks if not c.ok]
