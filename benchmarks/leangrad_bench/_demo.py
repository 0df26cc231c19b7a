"""``leangrad demo``: the headline — a language model with GPT-2's vocabulary planned to ⅛
of its memory beside PyTorch's exact options and torch.compile at that budget, then the
deepest network each engine trains in one budget (:mod:`leangrad_bench._demo_headline`) —
then every engine on small models on real digits, one table that fits 100 columns."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from leangrad import engines
from leangrad.measure._timer import num_threads

from ._report import fmt_bytes
from ._run import write_records
from ._runner import EngineSpec, machine_info, measure_config, now

__all__ = ["DEMO_CONFIGS", "demo_engines", "format_table", "run_demo"]

DEMO_CONFIGS: dict[str, dict[str, Any]] = {
    "mlp": {"model": "mlp", "data": "digits", "in_features": 64, "width": 32, "depth": 3,
            "batch": 256, "classes": 10, "dtype": "float32", "seed": 0},
    "cnn": {"model": "small_cnn", "data": "digits", "channels": 8, "batch": 256,
            "classes": 10, "dtype": "float32", "seed": 0},
    "revnet": {"model": "revnet", "data": "digits", "in_channels": 1, "channels": 8,
               "size": 8, "blocks": 2, "depth": 2, "batch": 256, "classes": 10,
               "dtype": "float32", "seed": 0},
    "subcnn": {"model": "subcnn", "data": "digits", "in_channels": 1, "channels": 8,
               "size": 8, "depth": 3, "batch": 256, "classes": 10, "dtype": "float32",
               "seed": 0},
}  # fmt: skip
"""The embedded default workloads: the first 256 scikit-learn digits (real, offline)."""

_VARIANTS: dict[str, list[EngineSpec]] = {
    "checkpoint": [
        EngineSpec("checkpoint", label="checkpoint(per-block)"),
        EngineSpec("checkpoint", {"segments": 2}),
    ],
    "projforward": [EngineSpec("projforward", {"seed": 0}, label="projforward")],
    # One jvp per parameter: skipped on models where that would take minutes.
    "forward": [EngineSpec("forward", max_params=6_000)],
    "moonwalk": [
        EngineSpec("moonwalk"),
        EngineSpec("moonwalk", {"mode": "pure", "per_example": True, "chunk_size": 64},
                   label="moonwalk(pure)"),
    ],
}


def demo_engines() -> list[EngineSpec]:
    """Every registered engine with its default options (plus a few named variants)."""
    specs = [EngineSpec("backprop")]
    for name in engines.available():
        if name != "backprop":
            specs += _VARIANTS.get(name, [EngineSpec(name)])
    return specs


_COLUMNS = ("model", "engine", "peak", "saved", "time ratio", "max rel err", "cosine")



def format_table(records: list[dict[str, Any]], *, width: int = 100) -> str:
    """A plain-text table of demo records, one row per (model, engine), at most ``width``
    columns: an engine that does not apply shows why, cut to fit."""
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for r in records:
        if r.get("skipped"):
            why = next((f"needs a {k}" for k in ("leangrad.Chain", "HighwayNet")
                        if k in r["skipped"]), r["skipped"])  # fmt: skip
            rows.append((r["series"], r["engine"], f"n/a: {why}"))
            continue
        rows.append((
            r["series"], r["engine"], fmt_bytes(r["peak_bytes"]), fmt_bytes(r["saved_bytes"]),
            f"{r['time_ratio']:.2f}" if r["time_ratio"] is not None else "—",
            f"{r['grad_max_rel_err']:.1e}", f"{r['grad_cosine']:.5f}",
        ))  # fmt: skip
    full = [row for row in rows if len(row) == len(_COLUMNS)]
    widths = [max(len(row[i]) for row in full) for i in range(len(_COLUMNS))]
    widths[1] = max(widths[1], *(len(row[1]) for row in rows))
    lines = []
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        if len(row) < len(_COLUMNS):  # the reason takes the rest of the line
            cells[-1] = row[-1]
        lines.append("  ".join(cells).rstrip()[:width])
    lines.insert(1, "  ".join("-" * w for w in widths)[:width])
    return "\n".join(lines)


_CLIP = 2.5
"""Peak ratios above this are drawn cut (orange) with their value written."""


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    """Per demo model, each engine's peak as a multiple of backprop's (linear axis), its
    time ratio written on the bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["series"] for r in records))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rs = [r for r in records if r["series"] == model and not r.get("skipped")]
        base = next((r["peak_bytes"] for r in rs if r["engine"] == "backprop"), None) or 1
        peaks = [r["peak_bytes"] / base for r in rs]
        shown = [min(p, _CLIP) for p in peaks]  # a forward-mode bar would flatten the rest
        bars = ax.barh([r["engine"] for r in rs], shown,
                       color=["tab:orange" if p > _CLIP else "tab:blue" for p in peaks])
        labels = [(f"{p:.0f}× mem, " if p > _CLIP else "")
                  + ("—" if r["time_ratio"] is None else f"{r['time_ratio']:.1f}× time")
                  for p, r in zip(peaks, rs, strict=True)]  # fmt: skip
        ax.bar_label(bars, labels=labels, padding=2, fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlim(0, _CLIP * 2)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel(f"peak memory × backprop's (cut at {_CLIP:g}×)")
        ax.set_title(f"{model} (digits, batch {rs[0]['config']['batch']})", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("Every engine: peak memory (bar) and time (label), relative to backprop")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(
    *,
    out: str | Path = "leangrad-demo",
    repeats: int = 3,
    rss: bool = False,
    progress: bool = True,
    stream: TextIO | None = None,
) -> list[dict[str, Any]]:
    """The headline (a GPT-2-vocabulary LM planned to ⅛ of its memory beside PyTorch's exact
    options and torch.compile at the same budget; the deepest network per engine in one
    budget), then every engine on the demo workloads; print the tables; write
    ``demo.json``, ``demo-plan.png`` (plan vs PyTorch: memory and time), ``demo-depth.png``
    and ``demo-engines.png``."""
    from . import _demo_headline as headline

    out = Path(out)
    stream = stream if stream is not None else sys.stdout
    specs = demo_engines()
    print(f"leangrad demo: {len(specs)} engine variants, repeats={repeats}, threads=1, "
          f"out={out}/", file=stream)  # fmt: skip
    common = {"suite": "demo", "quick": False, "machine": machine_info(), "created": now()}
    bar = tqdm(total=2 + len(DEMO_CONFIGS), desc="demo", unit="part", disable=not progress)

    def say(msg: str) -> None:
        bar.set_postfix_str(msg, refresh=True)

    with num_threads(1):
        planned = headline.plan_lm(repeats=repeats, progress=say)
    bar.update()
    depth = headline.deepest(progress=say)
    bar.update()
    records: list[dict[str, Any]] = []
    for model, config in DEMO_CONFIGS.items():
        bar.set_description(f"demo {model}")
        recs = measure_config(config, specs, repeats=repeats, rss=rss, progress=say)
        for r in recs:
            r.update(series=model, sweep="model", x=model, **common)
        records += recs
        bar.update()
    bar.close()
    print(headline.format_plan(planned), file=stream)
    print(file=stream)
    print(headline.format_depth(depth), file=stream)
    print(file=stream)
    print(format_table(records), file=stream)
    extra = [{**r, "kind": "depth_at_budget", "series": "depth", **common} for r in depth]
    extra.append({**planned, "kind": "plan_lm", "series": "plan", **common})
    write_records(records + extra, out / "demo.json")
    try:
        headline.plot_plan(planned, out / "demo-plan.png")
        headline.plot_depth(depth, out / "demo-depth.png")
        _plot(records, out / "demo-engines.png")
        print(f"wrote {out / 'demo.json'}, demo-plan.png, demo-depth.png and demo-engines.png",
              file=stream)  # fmt: skip
    except ImportError:
        print(f"wrote {out / 'demo.json'} (install leangrad[plot] for the PNGs)", file=stream)
    return records + extra
