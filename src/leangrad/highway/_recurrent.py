"""GRU and LSTM layers unrolled over time, with hand-written J-vjps (paper Table 1, 5.2).

A recurrent layer is a stack whose L layers are the time steps, all sharing the weights
(θ_t = [θ, x_t], section 5.2). Shapes are time-major: inputs ``(L, batch, input_size)``,
outputs ``(L, batch, hidden_size)``, and every step's output may feed a loss
(per-step losses, e.g. language modelling). Weights use ``torch.nn.GRU``/``nn.LSTM``'s
layout and gate order, so :meth:`GRULayer.from_torch` copies a trained module.

- GRU: ``h' = z ⊙ h + (1 − z) ⊙ n`` → ``g = [z, (1 − z) ⊙ n]``, ``r = z1 ⊙ h + z2``,
  ``K = diag(z)``.
- LSTM on the state ``[c, h]``: ``c' = f ⊙ c + i ⊙ g``, ``h' = o ⊙ tanh(c')`` →
  ``r = [z1 ⊙ c + z2, z3]``, ``K = diag([f, 0])``.

The traced forward saves the gates as the few products that the J-vjp multiplies by, so
one J-vjp over all L steps is one element-wise product and one ``(L·B, gH) @ (gH, H)``
matmul; parameter gradients are two more matmuls. (Autograd J-vjps made k ≥ 1 no faster
than BPTT on CPU in the issue's prototype; these make the iterations cheap.)
With ``residual=True`` the layer outputs ``h_t + x_t`` (residuals between stacked
layers, Appendix C.3 "RNNs"), which needs ``input_size == hidden_size``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._protocol import MISMATCHED_SIZES, SHORT_SEQUENCE, HighwayError, HighwayStack, Trace

__all__ = ["GRULayer", "LSTMLayer"]


class _RecurrentLayer(HighwayStack):
    gates: int = 3
    k_structure = "diagonal"

    def __init__(self, input_size: int, hidden_size: int, *, residual: bool = False) -> None:
        super().__init__()
        name = type(self).__name__
        if residual and input_size != hidden_size:
            raise HighwayError(
                MISMATCHED_SIZES.format(
                    where=f"{name}(residual=True)",
                    detail=f"input_size {input_size} != hidden_size {hidden_size}",
                )
            )
        self.input_size, self.hidden_size, self.residual = input_size, hidden_size, residual
        g = self.gates
        self.weight_ih = nn.Parameter(torch.empty(g * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(g * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(g * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(g * hidden_size))
        bound = 1 / math.sqrt(hidden_size)  # torch.nn.GRU/LSTM's default init
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    @classmethod
    def from_torch(cls, module: nn.RNNBase, *, residual: bool = False) -> _RecurrentLayer:
        """A layer with the weights of a one-layer ``nn.GRU``/``nn.LSTM`` (copied)."""
        layer = cls(module.input_size, module.hidden_size, residual=residual)
        with torch.no_grad():
            for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(layer, n).copy_(getattr(module, f"{n}_l0"))
        return layer.to(module.weight_ih_l0.device)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, residual={self.residual}"

    def _check(self, x: torch.Tensor, *, highway: bool) -> None:
        name = type(self).__name__
        if x.dim() != 3 or x.shape[-1] != self.input_size:
            raise HighwayError(
                MISMATCHED_SIZES.format(
                    where=name,
                    detail=f"expected input (L, batch, {self.input_size}), got {tuple(x.shape)}",
                )
            )
        if highway and x.shape[0] < 2:
            raise HighwayError(SHORT_SEQUENCE.format(where=name, length=x.shape[0]))

    def direct_grads(self, trace: Trace, dy: torch.Tensor) -> torch.Tensor:
        return dy

    def _finish(self, g_in: torch.Tensor, g_hh: torch.Tensor, trace: Trace, dy: torch.Tensor):
        """Parameter and input gradients from the gate pre-activation cotangents."""
        x, h_prev = trace.saved["x"], trace.saved["h_prev"]
        gi = g_in.reshape(-1, g_in.shape[-1])
        gh = g_hh.reshape(-1, g_hh.shape[-1])
        grads = {
            self.weight_ih: gi.t() @ x.reshape(-1, x.shape[-1]),
            self.weight_hh: gh.t() @ h_prev.reshape(-1, h_prev.shape[-1]),
            self.bias_ih: gi.sum(0),
            self.bias_hh: gh.sum(0),
        }
        dx = (gi @ self.weight_ih.detach()).reshape(x.shape)
        if self.residual:
            dx = dx + dy
        return {p: g for p, g in grads.items() if p.requires_grad}, dx


class GRULayer(_RecurrentLayer):
    """One GRU layer over time (``torch.nn.GRU`` equations, gate order r, z, n).

    Args:
        input_size, hidden_size: as ``nn.GRU``.
        residual: output ``h_t + x_t`` (needs ``input_size == hidden_size``).
    """

    gates = 3

    def _run(self, x: torch.Tensor, save: bool) -> tuple[torch.Tensor, dict]:
        length, batch, _ = x.shape
        hsz = self.hidden_size
        xi = torch.addmm(self.bias_ih, x.reshape(-1, self.input_size), self.weight_ih.t())
        xi = xi.reshape(length, batch, 3 * hsz)
        h = x.new_zeros(batch, hsz)
        outs = []
        saved: dict[str, list[torch.Tensor]] = {"r": [], "z": [], "n": [], "hn": []}
        for t in range(length):
            hh = torch.addmm(self.bias_hh, h, self.weight_hh.t())
            rz = torch.sigmoid(xi[t, :, : 2 * hsz] + hh[:, : 2 * hsz])
            r, z = rz[:, :hsz], rz[:, hsz:]
            hn = hh[:, 2 * hsz :]
            n = torch.tanh(torch.addcmul(xi[t, :, 2 * hsz :], r, hn))
            h = torch.lerp(n, h, z)  # z ⊙ h + (1 − z) ⊙ n
            outs.append(h)
            if save:
                for key, val in (("r", r), ("z", z), ("n", n), ("hn", hn)):
                    saved[key].append(val)
        return torch.stack(outs), saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x, highway=False)
        hs, _ = self._run(x, save=False)
        return hs + x if self.residual else hs

    def trace(self, x: torch.Tensor) -> Trace:
        self._check(x, highway=True)
        with torch.no_grad():
            x = x.detach()
            hs, s = self._run(x, save=True)
            r, z, n, hn = (torch.stack(s[k]) for k in ("r", "z", "n", "hn"))
            h_prev = torch.cat([hs.new_zeros(1, *hs.shape[1:]), hs[:-1]])
            c_n = (1 - z) * (1 - n * n)  # ∂h'/∂(n pre-activation)
            c_z = (h_prev - n) * z * (1 - z)  # ∂h'/∂(z pre-activation)
            c_r = c_n * hn * r * (1 - r)  # ∂h'/∂(r pre-activation)
            coef_hh = torch.cat([c_r, c_z, c_n * r], -1)  # cotangent factors of W_hh·h
            out = hs + x if self.residual else hs
        saved = {"x": x, "h_prev": h_prev, "coef_hh": coef_hh, "c_n": c_n}
        return Trace(output=out, length=x.shape[0], k=z, saved=saved)

    def _g_hh(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        return w.repeat(1, 1, 3) * trace.saved["coef_hh"]

    def j_vjp(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        g = self._g_hh(trace, w)
        return (g.reshape(-1, g.shape[-1]) @ self.weight_hh.detach()).reshape(w.shape)

    def param_vjp(self, trace: Trace, w: torch.Tensor, dy: torch.Tensor):
        g_hh = self._g_hh(trace, w)
        hsz = self.hidden_size
        g_in = torch.cat([g_hh[..., : 2 * hsz], w * trace.saved["c_n"]], -1)
        return self._finish(g_in, g_hh, trace, dy)


class LSTMLayer(_RecurrentLayer):
    """One LSTM layer over time (``torch.nn.LSTM`` equations, gate order i, f, g, o).

    The highway state is ``[c_t, h_t]`` concatenated on the last axis; the layer's output
    is the sequence of ``h_t`` (plus ``x_t`` with ``residual=True``).
    """

    gates = 4

    def _run(self, x: torch.Tensor, save: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
        length, batch, _ = x.shape
        hsz = self.hidden_size
        xi = torch.addmm(self.bias_ih, x.reshape(-1, self.input_size), self.weight_ih.t())
        xi = xi.reshape(length, batch, 4 * hsz)
        h = x.new_zeros(batch, hsz)
        c = x.new_zeros(batch, hsz)
        hs, cs = [], []
        saved: dict[str, list[torch.Tensor]] = {"gates": [], "tc": []}
        for t in range(length):
            pre = xi[t] + torch.addmm(self.bias_hh, h, self.weight_hh.t())
            ifo = torch.sigmoid(pre[:, : 2 * hsz])
            i, f = ifo[:, :hsz], ifo[:, hsz:]
            o = torch.sigmoid(pre[:, 3 * hsz :])
            gg = torch.tanh(pre[:, 2 * hsz : 3 * hsz])
            c = torch.addcmul(f * c, i, gg)
            tc = torch.tanh(c)
            h = o * tc
            hs.append(h)
            cs.append(c)
            if save:
                saved["gates"].append(torch.cat([i, f, gg, o], -1))
                saved["tc"].append(tc)
        return torch.stack(hs), torch.stack(cs), saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x, highway=False)
        hs, _, _ = self._run(x, save=False)
        return hs + x if self.residual else hs

    def trace(self, x: torch.Tensor) -> Trace:
        self._check(x, highway=True)
        hsz = self.hidden_size
        with torch.no_grad():
            x = x.detach()
            hs, cs, s = self._run(x, save=True)
            gates, tc = torch.stack(s["gates"]), torch.stack(s["tc"])
            i, f, gg, o = gates.split(hsz, -1)
            zero = hs.new_zeros(1, *hs.shape[1:])
            h_prev, c_prev = torch.cat([zero, hs[:-1]]), torch.cat([zero, cs[:-1]])
            q = o * (1 - tc * tc)  # ∂h'/∂c'
            # With s = w_c + w_h ⊙ q (the cotangent reaching c'), the gate pre-activation
            # cotangents are s ⊙ [a_i, a_f, a_g] and w_h ⊙ a_o:
            coef = torch.cat(
                [gg * i * (1 - i), c_prev * f * (1 - f), i * (1 - gg * gg), tc * o * (1 - o)], -1
            )
            k = torch.cat([f, torch.zeros_like(f)], -1)
            out = hs + x if self.residual else hs
        saved = {"x": x, "h_prev": h_prev, "coef": coef, "q": q, "qf": q * f}
        return Trace(output=out, length=x.shape[0], k=k, saved=saved)

    def direct_grads(self, trace: Trace, dy: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(dy), dy], -1)

    def _g(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        hsz = self.hidden_size
        wc, wh = w[..., :hsz], w[..., hsz:]
        s = torch.addcmul(wc, wh, trace.saved["q"])
        return torch.cat([s, s, s, wh], -1) * trace.saved["coef"]

    def j_vjp(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        g = self._g(trace, w)
        dh = (g.reshape(-1, g.shape[-1]) @ self.weight_hh.detach()).reshape(*w.shape[:-1], -1)
        dc = w[..., self.hidden_size :] * trace.saved["qf"]
        return torch.cat([dc, dh], -1)

    def param_vjp(self, trace: Trace, w: torch.Tensor, dy: torch.Tensor):
        g = self._g(trace, w)
        return self._finish(g, g, trace, dy)
