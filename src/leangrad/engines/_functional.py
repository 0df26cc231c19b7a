"""Shared plumbing of the forward-mode engines: the loss as a pure function of parameters.

Two PyTorch behaviours are worked around here, at their cause:

- ``torch.func.functional_call`` (``tie_weights=True``, its default) swaps a tensor into
  every *name* it has; a module registered under two names (``nn.Sequential(lin, act,
  lin)``) is one attribute slot reached twice, so the second swap saves the first one's
  stand-in as "the original" and puts it back at the end — the user's ``lin.weight``
  is left a plain tensor, not their Parameter. :func:`call_with` swaps each attribute
  slot once (a tensor tied into several modules, GPT-2's embedding and output layer, is
  swapped into each of its slots).
- ``group_norm`` under ``torch.func``: its vmap rule folds the vmapped dimension into the
  batch by a reshape that can stay a non-contiguous view (a convolution with a batched
  weight, split along channels, hands it one), which the CPU kernel refuses ("Expected
  X.is_contiguous"); its forward-mode rule views a channels-last input, which fails too.
  :func:`contiguous_norms` hands it a contiguous copy of its input — the same values.
- ``F.scaled_dot_product_attention`` on CPU dispatches to a fused flash kernel that has no
  forward-mode rule ("Trying to use forward AD with
  _scaled_dot_product_flash_attention_for_cpu"), so every Hugging Face model failed under
  ``forward`` and ``projforward``. :func:`pure_loss` runs the model under
  ``sdpa_kernel(SDPBackend.MATH)``: the same attention written in ops that all have one
  (the same function; the fused kernels differ from it only by rounding).
- ``nn.RNN``/``nn.LSTM``/``nn.GRU`` on CUDA dispatch to ``_cudnn_rnn``, which has no
  forward-mode rule either (found on an H200: ``forward`` on the RNN classifier failed
  there and nowhere else). :func:`pure_loss` turns cuDNN off while a model holding one
  runs, so PyTorch takes its native recurrent path, written in ops that have one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ._loss_fn import LossFn, check_loss, run_forward

__all__ = [
    "BatchedBuffers",
    "CallMode",
    "call_with",
    "contiguous_norms",
    "jvp_with_buffers",
    "pure_loss",
    "slot_names",
]


def slot_names(model: nn.Module) -> dict[str, list[str]]:
    """For each parameter and buffer name (as ``named_parameters()`` / ``named_buffers()``
    give it), one name per attribute slot that holds the same tensor: a tensor tied into
    two modules has two slots; a module registered under two names has one."""
    canonical = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    out: dict[str, list[str]] = {n: [] for n in canonical.values()}
    seen: set[tuple[int, str]] = set()
    members = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]  # fmt: skip
    for name, t in members:
        prefix, _, attr = name.rpartition(".")
        slot = (id(model.get_submodule(prefix)), attr)
        if slot not in seen and id(t) in canonical:
            seen.add(slot)
            out[canonical[id(t)]].append(name)
    return out


def call_with(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    args: tuple[Any, ...],
    *,
    slots: Mapping[str, list[str]] | None = None,
) -> Any:
    """``model(*args)`` with the tensors of ``state`` (by ``named_parameters()`` /
    ``named_buffers()`` name) in place of the model's, as ``torch.func.functional_call``,
    but swapping each attribute slot once, so the model holds its own Parameters again
    afterwards whatever is shared (module docstring). ``slots``: :func:`slot_names` of
    the model, when the caller has it already."""
    slots = slot_names(model) if slots is None else slots
    full = {path: t for n, t in state.items() for path in slots.get(n, [n])}
    return functional_call(model, full, args, tie_weights=False)


class CallMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that hands each torch call to :meth:`call`, its keyword
    arguments always a dict (PyTorch passes ``None`` for none); subclasses define
    :meth:`call`, which runs the call or what stands in for it."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.call(func, args, kwargs or {})

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, or what the mode runs in its place."""
        raise NotImplementedError


class _ContiguousNorms(CallMode):
    """Hands ``group_norm`` a contiguous copy of its input (see :func:`contiguous_norms`),
    and ``F.embedding`` a weight whose ``padding_idx`` row is constant
    (:func:`_padding_row_constant`)."""

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if (
            (func is F.group_norm or func is torch.group_norm)
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            args = (args[0].clone(memory_format=torch.contiguous_format), *args[1:])
        if func is F.embedding:
            args, kwargs = _padding_row_constant(args, kwargs)
        return func(*args, **kwargs)


def _padding_row_constant(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``F.embedding``'s arguments with the ``padding_idx`` row of the weight detached:
    autograd's embedding backward gives that row nothing from the lookup (PyTorch's
    documented rule, BERT's ``pad_token_id``), while forward mode would differentiate it
    like any other row. The values are the same tensor's."""
    names = ("input", "weight", "padding_idx")
    bound = dict(zip(names, args, strict=False)) | kwargs
    pad, weight = bound.get("padding_idx"), bound.get("weight")
    if pad is None or not isinstance(weight, torch.Tensor):
        return args, kwargs
    rows = torch.arange(weight.shape[0], device=weight.device)[:, None]
    pinned = torch.where(rows == pad % weight.shape[0], weight.detach(), weight)
    if len(args) > 1:
        return (args[0], pinned, *args[2:]), kwargs
    return args, {**kwargs, "weight": pinned}


@contextlib.contextmanager
def _cudnn_off(off: bool) -> Iterator[None]:
    """Within, when ``off``: cuDNN disabled (only that flag; ``torch.backends.cudnn.flags``
    would reset TF32, benchmark and determinism to its defaults too)."""
    was = torch.backends.cudnn.enabled
    if off:
        torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = was


@contextlib.contextmanager
def contiguous_norms() -> Iterator[None]:
    """Within: ``group_norm`` gets a contiguous copy of its input. Under ``vmap`` the copy is
    contiguous with the vmapped dimension first, which its batching rule needs; under
    ``jvp`` it is not channels-last, which its forward-mode rule needs (module
    docstring). Use it around model code run under ``torch.func`` transforms."""
    with _ContiguousNorms():
        yield


class BatchedBuffers:
    """Per-direction copies of the module's buffers, so in-place updates (BatchNorm
    running statistics) work under ``vmap`` and are committed to the module once."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buffers = dict(model.named_buffers())
        self.committed = False

    def batched(self, k: int) -> dict[str, torch.Tensor]:
        return {n: b.unsqueeze(0).expand(k, *b.shape).clone() for n, b in self.buffers.items()}

    def commit(self, batched: dict[str, torch.Tensor]) -> None:
        """Copy the first direction's buffer values into the module, once per step."""
        if self.committed:
            return
        with torch.no_grad():
            for n, b in self.buffers.items():
                b.copy_(batched[n][0])
        self.committed = True


def pure_loss(
    engine: str,
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    loss_fn: LossFn,
    params: Mapping[str, nn.Parameter],
) -> Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]:
    """``f(param_values, buffer_values) -> loss``, a pure function for ``torch.func``; the
    model runs by :func:`call_with` under :func:`contiguous_norms`, with attention by its
    math kernel and recurrent layers off cuDNN (forward-mode AD has rules for those;
    module docstring)."""
    frozen = {n: p.detach() for n, p in model.named_parameters() if n not in params}
    slots = slot_names(model)
    cudnn = not any(isinstance(m, nn.RNNBase) for m in model.modules())

    def run(*xs: torch.Tensor, state: dict[str, torch.Tensor]) -> Any:
        with (
            contiguous_norms(),
            sdpa_kernel(SDPBackend.MATH),
            _cudnn_off(not cudnn),
        ):
            return call_with(model, state, xs, slots=slots)

    def f(values: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        state = {**frozen, **values, **buffers}
        out = run_forward(engine, lambda *xs: run(*xs, state=state), inputs)
        return check_loss(loss_fn(out), needs_graph=False)

    return f


def jvp_with_buffers(
    fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor],
    primal: Any,
    tangent: Any,
    buffers: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``jvp`` of ``fn(primal, buffers)`` along ``tangent``; also returns the updated buffers.

    The buffers are cloned *inside* the transformed function: a module that
    updates them in place (BatchNorm's running statistics in training mode)
    may not mutate a tensor captured from outside ``torch.func.jvp``. The
    updated copies come back as the third result, for :meth:`BatchedBuffers.commit`.
    """

    def g(p: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        local = {n: b.clone() for n, b in buffers.items()}
        loss = fn(p, local)
        return loss, {n: b.detach() for n, b in local.items()}

    value, dloss, updated = cast(Any, jvp(g, (primal,), (tangent,), has_aux=True))  # 3 with aux
    return value, dloss, updated
