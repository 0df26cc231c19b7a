"""``graph_nodes``, the one autograd-graph walk (used parameters, the fragments' probe,
BatchNorm's pass order), must not depend on Python wrapper identity outliving a visit.

Under torch 2.11 a node's Python wrapper is cached only while Python holds it: a walk that
remembered ids alone could meet a new wrapper at a freed one's address and skip a node it
never saw (found on an H100: BatchNorm fragments raised, their pass order missing an
edge). The model below behaves that way on any torch version."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from leangrad.engines._contract import graph_nodes


class _Core:
    """A node as C++ holds it: its wrapper is cached only while something else holds it."""

    def __init__(self, name: int, nxt: list[_Core]) -> None:
        self.name, self.nxt = name, nxt
        self._wrapper: weakref.ref[_Wrapper] | None = None

    def wrap(self) -> _Wrapper:
        w = self._wrapper() if self._wrapper is not None else None
        if w is None:
            w = _Wrapper(self)
            self._wrapper = weakref.ref(w)
        return w


class _Wrapper:
    __slots__ = ("__weakref__", "core")

    def __init__(self, core: _Core) -> None:
        self.core = core

    @property
    def next_functions(self) -> tuple[tuple[Any, int], ...]:
        return tuple((c.wrap(), 0) for c in self.core.nxt)


def test_walk_finds_every_node_when_wrappers_are_made_afresh() -> None:
    cores = [_Core(0, [])]
    for i in range(1, 300):  # a ladder of diamonds: every node reached twice
        cores.append(_Core(i, [cores[i - 1], *([cores[i - 2]] if i > 1 else [])]))
    found = [n.core.name for n in graph_nodes([cores[-1].wrap()])]
    assert sorted(found) == list(range(300))  # each once: wrappers kept, so deduplicated


def test_walk_visits_a_real_graph_once_per_node() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x
    for _ in range(50):
        y = torch.relu(y) + y  # diamonds
    nodes = list(graph_nodes([y.grad_fn]))
    assert len(nodes) == len({id(n) for n in nodes}) == 101  # 50 x (relu, add) + the leaf
    assert any(getattr(n, "variable", None) is x for n in nodes)
