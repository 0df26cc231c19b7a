"""The demo's headline: what leangrad buys, in two measurements and two figures.

1. **The deepest network each engine trains in one budget** — Moonwalk v2 §6.3's
   experiment scaled to a few seconds: the fragmental 1D CNN, one training step under a
   tracker that refuses any allocation past the budget (parameters, inputs, gradients and
   activations all count), deepest depth by doubling and bisection
   (:func:`leangrad_bench._fragmental.deepest_fitting`).
2. **A zoo model planned to half its memory** — the GPT-2-style transformer of
   :mod:`leangrad.zoo`, ``leangrad.plan(budget=parameters + inputs + ½ × backprop's step
   peak)``, its choice timed against backprop and against PyTorch's best exact option at
   the same budget (:func:`best_pytorch`: the fastest of the ``zoo`` suite's PyTorch-only
   exact recipes — ``torch.utils.checkpoint`` per block, selective checkpointing,
   ``checkpoint_sequential``, gradient accumulation alone and with per-block
   checkpointing — whose step fits), side by side.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from leangrad import zoo
from leangrad._step import as_call
from leangrad.measure import profile_step, time_interleaved

from ._fragmental import _probe, deepest_fitting
from ._report import fmt_bytes
from ._runner import EngineSpec
from ._zoo_methods import Method, pytorch_methods

__all__ = ["DEPTH_BUDGET", "DEPTH_CONFIG", "DEPTH_ENGINES", "PLAN_SIZE", "PYTORCH_OPTIONS",
           "best_pytorch", "deepest", "format_depth", "format_plan", "plan_half",
           "plot_depth", "plot_plan", "pytorch_options"]  # fmt: skip

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
PYTORCH_OPTIONS: dict[str, list[int]] = {"segments": [2, 3], "micro_batches": [2, 4, 8]}
"""PyTorch's exact recipes tried beside the plan (the ``zoo`` suite's, :func:`pytorch_methods`):
per-block and selective checkpointing, ``checkpoint_sequential`` with these segments, and
gradient accumulation over these micro-batch counts, alone and with per-block checkpointing."""
NO_COMPILE = ("torch.compile is not tried here: its memory is seen only by a fresh process's "
              "RSS (the zoo suite's table has it)")  # fmt: skip


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
    """Plan the zoo GPT to half of backprop's step memory; measure PyTorch's exact options at
    the same budget (:func:`pytorch_options`); time the plan's choice and every PyTorch
    option that fits against backprop, interleaved (:func:`best_pytorch` picks the fastest)."""
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
    if progress is not None:
        progress("PyTorch's exact options at the same budget")
    options = pytorch_options(model, idx, loss_fn, budget=budget)
    rec: dict[str, Any] = {"model": "gpt", "size": PLAN_SIZE, "budget_bytes": budget,
                           "backprop_total_bytes": ref.total_bytes,
                           "choice": None if p.engine is None else p.engine.label,
                           "plan_total_bytes": p.peak_bytes, "time_ratio": None,
                           "message": p.message, "pytorch": options,
                           "pytorch_best": None, "pytorch_note": NO_COMPILE}  # fmt: skip

    def step(e: Any) -> Callable[[], None]:
        return as_call(e, model, idx, loss_fn)

    steps = {"backprop": step(leangrad.engine("backprop"))}
    if p.engine is not None:
        steps["plan"] = step(p.engine)
    steps.update({o["label"]: step(Method(o["label"], "pytorch", True, o["spec"]).make())
                  for o in options if o["fits"]})  # fmt: skip
    t = time_interleaved(steps, repeats=repeats, warmup=1, reference="backprop")
    rec["time_ratio"] = t["plan"].ratio if "plan" in t else None
    for o in options:
        o["time_ratio"] = t[o["label"]].ratio if o["label"] in t else None
    rec["pytorch_best"] = best_pytorch(options, budget)
    model.zero_grad(set_to_none=True)
    return rec


def pytorch_options(
    model: torch.nn.Module, idx: torch.Tensor, loss_fn: Any, *, budget: int
) -> list[dict[str, Any]]:
    """Every exact PyTorch-only recipe of :data:`PYTORCH_OPTIONS` for ``model``: its step's
    total memory (parameters, inputs and the tracker's peak, as the plan's budget counts
    it), whether that fits ``budget``, its gradient's error against backprop's and its
    ``spec`` (:class:`Method`'s, to rebuild it); ``time_ratio`` is filled in by the caller.
    A recipe that raises is a row with ``failed`` (the error) that does not fit."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(idx)).backward()
    reference = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    methods, _ = pytorch_methods(model, segments=PYTORCH_OPTIONS["segments"], chunks=[],
                                 micro_batches=PYTORCH_OPTIONS["micro_batches"],
                                 loss_fn=loss_fn)  # fmt: skip
    out = []
    for m in (m for m in methods if m.exact):
        row: dict[str, Any] = {"label": m.label, "spec": m.spec, "total_bytes": None,
                               "fits": False, "grad_max_rel_err": None, "time_ratio": None}
        try:
            prof = profile_step(m.make(), model, idx, loss_fn, repeats=0, reference=reference)
        except Exception as err:  # a recipe failing on the model is shown, not fatal
            row["failed"] = f"{type(err).__name__}: {str(err)[:200]}"
        else:
            row.update(total_bytes=prof.total_bytes, fits=prof.total_bytes <= budget,
                       grad_max_rel_err=prof.grad_max_rel_err)  # fmt: skip
        out.append(row)
    model.zero_grad(set_to_none=True)
    return out


def best_pytorch(options: list[dict[str, Any]], budget: int) -> dict[str, Any] | None:
    """The fastest timed PyTorch option whose step fits ``budget`` bytes (``None``: none)."""
    fit = [o for o in options if o.get("total_bytes") is not None
           and o["total_bytes"] <= budget and o.get("time_ratio") is not None]  # fmt: skip
    return min(fit, key=lambda o: o["time_ratio"]) if fit else None


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
    """The plan summary beside PyTorch's best exact option, under 100 columns."""
    ratio = "—" if rec["time_ratio"] is None else f"{rec['time_ratio']:.2f}× backprop's time"
    best = rec.get("pytorch_best")
    tried = len(rec.get("pytorch", []))
    torch_line = (f"  PyTorch's best exact option: none of {tried} fits" if best is None else
                  f"  PyTorch's best exact option: {best['label']}: "
                  f"{fmt_bytes(best['total_bytes'])}, {best['time_ratio']:.2f}× backprop's time")
    return "\n".join([
        f"GPT-2-style transformer (zoo.gpt, {rec['size']['layers']} layers, d="
        f"{rec['size']['dim']}, T={rec['size']['context']}, batch {rec['size']['batch']}) "
        "planned to half its memory:",
        f"  backprop needs {fmt_bytes(rec['backprop_total_bytes'])}; budget "
        f"{fmt_bytes(rec['budget_bytes'])}",
        f"  leangrad.plan chose {_short(rec['choice'])}: "
        f"{fmt_bytes(rec['plan_total_bytes'])}, {ratio}",
        torch_line,
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


_GRAY, _ORANGE, _GREEN = "tab:gray", "tab:orange", "tab:green"


def plot_plan(rec: dict[str, Any], path: Path) -> None:
    """One message, on one slide: at the same budget (half of backprop's step memory),
    leangrad's plan beside PyTorch's best exact option — memory on the left, time on the
    right, backprop for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    best = rec.get("pytorch_best")
    names = ["backprop (no saving)",
             "PyTorch's best:\n" + (best["label"] if best else "nothing exact fits"),
             "leangrad.plan:\n" + _short(rec["choice"])]  # fmt: skip
    totals = [rec["backprop_total_bytes"], best["total_bytes"] if best else None,
              rec["plan_total_bytes"]]  # fmt: skip
    times = [1.0, best["time_ratio"] if best else None, rec["time_ratio"]]
    colors = [_GRAY, _ORANGE, _GREEN]
    size = rec["size"]
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 2]})  # fmt: skip
    bars = mem.barh(names, [(v or 0) / mib for v in totals], color=colors)
    mem.bar_label(bars, labels=[fmt_bytes(v) if v else "—" for v in totals], padding=3)
    mem.axvline(rec["budget_bytes"] / mib, color="tab:red", ls="--", lw=1.4,
                label=f"budget {fmt_bytes(rec['budget_bytes'])}: parameters, inputs "
                      "+ ½ backprop's peak")  # fmt: skip
    mem.set_xlim(0, rec["backprop_total_bytes"] / mib * 1.3)
    mem.set_xlabel("memory one training step needs (MiB)")
    mem.set_title("Memory (lower is better)")
    mem.legend(loc="lower right", fontsize=8)
    bars = tim.barh(names, [t or 0 for t in times], color=colors)
    tim.bar_label(bars, labels=["—" if t is None else f"{t:.2f}×" for t in times], padding=3)
    tim.axvline(1.0, color="k", lw=0.8)
    tim.set_xlim(0, max([t or 0 for t in times] + [1.0]) * 1.3)
    tim.set_xlabel("time per step (× backprop's)")
    tim.set_title("Time (lower is better)")
    for ax in (mem, tim):
        ax.grid(alpha=0.3, axis="x")
    mem.invert_yaxis()
    fig.suptitle(f"Same budget, exact gradients: leangrad.plan vs PyTorch's best — zoo.gpt "
                 f"({size['layers']} layers, d={size['dim']}, T={size['context']}, "
                 f"batch {size['batch']})")  # fmt: skip
    tried = textwrap.fill("PyTorch options tried: "
                          + ", ".join(o["label"] for o in rec.get("pytorch", [])) + ".",
                          width=190)  # fmt: skip
    fig.text(0.01, 0.01, f"Memory: parameters, inputs and the step's tracked peak. Time: "
             "medians of interleaved repeats, 1 thread. Exact: the same gradient as "
             f"backprop's.\n{tried}\n"
             f"{rec.get('pytorch_note', '')}.", fontsize=7, color="dimgray")  # fmt: skip
    fig.tight_layout(rect=(0, 0.12, 1, 1))
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
