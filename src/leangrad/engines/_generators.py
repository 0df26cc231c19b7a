"""Recomputation that replays the generators a model's layers own.

``torch.utils.checkpoint`` replays the global RNG streams when it recomputes a block, but
not a ``torch.Generator`` a layer holds (``rad.RandLinear(seed=...)`` draws each call's
sample seed from its own generator, as does every layer the ``rad`` engine randomizes with
a ``seed``): the recomputation drew the next seed — another sample than the forward's, so
another gradient — and left the generator two draws on instead of one (found
with fuzz finding F3). :func:`generator_replay` is a ``context_fn`` for
``checkpoint(..., use_reentrant=False)`` that rewinds those generators for the
recomputation and puts them back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ._draws import REPLAYING

__all__ = ["generator_replay", "layer_generators"]

ContextFn = Callable[[], tuple[contextlib.AbstractContextManager[None],
                               contextlib.AbstractContextManager[None]]]  # fmt: skip


def layer_generators(modules: Iterable[nn.Module]) -> list[torch.Generator]:
    """The distinct generators the modules (and their submodules) hold as attributes."""
    seen: dict[int, torch.Generator] = {}
    for module in modules:
        for m in module.modules():
            for v in vars(m).values():
                if isinstance(v, torch.Generator):
                    seen.setdefault(id(v), v)
    return list(seen.values())


def generator_replay(modules: Iterable[nn.Module]) -> ContextFn:
    """A ``context_fn`` for non-reentrant ``checkpoint``: the recomputation of ``modules``
    starts from the states their generators had when the forward began, and ends with the
    generators where they were before it (module docstring). Inside accumulate's replay of
    a whole batch's draws (:class:`~leangrad.engines._batch_draws.BatchDraws`), the
    recomputation is handed the draws the forward was handed."""
    gens = layer_generators(modules)

    def contexts() -> tuple[contextlib.AbstractContextManager[None],
                            contextlib.AbstractContextManager[None]]:  # fmt: skip
        start: list[torch.Tensor] = []
        cursor: list[int] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            start[:] = [g.get_state() for g in gens]
            cursor[:] = [r.cursor for r in REPLAYING[-1:]]
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            now = [g.get_state() for g in gens]
            for g, s in zip(gens, start, strict=True):
                g.set_state(s)
            replay = REPLAYING[-1] if REPLAYING and cursor else None
            if replay is not None:
                was = replay.cursor
                replay.cursor = cursor[0]
                replay.recomputing += 1
            try:
                yield
            finally:
                for g, s in zip(gens, now, strict=True):
                    g.set_state(s)
                if replay is not None:
                    replay.cursor = was
                    replay.recomputing -= 1

        return forward(), recompute()

    return contexts
