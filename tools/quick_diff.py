"""The check for a bench refactor: each suite's quick JSON, before and after, equal in
every memory and gradient field.

Run as a file, so the same command runs a suite from another checkout's sources::

    python tools/quick_diff.py --base OLD_CHECKOUT [--suites blocks,fad] [--out DIR]

Each suite runs ``leangrad bench SUITE --quick --no-progress`` twice with this interpreter:
with ``PYTHONPATH`` at ``OLD_CHECKOUT``'s ``src`` (and ``benchmarks``, where it has them
apart) and at this checkout's. Records are
matched by what names them (:data:`KEY`: suite, kind, series, engine, ``x``, seed, threads,
model, method, label, fraction — those present), in order where several share a name, and
every field whose name matches :data:`COMPARED` must be equal; times, timestamps, the
machine and fresh-process RSS are not compared. Prints one line per suite and each
difference; exits 1 if any suite differs or failed to run, 2 on bad arguments."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

KEY = ("suite", "kind", "series", "engine", "x", "seed", "threads", "model", "method",
       "label", "fraction")  # fmt: skip
"""The fields that name a record (those present)."""
COMPARED = re.compile(r"bytes|peak|saved|kept|forward_live|max_batch|max_depth|grad_|mse"
                      r"|cosine|params")  # fmt: skip
"""Fields compared exactly (the issue's memory and gradient-error fields)."""
IGNORED = re.compile(r"^rss_|seconds|time|created|machine")
"""Fields never compared, even where :data:`COMPARED` matches: fresh-process RSS, times."""
HERE = Path(__file__).resolve().parent.parent


def run(root: Path, suite: str, out: Path) -> list[dict[str, Any]]:
    """``suite``'s quick records, run from the checkout at ``root`` into ``out``: its
    ``src`` and, where it has them apart from the library, its ``benchmarks``."""
    paths = [root / "src", *[root / "benchmarks"] * (root / "benchmarks").is_dir()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    cmd = [sys.executable, "-m", "leangrad", "bench", suite, "--quick", "--no-progress",
           "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    records: list[dict[str, Any]] = json.loads((out / f"{suite}.json").read_text())
    return records


def key(record: dict[str, Any]) -> str:
    return json.dumps({k: record[k] for k in KEY if k in record}, sort_keys=True, default=str)


def compared(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if COMPARED.search(k) and not IGNORED.search(k)}


def differences(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """What differs between two runs' records, one line each (empty: equal)."""
    groups: dict[str, list[list[dict[str, Any]]]] = {}
    for side, records in enumerate((before, after)):
        for r in records:
            groups.setdefault(key(r), [[], []])[side].append(r)
    out = []
    for name, (old, new) in groups.items():
        if len(old) != len(new):
            out.append(f"{name}: {len(old)} record(s) before, {len(new)} after")
            continue
        for a, b in zip(old, new, strict=True):
            fa, fb = compared(a), compared(b)
            for field in sorted(fa.keys() | fb.keys()):
                if fa.get(field, "<missing>") != fb.get(field, "<missing>"):
                    out.append(f"{name}: {field}: {fa.get(field, '<missing>')!r} -> "
                               f"{fb.get(field, '<missing>')!r}")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout before")
    parser.add_argument("--suites", default="", help="comma-separated (default: every suite)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/quick_diff"))
    args = parser.parse_args(argv)
    if not (args.base / "src" / "leangrad").is_dir():
        parser.error(f"{args.base} has no src/leangrad")
    suites = [s for s in args.suites.split(",") if s] or sorted(
        p.stem for p in (HERE / "benchmarks/leangrad_bench/suites").glob("*.toml"))
    failed = 0
    for suite in suites:
        try:
            old = run(args.base, suite, args.out / "base")
            new = run(HERE, suite, args.out / "head")
        except subprocess.CalledProcessError as err:
            print(f"{suite}: failed ({err})")
            failed += 1
            continue
        diff = differences(old, new)
        print(f"{suite}: {len(new)} records, " + (f"{len(diff)} differences" if diff else "equal"))
        for line in diff:
            print(f"  {line}")
        failed += bool(diff)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
