"""Path sampling on a general scalar computation graph (section 3.1, Appendix C).

Bauer's formula (eq. 1) writes ``∂y/∂θ_i`` as a sum over the paths from ``θ_i`` to
``y`` of the product of the local partials on each path. Algorithm 1 (RMAD with path
sampling) visits vertices in topological order; a vertex reached by a sampled edge
(or an input) draws ``k`` of its ``d_v`` outgoing edges uniformly and records
``Q(v, s) += d_v/k · ∂s/∂v`` for each draw; reverse mode on the sparse partials ``Q``
then gives an unbiased estimate of the gradient (Appendix C's induction: with
``ẑ = d_z/k Σ_draws ∂v_i/∂z · v̂_i``, ``E ẑ = Σ_v ∂v/∂z · v̄ = z̄``). Vertices that no
sampled edge reaches are skipped, so only ``len(Q)`` partials are stored.

This is the paper's general recipe on scalar graphs; its variance can grow
exponentially with depth on interleaved graphs (section 3.3, Fig. 2b), which is
why the neural-network layers use matrix injection on a single Jacobian instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from . import _errors as errors

__all__ = ["PathGraph", "PathSample"]

_UNARY: dict[str, tuple[Callable[[float], float], Callable[[float, float], float]]] = {
    # op -> (value(x), derivative(x, value))
    "sin": (math.sin, lambda x, y: math.cos(x)),
    "cos": (math.cos, lambda x, y: -math.sin(x)),
    "exp": (math.exp, lambda x, y: y),
    "log": (math.log, lambda x, y: 1.0 / x),
    "tanh": (math.tanh, lambda x, y: 1.0 - y * y),
    "square": (lambda x: x * x, lambda x, y: 2.0 * x),
    "relu": (lambda x: max(x, 0.0), lambda x, y: 1.0 if x > 0 else 0.0),
}
_BINARY = ("add", "sub", "mul", "div")

UNKNOWN_OP = "unknown op {op!r}; known ops: {known}"
NO_OUTPUT = "the graph has no vertex yet; add inputs and ops before differentiating"


@dataclasses.dataclass(frozen=True)
class PathSample:
    """One path-sampling estimate.

    Attributes:
        grad: input name -> estimated ``∂y/∂input``.
        stored_edges: partials kept (``len(Q)``), against ``total_edges`` for reverse mode.
        total_edges: edges in the graph.
        visited: vertices reached by a sampled edge (or inputs).
    """

    grad: dict[str, float]
    stored_edges: int
    total_edges: int
    visited: int


class PathGraph:
    """A small scalar computation graph, built op by op; the last vertex is the output ``y``.

    ``g = PathGraph(); a = g.input("a", 1.5); b = g.input("b", -0.3)``, then
    ``y = g.op("add", g.op("sin", g.op("mul", a, b)), g.op("exp", a))``. Each op records
    its value and the local partials of its incoming edges (the linearized graph).
    """

    def __init__(self) -> None:
        self.values: list[float] = []
        self.names: dict[int, str] = {}
        self.preds: list[list[tuple[int, float]]] = []  # v -> [(u, ∂v/∂u)]
        self.succs: list[list[int]] = []  # u -> [v] (one entry per edge)

    def input(self, name: str, value: float) -> int:
        """Add an input vertex ``θ`` (a leaf we differentiate with respect to)."""
        self.names[len(self.values)] = name
        return self._add(float(value), [])

    def const(self, value: float) -> int:
        """Add a constant vertex (not differentiated; no path starts there)."""
        return self._add(float(value), [])

    def _add(self, value: float, preds: list[tuple[int, float]]) -> int:
        v = len(self.values)
        self.values.append(value)
        self.preds.append(preds)
        self.succs.append([])
        for u, _ in preds:
            self.succs[u].append(v)
        return v

    def op(self, op: str, *args: int) -> int:
        """Add ``op(*args)`` (unary: sin, cos, exp, log, tanh, square, relu; binary: add,
        sub, mul, div) and return its vertex id."""
        xs = [self.values[a] for a in args]
        if op in _UNARY and len(args) == 1:
            f, df = _UNARY[op]
            y = f(xs[0])
            return self._add(y, [(args[0], df(xs[0], y))])
        if op in _BINARY and len(args) == 2:
            (a, b), (x, z) = args, xs
            if op == "add":
                return self._add(x + z, [(a, 1.0), (b, 1.0)])
            if op == "sub":
                return self._add(x - z, [(a, 1.0), (b, -1.0)])
            if op == "mul":
                return self._add(x * z, [(a, z), (b, x)])
            return self._add(x / z, [(a, 1.0 / z), (b, -x / (z * z))])
        known = ", ".join([*_UNARY, *_BINARY])
        raise errors.RadInputError(UNKNOWN_OP.format(op=f"{op}/{len(args)} args", known=known))

    @property
    def output(self) -> int:
        if not self.values:
            raise errors.RadInputError(NO_OUTPUT)
        return len(self.values) - 1

    @property
    def total_edges(self) -> int:
        """Distinct edges ``(u, v)`` of the linearized graph (``e + e`` is one edge)."""
        return len({(u, v) for v, preds in enumerate(self.preds) for u, _ in preds})

    def _reverse(self, partial: dict[tuple[int, int], float]) -> dict[str, float]:
        """Reverse mode over the edges in ``partial`` ((u, v) -> weight), from y."""
        adj = [0.0] * len(self.values)
        adj[self.output] = 1.0
        out_edges: dict[int, list[tuple[int, float]]] = {}
        for (u, v), w in partial.items():
            out_edges.setdefault(u, []).append((v, w))
        for u in range(self.output - 1, -1, -1):
            adj[u] = sum(w * adj[v] for v, w in out_edges.get(u, ()))
        return {name: adj[i] for i, name in self.names.items()}

    def exact_gradient(self) -> dict[str, float]:
        """Reverse-mode AD on the full linearized graph (Bauer's sum over every path)."""
        partial: dict[tuple[int, int], float] = {}
        for v, preds in enumerate(self.preds):
            for u, d in preds:
                partial[(u, v)] = partial.get((u, v), 0.0) + d
        return self._reverse(partial)

    def sample_gradient(
        self, *, k: int = 1, replace: bool = True, generator: torch.Generator | None = None
    ) -> PathSample:
        """Algorithm 1: an unbiased estimate from ``k`` sampled out-edges per reached vertex.

        Args:
            k: out-edges drawn per reached vertex (``d_v/k`` rescaling).
            replace: draw with replacement (Algorithm 1) or ``min(k, d_v)`` distinct edges
                (then ``k ≥`` the largest out-degree reproduces the exact gradient).
            generator: torch generator for the draws (reproducible runs).

        Returns:
            :class:`PathSample`.
        """
        if not isinstance(k, int) or k < 1:
            raise errors.RadInputError(
                f"k must be a positive int (edges drawn per vertex), got {k!r}"
            )
        edge_partial: dict[tuple[int, int], float] = {}
        for v, preds in enumerate(self.preds):
            for u, d in preds:
                edge_partial[(u, v)] = edge_partial.get((u, v), 0.0) + d
        reached = [i in self.names for i in range(len(self.values))]
        q: dict[tuple[int, int], float] = {}
        for v in range(len(self.values)):  # creation order is a topological order
            succ = self.succs[v]
            if not reached[v] or not succ:
                continue
            d = len(succ)
            if replace:
                picks = torch.randint(d, (k,), generator=generator).tolist()
                scale = d / k
            else:
                m = min(k, d)
                picks = torch.randperm(d, generator=generator)[:m].tolist()
                scale = d / m
            for i in picks:
                s = succ[i]
                # an edge listed twice in succ (x*x) carries its summed partial once per listing
                w = edge_partial[(v, s)] / succ.count(s)
                q[(v, s)] = q.get((v, s), 0.0) + scale * w
                reached[s] = True
        return PathSample(
            grad=self._reverse(q),
            stored_edges=len(q),
            total_edges=self.total_edges,
            visited=sum(reached),
        )
