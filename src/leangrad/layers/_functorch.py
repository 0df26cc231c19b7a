"""Whether code runs under a ``torch.func`` transform, for leangrad's custom autograd Functions.

leangrad's lean layers (``bits.BitReLU``, ``bits.BitLeakyReLU``, ``bits.BitDropout``,
``bits.LeanAvgPool2d``, ...) are ``torch.autograd.Function`` s that change only what
autograd *saves* for its backward pass; their forward and gradient are those of the plain
PyTorch op. ``torch.func`` transforms (``vmap``, ``jvp``: the engines ``forward``,
``projforward`` and Moonwalk's pure mode) save nothing for a backward pass and refuse a
Function without ``setup_context`` (fuzz findings F4/F5). Under a transform these
layers therefore run the plain op — the same values, the same derivative, the same random
draws — which every transform has rules for.

A ``TorchFunctionMode`` whose ``leangrad_plain_ops`` attribute is true asks for the plain ops
too: the forward-mode engines record dropout masks on a real forward with such a mode, and
the masks must be drawn by the same call that the transformed runs replay.
"""

from __future__ import annotations

from torch._C._functorch import peek_interpreter_stack
from torch.overrides import _get_current_function_mode_stack

__all__ = ["plain_ops"]


def plain_ops() -> bool:
    """True inside a ``torch.func`` transform, or inside a torch-function mode that sets
    ``leangrad_plain_ops``: lean layers then run the plain PyTorch op (module docstring)."""
    if peek_interpreter_stack() is not None:
        return True
    return any(getattr(m, "leangrad_plain_ops", False) for m in _get_current_function_mode_stack())
