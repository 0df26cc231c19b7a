"""The reproduction table: each paper's headline number beside ours.

The rows are data (``benchmarks/leangrad_bench/reproduction.toml``: paper, figure, claim,
the paper's number in its own words, the suite that regenerates it, and why the two
differ). *Ours* is never typed in: it is read from ``DIR/<suite>.json`` when the table is
rendered, by the extractor registered here under the row's id (:func:`_reads`) — a few
lines reading the suite's records and saying which configuration the number is for. A row
whose suite has no results renders ``not run (leangrad bench SUITE)``; an extractor returns
``None`` when the records lack what it reads (e.g. a quick run without that model).

Papers: Moonwalk v1 (Krylov, Karamzade, Fox, arXiv:2402.14212), Moonwalk v2 (AISTATS 2026),
randomized AD (Oktay et al., ICLR 2021), nested forward-mode AD of activations, Highway
backpropagation.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import tomllib
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from statistics import mean
from typing import Any

from leangrad import _errors as errors
from leangrad._sizes import fmt_bytes

from ._records import at_threads, extra_threads, load_records

__all__ = ["Row", "extractor", "load_rows", "ours", "reproduction_markdown",
           "reproduction_section", "reproduction_table"]  # fmt: skip

Record = dict[str, Any]
Extractor = Callable[[list[Record]], str | None]

ROW_FIELDS = ("id", "paper", "figure", "claim", "paper_number", "suite", "why")
BAD_ROW = (
    "reproduction.toml, row {index} ({id}): {problem}; every row has exactly the fields "
    + ", ".join(ROW_FIELDS)
    + " (strings, no '|')"
)
NO_EXTRACTOR = (
    "reproduction row {id!r} has no extractor; register one in "
    "benchmarks/leangrad_bench/_reproduction.py with @_reads({id!r}), or remove the row"
)
NOT_RUN = "not run (leangrad bench {suite})"
NOT_IN_RECORDS = "— (not in this run's records)"
TABLE_HEAD = [
    "| paper | figure | claim | paper's number | ours | suite | why they differ |",
    "|---|---|---|---|---|---|---|",
]


@dataclasses.dataclass(frozen=True)
class Row:
    """One headline figure or table: what the paper says and where ours comes from."""

    id: str
    paper: str
    figure: str
    claim: str
    paper_number: str
    suite: str
    why: str


def load_rows(path: str | Path | None = None) -> list[Row]:
    """The rows of ``reproduction.toml`` (shipped beside this module unless ``path``).

    Raises:
        LeangradError: a row lacks a field, has an unknown one, a non-string value or a
            ``|`` (which would break the Markdown table), or repeats an id.
    """
    if path is None:
        text = (resources.files("leangrad_bench") / "reproduction.toml").read_text()
    else:
        text = Path(path).read_text()
    rows: list[Row] = []
    for index, entry in enumerate(tomllib.loads(text).get("rows", []), start=1):
        problem = _row_problem(entry, seen={r.id for r in rows})
        if problem:
            raise errors.LeangradError(
                BAD_ROW.format(index=index, id=entry.get("id", "no id"), problem=problem)
            )
        rows.append(Row(**{f: entry[f] for f in ROW_FIELDS}))
    return rows


def _row_problem(entry: dict[str, Any], *, seen: set[str]) -> str:
    missing = [f for f in ROW_FIELDS if f not in entry]
    extra = sorted(set(entry) - set(ROW_FIELDS))
    if missing or extra:
        return f"missing {missing}, unknown {extra}"
    bad = [f for f in ROW_FIELDS if not isinstance(entry[f], str) or "|" in entry[f]]
    if bad:
        return f"{bad} must be strings without '|'"
    return f"the id {entry['id']!r} is used twice" if entry["id"] in seen else ""


_EXTRACTORS: dict[str, Extractor] = {}


def _reads(row_id: str) -> Callable[[Extractor], Extractor]:
    """Register the function that reads row ``row_id``'s *ours* from its suite's records."""

    def register(fn: Extractor) -> Extractor:
        _EXTRACTORS[row_id] = fn
        return fn

    return register


def extractor(row_id: str) -> Extractor:
    """The extractor registered for ``row_id``.

    Raises:
        LeangradError: none is registered.
    """
    if row_id not in _EXTRACTORS:
        raise errors.LeangradError(NO_EXTRACTOR.format(id=row_id))
    return _EXTRACTORS[row_id]


def ours(row: Row, suites: Mapping[str, list[Record]]) -> str:
    """*Ours* for ``row``, read from its suite's records in ``suites`` (suite -> records)."""
    records = suites.get(row.suite)
    if not records:
        return NOT_RUN.format(suite=row.suite)
    value = extractor(row.id)(records)
    return NOT_IN_RECORDS if value is None else value


def reproduction_table(suites: Mapping[str, list[Record]], *,
                       rows: list[Row] | None = None) -> str:  # fmt: skip
    """The Markdown table, one line per row, *ours* read from ``suites`` now."""
    lines = list(TABLE_HEAD)
    for row in load_rows() if rows is None else rows:
        records = suites.get(row.suite) or []
        quick = " (quick)" if records and all(r.get("quick") for r in records) else ""
        cells = [row.paper, row.figure, row.claim, row.paper_number, ours(row, suites),
                 f"`{row.suite}`{quick}", row.why]  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def reproduction_markdown(directory: str | Path) -> str:
    """:func:`reproduction_table` of the suite results in ``directory`` (``leangrad report
    DIR --reproduction``; the table of ``docs/reproduction.md`` is this of ``results/``)."""
    return reproduction_table(load_records(Path(directory)))


def reproduction_section(suites: Mapping[str, list[Record]]) -> list[str]:
    """``## Reproduction`` for the top of ``report.md``; nothing when no row's suite ran
    (a directory of unrelated suites)."""
    rows = load_rows()
    if not any(suites.get(r.suite) for r in rows):
        return []
    return [
        "## Reproduction",
        "",
        "Each paper's headline number beside ours. *Ours* is read from `SUITE.json` in this "
        "directory when the report is rendered "
        "(rows: `benchmarks/leangrad_bench/reproduction.toml`); "
        "our runs are CPU, float32, at the sizes each cell states (quick runs are small), "
        "and *why they differ* is our reading of the two.",
        "",
        reproduction_table(suites, rows=rows),
        "",
    ]


# ------------------------------------------------------------------------------ helpers


def _match(records: list[Record], **want: Any) -> list[Record]:
    return [r for r in records if all(r.get(k) == v for k, v in want.items())]


def _deepest(records: list[Record], **want: Any) -> Record | None:
    """The matching, measured record at the largest numeric ``x``."""
    rs = [r for r in _match(records, **want)
          if not r.get("skipped") and isinstance(r.get("x"), int | float)]  # fmt: skip
    return max(rs, key=lambda r: r["x"]) if rs else None


def _last(records: list[Record], key: str, **want: Any) -> Record | None:
    """The matching record with ``key`` measured at the largest numeric ``x``."""
    rs = [r for r in _match(records, **want)
          if r.get(key) is not None and isinstance(r.get("x"), int | float)]  # fmt: skip
    return max(rs, key=lambda r: r["x"]) if rs else None


def _numeric_x(records: list[Record]) -> list[Record]:
    return [r for r in records if isinstance(r.get("x"), int | float)]


def _also_at(records: list[Record], record: Record, key: str) -> str:
    """``; 1.75× at 2 threads`` for the first further thread count the run timed, if any."""
    more = extra_threads(records)
    value = at_threads(record, more[0], key) if more else None
    return f"; {_x(value)} at {more[0]} threads" if value is not None else ""


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def _x(v: float | None, spec: str = ".2f") -> str:
    """``1.59×``; ``—`` when not measured."""
    return "—" if v is None else f"{v:{spec}}×"


def _num(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) else "—"


class _Unknown(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "?"


def _config(record: Record | None, text: str) -> str:
    """``text`` with ``{key}`` filled from the record's ``config`` (``?`` where absent)."""
    return text.format_map(_Unknown((record or {}).get("config") or {}))


# --------------------------------------------------------------------------- Moonwalk v1


def _peaks_at_deepest(records: list[Record], series: str) -> tuple[Any, dict[str, Any]]:
    """The backprop record's depth and every engine's peak at that depth."""
    bp = _deepest(records, series=series, engine="backprop")
    if bp is None:
        return None, {}
    at = [r for r in _match(records, series=series, x=bp["x"]) if not r.get("skipped")]
    return bp["x"], {r["engine"]: r.get("peak_bytes") for r in at}


@_reads("moonwalk-v1-fig1-memory")
def _moonwalk_v1_fig1(records: list[Record]) -> str | None:
    depth, peaks = _peaks_at_deepest(records, "revnet")
    if depth is None:
        return None
    names = [("moonwalk", "Mixed"), ("moonwalk(mode=pure)", "pure Moonwalk"),
             ("revbackprop", "RevBackprop"), ("projforward", "ProjForward")]  # fmt: skip
    parts = [f"{label} {_x(_ratio(peaks['backprop'], peaks.get(engine)))}"
             for engine, label in names if engine in peaks]  # fmt: skip
    bp = _deepest(records, series="revnet", engine="backprop")
    where = _config(bp, "{size}×{size} {data}, {channels} ch., batch {batch}")
    return f"{', '.join(parts)} ({depth} layers/block, {where}; tracker peak)"


@_reads("moonwalk-v1-fig2-growth")
def _moonwalk_v1_fig2(records: list[Record]) -> str | None:
    names = [
        ("backprop", "backprop"),
        ("moonwalk", "Mixed"),
        ("revbackprop", "RevBackprop"),
        ("forward(chunk_size=32)", "Forward"),
        ("moonwalk(mode=pure)", "pure Moonwalk"),
    ]
    parts, span = [], ""
    for engine, label in names:
        measured = _numeric_x(_match(records, series="revnet", engine=engine))
        rs = sorted((r for r in measured if not r.get("skipped") and r.get("peak_bytes")),
                    key=lambda r: r["x"])  # fmt: skip
        if len(rs) >= 2:
            parts.append(f"{label} {_x(_ratio(rs[-1]['peak_bytes'], rs[0]['peak_bytes']))}")
            span = f"{rs[0]['x']} → {rs[-1]['x']} layers/block"
    return f"peak growth: {', '.join(parts)} ({span})" if parts else None


@_reads("moonwalk-v1-fig3-forward")
def _moonwalk_v1_fig3_depth(records: list[Record]) -> str | None:
    rs = sorted(_match(records, kind="moonwalk-depth", threads=1), key=lambda r: r["x"])
    if not rs:
        return None
    first, last = rs[0], rs[-1]
    worst = min(r["speedup_over_bound"] for r in rs)
    grows = all(a["speedup"] < b["speedup"] for a, b in itertools.pairwise(rs))
    return (f"{_x(first['speedup'], '.1f')} at {first['x']} → {_x(last['speedup'], '.1f')} at "
            f"{last['x']} couplings ({'growing' if grows else 'not growing'} with depth); "
            f"bound P/(2d) {_x(first['bound'], '.1f')} → {_x(last['bound'], '.1f')}, measured "
            f"≥ {worst:.2f}× the bound (1 thread, batch {first['config'].get('batch', '?')}, "
            f"{first['config'].get('channels', '?')} ch. {first['config'].get('size', '?')}²; "
            "Forward extrapolated from a measured share of its directions beyond "
            f"{first['x']} couplings)")  # fmt: skip


@_reads("highway-table2-gpt2")
def _highway_gpt2(records: list[Record]) -> str | None:
    curves = _match(records, kind="highway-transformer")
    parts = []
    for series in dict.fromkeys(r["series"] for r in curves):
        bp = _last(_match(curves, series=series), "val_loss", engine="backprop")
        if bp is None:
            continue
        cfg, k = bp["config"], bp["config"].get("paper_k")
        hw = _last(_match(curves, series=series), "val_loss", engine=f"highway(k={k})")
        if hw is None:
            continue
        step = _match(records, kind="highway-transformer-step", series=series,
                      engine=f"highway(k={k})", threads=1)  # fmt: skip
        time = f", step {_x(step[0].get('time_ratio'))} backprop's (1 thread)" if step else ""
        parts.append(
            f"{cfg.get('norm', '?')}-LN, {cfg.get('layers', '?')} layers = "
            f"{cfg.get('blocks', '?')} sublayers: highway k={k} {hw['val_loss']:.3f} vs backprop "
            f"{bp['val_loss']:.3f} ({hw['val_loss'] / bp['val_loss'] - 1:+.1%}) at step "
            f"{bp['x']}, gradient cosine {_num(hw.get('grad_cosine'), '.4f')}{time}"
        )
    if not parts:
        return None
    return "final validation loss (characters, d 64): " + "; ".join(parts)


@_reads("moonwalk-v1-fig3-revnet")
def _moonwalk_v1_fig3_revnet(records: list[Record]) -> str | None:
    pts = []
    forward = _numeric_x(_match(records, series="revnet", engine="forward(chunk_size=32)"))
    for fwd in sorted(forward, key=lambda r: r["x"]):
        pure = _match(records, series="revnet", engine="moonwalk(mode=pure)", x=fwd["x"])
        ratio = _ratio(fwd.get("seconds_median"), pure[0].get("seconds_median")) if pure else None
        if ratio is not None and not fwd.get("skipped"):
            pts.append((fwd["x"], ratio))
    if not pts:
        return None
    (x0, r0), (x1, r1) = pts[0], pts[-1]
    return f"{_x(r0, '.1f')} at {x0} → {_x(r1, '.1f')} at {x1} layers/block (1 thread)"


@_reads("moonwalk-v1-fig3-mixed")
def _moonwalk_v1_fig3_mixed(records: list[Record]) -> str | None:
    mixed = _deepest(records, series="revnet", engine="moonwalk")
    rev = _deepest(records, series="revnet", engine="revbackprop")
    if mixed is None:
        return None
    also = _also_at(records, mixed, "time_ratio")
    rb = f", RevBackprop {_x(rev.get('time_ratio'))}" if rev else ""
    return (f"{_x(mixed.get('time_ratio'))} backprop's (1 thread{also}){rb}, "
            f"at {mixed['x']} layers/block")  # fmt: skip


_FAILED = re.compile(r"step (\d+): (\w+)")  # "step 230: LayerConditionError: …"


def _tanh_series(records: list[Record]) -> str | None:
    """The series of the Fig. 4/5 run with tanh on each coupling's output (``None``: absent)."""
    return next(
        (r.get("series") for r in records if (r.get("config") or {}).get("output_tanh")), None
    )


def _per_engine(records: list[Record], order: tuple[tuple[str, str], ...],
                part: Callable[[list[Record], str], str | None]) -> list[str] | None:
    """``part(its records, label)`` for each engine of the Fig. 4/5 tanh run, in
    ``order`` (those with nothing to say left out); ``None`` where that run is absent."""
    series = _tanh_series(records)
    if series is None:
        return None
    found = (part(_match(records, series=series, engine=e), label) for e, label in order)
    return [p for p in found if p is not None]


def _fig4_part(rows: list[Record], label: str) -> str | None:
    """How one engine's Fig. 4 training run ended: its step and error, or its accuracy."""
    failed = next((r["failed"] for r in rows if r.get("failed")), None)
    if failed:
        m = _FAILED.match(str(failed))
        return f"{label} stopped at step {m.group(1)} ({m.group(2)})" if m else f"{label} failed"
    fin = _last(rows, "train_acc")
    return None if fin is None else (f"{label} train acc {_num(fin['train_acc'], '.3f')} "
                                     f"at step {fin['x']}")  # fmt: skip


@_reads("moonwalk-v1-fig4-training")
def _moonwalk_v1_fig4(records: list[Record]) -> str | None:
    parts = _per_engine(records, (("backprop", "Backprop"), ("moonwalk", "Mixed"),
                                  ("revbackprop", "RevBackprop")), _fig4_part)  # fmt: skip
    return "tanh on each coupling's output: " + "; ".join(parts) if parts else None


def _fig5_part(rows: list[Record], label: str) -> str | None:
    """One engine's largest gradient error over the Fig. 5 run."""
    errs = [r["grad_max_rel_err"] for r in rows if r.get("grad_max_rel_err") is not None]
    return f"{label} {max(errs):.1e}" if errs else None


@_reads("moonwalk-v1-fig5-error")
def _moonwalk_v1_fig5(records: list[Record]) -> str | None:
    parts = _per_engine(records, (("revbackprop", "RevBackprop"), ("moonwalk", "Mixed"),
                                  ("backprop", "Backprop")), _fig5_part)  # fmt: skip
    return f"max rel. error over the run: {', '.join(parts)}" if parts else None


# --------------------------------------------------------------------------- Moonwalk v2


def _saving(records: list[Record], series: str, engine: str) -> str | None:
    """``A → B (−p%) at depth d``: backprop's peak and ``engine``'s at backprop's deepest."""
    depth, peaks = _peaks_at_deepest(records, series)
    if depth is None or not peaks.get(engine) or not peaks.get("backprop"):
        return None
    less = 1 - peaks[engine] / peaks["backprop"]
    return (f"{fmt_bytes(peaks['backprop'])} → {fmt_bytes(peaks[engine])} "
            f"(−{less:.0%}) at {depth} layers")  # fmt: skip


@_reads("moonwalk-v2-fig2a-memory")
def _moonwalk_v2_fig2a(records: list[Record]) -> str | None:
    parts = [f"{s}: {v}" for s, v in (("repeat stem", _saving(records, "repeat-stem", "moonwalk")),
                                      ("conv stem", _saving(records, "conv-stem", "moonwalk")))
             if v is not None]  # fmt: skip
    bp = _deepest(records, series="repeat-stem", engine="backprop")
    where = _config(bp, "{size}×{size}, {channels} ch., batch {batch}")
    return f"{'; '.join(parts)} ({where})" if parts else None


@_reads("moonwalk-v2-fig2b-time")
def _moonwalk_v2_fig2b(records: list[Record]) -> str | None:
    mw = _deepest(records, series="repeat-stem", engine="moonwalk")
    if mw is None:
        return None
    also = _also_at(records, mw, "time_ratio")
    return f"{_x(mw.get('time_ratio'))} backprop's (1 thread{also}), at {mw['x']} layers"


@_reads("moonwalk-v2-fig3a-fragmental")
def _moonwalk_v2_fig3a(records: list[Record]) -> str | None:
    b4 = _saving(records, "length1024", "moonwalk(fragment=4)")
    if b4 is None:
        return None
    _, peaks = _peaks_at_deepest(records, "length1024")
    b16 = _ratio(peaks.get("moonwalk(fragment=16)"), peaks["backprop"])
    more = f"; B=16: −{1 - b16:.0%}" if b16 is not None else ""
    bp = _deepest(records, series="length1024", engine="backprop")
    where = _config(bp, "{channels} ch., length {length}, batch {batch}")
    return f"B=4: {b4}{more} ({where})"


@_reads("moonwalk-v2-fig3b-blocks")
def _moonwalk_v2_fig3b(records: list[Record]) -> str | None:
    bp = _deepest(records, series="length1024", engine="backprop")
    if bp is None:
        return None
    parts = []
    for b in ("4", "8", "16", "full"):
        r = _match(records, series="length1024", engine=f"moonwalk(fragment={b})", x=bp["x"])
        if r and r[0].get("time_ratio") is not None:
            parts.append(f"B={b} {_x(r[0]['time_ratio'])}")
    return f"{', '.join(parts)} backprop's time at {bp['x']} layers (1 thread)" if parts else None


@_reads("moonwalk-v2-depth-budget")
def _moonwalk_v2_budget(records: list[Record]) -> str | None:
    depth = {r["engine"]: r.get("max_depth") for r in records if r.get("max_depth") is not None}
    if "backprop" not in depth:
        return None
    names = [
        ("backprop", "backprop"),
        ("checkpoint(segments=sqrt)", "checkpoint"),
        ("moonwalk(fragment=16)", "Moonwalk B=16"),
        ("moonwalk(fragment=4)", "B=4"),
    ]
    parts = [f"{label} {depth[e]}" for e, label in names if e in depth]
    first = next((r for r in records if r.get("budget_bytes")), None)
    where = _config(first, "length {length}, {channels} ch., batch {batch}")
    budget = fmt_bytes(first["budget_bytes"]) if first else "?"
    return f"{', '.join(parts)} layers within {budget} of live tensors ({where})"


@_reads("moonwalk-v2-fig4-constrained")
def _moonwalk_v2_fig4(records: list[Record]) -> str | None:
    parts = []
    for label in ("constrained", "unconstrained"):
        fin = _last(records, "test_acc", engine=f"{label} (backprop)")
        if fin is not None:
            parts.append(f"{label} {_num(fin['test_acc'], '.1%')}")
    last = max((r for r in records if isinstance(r.get("x"), int)), key=lambda r: r["x"],
               default=None)  # fmt: skip
    where = _config(last, "{dataset}, {depth} layers")
    epoch = last["x"] if last else "?"
    return f"test acc {', '.join(parts)} after {epoch} epochs ({where})" if parts else None


# ---------------------------------------------------------------------------- RAD


def _estimator(records: list[Record], model: str, engine: str) -> Record | None:
    return next(iter(_match(records, model=model, engine=engine)), None)


@_reads("rad-memory-8x")
def _rad_memory(records: list[Record]) -> str | None:
    full = _estimator(records, "mlp", "batch 150")
    rad = _estimator(records, "mlp", "RAD 0.1 different")
    if full is None or rad is None:
        return None
    saved = _x(_ratio(full.get("saved_bytes"), rad.get("saved_bytes")), ".1f")
    peak = _x(_ratio(full.get("peak_bytes"), rad.get("peak_bytes")))
    return (f"saved {saved} ({fmt_bytes(full.get('saved_bytes'))} → "
            f"{fmt_bytes(rad.get('saved_bytes'))}, measured); peak {peak}")  # fmt: skip


@_reads("rad-fig5-variance")
def _rad_fig5(records: list[Record]) -> str | None:
    parts = []
    for model in ("cnn", "mlp"):
        full = _estimator(records, model, "batch 150")
        rad = _estimator(records, model, "RAD 0.1 different")
        smaller = [r for r in _match(records, model=model, fraction=None)
                   if r.get("batch") != 150 and r.get("saved_bytes")]  # fmt: skip
        if full is None or rad is None or not smaller or not rad.get("saved_bytes"):
            continue
        near = min(smaller, key=lambda r: abs(r["saved_bytes"] - rad["saved_bytes"]))

        def point(r: Record, full: Record = full) -> str:
            mse = _ratio(r.get("grad_mse"), full.get("grad_mse"))
            mem = _ratio(r.get("saved_bytes"), full.get("saved_bytes"))
            return f"MSE {_x(mse, '.1f')} at {_num(mem, '.2f')}× memory"

        parts.append(f"{model}: RAD 0.1 {point(rad)} vs batch {near['batch']} {point(near)}")
    return "; ".join(parts) + " (× batch 150)" if parts else None


def _rad_training(records: list[Record], model: str) -> str | None:
    """RAD 0.1 (different) against the reduced batch at the last step: the median over
    seeds with its band where the run kept ``rad-band`` records, else the one run."""
    bands = _match(records, kind="rad-band")
    key, rs = ("train_loss_median", bands) if bands else ("train_loss", records)

    def cell(r: Record) -> str:
        if not bands:
            return _num(r[key], ".3g")
        return f"{r[key]:.3g} [{r['train_loss_min']:.3g}–{r['train_loss_max']:.3g}]"

    rad = _last(rs, key, model=model, engine="RAD 0.1 different")
    base = _last(rs, key, model=model, engine="baseline")
    reduced = next((r for r in rs if r.get("model") == model
                    and str(r.get("engine", "")).startswith("reduced batch")), None)  # fmt: skip
    red = _last(rs, key, model=model, engine=reduced["engine"]) if reduced else None
    if rad is None or red is None:
        return None
    bl = f"; batch 150: {cell(base)}" if base else ""
    over = f", median [min–max] of {len(rad['seeds'])} seeds" if bands else ""
    return (f"train loss at step {rad['x']}{over}: RAD 0.1 {cell(rad)} vs "
            f"{red['engine']} {cell(red)}{bl}")  # fmt: skip


_FIG6_MODELS = {"mlp": "mlp", "cnn": "cnn", "rnn": "irnn"}
"""Fig. 6's rows ``rad-fig6-<key>``, read alike: the model each is of."""
_EXTRACTORS.update({f"rad-fig6-{row}": functools.partial(_rad_training, model=model)
                    for row, model in _FIG6_MODELS.items()})  # fmt: skip


@_reads("rad-fig10-fractions")
def _rad_fig10(records: list[Record]) -> str | None:
    bands = _match(records, kind="rad-band")
    parts = []
    for model in dict.fromkeys(r["model"] for r in bands):
        ours = _match(bands, model=model)
        end = max(r["x"] for r in ours)
        at = {r["fraction"]: r for r in ours if r["x"] == end}
        if None not in at:
            continue
        fracs = sorted(f for f in at if f is not None)
        losses = "/".join(f"{at[f]['train_loss_median']:.2g}" for f in fracs)
        parts.append(f"{model} step {end}: {losses} (baseline "
                     f"{at[None]['train_loss_median']:.2g})")  # fmt: skip
    ones = _match(records, kind="rad-fraction-one")
    if not parts:
        return None
    equal = sum(all(s["grads_equal"] and s["curves_identical"] for s in r["per_seed"])
                for r in ones)  # fmt: skip
    seeds = len(bands[0].get("seeds", [])) if bands else 0
    return (f"final train loss, median of {seeds} seeds, at fractions "
            f"{'/'.join(f'{f:g}' for f in fracs)}: {'; '.join(parts)}; fraction 1.0 without "
            f"replacement equals the baseline (gradients torch.equal, curves identical on "
            f"every seed) for {equal} of {len(ones)} models")  # fmt: skip


@_reads("rad-fig7-pde")
def _rad_fig7(records: list[Record]) -> str | None:
    bands = _match(records, kind="rad-pde-band")
    rs = bands or records  # results written before the replicates: one run per lane
    key = "train_loss_median" if bands else "train_loss"
    exact = _last(rs, key, engine="exact")
    rads = [r for r in rs if r.get("engine") != "exact" and r.get("fraction") is not None]
    if exact is None or not rads:
        return None
    least = min(r["fraction"] for r in rads)
    rad = _last(rs, key, fraction=least)
    if rad is None:
        return None
    less = 1 - rad["saved_bytes"] / exact["saved_bytes"] if exact.get("saved_bytes") else None
    spread = (f" [{_x(_ratio(rad['train_loss_min'], exact[key]))}–"
              f"{_x(_ratio(rad['train_loss_max'], exact[key]))}], median of "
              f"{len(rad['seeds'])} replicates" if bands else "")  # fmt: skip
    return (f"fraction {least:g}: saved −{_num(less, '.1%')} "
            f"({fmt_bytes(exact.get('saved_bytes'))} → {fmt_bytes(rad.get('saved_bytes'))}); "
            f"loss {_x(_ratio(rad[key], exact[key]))}{spread} exact's "
            f"at iteration {rad['x']}")  # fmt: skip


# ---------------------------------------------------------------- nested forward AD (fad)

_FAD = "fad.nest(paper)"  # every activation chain nested: the paper's method


@_reads("fad-fig7-batch")
def _fad_fig7(records: list[Record]) -> str | None:
    parts = []
    for engine, label in ((_FAD, "FAD (fx pass)"), ("fad.nested", "FAD (eager FSM)")):
        ratios = {r.get("series"): r["max_batch_ratio"] for r in _match(records, engine=engine)
                  if r.get("max_batch_ratio") is not None}  # fmt: skip
        if ratios:
            top = max(ratios, key=lambda s: ratios[s])
            parts.append(f"{label} up to {_x(ratios[top])} ({top}), mean "
                         f"{_x(mean(ratios.values()))} over {len(ratios)}")  # fmt: skip
    return "; ".join(parts) if parts else None


@_reads("fad-fig8-speed")
def _fad_fig8(records: list[Record]) -> str | None:
    parts = []
    for family, label in (("bert", "BERT"), ("resnet", "ResNet")):
        over_fad, over_eager = [], []
        for rec in _match(records, engine="recompute"):
            if not str(rec.get("series", "")).startswith(f"{family}-"):
                continue
            fad = _match(records, engine=_FAD, series=rec["series"])
            if v := _ratio(rec.get("time_ratio"), fad[0].get("time_ratio") if fad else None):
                over_fad.append(v)
            if isinstance(rec.get("time_ratio"), int | float):
                over_eager.append(rec["time_ratio"])
        if over_fad:
            parts.append(f"{label} {_x(mean(over_fad))} FAD's, {_x(mean(over_eager))} eager's")
    return "recompute's step time: " + "; ".join(parts) + " (1 thread)" if parts else None


@_reads("fad-table4-activation")
def _fad_table4(records: list[Record]) -> str | None:
    ratios = {r["series"]: r["act_time_ratio_to_fad"]["recompute"]
              for r in _match(records, kind="fad-activation")
              if (r.get("act_time_ratio_to_fad") or {}).get("recompute") is not None}  # fmt: skip
    if not ratios:
        return None
    gelu = f"BERT GELU {_x(ratios['bert-gelu'])}; " if "bert-gelu" in ratios else ""
    return f"{gelu}{_x(min(ratios.values()))}–{_x(max(ratios.values()))} over {len(ratios)}"


# ---------------------------------------------------------------------------- Highway-BP


def _speedups(records: list[Record], cell: str, length: int) -> str | None:
    by_k = {r.get("k"): r for r in _match(records, series=cell, x=length)
            if str(r.get("engine", "")).startswith("highway(")}  # fmt: skip
    if not all(k in by_k for k in (0, 5, 10)):
        return None
    one = " / ".join(_x(by_k[k].get("step_speedup")) for k in (0, 5, 10))
    counts = extra_threads(records)
    other = [at_threads(by_k[k], counts[0], "step_speedup") for k in (0, 5, 10)] if counts else []
    more = (f"; {counts[0]} threads: {' / '.join(_x(v) for v in other)}"
            if other and None not in other else "")  # fmt: skip
    return f"{one} (1 thread){more}"


# Table 3's three cells, read alike (as @_reads would register them)
_EXTRACTORS.update({f"highway-table3-{cell}{n}": functools.partial(_speedups, cell=cell, length=n)
                    for cell, n in (("lstm", 256), ("gru", 256), ("gru", 1024))})  # fmt: skip


@_reads("highway-fig2-resnet")
def _highway_fig2(records: list[Record]) -> str | None:
    names = [("backprop", "backprop"), ("highway(k=0)", "k=0"), ("highway(k=2)", "k=2"),
             ("highway(k=5)", "k=5"), ("highway(k=0->5)", "k 0→5")]  # fmt: skip
    last = {e: _last(records, "test_acc", series="preact-resnet", engine=e) for e, _ in names}
    parts = [f"{label} {_num(r['test_acc'], '.3f')}" for e, label in names
             if (r := last[e]) is not None]  # fmt: skip
    step = last["backprop"]["x"] if last["backprop"] else None
    return f"pre-act ResNet test acc at step {step}: {', '.join(parts)}" if parts else None


@_reads("highway-fig4-fpi")
def _highway_fig4(records: list[Record]) -> str | None:
    parts = []
    for series, key in (("char-gru", "val_loss"), ("preact-resnet", "test_acc")):
        hw = _last(records, key, series=series, engine="highway(k=2)")
        fpi = _last(records, key, series=series, engine="fpi(k=2)")
        if hw and fpi:
            what = "held-out loss" if key == "val_loss" else "test acc"
            parts.append(f"{series} {what}: highway {_num(hw[key], '.3f')}, "
                         f"FPI {_num(fpi[key], '.3f')}")  # fmt: skip
    return "; ".join(parts) + " (k=2, last step)" if parts else None


@_reads("highway-fig5-runtime")
def _highway_fig5(records: list[Record]) -> str | None:
    parts = []
    for engine, label in (("backprop", "backprop"), ("highway(k=0)", "k=0"),
                          ("highway(k=2)", "k=2"), ("highway(k=5)", "k=5")):  # fmt: skip
        r = _last(records, "val_loss", series="char-gru", engine=engine)
        if r is not None and r.get("wall_seconds") is not None:
            parts.append(
                f"{label} {_num(r['wall_seconds'], '.1f')} s → {_num(r['val_loss'], '.3f')}"
            )
    return "char-GRU training time → held-out loss: " + ", ".join(parts) if parts else None


@_reads("highway-fig6-convergence")
def _highway_fig6(records: list[Record]) -> str | None:
    parts = []
    for series in sorted({str(r.get("series")) for r in _match(records, engine="highway")}):
        rs = _match(records, engine="highway", series=series)
        fractions = sorted({r["fraction"] for r in rs if r.get("fraction") is not None})
        if len(fractions) < 2:
            continue
        need = []
        for f in (fractions[0], fractions[-1]):
            ok = sorted(r["k"] for r in rs if r.get("fraction") == f and isinstance(r.get("k"), int)
                        and (r.get("grad_cosine") or 0) >= 0.999)  # fmt: skip
            need.append(str(ok[0]) if ok else "—")
        parts.append(f"{series} k={need[0]} → k={need[1]}")
    return "; ".join(parts) if parts else None
