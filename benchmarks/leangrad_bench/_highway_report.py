"""The Markdown section of ``leangrad report`` for the Highway-BP suites,
from the records of :mod:`leangrad_bench._highway`'s runners: the RNN targets and
speed/memory table, scan timings, training curves (highway-train, highway-transformer:
one renderer) and convergence in k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leangrad._errors import LeangradError

from ._report import (
    at_threads,
    by_series,
    extra_threads,
    fmt,
    line_figure,
    md_table,
    mib,
)

__all__ = ["TOLERANCE", "render"]

TOLERANCE = 0.02
"""highway-transformer's test: highway at the paper's k ends within 2% of backprop's
final validation loss."""


# --- highway-rnn -----------------------------------------------------------------------


def _at(rs: list[dict[str, Any]], cell: str, length: int, label: str) -> dict[str, Any] | None:
    return next((r for r in rs if r["config"].get("cell") == cell and r["x"] == length
                 and r["engine"] == label), None)  # fmt: skip


def _targets(rs: list[dict[str, Any]]) -> list[str]:
    """The targets beside the measured values (hidden 128, batch 32)."""
    lines = ["Targets (GRU, hidden 128, batch 32, one thread):", ""]
    for label, key, want in (("highway(k=0)", "backward_speedup", 2.4),
                             ("highway(k=2)", "backward_speedup", 1.15),
                             ("highway(k=2)", "grad_cosine", 0.999)):  # fmt: skip
        r = _at(rs, "gru", 256, label)
        if r is not None and r.get(key) is not None:
            ok = "met" if r[key] >= want else "NOT met"
            lines.append(f"- L=256 {label} {key} {r[key]:.4g} (target ≥ {want}): {ok}")
    for label in ("highway(k=0)", "highway(k=2)", "highway(k=5)", "highway(k=10)"):
        a, b = _at(rs, "gru", 256, label), _at(rs, "gru", 1024, label)
        if a and b and a.get("backward_speedup") and b.get("backward_speedup"):
            more = "larger" if b["backward_speedup"] > a["backward_speedup"] else "NOT larger"
            lines.append(f"- {label} backward speedup L=1024 {b['backward_speedup']:.2f}x vs "
                         f"L=256 {a['backward_speedup']:.2f}x: {more}")  # fmt: skip
    for n in [rs[0].get("threads", 1), *extra_threads(rs)]:  # vs nn.GRU / nn.LSTM
        for cell, label, want in (("gru", "highway(k=0)", 2.0), ("gru", "highway(k=2)", 1.4),
                                  ("lstm", "highway(k=0)", 1.0)):  # fmt: skip
            mine, peer = _at(rs, cell, 256, label), _at(rs, cell, 256, f"nn.{cell.upper()}")
            if mine is None or peer is None:
                continue
            a = at_threads(mine, n, "seconds_median") or mine["seconds_median"]
            b = at_threads(peer, n, "seconds_median") or peer["seconds_median"]
            ok = "met" if b / a >= want else "NOT met"
            lines.append(f"- L=256 {label} at {n} thread{'s' if n > 1 else ''}: "
                         f"nn.{cell.upper()}'s step time / its own {b / a:.2f} "
                         f"(target ≥ {want}): {ok}")  # fmt: skip
    return [*lines, ""]


def _render_rnn(rs: list[dict[str, Any]]) -> list[str]:
    extra = extra_threads(rs)
    return [
        f"One training step (forward + gradients), float32, {rs[0].get('threads', 1)} "
        "thread(s)" + "".join(f"; step speedup also at {n} threads" for n in extra)
        + " (side by side in one run). *backward* = step − "
        "forward of the same method (BPTT and nn.* record a graph; highway runs its traced "
        "no-grad forward). Speedups are BPTT's time over the method's, measured "
        "interleaved in one process. Peak = allocator-level tracker peak over the step. "
        "Gradients vs autograd in float64.",
        "",
        *_targets(rs),
        *md_table(
            ("series", "L", "method", "step ms", "step speedup",
             *(f"step speedup ({n} thr)" for n in extra), "backward ms", "backward speedup",
             "peak", "cosine", "max rel err"),
            ((r["series"], r["x"], r["engine"], f"{r['seconds_median'] * 1e3:.1f}",
              f"{fmt(r.get('step_speedup'), '.2f')}x",
              *(f"{fmt(at_threads(r, n, 'step_speedup'), '.2f')}x" for n in extra),
              f"{r['backward_seconds'] * 1e3:.1f}", f"{fmt(r.get('backward_speedup'), '.2f')}x",
              mib(r.get("peak_bytes")), fmt(r.get("grad_cosine"), ".6f"),
              fmt(r.get("grad_max_rel_err"), ".2e")) for r in rs),
        ),
        "",
    ]  # fmt: skip


def _render_scan(rs: list[dict[str, Any]]) -> list[str]:
    return ["CumSumProd with diagonal K, one thread (ratio = time / sequential's):", "",
            *md_table(("state", "L", "algorithm", "ms", "ratio"),
                      ((r["series"], r["x"], r["engine"], f"{r['seconds_median'] * 1e3:.3f}",
                        fmt(r.get("time_ratio"), ".2f")) for r in rs)), ""]  # fmt: skip


# --- plots -----------------------------------------------------------------------------


def _plot(directory: Any, name: str, rs: list[dict[str, Any]], x: tuple[str, str],
          ys: list[tuple[str, str]], title: str) -> list[str]:  # fmt: skip
    """``plots/{name}.png`` (:func:`line_figure`, a line per engine); the Markdown showing
    it (none without matplotlib)."""
    png = Path("plots") / f"{name}.png"
    drawn = line_figure(Path(directory) / png, rs, x=x, ys=ys, title=title)
    return [f"![{name}]({png.as_posix()})"] if drawn else []


# --- training curves: highway-train and highway-transformer ----------------------------


def _final(rs: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    mine = [r for r in rs if r["engine"] == label and r.get("val_loss") is not None]
    return max(mine, key=lambda r: r["x"]) if mine else None


def _verdict(rs: list[dict[str, Any]], reference: str) -> tuple[str, str | None]:
    """A sentence for the report on highway at the paper's k, and that lane's label."""
    k = rs[0]["config"].get("paper_k")
    label = f"highway(k={k})"
    bp, hw = _final(rs, reference), _final(rs, label)
    if k is None or bp is None or hw is None:
        return f"No run of highway at the paper's k ({label}) to compare with {reference}.", None
    rel = hw["val_loss"] / bp["val_loss"] - 1
    word = "within" if abs(rel) <= TOLERANCE else "NOT within"
    return (
        f"**{label} (the paper's k) is {word} {TOLERANCE:.0%} of {reference}'s final "
        f"validation loss**: {hw['val_loss']:.4f} vs {bp['val_loss']:.4f} after {bp['x']} "
        f"steps ({rel:+.2%})."
    ), label


def _titles(rs: list[dict[str, Any]], label: str | None, reference: str) -> dict[str, str]:
    """One message per plot, read from the records (about the paper's k when it ran)."""
    titles = {"loss": "validation loss against training step",
              "time": "validation loss against training time",
              "cosine": f"gradient cosine to {reference} at the same weights"}  # fmt: skip
    bp, hw = _final(rs, reference), None if label is None else _final(rs, label)
    if label is None or bp is None or hw is None:
        return titles
    rel = hw["val_loss"] / bp["val_loss"] - 1
    titles["loss"] = f"{label} ends {rel:+.1%} from {reference}'s validation loss"
    if bp.get("wall_seconds") and hw.get("wall_seconds") is not None:
        titles["time"] = (f"{label} takes {hw['wall_seconds'] / bp['wall_seconds']:.1f}x "
                          f"{reference}'s training time")  # fmt: skip
    cos = [r["grad_cosine"] for r in rs if r["engine"] == label and r.get("grad_cosine")]
    if cos:
        titles["cosine"] = f"{label}'s gradient keeps cosine >= {min(cos):.3f} to {reference}"
    return titles


def _plots(suite: str, series: str, rs: list[dict[str, Any]], directory: Any,
           titles: dict[str, str]) -> list[str]:  # fmt: skip
    blocks = rs[0]["config"].get("blocks")
    what = f"{series} ({blocks} sublayers)" if blocks else series
    loss = ("val_loss", "held-out loss (mean cross-entropy)")
    panels = [("loss", ("x", "training step"), loss),
              ("time", ("wall_seconds", "training wall time (s, 1 thread; evaluation "
                                        "excluded)"), loss),
              ("cosine", ("x", "training step"), ("grad_cosine", "cosine to the reference's "
                                                                 "gradient"))]  # fmt: skip
    out: list[str] = []
    for tag, x, y in panels:
        if any(r.get(y[0]) is not None for r in rs):
            out += _plot(directory, f"{suite}-{series}-{tag}", rs, x, [y],
                         f"{what}: {titles[tag]}")  # fmt: skip
    return [*out, ""] if out else []


def _table(rs: list[dict[str, Any]], steps: list[dict[str, Any]], reference: str) -> list[str]:
    """Each method's last evaluation (and, with step records, its step time ratios)."""
    counts = [steps[0]["threads"], *extra_threads(steps)] if steps else []
    has = {k: any(r.get(k) is not None for r in rs) for k in ("test_acc", "grad_cosine")}
    bp, rows = _final(rs, reference), []
    for label in dict.fromkeys(r["engine"] for r in rs):
        last = _final(rs, label)
        if last is None:
            continue
        rel = None if bp is None else 100 * (last["val_loss"] / bp["val_loss"] - 1)
        step = next((s for s in steps if s["engine"] == label), None)
        rows.append((
            label, last["x"], fmt(last.get("train_loss"), ".4f"), f"{last['val_loss']:.4f}",
            f"{fmt(rel, '+.2f')}%",
            *([fmt(last.get("test_acc"), ".3f")] if has["test_acc"] else []),
            *([fmt(last.get("grad_cosine"), ".4f")] if has["grad_cosine"] else []),
            *(fmt(None if step is None else at_threads(step, n, "time_ratio"), ".2f")
              for n in counts),
            fmt(last.get("wall_seconds"), ".1f"),
        ))  # fmt: skip
    header = ("method", "steps", "train loss (last window)", "held-out loss", f"vs {reference}",
              *(["test acc"] if has["test_acc"] else []),
              *(["final grad cosine"] if has["grad_cosine"] else []),
              *(f"step time ratio ({n} thr)" for n in counts), "training s")  # fmt: skip
    return [*md_table(header, rows), ""]


def _render_training(suite: str, records: list[dict[str, Any]], directory: Any,
                     plots: bool) -> list[str]:  # fmt: skip
    """Per series: the verdict on the paper's k (highway-transformer), loss against step
    and wall time, the gradient cosine where measured, and the table of final values."""
    from ._suites import load_suite

    try:
        reference = load_suite(suite).reference
    except LeangradError:  # a renamed or foreign suite file: the shipped default
        reference = "backprop"
    curves = [r for r in records if r.get("kind") in ("highway-train", "highway-transformer")]
    steps = [r for r in records if r.get("kind") == "highway-transformer-step"]
    lines = [
        "Held-out loss = mean cross-entropy on held-out data (the language models: windows "
        "of the last 10% of the corpus). Training at one torch thread, float32, all methods "
        "from the same initialisation on the same batches; wall time = training steps only."
        + (f" Gradient cosine: each method's gradient vs {reference}'s at the method's own "
           "weights, on one fixed training batch, at every evaluation."
           if any(r.get("grad_cosine") is not None for r in curves) else "")
        + (f" Step time ratio: one forward + gradient step over {reference}'s, medians of "
           "interleaved repeats after warm-up, at each thread count (the k schedule has no "
           "fixed step time)." if steps else ""),
        "",
    ]  # fmt: skip
    for series, rs in by_series(curves).items():
        cfg, label = rs[0]["config"], None
        lines += [f"### {series}", ""]
        if "paper_k" in cfg:
            sentence, label = _verdict(rs, reference)
            lines += [
                f"{cfg.get('norm', 'pre')}-LN, {cfg.get('layers')} layers = {cfg.get('blocks')} "
                f"sublayers, d_model {cfg.get('d_model')}, context {cfg.get('context')}, batch "
                f"{cfg.get('batch')}, γ = {cfg.get('gamma')}, lr {cfg.get('lr')}. The paper's "
                f"k = {cfg.get('paper_k')}: its text gives no GPT-2 number (Figs. 2d, 3 are "
                "plots), so the suite's `paper_k` setting takes the one k it names as matching "
                "backprop (ResNet110, k = 4 at L = 54).",
                "",
                sentence,
                "",
            ]
        if plots:
            lines += _plots(suite, series, rs, directory, _titles(rs, label, reference))
        lines += _table(rs, [s for s in steps if s["series"] == series], reference)
    return lines


# --- highway-convergence ---------------------------------------------------------------


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
            rows = []
            for step in sorted({r["x"] for r in ss}):
                row = {r["k"]: r for r in ss if r["x"] == step}
                rows.append([step, *(f"{row[k]['grad_cosine']:.4f} ({row[k]['step_share']:.2f})"
                                     for k in ks)])  # fmt: skip
            lines += [f"### {series} ({base})", "",
                      *md_table(("step", *(f"k={k}" for k in ks)), rows)]  # fmt: skip
            if plots:
                pts = [{**r, "engine": f"step {r['x']}"} for r in ss]
                shown = _plot(directory, f"{suite}-{series}-{base}", pts, ("k", "iterations k"),
                              [("grad_cosine", "cosine to the exact gradient"),
                               ("step_share", "share of ‖g‖ the k-th iteration adds")],
                              f"{series} ({base}): the gradient converges in k")  # fmt: skip
                lines += ["", *shown] if shown else []
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
    if kinds.keys() & {"highway-train", "highway-transformer"}:
        lines += _render_training(suite, records, directory, plots)
    if "highway-convergence" in kinds:
        lines += _render_convergence(suite, kinds["highway-convergence"], directory, plots)
    return lines
