"""Checkpointing as one family: the ``checkpoint`` engine (``_engine``) and its options,
each in a module named for what it does — ``_segments`` (blocks grouped into segments),
``_two_level`` (the √L scheme over block boundaries), ``_fragments`` and ``_batchnorm``
(recomputation in pieces along the batch, exact through training-mode BatchNorm),
``_time_chunks`` (fused recurrent modules in chunks of time), ``_offers`` (what the
planner may try) and ``_explain`` (what a configuration keeps and recomputes)."""

from ._engine import Checkpoint

__all__ = ["Checkpoint"]
