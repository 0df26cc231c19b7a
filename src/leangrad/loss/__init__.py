"""Losses that hold less than autograd would: cross-entropy of a linear layer's output
without its logits (:func:`linear_cross_entropy`), and :func:`chunked_logits`, which makes
a model's final linear layer hand the loss a :class:`LazyLogits` instead of the logits, so
a loss written ``F.cross_entropy(out.logits.reshape(-1, V), y.reshape(-1))`` runs chunked
as it is; and :func:`per_example`, a loss declared a mean over examples, which the
``accumulate`` engine splits into micro-batches."""

from ._chunked import CHUNK_BYTES, CHUNKS, chunk_rows, linear_cross_entropy
from ._examples import PerExample, per_example
from ._lazy import Head, LazyLogits, LogitsReadError, chunked_logits, final_linear

__all__ = [
    "CHUNKS",
    "CHUNK_BYTES",
    "Head",
    "LazyLogits",
    "LogitsReadError",
    "PerExample",
    "chunk_rows",
    "chunked_logits",
    "final_linear",
    "linear_cross_entropy",
    "per_example",
]
