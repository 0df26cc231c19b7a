"""The catalog of engine classes by name (DESIGN.md, "Naming"): the bottom of the
registry, which knows nothing of composition.

Engine modules register their classes here at import (``@register("backprop")``);
:mod:`leangrad.engines._registry`, above both, makes engines from names and builds
compositions such as ``"checkpoint+fad"`` (:mod:`leangrad.engines._compose`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .. import _errors as errors
from ._base import Engine

__all__ = ["ALREADY_REGISTERED", "available", "engine_class", "register", "unregister"]

ALREADY_REGISTERED = (
    "an engine named {name!r} is already registered; register it under another name"
)

_REGISTRY: dict[str, type[Engine]] = {}
EngineT = TypeVar("EngineT", bound=type[Engine])


def register(name: str) -> Callable[[EngineT], EngineT]:
    """Class decorator registering an engine under ``name`` (its ``Engine.name``)."""

    def deco(cls: EngineT) -> EngineT:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(ALREADY_REGISTERED.format(name=name))
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove the engine registered as ``name`` (a test's own engine, at teardown);
    unknown names list the known ones."""
    engine_class(name)
    del _REGISTRY[name]


def available(*, exact: bool | None = None) -> list[str]:
    """Names of the registered engines, sorted; ``exact=`` filters exact/estimating ones."""
    return sorted(n for n, c in _REGISTRY.items() if exact is None or c.exact == exact)


def engine_class(name: str) -> type[Engine]:
    """The engine class registered as ``name``; unknown names list the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise errors.UnknownNameError(
            errors.UNKNOWN_NAME.format(kind="engine", name=name, known=", ".join(available()))
        ) from None
