"""Bit-packed boolean masks: 1 bit per element, for residuals that are only a sign.

Moonwalk v2 (Krylov, Karamzade, Fox, AISTATS 2026), section 4.5: in a chain of
convolutions with LeakyReLU activations, the LeakyReLU vjp only needs "the sign
of each activation", not the activation. A ``bool`` tensor spends a byte on each
sign; :func:`pack_bits` spends a bit, so the residual is ``ceil(numel / 8)``
bytes.

Layout: elements are taken in row-major (C-contiguous) order of the mask's
logical shape, eight to a byte, least-significant bit first (element ``8k + j``
is bit ``j`` of byte ``k``); the last byte is padded with zero bits. Both
functions are vectorised tensor operations and run on the mask's device.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

__all__ = ["PackedBits", "pack_bits", "unpack_bits", "unpack_nonzero"]

_LITTLE = sys.byteorder == "little"
_GATHER = sum(1 << (7 * j + 7) for j in range(8))  # < 2**63: a positive int64
"""Times eight 0/1 bytes read as one little-endian int64, puts byte ``j`` at bit ``56 + j``
(each product term lands on its own bit: no carries): a byte of 8 mask bits in one multiply."""
_SPREAD, _KEEP = 0x0101010101010101, 0x8040201008040201 - (1 << 64)
"""A byte times ``_SPREAD`` copies it into all 8 bytes of an int64; ``& _KEEP`` keeps bit ``j``
in byte ``j``: byte ``j`` is non-zero exactly when bit ``j`` was set."""

NOT_BOOL = (
    "pack_bits packs a bool mask, got dtype {dtype}; "
    "pass a comparison such as (x > 0), or call .bool() first"
)
NOT_PACKED = "unpack_bits expects uint8 data from pack_bits, got dtype {dtype}"
WRONG_LENGTH = (
    "unpack_bits: {nbytes} bytes cannot hold shape {shape} ({numel} elements need {need} bytes); "
    "pass the PackedBits that pack_bits returned, unchanged"
)


class PackedBits(NamedTuple):
    """A bool mask packed 8 elements to a byte.

    Attributes:
        data: 1-D ``uint8`` tensor of ``ceil(numel / 8)`` bytes, on the mask's device.
        shape: the mask's shape, which :func:`unpack_bits` restores.
    """

    data: torch.Tensor
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        """Bytes of packed data (``ceil(numel / 8)``)."""
        return self.data.numel() * self.data.element_size()


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(mask: torch.Tensor) -> PackedBits:
    """Pack a bool mask into bytes, 1 bit per element.

    Args:
        mask: a ``torch.bool`` tensor of any shape (views and non-contiguous
            tensors are read in their logical row-major order).

    Returns:
        :class:`PackedBits` with ``ceil(mask.numel() / 8)`` bytes and ``mask.shape``.

    Raises:
        TypeError: ``mask`` is not a bool tensor.

    Trade-off: 8x less memory than a ``bool`` mask (32x/64x less than a float32/
    float64 activation), for one multiply-shift-mask per 8 elements to pack and one
    multiply-mask per 8 elements to unpack. Moonwalk v2, section 4.5.
    """
    if mask.dtype != torch.bool:
        raise TypeError(NOT_BOOL.format(dtype=mask.dtype))
    flat = mask.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if _LITTLE:  # 8 bools as one int64: one multiply, shift and mask per 8 elements
        raw = flat.contiguous().view(torch.uint8)
        if raw.storage_offset() % 8:  # an int64 view needs an 8-byte-aligned start
            raw = raw.clone()
        words = raw.view(torch.int64)
        data = (words * _GATHER).bitwise_right_shift_(56).bitwise_and_(0xFF).to(torch.uint8)
    else:
        bits = flat.to(torch.uint8).view(-1, 8) * _bit_weights(flat.device)
        data = bits.sum(dim=1, dtype=torch.uint8)
    return PackedBits(data=data, shape=mask.shape)


def unpack_bits(packed: PackedBits) -> torch.Tensor:
    """The bool mask that :func:`pack_bits` packed, with its shape, on the data's device.

    Args:
        packed: the result of :func:`pack_bits`.

    Returns:
        A contiguous ``torch.bool`` tensor of shape ``packed.shape``.

    Raises:
        TypeError: ``packed.data`` is not ``uint8``.
        ValueError: ``packed.data`` has the wrong number of bytes for ``packed.shape``.
    """
    return unpack_nonzero(packed) != 0


def unpack_nonzero(packed: PackedBits) -> torch.Tensor:
    """A ``uint8`` tensor of ``packed.shape``, non-zero exactly where the mask was set (the
    value is ``2**(i % 8)``, not 1): what kernels that test ``input > 0`` (``leaky_relu``'s
    and ``threshold``'s backward) can read directly, one pass cheaper than the bool mask.

    Raises:
        TypeError, ValueError: as :func:`unpack_bits`.
    """
    data, shape = packed
    if data.dtype != torch.uint8:
        raise TypeError(NOT_PACKED.format(dtype=data.dtype))
    numel = torch.Size(shape).numel()
    need = -(-numel // 8)
    if data.numel() != need:
        raise ValueError(
            WRONG_LENGTH.format(nbytes=data.numel(), shape=tuple(shape), numel=numel, need=need)
        )
    if _LITTLE:  # each byte spread over one int64, byte j keeping bit j
        bits = (data.to(torch.int64) * _SPREAD).bitwise_and_(_KEEP).view(torch.uint8)
    else:
        bits = torch.bitwise_and(data.reshape(-1, 1), _bit_weights(data.device))
    return bits.reshape(-1)[:numel].reshape(shape)
