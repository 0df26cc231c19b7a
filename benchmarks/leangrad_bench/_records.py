"""Reading suite results back: the ``*.json`` lists of records in a directory
(:func:`load_records`), and a record's values at the further thread counts it was timed
at (:func:`at_threads`, :func:`extra_threads`).

Below :mod:`~leangrad_bench._report` and :mod:`~leangrad_bench._reproduction`, which both
read records with it ( no import circle); ``_report`` re-exports these names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leangrad import _errors as errors

from ._suites import list_suites

__all__ = ["BAD_JSON", "NOT_A_DIRECTORY", "UNREADABLE", "at_threads", "extra_threads",
           "load_records", "scan_records"]  # fmt: skip


def extra_threads(records: list[dict[str, Any]]) -> list[int]:
    """The thread counts records were also timed at (``by_threads``) beside their own."""
    return sorted({e["threads"] for r in records for e in (r.get("by_threads") or [])}
                  - {r.get("threads") for r in records})  # fmt: skip


def at_threads(r: dict[str, Any], threads: int, key: str) -> Any:
    """A record's ``key`` as timed at ``threads`` (``by_threads``); ``None`` if not timed."""
    return next((e.get(key) for e in (r.get("by_threads") or []) if e["threads"] == threads),
                None)  # fmt: skip


NOT_A_DIRECTORY = (
    "{directory} is {what}: name the directory that `leangrad bench SUITE --out DIR` wrote to"
)
BAD_JSON = "{path} is not valid JSON ({error}); run its suite again, or move the file away"
UNREADABLE = "cannot read {path} ({error}); make it readable, or move it away"
_JSON_KIND = {"dict": "an object", "str": "a string", "int": "a number", "float": "a number",
              "bool": "true/false", "NoneType": "null"}  # fmt: skip


def load_records(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """Suite name -> records, from every ``*.json`` list of records in ``directory``."""
    return scan_records(Path(directory))[0]


def scan_records(directory: Path) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """The suites' records, and why each other ``*.json`` file is not a suite result."""
    if not directory.is_dir():
        what = "a file" if directory.exists() else "not there"
        raise errors.LeangradError(NOT_A_DIRECTORY.format(directory=directory, what=what))
    out: dict[str, list[dict[str, Any]]] = {}
    skipped: list[str] = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise errors.LeangradError(BAD_JSON.format(path=path, error=err)) from None
        except OSError as err:
            raise errors.LeangradError(UNREADABLE.format(path=path, error=err.strerror)) from None
        if not isinstance(data, list):
            what = _JSON_KIND.get(type(data).__name__, type(data).__name__)
            skipped.append(f"{path.name} holds {what}, not a list of records")
        elif not data:
            skipped.append(f"{path.name} is an empty list")
        elif not all(isinstance(r, dict) for r in data):
            skipped.append(f"{path.name} is a list of values, not of records (objects)")
        elif not any("suite" in r for r in data) and path.stem not in list_suites():
            skipped.append(f"{path.name} holds records of no suite (no 'suite' field)")
        else:
            out[path.stem] = data
    return out, skipped
