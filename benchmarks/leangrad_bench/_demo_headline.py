"""The demo's headline: what leangrad buys, in two measurements and two figures.

1. **A language model with a real vocabulary planned to ⅛ of its memory** — the zoo's
   GPT-2-style transformer at GPT-2's 50,257-token vocabulary (the ``zoo`` suite's quick
   ``gpt_50k``), ``leangrad.plan(budget=parameters + inputs + ⅛ × backprop's step peak)``,
   its choice timed against backprop and beside PyTorch's exact options at the same budget
   (:func:`pytorch_options`: ``torch.utils.checkpoint`` per block, selective
   checkpointing, ``checkpoint_sequential``, gradient accumulation alone and with per-block
   checkpointing — the fastest that fits, else the lowest) and ``torch.compile`` with
   ``activation_memory_budget=0`` (its peak by fresh-process RSS, as the zoo suite
   measures it: inductor's buffers are invisible to the tracker). Where the logits are
   most of the step, only a loss that never holds them fits.
2. **The deepest network each engine trains in one budget** — Moonwalk v2 §6.3's
   experiment scaled to a few seconds: the fragmental 1D CNN, one training step under a
   tracker that refuses any allocation past the budget (parameters, inputs, gradients and
   activations all count), deepest depth by doubling and bisection
   (:func:`leangrad_bench._fragmental.deepest_fitting`).
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

__all__ = ["DEPTH_BUDGET", "DEPTH_CONFIG", "DEPTH_ENGINES", "PLAN_FRACTION", "PLAN_SIZE",
           "PYTORCH_OPTIONS", "best_pytorch", "compile_lowest", "deepest", "format_depth",
           "format_plan", "lowest_pytorch", "plan_lm", "plot_depth", "plot_plan",
           "pytorch_options"]  # fmt: skip

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
PLAN_SIZE: dict[str, int] = {"vocab": 50257, "dim": 64, "layers": 4, "heads": 4,
                             "context": 64, "batch": 8}  # fmt: skip
"""The zoo GPT the demo plans: the ``zoo`` suite's quick ``gpt_50k`` (GPT-2's vocabulary)."""
PLAN_FRACTION = 1 / 8
"""The plan's budget: parameters and inputs plus this share of backprop's step peak."""
COMPILE_BUDGET = 0.0
"""``torch.compile``'s ``activation_memory_budget`` beside the plan: its lowest setting."""
PYTORCH_OPTIONS: dict[str, list[int]] = {"segments": [2], "micro_batches": [4, 8]}
"""PyTorch's exact recipes tried beside the plan (the ``zoo`` suite's, :func:`pytorch_methods`):
per-block and selective checkpointing, ``checkpoint_sequential`` with these segments, and
gradient accumulation over these micro-batch counts, alone and with per-block checkpointing."""
COMPILE_NOTE = ("torch.compile(activation_memory_budget=0): peak by fresh-process RSS as a "
                "share of eager backprop's there, drawn at that share of backprop's memory")


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


def plan_lm(*, repeats: int = 3, progress: Any = None, compile_model: bool = True
            ) -> dict[str, Any]:  # fmt: skip
    """Plan the zoo GPT of :data:`PLAN_SIZE` to :data:`PLAN_FRACTION` of backprop's step
    memory; measure PyTorch's exact options at the same budget (:func:`pytorch_options`) and
    ``torch.compile`` at its lowest activation budget (:func:`compile_lowest`, in a fresh
    process; ``compile_model=False`` skips it); time the plan's choice and every PyTorch
    option that fits against backprop, interleaved."""
    import leangrad

    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    torch.manual_seed(0)
    size = dict(PLAN_SIZE)
    batch = size.pop("batch")
    model = zoo.gpt(**size)
    idx, loss_fn = zoo.batch("gpt", model, batch, length=size["context"])
    ref = profile_step(leangrad.engine("backprop"), model, idx, loss_fn, repeats=0)
    budget = ref.baseline_bytes + int(ref.peak_bytes * PLAN_FRACTION)
    say(f"plan the GPT to {_fraction(PLAN_FRACTION)} of its memory")
    p = leangrad.plan(model, idx, loss_fn, budget=budget, repeats=repeats)
    say("PyTorch's exact options at the same budget")
    options = pytorch_options(model, idx, loss_fn, budget=budget)
    rec: dict[str, Any] = {"model": "gpt", "size": PLAN_SIZE, "fraction": PLAN_FRACTION,
                           "budget_bytes": budget, "backprop_total_bytes": ref.total_bytes,
                           "choice": None if p.engine is None else p.engine.label,
                           "plan_total_bytes": p.peak_bytes, "time_ratio": None,
                           "message": p.message, "pytorch": options,
                           "pytorch_best": None, "pytorch_lowest": None,
                           "compile": None, "compile_note": COMPILE_NOTE}  # fmt: skip

    def step(e: Any) -> Callable[[], None]:
        return as_call(e, model, idx, loss_fn)

    steps = {"backprop": step(leangrad.engine("backprop"))}
    if p.engine is not None:
        steps["plan"] = step(p.engine)
    lowest = lowest_pytorch(options)
    timed = [o for o in options if o["fits"] or o is lowest]
    steps.update({o["label"]: step(Method(o["label"], "pytorch", True, o["spec"]).make())
                  for o in timed})  # fmt: skip
    t = time_interleaved(steps, repeats=repeats, warmup=1, reference="backprop")
    rec["time_ratio"] = t["plan"].ratio if "plan" in t else None
    for o in options:
        o["time_ratio"] = t[o["label"]].ratio if o["label"] in t else None
    rec["pytorch_best"] = best_pytorch(options, budget)
    rec["pytorch_lowest"] = lowest
    model.zero_grad(set_to_none=True)
    if compile_model:
        say("torch.compile(activation_memory_budget=0), in a fresh process")
        rec["compile"] = compile_lowest(repeats=min(repeats, 2))  # a cold compile: ~40 s
    return rec


def compile_lowest(*, repeats: int = 3) -> dict[str, Any]:
    """``torch.compile`` of the :data:`PLAN_SIZE` GPT with ``activation_memory_budget =``
    :data:`COMPILE_BUDGET`, in a fresh process (the zoo suite's worker, cold inductor
    cache): ``peak_ratio`` (RSS, over eager backprop's in that process), ``time_ratio``,
    ``compile_seconds`` and the gradient error; ``{"failed": why}`` if it did not run."""
    from leangrad.measure._rss import run_json_worker

    size = dict(PLAN_SIZE)
    payload = {"mode": "zoo", "model": "gpt_50k", "size": size, "compile": [COMPILE_BUDGET],
               "repeats": repeats}  # fmt: skip
    try:
        out = run_json_worker("leangrad_bench._worker", payload, timeout=600.0)
        c = dict(out["compile"][str(COMPILE_BUDGET)])
    except Exception as err:  # the figure says why the bar is missing
        return {"failed": f"{type(err).__name__}: {str(err)[-300:]}"}
    if "failed" in c:
        return {"failed": c["failed"]}
    return {"budget": COMPILE_BUDGET, "peak_ratio": c["rss"] / c["rss_eager"],
            "time_ratio": c["t"] / c["t_eager"], "compile_seconds": c["compile_s"],
            "grad_max_rel_err": c["grad_max_rel_err"]}  # fmt: skip


def lowest_pytorch(options: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The PyTorch option with the smallest step, fitting or not (``None``: none ran)."""
    ran = [o for o in options if o.get("total_bytes") is not None]
    return min(ran, key=lambda o: o["total_bytes"]) if ran else None


def _fraction(f: float) -> str:
    return {0.5: "½", 0.25: "¼", 0.125: "⅛"}.get(f, f"{f:g}×")


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


def _option_line(what: str, o: dict[str, Any] | None, rec: dict[str, Any]) -> str:
    if o is None:
        return f"  {what}: none ran"
    fits = "fits" if o["total_bytes"] <= rec["budget_bytes"] else "over budget"
    t = "—" if o.get("time_ratio") is None else f"{o['time_ratio']:.2f}× time"
    return f"  {what}: {o['label']}: {fmt_bytes(o['total_bytes'])} ({fits}), {t}"


def format_plan(rec: dict[str, Any]) -> str:
    """The plan beside PyTorch's exact options and torch.compile, under 100 columns."""
    ratio = "—" if rec["time_ratio"] is None else f"{rec['time_ratio']:.2f}× backprop's time"
    size, best = rec["size"], rec.get("pytorch_best")
    lines = [
        f"GPT-2-style LM at GPT-2's vocabulary (zoo.gpt, vocab {size['vocab']:,}, "
        f"{size['layers']} layers, d={size['dim']}, T={size['context']}, "
        f"batch {size['batch']})",
        f"planned to {_fraction(rec['fraction'])} of its memory: backprop needs "
        f"{fmt_bytes(rec['backprop_total_bytes'])}; budget {fmt_bytes(rec['budget_bytes'])}",
        f"  leangrad.plan chose {_short(rec['choice'])}: "
        f"{fmt_bytes(rec['plan_total_bytes'])}, {ratio}",
    ]  # fmt: skip
    if best is not None:
        lines.append(_option_line("PyTorch's best exact", best, rec))
    else:
        tried = len(rec.get("pytorch", []))
        lines.append(f"  PyTorch's best exact: none of {tried} fits")
        lines.append(_option_line("PyTorch's lowest exact", rec.get("pytorch_lowest"), rec))
    c = rec.get("compile")
    if c is not None and "failed" in c:
        lines.append(f"  torch.compile(activation_memory_budget=0): failed ({c['failed'][:40]})")
    elif c is not None:
        lines.append(f"  torch.compile(activation_memory_budget=0): {c['peak_ratio']:.2f}× "
                     f"backprop's peak (RSS), {c['time_ratio']:.2f}× its time")  # fmt: skip
    return "\n".join(lines)


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


_GRAY, _ORANGE, _GREEN, _PURPLE = "tab:gray", "tab:orange", "tab:green", "tab:purple"


def plot_plan(rec: dict[str, Any], path: Path) -> None:
    """One message, on one slide: at the same budget (⅛ of backprop's step memory),
    leangrad's plan beside PyTorch's exact options (the fastest that fits, else the lowest)
    and torch.compile's lowest activation budget — memory on the left, time on the right,
    backprop for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib, total = 2**20, rec["backprop_total_bytes"]
    best, low, c = rec.get("pytorch_best"), rec.get("pytorch_lowest"), rec.get("compile")
    torch_row = best or low
    over = torch_row is not None and torch_row["total_bytes"] > rec["budget_bytes"]
    names = ["backprop (no saving)",
             ("PyTorch's lowest exact:\n" if over else "PyTorch's best exact:\n")
             + (torch_row["label"] if torch_row else "none ran")]  # fmt: skip
    totals = [total, torch_row["total_bytes"] if torch_row else None]
    times = [1.0, torch_row.get("time_ratio") if torch_row else None]
    colors = [_GRAY, _ORANGE]
    if c is not None:
        ok = "failed" not in c
        names.append("torch.compile\n(activation_memory_budget=0)" + ("" if ok else ": failed"))
        totals.append(int(c["peak_ratio"] * total) if ok else None)
        times.append(c["time_ratio"] if ok else None)
        colors.append(_PURPLE)
    names.append("leangrad.plan:\n" + _short(rec["choice"]))
    totals.append(rec["plan_total_bytes"])
    times.append(rec["time_ratio"])
    colors.append(_GREEN)
    size = rec["size"]
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 2]})  # fmt: skip
    bars = mem.barh(names, [(v or 0) / mib for v in totals], color=colors)
    mem.bar_label(bars, labels=[fmt_bytes(v) if v else "—" for v in totals], padding=3)
    frac = _fraction(rec["fraction"])
    mem.axvline(rec["budget_bytes"] / mib, color="tab:red", ls="--", lw=1.4,
                label=f"budget {fmt_bytes(rec['budget_bytes'])}: parameters, inputs "
                      f"+ {frac} backprop's peak")  # fmt: skip
    mem.set_xlim(0, total / mib * 1.3)
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
    fig.suptitle(f"A real vocabulary in {frac} of the memory, exact: zoo.gpt at vocab "
                 f"{size['vocab']:,} ({size['layers']} layers, d={size['dim']}, "
                 f"T={size['context']}, batch {size['batch']})")  # fmt: skip
    tried = textwrap.fill("PyTorch options tried: "
                          + ", ".join(o["label"] for o in rec.get("pytorch", [])) + ".",
                          width=190)  # fmt: skip
    fig.text(0.01, 0.01, f"Memory: parameters, inputs and the step's tracked peak. Time: "
             "medians of interleaved repeats, 1 thread. Exact: the same gradient as "
             f"backprop's.\n{tried}\n{rec.get('compile_note', '')}.",
             fontsize=7, color="dimgray")  # fmt: skip
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
