"""The reaction-diffusion control problem of Randomized AD, section 5 and Appendix B.

``∂φ/∂t = D ∇²φ + C(x, t, θ) φ`` on the unit square, ``φ = 0`` on the boundary,
``φ₀ = sin(πx) sin(πy)``, stepped by explicit FTCS,
``φ_{t+1} = M φ_t + Δt C_t φ_t`` (stable when ``D Δt / Δx² ≤ 1/4``). The control
``C = θ₀ + θ₁ sin πt + θ₂ cos πt + θ₃ sin 2πx sin πt + θ₄ sin 2πx cos πt
+ θ₅ cos 2πx sin πt + θ₆ cos 2πx cos πt`` is fitted so that ``φ_t`` follows
``φ₀ + ¼ sin(πt) sin(2πx) sin(πy)``; the loss is ``L = 1/T Σ_t mean((φ_t − target_t)²)``.

The gradient is computed by a hand-written adjoint (reverse sweep): ``a_T = ∂ℓ_T/∂φ_T``,
``a_t = ∂ℓ_t/∂φ_t + A_tᵀ a_{t+1}`` with ``A_t = M + Δt diag(C_t)`` (symmetric, rebuilt
from θ; C is never stored), and ``∂L/∂θ = Σ_t Δt ⟨a_{t+1}, φ_t ∂C_t/∂θ⟩``. Backprop
stores every ``φ_t``. RAD (section 5, the estimator after eq. 10) stores a random
``fraction`` of each ``φ_t`` (indices regenerated from a seed) and uses the rescaled
sample ``P_t φ_t`` in both places ``φ_t`` appears: ``∂ℓ_t/∂φ_t`` and ``∂φ_{t+1}/∂C_t``.
``P_t`` is independent of every ``P_s`` (s > t) inside ``a_{t+1}``, so the estimate is
unbiased; the state Jacobians ``M`` carry no sampling, so variance does not explode.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..measure import FORWARD_END, mark
from . import _errors as errors
from ._sampling import check_fraction

__all__ = ["PdeGradient", "PdeRun", "ReactionDiffusion", "optimize", "pde_gradient", "pde_loss"]


@dataclasses.dataclass(frozen=True)
class ReactionDiffusion:
    """The discretised problem (Appendix B, scaled down for a CPU).

    Attributes:
        n: interior grid points per side (``Δx = 1/(n+1)``); the paper uses 31.
        steps: time steps ``T``; ``Δt = t_end / steps`` (the paper: Δt = 1/4096).
        t_end: simulated time (the paper: 10).
        D: diffusion coefficient (the paper: 1/4).
        dtype: floating-point dtype of the state.

    Raises:
        StabilityError: ``D Δt / Δx² > 1/4`` (FTCS would blow up).
    """

    n: int = 15
    steps: int = 1024
    t_end: float = 2.0
    D: float = 0.25
    dtype: torch.dtype = torch.float64

    def __post_init__(self) -> None:
        ratio = self.D * self.dt / self.dx**2
        if ratio > 0.25 + 1e-12:
            raise errors.StabilityError(
                errors.UNSTABLE_STEP.format(
                    ratio=ratio, D=self.D, dt=self.dt, dx=self.dx, dt_max=self.dx**2 / (4 * self.D)
                )
            )

    @property
    def dx(self) -> float:
        return 1.0 / (self.n + 1)

    @property
    def dt(self) -> float:
        return self.t_end / self.steps

    def grid(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Interior coordinates ``x_i = i Δx``, i = 1..n."""
        return torch.arange(1, self.n + 1, device=device, dtype=self.dtype) * self.dx

    def phi0(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``φ₀ = sin(πx) sin(πy)`` on the interior, shape ``(n, n)`` (x along rows)."""
        s = torch.sin(math.pi * self.grid(device))
        return s[:, None] * s[None, :]

    def target(self, t: float, phi0: torch.Tensor) -> torch.Tensor:
        """``φ₀ + ¼ sin(πt) sin(2πx) sin(πy)``."""
        g = self.grid(phi0.device)
        bump = torch.sin(2 * math.pi * g)[:, None] * torch.sin(math.pi * g)[None, :]
        return phi0 + 0.25 * math.sin(math.pi * t) * bump

    def basis(self, t: float, device: torch.device | str | None = None) -> torch.Tensor:
        """``∂C_t/∂θ``: the ``(n, 7)`` Fourier terms at time ``t`` (C varies along x only)."""
        g = self.grid(device)
        st, ct = math.sin(math.pi * t), math.cos(math.pi * t)
        s2, c2 = torch.sin(2 * math.pi * g), torch.cos(2 * math.pi * g)
        one = torch.ones_like(g)
        return torch.stack([one, st * one, ct * one, s2 * st, s2 * ct, c2 * st, c2 * ct], 1)

    def stable_theta0(self) -> float:
        """θ₀ that keeps the discrete φ₀ stationary: ``D`` times minus its Laplacian eigenvalue."""
        return self.D * 8 / self.dx**2 * math.sin(math.pi * self.dx / 2) ** 2

    def initial_theta(self, *, seed: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Appendix B: stable θ₀, the other six uniform (here on [-1, 1])."""
        gen = torch.Generator().manual_seed(seed)
        theta = torch.rand(7, generator=gen, dtype=self.dtype) * 2 - 1
        theta[0] = self.stable_theta0()
        return theta.to(device)

    def step(self, phi: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """One FTCS step ``φ + D Δt/Δx² ∇²φ + Δt C φ`` (zero Dirichlet boundary).

        Symmetric in ``φ``, so it is also the adjoint step ``A_tᵀ a``.
        """
        p = torch.nn.functional.pad(phi, (1, 1, 1, 1))
        lap = p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4 * phi
        return phi + (self.D * self.dt / self.dx**2) * lap + self.dt * c[:, None] * phi


def pde_loss(problem: ReactionDiffusion, theta: torch.Tensor) -> torch.Tensor:
    """The loss by plain autograd-able simulation (the oracle for :func:`pde_gradient`)."""
    phi0 = problem.phi0(theta.device)
    phi, total = phi0, theta.new_zeros(())
    for t in range(problem.steps):
        phi = problem.step(phi, problem.basis(t * problem.dt, theta.device) @ theta)
        total = total + (phi - problem.target((t + 1) * problem.dt, phi0)).square().mean()
    return total / problem.steps


@dataclasses.dataclass(frozen=True)
class PdeGradient:
    """One gradient evaluation.

    Attributes:
        loss: the exact loss (the forward is never randomized).
        grad: ``∂L/∂θ`` (exact at fraction 1, else an unbiased estimate).
        stored_values: numbers of ``φ`` stored for the reverse sweep, over all steps.
    """

    loss: float
    grad: torch.Tensor
    stored_values: int


def _indices(size: int, k: int, seed: int, replace: bool, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    if replace:
        return torch.randint(size, (k,), generator=gen, device=device)
    return torch.randperm(size, generator=gen, device=device)[:k]


@torch.no_grad()
def pde_gradient(
    problem: ReactionDiffusion,
    theta: torch.Tensor,
    *,
    fraction: float = 1.0,
    replace: bool = False,
    seed: int = 0,
) -> PdeGradient:
    """Loss and (RAD) gradient of the control problem by a forward sweep and an adjoint sweep.

    Args:
        problem: the discretised PDE.
        theta: the 7 control coefficients.
        fraction: share of each ``φ_t`` stored, in (0, 1]; 1 stores all (exact gradient).
        replace: sample grid points with replacement instead of without.
        seed: base seed; step ``t`` uses ``seed·(T+1) + t``, regenerated in the reverse sweep.

    Returns:
        :class:`PdeGradient`.

    Trade-off: stored state falls from ``(T+1)·n²`` to ``(T+1)·⌈fraction·n²⌉`` numbers for
    gradient variance; no recomputation (section 5: "up to 99% of memory").
    """
    fraction = check_fraction(fraction)
    T, n2, dev = problem.steps, problem.n**2, theta.device
    exact = fraction >= 1.0
    k = n2 if exact else max(1, math.ceil(fraction * n2 - 1e-9))
    scale = n2 / k

    def idx(t: int) -> torch.Tensor:
        return _indices(n2, k, seed * (T + 1) + t, replace, dev)

    phi0 = problem.phi0(dev)
    phi, loss = phi0, 0.0
    stored = [phi0.reshape(-1) if exact else phi0.reshape(-1)[idx(0)]]
    for t in range(T):
        phi = problem.step(phi, problem.basis(t * problem.dt, dev) @ theta)
        loss += (phi - problem.target((t + 1) * problem.dt, phi0)).square().mean().item()
        stored.append(phi.reshape(-1).clone() if exact else phi.reshape(-1)[idx(t + 1)])
    del phi
    mark(FORWARD_END)  # a MemoryTracker, if any, records the stored state here
    grad = torch.zeros_like(theta)
    a = theta.new_zeros(n2)  # A_Tᵀ a_{T+1} = 0
    w = 2.0 / (T * n2)  # ∂ℓ_t/∂φ_t = w (φ_t − target_t)
    for t in range(T, -1, -1):
        # a_t = P_t ∂ℓ_t/∂φ_t + A_tᵀ a_{t+1} (a already holds the second term)
        if t > 0:
            tgt = problem.target(t * problem.dt, phi0).reshape(-1)
            if exact:
                a = a + w * (stored[t] - tgt)
            else:
                i = idx(t)
                a = a.index_add(0, i, w * scale * (stored[t] - tgt[i]))
        if t == 0:
            break
        # ∂L/∂θ += Δt Σ a_t ⊙ P_{t-1} φ_{t-1} ⊙ ∂C_{t-1}/∂θ, then a ← A_{t-1}ᵀ a_t
        basis = problem.basis((t - 1) * problem.dt, dev)
        if exact:
            prod = (a * stored[t - 1]).reshape(problem.n, problem.n)
        else:
            i = idx(t - 1)
            prod = a.new_zeros(n2).index_add_(0, i, scale * a[i] * stored[t - 1])
            prod = prod.reshape(problem.n, problem.n)
        grad += problem.dt * (basis.T @ prod.sum(1))
        stored[t] = stored[t][:0]  # free what the sweep no longer needs
        c = basis @ theta
        a = problem.step(a.reshape(problem.n, problem.n), c).reshape(-1)
    return PdeGradient(loss=loss / T, grad=grad, stored_values=(T + 1) * k)


@dataclasses.dataclass(frozen=True)
class PdeRun:
    """An optimisation run: the exact loss before each Adam step, and the final θ."""

    losses: list[float]
    theta: torch.Tensor
    stored_values: int


def optimize(
    problem: ReactionDiffusion,
    theta0: torch.Tensor,
    *,
    fraction: float = 1.0,
    iterations: int = 100,
    lr: float = 0.05,
    seed: int = 0,
    replace: bool = False,
    tick: object = None,
) -> PdeRun:
    """Adam on θ from :func:`pde_gradient` (Appendix B: "The Adam optimizer is used").

    Args:
        problem, theta0: the problem and the starting control.
        fraction, replace: as :func:`pde_gradient`; iteration ``i`` uses seed ``seed + i``.
        iterations, lr: Adam steps and learning rate.
        tick: optional callable run after each step (a progress bar's ``update``).

    Returns:
        :class:`PdeRun` (``losses[i]`` is the exact loss at the i-th iterate).
    """
    theta = theta0.detach().clone().requires_grad_()
    opt = torch.optim.Adam([theta], lr=lr)
    losses, stored = [], 0
    for i in range(iterations):
        res = pde_gradient(
            problem, theta.detach(), fraction=fraction, replace=replace, seed=seed + i
        )
        losses.append(res.loss)
        stored = res.stored_values
        theta.grad = res.grad
        opt.step()
        if callable(tick):
            tick()
    losses.append(pde_gradient(problem, theta.detach(), fraction=1.0).loss)
    return PdeRun(losses=losses, theta=theta.detach(), stored_values=stored)
