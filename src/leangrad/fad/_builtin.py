"""Chains that *are* a PyTorch fused activation: run them by the built-in instead.

A chain written from primitives may compute exactly what one fused kernel computes
(``x * torch.sigmoid(x)`` is ``F.silu``; the erf and tanh GELU formulas are ``F.gelu``).
Such a kernel keeps only its input for backward — the same one tensor a nested chain
keeps — and runs faster than the chain's forward-mode rules (measured, one thread:
``nn.SiLU`` 0.83-0.85x FAD's time, GELU about even), so :func:`~leangrad.fad.nest`
calls the built-in there. PyTorch's CPU Mish is slower than FAD (1.40-1.50x): not matched.

A chain matches when it has one output, only smooth primitives (no branch: ``relu``,
``abs`` and ``softplus``'s threshold are never matched) and, on probe points from
-1e3 to 1e3 in float64, its values *and* derivatives equal the built-in's to 1e-10.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._program import Program

__all__ = ["BUILTINS", "Builtin", "builtin_of"]

_SMOOTH = frozenset(
    {"add", "sub", "mul", "div", "neg", "pow", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt",
     "square", "reciprocal", "sigmoid", "tanh", "erf"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A fused activation: ``fn(x, **kwargs)``, shown as ``label``."""

    label: str
    fn: Callable[..., torch.Tensor]
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, **dict(self.kwargs))


BUILTINS = (
    Builtin("F.silu", F.silu),
    Builtin("F.gelu", F.gelu),
    Builtin("F.gelu(approximate='tanh')", F.gelu, (("approximate", "tanh"),)),
)
"""The fused activations a chain is matched against (those faster than, or even with, FAD)."""


def _probe() -> torch.Tensor:
    mid = torch.linspace(-8.0, 8.0, 801, dtype=torch.float64)
    far = torch.logspace(-6.0, 3.0, 64, dtype=torch.float64)
    return torch.cat([mid, far, -far])


def builtin_of(program: Program) -> Builtin | None:
    """The built-in that computes ``program`` (values and derivatives), or ``None``."""
    if len(program.outputs) != 1 or not program.steps:
        return None
    if any(s.prim.name not in _SMOOTH for s in program.steps):
        return None
    x = _probe()
    try:
        with torch.no_grad():
            (value,), (deriv,) = program.run_dual(x)
    except Exception:  # a chain the probe cannot run (e.g. a tensor constant of another shape)
        return None
    if not isinstance(value, torch.Tensor) or value.shape != x.shape:
        return None
    for b in BUILTINS:
        xr = x.clone().requires_grad_(True)
        want = b(xr)
        (dwant,) = torch.autograd.grad(want.sum(), xr)
        d = deriv if isinstance(deriv, torch.Tensor) else torch.full_like(x, float(deriv))
        if torch.allclose(value, want.detach(), rtol=1e-10, atol=1e-12, equal_nan=True) and \
                torch.allclose(d, dwant, rtol=1e-10, atol=1e-12, equal_nan=True):  # fmt: skip
            return b
    return None
