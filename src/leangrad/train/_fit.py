"""``fit``: a plain training loop over any engine, with checkpoints, resume and DDP.

The loop is what ``leangrad train`` runs. Each step hands a batch to
``engine.backward`` (DESIGN.md, "The mental model") and steps the optimizer —
after backward, or per parameter inside ``on_grad`` (``step_per_layer``,
Moonwalk v1 Algorithm 1). Everything a step depends on — weights, optimizer
state, every RNG, the position in the data order — is in the checkpoint, so a
run resumed from step s ends with the same weights, bit for bit, as one that
was never stopped (same machine, same thread count).

A run directory holds one run: a fresh run into a directory that holds another
run's checkpoints or metrics is refused (``resume=`` continues that run,
``overwrite=True`` deletes it first). A checkpoint is written only when every
weight, buffer and optimizer state tensor is finite, so the newest checkpoint is
always a good one to resume from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import _errors as errors
from .._sizes import fmt_bytes
from .._step import MakeReducer, Step
from ..data import Dataset
from ..engines import Engine
from ..measure import MemoryTracker
from ..planner._parallel import check_parallel
from ..planner._plan import Plan
from . import _distributed as distributed
from . import _sharded as sharded
from . import _snapshot as snapshot
from ._buckets import GradBuckets
from ._config import (
    BAD_OPTIMIZER,
    BATCH_TOO_BIG,
    EXACT_KEYS,
    NO_CHECKPOINT_YET,
    NON_FINITE,
    RESUME_MISMATCH,
    UNSUPPORTED,
    FitResult,
    NonFiniteLossError,
    TrainConfig,
)
from ._metrics import MetricsWriter, plot_metrics
from ._perlayer import GradMemory, PerLayerOptimizer, grad_memory_of_plan, measure_grad_memory
from ._registry import build_model, data_info, load_data

__all__ = ["FitResult", "NonFiniteLossError", "TrainConfig", "evaluate", "fit"]

BAD_SETTING = "{name} must be {want}, got {value!r}"
_CHOOSES_ENGINE = (
    "{flag}= chooses the engine and its options; do not also give engine options "
    "({{options}}): drop --engine-opt, or drop --{flag} and name the engine"
)
BUDGET_AND_ENGINE = _CHOOSES_ENGINE.format(flag="budget")
PLAN_AND_ENGINE = _CHOOSES_ENGINE.format(flag="plan")
PLAN_AND_BUDGET = (
    "plan= trains with a saved plan's engine and budget= plans one now; give one of them"
)
PLAN_FITS_NOTHING = "{path}: the plan chose no engine ({message}); plan again with a larger budget"
NON_FINITE_STATE = (
    "weights or optimizer state are not finite after the update of step {step}: NaN/Inf in "
    "{names} (the loss before that update was {loss}); training stopped and this step was "
    "not saved. Last good checkpoint (kept): {last}. Lower the learning rate (--lr / lr=, now "
    "{lr}) and start the run again (--overwrite, or another --out): --resume keeps the "
    "checkpoint's learning rate"
)


NOT_LOGITS = (
    "the model returned {type}, and training reads a tensor of logits from it: a tensor, "
    "a tuple whose first item is one, or an output with .logits (Hugging Face "
    "transformers' ModelOutput); return the logits from the factory's model (wrap it), or "
    "train it from Python with your own loss_fn"
)


def logits_of(out: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor as is, ``out.logits`` or ``out["logits"]``
    (Hugging Face ``ModelOutput``), or the first item of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    found = getattr(out, "logits", None)
    if found is None and isinstance(out, Mapping):
        found = out.get("logits")
    if found is None and isinstance(out, (tuple, list)) and out:
        found = out[0]
    if not isinstance(found, torch.Tensor):
        raise errors.EngineInputError(NOT_LOGITS.format(type=type(out).__name__))
    return found


def _loss_fn(y: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """Cross-entropy over classes (N, C) or over every position of sequences (N, T, V),
    declared a mean over examples (every example has as many positions), so a plan may
    accumulate gradients over micro-batches (:func:`leangrad.loss.per_example`)."""
    from ..loss import per_example

    return per_example(_cross_entropy, y)


def _cross_entropy(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = logits_of(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, batch: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (per position for sequences) over ``ds``."""
    was = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in ds.batches(batch, shuffle=False):
        out = logits_of(model(x))
        out = out.reshape(-1, out.shape[-1])
        loss_sum += F.cross_entropy(out, y.reshape(-1), reduction="sum").item()
        correct += int((out.argmax(1) == y.reshape(-1)).sum().item())
        count += y.numel()
    model.train(was)
    return loss_sum / count, correct / count


def _make_optimizer(
    name: str, lr: float
) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    if name not in ("adam", "sgd"):
        raise ValueError(BAD_OPTIMIZER.format(value=name))

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if name == "adam":
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr)

    return make


def _device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


SYNC_EVERY = 8
"""Under several processes, steps whose losses one collective averages (with the stop
request): one small all-reduce per step that every process waits for cost 7% of a 17 ms
DDP step on 2 CPU processes (``results/distributed/ddp_step_time.py``)."""


@dataclasses.dataclass(frozen=True)
class _Done:
    """A finished step whose loss is not averaged over processes yet."""

    step: int  # 1-based: the step count after it
    epoch: int
    batch: int  # its batch's index within the epoch
    loss: torch.Tensor  # this process's
    rate: float  # examples per second so far


class _Interrupt:
    """SIGINT sets a flag the loop checks after each step; a second one raises."""

    def __init__(self, enabled: bool) -> None:
        self.hit = False
        self.old: Any = None
        self.enabled = enabled

    def __enter__(self) -> _Interrupt:
        if self.enabled:
            try:
                self.old = signal.signal(signal.SIGINT, self._handle)
            except ValueError:  # not the main thread
                self.enabled = False
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self.old)


def fit(
    model: str | nn.Module = "mlp",
    data: str | Dataset = "digits",
    *,
    engine: str = "backprop",
    engine_options: Mapping[str, Any] | None = None,
    model_options: Mapping[str, Any] | None = None,
    data_options: Mapping[str, Any] | None = None,
    epochs: int = 1,
    batch_size: int = 64,
    lr: float = 1e-2,
    optimizer: str = "adam",
    seed: int = 0,
    out: str | Path | None = None,
    step_per_layer: bool = False,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    resume: str | Path | None = None,
    overwrite: bool = False,
    budget: int | str | None = None,
    plan_engines: Sequence[str] | None = None,
    plan: Plan | str | Path | None = None,
    max_steps: int | None = None,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    precision: str = "float32",
    parallel: str = "ddp",
    test_fraction: float = 0.2,
    track_memory_every: int = 50,
    progress: bool = True,
    plots: bool = True,
    handle_sigint: bool = True,
    measure_saving: bool = True,
) -> FitResult:
    """Train ``model`` on ``data`` with any engine.

    Args:
        model: a registered name (``train.model_names()``), ``"module:factory"``, or a module.
        data: a registered name (``train.data_names()``), ``"text:PATH"``,
            ``"module:factory"``, or a :class:`leangrad.data.Dataset`.
        engine: an engine name (``leangrad.available()``), with ``engine_options``.
        model_options, data_options: keywords of the model factory / data loader.
        epochs, batch_size, lr, optimizer (``"adam"``/``"sgd"``), seed: the usual;
            ``batch_size`` is per process under torchrun (as with DDP). The default lr
            (0.01) suits the small registered models, which learn slowly at Adam's
            customary 0.001 within an epoch of digits.
        out: run directory for metrics.jsonl, checkpoints/ and plots (None: nothing written).
        step_per_layer: step each parameter's optimizer inside ``on_grad`` and free its
            gradient at once; the saving is measured first (``FitResult.grad_memory``).
        checkpoint_every: write a checkpoint every this many steps (and always at the end
            and on SIGINT when ``out`` is set); the newest ``keep_checkpoints`` are kept.
        resume: a checkpoint file or run directory to continue from, bit-exactly. With
            ``out``, ``out`` must be that run's directory, or hold no run.
        overwrite: ``out`` may hold an earlier run: delete its checkpoints, temp files,
            metrics, run.json and plot first (nothing else). Without it a fresh run into a
            directory holding another run's checkpoints or metrics is refused. Not
            with ``resume``; ignored without ``out``.
        budget: plan the step instead of naming an engine: :func:`leangrad.plan` measures
            the engines that apply to the model on a batch of the training data and the
            run uses the fastest exact one whose memory (parameters, inputs and the step's
            peak; optimizer state not included) fits, e.g. ``"64MiB"``, with the
            optimizer stepped after backward or per layer (which then turns
            ``step_per_layer`` on); the plan's table is printed and the chosen engine is
            stored in the run's config (a resumed run keeps it). Not with
            ``engine_options``.
        plan_engines: with ``budget``, the engines the plan may choose from (names as
            for :func:`leangrad.engine`, e.g. ``["backprop", "checkpoint+fad"]``; default:
            every one that applies), e.g. to leave out one that is slow on the model.
        plan: train with a plan's engine instead of naming one: a :class:`leangrad.Plan`
            or the path of one it saved (``Plan.save``, ``leangrad plan --save``). It must
            have been made for this model (class and parameters, in ``dtype``), a batch of
            ``batch_size`` of this data, and this device type, else it is refused
            (``EngineInputError``); a per-layer plan turns ``step_per_layer`` on. The
            engine is stored in the run's config with the plan's path (a resumed run keeps
            the engine and does not read the plan again). Not with ``budget`` or
            ``engine_options``.
        max_steps: stop after this many steps in total.
        device, dtype: where and in which float type to train (default: CUDA if present).
        precision: ``"float32"`` (no autocast), ``"bf16"`` or ``"fp16"``: every step runs
            under ``torch.autocast`` with that dtype, and ``budget=`` plans under it;
            engines not checked under autocast refuse, naming why.
        test_fraction: share of the data held out for per-epoch test loss/accuracy.
        track_memory_every: measure a step's peak memory with the tracker every this
            many steps (0: never).
        progress, plots, handle_sigint: progress bar; plots at the end; SIGINT writes a
            checkpoint and returns with ``stopped == "interrupted"``.
        measure_saving: with ``step_per_layer``, measure the gradient-memory saving on
            copies of the model before the first step (needs room for a second copy).

    Returns:
        A :class:`FitResult`.

    Raises:
        NonFiniteLossError: the loss became NaN/Inf, or an update made the weights (or the
            optimizer state) NaN/Inf; the message gives the step and the last good
            checkpoint, which is kept. Nothing non-finite is ever saved.
        CheckpointError: the resume checkpoint is corrupt, foreign, for another model, or
            holds NaN/Inf.
        RunDirectoryError: ``out`` holds another run (give ``resume`` or ``overwrite``),
            or ``resume`` and ``overwrite`` are both given.

    The finiteness of the weights is checked where a checkpoint is due (every
    ``checkpoint_every`` steps, the last step, SIGINT) — one ``isfinite(t).all()``
    per tensor and one sync, before the step's metrics are written — and not after
    every step: on the registered MLP at batch 32 (a 0.6 ms step on one CPU thread) that
    check costs 35-65 us, 6-11% of the step, over the 2% worth paying for it.
    Between checkpoints a NaN/Inf weight makes the next step's loss NaN, which stops the
    run as a non-finite loss does; either way nothing non-finite is saved.
    """
    _check_settings(epochs=epochs, batch_size=batch_size, max_steps=max_steps,
                    checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                    track_memory_every=track_memory_every, test_fraction=test_fraction,
                    lr=lr, precision=precision, parallel=parallel,
                    resume=resume is not None, overwrite=overwrite,
                    plan_and_budget=plan is not None and budget is not None and resume is None,
                    )  # fmt: skip
    dev = _device(device)
    ctx = distributed.init_distributed(dev)
    if out is not None:
        _claim_run_dir(Path(out), resume=resume, overwrite=overwrite, ctx=ctx)
    cfg = TrainConfig(
        model=model if isinstance(model, str) else f"<{type(model).__name__}>",
        data=data if isinstance(data, str) else f"<{data.name}>",
        engine=engine, engine_options=dict(engine_options or {}),
        model_options=dict(model_options or {}), data_options=dict(data_options or {}),
        epochs=epochs, batch_size=batch_size, lr=lr, optimizer=optimizer, seed=seed,
        step_per_layer=step_per_layer, checkpoint_every=checkpoint_every,
        max_steps=max_steps, dtype=dtype, precision=precision, test_fraction=test_fraction,
        parallel=parallel,
        world_size=ctx.world_size,
        plan=None if plan is None else "<Plan>" if isinstance(plan, Plan) else str(plan),
    )  # fmt: skip
    run = _new_run(cfg, model, data, dev, ctx, budget=None if resume is not None else budget,
                   plan=None if resume is not None else plan, plan_engines=plan_engines,
                   progress=progress)  # fmt: skip
    if resume is not None:
        run.resume(resume)
    else:
        if not run.sharded:  # (a sharded model was broadcast before sharding)
            distributed.broadcast_parameters(run.net, ctx)
        distributed.seed_per_rank(seed, ctx)  # dropout, RAD: each rank its own samples
    if out is not None:
        run.open(Path(out), keep_checkpoints, resumed=resume is not None)
    with _Interrupt(handle_sigint) as interrupt:
        run.loop(interrupt, progress=progress, track_every=track_memory_every,
                 measure_saving=measure_saving)  # fmt: skip
    return run.finish(plots=plots)


def _new_run(cfg: TrainConfig, model: str | nn.Module, data: str | Dataset,
             dev: torch.device, ctx: distributed.DistContext, *, budget: int | str | None,
             plan: Plan | str | Path | None, plan_engines: Sequence[str] | None,
             progress: bool) -> _Run:  # fmt: skip
    """The run: its data and model built (from ``cfg.seed``), its engine named, planned
    within ``budget`` or taken from ``plan`` (``cfg`` then records it)."""
    torch.manual_seed(cfg.seed)
    ds = load_data(data, **cfg.data_options) if isinstance(data, str) else data
    net = model
    if isinstance(model, str):
        net = build_model(model, data_info(cfg.data, ds), **cfg.model_options)
    planned: Engine | None = None  # the engine object a plan measured, trained as it is
    saving: GradMemory | None = None  # what its per-layer steps save, as the plan measured
    if budget is not None:
        cfg, planned, saving = _planned(cfg, net, ds, dev, budget,  # type: ignore[arg-type]
                                        progress=progress, engines=plan_engines,
                                        ctx=ctx)  # fmt: skip
    if plan is not None:
        cfg, planned = _from_plan(cfg, net, ds, dev, plan)  # type: ignore[arg-type]
    run = _Run(cfg, net, ds, dev, ctx, engine=planned)  # type: ignore[arg-type]
    run.grad_memory = saving
    return run


def _checked_engine(cfg: TrainConfig, net: nn.Module, engine: Engine | None) -> Engine:
    """A plan's measured ``engine`` as it is, else one built from the config; refused
    (naming why) where an option value or the model is not the engine's."""
    try:
        made = engine if engine is not None else _engine_for(cfg.engine, cfg.engine_options)
    except (ValueError, TypeError) as err:  # an option value the engine refuses
        if isinstance(err, errors.LeangradError):
            raise
        raise errors.OptionError(f"--engine-opt (engine {cfg.engine!r}): {err}") from None
    if (reason := made.supports(net)) is not None:
        raise errors.EngineInputError(UNSUPPORTED.format(engine=made.label, model=cfg.model,
                                                    reason=reason))  # fmt: skip
    return made


def _check_settings(*, epochs: int, batch_size: int, max_steps: int | None,
                    checkpoint_every: int | None, keep_checkpoints: int,
                    track_memory_every: int, test_fraction: float, lr: float, precision: str,
                    parallel: str, resume: bool, overwrite: bool,
                    plan_and_budget: bool) -> None:  # fmt: skip
    """Settings that make no sense are refused before anything runs (not run as no-ops)."""
    at_least_1 = {"epochs": epochs, "batch_size": batch_size, "keep_checkpoints": keep_checkpoints,
                  "max_steps": max_steps, "checkpoint_every": checkpoint_every}  # fmt: skip
    for name, value in at_least_1.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise errors.OptionError(BAD_SETTING.format(name=name, value=value, want="an int >= 1"))
    if isinstance(track_memory_every, bool) or not isinstance(track_memory_every, int) or \
            track_memory_every < 0:  # fmt: skip
        raise errors.OptionError(BAD_SETTING.format(name="track_memory_every",
                                               value=track_memory_every, want="an int >= 0"))
    if not 0 <= test_fraction < 1:
        raise errors.OptionError(BAD_SETTING.format(name="test_fraction", value=test_fraction,
                                               want="a share in [0, 1)"))
    if not (math.isfinite(lr) and lr > 0):
        raise errors.OptionError(
            BAD_SETTING.format(name="lr", value=lr, want="a finite number > 0")
        )
    autocast_dtype(precision)  # a bad precision is refused before any work
    check_parallel(parallel)
    if resume and overwrite:
        raise snapshot.RunDirectoryError(snapshot.RESUME_AND_OVERWRITE)
    if plan_and_budget:
        raise errors.OptionError(PLAN_AND_BUDGET)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (``None`` for float32), or a one-line refusal."""
    from ._config import BAD_PRECISION, PRECISIONS

    if precision not in PRECISIONS:
        raise errors.OptionError(BAD_PRECISION.format(names=", ".join(PRECISIONS),
                                                      value=precision))  # fmt: skip
    name = PRECISIONS[precision]
    return None if name is None else getattr(torch, name)


def _planned(cfg: TrainConfig, net: nn.Module, ds: Dataset, dev: torch.device,
             budget: int | str, *, progress: bool, engines: Sequence[str] | None = None,
             ctx: distributed.DistContext | None = None,
             ) -> tuple[TrainConfig, Engine | None, GradMemory | None]:  # fmt: skip
    """``cfg`` with the engine :func:`leangrad.plan` chooses for ``budget`` (printed), the
    engine object the plan measured (``None`` where this rank builds it by name), and
    what its per-layer steps save as the plan measured it (``None``: measured in the run,
    on copies — a whole-model step, or a rank other than 0).

    Under several processes rank 0 plans alone and sends its choice — name, options,
    per-layer stepping — to every rank, so all build the same step (each planning on its
    own could choose differently and leave their collectives mismatched); rank 0 trains
    with the engine it measured, the others with one built by name; a plan that fits
    nothing is refused on every rank."""
    if cfg.engine_options:
        raise errors.EngineInputError(BUDGET_AND_ENGINE.format(options=cfg.engine_options))
    ctx = ctx or distributed.DistContext()
    choice: list[Any] = [None, None]  # (name, options, per-layer), or None and rank 0's refusal
    failed: errors.LeangradError | None = None
    measured: Engine | None = None  # rank 0's: not sent (an engine need not pickle)
    saving: GradMemory | None = None
    if ctx.rank == 0:
        try:
            *sent, measured, saving = _plan_choice(cfg, net, ds, dev, budget,
                                                   progress=progress, engines=engines)  # fmt: skip
            choice[0] = tuple(sent)
        except errors.LeangradError as err:
            failed, choice[1] = err, str(err)
    distributed.broadcast_object(choice, ctx)
    if failed is not None:
        raise failed
    if choice[0] is None:
        raise errors.EngineInputError(str(choice[1]))
    name, options, per_layer = choice[0]
    cfg = dataclasses.replace(cfg, engine=name, engine_options=dict(options),
                              step_per_layer=cfg.step_per_layer or per_layer)  # fmt: skip
    return cfg, measured, saving


def _plan_choice(cfg: TrainConfig, net: nn.Module, ds: Dataset, dev: torch.device,
                 budget: int | str, *, progress: bool,
                 engines: Sequence[str] | None,
                 ) -> tuple[str, dict[str, Any], bool, Engine | None,
                            GradMemory | None]:  # fmt: skip
    """The engine's name, options and per-layer stepping :func:`leangrad.plan` chooses
    (printed), the engine object it measured (``None`` under FSDP2, whose check
    estimates engines by name), and what per-layer steps save where the plan measured
    both ways (:func:`~leangrad.train.grad_memory_of_plan`).

    The plan measures ``net`` as the run will hold it (on ``dev``, in the run's dtype) and
    leaves it as it was: it steps its optimizer on its own deep copy, the only one made.
    The engine's prepared copies are keyed by model, so the run builds its own for ``net``."""
    from .._sizes import parse_bytes
    from ..planner._plan import plan

    limit = parse_bytes(budget) if isinstance(budget, str) else budget
    dtype = getattr(torch, cfg.dtype)
    net.to(device=dev, dtype=dtype)  # as the run will hold it (the run moves it too)
    x = ds.x[: cfg.batch_size].to(dev)
    x = x.to(dtype) if x.is_floating_point() else x
    make = _make_optimizer(cfg.optimizer, cfg.lr)  # the step is planned with its optimizer
    if cfg.parallel == "fsdp" and cfg.world_size > 1:  # the budget is per rank
        from ..planner._ranks import fsdp_budget_check

        name, est = fsdp_budget_check(net, x, _loss_fn(ds.y[: cfg.batch_size].to(dev)),
                                      budget=limit, nproc=cfg.world_size,
                                      optimizer=cfg.optimizer, engines=engines)  # fmt: skip
        print(est if progress else est.summary(limit), flush=True)
        return name, {}, False, None, None
    result = plan(net, x, _loss_fn(ds.y[: cfg.batch_size].to(dev)), budget=limit,
                  optimizer=make, autocast=autocast_dtype(cfg.precision),
                  engines=None if engines is None else [(n, {}) for n in engines])  # fmt: skip
    print(result if progress else result.message, flush=True)
    row = result.chosen
    if row is None:
        raise errors.EngineInputError(result.message)
    return (row.name, dict(row.options), result.per_layer, row.engine,
            grad_memory_of_plan(result, net, x))  # fmt: skip


def _from_plan(cfg: TrainConfig, net: nn.Module, ds: Dataset, dev: torch.device,
               plan: Plan | str | Path) -> tuple[TrainConfig, Engine]:  # fmt: skip
    """``cfg`` with the engine of a saved plan, once it is checked to be made for this
    model (in the run's dtype, on ``dev``) and a batch of this data (printed), and the
    plan's engine object (a loaded plan's, rebuilt from the file)."""
    from ..planner._io import check_made_for

    if cfg.engine_options:
        raise errors.OptionError(PLAN_AND_ENGINE.format(options=cfg.engine_options))
    dtype = getattr(torch, cfg.dtype)
    net.to(device=dev, dtype=dtype)  # as the run will hold it
    x = ds.x[: cfg.batch_size].to(dev)
    x = x.to(dtype) if x.is_floating_point() else x
    source = cfg.plan or "the plan"
    if isinstance(plan, Plan):
        check_made_for(plan.made_for, model=net, inputs=x, source=source)
    else:
        plan = Plan.load(plan, model=net, inputs=x)
    row = plan.chosen
    if row is None or row.engine is None:
        raise errors.EngineInputError(PLAN_FITS_NOTHING.format(path=source,
                                                               message=plan.message))  # fmt: skip
    print(f"plan {source}: {plan.message}", flush=True)
    return dataclasses.replace(cfg, engine=row.name, engine_options=dict(row.options),
                               step_per_layer=cfg.step_per_layer or plan.per_layer), row.engine


def _claim_run_dir(out: Path, *, resume: str | Path | None, overwrite: bool,
                   ctx: distributed.DistContext) -> None:  # fmt: skip
    """Refuse ``out`` when it holds another run (rank 0 decides, every rank raises its
    message), or delete that run first with ``overwrite``."""
    marks = snapshot.run_marks(out) if ctx.rank == 0 else []
    why = None
    if marks and resume is None and not overwrite:
        why = snapshot.RUN_EXISTS.format(dir=out, found=snapshot.describe_marks(marks))
    elif marks and resume is not None:
        src = snapshot.resolve_resume(resume)
        if src.resolve().parent not in (out.resolve(), (out / "checkpoints").resolve()):
            why = snapshot.RESUME_INTO_OTHER_RUN.format(dir=out, path=src,
                                                 found=snapshot.describe_marks(marks))  # fmt: skip
    reason = [why]  # rank 0's, on every rank: all raise (and print once) the same words
    distributed.broadcast_object(reason, ctx)
    if reason[0] is not None:
        raise snapshot.RunDirectoryError(str(reason[0]))
    if marks and overwrite:
        snapshot.remove_run(out)
    distributed.barrier(ctx)


class _Run:
    """The state of one training run and the steps that change it."""

    def __init__(self, cfg: TrainConfig, net: nn.Module, ds: Dataset, dev: torch.device,
                 ctx: distributed.DistContext, *,
                 engine: Engine | None = None) -> None:  # fmt: skip
        dtype = getattr(torch, cfg.dtype)
        self.cfg, self.dev, self.ctx = cfg, dev, ctx
        self.net = net.to(device=dev, dtype=dtype)
        ds = ds.to(dev, dtype if ds.x.is_floating_point() else None)
        frac = cfg.test_fraction
        self.test: Dataset | None
        self.train, self.test = ds.split(1 - frac, seed=cfg.seed) if frac > 0 else (ds, None)
        self.engine = _checked_engine(cfg, self.net, engine)
        self.make_opt = _make_optimizer(cfg.optimizer, cfg.lr)
        self.sharded = ctx.enabled and cfg.parallel == "fsdp"
        if self.sharded:  # rank 0's weights everywhere, then 1/N of them on each rank
            distributed.broadcast_parameters(self.net, ctx)
            sharded.shard(self.net, self.engine, per_layer=cfg.step_per_layer)
        self.params = {n: p for n, p in self.net.named_parameters() if p.requires_grad}
        # an engine whose backward is autograd's trains through PyTorch's DDP (bucketed
        # all-reduce overlapping the backward); the others average after the step
        self.ddp = (distributed.data_parallel(self.net, ctx)
                    if ctx.enabled and not cfg.step_per_layer and self.engine.wrapped_models
                    and self.engine.wrapped_why(self.net, "DistributedDataParallel") is None
                    and not self.sharded
                    else None)  # fmt: skip
        # the other engines hand each final gradient to on_grad: averaged in buckets whose
        # all-reduces overlap the rest of the backward (then stepped, per layer)
        bucketed = ctx.enabled and self.ddp is None and not self.sharded
        self.stepped: nn.Module = self.ddp or self.net  # what the engine runs
        self.train_step = Step(self.engine, self.make_opt, per_layer=cfg.step_per_layer,
                            autocast=autocast_dtype(cfg.precision),
                            reduce=_buckets(ctx) if bucketed else None)  # fmt: skip
        made = self.train_step.optimizer_for(self.stepped)
        self.plo = made if isinstance(made, PerLayerOptimizer) else None
        self.opt = made if isinstance(made, torch.optim.Optimizer) else None
        self.per_step = cfg.batch_size * ctx.world_size
        self.steps_per_epoch = len(self.train) // self.per_step
        if self.steps_per_epoch < 1:
            msg = BATCH_TOO_BIG.format(batch=cfg.batch_size, world=ctx.world_size,
                                       n=len(self.train))  # fmt: skip
            raise errors.OptionError(msg)
        full = cfg.epochs * self.steps_per_epoch
        self.total = full if cfg.max_steps is None else min(cfg.max_steps, full)
        self.step = self.epoch = self.batch = 0
        self.lead = ctx.rank == 0
        self.out: Path | None = None
        self.ckpt_dir: Path | None = None
        self.keep = 3
        self.metrics: MetricsWriter | None = None
        self.last_ckpt: Path | None = None  # the newest checkpoint, finite by construction
        self.stopped = "completed"
        self.final_loss: float | None = None
        self.test_loss: float | None = None
        self.test_acc: float | None = None
        self.peak: int | None = None
        self.grad_memory: GradMemory | None = None
        self.examples, self.seconds = 0, 0.0

    @property
    def _optimizer(self) -> Any:
        return self.plo if self.plo is not None else self.opt

    # -- checkpoints ---------------------------------------------------------------
    def resume(self, where: str | Path) -> None:
        """Load a checkpoint: weights, optimizer, position and every RNG state.

        A single-file checkpoint (``step-N.pt``) or a sharded one (``step-N.dcp/``, written
        under ``parallel="fsdp"``: :func:`sharded.load_sharded` reads this process's part)
        resumes on any number of processes, sharded or not, when the global batch
        (``batch_size`` x processes) is the checkpoint's: the run then sees the same
        examples in each step, bit-exactly on the same number of processes, within
        rounding on another (the batch is split differently)."""
        path = snapshot.resolve_resume(where)
        payload = snapshot.load_checkpoint(path, map_location=self.dev)  # (.dcp: side file)
        snapshot.check_fingerprint(payload, self.net, path)
        saved, cfg = payload["config"], self.cfg
        per_run = ("batch_size", "world_size")  # compared as their product, the global batch
        diffs = [f"{k}: {saved.get(k)!r} there, {getattr(cfg, k)!r} here" for k in EXACT_KEYS
                 if k not in per_run and saved.get(k) != getattr(cfg, k)]  # fmt: skip
        there = (saved.get("batch_size"), saved.get("world_size", 1))
        if there[0] is None or there[0] * there[1] != cfg.batch_size * cfg.world_size:
            diffs.append(f"global batch (batch_size x processes): {there[0]} x {there[1]} "
                         f"there, {cfg.batch_size} x {cfg.world_size} here")  # fmt: skip
        if diffs:
            msg = RESUME_MISMATCH.format(path=path, diffs="; ".join(diffs))
            raise snapshot.CheckpointError(msg)
        if snapshot.is_sharded_checkpoint(path):  # checks checksums and finiteness itself
            sharded.load_sharded(path, self.net, self._optimizer, payload, self.ctx)
        else:
            snapshot.check_finite(payload, path)
            if self.sharded:
                sharded.load_full_state(self.net, self._optimizer, payload["model"],
                                        payload["optimizer"])  # fmt: skip
            else:
                self.net.load_state_dict(payload["model"])
                optim = payload["optimizer"]
                if self.opt is not None:  # (a sharded run's is keyed by parameter name)
                    optim = sharded.optimizer_state_keyed(self.net, self.opt, optim,
                                                          by_name=False)  # fmt: skip
                self._optimizer.load_state_dict(optim)
        self.step, self.epoch, self.batch = payload["step"], payload["epoch"], payload["batch"]
        self.last_ckpt = path
        snapshot.load_engine_state(self.engine, payload)
        ranks = payload.get("rng_ranks") or []
        if len(ranks) == self.ctx.world_size:  # each rank continues its own stream
            snapshot.set_rng_state(ranks[self.ctx.rank])
        else:  # saved by another number of processes (or before per-rank streams)
            snapshot.set_rng_state(payload["rng"])
            distributed.seed_per_rank(self.cfg.seed + self.step, self.ctx)

    def open(self, out: Path, keep: int, *, resumed: bool) -> None:
        """Start writing into the run directory (rank 0 writes, every rank checkpoints).
        ``fit`` has made sure it holds no other run."""
        self.out, self.ckpt_dir, self.keep = out, out / "checkpoints", keep
        if not self.lead:
            return
        out.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(self.cfg)
        (out / "run.json").write_text(json.dumps(config, indent=2, default=str))
        self.metrics = MetricsWriter(out / "metrics.jsonl",
                                     resume_step=self.step if resumed else None)  # fmt: skip
        self.metrics.write(kind="event", step=self.step, event="resume" if resumed else "start",
                           config=config, device=str(self.dev))  # fmt: skip

    def save(self) -> None:
        """Check the state is finite (else raise), write a checkpoint of it, then wait for
        every rank. Without a run directory, only the check.

        Rank 0 writes ``step-N.pt``; a sharded run (``parallel="fsdp"``) writes
        ``step-N.dcp/`` instead, each rank its own shards (:func:`sharded.save_sharded`),
        nothing gathered. A step already saved (the loop's end asks again) is not rewritten.
        """
        self._check_finite(self.step, self.final_loss, optimizer=True)
        if self.ckpt_dir is None:
            return
        path = self.ckpt_dir / snapshot.checkpoint_name(self.step, sharded=self.sharded)
        if self.last_ckpt is not None and _same(self.last_ckpt, path):
            return  # (the same on every rank)
        rngs = distributed.gather_object(snapshot.rng_state(), self.ctx)  # every rank's stream
        state = {
            "step": self.step, "epoch": self.epoch, "batch": self.batch,
            "config": dataclasses.asdict(self.cfg),
            "fingerprint": snapshot.model_fingerprint(self.net),
            "rng": rngs[0], "rng_ranks": rngs, "engine_state": self.engine.state_dict(),
        }  # fmt: skip
        if self.sharded:  # all ranks write
            sharded.save_sharded(path, self.net, self._optimizer, state, self.ctx)
        elif self.lead:
            state.update(model=self.net.state_dict(), optimizer=self._optimizer.state_dict())
            snapshot.save_checkpoint(path, state)
        if self.lead:
            snapshot.prune(self.ckpt_dir, self.keep)
        self.last_ckpt = path  # on every rank, so all take the same branches after the loop
        distributed.barrier(self.ctx)

    def _state_tensors(self, *, optimizer: bool) -> list[tuple[str, torch.Tensor]]:
        """The weights and buffers by name, and the optimizer state if asked."""
        named = [(n, sharded.local(t)) for n, t in
                 [*self.net.named_parameters(), *self.net.named_buffers()]]  # fmt: skip
        if optimizer:
            name = {id(p): n for n, p in self.params.items()}
            opts = self.plo.optimizers.values() if self.plo is not None else [self.opt]
            states = [(name.get(id(p), "?"), st) for o in opts
                      for p, st in o.state.items()]  # type: ignore[union-attr]  # fmt: skip
            named += [(f"optimizer state {k} of {n}", sharded.local(t)) for n, st in states
                      for k, t in st.items() if isinstance(t, torch.Tensor)]  # fmt: skip
        return named

    def _check_finite(self, step: int, loss: float | None, *, optimizer: bool) -> None:
        """Raise :class:`NonFiniteLossError` (on every rank) when the weights, buffers or
        (``optimizer``) optimizer state hold NaN/Inf after ``step``."""
        bad = snapshot.non_finite(self._state_tensors(optimizer=optimizer))
        if not distributed.any_process(bool(bad), self.ctx):
            return
        if self.metrics is not None:
            self.metrics.write(kind="event", step=step, event="non-finite weights", where=bad)
            self.metrics.close()
            self.metrics = None
        raise NonFiniteLossError(NON_FINITE_STATE.format(
            step=step, names=_names(bad) or "another process's state", lr=self.cfg.lr,
            loss="n/a" if loss is None else f"{loss:.6g}",
            last=self.last_ckpt or NO_CHECKPOINT_YET))  # fmt: skip

    # -- steps -----------------------------------------------------------------------
    def _batch(self, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's shard of the global batch at the current position."""
        lo = self.batch * self.per_step + self.ctx.rank * self.cfg.batch_size
        idx = order[lo : lo + self.cfg.batch_size].to(self.dev)
        return self.train.x[idx], self.train.y[idx]

    def _update(self, x: torch.Tensor, y: torch.Tensor, track: bool
                ) -> torch.Tensor:  # fmt: skip
        """One optimizer step on (x, y) (:class:`leangrad.train.Step`); returns this
        process's loss."""
        tracker = (MemoryTracker(baseline=(self.net, x, y, _opt_tensors(self._optimizer)))
                   if track else contextlib.nullcontext())  # fmt: skip
        with tracker:
            res = self.train_step.run(self.stepped, x, loss=_loss_fn(y))
        if isinstance(tracker, MemoryTracker):
            rep = tracker.report
            self.peak = max(self.peak or 0, rep.baseline_bytes + rep.peak_bytes)
        return res.loss.detach()

    def _non_finite(self, loss: float, at: _Done) -> NonFiniteLossError:
        if self.metrics is not None:
            self.metrics.write(kind="event", step=at.step, event="non-finite loss")
            self.metrics.close()
            self.metrics = None
        return NonFiniteLossError(NON_FINITE.format(
            loss=loss, step=at.step, epoch=at.epoch, batch=at.batch, lr=self.cfg.lr,
            last=self.last_ckpt or NO_CHECKPOINT_YET))  # fmt: skip

    def _record(self, steps: list[_Done], bar: Any, interrupt: _Interrupt) -> bool:
        """Average the steps' losses over processes with the stop request (one collective),
        refuse a non-finite loss (and non-finite weights where a checkpoint is due), log
        each step; whether any process asked to stop."""
        losses, stop = distributed.mean_and_any(torch.stack([d.loss for d in steps]),
                                                interrupt.hit, self.ctx)  # fmt: skip
        for done, loss_t in zip(steps, losses.tolist(), strict=True):
            loss = float(loss_t)
            if not math.isfinite(loss):
                raise self._non_finite(loss, done)
            if self._checkpoint_due(done.step):  # stop before logging the step
                self._check_finite(done.step, loss, optimizer=False)
            self.final_loss = loss
            if self.metrics is not None:
                self.metrics.write(kind="step", step=done.step, epoch=done.epoch, loss=loss,
                                   examples_per_s=done.rate, peak_bytes=self.peak)  # fmt: skip
            peak = fmt_bytes(self.peak, spec=".1f", missing="?", unit="MiB")
            bar.set_postfix(loss=f"{loss:.4f}", ex_s=f"{done.rate:.0f}", peak=peak,
                            refresh=False)  # fmt: skip
            bar.update()
        return stop

    def _end_epoch(self) -> None:
        if self.test is not None and len(self.test):
            self.test_loss, self.test_acc = evaluate(self.net, self.test)
            if self.metrics is not None:
                self.metrics.write(kind="epoch", step=self.step, epoch=self.epoch,
                                   test_loss=self.test_loss, test_acc=self.test_acc)  # fmt: skip
        self.epoch, self.batch = self.epoch + 1, 0

    def loop(self, interrupt: _Interrupt, *, progress: bool, track_every: int,
             measure_saving: bool) -> None:  # fmt: skip
        """Train until ``total`` steps, SIGINT, or a non-finite loss (raised)."""
        cfg = self.cfg
        bar = tqdm(total=self.total, initial=self.step, disable=not (progress and self.lead),
                   unit="step", desc=f"train {cfg.model} [{self.engine.label}]")  # fmt: skip
        self.net.train()
        start = time.perf_counter()
        held: list[_Done] = []  # steps whose losses are not averaged yet (processes > 1)
        try:
            while self.step < self.total and self.stopped == "completed":
                gen = torch.Generator().manual_seed(cfg.seed + self.epoch)
                order = torch.randperm(len(self.train), generator=gen)  # this epoch's order
                while self.step < self.total and self.batch < self.steps_per_epoch:
                    x, y = self._batch(order)
                    if self.plo is not None and measure_saving and self.grad_memory is None:
                        # on copies; restores the RNG state it used
                        self.grad_memory = measure_grad_memory(
                            self.net, self.engine, x, _loss_fn(y), self.make_opt)
                    track = track_every > 0 and self.step % track_every == 0
                    loss = self._update(x, y, track)
                    self.examples += self.per_step
                    held.append(_Done(self.step + 1, self.epoch, self.batch, loss,
                                      self.examples / (time.perf_counter() - start)))  # fmt: skip
                    self.step, self.batch = self.step + 1, self.batch + 1
                    epoch_done = self.batch == self.steps_per_epoch
                    # Under several processes the losses of SYNC_EVERY steps are averaged
                    # (and the stop request shared) in one collective, or sooner where a
                    # checkpoint or an epoch's end needs them; SIGINT then stops every
                    # process at the same step, up to SYNC_EVERY - 1 steps later.
                    stop = False
                    if (not self.ctx.enabled or len(held) >= SYNC_EVERY or epoch_done
                            or self._checkpoint_due(self.step)):  # fmt: skip
                        stop, held = self._record(held, bar, interrupt), []
                    if epoch_done:
                        self._end_epoch()
                    if stop:  # a process was interrupted (SIGINT) by the end of a step
                        self.stopped = "interrupted"
                        break
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        self.save()
                    if epoch_done:
                        break  # a new epoch: a new order
        finally:
            bar.close()
            self.seconds = time.perf_counter() - start
        if self.stopped != "interrupted" and cfg.max_steps is not None:
            self.stopped = "max_steps" if self.step >= cfg.max_steps else self.stopped
        name = snapshot.checkpoint_name(self.step)
        final = None if self.ckpt_dir is None else self.ckpt_dir / name
        if self.last_ckpt is None or final is None or not _same(self.last_ckpt, final):
            self.save()

    def _checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is written after ``step`` (unless SIGINT comes first)."""
        every = self.cfg.checkpoint_every
        return step >= self.total or bool(every and step % every == 0)

    def finish(self, *, plots: bool) -> FitResult:
        """Close the metrics, draw the plots, and name the result."""
        plot, notes = None, []
        if self.metrics is not None and self.out is not None:
            self.metrics.write(kind="event", step=self.step, event=self.stopped)
            self.metrics.close()
            if plots:
                note = plot_metrics(self.out / "metrics.jsonl", self.out / "training.png")
                if note is None:
                    plot = self.out / "training.png"
                else:
                    notes.append(note)
        secs = self.seconds
        return FitResult(
            model=self.net, config=self.cfg, steps=self.step, stopped=self.stopped,
            final_loss=self.final_loss, test_loss=self.test_loss, test_acc=self.test_acc,
            examples_per_s=self.examples / secs if self.examples and secs > 0 else None,
            peak_bytes=self.peak, grad_memory=self.grad_memory, checkpoint=self.last_ckpt,
            metrics=self.out / "metrics.jsonl" if self.out is not None else None,
            plot=plot, notes=notes,
        )  # fmt: skip


def _buckets(ctx: distributed.DistContext) -> MakeReducer:
    """A :class:`Step`'s ``reduce``: gradients averaged in :class:`GradBuckets`."""
    return lambda then: GradBuckets(ctx, then=then)


def _opt_tensors(opt: Any) -> list[torch.Tensor]:
    """Optimizer state tensors (existing before the step: baseline, not allocations)."""
    if opt is None:
        return []
    opts = opt.optimizers.values() if isinstance(opt, PerLayerOptimizer) else [opt]
    return [t for o in opts for s in o.state.values() for t in s.values()
            if isinstance(t, torch.Tensor)]  # fmt: skip


def _names(names: list[str], most: int = 4) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _engine_for(name: str, options: dict[str, Any]) -> Engine:
    """``leangrad.engine(name, **options)``, or the compiled step a saved plan chose
    (``leangrad plan --compile``: not a registered engine)."""
    from ..planner._io import _rebuild

    return _rebuild(name, options)
