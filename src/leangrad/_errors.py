"""Error types and the message templates leangrad raises.

Messages are constants so tests can assert their text (STYLE.md, habit 7):
each names the offending object, the violated condition and the fix.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EngineInputError",
    "LeangradError",
    "OptionError",
    "OptionalDependencyError",
    "UnknownNameError",
    "require",
]


class LeangradError(Exception):
    """Base class of every error leangrad raises on purpose."""


class UnknownNameError(LeangradError, KeyError):
    """A name (engine, suite, dataset, option) that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class EngineInputError(LeangradError, ValueError):
    """The model, inputs or loss function given to an engine break its contract."""


class OptionError(LeangradError, ValueError):
    """A setting (a model, data or engine option, a batch size, ...) that cannot work."""


class OptionalDependencyError(LeangradError, ImportError):
    """A feature needs a package from one of leangrad's extras."""


UNKNOWN_NAME = "unknown {kind} {name!r}; known {kind}s: {known}"
UNKNOWN_OPTION = "engine {engine!r} has no option {option!r}; its options are: {known}"
LOSS_NOT_TENSOR = (
    "loss_fn must return a scalar torch.Tensor, got {type}; "
    "make it return e.g. F.cross_entropy(output, targets)"
)
LOSS_NOT_SCALAR = (
    "loss_fn must return a scalar (0-dim or one-element) tensor, got shape {shape}; "
    "reduce it, e.g. with .mean() or reduction='mean'"
)
LOSS_NOT_FLOAT = "loss_fn must return a floating-point tensor, got dtype {dtype}"
LOSS_NO_GRAD = (
    "the loss does not depend on any trainable parameter (it has no grad_fn); "
    "check that loss_fn uses the model output and that parameters have requires_grad=True"
)
NO_PARAMETERS = (
    "model {model} has no parameters with requires_grad=True; there is nothing to differentiate"
)
INPUT_NOT_TENSOR = "inputs must be a tensor or a tuple of tensors, got {type} at position {index}"
INPUT_DTYPE = (
    "input {index} has dtype {input_dtype} but the model's parameters are {param_dtype}; "
    "cast the inputs with .to({param_dtype})"
)
INPUT_DEVICE = (
    "input {index} is on {input_device} but the model's parameters are on {param_device}; "
    "move the inputs with .to({param_device!r})"
)
FORWARD_FAILED = (
    "engine {engine!r}: the model's forward failed on inputs of shapes {shapes}: {error}"
)
POSITIVE_INT = "{name} must be a positive int, got {value!r}"
MISSING_EXTRA = (
    "{feature} needs the package {package!r}; install it with: pip install 'leangrad[{extra}]'"
)


def require(package: str, *, feature: str, extra: str, module: str | None = None) -> Any:
    """Import ``module`` (default: ``package``) or raise :class:`OptionalDependencyError`
    naming the extra that installs ``package``."""
    import importlib

    try:
        return importlib.import_module(module or package)
    except ImportError as err:
        raise OptionalDependencyError(
            MISSING_EXTRA.format(feature=feature, package=package, extra=extra)) from err
