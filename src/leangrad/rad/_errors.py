"""Errors of :mod:`leangrad.rad` and their message templates (tests assert the text)."""

from __future__ import annotations

from .._errors import LeangradError

__all__ = ["RadInputError", "StabilityError"]


class RadInputError(LeangradError, ValueError):
    """An option or input that a randomized layer cannot honour."""


class StabilityError(LeangradError, ValueError):
    """An explicit PDE time step that violates the FTCS stability criterion."""


BAD_FRACTION = (
    "fraction must be a number in (0, 1], got {value!r}; "
    "it is the share of activations kept for the weight gradient (1 keeps all: exact)"
)
BAD_MODE = "unknown mode {mode!r}; known modes: {known}"
BAD_REPLACE = "replace must be True or False, got {value!r}"
BAD_SEED = (
    "seed must be an int or None, got {value!r}; None draws from torch's global RNG "
    "(torch.manual_seed makes it reproducible)"
)
BAD_NONLINEARITY = "unknown nonlinearity {value!r}; known nonlinearities: tanh, relu"
BAD_INPUT = "{layer}: needs {want}, got shape {shape}{fix}"
BAD_PADDING = "{layer}: cannot use {why}; use nn.Conv2d for it, or numeric zero padding"
NOT_A_SPEC = "spec must be a SampleSpec, got {type}; build one with SampleSpec(fraction, mode)"
NEEDS_BATCH = (
    "{layer}: mode {mode!r} draws a separate sample per example and needs a batch "
    "dimension, but got an unbatched input of shape {shape}; add one with x.unsqueeze(0) "
    "or use mode='same' or mode='project'"
)
ROOT_SUPPORTED = (
    "randomize swaps layers inside a model, but the model itself is a {kind}; "
    "wrap it, e.g. nn.Sequential(model), or build the randomized layer directly"
)
UNSUPPORTED_WARNING = (
    "randomize left {count} layer(s) exact (no randomized version): {names}; "
    "their saved activations are not reduced"
)
UNDER_TRANSFORM = (
    "{layer}: a randomized layer estimates its weight gradient in autograd's backward pass, "
    "which a torch.func transform (vmap/jvp: the engines forward and projforward, Moonwalk's "
    "pure mode) never runs, so it would not give the layer's estimate; use an engine that "
    "runs autograd's backward (backprop, checkpoint, rad, moonwalk mode='mixed'), or the "
    "exact layer (nn.Linear, nn.Conv2d, ...)"
)
UNSTABLE_STEP = (
    "FTCS is unstable: D*dt/dx^2 = {ratio:.6g} > 1/4 (D={D}, dt={dt}, dx={dx}); "
    "take more time steps (dt <= {dt_max:.6g}) or a coarser grid"
)
