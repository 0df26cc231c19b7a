"""Render every ``*.json`` suite result in a directory into one Markdown report with plots."""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from leangrad import _errors as errors
from leangrad._sizes import MiB, fmt_bytes

from ._records import at_threads, extra_threads, load_records, scan_records
from ._reproduction import reproduction_section

__all__ = ["at_threads", "by_series", "extra_threads", "fmt", "fmt_bytes", "line_figure",
           "load_records", "md_table", "mib", "pyplot", "render_report", "save_figure",
           "save_series_figure", "series_png", "sweep_section"]  # fmt: skip


def md_table(header: tuple[str, ...], rows: Iterable[Iterable[Any]]) -> list[str]:
    """A Markdown table: the ``header`` row, the rule, then one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def by_series(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each series' records, series in the order they first appear."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r["series"], []).append(r)
    return out


def series_png(suite: str, series: str, directory: Any) -> tuple[Path, list[str]]:
    """Where a series' figure goes (``directory/plots/{suite}-{series}.png``) and the
    markdown lines that show it."""
    png = Path("plots") / f"{suite}-{series}.png"
    return Path(directory) / png, [f"![{suite} {series}]({png.as_posix()})", ""]


def save_series_figure(fig: Any, suite: str, series: str, directory: Any) -> list[str]:
    """Save ``fig`` as the series' figure (:func:`series_png`); the markdown lines showing it."""
    path, shown = series_png(suite, series, directory)
    save_figure(fig, path)
    return shown


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Any) -> None:
    """Write ``fig`` to ``path`` (parents made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


MISSING = "—"
"""What a formatted cell prints for a missing (``None``) or NaN value."""


def line_figure(path: Path, rs: list[dict[str, Any]], *, x: tuple[str, str],
                ys: list[tuple[str, str]], title: str, by: str = "engine") -> bool:  # fmt: skip
    """``path``: one panel per ``(key, axis label)`` of ``ys`` against ``x`` (a key and its
    label), one line (and colour, the same in every panel) per value of ``by`` in record
    order, ``title`` wrapped above; ``False`` (nothing written) without matplotlib."""
    try:
        plt = pyplot()
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(ys), figsize=(6.4 * len(ys), 4.2), squeeze=False)
    for ax, (y, ylabel) in zip(axes[0], ys, strict=True):
        for i, label in enumerate(dict.fromkeys(r[by] for r in rs)):
            pts = [(r[x[0]], r[y]) for r in rs if r[by] == label and r.get(y) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", label=label, color=f"C{i % 10}")
        ax.set_xlabel(x[1])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 72 * len(ys)), fontsize=10)
    save_figure(fig, path)
    return True


def fmt(v: Any, spec: str) -> str:
    """``v`` in a report's format ``spec``; :data:`MISSING` for ``None`` or NaN.

    ``spec`` is a format spec (``".3f"``) or ``"gib"`` (MiB below 1 GiB, GiB above, three
    significant digits)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return MISSING
    if spec == "gib":
        return fmt_bytes(v) if v < 2**30 else f"{v / 2**30:.3g} GiB"
    return format(v, spec)


def mib(n: float | None) -> str:
    """Bytes as MiB with two decimals (:data:`MISSING` for ``None``): fixed-point columns."""
    return fmt_bytes(n, spec=".2f")


NO_RESULTS = (
    "no suite results (*.json lists of records) in {directory}{why}; "
    "run `leangrad bench SUITE --out DIR` first"
)
MISSING_FIELD = (
    "{path}: a record has no field {field!r}, which the report of suite {suite!r} needs; "
    "run `leangrad bench {suite}` again to rewrite it, or move the file away"
)

def _plot_series(suite: str, series: str, recs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    sweep = recs[0].get("sweep", "x")
    extra = extra_threads(recs)
    timed = "time / backprop"
    if extra:  # which line is which thread count, said in the panel's title
        counts = ", ".join(map(str, extra))
        timed += f" (solid: {recs[0].get('threads', 1)} thread, dashed: {counts} threads)"
    panels = [
        ("peak_bytes", "peak memory above baseline (MiB)", MiB),
        ("saved_bytes", "kept for backward (MiB)", MiB),
        ("time_ratio", timed, 1.0),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    by_engine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        by_engine[r["engine"]].append(r)
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        for engine, rs in by_engine.items():
            pts = sorted((r["x"], r[key] / scale) for r in rs if r.get(key) is not None)
            if pts:
                line = ax.plot(*zip(*pts, strict=True), marker="o", label=engine)[0]
            for n in extra if key == "time_ratio" and pts else []:
                more = sorted((r["x"], v) for r in rs
                              if (v := at_threads(r, n, key)) is not None)  # fmt: skip
                if more:
                    ax.plot(*zip(*more, strict=True), marker="x", ls="--",
                            color=line.get_color(), label=f"{engine} ({n} threads)")  # fmt: skip
        ax.set_xlabel(sweep)
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        xs = sorted({r["x"] for r in recs if isinstance(r.get("x"), int | float)})
        ax.set_xticks(xs, [f"{v:g}" for v in xs])  # the swept values, not powers of 2
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    times = FuncFormatter(lambda v, _: f"{v:g}×")  # 1.5×, not 1.5 × 10⁰
    axes[2].yaxis.set_major_formatter(times)
    low, high = axes[2].get_ylim()
    if high < 10 * low:  # within a decade only the minor ticks carry numbers; else clutter
        axes[2].yaxis.set_minor_formatter(times)
    else:
        axes[2].yaxis.set_minor_formatter(NullFormatter())
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{suite} — {series}")
    save_figure(fig, path)


def _growth(recs: list[dict[str, Any]], key: str) -> str:
    pts = sorted((r["x"], r[key]) for r in recs if r.get(key) is not None)
    if len(pts) < 2 or not pts[0][1]:
        return "—"
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    return f"×{y1 / y0:.2f} for ×{x1 / x0:g} {recs[0].get('sweep', 'x')}"


def _line(r: dict[str, Any]) -> str:
    """A training record's curve label: the engine, and the model variant if any."""
    return f"{r['engine']} / {r['model']}" if r.get("model") else str(r["engine"])


def _plot_training(suite: str, series: str, recs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    panels = [("train_loss", "train loss", False), ("train_acc", "accuracy", False)]
    if any(r.get("grad_max_rel_err") is not None for r in recs):
        panels.append(("grad_max_rel_err", "max rel. grad error vs float64 oracle", True))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    by_line: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        by_line[_line(r)].append(r)
    colors = {line: f"C{i % 10}" for i, line in enumerate(by_line)}
    for ax, (key, title, log) in zip(axes[0], panels, strict=True):
        for line, rs in by_line.items():
            keys = [key, "test_acc"] if key == "train_acc" else [key]
            for k in keys:
                pts = sorted((r["x"], r[k]) for r in rs if r.get(k) is not None)
                if log:
                    pts = [(x, max(y, 1e-17)) for x, y in pts]
                if pts:
                    style = "--" if k == "test_acc" else "-"
                    name = f"{line} (test)" if k == "test_acc" else line
                    ax.plot(
                        *zip(*pts, strict=True), style, marker=".", color=colors[line], label=name
                    )
        ax.set_xlabel(recs[0].get("sweep", "x"))
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[0][1].legend(fontsize=7)
    fig.suptitle(f"{suite} — {series}")
    save_figure(fig, path)


def _training_section(
    suite: str, series: str, recs: list[dict[str, Any]], directory: Path, *, plots: bool
) -> list[str]:
    """Markdown (and a PNG) for records of ``kind == "training"``: curves and final values."""
    sweep = recs[0].get("sweep", "x")
    lines = [f"### {series}", "", f"`{json.dumps(recs[0].get('config', {}))}`", ""]
    if plots:
        path, shown = series_png(suite, series, directory)
        _plot_training(suite, series, recs, path)
        lines += shown
    lines += [
        f"| engine | last {sweep} | train loss | train acc | test acc | max rel err "
        "| max rel err (max over run) | cosine | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_line: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        by_line[_line(r)].append(r)
    for line, rs in by_line.items():
        last = max(rs, key=lambda r: r["x"])
        measured = [r for r in rs if r.get("train_loss") is not None]
        fin = max(measured, key=lambda r: r["x"]) if measured else last
        errs = [r["grad_max_rel_err"] for r in rs if r.get("grad_max_rel_err") is not None]
        lines.append(
            f"| {line} | {fin['x']} | {fmt(fin.get('train_loss'), '.4f')} "
            f"| {fmt(fin.get('train_acc'), '.3f')} | {fmt(fin.get('test_acc'), '.3f')} "
            f"| {fmt(fin.get('grad_max_rel_err'), '.2e')} "
            f"| {fmt(max(errs) if errs else None, '.2e')} "
            f"| {fmt(fin.get('grad_cosine'), '.8f')} | {last.get('failed') or ''} |"
        )
    lines.append("")
    return lines


def sweep_section(
    suite: str, series: str, recs: list[dict[str, Any]], directory: Path, *, plots: bool
) -> list[str]:
    """Markdown (and a PNG) for one series of sweep records: the table and growth lines."""
    lines: list[str] = []
    cfg = {k: v for k, v in recs[0]["config"].items() if k != recs[0].get("sweep")}
    lines += [f"### {series}", "", f"`{json.dumps(cfg)}`", ""]
    if plots:
        path, shown = series_png(suite, series, directory)
        _plot_series(suite, series, recs, path)
        lines += shown
    extra = extra_threads(recs)
    first = recs[0].get("threads", 1)
    more = "".join(f" | time ratio ({n} thr)" for n in extra)
    lines += [
        f"| engine | {recs[0].get('sweep', 'x')} | params | peak | peak (grads prealloc.)"
        f" | saved | RSS | time ratio{f' ({first} thr)' if extra else ''}{more}"
        " | s median [min–max] | max rel err | cosine |",
        "|---|---|---|---|---|---|---|---|" + "---|" * (3 + len(extra)),
    ]
    for r in sorted(recs, key=lambda r: (r["engine"], r["x"])):
        if r.get("skipped"):
            lines.append(
                f"| {r['engine']} | {r['x']} | {r.get('num_params', '—')} "
                f"| skipped: {r['skipped']} | | | | | | | |" + " |" * len(extra)
            )
            continue
        rss = fmt_bytes(r.get("rss_peak_bytes"))
        if r.get("rss_exceeds_tracker"):
            rss += " ⚠"
        est = " (estimate)" if r.get("estimate") else ""
        secs = (
            f"{fmt(r.get('seconds_median'), '.4f')} "
            f"[{fmt(r.get('seconds_min'), '.4f')}–{fmt(r.get('seconds_max'), '.4f')}]"
        )
        lines.append(
            f"| {r['engine']} | {r['x']} | {r.get('num_params', '—')} "
            f"| {fmt_bytes(r.get('peak_bytes'))}{est} "
            f"| {fmt_bytes(r.get('peak_bytes_prealloc'))} "
            f"| {fmt_bytes(r.get('saved_bytes'))} | {rss} "
            f"| {fmt(r.get('time_ratio'), '.2f')} "
            + "".join(f"| {fmt(at_threads(r, n, 'time_ratio'), '.2f')} " for n in extra)
            + f"| {secs} "
            f"| {fmt(r.get('grad_max_rel_err'), '.2e')} "
            f"| {fmt(r.get('grad_cosine'), '.6f')} |"
        )
    lines += ["", "Growth from the smallest to the largest sweep value:", ""]
    engines = sorted({r["engine"] for r in recs})
    for eng in engines:
        rs = [r for r in recs if r["engine"] == eng and not r.get("skipped")]
        if rs:
            lines.append(
                f"- {eng}: peak {_growth(rs, 'peak_bytes')}; "
                f"time {_growth(rs, 'seconds_median')}"
            )
    lines.append("")
    return lines


def _report_hook(suite: str) -> Any:
    """The suite's own ``report = "module:function"`` renderer, if it names one."""
    from ._suites import list_suites, load_suite

    if suite not in list_suites():
        return None
    spec = load_suite(suite)
    return spec.resolve_report() if spec.report is not None else None


def _suite_section(suite: str, records: list[dict[str, Any]], directory: Path, *,
                   plots: bool) -> list[str]:  # fmt: skip
    """Markdown of one suite's records: its own renderer's, or one section per series."""
    hook = _report_hook(suite)
    if hook is not None:
        return list(hook(suite, records, directory, plots=plots))
    lines: list[str] = []
    by_series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_series[r.get("series", "")].append(r)
    for series, recs in by_series.items():
        if recs[0].get("kind") == "training":
            lines += _training_section(suite, series, recs, directory, plots=plots)
        else:
            lines += sweep_section(suite, series, recs, directory, plots=plots)
    return lines


def render_report(directory: str | Path, *, plots: bool = True) -> Path:
    """Write ``directory/report.md`` (and ``plots/*.png``) from the suite JSON files there."""
    directory = Path(directory)
    suites, skipped = scan_records(directory)
    if not suites:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise errors.LeangradError(NO_RESULTS.format(directory=directory, why=why))
    lines = ["# leangrad benchmark report", ""]
    first = next(iter(suites.values()))[0]
    m = first.get("machine", {})
    lines += [
        f"Machine: {m.get('processor', '?')}, {m.get('cpu_count', '?')} CPUs, "
        f"torch {m.get('torch', '?')}, Python {m.get('python', '?')}.",
        "",
        "Memory is measured at the allocator level (live tensor storage bytes, above the "
        "baseline of parameters, buffers and inputs). *saved* = live bytes when the forward "
        "phase ended. *peak (grads prealloc.)* = peak with `.grad` buffers allocated "
        "beforehand. Time ratios are medians of interleaved repeats in one process, "
        "divided by backprop's. Gradient errors are against autograd in float64. *RSS* is "
        "the peak resident memory of the same step in a fresh process; ⚠ marks RSS more "
        "than 1% above the tracker (memory the tracker cannot see, e.g. kernel scratch).",
        "",
    ]
    lines += reproduction_section(suites)
    for suite, records in suites.items():
        quick = " (quick)" if records and records[0].get("quick") else ""
        lines += [f"## {suite}{quick}", ""]
        try:
            lines += _suite_section(suite, records, directory, plots=plots)
        except KeyError as err:  # a record without a field its renderer reads
            raise errors.LeangradError(MISSING_FIELD.format(
                path=directory / f"{suite}.json", field=err.args[0] if err.args else "?",
                suite=suite)) from None  # fmt: skip
    path = directory / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
