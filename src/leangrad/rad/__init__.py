"""leangrad.rad: randomized automatic differentiation (Oktay et al., ICLR 2021).

Unbiased gradient estimates that store a random reduced copy of each layer's
activations (section 4), path sampling on a general computation graph (section
3.1, Appendix C) and the reaction-diffusion PDE case study (section 5, Appendix B).

Quick use::

    from leangrad import rad
    report = rad.randomize(model, fraction=0.1, mode="different")
    loss_fn(model(x)).backward()          # unbiased weight gradients, ~10x less saved
"""

from ._conv import RandConv2d
from ._errors import RadInputError, StabilityError
from ._linear import RandLinear, rand_linear
from ._paths import PathGraph, PathSample
from ._pde import PdeGradient, PdeRun, ReactionDiffusion, optimize, pde_gradient, pde_loss
from ._randomize import RandomizeReport, randomize
from ._recurrent import RandGRUCell, RandRNNCell, irnn_cell
from ._relu import BitReLU, LeanAdaptiveAvgPool2d, LeanAvgPool2d
from ._sampling import MODES, SampleSpec, rademacher

__all__ = [
    "MODES",
    "BitReLU",
    "LeanAdaptiveAvgPool2d",
    "LeanAvgPool2d",
    "PathGraph",
    "PathSample",
    "PdeGradient",
    "PdeRun",
    "RadInputError",
    "RandConv2d",
    "RandGRUCell",
    "RandLinear",
    "RandRNNCell",
    "RandomizeReport",
    "ReactionDiffusion",
    "SampleSpec",
    "StabilityError",
    "irnn_cell",
    "optimize",
    "pde_gradient",
    "pde_loss",
    "rademacher",
    "rand_linear",
    "randomize",
]
