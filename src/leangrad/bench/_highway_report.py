"""The Markdown section of ``leangrad report`` for the Highway-BP suites (issue 7):
target lines, speed/memory tables, scan timings, training curves and convergence in k,
from the records of :mod:`leangrad.bench._highway`'s runners."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from .._sizes import fmt_bytes
from ._report import at_threads, by_series, extra_threads, pyplot, save_figure

__all__ = ["render"]


def _f(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


_mib = functools.partial(fmt_bytes, spec=".2f")
"""Sizes in this report's tables: MiB with two decimals."""


def _targets(rs: list[dict[str, Any]]) -> list[str]:
    """The issue's targets beside the measured values (GRU, hidden 128, batch 32)."""
    def get(length: int, label: str) -> dict[str, Any] | None:
        return next((r for r in rs if r["config"].get("cell") == "gru"
                     and r["x"] == length and r["engine"] == label), None)  # fmt: skip

    lines = ["Targets of issue 7 (GRU, hidden 128, batch 32, one thread):", ""]
    for label, key, want in (("highway(k=0)", "backward_speedup", 2.4),
                             ("highway(k=2)", "backward_speedup", 1.15),
                             ("highway(k=2)", "grad_cosine", 0.999)):  # fmt: skip
        r = get(256, label)
        if r is not None and r.get(key) is not None:
            ok = "met" if r[key] >= want else "NOT met"
            lines.append(f"- L=256 {label} {key} {r[key]:.4g} (target ≥ {want}): {ok}")
    for label in ("highway(k=0)", "highway(k=2)", "highway(k=5)", "highway(k=10)"):
        a, b = get(256, label), get(1024, label)
        if a and b and a.get("backward_speedup") and b.get("backward_speedup"):
            more = "larger" if b["backward_speedup"] > a["backward_speedup"] else "NOT larger"
            lines.append(f"- {label} backward speedup L=1024 {b['backward_speedup']:.2f}x vs "
                         f"L=256 {a['backward_speedup']:.2f}x: {more}")  # fmt: skip
    lines += _step_targets(rs, get)
    return [*lines, ""]


def _step_targets(rs: list[dict[str, Any]], get: Any) -> list[str]:
    """Issue 16's step targets against nn.GRU / nn.LSTM (same weights, same run), at every
    thread count timed."""
    lines = []
    for n in [rs[0].get("threads", 1), *extra_threads(rs)]:
        for cell, label, want in (("gru", "highway(k=0)", 2.0), ("gru", "highway(k=2)", 1.4),
                                  ("lstm", "highway(k=0)", 1.0)):  # fmt: skip
            mine = next((r for r in rs if r["config"].get("cell") == cell and r["x"] == 256
                         and r["engine"] == label), None)  # fmt: skip
            peer = next((r for r in rs if r["config"].get("cell") == cell and r["x"] == 256
                         and r["engine"] == f"nn.{cell.upper()}"), None)  # fmt: skip
            if mine is None or peer is None:
                continue
            a = at_threads(mine, n, "seconds_median") or mine["seconds_median"]
            b = at_threads(peer, n, "seconds_median") or peer["seconds_median"]
            ok = "met" if b / a >= want else "NOT met"
            lines.append(f"- L=256 {label} at {n} thread{'s' if n > 1 else ''}: "
                         f"nn.{cell.upper()}'s step time / its own {b / a:.2f} "
                         f"(target ≥ {want}): {ok}")  # fmt: skip
    return lines


def _render_rnn(rs: list[dict[str, Any]]) -> list[str]:
    extra = extra_threads(rs)
    lines = [
        f"One training step (forward + gradients), float32, {rs[0].get('threads', 1)} "
        "thread(s)" + "".join(f"; step speedup also at {n} threads" for n in extra)
        + " (side by side in one run). *backward* = step − "
        "forward of the same method (BPTT and nn.* record a graph; highway runs its traced "
        "no-grad forward). Speedups are BPTT's time over the method's, measured "
        "interleaved in one process. Peak = allocator-level tracker peak over the step. "
        "Gradients vs autograd in float64.",
        "",
        *_targets(rs),
        "| series | L | method | step ms | step speedup"
        + "".join(f" | step speedup ({n} thr)" for n in extra)
        + " | backward ms | backward speedup | peak | cosine | max rel err |",
        "|---|---|---|---|---|" + "---|" * (5 + len(extra)),
    ]
    for r in rs:
        lines.append(
            f"| {r['series']} | {r['x']} | {r['engine']} | {r['seconds_median'] * 1e3:.1f} "
            f"| {_f(r.get('step_speedup'), '.2f')}x "
            + "".join(f"| {_f(at_threads(r, n, 'step_speedup'), '.2f')}x " for n in extra)
            + f"| {r['backward_seconds'] * 1e3:.1f} "
            f"| {_f(r.get('backward_speedup'), '.2f')}x | {_mib(r.get('peak_bytes'))} "
            f"| {_f(r.get('grad_cosine'), '.6f')} | {_f(r.get('grad_max_rel_err'), '.2e')} |"
        )
    return [*lines, ""]


def _render_scan(rs: list[dict[str, Any]]) -> list[str]:
    lines = ["CumSumProd with diagonal K, one thread (ratio = time / sequential's):", "",
             "| state | L | algorithm | ms | ratio |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rs:
        lines.append(f"| {r['series']} | {r['x']} | {r['engine']} "
                     f"| {r['seconds_median'] * 1e3:.3f} | {_f(r.get('time_ratio'), '.2f')} |")
    return [*lines, ""]


def _plot(path: Path, rs: list[dict[str, Any]], x: str, ys: list[str], title: str) -> bool:
    try:
        plt = pyplot()
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(ys), figsize=(5 * len(ys), 3.6))
    axes = [axes] if len(ys) == 1 else list(axes)
    for ax, y in zip(axes, ys, strict=True):
        for label in dict.fromkeys(r["engine"] for r in rs):
            pts = [(r[x], r[y]) for r in rs if r["engine"] == label and r.get(y) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", label=label)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    save_figure(fig, path)
    return True


def _render_train(suite: str, rs: list[dict[str, Any]], directory: Any, plots: bool) -> list[str]:
    lines: list[str] = []
    for series, ss in by_series(rs).items():
        lines += [f"### {series}", ""]
        if plots:
            png = Path("plots") / f"{suite}-{series}.png"
            if _plot(Path(directory) / png, ss, "x", ["val_loss"], f"{series}: loss vs step"):
                _plot(Path(directory) / png.with_name(png.stem + "-time.png"), ss,
                      "wall_seconds", ["val_loss"], f"{series}: loss vs wall time")  # fmt: skip
                lines += [f"![{series}]({png.as_posix()})",
                          f"![{series} time]({png.with_name(png.stem + '-time.png').as_posix()})",
                          ""]  # fmt: skip
        lines += ["| method | steps | train loss (last window) | held-out loss | test acc "
                  "| training s |", "|---|---|---|---|---|---|"]  # fmt: skip
        for label in dict.fromkeys(r["engine"] for r in ss):
            last = max((r for r in ss if r["engine"] == label), key=lambda r: r["x"])
            lines.append(f"| {label} | {last['x']} | {_f(last.get('train_loss'), '.4f')} "
                         f"| {_f(last.get('val_loss'), '.4f')} | {_f(last.get('test_acc'), '.3f')} "
                         f"| {_f(last.get('wall_seconds'), '.1f')} |")  # fmt: skip
        lines.append("")
    return lines


def _render_convergence(suite: str, rs: list[dict[str, Any]], directory: Any,
                        plots: bool) -> list[str]:  # fmt: skip
    lines = ["Cosine to the exact gradient after k iterations (rows: training step; "
             "share = ‖g_k − g_(k−1)‖ / ‖g‖).", ""]  # fmt: skip
    for series in dict.fromkeys(r["series"] for r in rs):
        for base in ("highway", "fpi"):
            ss = [r for r in rs if r["series"] == series and r["engine"] == base]
            if not ss:
                continue
            ks = sorted({r["k"] for r in ss})
            lines += [f"### {series} ({base})", "",
                      "| step | " + " | ".join(f"k={k}" for k in ks) + " |",
                      "|---|" + "---|" * len(ks)]  # fmt: skip
            for step in sorted({r["x"] for r in ss}):
                row = {r["k"]: r for r in ss if r["x"] == step}
                lines.append(f"| {step} | " + " | ".join(
                    f"{row[k]['grad_cosine']:.4f} ({row[k]['step_share']:.2f})" for k in ks
                ) + " |")  # fmt: skip
            if plots:
                png = Path("plots") / f"{suite}-{series}-{base}.png"
                pts = [{**r, "engine": f"step {r['x']}"} for r in ss]
                if _plot(Path(directory) / png, pts, "k", ["grad_cosine", "step_share"],
                         f"{series} ({base})"):  # fmt: skip
                    lines += ["", f"![{series} {base}]({png.as_posix()})"]
            lines.append("")
    return lines


def render(suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool) -> list[str]:
    """Markdown for the highway-* suites."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        kinds.setdefault(r.get("kind", ""), []).append(r)
    lines: list[str] = []
    if "highway-rnn" in kinds:
        lines += _render_rnn(kinds["highway-rnn"])
    if "scan" in kinds:
        lines += _render_scan(kinds["scan"])
    if "highway-train" in kinds:
        lines += _render_train(suite, kinds["highway-train"], directory, plots)
    if "highway-convergence" in kinds:
        lines += _render_convergence(suite, kinds["highway-convergence"], directory, plots)
    return lines
