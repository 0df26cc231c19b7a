"""Path sampling (section 3.1, Algorithm 1): exact reverse mode = autograd; samples unbiased."""

from __future__ import annotations

import math

import pytest
import torch

from leangrad import rad
from leangrad.measure import estimator_stats


def _graph(a: float, b: float) -> rad.PathGraph:
    g = rad.PathGraph()
    ia, ib = g.input("a", a), g.input("b", b)
    c = g.op("mul", ia, ib)
    d = g.op("sin", c)
    e = g.op("exp", ia)
    f = g.op("mul", d, e)
    h = g.op("tanh", g.op("add", c, e))
    s = g.op("square", g.op("sub", f, ib))
    g.op("add", g.op("add", f, h), g.op("div", s, g.op("add", e, e)))
    return g


def _torch_value(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a * b
    e = torch.exp(a)
    f = torch.sin(c) * e
    return f + torch.tanh(c + e) + (f - b).square() / (e + e)


def test_exact_gradient_matches_autograd() -> None:
    a = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-1.3, dtype=torch.float64, requires_grad=True)
    y = _torch_value(a, b)
    ga, gb = torch.autograd.grad(y, (a, b))
    g = _graph(0.7, -1.3)
    assert g.values[g.output] == pytest.approx(y.item(), rel=1e-14)
    exact = g.exact_gradient()
    assert exact["a"] == pytest.approx(ga.item(), rel=1e-12)
    assert exact["b"] == pytest.approx(gb.item(), rel=1e-12)


@pytest.mark.parametrize(("k", "replace"), [(1, True), (2, True), (1, False)])
def test_path_sampling_unbiased(k: int, replace: bool) -> None:
    # mean z^2 over 2 coordinates ~ chi^2_2 / 2 (99.9% quantile 6.9); |z| < 4 (Bonferroni 1e-4)
    g = _graph(0.7, -1.3)
    exact = {n: torch.tensor(v, dtype=torch.float64) for n, v in g.exact_gradient().items()}
    gen = torch.Generator().manual_seed(0)

    def draw() -> dict[str, torch.Tensor]:
        s = g.sample_gradient(k=k, replace=replace, generator=gen)
        return {n: torch.tensor(v, dtype=torch.float64) for n, v in s.grad.items()}

    st = estimator_stats(draw, exact, draws=3000)
    assert st.z_mean_square < 6.9 and st.max_abs_z < 4.0, st
    assert st.mean_cosine < 0.999  # it is random


def test_all_edges_without_replacement_is_exact() -> None:
    g = _graph(0.2, 0.9)
    s = g.sample_gradient(k=max(len(x) for x in g.succs), replace=False)
    exact = g.exact_gradient()
    assert s.stored_edges == g.total_edges
    for n in exact:
        assert s.grad[n] == pytest.approx(exact[n], rel=1e-14)


def test_independent_paths_store_few_edges() -> None:
    # Fig. 2a: theta -> 32 independent chains of depth 8 -> sum. One sampled path per draw.
    g = rad.PathGraph()
    theta = g.input("theta", 0.3)
    ends = []
    for i in range(32):
        v = g.op("mul", theta, g.const(1.0 + i / 32))
        for _ in range(8):
            v = g.op("sin", v)
        ends.append(v)
    total = ends[0]
    for v in ends[1:]:
        total = g.op("add", total, v)
    s = g.sample_gradient(k=1, generator=torch.Generator().manual_seed(0))
    assert s.stored_edges < 0.25 * g.total_edges, (s.stored_edges, g.total_edges)
    exact = g.exact_gradient()["theta"]
    draws = [
        g.sample_gradient(k=1, generator=torch.Generator().manual_seed(i)).grad["theta"]
        for i in range(400)
    ]
    mean = sum(draws) / len(draws)
    sd = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1))
    assert abs(mean - exact) < 4 * sd / math.sqrt(len(draws))


def test_bad_op_and_k() -> None:
    g = rad.PathGraph()
    a = g.input("a", 1.0)
    with pytest.raises(rad.RadInputError, match=r"unknown op 'pow/2 args'; known ops: sin"):
        g.op("pow", a, a)
    with pytest.raises(rad.RadInputError, match="k must be a positive int"):
        g.sample_gradient(k=0)
