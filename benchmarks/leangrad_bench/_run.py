"""Run a named suite and write ``OUT/SUITE.json`` (a list of records)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from leangrad import _errors as errors

from ._runner import machine_info, measure_config, now
from ._suites import RunSettings, Suite, load_suite, runner_options

__all__ = ["MIXED", "NO_ONLY", "ONE_THREAD_COUNT", "UNKNOWN_SERIES", "run_suite",
           "timing_threads", "write_records"]  # fmt: skip

NO_ONLY = "suite {suite!r} runs all of its series at once; drop --only"
ONE_THREAD_COUNT = (
    "suite {suite!r} times at one thread count ({threads}); drop --threads (suites that "
    "time at several: {several})"
)
BAD_THREADS = (
    "suite {suite!r}: setting threads = {value!r} is not a list of thread counts; write e.g. "
    'threads = [1, "cores"]'
)
UNKNOWN_SERIES = "suite {suite!r} has no series {names}; its series: {known}"
MIXED = (
    "{path} holds a {theirs} run; --only merges into a file of the same mode: pass another "
    "--out, or run the whole suite"
)


def write_records(records: list[dict[str, Any]], path: Path) -> Path:
    """Write records as a JSON list, atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


TIMING_THREADS = 1
"""Torch threads of a suite's timings unless it records its own: ``time_interleaved``'s
default, which a suite without a ``threads`` setting times with."""


def timing_threads(
    suite: Suite, *, quick: bool = False, threads: Sequence[int | str] | None = None
) -> list[int]:
    """The torch thread counts ``suite``'s timings run at, side by side: ``threads`` (the
    command's ``--threads``), else the suite's ``threads`` setting, else
    ``[TIMING_THREADS]``; ``"cores"`` is this machine's CPU count, a repeat is dropped.

    Raises:
        OptionError: ``threads`` names several counts for a suite whose runner times at
            one; a ``threads`` setting that is not a list of counts.
    """
    raw = threads if threads is not None else suite.setting("threads", quick, [TIMING_THREADS])
    if not isinstance(raw, list | tuple) or not raw or not all(
        v == "cores" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1) for v in raw
    ):
        raise errors.OptionError(BAD_THREADS.format(suite=suite.name, value=raw))
    counts = list(dict.fromkeys((os.cpu_count() or 1) if v == "cores" else int(v) for v in raw))
    if counts != [TIMING_THREADS] and not _times_at_threads(suite):
        from ._suites import list_suites, load_suite

        several = [n for n in list_suites() if _times_at_threads(load_suite(n))]
        raise errors.OptionError(ONE_THREAD_COUNT.format(
            suite=suite.name, threads=TIMING_THREADS, several=", ".join(several)))  # fmt: skip
    return counts


def _times_at_threads(suite: Suite) -> bool:
    """A sweep suite, or a runner declared with ``runner(threads=True)``."""
    return suite.runner is None or runner_options(suite.resolve_runner()).threads


def run_suite(
    name: str,
    *,
    out: str | Path = "results",
    quick: bool = False,
    rss: bool = True,
    device: str = "cpu",
    progress: bool = True,
    only: Sequence[str] | None = None,
    threads: Sequence[int | str] | None = None,
) -> Path:
    """Run suite ``name`` and write ``out/name.json``; returns the path.

    Every record carries the fields of :data:`~leangrad_bench.RECORD_FIELDS`
    plus ``suite``, ``series``, ``sweep``, ``x`` (the swept value), ``quick``,
    ``machine``, ``created`` and ``threads`` (torch threads of its timings: the record's
    own, else ``config["threads"]``, else :data:`TIMING_THREADS`).

    ``threads`` (e.g. ``[1, "cores"]``; default: the suite's ``threads`` setting) times
    every step at each thread count side by side in one run (:func:`timing_threads`);
    a record's ``by_threads`` lists its time fields per count, ratios at the same count.

    ``only`` runs just these series (a sweep suite's series, the zoo's models) and merges
    them into ``out/name.json``: the records of the series run are replaced, the others
    kept. A file from the other mode (``--quick`` or not) is refused, not mixed.

    A runner gets these as a :class:`~leangrad_bench._suites.RunSettings`; one that calls
    its ``save`` (the zoo) writes the file after each of its series, so a long run that is
    stopped keeps every series it finished.
    """
    suite = load_suite(name)
    counts = timing_threads(suite, quick=quick, threads=threads)
    path = Path(out) / f"{suite.name}.json"
    kept = _kept_records(path, quick=quick) if only is not None else []
    stamp = {"suite": suite.name, "quick": quick, "machine": machine_info(), "created": now()}

    def merged(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in records:  # the run's fields; a record's own ``threads`` wins
            r.update(stamp)
            r.setdefault("threads", (r.get("config") or {}).get("threads", TIMING_THREADS))
        rerun = {r.get("series") for r in records}
        return [r for r in kept if r.get("series") not in rerun] + records

    if suite.runner is not None:
        runner = suite.resolve_runner()
        takes = runner_options(runner)
        if only is not None and not takes.only:
            raise errors.OptionError(NO_ONLY.format(suite=suite.name))
        settings = RunSettings(
            quick=quick,
            device=device,
            progress=progress,
            threads=counts if takes.threads else None,
            only=list(only) if only is not None else None,
            save=lambda records: write_records(merged(records), path),
        )
        records = runner(suite, settings)
    else:
        if only is not None:
            suite = dataclasses.replace(suite, series=_pick(suite, only))
        records = _sweep(suite, quick=quick, rss=rss, device=device, progress=progress,
                         threads=counts)  # fmt: skip
    return write_records(merged(records), path)


def _pick(suite: Suite, only: Sequence[str]) -> list[Any]:
    known = [s.name for s in suite.series]
    unknown = [n for n in only if n not in known]
    if unknown:
        raise errors.OptionError(UNKNOWN_SERIES.format(
            suite=suite.name, names=", ".join(unknown), known=", ".join(known)))  # fmt: skip
    return [s for s in suite.series if s.name in only]


def _kept_records(path: Path, *, quick: bool) -> list[dict[str, Any]]:
    """The records already in ``path`` that a run of some series is merged into."""
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise errors.OptionError(f"cannot merge into {path}: {err}") from err
    modes = {bool(r.get("quick")) for r in old if isinstance(r, dict)}
    if modes - {quick}:
        raise errors.OptionError(MIXED.format(path=path, theirs="--quick" if not quick else "full"))
    return [r for r in old if isinstance(r, dict)]


def _sweep(
    suite: Suite, *, quick: bool, rss: bool, device: str, progress: bool, threads: list[int]
) -> list[dict[str, Any]]:
    jobs = suite.jobs(quick)
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
            threads=threads,
            progress=lambda msg: bar.set_postfix_str(msg, refresh=True),
        )
        for r in recs:
            r.update(series=series.name, sweep=suite.sweep, x=value)
        records.extend(recs)
    return records
