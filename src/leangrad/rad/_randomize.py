"""``randomize``: swap a model's supported layers for their RAD versions, in place.

Randomized AD, section 4.2: sample only ``∂h/∂W`` of each linear map (Linear,
Conv2d, recurrent cells), keep the ReLU derivative as 1 bit and let average
pooling store nothing; everything else is differentiated exactly. Weights are
shared with the original modules (the same ``Parameter`` objects), so an
optimizer built before the swap keeps working.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, cast

import torch
from torch import nn

from . import _errors as errors
from ._conv import RandConv2d
from ._linear import RandLinear
from ._recurrent import RandGRUCell, RandRNNCell
from ._relu import BitReLU, LeanAdaptiveAvgPool2d, LeanAvgPool2d
from ._sampling import SampleSpec, make_generator

__all__ = ["RandomizeReport", "randomize"]

_RANDOMIZED = (
    RandLinear, RandConv2d, RandRNNCell, RandGRUCell, BitReLU, LeanAvgPool2d,
    LeanAdaptiveAvgPool2d,
)  # fmt: skip
_SAVE_NOTHING = (nn.Flatten, nn.Unflatten, nn.Identity)
"""Parameter-free layers whose backward needs nothing: never listed as left exact."""


@dataclasses.dataclass(frozen=True)
class RandomizeReport:
    """What :func:`randomize` did.

    Attributes:
        swapped: module name -> ``"Linear -> RandLinear"`` etc., in model order.
        left_exact: names (and types) of leaf layers with no randomized version.
        fraction, mode, replace: the sampling options applied.
    """

    swapped: dict[str, str]
    left_exact: list[str]
    fraction: float
    mode: str
    replace: bool


def _swap(module: nn.Module, spec: SampleSpec, gen: torch.Generator | None) -> nn.Module | None:
    """The randomized replacement of ``module``, or ``None`` when it has none."""
    if isinstance(module, _RANDOMIZED):
        return None
    # the exact type is matched (a subclass may change the forward), which mypy cannot narrow
    t, m = type(module), cast(Any, module)
    if t is nn.Linear:
        return RandLinear.from_linear(m, spec=spec, generator=gen)
    if t is nn.Conv2d and RandConv2d.supports(m) is None:
        return RandConv2d.from_conv(m, spec=spec, generator=gen)
    if t is nn.RNNCell:
        return RandRNNCell.from_cell(m, spec=spec, generator=gen)
    if t is nn.GRUCell:
        return RandGRUCell.from_cell(m, spec=spec, generator=gen)
    if t is nn.ReLU:
        return BitReLU()
    if t is nn.AvgPool2d:
        return LeanAvgPool2d(
            m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
            m.divisor_override,
        )  # fmt: skip
    if t is nn.AdaptiveAvgPool2d:
        return LeanAdaptiveAvgPool2d(m.output_size)
    return None


def randomize(
    model: nn.Module,
    *,
    fraction: float = 0.1,
    mode: str = "different",
    replace: bool = False,
    seed: int | None = None,
    keep_randomized: bool = False,
) -> RandomizeReport:
    """Swap ``model``'s supported layers for RAD layers, in place, sharing their weights.

    Swapped: ``nn.Linear`` -> :class:`RandLinear`, ``nn.Conv2d`` (zero numeric padding)
    -> :class:`RandConv2d`, ``nn.RNNCell`` / ``nn.GRUCell`` -> :class:`RandRNNCell` /
    :class:`RandGRUCell`, ``nn.ReLU`` -> :class:`BitReLU` (1-bit mask),
    ``nn.AvgPool2d`` / ``nn.AdaptiveAvgPool2d`` -> pooling that saves nothing.
    Other leaf layers stay exact and are listed in a ``UserWarning`` and the report.
    Layers randomized by an earlier call take this call's settings (``fraction``,
    ``mode``, ``replace``, ``seed``), so the report always describes what the model does —
    unless ``keep_randomized``: then they keep their own (the ``rad`` engine's choice: a
    layer the user randomized is the user's estimator, and draws from the user's stream).

    Args:
        model: the model to modify (not its root: wrap a bare layer in ``nn.Sequential``).
        fraction: share of each sampled activation kept, in (0, 1]; 1 gives exact gradients.
        mode: ``"different"`` (per-example samples: the paper's best for MLPs),
            ``"same"`` (one sample per batch) or ``"project"`` (Rademacher projection).
        replace: sample with replacement (the paper) instead of without.
        seed: seeds one generator shared by all swapped layers; ``None`` uses torch's
            global RNG.
        keep_randomized: leave layers randomized before (settings and generator) alone.

    Returns:
        A :class:`RandomizeReport`.

    Raises:
        RadInputError: bad ``fraction``, ``mode``, ``replace`` or ``seed``, or ``model``
            itself is a supported layer (a root that is already randomized takes the new
            settings instead, reported as ``"<root>"``).
    """
    spec = SampleSpec(fraction, mode, replace)
    gen = make_generator(seed)
    if _swap(model, spec, gen) is not None:
        raise errors.RadInputError(errors.ROOT_SUPPORTED.format(kind=type(model).__name__))
    swapped: dict[str, str] = {}
    left: list[str] = []
    if isinstance(model, _RANDOMIZED):  # a randomized layer as the root: nothing to swap
        if hasattr(model, "spec") and not keep_randomized:
            model.spec, model.generator = spec, gen
            swapped["<root>"] = f"{type(model).__name__} (settings replaced)"
        return RandomizeReport(swapped, left, spec.fraction, spec.mode, spec.replace)

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            full = f"{prefix}{name}"
            new = _swap(child, spec, gen)
            if new is not None:
                setattr(parent, name, new)
                swapped[full] = f"{type(child).__name__} -> {type(new).__name__}"
            elif isinstance(child, _RANDOMIZED):
                if hasattr(child, "spec") and not keep_randomized:  # takes the new settings
                    child.spec, child.generator = spec, gen
                    swapped[full] = f"{type(child).__name__} (settings replaced)"
            elif next(child.children(), None) is None:
                if not isinstance(child, _SAVE_NOTHING):
                    left.append(f"{full} ({type(child).__name__})")
            else:
                visit(child, f"{full}.")

    visit(model, "")
    if next(model.children(), None) is None and not isinstance(model, _SAVE_NOTHING):
        left.append(f"<root> ({type(model).__name__})")
    if left:
        warnings.warn(
            errors.UNSUPPORTED_WARNING.format(count=len(left), names=", ".join(left)), stacklevel=2
        )
    return RandomizeReport(swapped, left, spec.fraction, spec.mode, spec.replace)
