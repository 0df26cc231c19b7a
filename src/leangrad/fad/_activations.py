"""Ready-made nested-FAD activations (paper Table I): Swish, GELU, Mish.

Each is written out of primitives as a :class:`~leangrad.fad._program.Program`
and runs as one autograd node that saves one tensor, the derivative (Table II
for Swish: ``sigma(x) + x * sigma(x) * (1 - sigma(x))``), where eager autograd
saves several intermediates (Swish: ``x`` and ``sigma(x)``).
"""

from __future__ import annotations

import math

from . import _errors as errors
from ._program import Builder, FusedChain, Program, Ref, program_of

__all__ = ["GELU", "Mish", "Swish", "gelu_program", "mish_program", "swish_program"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


def _swish(b: Builder) -> list[Ref]:
    x = b.source
    return [b.op("mul", x, b.op("sigmoid", x))]


def _mish(b: Builder) -> list[Ref]:
    x = b.source
    return [b.op("mul", x, b.op("tanh", b.op("softplus", x)))]


def _gelu_tanh(b: Builder) -> list[Ref]:
    # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))   (Table I)
    x = b.source
    inner = b.op("add", x, b.op("mul", 0.044715, b.op("pow", x, 3)))
    t = b.op("tanh", b.op("mul", _SQRT_2_OVER_PI, inner))
    return [b.op("mul", b.op("mul", 0.5, x), b.op("add", 1.0, t))]


def _gelu_erf(b: Builder) -> list[Ref]:
    # 0.5 * x * (1 + erf(x / sqrt(2)))
    x = b.source
    e = b.op("erf", b.op("mul", x, _INV_SQRT_2))
    return [b.op("mul", b.op("mul", 0.5, x), b.op("add", 1.0, e))]


def swish_program() -> Program:
    """``x * sigmoid(x)``."""
    return program_of("swish", _swish)


def mish_program() -> Program:
    """``x * tanh(softplus(x))``."""
    return program_of("mish", _mish)


def gelu_program(approximate: str = "none") -> Program:
    """``0.5 x (1 + erf(x / sqrt 2))`` (``"none"``) or the tanh form (``"tanh"``)."""
    if approximate == "tanh":
        return program_of("gelu-tanh", _gelu_tanh)
    if approximate == "none":
        return program_of("gelu", _gelu_erf)
    raise errors.FadOptionError(errors.BAD_APPROXIMATE.format(value=approximate))


class Swish(FusedChain):
    """Swish / SiLU ``x * sigmoid(x)``, saving one tensor (the derivative) for backward.

    Eager autograd saves ``x`` and ``sigmoid(x)`` (paper section II-C, eq. 1-4).
    """

    def __init__(self) -> None:
        super().__init__(swish_program())


class Mish(FusedChain):
    """Mish ``x * tanh(softplus(x))``, saving one tensor for backward (paper Table I)."""

    def __init__(self) -> None:
        super().__init__(mish_program())


class GELU(FusedChain):
    """GELU, exact (``approximate="none"``) or tanh form, saving one tensor for backward.

    Args:
        approximate: ``"none"`` (erf) or ``"tanh"`` (paper Table I), as ``torch.nn.GELU``.
    """

    def __init__(self, *, approximate: str = "none") -> None:
        super().__init__(gelu_program(approximate))
        self.approximate = approximate
