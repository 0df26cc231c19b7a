"""What every engine keeps of ``loss.backward()``'s behaviour (issue: "behave like
``loss.backward()``, or say why").

Engines that run part of the model more than once (``checkpoint`` recomputes segments,
``moonwalk`` replays its stem and reruns chain layers, ``revbackprop`` reruns each layer)
must not advance BatchNorm running statistics more than once, must not fire a forward
hook more than once, and must leave the RNG stream where one forward leaves it. The
forward-mode engines must not write gradients of parameters the loss does not use.
This module holds the shared machinery:

- :class:`BufferGuard`: the buffers' state after the *first* forward (marked by
  :func:`forward_end`) is the state a step leaves, whatever reruns did afterwards —
  the same result as ``torch.utils.checkpoint``'s documented advice of not updating
  statistics on recomputation, but for every engine and every buffer.
- :func:`refuse_hooks`: a module an engine reruns may not carry forward hooks (they
  would fire on each rerun); the error names the module and the fix.
- :func:`used_parameters`: which parameters the loss depends on, from autograd's graph
  of one forward on fake tensors (no compute, no RNG draw, no buffer update).
- :func:`batch_coupling`: the first module that mixes examples of a batch (BatchNorm in
  training mode), for engines whose options assume examples are independent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .. import _errors as errors
from ..measure._memory import FORWARD_END, mark
from ._draws import aside
from ._functional import call_with
from ._loss_fn import LossFn, ModelRun, check_loss

__all__ = [
    "HOOK_RERUN",
    "NON_FINITE_INPUT",
    "NO_INPUT_GRADIENTS",
    "BufferGuard",
    "batch_coupling",
    "forward_end",
    "graph_nodes",
    "keep_nothing",
    "random_module",
    "refuse_hooks",
    "used_parameters",
]

HOOK_RERUN = (
    "engine {engine!r} runs {module} more than once per step, so its forward {kind} "
    "would fire more than once (autograd runs it once); remove the hook for training "
    "steps, or use engine 'backprop'"
)
NO_INPUT_GRADIENTS = (
    "engine {engine!r} does not compute input gradients, but input {index} has "
    "requires_grad=True; pass inputs.detach(), or use an engine that does "
    "(backprop, checkpoint, moonwalk, revbackprop, highway)"
)
NON_FINITE_INPUT = (
    "engine {engine!r} cannot reproduce autograd's gradient when input {index} holds NaN "
    "or Inf (forward mode multiplies zero tangents by them, giving NaN where autograd "
    "gives exact zeros); clean the input (e.g. torch.nan_to_num), or use engine 'backprop'"
)
EMPTY_BATCH = (
    "input {index} is empty (shape {shape}): an empty batch has no loss to differentiate; "
    "skip empty batches (e.g. DataLoader(drop_last=True))"
)

_GUARDS: list[BufferGuard] = []


def forward_end() -> None:
    """The engine's forward phase is done: mark it for the memory tracker and fix the
    buffers' post-forward state for every active :class:`BufferGuard`."""
    mark(FORWARD_END)
    for guard in _GUARDS:
        guard.settle()


class BufferGuard:
    """Put back, when the step ends, the buffers' values at the end of the first forward.

    :meth:`settle` (called by :func:`forward_end`) copies the buffers the forward can
    have updated — BatchNorm statistics and counters of modules in training mode, and
    any other buffer whose version counter moved during the forward — and on exit they
    are restored, so whatever reruns did to them afterwards is undone and statistics
    advance exactly once. Constant buffers (masks, tables) are never copied.
    (BatchNorm's kernel updates ``running_mean`` in place without bumping its version,
    hence the explicit list.)
    """

    def __init__(self, model: nn.Module) -> None:
        seen: set[int] = set()
        self.buffers: list[tuple[torch.Tensor, bool]] = []  # (buffer, is BatchNorm state)
        for m in model.modules():
            if not m.training:
                continue
            is_bn = isinstance(m, nn.modules.batchnorm._BatchNorm)
            for b in m.buffers(recurse=False):
                if id(b) not in seen:
                    seen.add(id(b))
                    self.buffers.append((b, is_bn))
        self.versions: list[int] = []
        self.after_forward: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __enter__(self) -> BufferGuard:
        self.versions = [b._version for b, _ in self.buffers]
        _GUARDS.append(self)
        return self

    def settle(self) -> None:
        if self.after_forward is None:
            self.after_forward = [
                (b, b.detach().clone())
                for (b, is_bn), v in zip(self.buffers, self.versions, strict=True)
                if is_bn or b._version != v
            ]

    def __exit__(self, *exc: object) -> None:
        _GUARDS.remove(self)
        if self.after_forward is None:
            return
        with torch.no_grad():
            for b, value in self.after_forward:
                b.copy_(value)


RERUN_SAFE_HOOKS = frozenset({"make_inputs_require_grad", "make_inputs_require_grads"})
"""Forward hooks the libraries register that may fire once per run of their module:
transformers' ``enable_input_require_grads()`` and PEFT's copies of it (which PEFT users
call with gradient checkpointing) set ``output.requires_grad_(True)`` and nothing else, so
a recomputation running them again changes nothing. Recognised by their function's name
*and* the library that defines it (``transformers``, ``peft``); any other hook is the
user's, and refused where it would fire more than once."""


def _rerun_safe(hook: object) -> bool:
    fn = getattr(hook, "__func__", hook)
    module = str(getattr(fn, "__module__", "") or "")
    return (getattr(fn, "__name__", None) in RERUN_SAFE_HOOKS
            and module.split(".")[0] in ("transformers", "peft"))  # fmt: skip


def _hook_kinds(module: nn.Module) -> list[str]:
    kinds = []
    if module._forward_pre_hooks:
        kinds.append("pre-hook")
    if any(not _rerun_safe(h) for h in module._forward_hooks.values()):
        kinds.append("hook")
    return kinds


def refuse_hooks(engine: str, modules: Iterable[tuple[str, nn.Module]]) -> None:
    """Raise if a module the engine reruns (or a global module hook) has forward hooks."""
    from torch.nn.modules import module as module_mod

    if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks:
        raise errors.EngineInputError(
            HOOK_RERUN.format(engine=engine, module="every module", kind="global hook")
        )
    for name, m in modules:
        kinds = _hook_kinds(m)
        if kinds:
            where = f"{type(m).__name__} {name!r}" if name else type(m).__name__
            raise errors.EngineInputError(
                HOOK_RERUN.format(engine=engine, module=where, kind=" and ".join(kinds))
            )


def batch_coupling(module: nn.Module) -> str | None:
    """``"BatchNorm2d 'stem.1'"`` for the first module that mixes the examples of a batch
    (batch normalisation in training mode), else ``None``."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            return f"{type(m).__name__} {name!r}" if name else type(m).__name__
    return None


def random_module(module: nn.Module) -> str | None:
    """The first module that draws random numbers in its forward (dropout in training)."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            return f"{type(m).__name__} {name!r}" if name else type(m).__name__
    return None


def check_batch(xs: tuple[torch.Tensor, ...], model: nn.Module | None = None) -> None:
    """An empty input has no loss to differentiate: refuse it with the fix. A model that
    knows which dimension is empty says so through ``model.explain_empty_input(index, x)``
    (e.g. a time-first recurrent net: the sequence length, not the batch)."""
    for i, x in enumerate(xs):
        if x.numel() == 0:
            explain = getattr(model, "explain_empty_input", None)
            msg = explain(i, x) if callable(explain) else None
            if not isinstance(msg, str):
                msg = EMPTY_BATCH.format(index=i, shape=tuple(x.shape))
            raise errors.EngineInputError(msg)


def refuse_non_finite(engine: str, xs: tuple[torch.Tensor, ...]) -> None:
    """Forward mode multiplies every zero tangent by the activations, so one NaN/Inf
    input turns gradients NaN where autograd has exact zeros (masked entries): refuse."""
    for i, x in enumerate(xs):
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise errors.EngineInputError(NON_FINITE_INPUT.format(engine=engine, index=i))


def refuse_input_grads(engine: str, xs: tuple[torch.Tensor, ...]) -> None:
    for i, x in enumerate(xs):
        if x.requires_grad:
            raise errors.EngineInputError(NO_INPUT_GRADIENTS.format(engine=engine, index=i))


def used_parameters(
    model: nn.Module,
    xs: tuple[torch.Tensor, ...],
    loss_fn: LossFn,
    params: Mapping[str, nn.Parameter],
    run: ModelRun,
    *,
    real: bool = False,
) -> dict[str, nn.Parameter]:
    """The parameters the loss depends on (autograd would give the others no ``.grad``).

    One forward of the model and the loss on fake tensors builds autograd's graph
    without computing, drawing random numbers or touching the real buffers; the
    parameters behind its ``AccumulateGrad`` nodes are the ones used. A model that fake
    tensors cannot run (data-dependent control flow) gets one real forward instead,
    with the RNG forked, nothing saved for backward and every buffer put back afterwards.
    ``real=True`` takes the real forward at once: an engine that runs the model many
    times per step (``forward``: one run per chunk of directions) pays one more run, far
    less than fake tensors' per-operator cost (7.5 ms vs 0.3 ms on a small MLP).

    Raises:
        EngineInputError: the loss depends on no trainable parameter.
    """
    step = _LossForward(model, xs, loss_fn, params, run)
    if real:
        leaves = step.real_leaves()
    else:
        try:
            leaves = step.fake_leaves()
        except errors.LeangradError:
            raise
        except Exception:
            leaves = step.real_leaves()
    used = {n: p for n, p in params.items() if n in leaves}
    if not used:
        raise errors.EngineInputError(errors.LOSS_NO_GRAD)
    return used


def _graph_leaves(loss: Any, names: dict[int, str]) -> set[str]:
    loss = check_loss(loss)  # the same messages as every engine's loss check
    found: set[str] = set()
    for node in graph_nodes([loss.grad_fn]):
        var = getattr(node, "variable", None)
        if var is not None and id(var) in names:
            found.add(names[id(var)])
    return found


def graph_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every autograd node reachable from ``roots`` (``grad_fn`` objects; ``None`` skipped),
    each once; a leaf's ``AccumulateGrad`` node carries it as ``.variable``."""
    stack = list(roots)
    # the nodes themselves are kept until the walk ends: a C++ node's Python wrapper may be
    # made afresh on each access and freed after, and a freed wrapper's id can be reused by
    # the next one — keyed by id alone, a walk could then skip nodes it never saw
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions)


def keep_nothing(_saved: Any) -> Any:
    """A saved-tensor hook that keeps nothing, for a graph that is read, never
    differentiated. Not the tensor itself: a pack hook that returns it makes a reference
    cycle with an output the graph saves (the output's node holds what the hook returned),
    which Python's collector cannot see, so a graph never differentiated keeps its saved
    outputs for good."""
    return None


@dataclasses.dataclass(frozen=True)
class _LossForward:
    """One forward of ``model`` on ``xs`` by ``run`` and ``loss_fn`` on its output, whose
    autograd graph names the ``params`` (by name) the loss depends on: on fake tensors
    (:meth:`fake_leaves`) or, where those cannot run the model, for real
    (:meth:`real_leaves`)."""

    model: nn.Module
    xs: tuple[torch.Tensor, ...]
    loss_fn: LossFn
    params: Mapping[str, nn.Parameter]
    run: ModelRun

    def fake_leaves(self) -> set[str]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with torch.random.fork_rng(devices=[]), aside():
            state: dict[str, torch.Tensor] = {}
            names: dict[int, str] = {}
            for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
                fake = mode.from_tensor(t.detach())
                if n in self.params:
                    fake.requires_grad_(True)
                    names[id(fake)] = n
                state[n] = fake
            fxs = tuple(mode.from_tensor(x.detach()) for x in self.xs)
            with mode, torch.enable_grad():
                # each attribute slot gets its fake: a weight tied into a second module is
                # found through either
                out = self.run(lambda *a: call_with(self.model, state, a), fxs)
                loss = self.loss_fn(out)
                return _graph_leaves(loss, names)

    def real_leaves(self) -> set[str]:
        names = {id(p): n for n, p in self.params.items()}
        guard = BufferGuard(self.model)
        with torch.random.fork_rng(devices=[]), aside(), guard, torch.enable_grad():
            guard.settle()  # every change this forward makes is undone on exit
            with torch.autograd.graph.saved_tensors_hooks(keep_nothing, keep_nothing):
                loss = self.loss_fn(self.run(self.model, tuple(x.detach() for x in self.xs)))
            return _graph_leaves(loss, names)


class RngReplay:
    """Every run of the model starts from the RNG state the step began with (so each
    chunk of a vmapped forward draws the same dropout masks, as one autograd forward
    does), and the step ends with the stream where one run leaves it."""

    def __init__(self, xs: Iterable[torch.Tensor]) -> None:
        self.devices = sorted({x.device for x in xs if x.device.type == "cuda"}, key=str)
        self.start = self._get()
        self.after: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def _get(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices]

    def _set(self, state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        torch.set_rng_state(state[0])
        for d, s in zip(self.devices, state[1], strict=True):
            torch.cuda.set_rng_state(s, d)

    def before_run(self) -> None:
        """Rewind to the step's starting state (a no-op before the first run)."""
        if self.after is not None:
            self._set(self.start)

    def after_run(self) -> None:
        if self.after is None:
            self.after = self._get()

    def finish(self) -> None:
        """Leave the stream where one forward leaves it."""
        if self.after is not None:
            self._set(self.after)
