"""What autograd saves for the backward pass, counted by storage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["SavedBytes", "saved_tensor_bytes"]


class SavedBytes:
    """Distinct storages autograd packed, split by whether they are in ``exclude``."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        self.storages[id(st)] = st.nbytes()
        return t

    @property
    def bytes(self) -> int:
        """Bytes of saved storages not in ``exclude`` (e.g. not parameters or inputs)."""
        return sum(v for k, v in self.storages.items() if k not in self.exclude)


@contextlib.contextmanager
def saved_tensor_bytes(*exclude: torch.Tensor) -> Iterator[SavedBytes]:
    """Count the distinct storages autograd saves inside the block.

    Storages of the ``exclude`` tensors (parameters, inputs, targets) are left
    out of :attr:`SavedBytes.bytes`. Views of one storage count once.
    """
    counter = SavedBytes({id(t.untyped_storage()) for t in exclude})
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter
