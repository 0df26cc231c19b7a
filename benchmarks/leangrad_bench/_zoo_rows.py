"""Records of the ``zoo`` suite (:mod:`leangrad_bench._zoo`) that are not measured in its own
process: fresh-process RSS and ``torch.compile`` (:mod:`leangrad_bench._worker`), and
GPU-sized configurations estimated on fake tensors; with the helpers the runner shares
(its settings, one record, the methods for a model).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import nn

from leangrad.engines import engine
from leangrad.engines.checkpoint._time_chunks import fused_recurrent
from leangrad.measure import StepProfile
from leangrad.measure._rss import run_json_worker

from ._models import build
from ._runner import RECORD_FIELDS
from ._zoo_batch import estimable, footprint, max_batch
from ._zoo_methods import Method, Skipped, leangrad_methods, pytorch_methods

__all__ = [
    "Context",
    "compile_records",
    "estimate_records",
    "fresh_process",
    "methods_for",
    "record",
]

WORKER = "leangrad_bench._worker"
HIGHWAY_CHANGED = (
    "gru_lm as a leangrad.highway.HighwayNet: leangrad's GRULayer (nn.GRU's equations and "
    "gate order, one step at a time, hand-written J-vjps) instead of the fused nn.GRU, "
    "time-major; same inputs, outputs and loss"
)
COMPILE_MAX_BATCH = (
    "not measured: compile's memory is seen only by RSS in a fresh process, and each batch "
    "size compiles again"
)


@dataclasses.dataclass(frozen=True)
class Context:
    """One run's settings (``quick_*`` resolved) and the fields every record shares."""

    quick: bool
    common: dict[str, Any]
    settings: dict[str, Any]
    repeats: int
    device: str = "cpu"

    def get(self, key: str, default: Any = None) -> Any:
        value = self.settings.get(key)
        return default if value is None else value


def record(
    ctx: Context, name: str, size: dict[str, Any], label: str, side: str, **fields: Any
) -> dict[str, Any]:
    """One record: :data:`RECORD_FIELDS` (``None`` where not measured), the suite's shared
    fields, the model's configuration, then ``fields``."""
    config = {
        "model": name,
        **size,
        "dtype": "float32",
        "device": ctx.device,
        "threads": 1,
        "step": "gradients (backward), no optimizer",
    }
    if name == "highway_gru_lm":
        config["changed"] = HIGHWAY_CHANGED
    rec: dict[str, Any] = dict.fromkeys(RECORD_FIELDS)
    rec.update(ctx.common, series=name, x=label, engine=label, side=side, config=config,
               estimate=False, base_batch=int(size["batch"]))  # fmt: skip
    rec.update(fields)
    return rec


def methods_for(
    name: str, model: nn.Module, ctx: Context, *, loss_fn: Any = None, inputs: Any = None
) -> tuple[list[Method], list[Skipped]]:
    """leangrad's and PyTorch's methods for zoo model ``name`` (``no_pytorch`` names models
    without PyTorch rows, with the reason); gradient accumulation over each of the suite's
    ``micro_batches`` on both sides, where ``loss_fn`` (the workload's) makes it exact
    (``inputs``: the batch, watched for what couples its examples or draws)."""
    micro_batches = [int(v) for v in ctx.get("micro_batches", [])]
    lg, lg_skip = leangrad_methods(
        model,
        options=dict(ctx.get("engine_options", {})),
        skip=dict(ctx.get("skip", {})),
        forward_max_params=int(ctx.get("forward_max_params", 20_000)),
        max_transforms=int(ctx.get("max_transforms", 3)),
        micro_batches=micro_batches,
        loss_fn=loss_fn,
    )
    chunks = [int(v) for v in ctx.get("chunks", [4])]
    if fused_recurrent(model):  # leangrad's time chunks beside PyTorch's (same k)
        for k in chunks:
            eng = engine("checkpoint", time_chunks=k)
            if eng.supports(model) is None:
                spec = {"engine": "checkpoint", "options": {"time_chunks": k}}
                lg.append(Method(eng.label, "leangrad", True, spec))
    fr, fr_skip = _fragment_methods(model, [int(v) for v in ctx.get("fragments", [])])
    lg, lg_skip = lg + fr, lg_skip + fr_skip
    no_pytorch = ctx.get("no_pytorch", {})
    if name in no_pytorch:
        return lg, [*lg_skip, Skipped("PyTorch rows", "pytorch", no_pytorch[name])]
    pt, pt_skip = pytorch_methods(
        model,
        segments=[int(v) for v in ctx.get("segments", [2, 4])],
        chunks=chunks,
        micro_batches=micro_batches,
        loss_fn=loss_fn,
        inputs=inputs,
    )
    return lg + pt, lg_skip + pt_skip


def _fragment_methods(model: nn.Module,
                      counts: list[int]) -> tuple[list[Method], list[Skipped]]:  # fmt: skip
    """Checkpointing with each block recomputed in ``k`` fragments of the batch (each of
    ``counts``), alone and under chunked cross-entropy; skipped, with the reason, where no
    block can be split or the composition changes nothing."""
    from leangrad.engines.checkpoint._fragments import split_reason

    methods: list[Method] = []
    skipped: list[Skipped] = []
    for k in counts:
        for name in ("checkpoint", "checkpoint+chunked_ce"):
            eng = engine(name, fragments=k)
            why = eng.supports(model)
            if why is None:
                why = eng.idle_reason(model)
            if why is None:
                found = eng.blocks(model)
                reasons = [split_reason([found.modules[n]]) for n in found.names]
                if all(r is not None for r in reasons):
                    why = f"no block can be split: {reasons[0]}"
            if why is not None:
                skipped.append(Skipped(eng.label, "leangrad", why))
                continue
            spec = {"engine": name, "options": {"fragments": k}}
            methods.append(Method(eng.label, "leangrad", True, spec))
    return methods, skipped


def fresh_process(
    name: str, size: dict[str, Any], ok: list[Method], prof: dict[str, StepProfile], ctx: Context
) -> dict[str, Any]:
    """The worker's answer: ``{"rss": {label: bytes}, "compile": {setting: {...}}}``.

    RSS of the rows ``rss_rows`` names: ``"all"``, or ``"key"`` (backprop, the plans, bf16
    and each side's exact row with the lowest tracker peak); torch.compile for the models in
    ``compile_models``, at each of ``compile_budgets``. On CUDA no RSS (the host's resident
    set says nothing of the GPU's memory; the tracker reads the CUDA allocator) and compile's
    peak is the CUDA allocator's, which sees inductor's buffers too.
    """
    rows = ok
    if ctx.device != "cpu":
        rows = []
    elif ctx.get("rss_rows", "key") == "key":
        keep = {"backprop", "torch bf16 autocast"} | {m.label for m in ok if m.side == "plan"}
        for side in ("leangrad", "pytorch"):
            exact = [m for m in ok if m.side == side and m.exact]
            if exact:
                keep.add(min(exact, key=lambda m: prof[m.label].peak_bytes).label)
        rows = [m for m in ok if m.label in keep]
    budgets = (
        ctx.get("compile_budgets", ["default"]) if name in ctx.get("compile_models", []) else []
    )
    payload = {
        "mode": "zoo",
        "model": name,
        "size": size,
        "repeats": ctx.repeats,
        "device": ctx.device,
        "methods": [dataclasses.asdict(m) for m in rows],
        "compile": [None if b == "default" else float(b) for b in budgets],
    }
    try:
        return dict(
            run_json_worker(WORKER, payload, timeout=float(ctx.get("worker_timeout", 1800)))
        )
    except Exception as err:  # the in-process rows stand; these say why they are missing
        why = f"fresh-process worker failed: {type(err).__name__}: {str(err)[-300:]}"
        return {"rss": {}, "compile": {str(b): {"failed": why} for b in budgets}}


def compile_records(
    ctx: Context, name: str, size: dict[str, Any], compiled: dict[str, Any]
) -> list[dict[str, Any]]:
    """One record per torch.compile setting the worker ran (peak and time as ratios to eager
    backprop's in the worker's process; the peak is RSS on the CPU, the CUDA allocator's
    peak above the step's start on CUDA)."""
    out = []
    for key, c in compiled.items():
        label = (
            "torch.compile"
            if key in ("default", "None")
            else f"torch.compile(activation_memory_budget={key})"
        )
        if "failed" in c:
            out.append(record(ctx, name, size, label, "compile", failed=c["failed"]))
            continue
        cuda = "cuda_peak" in c
        peaks = (
            {"peak_source": "cuda", "peak_ratio": c["cuda_peak"] / c["cuda_peak_eager"],
             "peak_bytes": c["cuda_peak"]}
            if cuda
            else {"peak_source": "rss", "peak_ratio": c["rss"] / c["rss_eager"],
                  "rss_peak_bytes": c["rss"], "rss_backprop_bytes": c["rss_eager"]}
        )  # fmt: skip
        out.append(
            record(
                ctx,
                name,
                size,
                label,
                "compile",
                exact=True,
                **peaks,
                seconds_median=c["t"],
                time_ratio=c["t"] / c["t_eager"],
                grad_max_rel_err=c["grad_max_rel_err"],
                grad_cosine=c["grad_cosine"],
                compile_seconds=c["compile_s"],
                max_batch_method=COMPILE_MAX_BATCH,
            )
        )
    return out


def _estimated_total(name: str, size: dict[str, Any], m: Method, batch: int) -> int:
    """The fake-tensor estimate of ``m``'s total bytes at ``batch``."""
    return footprint(name, size, m, batch, estimate=True).total


def estimate_records(
    name: str, size: dict[str, Any], ctx: Context, bar: Any, checked: dict[str, float | None]
) -> list[dict[str, Any]]:
    """A GPU-sized configuration on fake tensors only (series ``"NAME (estimate)"``): the
    peak, kept bytes and max batch of every method that supports it; no time, gradient or
    RSS. ``checked``: estimate / tracker per method at the measured size, where known."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        wl = build(name, size)
        model = wl.model
        methods, skipped = methods_for(name, model, ctx, loss_fn=wl.loss_fn, inputs=wl.inputs)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # + gradients
    base, series = int(size["batch"]), f"{name} (estimate)"
    skipped += [Skipped(m.label, m.side, why) for m in methods if (why := estimable(m))]
    methods = [m for m in methods if estimable(m) is None]
    foot: dict[str, Any] = {}
    out = []
    for m in methods:
        bar.set_postfix_str(f"{series}: {m.label}", refresh=True)
        try:
            foot[m.label] = footprint(name, size, m, base, estimate=True)
        except Exception as err:  # an op fake tensors cannot run
            why = f"fake tensors cannot run it: {type(err).__name__}: {str(err)[:200]}"
            skipped.append(Skipped(m.label, m.side, why))
    bp = foot["backprop"]
    limit = int(ctx.get("max_batch_factor", 16)) * base
    for m in (m for m in methods if m.label in foot):
        f, fields = foot[m.label], {}
        if ctx.get("estimate_max_batch", True):
            bar.set_postfix_str(f"{series}: max batch of {m.label}", refresh=True)
            search = max_batch(
                functools.partial(_estimated_total, name, size, m), bp.total, start=base,
                limit=limit, fixed=fixed, known={base: f.total},
            )  # fmt: skip
            fields = {"max_batch": search.batch, "max_batch_capped": search.capped,
                      "max_batch_budget_bytes": bp.total,
                      "max_batch_method": "estimate"}  # fmt: skip
        out.append(record(
            ctx, name, size, m.label, m.side, exact=m.exact, estimate=True, series=series,
            peak_bytes=f.peak, peak_ratio=f.peak / bp.peak, peak_source="estimate",
            baseline_bytes=f.baseline, kept_bytes=f.kept, saved_bytes=f.kept, spec=m.spec,
            estimate_vs_tracker_at_measured_size=checked.get(m.label), **fields,
        ))  # fmt: skip
    out += [
        record(ctx, name, size, s.label, s.side, estimate=True, series=series, skipped=s.reason)
        for s in skipped
    ]
    return out
