"""The demo's headline (issue 14): what leangrad buys, in two measurements and two figures.

1. **The deepest network each engine trains in one budget** — Moonwalk v2 §6.3's
   experiment scaled to a few seconds: the fragmental 1D CNN, one training step under a
   tracker that refuses any allocation past the budget (parameters, inputs, gradients and
   activations all count), deepest depth by doubling and bisection
   (:func:`leangrad.bench._fragmental.deepest_fitting`).
2. **A zoo model planned to half its memory** — the GPT-2-style transformer of
   :mod:`leangrad.zoo`, ``leangrad.plan(budget=parameters + inputs + ½ × backprop's step
   peak)``, its choice timed against backprop side by side.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import zoo
from ..measure import profile_step, time_interleaved
from ._fragmental import _probe, deepest_fitting
from ._report import fmt_bytes
from ._runner import EngineSpec

__all__ = ["DEPTH_BUDGET", "DEPTH_CONFIG", "DEPTH_ENGINES", "PLAN_SIZE", "deepest",
           "format_depth", "format_plan", "plan_half", "plot_depth", "plot_plan"]  # fmt: skip

DEPTH_CONFIG: dict[str, Any] = {
    "model": "frag1d", "stem": "conv", "in_channels": 3, "channels": 32, "length": 128,
    "batch": 8, "classes": 10, "dtype": "float32", "seed": 0,
}  # fmt: skip
"""Moonwalk v2's fragmental 1D CNN (section 6.3), at a size that searches in seconds."""
DEPTH_BUDGET = int(1.5 * 2**20)
DEPTH_MAX = 128
DEPTH_ENGINES: list[tuple[str, EngineSpec]] = [
    ("backprop", EngineSpec("backprop")),
    ("checkpoint", EngineSpec("checkpoint", {"segments": "sqrt"})),
    ("moonwalk", EngineSpec("moonwalk", {"fragment": "full"})),
    ("moonwalk B=4", EngineSpec("moonwalk", {"fragment": 4})),
    ("moonwalk B=16", EngineSpec("moonwalk", {"fragment": 16})),
]
"""Short label -> engine. Options, for the legend: checkpoint with ⌈√L⌉ segments;
moonwalk keeping whole cotangents (full) or fragments of blocks of B positions."""
_LEGEND = ("checkpoint: ⌈√L⌉ segments · moonwalk: keeps whole cotangents · "
           "B=k: keeps fragments\nof k-position blocks (Moonwalk v2 §5) · "
           "+: the search's cap")  # fmt: skip
PLAN_SIZE: dict[str, int] = {"dim": 128, "layers": 6, "heads": 4, "context": 128,
                             "vocab": 256, "batch": 8}  # fmt: skip
"""The zoo GPT the demo plans to half its memory."""


def _probe_depth(spec: EngineSpec, depth: int) -> Any:
    """One probe of the depth search: ``spec`` at ``depth`` within :data:`DEPTH_BUDGET`."""
    return _probe(DEPTH_CONFIG, spec, depth, DEPTH_BUDGET, "cpu")


def deepest(*, progress: Any = None) -> list[dict[str, Any]]:
    """For each of :data:`DEPTH_ENGINES`, the deepest network whose step fits the budget."""
    out = []
    for label, spec in DEPTH_ENGINES:
        if progress is not None:
            progress(f"deepest {label}")
        depth, probes = deepest_fitting(
            functools.partial(_probe_depth, spec),
            max_depth=DEPTH_MAX, extra_probes=1)  # fmt: skip
        out.append({"engine": label, "engine_label": spec.display, "max_depth": depth,
                    "capped": depth >= DEPTH_MAX, "budget_bytes": DEPTH_BUDGET,
                    "probes": probes, "config": DEPTH_CONFIG})  # fmt: skip
    return out


def plan_half(*, repeats: int = 3, progress: Any = None) -> dict[str, Any]:
    """Plan the zoo GPT to half of backprop's step memory; time the choice against backprop."""
    import leangrad

    torch.manual_seed(0)
    size = dict(PLAN_SIZE)
    batch = size.pop("batch")
    model = zoo.gpt(**size)
    idx, loss_fn = zoo.batch("gpt", model, batch, length=size["context"])
    ref = profile_step(leangrad.engine("backprop"), model, idx, loss_fn, repeats=0)
    budget = ref.baseline_bytes + ref.peak_bytes // 2
    if progress is not None:
        progress("plan the GPT to half its memory")
    p = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=repeats)
    rec: dict[str, Any] = {"model": "gpt", "size": PLAN_SIZE, "budget_bytes": budget,
                           "backprop_total_bytes": ref.total_bytes,
                           "choice": None if p.engine is None else p.engine.label,
                           "plan_total_bytes": p.peak_bytes, "time_ratio": None,
                           "message": p.message}  # fmt: skip
    if p.engine is not None:
        eng = p.engine

        def step(e: Any) -> Callable[[], None]:
            def run() -> None:
                model.zero_grad(set_to_none=True)
                e.backward(model, idx, loss_fn)

            return run

        t = time_interleaved({"backprop": step(leangrad.engine("backprop")), "plan": step(eng)},
                             repeats=repeats, warmup=1, reference="backprop")  # fmt: skip
        rec["time_ratio"] = t["plan"].ratio
        model.zero_grad(set_to_none=True)
    return rec


def format_depth(records: list[dict[str, Any]]) -> str:
    """The depth table, under 100 columns."""
    base = next((r["max_depth"] for r in records if r["engine"] == "backprop"), None)
    lines = [f"Deepest fragmental 1D CNN each engine trains in {fmt_bytes(DEPTH_BUDGET)} "
             f"(everything live counts):", f"  {'engine':15s} {'depth':>6s} {'× backprop':>11s}"]
    for r in records:
        ratio = f"{r['max_depth'] / base:.1f}×" if base else "—"
        cap = "+" if r["capped"] else ""
        lines.append(f"  {r['engine']:15s} {str(r['max_depth']) + cap:>6s} {ratio:>11s}")
    lines += [f"  {line}" for line in _LEGEND.splitlines()]
    return "\n".join(lines)


def format_plan(rec: dict[str, Any]) -> str:
    """The plan summary, under 100 columns."""
    ratio = "—" if rec["time_ratio"] is None else f"{rec['time_ratio']:.2f}× backprop's time"
    return "\n".join([
        f"GPT-2-style transformer (zoo.gpt, {rec['size']['layers']} layers, d="
        f"{rec['size']['dim']}, T={rec['size']['context']}, batch {rec['size']['batch']}) "
        "planned to half its memory:",
        f"  backprop needs {fmt_bytes(rec['backprop_total_bytes'])}; budget "
        f"{fmt_bytes(rec['budget_bytes'])}",
        f"  leangrad.plan chose {_short(rec['choice'])}: "
        f"{fmt_bytes(rec['plan_total_bytes'])}, {ratio}",
    ])  # fmt: skip


def plot_depth(records: list[dict[str, Any]], path: Path) -> None:
    """One message: how deep each engine goes in the same memory (linear axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [r["engine"] for r in records]
    depths = [r["max_depth"] for r in records]
    colors = ["tab:gray" if n == "backprop" else "tab:blue" if n == "checkpoint"
              else "tab:green" for n in names]  # fmt: skip
    bars = ax.barh(names, depths, color=colors)
    ax.bar_label(bars, labels=[f"{d}{'+' if r['capped'] else ''}" for d, r in
                               zip(depths, records, strict=True)], padding=3)  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("deepest network that trains (layers)")
    ax.set_xlim(0, max(depths) * 1.15 + 1)
    ax.set_title(f"Same memory ({fmt_bytes(DEPTH_BUDGET)}), deeper networks")
    ax.grid(alpha=0.3, axis="x")
    fig.text(0.01, 0.01, _LEGEND, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_plan(rec: dict[str, Any], path: Path) -> None:
    """One message: the planned step fits half the memory, at this time cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, ax = plt.subplots(figsize=(8, 2.8))
    names = ["backprop", f"plan: {_short(rec['choice'])}"]
    values = [rec["backprop_total_bytes"] / mib, (rec["plan_total_bytes"] or 0) / mib]
    bars = ax.barh(names, values, color=["tab:gray", "tab:green"])
    times = ["1.00× time", "—" if rec["time_ratio"] is None else f"{rec['time_ratio']:.2f}× time"]
    totals = [rec["backprop_total_bytes"], rec["plan_total_bytes"]]
    ax.bar_label(bars, labels=[f"{fmt_bytes(v)} · {t}" for v, t in zip(totals, times,
                                                                      strict=True)],
                 padding=3)  # fmt: skip
    ax.axvline(rec["budget_bytes"] / mib, color="tab:red", ls="--", lw=1.2, label="budget: ½")
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.45)
    ax.set_xlabel("memory one training step needs (MiB)")
    ax.set_title("A GPT in half its memory: leangrad.plan")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _short(label: str | None) -> str:
    """An engine label short enough for a bar: block lists become their count."""
    if label is None:
        return "nothing fits"
    if "blocks=[" in label:
        head, rest = label.split("blocks=[", 1)
        inner, tail = rest.split("]", 1)
        return f"{head}{inner.count(',') + 1} blocks{tail}"
    return label
