"""Engines by name (DESIGN.md, "Naming"): :func:`engine` makes a registered engine or a
composition ``BASE+TRANSFORM[+...]``.

The classes are registered in :mod:`leangrad.engines._catalog`, at the bottom; this
module sits above it and above :mod:`leangrad.engines._compose`, so the imports run one
way (the catalog and the engine modules know nothing of composition).
``register``, ``available`` and ``engine_class`` are the catalog's, re-exported here.
"""

from __future__ import annotations

import inspect
from typing import Any

from .. import _errors as errors
from ._base import Engine
from ._catalog import _REGISTRY, available, engine_class, register
from ._compose import compose

__all__ = ["_REGISTRY", "available", "engine", "engine_class", "register"]


def engine(name: str, **options: Any) -> Engine:
    """Make the engine ``name`` with keyword-only ``options``.

    ``name`` is a registered engine (``available()``) or a composition
    ``BASE+TRANSFORM[+...]`` such as ``"checkpoint+fad"`` (see
    :mod:`leangrad.engines._compose`); options go to the part that knows them.

    >>> leangrad.engine("checkpoint", segments=4).label
    'checkpoint(segments=4)'
    """
    if "+" in name:  # a base engine and transforms, e.g. "checkpoint+fad"
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
