"""Measure engines on one workload: memory, saved bytes, time ratio, gradient error.

Every number in a record is measured in the same process run as the backprop
reference it is compared with (except the RSS cross-check, which needs a fresh
process by design).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from leangrad import engines
from leangrad._step import as_call
from leangrad.measure import Timing, profile_step, run_rss_worker, time_across_threads
from leangrad.measure._rss import rss_supported

from ._workloads import Workload, build

__all__ = [
    "RECORD_FIELDS",
    "EngineSpec",
    "Record",
    "by_threads",
    "machine_info",
    "measure_config",
    "new_record",
    "now",
    "reference_grads",
    "step_of",
    "timing_fields",
]

@dataclasses.dataclass(frozen=True)
class Record:
    """The fields every benchmark record has (``None`` where not applicable), typed.

    Records stay JSON dicts: :func:`new_record` writes these fields first, in this order,
    then a suite's own fields — the keys ``dict.fromkeys(RECORD_FIELDS)`` plus an update
    gave.
    """

    engine: str | None = None
    config: dict[str, Any] | None = None
    peak_bytes: int | None = None
    saved_bytes: int | None = None
    seconds_median: float | None = None
    time_ratio: float | None = None
    grad_max_rel_err: float | None = None
    grad_cosine: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict, in declaration order (values not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(Record))
"""The fields every benchmark record has (``None`` where not applicable)."""


def new_record(*parts: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """A record: every :class:`Record` field first (``None`` unless given), then the suite's
    own fields in the order given (``parts``, then ``fields``; a later value wins)."""
    given: dict[str, Any] = {}
    for part in parts:
        given.update(part)
    given.update(fields)
    common = Record(**{k: given.pop(k) for k in RECORD_FIELDS if k in given})
    return {**common.as_dict(), **given}


RSS_TOLERANCE = 0.01
"""The RSS cross-check flags a record whose fresh-process peak exceeds the tracker's by more."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """An engine as a suite names it: registry name, options, display label, limits."""

    name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    label: str | None = None
    max_params: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSpec:
        unknown = set(d) - {"name", "options", "label", "max_params"}
        if unknown:
            raise ValueError(f"unknown engine keys {sorted(unknown)} in suite entry {dict(d)}")
        return cls(d["name"], dict(d.get("options", {})), d.get("label"), d.get("max_params"))

    def make(self) -> engines.Engine:
        return engines.engine(self.name, **self.options)

    @property
    def display(self) -> str:
        return self.label or self.make().label


def now() -> str:
    """The time a run started, as records carry it (``created``): UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def reference_grads(config: Mapping[str, Any], device: str) -> dict[str, torch.Tensor]:
    """Autograd's gradient of the same step in float64 (the oracle)."""
    wl = build({**config, "dtype": "float64"}, device=device)
    loss = wl.loss_fn(wl.model(*wl.inputs))
    params = {n: p for n, p in wl.model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()))
    return dict(zip(params, grads, strict=True))


def step_of(engine: engines.Engine, wl: Workload) -> Callable[[], object]:
    """One step of ``engine`` on the workload: gradients zeroed (to None), then its backward."""
    return as_call(engine, wl.model, wl.inputs, wl.loss_fn)


_MEASURED = (
    "peak_bytes",
    "peak_bytes_prealloc",
    "saved_bytes",
    "baseline_bytes",
    "seconds_median",
    "seconds_min",
    "seconds_max",
    "time_ratio",
    "by_threads",
    "grad_max_rel_err",
    "grad_cosine",
    "rss_peak_bytes",
    "rss_exceeds_tracker",
)
"""The fields :func:`measure_config` measures (``None`` until measured)."""


def _blank_record(
    spec: EngineSpec, engine: engines.Engine, config: Mapping[str, Any], base: Workload
) -> dict[str, Any]:
    """An engine's record before anything is measured."""
    rec: dict[str, Any] = {
        "engine": spec.label or engine.label,
        "engine_name": spec.name,
        "options": spec.options,
        "exact": engine.exact,
        "config": dict(config),
        "num_params": base.num_params,
        "estimate": False,
        "skipped": None,
    }
    rec.update(dict.fromkeys(_MEASURED))
    return rec


def _skip_reason(spec: EngineSpec, engine: engines.Engine, base: Workload) -> str | None:
    """Why ``engine`` is not measured on ``base`` (``None``: it is)."""
    if spec.max_params is not None and base.num_params > spec.max_params:
        return (
            f"{base.num_params} parameters > max_params {spec.max_params} "
            "(its time grows with the parameter count)"
        )
    reason = engine.supports(base.model)
    return None if reason is None else f"not applicable: {reason}"


def _measure_memory(
    rec: dict[str, Any],
    spec: EngineSpec,
    engine: engines.Engine,
    wl: Workload,
    *,
    ref_grads: dict[str, torch.Tensor],
    rss: bool,
    device: str,
    tick: Callable[[str], None],
) -> None:
    """One tracked step (peak, saved bytes, gradient error) and the RSS cross-check."""
    prof = profile_step(engine, wl.model, wl.inputs, wl.loss_fn, repeats=0,
                        reference=ref_grads, prealloc=True,
                        baseline=(wl.targets,))  # fmt: skip
    rec.update(
        peak_bytes=prof.peak_bytes,
        saved_bytes=prof.kept_bytes,
        baseline_bytes=prof.baseline_bytes,
        grad_max_rel_err=prof.grad_max_rel_err,
        grad_cosine=prof.grad_cosine,
        peak_bytes_prealloc=prof.peak_bytes_prealloc,
        engine_info=dict(prof.info),
    )
    tick(f"memory {rec['engine']}")
    if rss and rss_supported() and device == "cpu":
        r = run_rss_worker(
            "leangrad_bench._worker",
            {
                "mode": "rss",
                "config": dict(rec["config"]),
                "engine": spec.name,
                "options": spec.options,
            },
        )
        rec["rss_peak_bytes"] = r.peak_above
        rec["rss_exceeds_tracker"] = r.peak_above > prof.peak_bytes * (1 + RSS_TOLERANCE)
        tick(f"rss {rec['engine']}")


def timing_fields(t: Timing) -> dict[str, Any]:
    """A record's time fields from one :class:`~leangrad.measure.Timing`."""
    return {"seconds_median": t.median, "seconds_min": t.minimum, "seconds_max": t.maximum,
            "time_ratio": t.ratio}  # fmt: skip


def by_threads(timings: Mapping[int, Mapping[str, Timing]], name: str) -> list[dict[str, Any]]:
    """A record's ``by_threads`` field: ``name``'s time fields at every thread count timed
    (:func:`~leangrad.measure.time_across_threads`'s result), ratios at the same count."""
    return [{"threads": n, **timing_fields(ts[name])} for n, ts in timings.items()]


def _measure_time(
    records: Mapping[str, dict[str, Any]],
    steps: Mapping[str, Callable[[], object]],
    *,
    reference: str,
    repeats: int,
    warmup: int,
    threads: Sequence[int],
    tick: Callable[[str], None],
) -> None:
    """Interleaved timings of ``steps`` (by label) at every thread count, ratios to the
    ``reference`` engine's; the record's own time fields are those at ``threads[0]``."""
    ref_label = next((lb for lb in steps if records[lb]["engine_name"] == reference), None)
    timings = time_across_threads(
        dict(steps), threads=threads, repeats=repeats, warmup=warmup, reference=ref_label,
        progress=lambda: tick("time"),
    )  # fmt: skip
    for lb in steps:
        records[lb].update(timing_fields(timings[threads[0]][lb]), threads=threads[0],
                           by_threads=by_threads(timings, lb))  # fmt: skip


def measure_config(
    config: Mapping[str, Any],
    specs: Sequence[EngineSpec],
    *,
    reference: str = "backprop",
    repeats: int = 5,
    warmup: int = 1,
    rss: bool = True,
    device: str = "cpu",
    threads: Sequence[int] = (1,),
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure every engine of ``specs`` on the workload ``config``; one record each.

    Memory: one tracked step per engine with ``.grad`` unset (``peak_bytes``) and
    one with gradients pre-allocated (``peak_bytes_prealloc``), so new gradient
    buffers do not hide activation differences. ``saved_bytes`` is the live
    memory above baseline when the engine's forward phase ended. Time: medians
    of interleaved repeats, ratio to ``reference`` (which must be among specs), at every
    torch thread count of ``threads`` side by side (``by_threads``; the record's time
    fields and ``threads`` are the first count's). Gradients: compared with autograd's
    float64 gradient of the same step. ``repeats=0`` measures memory and gradients only
    (the time fields stay ``None``).
    """

    def tick(msg: str) -> None:
        if progress is not None:
            progress(msg)

    ref_grads = reference_grads(config, device)
    base = build(config, device=device)
    steps: dict[str, Callable[[], object]] = {}
    records: dict[str, dict[str, Any]] = {}
    for spec in specs:
        engine = spec.make()
        rec = _blank_record(spec, engine, config, base)
        records[rec["engine"]] = rec
        rec["skipped"] = _skip_reason(spec, engine, base)
        if rec["skipped"] is not None:
            continue
        wl = copy.deepcopy(base)
        steps[rec["engine"]] = step_of(engine, wl)
        _measure_memory(rec, spec, engine, wl, ref_grads=ref_grads, rss=rss, device=device,
                        tick=tick)  # fmt: skip
    if steps and repeats > 0:
        _measure_time(records, steps, reference=reference, repeats=repeats, warmup=warmup,
                      threads=list(threads), tick=tick)  # fmt: skip
    return list(records.values())
