"""Suites of Moonwalk v2's fragmental checkpointing (section 6.3, Fig. 3): the report of
``fragmental-1d`` and the ``depth-at-budget`` search (the paper's 10 / 16 / 22 layers)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from leangrad.measure import MemoryBudgetExceeded, MemoryTracker

from ._report import by_series, fmt, fmt_bytes, md_table, sweep_section
from ._runner import EngineSpec, new_record
from ._search import bisect_last_fit
from ._suites import RunSettings, Suite
from ._workloads import build

__all__ = [
    "DepthProbe",
    "deepest_fitting",
    "report_depth_at_budget",
    "report_fragmental",
    "run_depth_at_budget",
]

MiB = 2**20


# -- fragmental-1d ------------------------------------------------------------------


def report_fragmental(
    suite: str, records: list[dict[str, Any]], directory: Path, *, plots: bool
) -> list[str]:
    """The usual sweep tables, plus kept cotangent bytes relative to full checkpointing."""
    lines: list[str] = []
    for series, recs in by_series(records).items():
        lines += sweep_section(suite, series, recs, directory, plots=plots)
        kept = {(r["engine"], r["x"]): (r.get("engine_info") or {}).get("kept_cotangent_bytes")
                for r in recs}  # fmt: skip
        peaks = {(r["engine"], r["x"]): r.get("peak_bytes") for r in recs}
        engines = sorted({e for e, _ in kept if kept[(e, _)] is not None})
        if not engines:
            continue

        def ratio(a: Any, b: Any) -> str:
            return fmt(a / b if a is not None and b else None, ".3f")

        rows = [(e, x, fmt_bytes(kept.get((e, x))),
                 ratio(kept.get((e, x)), kept.get(("moonwalk(fragment=full)", x))),
                 ratio(peaks.get((e, x)), peaks.get(("backprop", x))))
                for e in engines for x in sorted({x for _, x in kept})]  # fmt: skip
        head = ("engine", recs[0].get("sweep", "x"), "kept", "kept / full", "peak / backprop")
        lines += [
            "Cotangent bytes Moonwalk keeps from Phase II for Phase III (measured on the "
            "kept storages), ratio to `fragment=full`, and peak ratio to backprop:",
            "",
            *md_table(head, rows),
            "",
        ]
    return lines


# -- depth-at-budget ----------------------------------------------------------------


class DepthProbe(dict):  # type: ignore[type-arg]
    """One probe of the search: ``{"depth", "fits", "total_bytes"}`` (JSON-ready)."""


def _probe(config: dict[str, Any], spec: EngineSpec, depth: int, budget: int,
           device: str) -> DepthProbe:  # fmt: skip
    """One step of ``spec`` at ``depth`` under the budget: did it fit, and its peak."""
    wl = build({**config, "depth": depth}, device=device)
    engine = spec.make()
    reason = engine.supports(wl.model)
    if reason is not None:
        raise ValueError(f"{engine.label} cannot run this model: {reason}")
    gc.collect()
    tracker = MemoryTracker(baseline=(wl.model, wl.inputs, wl.targets), budget_bytes=budget)
    try:
        with tracker:
            engine.backward(wl.model, wl.inputs, wl.loss_fn)
    except MemoryBudgetExceeded:
        return DepthProbe(depth=depth, fits=False, total_bytes=None)
    rep = tracker.report
    return DepthProbe(depth=depth, fits=True, total_bytes=rep.baseline_bytes + rep.peak_bytes)


def deepest_fitting(
    fits: Callable[[int], DepthProbe], *, max_depth: int, extra_probes: int = 2
) -> tuple[int, list[DepthProbe]]:
    """The deepest depth ``d ≤ max_depth`` with ``fits(d)``, by doubling from 1, then
    bisection, then ``extra_probes`` deeper probes past the boundary (the peak need not be
    monotone in depth, e.g. √L segments round); 0 when depth 1 does not fit."""
    probes: list[DepthProbe] = []
    seen: dict[int, bool] = {}

    def ok(d: int) -> bool:
        if d not in seen:
            p = fits(d)
            probes.append(p)
            seen[d] = bool(p["fits"])
        return seen[d]

    lo, hi = 0, None
    d = 1
    while d <= max_depth:
        if ok(d):
            lo, d = d, d * 2
        else:
            hi = d
            break
    if hi is None:
        if lo < max_depth and ok(max_depth):
            return max_depth, probes
        hi = max_depth if lo < max_depth else max_depth + 1
    while True:
        lo = bisect_last_fit(ok, lo, hi)
        hi = lo + 1
        deeper = [d for d in range(hi + 1, min(hi + extra_probes, max_depth) + 1) if ok(d)]
        if not deeper:
            return lo, probes
        lo, hi = deeper[-1], deeper[-1] + 1
        while hi <= max_depth and ok(hi):  # keep going while it fits
            lo, hi = hi, hi + 1


def run_depth_at_budget(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """For each engine, the deepest network whose training step fits the budget."""
    quick, device = settings.quick, settings.device
    budget = int(float(suite.setting("budget_mib", quick)) * MiB)
    max_depth = int(suite.setting("max_depth", quick, 256))
    extra = int(suite.setting("extra_probes", quick, 2))
    config = dict(suite.setting("config", quick))
    head = {"kind": "depth_at_budget", "series": "budget", "sweep": "depth"}
    records = []
    bar = tqdm(suite.engines, desc="depth-at-budget", unit="engine",
               disable=not settings.progress)  # fmt: skip
    for spec in bar:
        label = spec.display
        bar.set_description(f"depth-at-budget {label}")

        def fits(d: int, spec: EngineSpec = spec) -> DepthProbe:
            bar.set_postfix(depth=d)
            return _probe(config, spec, d, budget, device)

        depth, probes = deepest_fitting(fits, max_depth=max_depth, extra_probes=extra)
        at = next((p for p in probes if p["depth"] == depth), None)
        mine = dict(x=depth, engine=label, engine_name=spec.name, options=spec.options,
                    config=config, budget_bytes=budget, max_depth=depth,
                    capped=depth >= max_depth, total_bytes_at_max=at and at["total_bytes"],
                    probes=probes)  # fmt: skip
        records.append(new_record(head, mine))
    by_name = {r["engine"]: r["max_depth"] for r in records}
    for r in records:
        for ref in ("backprop", "checkpoint(segments=sqrt)"):
            base = by_name.get(ref)
            r[f"ratio_to_{ref.split('(')[0]}"] = r["max_depth"] / base if base else None
    return records


def report_depth_at_budget(
    suite: str, records: list[dict[str, Any]], directory: Path, *, plots: bool
) -> list[str]:
    """The paper-style depth table, with the probes that found each depth."""
    del directory, plots
    if not records:
        return []
    head = ("engine", "deepest depth that fits", "live at that depth", "× backprop",
            "× checkpoint", "probes (depth: fits)")  # fmt: skip
    rows = [(r["engine"], f"{r['max_depth']}{' (search cap)' if r.get('capped') else ''}",
             fmt_bytes(r["total_bytes_at_max"]), fmt(r.get("ratio_to_backprop"), ".2f"),
             fmt(r.get("ratio_to_checkpoint"), ".2f"),
             ", ".join(f"{p['depth']}:{'✓' if p['fits'] else '✗'}" for p in r["probes"]))
            for r in records]  # fmt: skip
    return [f"Budget: {fmt_bytes(records[0]['budget_bytes'])} for everything live during the "
            f"step (`{records[0]['config']}`). Paper (24 GB GPU): backprop 10, checkpointing "
            "16, Moonwalk B=16 22 layers.", "", *md_table(head, rows), ""]  # fmt: skip
