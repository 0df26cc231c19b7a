"""Suite ``plan``: ``leangrad.plan`` against what a PyTorch user can do by hand, at budgets
that are fractions of backprop's step memory (issue 13's targets).

For each model (a class-based ResNet-18-style CNN and GPT from :mod:`leangrad.zoo`, and an
MLP with dropout as an ``nn.Sequential``) and each budget ``baseline + f × backprop's
step peak`` (f = 0.75, 0.5, 0.35, 0.25; baseline = parameters and inputs):

- leangrad: :func:`leangrad.plan` (exact) picks an engine; its peak and time are
  re-measured here;
- PyTorch by hand, exact: ``checkpoint_sequential(s)`` over the blocks (s = 2, 3, 4, 6),
  ``torch.utils.checkpoint`` around every block, and selective checkpointing of every
  block (matmuls and convolutions saved, the rest recomputed). The fastest that fits
  is the peer's answer.

``torch.compile`` with ``activation_memory_budget`` and Rockmate are not in this version
(the tracker cannot see inductor's buffers: they need the fresh-process RSS; Rockmate is
not installed here) — the report says so. Peak: tracker, above the baseline, ``.grad``
allocated by the step. Time: medians of interleaved repeats, 1 thread.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)
from tqdm.auto import tqdm

from .._plan import plan
from ..measure import profile_step, time_interleaved
from ..measure._timer import num_threads
from ._blocks import _workload as _blocks_workload
from ._report import fmt_bytes
from ._runner import RECORD_FIELDS, machine_info
from ._suites import Suite

__all__ = ["render", "run_plan_suite"]

Step = Callable[[], None]
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.convolution.default}  # fmt: skip
NOT_MEASURED = (
    "torch.compile with activation_memory_budget and Rockmate are not in this version: "
    "inductor's buffers are invisible to the tracker (they need the fresh-process RSS) and "
    "Rockmate is not installed here"
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _mlp_parts(model: nn.Sequential, x: torch.Tensor) -> tuple[Callable[[], torch.Tensor],
                                                               list[nn.Module], Callable]:  # type: ignore[type-arg]  # fmt: skip
    return (lambda: x, list(model), lambda h: h)


def _workload(kind: str, size: dict[str, int]):  # type: ignore[no-untyped-def]
    """The blocks suite's ResNet and GPT, and an MLP with dropout as an nn.Sequential."""
    if kind in ("gpt", "resnet"):
        return _blocks_workload(kind, size)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    w, layers, b = size["width"], size["layers"], size["batch"]
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(size["features"], w), nn.ReLU(),
                                             nn.Dropout(0.1))]  # fmt: skip
    blocks += [nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Dropout(0.1))
               for _ in range(layers - 1)]  # fmt: skip
    model = nn.Sequential(*blocks, nn.Linear(w, 10))
    x = torch.randn(b, size["features"], generator=gen)
    y = torch.randint(0, 10, (b,), generator=gen)
    return model, x, (lambda out: F.cross_entropy(out, y)), _mlp_parts(model, x)


def _peers(parts: Any, loss_fn: Callable, segments: list[int]) -> dict[str, Step]:  # type: ignore[type-arg]
    stem, blocks, head = parts
    seq = nn.Sequential(*blocks)
    selective = functools.partial(create_selective_checkpoint_contexts, _policy)

    def run(wrap: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]) -> Step:
        def step() -> None:
            h = stem()
            for i, b in enumerate(blocks):
                h = b(h) if i == len(blocks) - 1 else wrap(i, b, h)
            loss_fn(head(h)).backward()

        return step

    out: dict[str, Step] = {
        "torch per-block": run(lambda i, b, h: checkpoint(b, h, use_reentrant=False)),
        "torch selective": run(lambda i, b, h: checkpoint(
            b, h, use_reentrant=False, context_fn=selective)),
    }  # fmt: skip
    for s in segments:
        if s < len(blocks):
            out[f"checkpoint_sequential({s})"] = _sequential(seq, s, stem, head, loss_fn)
    return out


def _sequential(seq: nn.Sequential, s: int, stem: Callable, head: Callable,  # type: ignore[type-arg]
                loss_fn: Callable) -> Step:  # type: ignore[type-arg]  # fmt: skip
    def step() -> None:
        h = checkpoint_sequential(seq, s, stem(), use_reentrant=False)
        loss_fn(head(h)).backward()

    return step


class _Stepper:
    """A peer's step as an engine for :func:`profile_step` (the same measurement)."""

    def __init__(self, label: str, step: Step) -> None:
        self.label, self._step = label, step

    def backward(self, model: nn.Module, xs: Any, loss_fn: Any) -> None:
        del model, xs, loss_fn
        self._step()


def run_plan_suite(suite: Suite, *, quick: bool = False, device: str = "cpu",
                   progress: bool = True) -> list[dict[str, Any]]:  # fmt: skip
    """One record per (model, budget, side): the choice, its peak and time."""
    if device != "cpu":
        raise ValueError("the plan suite runs on cpu in this version")
    machine = machine_info()
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    models: dict[str, dict[str, int]] = dict(suite.setting("models", quick, {}))
    fractions = [float(f) for f in suite.setting("fractions", quick, [0.75, 0.5, 0.35, 0.25])]
    segments = [int(s) for s in suite.setting("segments", quick, [2, 3, 4, 6])]
    repeats = suite.repeats(quick)
    records: list[dict[str, Any]] = []
    bar = tqdm(list(models), desc=f"bench {suite.name}", unit="model", disable=not progress)
    with num_threads(1):
        for kind in bar:
            records += _run_model(suite.name, kind, models[kind], fractions, segments,
                                  repeats, quick, machine, created)  # fmt: skip
    bar.close()
    return records


def _run_model(suite: str, kind: str, size: dict[str, int], fractions: list[float],
               segments: list[int], repeats: int, quick: bool, machine: Any,
               created: str) -> list[dict[str, Any]]:  # fmt: skip
    model, x, loss_fn, parts = _workload(kind, size)
    ref = profile_step(_Stepper("backprop", lambda: loss_fn(model(x)).backward()), model, x,
                       loss_fn, repeats=0)  # fmt: skip
    peers = _peers(parts, loss_fn, segments)
    peer_peak = {n: profile_step(_Stepper(n, s), model, x, loss_fn, repeats=0).peak_bytes
                 for n, s in peers.items()}  # fmt: skip
    records = []
    for f in fractions:
        budget = ref.baseline_bytes + int(f * ref.peak_bytes)
        p = plan(model, x, loss_fn, budget=budget, repeats=repeats)
        fits = {n: s for n, s in peers.items() if ref.baseline_bytes + peer_peak[n] <= budget}
        steps: dict[str, Step] = dict(fits)
        if p.engine is not None:
            eng = p.engine
            steps["leangrad"] = lambda eng=eng: eng.backward(model, x, loss_fn)
        times = (time_interleaved(steps, repeats=repeats, warmup=1) if steps else {})
        model.zero_grad(set_to_none=True)
        best = min(fits, key=lambda n: times[n].median) if fits else None
        ours = p.table and next((c for c in p.table if c.verdict == "chosen"), None)
        base = {"suite": suite, "series": kind, "sweep": "fraction", "x": f, "quick": quick,
                "machine": machine, "created": created, "budget_bytes": budget,
                "baseline_bytes": ref.baseline_bytes, "backprop_peak_bytes": ref.peak_bytes,
                "config": {"model": kind, **size, "dtype": "float32", "threads": 1},
                "not_measured": NOT_MEASURED}  # fmt: skip
        for side, label, peak, secs in (
            ("leangrad", ours.label if ours else None,
             (ours.peak_bytes - ref.baseline_bytes) if ours and ours.peak_bytes else None,
             times["leangrad"].median if ours else None),
            ("pytorch", best, peer_peak[best] if best else None,
             times[best].median if best else None),
        ):  # fmt: skip
            rec: dict[str, Any] = dict.fromkeys(RECORD_FIELDS)
            rec.update(base, engine=side, choice=label, peak_bytes=peak, seconds_median=secs,
                       fits=label is not None)  # fmt: skip
            records.append(rec)
    return records


def render(suite: str, records: list[dict[str, Any]], directory: Any, *,
           plots: bool = True) -> list[str]:  # fmt: skip
    """Markdown: per model and budget, leangrad's plan beside PyTorch's best by hand."""
    del suite, directory, plots
    lines = ["`leangrad.plan` (exact) against the fastest exact PyTorch option that fits the "
             "same budget: checkpoint_sequential(2/3/4/6), per-block and selective "
             "checkpointing. Budget = parameters and inputs + f × backprop's step peak. "
             "Peak: tracker, above parameters and inputs. Time: medians of interleaved "
             "repeats, 1 thread; the two sides are timed in the same round-robin.", "",
             f"Not measured: {NOT_MEASURED}.", ""]  # fmt: skip
    for series in dict.fromkeys(r["series"] for r in records):
        rs = [r for r in records if r["series"] == series]
        lines += [f"### {series}", "",
                  "| f | budget | leangrad choice | peak | s/step | PyTorch choice | peak "
                  "| s/step | time leangrad / PyTorch |", "|---|---|---|---|---|---|---|---|---|"]
        for f in dict.fromkeys(r["x"] for r in rs):
            ours = next(r for r in rs if r["x"] == f and r["engine"] == "leangrad")
            peer = next(r for r in rs if r["x"] == f and r["engine"] == "pytorch")

            def cell(r: dict[str, Any]) -> str:
                if not r["fits"]:
                    return "nothing fits | — | —"
                return (f"{r['choice']} | {fmt_bytes(r['peak_bytes'])} | "
                        f"{r['seconds_median']:.4f}")  # fmt: skip

            ratio = (f"{ours['seconds_median'] / peer['seconds_median']:.2f}"
                     if ours["fits"] and peer["fits"] else "—")  # fmt: skip
            lines.append(f"| {f} | {fmt_bytes(ours['budget_bytes'])} | {cell(ours)} | "
                         f"{cell(peer)} | {ratio} |")  # fmt: skip
        lines.append("")
    return lines
