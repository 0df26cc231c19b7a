"""FSDP2 inside ``fit`` (``parallel="fsdp"``, ``leangrad train --parallel fsdp`` under
torchrun; issue 32): each block :func:`leangrad.blocks` finds, then the root, is
``fully_shard``-ed, so a rank holds 1/N of the parameters, gradients and optimizer state.

Only engines whose backward is the wrapper's own (``wrapped_models``: backprop, whole
steps) train this way; the others refuse, naming the ones that do. Checkpoints hold the
full (unsharded) state, gathered with ``torch.distributed.checkpoint.state_dict`` and
written by rank 0 as every leangrad checkpoint is (atomic, ``weights_only``), so a run
resumes on any number of processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import _errors as errors
from ..engines import Engine

__all__ = ["PARALLEL", "full_state", "load_full_state", "local", "shard"]

PARALLEL = ("ddp", "fsdp")
"""How ``fit`` spreads a step over processes (under torchrun; ignored on one process)."""

BAD_PARALLEL = "parallel must be one of {names}, got {value!r}"
FSDP_ENGINE = (
    "--parallel fsdp trains through FSDP2's own backward, which {engine} does not run "
    "(it would keep each process's gradient shard unreduced); use --engine backprop (or "
    "--budget with --engines backprop) without --step-per-layer, or --parallel ddp"
)


def check_parallel(value: str) -> str:
    if value not in PARALLEL:
        raise errors.OptionError(BAD_PARALLEL.format(names=", ".join(PARALLEL), value=value))
    return value


def shard(model: nn.Module, engine: Engine, *, per_layer: bool) -> None:
    """``fully_shard`` each discovered block of ``model``, then the model itself."""
    from torch.distributed.fsdp import fully_shard

    from ..engines import blocks

    if not engine.wrapped_models or per_layer:
        raise errors.OptionError(FSDP_ENGINE.format(engine=engine.label))
    found, done = blocks(model), set()
    for name in found.names:
        module = found.modules[name]
        if module is model or id(module) in done or not any(True for _ in module.parameters()):
            continue
        done.add(id(module))  # a block registered under two names is sharded once
        fully_shard(module)
    fully_shard(model)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a ``DTensor``), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


State = dict[str, Any]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[State, State]:
    """The model's and optimizer's whole state, gathered from every rank (a collective:
    every rank calls it), on the CPU."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=opts),
            get_optimizer_state_dict(model, optimizer, options=opts))  # fmt: skip


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: Mapping[str, Any], optim_state: Mapping[str, Any]) -> None:  # fmt: skip
    """Shard a whole state (:func:`full_state`) back onto this process's model and
    optimizer (every rank reads the same checkpoint)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, dict(state), options=opts)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=dict(optim_state), options=opts)
