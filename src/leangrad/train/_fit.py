"""``fit``: a plain training loop over any engine, with checkpoints, resume and DDP.

The loop is what ``leangrad train`` runs. Each step hands a batch to
``engine.backward`` (DESIGN.md, "The mental model") and steps the optimizer —
after backward, or per parameter inside ``on_grad`` (``step_per_layer``,
Moonwalk v1 Algorithm 1). Everything a step depends on — weights, optimizer
state, every RNG, the position in the data order — is in the checkpoint, so a
run resumed from step s ends with the same weights, bit for bit, as one that
was never stopped (same machine, same thread count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import _errors as E
from ..data import Dataset
from ..engines import Engine
from ..engines import engine as make_engine
from ..measure import MemoryTracker
from . import _checkpoint as C
from . import _distributed as D
from ._metrics import MetricsWriter, plot_metrics
from ._perlayer import GradMemory, PerLayerOptimizer, measure_grad_memory
from ._registry import build_model, data_info, load_data

__all__ = ["FitResult", "NonFiniteLossError", "TrainConfig", "fit"]

NON_FINITE = (
    "loss is {loss} at step {step} (epoch {epoch}, batch {batch}); training stopped and this "
    "step was not saved. Last good checkpoint: {last}. Lower the learning rate (now {lr}) "
    "or check the data, then resume from that checkpoint"
)
NO_CHECKPOINT_YET = "none written (give out= and checkpoint_every=)"
UNSUPPORTED = "engine {engine!r} cannot train model {model!r}: {reason}"
RESUME_MISMATCH = (
    "cannot resume {path} bit-exactly: {diffs}. Use the checkpoint's settings (leave "
    "these options out with --resume) or start a fresh run"
)
BATCH_TOO_BIG = (
    "batch size {batch} x {world} process(es) is more than the {n} training examples; "
    "lower --batch-size"
)
BAD_OPTIMIZER = "optimizer must be 'adam' or 'sgd', got {value!r}"

EXACT_KEYS = ("model", "model_options", "data", "data_options", "engine", "engine_options",
              "batch_size", "lr", "optimizer", "seed", "step_per_layer", "dtype",
              "test_fraction", "world_size")  # fmt: skip
"""Config entries a resumed run must share with its checkpoint to continue bit-exactly."""


class NonFiniteLossError(E.LeangradError, FloatingPointError):
    """The training loss became NaN or infinite."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run (JSON-serialisable; stored in run.json and checkpoints)."""

    model: str
    data: str
    engine: str
    engine_options: dict[str, Any]
    model_options: dict[str, Any]
    data_options: dict[str, Any]
    epochs: int
    batch_size: int
    lr: float
    optimizer: str
    seed: int
    step_per_layer: bool
    checkpoint_every: int | None
    max_steps: int | None
    dtype: str
    test_fraction: float
    world_size: int


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What :func:`fit` returns.

    Attributes:
        model: the trained model.
        config: the run's settings.
        steps: optimizer steps done in total (including before a resume).
        stopped: ``"completed"``, ``"max_steps"`` or ``"interrupted"`` (SIGINT).
        final_loss: training loss of the last step.
        test_loss, test_acc: on the held-out split after the last full epoch (or None).
        examples_per_s: training throughput of this process's run (all processes).
        peak_bytes: largest tracked step peak incl. baseline (allocator level), or None.
        grad_memory: with ``step_per_layer``, the measured saving (:class:`GradMemory`).
        checkpoint: the last checkpoint written, metrics: the JSONL file, plot: the PNG.
        notes: things the user should know (e.g. plots skipped).
    """

    model: nn.Module
    config: TrainConfig
    steps: int
    stopped: str
    final_loss: float | None
    test_loss: float | None
    test_acc: float | None
    examples_per_s: float | None
    peak_bytes: int | None
    grad_memory: GradMemory | None
    checkpoint: Path | None
    metrics: Path | None
    plot: Path | None
    notes: list[str]


def _loss_fn(y: torch.Tensor):  # type: ignore[no-untyped-def]
    """Cross-entropy over classes (N, C) or over every position of sequences (N, T, V)."""

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return loss_fn


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, batch: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (per position for sequences) over ``ds``."""
    was = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in ds.batches(batch, shuffle=False):
        out = model(x)
        out = out.reshape(-1, out.shape[-1])
        loss_sum += F.cross_entropy(out, y.reshape(-1), reduction="sum").item()
        correct += int((out.argmax(1) == y.reshape(-1)).sum().item())
        count += y.numel()
    model.train(was)
    return loss_sum / count, correct / count


def _make_optimizer(name: str, lr: float):  # type: ignore[no-untyped-def]
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
    lr: float = 1e-3,
    optimizer: str = "adam",
    seed: int = 0,
    out: str | Path | None = None,
    step_per_layer: bool = False,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    resume: str | Path | None = None,
    max_steps: int | None = None,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    test_fraction: float = 0.2,
    track_memory_every: int = 50,
    progress: bool = True,
    plots: bool = True,
    handle_sigint: bool = True,
) -> FitResult:
    """Train ``model`` on ``data`` with any engine.

    Args:
        model: a registered name (``train.model_names()``), ``"module:factory"``, or a module.
        data: a registered name (``train.data_names()``), ``"text:PATH"``,
            ``"module:factory"``, or a :class:`leangrad.data.Dataset`.
        engine: an engine name (``leangrad.available()``), with ``engine_options``.
        model_options, data_options: keywords of the model factory / data loader.
        epochs, batch_size, lr, optimizer (``"adam"``/``"sgd"``), seed: the usual;
            ``batch_size`` is per process under torchrun (as with DDP).
        out: run directory for metrics.jsonl, checkpoints/ and plots (None: nothing written).
        step_per_layer: step each parameter's optimizer inside ``on_grad`` and free its
            gradient at once; the saving is measured first (``FitResult.grad_memory``).
        checkpoint_every: write a checkpoint every this many steps (and always at the end
            and on SIGINT when ``out`` is set); the newest ``keep_checkpoints`` are kept.
        resume: a checkpoint file or run directory to continue from, bit-exactly.
        max_steps: stop after this many steps in total.
        device, dtype: where and in which float type to train (default: CUDA if present).
        test_fraction: share of the data held out for per-epoch test loss/accuracy.
        track_memory_every: measure a step's peak memory with the tracker every this
            many steps (0: never).
        progress, plots, handle_sigint: progress bar; plots at the end; SIGINT writes a
            checkpoint and returns with ``stopped == "interrupted"``.

    Returns:
        A :class:`FitResult`.

    Raises:
        NonFiniteLossError: the loss became NaN/Inf (the message gives the step).
        CheckpointError: the resume checkpoint is corrupt, foreign, or for another model.
    """
    dev = _device(device)
    ctx = D.init_distributed(dev)
    torch_dtype = getattr(torch, dtype)
    make_opt = _make_optimizer(optimizer, lr)
    cfg = TrainConfig(
        model=model if isinstance(model, str) else f"<{type(model).__name__}>",
        data=data if isinstance(data, str) else f"<{data.name}>",
        engine=engine,
        engine_options=dict(engine_options or {}),
        model_options=dict(model_options or {}),
        data_options=dict(data_options or {}),
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        seed=seed,
        step_per_layer=step_per_layer,
        checkpoint_every=checkpoint_every,
        max_steps=max_steps,
        dtype=dtype,
        test_fraction=test_fraction,
        world_size=ctx.world_size,
    )
    torch.manual_seed(seed)
    ds = load_data(data, **cfg.data_options) if isinstance(data, str) else data
    info = data_info(cfg.data, ds)
    net = build_model(model, info, **cfg.model_options) if isinstance(model, str) else model
    net = net.to(device=dev, dtype=torch_dtype)
    ds = ds.to(dev, torch_dtype if ds.x.is_floating_point() else None)
    train, test = ds.split(1 - test_fraction, seed=seed) if test_fraction > 0 else (ds, None)
    eng: Engine = make_engine(engine, **cfg.engine_options)
    if (reason := eng.supports(net)) is not None:
        raise E.EngineInputError(UNSUPPORTED.format(engine=eng.label, model=cfg.model,
                                                    reason=reason))  # fmt: skip
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    plo = PerLayerOptimizer(params, make_opt) if step_per_layer else None
    opt = None if plo is not None else make_opt(list(params.values()))
    per_step = batch_size * ctx.world_size
    steps_per_epoch = len(train) // per_step
    if steps_per_epoch < 1:
        raise ValueError(BATCH_TOO_BIG.format(batch=batch_size, world=ctx.world_size,
                                              n=len(train)))  # fmt: skip

    step, epoch, batch = 0, 0, 0
    payload = None
    if resume is not None:
        path = C.resolve_resume(resume)
        payload = C.load_checkpoint(path, map_location=dev)
        C.check_fingerprint(payload, net, path)
        saved = payload["config"]
        diffs = [f"{k}: {saved.get(k)!r} there, {getattr(cfg, k)!r} here"
                 for k in EXACT_KEYS if saved.get(k) != getattr(cfg, k)]  # fmt: skip
        if diffs:
            raise C.CheckpointError(RESUME_MISMATCH.format(path=path, diffs="; ".join(diffs)))
        net.load_state_dict(payload["model"])
        (plo or opt).load_state_dict(payload["optimizer"])  # type: ignore[union-attr]
        step, epoch, batch = payload["step"], payload["epoch"], payload["batch"]
        C.set_engine_rng_state(eng, payload["engine_rng"])
        C.set_rng_state(payload["rng"])
    else:
        D.broadcast_parameters(net, ctx)

    lead = ctx.rank == 0
    out_dir = Path(out) if out is not None else None
    ckpt_dir = out_dir / "checkpoints" if out_dir is not None else None
    metrics = None
    if out_dir is not None and lead:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "run.json").write_text(_json(dataclasses.asdict(cfg)))
        metrics = MetricsWriter(out_dir / "metrics.jsonl",
                                resume_step=step if payload is not None else None)  # fmt: skip
        metrics.write(kind="event", step=step, event="resume" if payload else "start",
                      config=dataclasses.asdict(cfg), device=str(dev))  # fmt: skip

    total = epochs * steps_per_epoch if max_steps is None else min(max_steps,
                                                                   epochs * steps_per_epoch)
    on_grad = D.averaging_on_grad(ctx, plo.on_grad) if plo is not None else None
    grad_memory: GradMemory | None = None
    notes: list[str] = []
    last_ckpt: Path | None = None
    if ckpt_dir is not None and (found := C.list_checkpoints(ckpt_dir)):
        last_ckpt = found[-1]

    def save() -> None:
        nonlocal last_ckpt
        if ckpt_dir is None:
            return
        if lead:
            state = {
                "step": step, "epoch": epoch, "batch": batch,
                "config": dataclasses.asdict(cfg), "fingerprint": C.model_fingerprint(net),
                "model": net.state_dict(), "optimizer": (plo or opt).state_dict(),  # type: ignore[union-attr]
                "rng": C.rng_state(), "engine_rng": C.engine_rng_state(eng),
            }  # fmt: skip
            last_ckpt = C.save_checkpoint(ckpt_dir / C.checkpoint_name(step), state)
            C.prune(ckpt_dir, keep_checkpoints)
        D.barrier(ctx)

    final_loss = test_loss = test_acc = None
    peak: int | None = None
    stopped = "completed"
    bar = tqdm(total=total, initial=step, disable=not (progress and lead), unit="step",
               desc=f"train {cfg.model} [{eng.label}]")  # fmt: skip
    t_start, examples = time.perf_counter(), 0
    net.train()
    first = True
    with _Interrupt(handle_sigint) as interrupt:
        while step < total:
            gen = torch.Generator().manual_seed(seed + epoch)
            order = torch.randperm(len(train), generator=gen)
            while batch < steps_per_epoch and step < total:
                lo = batch * per_step + ctx.rank * batch_size
                idx = order[lo : lo + batch_size].to(dev)
                x, y = train.x[idx], train.y[idx]
                loss_fn = _loss_fn(y)
                if first:
                    first = False
                    if plo is not None:  # on copies; restores the RNG state it used
                        grad_memory = measure_grad_memory(net, eng, x, loss_fn, make_opt)
                track = track_memory_every > 0 and step % track_memory_every == 0
                tracker = (
                    MemoryTracker(baseline=(net, x, y, _opt_tensors(plo or opt)))
                    if track else contextlib.nullcontext()
                )  # fmt: skip
                with tracker:
                    if opt is not None:
                        opt.zero_grad(set_to_none=True)
                    res = eng.backward(net, x, loss_fn, on_grad=on_grad)
                    if on_grad is not None:  # gradients the engine did not hand over
                        for n, p in params.items():
                            if p.grad is not None:
                                on_grad(n, p)
                    else:
                        D.average_gradients(params.items(), ctx)
                        opt.step()  # type: ignore[union-attr]
                        opt.zero_grad(set_to_none=True)  # type: ignore[union-attr]
                if isinstance(tracker, MemoryTracker):
                    rep = tracker.report
                    peak = max(peak or 0, rep.baseline_bytes + rep.peak_bytes)
                loss = float(D.mean_scalar(res.loss, ctx))
                if not math.isfinite(loss):
                    if metrics is not None:
                        metrics.write(kind="event", step=step + 1, event="non-finite loss")
                        metrics.close()
                    bar.close()
                    raise NonFiniteLossError(NON_FINITE.format(
                        loss=loss, step=step + 1, epoch=epoch, batch=batch, lr=lr,
                        last=last_ckpt or NO_CHECKPOINT_YET))  # fmt: skip
                step, batch, final_loss = step + 1, batch + 1, loss
                examples += per_step
                rate = examples / (time.perf_counter() - t_start)
                if metrics is not None:
                    metrics.write(kind="step", step=step, epoch=epoch, loss=loss,
                                  examples_per_s=rate, peak_bytes=peak)  # fmt: skip
                bar.set_postfix(loss=f"{loss:.4f}", ex_s=f"{rate:.0f}", refresh=False,
                                peak=_mib(peak))  # fmt: skip
                bar.update()
                epoch_done = batch == steps_per_epoch
                if epoch_done:
                    if test is not None and len(test):
                        test_loss, test_acc = evaluate(net, test)
                        if metrics is not None:
                            metrics.write(kind="epoch", step=step, epoch=epoch,
                                          test_loss=test_loss, test_acc=test_acc)  # fmt: skip
                    epoch, batch = epoch + 1, 0
                if D.any_process(interrupt.hit, ctx):
                    stopped = "interrupted"
                    break
                if checkpoint_every and step % checkpoint_every == 0:
                    save()
                if epoch_done:
                    break  # a new epoch: a new order
            if stopped == "interrupted":
                break
        if stopped != "interrupted" and max_steps is not None and step >= max_steps:
            stopped = "max_steps"
        if not (last_ckpt is not None and last_ckpt.name == C.checkpoint_name(step)):
            save()
    bar.close()
    elapsed = time.perf_counter() - t_start
    plot = None
    if metrics is not None and out_dir is not None:
        metrics.write(kind="event", step=step, event=stopped)
        metrics.close()
        if plots:
            note = plot_metrics(out_dir / "metrics.jsonl", out_dir / "training.png")
            if note is None:
                plot = out_dir / "training.png"
            else:
                notes.append(note)
    return FitResult(
        model=net, config=cfg, steps=step, stopped=stopped, final_loss=final_loss,
        test_loss=test_loss, test_acc=test_acc,
        examples_per_s=examples / elapsed if examples and elapsed > 0 else None,
        peak_bytes=peak, grad_memory=grad_memory, checkpoint=last_ckpt,
        metrics=out_dir / "metrics.jsonl" if out_dir is not None else None,
        plot=plot, notes=notes,
    )  # fmt: skip


def _opt_tensors(opt: Any) -> list[torch.Tensor]:
    """Optimizer state tensors (existing before the step: baseline, not allocations)."""
    if opt is None:
        return []
    opts = opt.optimizers.values() if isinstance(opt, PerLayerOptimizer) else [opt]
    return [t for o in opts for s in o.state.values() for t in s.values()
            if isinstance(t, torch.Tensor)]  # fmt: skip


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f}MiB"


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=2, default=str)
