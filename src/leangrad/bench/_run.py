"""Run a named suite and write ``OUT/SUITE.json`` (a list of records)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ._runner import machine_info, measure_config
from ._suites import Suite, load_suite

__all__ = ["run_suite", "write_records"]


def write_records(records: list[dict[str, Any]], path: Path) -> Path:
    """Write records as a JSON list, atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def run_suite(
    name: str,
    *,
    out: str | Path = "results",
    quick: bool = False,
    rss: bool = True,
    device: str = "cpu",
    progress: bool = True,
) -> Path:
    """Run suite ``name`` and write ``out/name.json``; returns the path.

    Every record carries the fields of :data:`~leangrad.bench.RECORD_FIELDS`
    plus ``suite``, ``series``, ``sweep``, ``x`` (the swept value), ``quick``,
    ``machine`` and ``created``.
    """
    suite = load_suite(name)
    if suite.runner is not None:
        records = suite.resolve_runner()(suite, quick=quick, device=device, progress=progress)
    else:
        records = _sweep(suite, quick=quick, rss=rss, device=device, progress=progress)
    return write_records(records, Path(out) / f"{suite.name}.json")


def _sweep(suite: Suite, *, quick: bool, rss: bool, device: str, progress: bool) -> list[dict]:
    machine = machine_info()
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    jobs = [(s, v) for s in suite.series for v in (s.quick_values if quick else s.values)]
    records: list[dict[str, Any]] = []
    bar = tqdm(jobs, desc=f"bench {suite.name}", unit="config", disable=not progress)
    for series, value in bar:
        config = {**series.config, suite.sweep: value}
        bar.set_description(f"{suite.name} {series.name} {suite.sweep}={value}")
        recs = measure_config(
            config,
            suite.engines_for(series),
            reference=suite.reference,
            repeats=suite.repeats(quick),
            warmup=int(suite.settings.get("warmup", 1)),
            rss=rss,
            device=device,
            progress=lambda msg: bar.set_postfix_str(msg, refresh=True),
        )
        for r in recs:
            r.update(
                suite=suite.name,
                series=series.name,
                sweep=suite.sweep,
                x=value,
                quick=quick,
                machine=machine,
                created=created,
            )
        records.extend(recs)
    return records
