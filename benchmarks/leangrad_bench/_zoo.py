"""Suite ``zoo``: every way to compute a step's gradients on standard
architectures written the ordinary way (:mod:`leangrad.zoo`), leangrad's and PyTorch's,
side by side in one run.

Per model (ResNet-18-style CNN, GPT, BERT, LSTM and GRU LMs, the GRU LM as a
``HighwayNet`` for the ``highway`` engine, ViT), at a size whose backprop step needs about
1 GiB of activations here (``--quick``: small sizes), one record per method:

- leangrad: every registered engine and base + transforms composition that ``supports``
  the model (:func:`_zoo_methods.leangrad_methods`; the others recorded as skipped, with
  the reason), and ``leangrad.plan(exact=True)`` at budgets of parameters and inputs
  + f × backprop's peak (f = 0.5, 0.25, 0.125), each plan after the first taking the
  previous one's peaks (``plan(reuse=)``: its ``plan_seconds`` is its own work);
- PyTorch (:mod:`leangrad_bench._zoo_methods`): per-block, selective and
  ``checkpoint_sequential`` checkpointing (recurrent LMs: the recurrent module whole, or
  time chunks), bfloat16 autocast; ``torch.compile`` default and with
  ``activation_memory_budget``, in a fresh process (:mod:`leangrad_bench._worker`);
- gradient accumulation over k micro-batches (the suite's ``micro_batches``), on both
  sides: leangrad's ``accumulate`` and ``checkpoint+accumulate`` engines, and the loop a
  PyTorch user writes by hand, alone and with per-block checkpointing inside each
  micro-batch — only where exact (the loss a :func:`leangrad.loss.per_example` mean, no
  BatchNorm or dropout coupling the examples), else skipped with the reason. Every row's
  time is that of one effective step: the whole batch's gradient.

Hugging Face models (``hf_gpt2``, ``hf_llama``, ``hf_bert``, ``hf_unet``: :mod:`leangrad.hf`,
the ``[hf]`` extra) are opt-in: sized under ``hf_models`` and run only when ``--only`` names
them, with the libraries' own ``gradient_checkpointing_enable()`` as the PyTorch-side row
(``hf_checkpointing``); so are timm's ResNet-50, ConvNeXt-T and ViT-S (``timm_models``, the
``[vision]`` extra), beside timm's own ``set_grad_checkpointing()``.

Columns: tracker peak above parameters and inputs (``.grad`` allocated by the step) and
its ratio to backprop's; kept bytes (live when the forward phase ended); fresh-process
peak RSS; median step time of interleaved repeats (1 thread) / backprop's; float32
gradient's max relative error and cosine against backprop's; ``max_batch``: the largest
batch whose step fits backprop's total at the base batch (:mod:`._zoo_batch`; by fake-tensor
estimates where they equal the tracker at the base batch, else by the tracker). Optional
GPU-sized configurations are measured only on fake tensors and labelled ``estimate``.
Wall clock: a plan row's ``plan_seconds`` (planning, every measurement included), and
backprop's record's ``row_seconds``, the model's row by phase (profiles, each plan, the
interleaved timing, max-batch searches, fresh processes), so a full-size run can be
budgeted and its slow phase found.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from leangrad import _errors as errors
from leangrad._step import as_call
from leangrad.measure import StepProfile, profile_step, time_interleaved
from leangrad.measure._timer import num_threads
from leangrad.planner._plan import Plan, plan

from ._models import build
from ._suites import RunSettings, Suite, runner
from ._zoo_batch import estimable, footprint, max_batch
from ._zoo_methods import Method, Skipped, call
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

BAD_DEVICE = "the zoo suite runs on cpu or cuda, got device={device!r}"
NO_CUDA = (
    "--device cuda: torch.cuda.is_available() is False here (torch {version}); run on a "
    "machine with a GPU and a CUDA build of torch, or use --device cpu"
)

ESTIMATE_TOLERANCE = 0.01
"""Fake-tensor estimates drive a method's max-batch search where, at the base batch, they are
within this fraction of the tracker's total."""


@runner(only=True)
def run_zoo(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Run the suite: one record per (model, method), measured, skipped or failed, and per
    (GPU-sized model, method) estimated on fake tensors.

    Args:
        suite: the parsed ``zoo.toml`` (sizes and settings as data).
        settings: ``quick``: use the ``quick_*`` settings (small sizes, one model compiled).
            ``device``: ``"cpu"`` or ``"cuda"``: where the models run. On CUDA the tracker
            reads the CUDA allocator (peaks above what was allocated before the step),
            compile's peak too, and no fresh-process RSS is taken; max-batch searches by
            fake-tensor estimates where those are within :data:`ESTIMATE_TOLERANCE` of the
            allocator at the base batch, else by real steps on the GPU.
            ``progress``: a progress bar naming the model and the step at work.
            ``only``: run just these models (measured and estimated sizes of each); the
            opt-in Hugging Face and timm models (``hf_models``, ``timm_models``) run
            only when named here.
            ``save``: called with the records so far after each model, so a stopped run of
            hours keeps the models it finished (``run_suite`` writes them to its file).

    Returns:
        The records: :data:`~leangrad_bench.RECORD_FIELDS` plus ``series`` (the model),
        ``sweep`` (``"method"``), ``x`` (the method), ``side`` and the suite's own fields
        (module docstring); ``run_suite`` adds ``suite``, ``quick``, ``machine``, ``created``.

    Raises:
        OptionError: ``only`` names a model the suite does not have, or ``device`` is
            neither cpu nor an available cuda.
    """
    quick, device, only, save = settings.quick, settings.device, settings.only, settings.save
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = "?"
    if kind not in ("cpu", "cuda"):
        raise errors.OptionError(BAD_DEVICE.format(device=device))
    if kind == "cuda" and not torch.cuda.is_available():
        raise errors.OptionError(NO_CUDA.format(version=torch.__version__))
    values = {k: suite.setting(k, quick) for k in suite.settings if not k.startswith("quick_")}
    common = {"sweep": "method"}
    ctx = Context(quick, common, values, suite.repeats(quick), device=str(device))
    models: dict[str, dict[str, Any]] = dict(ctx.get("models", {}))
    estimates: dict[str, dict[str, Any]] = dict(ctx.get("estimate_models", {}))
    opt_in: dict[str, dict[str, Any]] = {**ctx.get("hf_models", {}),
                                         **ctx.get("timm_models", {})}  # fmt: skip
    if only is not None:
        unknown = [n for n in only if n not in models and n not in estimates and n not in opt_in]
        if unknown:
            known = ", ".join(dict.fromkeys([*models, *estimates]))
            extra = (f"; opt-in (the [hf] and [vision] extras): {', '.join(opt_in)}" if opt_in
                     else "")  # fmt: skip
            raise errors.OptionError(
                f"zoo suite has no model {', '.join(unknown)}; its models: {known}{extra}"
            )
        models = {k: v for k, v in {**models, **opt_in}.items() if k in only}
        estimates = {k: v for k, v in estimates.items() if k in only}
    records: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(models) + len(estimates),
        desc=f"bench {suite.name}",
        unit="model",
        disable=not settings.progress,
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

    phases: dict[str, float] = {}  # where the row's wall time went (seconds per phase)
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[phase] = round(now - clock, 1)  # each phase is lapped once
        clock = now

    run = _ModelRun(name, size, ctx, say)
    for m in list(run.methods):
        run.profile(m)
    lap("profiles")
    bp = run.prof["backprop"]
    for f in [float(v) for v in ctx.get("fractions", [0.5, 0.25])]:
        run.plan_at(f, bp)
        lap(f"plan at {f}")
    run.planned = None  # its candidates' engines (and their caches) are not kept further
    ok = [m for m in run.methods if m.label in run.prof]
    say(f"timing {len(ok)} methods, {ctx.repeats} interleaved repeats")
    steps = {m.label: as_call(run.engines[m.label], run.model, run.x, run.loss_fn) for m in ok}
    times = time_interleaved(steps, repeats=ctx.repeats, warmup=1, reference="backprop")
    lap("timing")
    batches = _max_batches(run, ok, say)
    lap("max batch")
    say("fresh-process RSS and torch.compile")
    worker = fresh_process(name, size, ok, run.prof, ctx)
    rss = worker["rss"]
    lap("fresh processes")
    out = [
        record(
            ctx, name, size, m.label, m.side, exact=m.exact,
            **_profile_fields(run.prof[m.label], bp),
            rss_peak_bytes=rss.get(m.label), rss_backprop_bytes=rss.get("backprop"),
            seconds_median=times[m.label].median, seconds_min=times[m.label].minimum,
            seconds_max=times[m.label].maximum, time_ratio=times[m.label].ratio,
            spec=m.spec, **run.plans.get(m.label, {}), **batches[m.label],
            **({"row_seconds": phases} if m.label == "backprop" else {}),  # the row's clock
        )
        for m in ok
    ]  # fmt: skip
    out += compile_records(ctx, name, size, worker["compile"])
    out += [
        record(ctx, name, size, lb, side, failed=why, **run.plans.get(lb, {}))
        for lb, (side, why) in run.failed.items()
    ]
    out += [
        record(ctx, name, size, s.label, s.side, skipped=s.reason, **run.plans.get(s.label, {}))
        for s in run.skipped
    ]
    return out


def _max_batches(run: _ModelRun, ok: list[Any], say: Callable[[str], None],
                 ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each measured method's largest batch within backprop's memory (or why it failed:
    a method failing at another batch is a finding, not a crash)."""
    ctx, bp = run.ctx, run.prof["backprop"]
    fixed = 2 * sum(p.numel() * p.element_size() for p in run.model.parameters())  # + grads
    factor = int(ctx.get("max_batch_factor", 16))
    relative = int(ctx.get("max_batch_tracker_relative", 0)) or None
    batches = {}
    for m in ok:
        say(f"max batch of {m.label}")
        try:
            batches[m.label] = _max_batch(
                run.name, run.size, m, run.prof[m.label], bp.total_bytes, factor, fixed,
                relative=relative, device=ctx.device,
            )  # fmt: skip
        except Exception as err:
            batches[m.label] = {"max_batch_failed": f"{type(err).__name__}: {str(err)[:300]}"}
    return batches


def _profile_fields(p: StepProfile, bp: StepProfile) -> dict[str, Any]:
    """A measured method's tracker fields, its peak as a ratio to backprop's."""
    return {
        "peak_bytes": p.peak_bytes,
        "peak_ratio": p.peak_bytes / bp.peak_bytes,
        "peak_source": "tracker",
        "baseline_bytes": p.baseline_bytes,
        "kept_bytes": p.kept_bytes,
        "saved_bytes": p.kept_bytes,
        "grad_max_rel_err": p.grad_max_rel_err,
        "grad_cosine": p.grad_cosine,
    }


class _ModelRun:
    """One zoo model at its measured size: its methods, their engines and tracker profiles,
    the plans added as methods, and what failed or was skipped (with the reason)."""

    def __init__(
        self, name: str, size: dict[str, Any], ctx: Context, say: Callable[[str], None]
    ) -> None:
        wl = build(name, size, device=ctx.device)
        self.model, self.x, self.loss_fn = wl.model, wl.inputs, wl.loss_fn
        self.name, self.size, self.ctx, self.say = name, size, ctx, say
        self.methods, self.skipped = methods_for(name, self.model, ctx, loss_fn=self.loss_fn,
                                                 inputs=self.x)  # fmt: skip
        self.engines = {m.label: m.make() for m in self.methods}
        self.model.zero_grad(set_to_none=True)
        cuda = [ctx.device] if torch.device(ctx.device).type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # each profiled step draws these masks too
            self.loss_fn(call(self.model, self.x)).backward()
        self.ref = {
            n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None
        }
        self.model.zero_grad(set_to_none=True)
        self.prof: dict[str, StepProfile] = {}
        self.failed: dict[str, tuple[str, str]] = {}  # label -> (side, error)
        self.plans: dict[str, dict[str, Any]] = {}  # plan label -> budget, fraction, choice
        self.planned: Plan | None = None  # the last plan: the next one takes its peaks

    def profile(self, m: Method) -> None:
        """The tracker's profile of ``m``'s step, or the error it raised (a finding)."""
        self.say(m.label)
        try:
            self.prof[m.label] = profile_step(
                self.engines[m.label], self.model, self.x, self.loss_fn, repeats=0,
                reference=self.ref,
            )  # fmt: skip
        except Exception as err:  # an engine failing on a zoo model is a finding
            self.failed[m.label] = (m.side, f"{type(err).__name__}: {str(err)[:300]}")

    def plan_at(self, fraction: float, bp: StepProfile) -> None:
        """``leangrad.plan`` at parameters and inputs + ``fraction`` x backprop's peak; its
        choice joins the methods (none fitting is recorded as skipped, with the plan's word)."""
        self.say(f"plan at {fraction}")
        label, budget = f"plan(≤{fraction}×)", bp.baseline_bytes + int(fraction * bp.peak_bytes)
        self.plans[label] = {"budget_bytes": budget, "fraction": fraction}
        try:
            p = plan(self.model, self.x, self.loss_fn, budget=budget, exact=True,
                     repeats=self.ctx.repeats, reuse=self.planned)  # fmt: skip
            self.planned = p
        except Exception as err:  # a planner failing on a zoo model is a finding
            self.failed[label] = ("plan", f"{type(err).__name__}: {str(err)[:300]}")
            return
        self.plans[label]["plan_seconds"] = round(p.wall_seconds or 0.0, 1)
        row = p.chosen  # whatever its verdict says ("chosen (estimate)" too)
        self.plans[label]["choice"] = row.label if row else None
        if row is None:
            self.skipped.append(Skipped(label, "plan", p.message))
            return
        m = Method(label, "plan", row.exact, {"engine": row.name, "options": row.options})
        self.methods.append(m)
        self.engines[label] = m.make()
        self.profile(m)


def _max_batch(
    name: str,
    size: dict[str, Any],
    m: Method,
    prof: StepProfile,
    budget: int,
    factor: int,
    fixed: int,
    *,
    relative: int | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """The max-batch fields of a record: searched on fake-tensor estimates where the estimate
    at the base batch is within :data:`ESTIMATE_TOLERANCE` of the tracker, else with the
    tracker (``estimate_vs_tracker``: that ratio, ``None`` where fake tensors cannot run) —
    to within 1/``relative`` there when given (``max_batch_fails``: the smallest batch seen
    not to fit, so the boundary lies in ``[max_batch, max_batch_fails)``)."""
    base = int(size["batch"])
    est: int | None = None
    if estimable(m) is None:
        try:
            est = footprint(name, size, m, base, estimate=True).total
        except Exception:  # an op fake tensors cannot run: the tracker does the search
            est = None
    ratio = None if est is None else est / prof.total_bytes
    use_estimate = ratio is not None and abs(ratio - 1) <= ESTIMATE_TOLERANCE
    at_base = est if est is not None and use_estimate else prof.total_bytes
    search = max_batch(
        lambda b: footprint(name, size, m, b, estimate=use_estimate, device=device).total,
        budget,
        start=base,
        limit=factor * base,
        fixed=fixed,
        known={base: at_base},
        relative=None if use_estimate else relative,
    )
    return {
        "max_batch": search.batch,
        "max_batch_capped": search.capped,
        "max_batch_budget_bytes": budget,
        "max_batch_probes": len(search.probes),
        "max_batch_fails": search.fails,
        "max_batch_relative": None if use_estimate else relative,
        "max_batch_method": "estimate" if use_estimate else "tracker",
        "estimate_vs_tracker": ratio,
    }
