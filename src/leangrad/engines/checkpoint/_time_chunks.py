"""Fused recurrent modules (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) checkpointed in time chunks.

A fused recurrent module is one opaque op to autograd and to ``torch.fx``: its whole
sequence of gates is kept for the backward pass, and no block boundary lies inside it.
Chen et al. ("Training deep nets with sublinear memory cost", 2016) checkpoint a
recurrence along time as they do along depth: run the sequence in ``k`` chunks, carry the
hidden state from one chunk to the next, keep only each chunk's input and entry state,
and recompute a chunk's gates when the backward pass reaches it. The last chunk is not
checkpointed (its gates are the first the backward pass needs, as
``checkpoint_sequential`` leaves its last segment).

The chunks run the same fused kernel with the same weights, so the gradients are
autograd's. Two configurations cannot be chunked without changing what the step computes,
and are refused by :func:`unchunkable` with the reason:

- a bidirectional module (its reverse direction starts from the end of the sequence);
- inter-layer ``dropout`` in training mode (each chunk would draw its own masks, so the RNG
  stream would differ from autograd's).

A ``PackedSequence`` input and calls without gradients run the module whole.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils.checkpoint import checkpoint

__all__ = ["BAD_TIME_CHUNKS", "TimeChunked", "chunk_recurrent", "fused_recurrent", "unchunkable"]

BAD_TIME_CHUNKS = "time_chunks must be an int >= 2 or None (run whole), got {value!r}"
BIDIRECTIONAL = (
    "time_chunks cannot chunk {name!r} ({kind}, bidirectional=True): its reverse direction "
    "starts from the end of the sequence; drop time_chunks= or make it unidirectional"
)
DROPOUT = (
    "time_chunks cannot chunk {name!r} ({kind}, dropout={p}) in training mode: each chunk "
    "would draw its own dropout masks, so the RNG stream would differ from autograd's; set "
    "dropout=0, call model.eval(), or drop time_chunks="
)


def fused_recurrent(model: nn.Module) -> list[tuple[str, nn.RNNBase]]:
    """The fused recurrent modules of ``model`` (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.RNNBase)]


def unchunkable(name: str, rnn: nn.RNNBase) -> str | None:
    """Why ``rnn`` cannot run in time chunks as autograd would run it whole; ``None`` if it can."""
    kind = type(rnn).__name__
    if rnn.bidirectional:
        return BIDIRECTIONAL.format(name=name, kind=kind)
    if rnn.training and rnn.dropout > 0 and rnn.num_layers > 1:
        return DROPOUT.format(name=name, kind=kind, p=rnn.dropout)
    return None


class TimeChunked:
    """The ``forward`` of a fused recurrent module ``rnn`` run over its sequence in ``chunks``
    time chunks, the state carried, every chunk but the last checkpointed (module
    docstring). It is set as that module's own ``forward`` (on a prepared copy), so the
    module keeps its class, attributes and parameter names for the model's code."""

    def __init__(self, rnn: nn.RNNBase, chunks: int) -> None:
        self.whole = type(rnn).forward.__get__(rnn)
        self.batch_first = rnn.batch_first
        self.chunks = chunks

    def __call__(self, input: Any, hx: Any = None) -> tuple[Any, Any]:
        if isinstance(input, PackedSequence) or not torch.is_grad_enabled():
            return self.whole(input, hx)
        time = 1 if self.batch_first and input.dim() == 3 else 0  # 2-D: unbatched (L, H)
        pieces = input.split(max(1, math.ceil(input.shape[time] / self.chunks)), dim=time)
        outs: list[torch.Tensor] = []
        state = hx
        for i, piece in enumerate(pieces):
            if i == len(pieces) - 1:
                out, state = self.whole(piece, state)
            else:
                out, state = checkpoint(self.whole, piece, state, use_reentrant=False)
            outs.append(out)
        return torch.cat(outs, dim=time), state


def chunk_recurrent(model: nn.Module, chunks: int, *, skip: tuple[str, ...] = ()) -> None:
    """Give each fused recurrent module of ``model`` a :class:`TimeChunked` ``forward`` (in
    place: call it on a prepared copy), except those inside the submodules named in ``skip``
    (recomputed whole already)."""
    for name, rnn in fused_recurrent(model):
        if not any(name == s or name.startswith(f"{s}.") for s in skip):
            rnn.forward = TimeChunked(rnn, chunks)
