"""Compiled candidates of :func:`leangrad.plan` (``plan(..., compile=True)``): ``torch.compile``
of the whole model, with its default partition and with AOT autograd's
``activation_memory_budget`` (the min-cut recomputation of
``torch._functorch.config.activation_memory_budget``, PyTorch 2.4+), and regional
compilation — each of the model's blocks compiled, under plain autograd
(``compile(regions=blocks)``) and under leangrad's per-block checkpointing
(``compile(regions=checkpoint)``; :mod:`leangrad.planner._regional`) — each a row of the
plan's table beside leangrad's engines, so a plan is never slower than what compile alone
gives at a budget both meet. A model whose module tree repeats no block has regional rows
saying so.

How a compiled step is measured. On the CPU, inductor's generated code allocates buffers
the tracker (a dispatch-mode tracker) never sees, so compile's memory is measurable only as
the resident set of a fresh process. Each setting therefore runs in its own process
(``python -m leangrad.planner._compile``, started by
:func:`leangrad.measure._rss.run_json_worker`), which loads the model, inputs and loss
from a ``torch.save`` pickle and runs the zoo suite's measurement of a compile
(:func:`leangrad.measure._compile.compile_costs`; a regional row's step is
:class:`Compiled`'s own): a cold compile (an empty inductor cache
of its own; its seconds are the first step's), the gradient against eager autograd's, the
peak RSS of a compiled step and of an eager one, and both steps' medians of interleaved
repeats. The row's peak is backprop's in this process (the tracker's) with its step part
scaled by the worker's compiled/eager ratio ("RSS-scaled"); on CUDA the caching allocator
sees every buffer, and the ratio is of its peaks ("CUDA-scaled"). The row's time is the
worker's compiled/eager ratio times backprop's median here; the compile's own seconds are
a column of their own, never in the step time.

A model, inputs or loss that cannot be pickled (a lambda, a class defined in ``__main__``)
is a row saying why; a compile that fails (dynamo, inductor) or a worker that runs past
:data:`COMPILE_TIMEOUT_S` is a row ``failed: <reason>``, and the plan goes on.

The chosen engine, :class:`Compiled`, compiles the model (or its blocks) on its first
backward (once per model, kept) under the same setting.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..engines import Engine, engine
from ..engines._backprop import grad_hooks
from ..engines._base import LossFn, OnGrad, StepResult, forward_loss
from ._measure import Context, Tried, failed_verdict
from ._regional import REGIONS, Regional, regions_why

__all__ = [
    "COMPILE_BUDGETS",
    "COMPILE_NAME",
    "COMPILE_REGIONS",
    "COMPILE_TIMEOUT_S",
    "Compiled",
    "compile_candidates",
    "compile_options",
    "measure_compiled",
]

COMPILE_NAME = "compile"
"""The ``name`` of compiled rows in a plan's table and file (not a registered engine:
``leangrad.engine`` does not make it; :class:`Compiled` is the plan's engine)."""
COMPILE_BUDGETS: tuple[float | None, ...] = (None, 0.5)
"""``activation_memory_budget`` settings tried (``None``: torch.compile's default)."""
COMPILE_REGIONS: tuple[str, ...] = REGIONS
"""Regional settings tried, each with the default partition (:mod:`leangrad.planner._regional`):
``"blocks"`` (each block compiled, plain autograd), ``"checkpoint"`` (each block compiled
and checkpointed)."""
COMPILE_TIMEOUT_S = 900
"""Seconds one setting's worker (cold compile, RSS, timing) may take before its row fails."""
MIN_RSS_BYTES = 1 << 20
"""An eager step whose resident set rises less than this cannot be scaled by."""
GRAD_TOLERANCE = {torch.float64: 1e-9}
"""Largest relative error (max abs error over max abs value, per parameter) of compiled
gradients against eager autograd's: float reassociation only; other dtypes: 1e-3."""
OTHER_TOLERANCE = 1e-3

BAD_COMPILE_BUDGET = (
    "compile: activation_memory_budget must be None or a number in (0, 1], got {value!r}"
)
NOT_PICKLABLE = (
    "compile runs in a fresh process, and the {what} cannot be pickled there ({why}); define "
    "it at module level (a named function or functools.partial, not a lambda or closure)"
)
NOT_REBUILT = (
    "compile runs in a fresh process, which could not rebuild the model, inputs or loss from "
    "their pickle ({why}); define their classes and functions in an importable module"
)
WITH_OPTIMIZER = (
    "compile is measured in a fresh process without an optimizer; plan without optimizer= "
    "to compare it"
)
UNDER_AUTOCAST = "compile is not measured under autocast; plan in full precision to compare it"
TOO_BIG = "compile is measured by running it, and this step is too big to allocate here"
NO_RSS = (
    "the resident set of a fresh process cannot be read here (Linux /proc only), and "
    "compile's CPU memory is measurable no other way"
)
TOO_SMALL = (
    "the eager step raised the worker's resident set by {rise} bytes only, too little to "
    "scale by; plan a larger batch to compare compile"
)
SMALL_STEP = (
    "backprop's step allocates {peak} bytes only, too little for a resident set to measure "
    "(compile's CPU memory is measurable no other way); plan a larger batch to compare compile"
)
TIMED_OUT = "failed: the compile worker ran past {seconds} s"
WORKER_FAILED = "failed: the compile worker exited: {why}"
GRAD_DIFFERS = (
    "failed: compiled gradient differs from autograd's (max relative error {err:.2e} > {tol:g})"
)
WORKER = "leangrad.planner._compile"
"""The module run as each setting's fresh process."""


def compile_options(budget: float | None, regions: str | None = None) -> dict[str, Any]:
    """The options of the compiled row for ``budget`` and ``regions`` (empty for the
    default: the whole model, its default partition)."""
    opts: dict[str, Any] = {} if budget is None else {"activation_memory_budget": budget}
    return opts if regions is None else {**opts, "regions": regions}


def compile_candidates() -> list[tuple[str, dict[str, Any]]]:
    """The compiled rows :func:`leangrad.plan` adds with ``compile=True``: the whole model
    at each of :data:`COMPILE_BUDGETS`, then each of :data:`COMPILE_REGIONS`."""
    return [(COMPILE_NAME, compile_options(b)) for b in COMPILE_BUDGETS] + [
        (COMPILE_NAME, compile_options(None, r)) for r in COMPILE_REGIONS
    ]


class Compiled(Engine):
    """Backprop through ``torch.compile(model)``, with AOT autograd's
    ``activation_memory_budget`` patched in while it compiles and runs (``None``: the
    default partition, which saves what the min-cut partitioner chooses).

    With ``regions``, each of the model's blocks is compiled instead of the model
    (regional compilation, :mod:`leangrad.planner._regional`), in a copy that shares the
    model's tensors: ``"blocks"`` runs it under plain autograd, ``"checkpoint"`` under
    leangrad's ``checkpoint`` engine (each block checkpointed); the code between the
    blocks runs eagerly.

    Exact in leangrad's sense: the gradient is autograd's up to float reassociation
    (inductor fuses and reorders reductions; the plan measured the difference). The model
    is compiled on the first backward (dynamo, AOT autograd, inductor: seconds to
    minutes) and the compiled module is kept for later steps on the same model, which keeps
    that model alive as long as this engine. Not a registered engine: the plan makes it
    (``Plan.engine``) and :meth:`leangrad.Plan.load` rebuilds it.

    Reference: PyTorch, "torch.compile" and the activation-memory-budget partitioner
    (``torch._functorch.config.activation_memory_budget``, PyTorch 2.4).
    """

    name = COMPILE_NAME
    exact = True

    def __init__(self, *, activation_memory_budget: float | None = None,
                 regions: str | None = None) -> None:  # fmt: skip
        b = activation_memory_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))
                              or not 0 < b <= 1):  # fmt: skip
            raise ValueError(BAD_COMPILE_BUDGET.format(value=b))
        self._regional = None if regions is None else Regional(regions)  # checks regions
        super().__init__(**compile_options(None if b is None else float(b), regions))
        self.budget = None if b is None else float(b)
        self.regions = regions
        self._compiled: dict[int, tuple[nn.Module, Callable[..., Any]]] = {}

    def supports(self, model: nn.Module) -> str | None:
        """``None``, or (with ``regions``) why the model has no blocks to compile."""
        return None if self.regions is None else regions_why(model)

    def compiled(self, model: nn.Module) -> Callable[..., Any]:
        """``torch.compile(model)``, made once per model and kept; with ``regions``, the
        copy of ``model`` whose blocks are compiled (``checkpoint`` runs its own copy of
        that, each block wrapped again)."""
        if self._regional is not None:
            return self._regional.prepared(model)[0]
        kept = self._compiled.get(id(model))
        if kept is None or kept[0] is not model:
            kept = (model, torch.compile(model))
            self._compiled[id(model)] = kept
        return kept[1]

    def _backward(self, model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn,
                  params: Mapping[str, nn.Parameter],
                  on_grad: OnGrad | None) -> StepResult:  # fmt: skip
        with _budget(self.budget):
            if self._regional is not None:
                loss, info = self._regional.backward(self.label, model, inputs, loss_fn,
                                                     params, on_grad)  # fmt: skip
                return self._result(loss, **info)
            loss = forward_loss(self.label, self.compiled(model), inputs, loss_fn)
            with grad_hooks(params, on_grad):
                loss.backward()
        return self._result(loss)


@contextlib.contextmanager
def _budget(budget: float | None) -> Iterator[None]:
    """AOT autograd's ``activation_memory_budget`` set to ``budget`` (as it is, for None)."""
    if budget is None:
        yield
        return
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=budget):
        yield


# -- measuring: this process -------------------------------------------------------------


def measure_compiled(ctx: Context, tried: list[Tried], *, repeats: int,
                     autocast: bool = False) -> None:  # fmt: skip
    """Measure each compiled setting in a fresh process and append its row to ``tried``:
    peak and time are backprop's here scaled by the worker's compiled/eager ratios
    (``Tried.time_ratio``; :func:`leangrad.plan` multiplies by backprop's median)."""
    from ..measure import profile_step
    from ..measure._rss import rss_supported

    todo = compile_candidates()
    device = ctx.xs[0].device if ctx.xs else next(ctx.model.parameters()).device
    why = (WITH_OPTIMIZER if ctx.optimizer is not None else UNDER_AUTOCAST if autocast
           else TOO_BIG if ctx.estimate_only
           else NO_RSS if device.type == "cpu" and not rss_supported() else None)  # fmt: skip
    if why is not None:
        tried.extend(_row(opts, verdict=f"n/a: {why}") for _, opts in todo)
        return
    with tempfile.TemporaryDirectory(prefix="leangrad-plan-compile-") as tmp:
        path = os.path.join(tmp, "step.pt")
        why = _pickle(ctx, path)
        if why is not None:
            tried.extend(_row(opts, verdict=f"n/a: {why}") for _, opts in todo)
            return
        ref = profile_step(engine("backprop"), ctx.model, ctx.xs, ctx.loss_fn, repeats=0)
        if device.type == "cpu" and ref.peak_bytes < MIN_RSS_BYTES:  # not worth a compile
            why = SMALL_STEP.format(peak=ref.peak_bytes)
            tried.extend(_row(opts, verdict=f"n/a: {why}") for _, opts in todo)
            return
        for _, opts in todo:
            if "regions" in opts and (why := regions_why(ctx.model)) is not None:
                tried.append(_row(opts, verdict=f"n/a: {why}"))
                continue
            if ctx.progress is not None:
                ctx.progress(f"compiling {Compiled(**opts).label} in a fresh process")
            tried.append(_measured(opts, path, ctx, ref.baseline_bytes, ref.peak_bytes,
                                   repeats=repeats, device=device))  # fmt: skip


def _row(opts: dict[str, Any], **fields: Any) -> Tried:
    fields.setdefault("engine", None)
    fields.setdefault("peak", None)
    return Tried(label=Compiled(**opts).label, exact=True, name=COMPILE_NAME,
                 options=dict(opts), **fields)  # fmt: skip


def _pickle(ctx: Context, path: str) -> str | None:
    """Write the model, inputs and loss for the worker; why they cannot be, or ``None``."""
    for what, obj in (("model", ctx.model), ("loss_fn", ctx.loss_fn)):
        try:
            torch.save(obj, os.devnull)
        except Exception as err:  # pickle raises PicklingError, AttributeError, TypeError
            return NOT_PICKLABLE.format(what=what, why=f"{type(err).__name__}: {err}")
    try:
        torch.save({"model": ctx.model, "inputs": ctx.xs, "loss_fn": ctx.loss_fn}, path)
    except Exception as err:  # the inputs, or the three together
        return NOT_PICKLABLE.format(what="inputs", why=f"{type(err).__name__}: {err}")
    return None


def _measured(opts: dict[str, Any], path: str, ctx: Context, baseline: int, step_peak: int,
              *, repeats: int, device: torch.device) -> Tried:  # fmt: skip
    """One setting's row from its worker's report."""
    from ..measure._rss import run_json_worker

    payload = {"path": path, "budget": opts.get("activation_memory_budget"),
               "regions": opts.get("regions"),
               "repeats": max(3, repeats), "threads": torch.get_num_threads(),
               "sys_path": [p for p in sys.path if p]}  # fmt: skip
    try:
        out = run_json_worker(WORKER, payload, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return _row(opts, verdict=TIMED_OUT.format(seconds=COMPILE_TIMEOUT_S))
    except (RuntimeError, ValueError) as err:  # a crash, or no JSON on its last line
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
        return _row(opts, verdict=WORKER_FAILED.format(why=lines[-1][:200] if lines else "?"))
    if "unpickle_failed" in out:
        return _row(opts, verdict=f"n/a: {NOT_REBUILT.format(why=out['unpickle_failed'])}")
    if "failed" in out:
        first = str(out["failed"]).strip().splitlines()
        return _row(opts, verdict=f"failed: {first[0][:200] if first else '?'}")
    seconds = float(out["compile_s"])
    dtype = next(ctx.model.parameters()).dtype
    tol = GRAD_TOLERANCE.get(dtype, OTHER_TOLERANCE)
    rel = float(out["grad_max_rel_err"])
    if not rel <= tol:  # NaN too
        return _row(opts, verdict=GRAD_DIFFERS.format(err=rel, tol=tol), compile_seconds=seconds)
    cuda = device.type == "cuda"
    eager, compiled = (
        (out["cuda_peak_eager"], out["cuda_peak"]) if cuda else (out["rss_eager"], out["rss"])
    )
    if eager < (1 if cuda else MIN_RSS_BYTES):
        return _row(opts, verdict=f"n/a: {TOO_SMALL.format(rise=eager)}",
                    compile_seconds=seconds)  # fmt: skip
    peak = baseline + round(step_peak * compiled / eager)
    source = "CUDA-scaled" if cuda else "RSS-scaled"
    verdict = ("fits" if peak <= ctx.budget else "over budget") + f" ({source})"
    return _row(
        opts,
        engine=Compiled(**opts),
        peak=peak,
        verdict=verdict,
        compile_seconds=seconds,
        time_ratio=float(out["t"]) / float(out["t_eager"]),
    )


# -- measuring: the fresh process ----------------------------------------------------------


def main() -> None:
    """The worker: read the payload on stdin, load the step's pickle, run the zoo suite's
    cold compile and its measurements, print one JSON line."""
    payload = json.loads(sys.stdin.read())
    sys.path.extend(p for p in payload.get("sys_path", []) if p not in sys.path)
    torch.set_num_threads(int(payload.get("threads", 1)))
    try:
        saved = torch.load(payload["path"], weights_only=False)
        model, xs, loss_fn = saved["model"], tuple(saved["inputs"]), saved["loss_fn"]
    except Exception as err:  # a class or function not importable here
        print(json.dumps({"unpickle_failed": f"{type(err).__name__}: {str(err)[:300]}"}))
        return
    from ..measure._compile import cold_inductor_cache, compile_costs

    budget, regions = payload.get("budget"), payload.get("regions")
    step = None
    if regions is not None:  # the engine's own step: a copy with each block compiled
        eng = Compiled(activation_memory_budget=budget, regions=regions)

        def step() -> None:
            eng.backward(model, xs, loss_fn)

    try:
        with cold_inductor_cache("leangrad-plan-inductor-"):  # no earlier compile reused
            out = compile_costs(model, xs, loss_fn, budget, int(payload["repeats"]),
                                step=step)  # fmt: skip
    except Exception as err:  # a compile failure is the row's finding
        out = {"failed": failed_verdict(err).removeprefix("failed: ")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
