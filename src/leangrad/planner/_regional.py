"""Regional compilation: each of a model's blocks compiled, not the whole model — the
compiled rows ``compile(regions=blocks)`` and ``compile(regions=checkpoint)`` of
``plan(..., compile=True)`` (:mod:`leangrad.planner._compile`).

PyTorch's recipe for a model built of repeated blocks (a transformer's layers, a ResNet's
residual blocks) compiles the block, not the model: dynamo treats the blocks' parameters
as inputs (``inline_inbuilt_nn_modules``), so every block of one class and shape runs the
same compiled graph and a cold compile costs one block's seconds, not the whole model's;
the code between the blocks (embedding, head, loss) runs eagerly. Compiled blocks then
compose with per-block activation checkpointing: each checkpointed block's forward and
its recomputation run the compiled graph.

The blocks are leangrad's own (:func:`leangrad.engines._blocks.blocks`, from the module
tree only: where nothing repeats, the fx split's pieces are each different code, and
compiling them one by one saves no compile time, so there is no regional row). The model
run is a copy that shares the user's tensors, each block replaced by a wrapper that
compiles it on first call — the copy :meth:`leangrad.engines.checkpoint._engine.Checkpoint.
apply_transforms` builds — so the user's module is never modified:

- ``"blocks"``: that copy run under plain autograd (backprop with compiled blocks);
- ``"checkpoint"``: that copy run by leangrad's ``checkpoint`` engine (each block
  checkpointed, non-reentrant; the last of a sequence kept, as ``checkpoint`` does), whose
  recomputation composes with compiled blocks: the gradients match autograd's up to
  inductor's float reassociation (tests/test_plan_regional.py checks float64).

Reference: PyTorch tutorial "Reducing torch.compile cold start compilation time with
regional compilation" (``torch.compile`` of the repeated ``nn.Module``, PyTorch 2.5+).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .. import _errors as errors
from ..engines import Engine
from ..engines._backprop import grad_hooks
from ..engines._base import LossFn, OnGrad, StepResult, forward_loss
from ..engines._blocks import blocks
from ..engines._prepare import PreparedCache, Wrapper
from ..engines.checkpoint._engine import Checkpoint

__all__ = ["REGIONS", "CompiledBlock", "Regional", "regions_why"]

REGIONS = ("blocks", "checkpoint")
"""What each block compiled runs under: plain autograd, or leangrad's ``checkpoint``."""

BAD_REGIONS = "compile: regions must be None, 'blocks' or 'checkpoint', got {value!r}"
NO_REGIONS = (
    "regional compilation compiles each of the model's repeated blocks once for all, and "
    "{why}"
)


def regions_why(model: nn.Module) -> str | None:
    """Why ``model`` has no blocks to compile one by one (``None``: it has): leangrad's
    block finder, on the module tree only (an fx split's pieces are all different code)."""
    try:
        blocks(model, graph=False)
    except errors.LeangradError as err:
        return NO_REGIONS.format(why=str(err))
    return None


class CompiledBlock(Wrapper):
    """A block of a prepared copy, run as ``torch.compile(block)``, compiled on its first
    call (dynamo reuses one graph for blocks of the same code, shapes and guards). The
    compiled module is not registered (the block's tensors are the wrapper's through
    ``inner``) and not copied with the wrapper: a copy compiles its own block."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run: Callable[..., Any] | None = self.__dict__.get("_compiled")
        if run is None:
            run = self.__dict__["_compiled"] = torch.compile(self.inner)
        return run(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        state = dict(state)
        state.pop("_compiled", None)
        return state


def _compile_block(name: str, block: nn.Module) -> nn.Module:
    del name
    return CompiledBlock(block)


class Regional:
    """The regional step of :class:`leangrad.planner._compile.Compiled` for one ``regions``
    setting: the prepared copy with compiled blocks, made once per model (again when its
    modules, parameters or modes change), run under autograd or ``checkpoint``."""

    def __init__(self, regions: str) -> None:
        if regions not in REGIONS:
            raise ValueError(BAD_REGIONS.format(value=regions))
        self.regions = regions
        self._prepared: PreparedCache[tuple[nn.Module, Engine, bool]] = PreparedCache()

    def prepared(self, model: nn.Module) -> tuple[nn.Module, Engine, bool]:
        """``(copy, checkpoint runner, sequential)``: the copy of ``model`` with each block
        a :class:`CompiledBlock` (a sequence of them where ``model`` is its blocks run one
        after another), and the ``checkpoint`` engine that runs it."""
        return self._prepared.get(model, self._prepare)

    @staticmethod
    def _prepare(model: nn.Module) -> tuple[nn.Module, Engine, bool]:
        if (why := regions_why(model)) is not None:
            raise errors.EngineInputError(why)
        new, runner = Checkpoint().apply_transforms(model, _compile_block)
        return new, runner, blocks(model).sequential

    def backward(self, label: str, model: nn.Module, inputs: tuple[torch.Tensor, ...],
                 loss_fn: LossFn, params: Mapping[str, nn.Parameter],
                 on_grad: OnGrad | None) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
        """The step's loss and info; ``.grad`` lands on ``model``'s tensors (the copy
        shares them), ``on_grad`` is called under ``model``'s parameter names."""
        new, runner, sequential = self.prepared(model)
        if self.regions == "checkpoint":
            # on_grad is the engine's GradAnnouncer: it names parameters by identity
            result: StepResult = runner.backward(new, inputs, loss_fn, on_grad=on_grad)
            return result.loss, dict(result.info)
        run: Callable[..., Any] = _in_sequence(new) if sequential else new
        loss = forward_loss(label, run, inputs, loss_fn)
        with grad_hooks(params, on_grad):
            loss.backward()
        return loss, {}


def _in_sequence(seq: nn.Module) -> Callable[..., Any]:
    """A sequence of blocks run as ``checkpoint`` runs one: the first takes the inputs
    unpacked, every later one the previous output whole (as ``nn.Sequential`` does)."""
    mods = list(seq.children())

    def run(*xs: Any) -> Any:
        out: Any = mods[0](*xs)
        for block in mods[1:]:
            out = block(out)
        return out

    return run
