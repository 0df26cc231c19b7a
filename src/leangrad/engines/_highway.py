"""``highway``: Highway backpropagation (Fagnou et al., sections 4.2-4.3, eq. 6-13).

For each :class:`~leangrad.highway.HighwayStack` of a
:class:`~leangrad.highway.HighwayNet`, from the top one down:

1. ``w⁰ = CumSumProd(∂L_t/∂h_t, K)`` — the gradient along the residual path only (eq. 10);
2. ``k`` rounds of (i) one batched vjp through every layer's J (eq. 8) and (ii) the scan
   ``w^{k+1} = w⁰ + CumSumProd(shift(w^k J), K)`` (eq. 11);
3. parameter gradients and the stack input's gradient in one batched vjp.

``w^k`` is the sum of the gradients of all paths through at most k blocks (Theorem 2),
so the result is exact once ``k ≥ L − 1`` (the engine stops there). ``baseline="fpi"``
is the fixed-point iteration of Wang & Ragni (g = f, r = z, K = 0): the same loop with
``w^{k+1} = ∂L/∂h + shift(w^k (J + K))``. With ``tol`` the loop stops early once an
update's relative norm ``‖w^{k+1} − w^k‖ / ‖w^{k+1}‖`` falls below ``tol`` (``k`` then
caps the iterations). Cost (eq. 13): forward + k batched J-vjps + k scans of
O(log L) depth; memory: the stacks' saved gates plus ``w⁰``, ``w`` and the scan's
products (Appendix D).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .. import _errors as errors
from ..layers._highway import NOT_HIGHWAY, HighwayError, HighwayNet, HighwayStack, Trace
from ._base import (
    Engine,
    LossFn,
    OnGrad,
    PlanOffer,
    PlanOrder,
    StepResult,
    accumulate_grad,
    check_loss,
    run_forward,
)
from ._catalog import register
from ._contract import forward_end
from ._scan import SCANS, Scan, cumsumprod

if TYPE_CHECKING:
    from ._blocks import Blocks

__all__ = ["BAD_BASELINE", "BAD_K", "BAD_SCAN", "BAD_TOL", "Highway", "StackResult"]

BAD_K = "highway: k must be an int >= 0 (the number of Highway-BP iterations), got {value!r}"
BAD_SCAN = "highway: scan must be one of {known}, got {value!r}"
BAD_BASELINE = "highway: baseline must be 'highway' or 'fpi', got {value!r}"
BAD_TOL = "highway: tol must be None or a float > 0 (relative update norm), got {value!r}"


@dataclasses.dataclass(frozen=True)
class StackResult:
    """Per-stack facts of one step: L, iterations run, and each update's relative norm."""

    length: int
    iterations: int
    updates: tuple[float, ...]


def _as_net(model: nn.Module) -> HighwayNet | None:
    if isinstance(model, HighwayNet):
        return model
    if isinstance(model, HighwayStack):
        return HighwayNet(None, [model], None)
    return None


@register("highway")
class Highway(Engine):
    """Highway-BP with ``k`` iterations (exact only at ``k ≥ L − 1``).

    Args:
        k: iterations (``0``: residual path only). Trade-off: time grows by one batched
            J-vjp and one scan per iteration; the error falls as paths through more
            blocks are added (Theorem 2).
        scan: ``"parallel"`` (Hillis-Steele, O(log L) depth), ``"sequential"`` (O(L)
            loop) or ``"auto"`` (by state size; see :mod:`leangrad.engines._scan`).
        baseline: ``"highway"`` or ``"fpi"`` (fixed-point iteration, K = 0).
        tol: stop early when the update's relative norm is below ``tol``.
    """

    exact = False
    transforms_act_on = "stem_head"

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        """On a :class:`~leangrad.highway.HighwayNet` where ``exact=False``: the
        residual path alone (``k=0``) and two iterations (after rad's offers)."""
        del found, loss_fn
        if exact or not isinstance(model, HighwayNet):
            return []
        return [PlanOffer("highway", {"k": k}, PlanOrder.ESTIMATORS + 1) for k in (0, 2)]

    def __init__(
        self,
        *,
        k: int = 2,
        scan: Scan = "auto",
        baseline: str = "highway",
        tol: float | None = None,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise HighwayError(BAD_K.format(value=k))
        if scan not in SCANS:
            raise HighwayError(BAD_SCAN.format(known=", ".join(SCANS), value=scan))
        if baseline not in ("highway", "fpi"):
            raise HighwayError(BAD_BASELINE.format(value=baseline))
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0
        ):
            raise HighwayError(BAD_TOL.format(value=tol))
        super().__init__(k=k, scan=scan, baseline=baseline, tol=tol)
        self.k, self.scan, self.baseline, self.tol = k, scan, baseline, tol

    def supports(self, model: nn.Module) -> str | None:
        if _as_net(model) is None:
            return NOT_HIGHWAY.format(model=type(model).__name__)
        return None

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        net = _as_net(model)
        if net is None:
            raise errors.EngineInputError(NOT_HIGHWAY.format(model=type(model).__name__))
        x0 = run_forward(self.label, net.stem, inputs) if net.stem is not None else inputs[0]
        x = x0.detach()
        traces: list[Trace] = []
        stacks = cast("list[HighwayStack]", list(net.stacks))
        for st in stacks:
            traces.append(st.trace(x))
            x = traces[-1].output
        xh = x.detach().requires_grad_()
        out = run_forward(self.label, net.head, (xh,)) if net.head is not None else xh
        loss = check_loss(loss_fn(out))
        forward_end()

        grads: dict[nn.Parameter, torch.Tensor] = {}
        head_params = [p for p in net.head.parameters() if p.requires_grad] if net.head else []
        hg = torch.autograd.grad(loss, [xh, *head_params], allow_unused=True)
        _add(grads, head_params, hg[1:])
        dy = hg[0] if hg[0] is not None else torch.zeros_like(xh)
        results: list[StackResult] = []
        for st in reversed(stacks):
            pg, dy, res = self.stack_backward(st, traces.pop(), dy)  # frees each trace
            _add(grads, list(pg), pg.values())
            results.append(res)
        # The stem (autograd) and the inputs that want a .grad, as loss.backward() does.
        wanted = [x for x in inputs if x.requires_grad]
        if net.stem is not None:
            stem_params = [p for p in net.stem.parameters() if p.requires_grad]
            if (stem_params or wanted) and x0.requires_grad:
                sg = torch.autograd.grad(x0, [*stem_params, *wanted], dy, allow_unused=True)
                _add(grads, stem_params, sg[: len(stem_params)])
                _add_input_grads(wanted, sg[len(stem_params) :])
        elif wanted:
            _add_input_grads(wanted[:1], [dy])
        for name, p in params.items():
            if p not in grads:  # unused by the loss: autograd leaves .grad as it is too
                continue
            accumulate_grad(p, grads.pop(p))
            if on_grad is not None:
                on_grad(name, p)
        results.reverse()
        return self._result(
            loss,
            iterations=[r.iterations for r in results],
            lengths=[r.length for r in results],
            updates=[list(r.updates) for r in results],
        )

    def stack_backward(
        self, stack: HighwayStack, trace: Trace, dy: torch.Tensor
    ) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor, StackResult]:
        """Highway-BP through one stack: ``(parameter grads, input grad, facts)``."""
        stack.prepare(trace)
        a = stack.direct_grads(trace, dy)
        k_fac = trace.k
        fpi = self.baseline == "fpi"
        # eq. 10 (the identity when the direct gradients vanish wherever K acts)
        w0 = a if fpi or stack.direct_off_support else self._scan(stack, a, k_fac)
        del a  # only w0 is needed from here on
        cap = min(self.k, trace.length - 1)  # w^{L-1} is exact (Theorem 2)
        w, cur = w0, w0  # cur: this iteration's w (w0 itself the first time: no copy)
        if cap > 0:  # w^k lands in its own buffer: w[:-1] = w0[:-1] + u, w[-1] = w0[-1]
            w = torch.empty_like(w0)
            w[-1] = w0[-1]
        k_tail = None if k_fac is None else k_fac[:-1]
        updates: list[float] = []
        done = 0
        for _ in range(cap):
            jw = stack.j_vjp(trace, cur)  # eq. 8, all layers at once (ours to overwrite)
            if fpi:
                self._add_k_times(stack, jw, cur, k_fac)
            u = jw[1:]  # v_t = w_{t+1} J_{t+1}; the last state has no successor
            if not fpi:
                self._scan(stack, u, k_tail, inplace=True)  # eq. 11
            done += 1
            change = None if self.tol is None else torch.linalg.vector_norm(w0[:-1] + u - cur[:-1])
            torch.add(w0[:-1], u, out=w[:-1])
            cur = w
            if change is not None:
                rel = float(change / torch.linalg.vector_norm(w).clamp_min(1e-30))
                updates.append(rel)
                if self.tol is not None and rel < self.tol:
                    break
        pg, dx = stack.param_vjp(trace, w, dy)
        return pg, dx, StackResult(length=trace.length, iterations=done, updates=tuple(updates))

    def _scan(self, stack: HighwayStack, v: torch.Tensor, k: torch.Tensor | None, *,
              inplace: bool = False) -> torch.Tensor:  # fmt: skip
        """CumSumProd of ``v`` by ``k``, over the part of the state where K may be non-zero
        (``stack.k_support()``, which ``k`` then covers alone); elsewhere K = 0, ``u = v``."""
        part = stack.k_support() if k is not None else None
        if part is None:
            return cumsumprod(v, k, scan=self.scan, inplace=inplace)
        u = v if inplace else v.clone()
        cumsumprod(u[..., part], k, scan=self.scan, inplace=True)
        return u

    @staticmethod
    def _add_k_times(stack: HighwayStack, jw: torch.Tensor, w: torch.Tensor,
                     k: torch.Tensor | None) -> None:  # fmt: skip
        """``jw += K w`` (the fixed-point baseline's residual term), K on its support."""
        if k is None:
            jw.add_(w)
            return
        part = stack.k_support() or slice(None)
        jw[..., part].addcmul_(w[..., part], k)  # a scalar K of shape (L, 1, …) broadcasts


def _add(grads: dict[nn.Parameter, torch.Tensor], params: list[Any], gs: Any) -> None:
    for p, g in zip(params, gs, strict=True):
        if g is not None:
            grads[p] = grads[p] + g if p in grads else g


def _add_input_grads(xs: list[torch.Tensor], gs: Any) -> None:
    """Accumulate into ``x.grad`` like autograd (a leaf input) — set, or add."""
    for x, g in zip(xs, gs, strict=True):
        if g is None or not x.is_leaf:
            continue
        x.grad = g.detach() if x.grad is None else x.grad + g.detach()
