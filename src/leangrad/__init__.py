"""leangrad: gradients of neural networks with less memory or in less time than
backprop, and honest measurements of what each method costs.

Quick use::

    import leangrad
    eng = leangrad.engine("checkpoint", segments="sqrt")
    result = eng.backward(model, x, lambda out: F.cross_entropy(out, y))
    optimizer.step()
"""

from . import (
    bits,
    data,
    engines,
    fad,
    hf,
    highway,
    layers,
    loss,
    measure,
    models,
    planner,
    rad,
    train,
    zoo,
)
from ._errors import EngineInputError, LeangradError, OptionalDependencyError, UnknownNameError
from ._version import __version__
from .engines import Blocks, Engine, StepResult, available, blocks, engine, explain
from .engines._surrogate import surrogate_loss
from .layers import Chain, ChainLayer, PrecisionWarning
from .planner import Plan, plan

__all__ = [
    "Blocks",
    "Chain",
    "ChainLayer",
    "Engine",
    "EngineInputError",
    "LeangradError",
    "OptionalDependencyError",
    "Plan",
    "PrecisionWarning",
    "StepResult",
    "UnknownNameError",
    "__version__",
    "available",
    "bits",
    "blocks",
    "data",
    "engine",
    "engines",
    "explain",
    "fad",
    "hf",
    "highway",
    "layers",
    "loss",
    "measure",
    "models",
    "plan",
    "planner",
    "rad",
    "surrogate_loss",
    "train",
    "zoo",
]
