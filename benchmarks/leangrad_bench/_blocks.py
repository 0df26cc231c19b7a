"""Suite ``blocks``: checkpointing a model as written (a class-based ResNet and GPT from
:mod:`leangrad.zoo`), side by side in one run with what a PyTorch user writes by hand:

- ``backprop``: plain autograd (the reference);
- ``leangrad checkpoint``: ``leangrad.engine("checkpoint")`` on the model as it is (its
  blocks found by :func:`leangrad.blocks`, each checkpointed);
- ``torch per-block``: ``torch.utils.checkpoint`` around every block but the last, in a
  forward written for this model;
- ``checkpoint_sequential(s)``: ``torch.utils.checkpoint.checkpoint_sequential`` over the
  blocks as one ``nn.Sequential``, ``s`` segments.

Per method: tracker peak (bytes above parameters and inputs, ``.grad`` preallocated),
median step time of interleaved repeats (1 thread) and its ratio to backprop, and the
float32 gradient's max relative error to backprop's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leangrad import engine
from leangrad.measure import MemoryTracker, compare_grads, time_interleaved
from leangrad.measure._timer import num_threads

from ._models import Inputs, Parts, Workload, build
from ._plan_peers import SUITE_MODELS, peers
from ._report import fmt_bytes
from ._runner import new_record
from ._suites import RunSettings, Suite

__all__ = ["render", "run_blocks"]

Step = Callable[[], None]


def _methods(wl: Workload, parts: Parts, segments: list[int]) -> dict[str, Step]:
    """Backprop on the model as written, leangrad's checkpoint on it, and the plan suite's
    hand-written PyTorch recipes over its stem, blocks and head (:func:`peers`)."""
    model, inp, loss_fn = wl.model, wl.inputs, wl.loss_fn
    eng = engine("checkpoint")
    hand = peers(parts, loss_fn, segments, optimizer=None)

    def backprop() -> None:
        loss_fn(model(inp)).backward()

    def ours() -> None:
        eng.backward(model, inp, loss_fn)

    return {"backprop": backprop, "leangrad checkpoint": ours,
            **{n: s for n, s in hand.items() if n != "backprop" and n != "torch selective"}}


def _peak(model: nn.Module, inp: Inputs, step: Step) -> int:
    for p in model.parameters():  # .grad preallocated: the step's own bytes are measured
        p.grad = torch.zeros_like(p)
    step()  # warm-up (the engine's prepared copy is made here, once)
    with MemoryTracker(baseline=(model, inp)) as tracker:
        step()
    return tracker.report.peak_bytes


def _grads(model: nn.Module, step: Step) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_blocks(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """One record per (model, method)."""
    quick, device = settings.quick, settings.device
    models: dict[str, dict[str, int]] = dict(suite.setting("models", quick, {}))
    segments = [int(s) for s in suite.setting("segments", quick, [2, 3, 4])]
    repeats = suite.repeats(quick)
    records: list[dict[str, Any]] = []
    bar = tqdm(list(models), desc=f"bench {suite.name}", unit="model",
               disable=not settings.progress)  # fmt: skip
    with num_threads(1):
        for kind in bar:
            size = models[kind]
            wl = build(SUITE_MODELS[kind], size, device=device)
            model, inp, parts = wl.model, wl.inputs, wl.parts
            assert parts is not None, "the suite's models are cut into stem, blocks and head"
            methods = _methods(wl, parts, segments)
            peaks = {n: _peak(model, inp, s) for n, s in methods.items()}
            ref = _grads(model, methods["backprop"])
            errs = {n: compare_grads(_grads(model, s), ref).max_rel_err
                    for n, s in methods.items()}  # fmt: skip
            times = time_interleaved(methods, repeats=repeats, warmup=1, reference="backprop")
            for name in methods:
                rec = new_record(
                    series=kind, sweep="method", x=name, engine=name,
                    config={"model": kind, **size, "dtype": "float32", "threads": 1},
                    peak_bytes=peaks[name], peak_ratio=peaks[name] / peaks["backprop"],
                    seconds_median=times[name].median, time_ratio=times[name].ratio,
                    seconds_min=times[name].minimum, seconds_max=times[name].maximum,
                    grad_max_rel_err=errs[name], blocks=len(parts[1]),
                )  # fmt: skip
                records.append(rec)
    bar.close()
    return records


def render(suite: str, records: list[dict[str, Any]], directory: Any, *,
           plots: bool = True) -> list[str]:  # fmt: skip
    """Markdown section of ``leangrad report`` for the ``blocks`` suite."""
    del suite, directory, plots
    lines = ["Checkpointing a class-based model as written vs what PyTorch gives by hand. "
             "Peak: tracker, bytes above parameters, inputs and preallocated `.grad`. Time: "
             "median of interleaved repeats, 1 thread, ratio to backprop. Error: float32 "
             "gradient vs backprop's.", ""]  # fmt: skip
    for series in dict.fromkeys(r["series"] for r in records):
        rs = [r for r in records if r["series"] == series]
        cfg = {k: v for k, v in rs[0]["config"].items() if k not in ("dtype", "threads")}
        lines += [f"### {series} ({rs[0].get('blocks')} blocks)", "", f"`{cfg}`", "",
                  "| method | peak | peak ratio | time ratio | s median | grad err |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rs:
            lines.append(
                f"| {r['engine']} | {fmt_bytes(r['peak_bytes'])} | {r['peak_ratio']:.3f} "
                f"| {r['time_ratio']:.3f} | {r['seconds_median']:.4f} "
                f"| {r['grad_max_rel_err']:.1e} |"
            )
        lines.append("")
    return lines
