"""``leangrad demo``: every engine on a small MLP and CNN on real digits, one table."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from .. import engines
from ._report import fmt_bytes
from ._run import write_records
from ._runner import EngineSpec, machine_info, measure_config

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
        EngineSpec("moonwalk", {"mode": "pure", "per_example": True, "chunk_size": 64}),
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


def format_table(records: list[dict[str, Any]]) -> str:
    """A plain-text table of demo records, one row per (model, engine)."""
    rows = [_COLUMNS]
    for r in records:
        if r.get("skipped"):
            why = "needs a leangrad.Chain" if "leangrad.Chain" in r["skipped"] else r["skipped"]
            rows.append((r["series"], r["engine"], "n/a", "", "", "", why[:48]))
            continue
        rows.append(
            (
                r["series"],
                r["engine"],
                fmt_bytes(r["peak_bytes"]),
                fmt_bytes(r["saved_bytes"]),
                f"{r['time_ratio']:.2f}" if r["time_ratio"] is not None else "—",
                f"{r['grad_max_rel_err']:.1e}",
                f"{r['grad_cosine']:.5f}",
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["series"] for r in records))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        rs = [r for r in records if r["series"] == model and not r.get("skipped")]
        names = [r["engine"] for r in rs]
        row[0].barh(names, [r["peak_bytes"] / 2**20 for r in rs], color="tab:blue")
        row[0].set_xscale("log")
        row[0].set_xlabel("peak memory above baseline (MiB, log)")
        row[1].barh(names, [r["time_ratio"] for r in rs], color="tab:orange")
        row[1].set_xscale("log")
        row[1].axvline(1.0, color="k", lw=0.8)
        row[1].set_xlabel("time / backprop (log)")
        for ax in row:
            ax.invert_yaxis()
            ax.set_title(f"{model} on digits (batch {rs[0]['config']['batch']})")
            ax.grid(alpha=0.3, axis="x")
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
    """Run every engine on the demo workloads; print the table; write JSON and a PNG."""
    out = Path(out)
    stream = stream if stream is not None else sys.stdout
    specs = demo_engines()
    print(
        f"leangrad demo: engines {[s.display for s in specs]}, repeats={repeats}, "
        f"threads=1, out={out}/",
        file=stream,
    )
    records: list[dict[str, Any]] = []
    machine = machine_info()
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    bar = tqdm(DEMO_CONFIGS.items(), desc="demo", unit="model", disable=not progress)
    for model, config in bar:
        bar.set_description(f"demo {model}")
        recs = measure_config(
            config,
            specs,
            repeats=repeats,
            rss=rss,
            progress=lambda msg: bar.set_postfix_str(msg, refresh=True),
        )
        for r in recs:
            r.update(
                suite="demo",
                series=model,
                sweep="model",
                x=model,
                quick=False,
                machine=machine,
                created=created,
            )
        records += recs
    print(format_table(records), file=stream)
    write_records(records, out / "demo.json")
    try:
        _plot(records, out / "demo.png")
        print(f"wrote {out / 'demo.json'} and {out / 'demo.png'}", file=stream)
    except ImportError:
        print(f"wrote {out / 'demo.json'} (install leangrad[plot] for the PNG)", file=stream)
    return records
