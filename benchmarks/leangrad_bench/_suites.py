"""Named benchmark suites: TOML files in ``benchmarks/leangrad_bench/suites/`` (data, not code).

A suite lists engines (registry name, options, optional label and
``max_params``) and series: a base configuration (see :func:`~leangrad_bench.build`)
swept over one key (``sweep``, e.g. ``depth``) with ``values`` (full run) and
``quick_values`` (``--quick``). A series may restrict itself to some engine
labels. A suite with ``runner = "module:function"`` is run by that function
instead (for suites that train rather than sweep), and a suite with
``report = "module:function"`` renders its own section of ``leangrad report``:
``function(suite_name, records, directory, plots=bool) -> list[str]`` (Markdown lines).

A runner is ``function(suite, settings) -> list[dict]`` (records), ``settings`` a
:class:`RunSettings`; :func:`runner` declares which of ``--threads`` and ``--only`` it
honours (by default neither: it times at one thread count and runs all of its series).
"""

from __future__ import annotations

import dataclasses
import importlib
import tomllib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from leangrad import _errors as errors

from ._runner import EngineSpec

__all__ = ["RunSettings", "RunnerOptions", "Series", "Suite", "list_suites", "load_suite",
           "runner", "runner_options"]  # fmt: skip

BAD_SUITE = (
    "suite {name!r} ({source}): {problem}; write it like the suites shipped in "
    "benchmarks/leangrad_bench/suites/ (`leangrad bench --list`)"
)
NO_SUITE_FILE = "suite file {path} does not exist; name a .toml file or one of: {known}"
BAD_HOOK = "suite {name!r}: its {what} {spec!r} cannot be imported ({error})"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """How ``leangrad bench`` runs a suite: what a suite runner reads besides the suite.

    Attributes:
        quick: use the suite's ``quick_*`` values and settings (``--quick``).
        device: where the models run (``--device``), e.g. ``"cpu"`` or ``"cuda"``.
        progress: show a progress bar.
        threads: the torch thread counts to time at side by side (``--threads``, else the
            suite's ``threads`` setting); ``None``: the runner's own default. Only given to
            a runner declared with ``runner(threads=True)``.
        only: run just these series (``--only``); ``None``: all of them. Only given to a
            runner declared with ``runner(only=True)``.
        save: called with the records so far, to write them while a long run goes on (a
            runner may call it after each series); ``None``: nothing to call.
    """

    quick: bool = False
    device: str = "cpu"
    progress: bool = True
    threads: list[int] | None = None
    only: list[str] | None = None
    save: Callable[[list[dict[str, Any]]], object] | None = None


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """What a suite runner honours beyond ``quick``, ``device`` and ``progress``.

    Attributes:
        threads: it times at every count of ``RunSettings.threads`` side by side (else it
            times at one thread count, and ``--threads`` with several is refused).
        only: it runs just the series of ``RunSettings.only`` (else ``--only`` is refused).
    """

    threads: bool = False
    only: bool = False


_OPTIONS = "leangrad_runner_options"
_F = TypeVar("_F", bound="Callable[[Suite, RunSettings], list[dict[str, Any]]]")


def runner(*, threads: bool = False, only: bool = False) -> Callable[[_F], _F]:
    """Declare the :class:`RunnerOptions` of a suite runner (returns it unchanged)."""

    def declare(fn: _F) -> _F:
        setattr(fn, _OPTIONS, RunnerOptions(threads=threads, only=only))
        return fn

    return declare


def runner_options(fn: Callable[..., Any]) -> RunnerOptions:
    """The options ``fn`` was declared with by :func:`runner`; none if it was not."""
    options = getattr(fn, _OPTIONS, RunnerOptions())
    assert isinstance(options, RunnerOptions)
    return options


@dataclasses.dataclass(frozen=True)
class Series:
    name: str
    config: dict[str, Any]
    values: list[Any]
    quick_values: list[Any]
    engines: list[str] | None


@dataclasses.dataclass(frozen=True)
class Suite:
    """A parsed suite file."""

    name: str
    description: str
    reference: str
    sweep: str
    engines: list[EngineSpec]
    series: list[Series]
    settings: dict[str, Any]
    runner: str | None = None
    report: str | None = None

    def engines_for(self, series: Series) -> list[EngineSpec]:
        if series.engines is None:
            return list(self.engines)
        by_label = {e.display: e for e in self.engines}
        missing = [lb for lb in series.engines if lb not in by_label]
        if missing:
            raise ValueError(
                f"suite {self.name!r}, series {series.name!r}: unknown engine labels {missing}; "
                f"the suite defines {sorted(by_label)}"
            )
        return [by_label[lb] for lb in series.engines]

    def jobs(self, quick: bool) -> list[tuple[Series, Any]]:
        """Every (series, swept value) pair of a run, in file order: ``quick_values`` when
        ``quick``, else ``values``."""
        return [(s, v) for s in self.series for v in (s.quick_values if quick else s.values)]

    def setting(self, key: str, quick: bool, default: Any = None) -> Any:
        """``settings["quick_KEY"]`` in quick mode when present, else ``KEY``, else ``default``."""
        if quick and f"quick_{key}" in self.settings:
            return self.settings[f"quick_{key}"]
        return self.settings.get(key, default)

    def repeats(self, quick: bool) -> int:
        key = "quick_repeats" if quick else "repeats"
        return int(self.settings.get(key, self.settings.get("repeats", 5)))

    def resolve_runner(self) -> Any:
        assert self.runner is not None
        return _resolve(self.runner, suite=self.name, what="runner")

    def resolve_report(self) -> Any:
        assert self.report is not None
        return _resolve(self.report, suite=self.name, what="report")

    def check(self) -> None:
        """Refuse, before any work, what would stop the run part-way: an engine name or
        option the registry refuses, a series naming an engine label the suite lacks, a
        runner or report function that does not import."""
        try:
            for spec in self.engines:
                spec.make()
            for series in self.series:
                self.engines_for(series)
        except (TypeError, ValueError) as err:
            if isinstance(err, errors.LeangradError):
                raise
            msg = str(err) if str(err).startswith("suite ") else f"suite {self.name!r}: {err}"
            raise errors.LeangradError(msg) from None
        if self.runner is not None:
            self.resolve_runner()
        if self.report is not None:
            self.resolve_report()


def _resolve(spec: str, *, suite: str, what: str) -> Any:
    """``"module:function"`` -> the function."""
    module, _, func = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as err:
        raise errors.LeangradError(BAD_HOOK.format(name=suite, what=what, spec=spec,
                                              error=err)) from err  # fmt: skip


def _files() -> dict[str, Any]:
    root = resources.files("leangrad_bench") / "suites"
    return {p.name.removesuffix(".toml"): p for p in root.iterdir() if p.name.endswith(".toml")}


def list_suites() -> dict[str, str]:
    """Suite name -> first line of its description."""
    out = {}
    for name in sorted(_files()):
        desc = load_suite(name).description.strip().splitlines()
        out[name] = desc[0] if desc else ""
    return out


def load_suite(name: str) -> Suite:
    """Parse the suite ``name``, or a suite file when ``name`` is a path ending in ``.toml``.

    Unknown names raise with the list of known ones.
    """
    files = _files()
    source = "shipped with leangrad"
    if name.endswith(".toml") and name not in files:
        if not Path(name).is_file():
            raise errors.UnknownNameError(
                NO_SUITE_FILE.format(path=name, known=", ".join(sorted(files)))
            )
        try:
            text = Path(name).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise errors.LeangradError(f"cannot read suite file {name}: {err}") from None
        source, name = name, Path(name).stem
    else:
        if name not in files:
            raise errors.UnknownNameError(
                errors.UNKNOWN_NAME.format(kind="suite", name=name, known=", ".join(sorted(files)))
            )
        text = files[name].read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise errors.LeangradError(f"suite {name!r} is not valid TOML: {err}") from err
    try:
        return _parse(name, data)
    except KeyError as err:
        problem = f"an entry lacks the key {err.args[0]!r}"
    except (TypeError, ValueError) as err:
        problem = str(err)
    raise errors.LeangradError(BAD_SUITE.format(name=name, source=source, problem=problem))


def _parse(name: str, data: dict[str, Any]) -> Suite:
    series = [
        Series(
            name=s["name"],
            config=dict(s["config"]),
            values=list(s["values"]),
            quick_values=list(s.get("quick_values", s["values"])),
            engines=s.get("engines"),
        )
        for s in data.get("series", [])
    ]
    return Suite(
        name=name,
        description=data.get("description", "").strip(),
        reference=data.get("reference", "backprop"),
        sweep=data.get("sweep", "depth"),
        engines=[EngineSpec.from_dict(e) for e in data.get("engines", [])],
        series=series,
        settings=dict(data.get("settings", {})),
        runner=data.get("runner"),
        report=data.get("report"),
    )
