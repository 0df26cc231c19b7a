"""Reaction-diffusion PDE (section 5): exact adjoint = autograd, RAD unbiased, stored state."""

from __future__ import annotations

import pytest
import torch

from leangrad import rad
from leangrad.measure import MemoryTracker, estimator_stats

SMALL = {"n": 6, "steps": 48, "t_end": 0.5}  # D dt/dx^2 = 0.25 * (0.5/48) * 49 = 0.128


def test_exact_adjoint_matches_autograd_float64() -> None:
    p = rad.ReactionDiffusion(**SMALL)
    theta = p.initial_theta(seed=0).requires_grad_()
    loss = rad.pde_loss(p, theta)
    (ref,) = torch.autograd.grad(loss, theta)
    got = rad.pde_gradient(p, theta.detach(), fraction=1.0)
    assert got.loss == pytest.approx(loss.item(), rel=1e-13)
    assert (got.grad - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()
    assert got.stored_values == (p.steps + 1) * p.n**2


@pytest.mark.slow
@pytest.mark.parametrize("replace", [False, True])
def test_rad_gradient_unbiased(replace: bool) -> None:
    # tolerance as in tests/rad/test_layers.py: mean z^2 near 1, |z| under a Bonferroni bound
    p = rad.ReactionDiffusion(**SMALL)
    theta = p.initial_theta(seed=1)
    exact = {"theta": rad.pde_gradient(p, theta).grad}
    seeds = iter(range(10**6))

    def draw() -> dict[str, torch.Tensor]:
        g = rad.pde_gradient(p, theta, fraction=0.2, replace=replace, seed=next(seeds)).grad
        return {"theta": g}

    st = estimator_stats(draw, exact, draws=120)
    assert 0.2 < st.z_mean_square < 2.5, st  # 7 coordinates: mean of 7 chi^2_1 / 7
    assert st.max_abs_z < 4.0, st
    assert st.mean_cosine < 0.9999


def test_stored_state_measured_by_tracker() -> None:
    p = rad.ReactionDiffusion(n=15, steps=512, t_end=1.0)
    theta = p.initial_theta(seed=0)
    peaks = {}
    for fraction in (1.0, 0.02):
        with MemoryTracker(baseline=(theta,)) as tracker:
            rad.pde_gradient(p, theta, fraction=fraction, seed=0)
        peaks[fraction] = tracker.report.peak_bytes
    assert peaks[1.0] >= (p.steps + 1) * p.n**2 * 8  # every phi_t, float64
    # the target: >= 95% less stored state (k = 5 of 225 values per step kept;
    # the rest of the peak is the sweeps' per-step temporaries, a few grids)
    assert peaks[0.02] <= 0.05 * peaks[1.0], peaks


def test_optimisation_converges_with_rad() -> None:
    p = rad.ReactionDiffusion(**SMALL)
    run = rad.optimize(p, p.initial_theta(seed=0), fraction=0.1, iterations=40, lr=0.1)
    assert run.losses[-1] < 0.3 * run.losses[0], run.losses[::10]


def test_unstable_time_step_is_refused() -> None:
    with pytest.raises(rad.StabilityError, match=r"FTCS is unstable: D\*dt/dx\^2 = 2\.56 > 1/4"):
        rad.ReactionDiffusion(n=31, steps=100, t_end=1.0)
    rad.ReactionDiffusion(n=31, steps=1024, t_end=1.0)  # 0.25 exactly: allowed


def test_bad_fraction() -> None:
    p = rad.ReactionDiffusion(**SMALL)
    with pytest.raises(rad.RadInputError, match=r"fraction must be a number in \(0, 1\]"):
        rad.pde_gradient(p, p.initial_theta(seed=0), fraction=0.0)
