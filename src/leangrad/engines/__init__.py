"""Gradient engines: one module per method, one signature, a registry by name.

Every engine has ``backward(model, inputs, loss_fn, *, on_grad=None) -> StepResult``
and fills ``p.grad`` like ``loss.backward()``. ``available()`` lists the names.
"""

from ._backprop import Backprop
from ._base import Engine, StepResult
from ._blocks import Blocks, blocks
from ._compose import Accumulate, Bits, ChunkedCE, Composed, Fad, Rad
from ._explain import Explanation, explain
from ._forward import Forward
from ._highway import Highway
from ._moonwalk import Moonwalk
from ._projforward import ProjForward
from ._registry import available, engine, engine_class, register
from ._revbackprop import RevBackprop
from ._transforms import Transform
from .checkpoint._engine import Checkpoint

__all__ = [
    "Accumulate",
    "Backprop",
    "Bits",
    "Blocks",
    "Checkpoint",
    "ChunkedCE",
    "Composed",
    "Engine",
    "Explanation",
    "Fad",
    "Forward",
    "Highway",
    "Moonwalk",
    "ProjForward",
    "Rad",
    "RevBackprop",
    "StepResult",
    "Transform",
    "available",
    "blocks",
    "engine",
    "engine_class",
    "explain",
    "register",
]
