"""The registry of engines by name (DESIGN.md, "Naming")."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _errors as errors
from ._base import Engine

__all__ = ["available", "engine", "engine_class", "register"]

_REGISTRY: dict[str, type[Engine]] = {}
EngineT = TypeVar("EngineT", bound=type[Engine])


def register(name: str) -> Callable[[EngineT], EngineT]:
    """Class decorator registering an engine under ``name`` (its ``Engine.name``)."""

    def deco(cls: EngineT) -> EngineT:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"an engine named {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


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


def engine(name: str, **options: Any) -> Engine:
    """Make the engine ``name`` with keyword-only ``options``.

    ``name`` is a registered engine (``available()``) or a composition
    ``BASE+TRANSFORM[+...]`` such as ``"checkpoint+fad"`` (see
    :mod:`leangrad.engines._compose`); options go to the part that knows them.

    >>> leangrad.engine("checkpoint", segments=4).label
    'checkpoint(segments=4)'
    """
    if "+" in name:  # a base engine and transforms, e.g. "checkpoint+fad"
        from ._compose import compose

        return compose(name, options)
    cls = engine_class(name)
    params = inspect.signature(cls.__init__).parameters
    known = [p for p in params if p != "self" and params[p].kind is inspect.Parameter.KEYWORD_ONLY]
    for key in options:
        if key not in known:
            raise errors.UnknownNameError(
                errors.UNKNOWN_OPTION.format(
                    engine=name, option=key, known=", ".join(known) or "(none)"
                )
            )
    return cls(**options)
