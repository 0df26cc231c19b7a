"""The settings and results of a training run, and the errors :func:`fit` raises."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from .. import _errors as errors
from ._perlayer import GradMemory

__all__ = ["EXACT_KEYS", "FitResult", "NonFiniteLossError", "TrainConfig"]

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

PRECISIONS = {"float32": None, "bf16": "bfloat16", "fp16": "float16"}
"""``--precision`` -> the autocast dtype's name (``None``: no autocast)."""
BAD_PRECISION = "precision must be one of {names}, got {value!r}"

EXACT_KEYS = ("model", "model_options", "data", "data_options", "engine", "engine_options",
              "batch_size", "lr", "optimizer", "seed", "step_per_layer", "dtype",
              "test_fraction", "world_size")  # fmt: skip
"""Config entries a resumed run must share with its checkpoint to continue bit-exactly."""


class NonFiniteLossError(errors.LeangradError, FloatingPointError):
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
    parallel: str = "ddp"
    """Under several processes: ``"ddp"`` (DDP for backprop, averaging for the others) or
    ``"fsdp"`` (FSDP2: parameters, gradients and optimizer state sharded; backprop only)."""
    precision: str = "float32"
    """``"float32"`` (the parameters' own dtype), or ``"bf16"``/``"fp16"``: each step runs
    under ``torch.autocast`` with that dtype (:data:`PRECISIONS`)."""
    plan: str | None = None
    """The saved plan the engine came from (``fit(plan=...)``, ``train --plan``): a record,
    not read again on resume (the engine and its options above are)."""


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
