"""Suite ``zoo`` (issue 14, item 2): every way to compute a step's gradients on standard
architectures written the ordinary way (:mod:`leangrad.zoo`), leangrad's and PyTorch's,
side by side in one run.

Per model (ResNet-18-style CNN, GPT, BERT, LSTM and GRU LMs, the GRU LM as a
``HighwayNet`` for the ``highway`` engine, ViT), at a size whose backprop step needs about
1 GiB of activations here (``--quick``: small sizes), one record per method:

- leangrad: every registered engine and base + transforms composition that ``supports``
  the model (:func:`_zoo_methods.leangrad_methods`; the others recorded as skipped, with
  the reason), and ``leangrad.plan(exact=True)`` at budgets of parameters and inputs
  + f × backprop's peak (f = 0.5, 0.25);
- PyTorch (:mod:`leangrad.bench._zoo_methods`): per-block, selective and
  ``checkpoint_sequential`` checkpointing (recurrent LMs: the recurrent module whole, or
  time chunks), bfloat16 autocast; ``torch.compile`` default and with
  ``activation_memory_budget``, in a fresh process (:mod:`leangrad.bench._zoo_worker`).

Columns: tracker peak above parameters and inputs (``.grad`` allocated by the step) and
its ratio to backprop's; kept bytes (live when the forward phase ended); fresh-process
peak RSS; median step time of interleaved repeats (1 thread) / backprop's; float32
gradient's max relative error and cosine against backprop's; ``max_batch``: the largest
batch whose step fits backprop's total at the base batch (:mod:`._zoo_batch`; by fake-tensor
estimates where they equal the tracker at the base batch, else by the tracker). Optional
GPU-sized configurations are measured only on fake tensors and labelled ``estimate``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from .. import _errors as E
from .._plan import plan
from ..measure import StepProfile, profile_step, time_interleaved
from ..measure._timer import num_threads
from ._runner import machine_info
from ._suites import Suite
from ._zoo_batch import estimable, footprint, max_batch
from ._zoo_methods import Method, Skipped, build
from ._zoo_report import render
from ._zoo_rows import (
    Context,
    compile_records,
    estimate_records,
    fresh_process,
    methods_for,
    record,
)

__all__ = ["ESTIMATE_TOLERANCE", "render", "run_zoo"]

ESTIMATE_TOLERANCE = 0.01
"""Fake-tensor estimates drive a method's max-batch search where, at the base batch, they are
within this fraction of the tracker's total."""


def run_zoo(
    suite: Suite,
    *,
    quick: bool = False,
    device: str = "cpu",
    progress: bool = True,
    only: list[str] | None = None,
    save: Callable[[list[dict[str, Any]]], object] | None = None,
) -> list[dict[str, Any]]:
    """Run the suite: one record per (model, method), measured, skipped or failed, and per
    (GPU-sized model, method) estimated on fake tensors.

    Args:
        suite: the parsed ``zoo.toml`` (sizes and settings as data).
        quick: use the ``quick_*`` settings (small sizes, one model compiled).
        device: ``"cpu"`` only.
        progress: a progress bar naming the model and the step at work.
        only: run just these models (measured and estimated sizes of each).
        save: called with the records so far after each model, so a stopped run of hours
            keeps the models it finished (``run_suite`` writes them to its file).

    Returns:
        The records: :data:`~leangrad.bench.RECORD_FIELDS` plus ``suite``, ``series`` (the
        model), ``sweep`` (``"method"``), ``x`` (the method), ``side``, ``quick``,
        ``machine``, ``created`` and the suite's own fields (module docstring).

    Raises:
        ValueError: a device other than ``"cpu"``.
        OptionError: ``only`` names a model the suite does not have.
    """
    if device != "cpu":
        raise ValueError(f"the zoo suite runs on cpu in this version, got device={device!r}")
    settings = {k: suite.setting(k, quick) for k in suite.settings if not k.startswith("quick_")}
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    common = {
        "suite": suite.name,
        "quick": quick,
        "machine": machine_info(),
        "sweep": "method",
        "created": created,
    }
    ctx = Context(quick, common, settings, suite.repeats(quick))
    models: dict[str, dict[str, Any]] = dict(ctx.get("models", {}))
    estimates: dict[str, dict[str, Any]] = dict(ctx.get("estimate_models", {}))
    if only is not None:
        unknown = [n for n in only if n not in models and n not in estimates]
        if unknown:
            known = ", ".join(dict.fromkeys([*models, *estimates]))
            raise E.OptionError(f"zoo suite has no model {', '.join(unknown)}; its models: {known}")
        models = {k: v for k, v in models.items() if k in only}
        estimates = {k: v for k, v in estimates.items() if k in only}
    records: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(models) + len(estimates),
        desc=f"bench {suite.name}",
        unit="model",
        disable=not progress,
    )
    with num_threads(1):
        for name, size in models.items():
            records += _run_model(name, size, ctx, bar)
            bar.update()
            if save is not None:
                save(records)
        for name, size in estimates.items():
            checked = {
                r["engine"]: r.get("estimate_vs_tracker") for r in records if r["series"] == name
            }
            records += estimate_records(name, size, ctx, bar, checked)
            bar.update()
            if save is not None:
                save(records)
    bar.close()
    return records


def _run_model(name: str, size: dict[str, Any], ctx: Context, bar: Any) -> list[dict[str, Any]]:
    """Every method on one model at its measured size, then the fresh-process rows."""

    def say(msg: str) -> None:
        bar.set_postfix_str(f"{name}: {msg}", refresh=True)

    wl = build(name, size)
    model, x, loss_fn = wl.model, wl.inputs, wl.loss_fn
    methods, skipped = methods_for(name, model, ctx)
    engines = {m.label: m.make() for m in methods}
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    prof: dict[str, StepProfile] = {}
    failed: dict[str, tuple[str, str]] = {}  # label -> (side, error)
    for m in methods:
        say(m.label)
        try:
            prof[m.label] = profile_step(
                engines[m.label], model, x, loss_fn, repeats=0, reference=ref
            )
        except Exception as err:  # an engine failing on a zoo model is a finding
            failed[m.label] = (m.side, f"{type(err).__name__}: {str(err)[:300]}")
    bp = prof["backprop"]
    plans: dict[str, dict[str, Any]] = {}
    for f in [float(v) for v in ctx.get("fractions", [0.5, 0.25])]:
        say(f"plan at {f}")
        label, budget = f"plan(≤{f}×)", bp.baseline_bytes + int(f * bp.peak_bytes)
        plans[label] = {"budget_bytes": budget, "fraction": f}
        try:
            p = plan(model, x, loss_fn, budget=budget, exact=True, repeats=ctx.repeats)
        except Exception as err:  # a planner failing on a zoo model is a finding
            failed[label] = ("plan", f"{type(err).__name__}: {str(err)[:300]}")
            continue
        row = next((c for c in p.table if c.verdict == "chosen"), None)
        plans[label]["choice"] = row.label if row else None
        if row is None:
            skipped.append(Skipped(label, "plan", p.message))
            continue
        m = Method(label, "plan", row.exact, {"engine": row.name, "options": row.options})
        methods.append(m)
        engines[label] = m.make()
        prof[label] = profile_step(engines[label], model, x, loss_fn, repeats=0, reference=ref)
    ok = [m for m in methods if m.label in prof]
    say(f"timing {len(ok)} methods, {ctx.repeats} interleaved repeats")
    steps = {m.label: _step(engines[m.label], model, x, loss_fn) for m in ok}
    times = time_interleaved(steps, repeats=ctx.repeats, warmup=1, reference="backprop")
    batches = {}
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # + gradients
    for m in ok:
        say(f"max batch of {m.label}")
        batches[m.label] = _max_batch(
            name,
            size,
            m,
            prof[m.label],
            bp.total_bytes,
            int(ctx.get("max_batch_factor", 16)),
            fixed,
        )
    say("fresh-process RSS and torch.compile")
    worker = fresh_process(name, size, ok, prof, ctx)
    rss = worker["rss"]
    out = []
    for m in ok:
        p, t = prof[m.label], times[m.label]
        out.append(
            record(
                ctx,
                name,
                size,
                m.label,
                m.side,
                exact=m.exact,
                peak_bytes=p.peak_bytes,
                peak_ratio=p.peak_bytes / bp.peak_bytes,
                peak_source="tracker",
                baseline_bytes=p.baseline_bytes,
                kept_bytes=p.kept_bytes,
                saved_bytes=p.kept_bytes,
                rss_peak_bytes=rss.get(m.label),
                rss_backprop_bytes=rss.get("backprop"),
                seconds_median=t.median,
                seconds_min=t.minimum,
                seconds_max=t.maximum,
                time_ratio=t.ratio,
                grad_max_rel_err=p.grad_max_rel_err,
                grad_cosine=p.grad_cosine,
                spec=m.spec,
                **plans.get(m.label, {}),
                **batches[m.label],
            )
        )
    out += compile_records(ctx, name, size, worker["compile"])
    out += [
        record(ctx, name, size, lb, side, failed=why, **plans.get(lb, {}))
        for lb, (side, why) in failed.items()
    ]
    out += [
        record(ctx, name, size, s.label, s.side, skipped=s.reason, **plans.get(s.label, {}))
        for s in skipped
    ]
    return out


def _step(eng: Any, model: Any, x: Any, loss_fn: Any) -> Any:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        eng.backward(model, x, loss_fn)

    return step


def _max_batch(
    name: str,
    size: dict[str, Any],
    m: Method,
    prof: StepProfile,
    budget: int,
    factor: int,
    fixed: int,
) -> dict[str, Any]:
    """The max-batch fields of a record: searched on fake-tensor estimates where the estimate
    at the base batch is within :data:`ESTIMATE_TOLERANCE` of the tracker, else with the
    tracker (``estimate_vs_tracker``: that ratio, ``None`` where fake tensors cannot run)."""
    base = int(size["batch"])
    est: int | None = None
    if estimable(m) is None:
        try:
            est = footprint(name, size, m, base, estimate=True).total
        except Exception:  # an op fake tensors cannot run: the tracker does the search
            est = None
    ratio = None if est is None else est / prof.total_bytes
    use_estimate = ratio is not None and abs(ratio - 1) <= ESTIMATE_TOLERANCE
    search = max_batch(
        lambda b: footprint(name, size, m, b, estimate=use_estimate).total,
        budget,
        start=base,
        limit=factor * base,
        fixed=fixed,
        known={base: est if use_estimate else prof.total_bytes},
    )
    return {
        "max_batch": search.batch,
        "max_batch_capped": search.capped,
        "max_batch_budget_bytes": budget,
        "max_batch_probes": len(search.probes),
        "max_batch_method": "estimate" if use_estimate else "tracker",
        "estimate_vs_tracker": ratio,
    }
