"""leangrad.train: train any model with any engine — ``leangrad train`` as a function.

Quick use::

    from leangrad import train
    result = train.fit("mlp", "digits", engine="backprop", epochs=1, out="run")
    result = train.fit("submersive_cnn", "digits", engine="moonwalk", step_per_layer=True)
    print(result.grad_memory.saving_bytes)

- :func:`fit` — the loop: per-layer optimizer steps, atomic checkpoints, bit-exact
  resume, SIGINT/NaN handling, DDP under torchrun, JSONL metrics and plots;
- :func:`model_names`, :func:`data_names`, :func:`build_model`, :func:`load_data` —
  the registries (plus ``"module:factory"`` specs);
- :func:`save_checkpoint`, :func:`load_checkpoint` — the checkpoint format;
- :func:`measure_grad_memory` — what per-layer steps save, measured
  (:func:`grad_memory_of_plan`: read from a plan that measured both ways);
- :class:`Step` — one training step as a value (engine, optimizer after backward or per
  layer, autocast), what the planner measures;
- :func:`leangrad.plan` (``leangrad plan``) — which engine fits a memory budget, measured.
"""

from .._step import Step
from ._buckets import GradBuckets, average_gradients
from ._config import FitResult, NonFiniteLossError, TrainConfig
from ._distributed import (
    DistContext,
    averaging_on_grad,
    init_distributed,
    seed_per_rank,
)
from ._fit import evaluate, fit
from ._metrics import plot_metrics, read_metrics
from ._perlayer import GradMemory, PerLayerOptimizer, grad_memory_of_plan, measure_grad_memory
from ._registry import DataInfo, build_model, data_names, load_data, model_names, parse_options
from ._snapshot import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "DataInfo",
    "DistContext",
    "FitResult",
    "GradBuckets",
    "GradMemory",
    "NonFiniteLossError",
    "PerLayerOptimizer",
    "Step",
    "TrainConfig",
    "average_gradients",
    "averaging_on_grad",
    "build_model",
    "data_names",
    "evaluate",
    "fit",
    "grad_memory_of_plan",
    "init_distributed",
    "list_checkpoints",
    "load_checkpoint",
    "load_data",
    "measure_grad_memory",
    "model_names",
    "parse_options",
    "plot_metrics",
    "read_metrics",
    "save_checkpoint",
    "seed_per_rank",
]
