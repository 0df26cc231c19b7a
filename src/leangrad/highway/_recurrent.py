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
from collections.abc import Iterator

import torch
from torch import nn

from ..layers._highway import MISMATCHED_SIZES, SHORT_SEQUENCE, HighwayError, HighwayStack, Trace

__all__ = ["CHUNK_ROWS", "GRULayer", "LSTMLayer"]

CHUNK_ROWS = 2048
"""The GRU/LSTM J-vjp and parameter vjp run over chunks of about this many (step, example)
rows: matmuls stay large (efficient), the gate-cotangent buffer stays small (memory)."""


class _RecurrentLayer(HighwayStack):
    gates: int = 3
    k_structure = "diagonal"
    time_first = True

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
        return layer.to(module.get_parameter("weight_ih_l0").device)

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

    separate_input_gates = False
    """Whether ``W_ih·x`` gets other gate cotangents than ``W_hh·h`` (the GRU's n gate:
    :meth:`_input_gates` rewrites them, and ``bias_ih`` gets its own sum)."""

    def _input_gates(self, trace: Trace, w: torch.Tensor, sl: slice, g: torch.Tensor) -> None:
        """Turn a chunk's ``W_hh·h`` gate cotangents ``g`` into the ``W_ih·x`` ones, in place
        (only where :attr:`separate_input_gates`)."""

    def _chunk_buffers(self, trace: Trace, w: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(steps, buffer)`` over chunks of about CHUNK_ROWS rows: the buffer is the chunk's
        rows of one ``(step, batch, gates, H)`` gate-cotangent buffer, reused across chunks
        and calls (a few big matmuls, a small buffer)."""
        s, length, batch = trace.saved, w.shape[0], w.shape[1]
        step = max(1, min(length, CHUNK_ROWS // max(batch, 1)))
        if "g" not in s:
            s["g"] = w.new_empty(step, batch, self.gates, self.hidden_size)
        for t0 in range(0, length, step):
            sl = slice(t0, min(t0 + step, length))
            yield sl, s["g"][: sl.stop - sl.start]

    def _chunks(self, trace: Trace, w: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(steps, gate cotangents of W_hh·h)`` per chunk of :meth:`_chunk_buffers`."""
        raise NotImplementedError

    @staticmethod
    def _jw_buffer(trace: Trace, w: torch.Tensor) -> torch.Tensor:
        """The J-vjp's output buffer, reused across calls (the engine may overwrite it until
        the next)."""
        s = trace.saved
        if "jw" not in s:
            s["jw"] = torch.empty_like(w)
        return s["jw"]

    def param_vjp(
        self, trace: Trace, w: torch.Tensor, dy: torch.Tensor
    ) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor]:
        """Weight, bias and input gradients over chunks of steps: per chunk, two matmuls
        into the weight gradients and one into ``dx``."""
        s, hsz = trace.saved, self.hidden_size
        x, h_prev = s["x"], s["h_prev"]
        w_ih = self.weight_ih.detach()
        d_hh, d_ih = torch.zeros_like(self.weight_hh), torch.zeros_like(self.weight_ih)
        b_hh = torch.zeros_like(self.bias_hh)
        b_ih = torch.zeros_like(self.bias_ih) if self.separate_input_gates else b_hh
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)  # x may be a view
        for sl, g in self._chunks(trace, w):
            g2 = g.view(-1, self.gates * hsz)
            d_hh.addmm_(g2.t(), h_prev[sl].reshape(-1, hsz))
            b_hh += g2.sum(0)
            if self.separate_input_gates:
                self._input_gates(trace, w, sl, g)
                b_ih += g2.sum(0)
            d_ih.addmm_(g2.t(), x[sl].reshape(-1, x.shape[-1]))
            torch.mm(g2, w_ih, out=dx[sl].view(-1, x.shape[-1]))
        s.pop("g", None)
        if self.residual:
            dx += dy
        if b_ih is b_hh:  # one sum serves both biases
            b_ih = b_hh.clone()
        grads = {self.weight_hh: d_hh, self.weight_ih: d_ih, self.bias_hh: b_hh,
                 self.bias_ih: b_ih}  # fmt: skip
        return {p: g for p, g in grads.items() if p.requires_grad}, dx


class GRULayer(_RecurrentLayer):
    """One GRU layer over time (``torch.nn.GRU`` equations, gate order r, z, n).

    Args:
        input_size, hidden_size: as ``nn.GRU``.
        residual: output ``h_t + x_t`` (needs ``input_size == hidden_size``).
    """

    gates = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The autograd forward (what BPTT differentiates), one step at a time."""
        self._check(x, highway=False)
        length, batch, _ = x.shape
        hsz = self.hidden_size
        xi = torch.addmm(self.bias_ih, x.reshape(-1, self.input_size), self.weight_ih.t())
        steps = xi.reshape(length, batch, 3 * hsz).unbind(0)  # per-step views, one backward
        h = x.new_zeros(batch, hsz)
        outs = []
        for xt in steps:
            hh = torch.addmm(self.bias_hh, h, self.weight_hh.t())
            rz = torch.sigmoid(xt[:, : 2 * hsz] + hh[:, : 2 * hsz])
            n = torch.tanh(torch.addcmul(xt[:, 2 * hsz :], rz[:, :hsz], hh[:, 2 * hsz :]))
            h = torch.lerp(n, h, rz[:, hsz:])  # z ⊙ h + (1 − z) ⊙ n
            outs.append(h)
        hs = torch.stack(outs)
        return hs + x if self.residual else hs

    def trace(self, x: torch.Tensor) -> Trace:
        """No-grad forward into preallocated buffers, keeping the gates; the J-vjp factors
        are made by :meth:`prepare`, at the start of the backward."""
        self._check(x, highway=True)
        length, batch, _ = x.shape
        hsz = self.hidden_size
        with torch.no_grad():
            x = x.detach()
            w_ih, w_hh = self.weight_ih.detach(), self.weight_hh.detach()
            pre = torch.addmm(self.bias_ih.detach(), x.reshape(-1, self.input_size), w_ih.t())
            pre = pre.reshape(length, batch, 3 * hsz)
            # pre becomes [W_ir·x + b_ir + b_hr, W_iz·x + b_iz + b_hz, b_hn] and each step
            # adds W_hh·h in place (one matmul, no bias copy per step, no separate add for
            # r and z); W_in·x + b_in, which r does not multiply, moves to xn.
            xn = pre[..., 2 * hsz :].clone()
            b_hh = self.bias_hh.detach()
            pre[..., : 2 * hsz] += b_hh[: 2 * hsz]
            pre[..., 2 * hsz :] = b_hh[2 * hsz :]
            hs = x.new_empty(length + 1, batch, hsz)
            hs[0].zero_()
            n = x.new_empty(length, batch, hsz)
            w_hh_t = w_hh.t()
            # every per-step view made once (a Python select per use cost ~6% of the loop)
            views = zip(hs[:-1], hs[1:], pre, pre[..., : 2 * hsz], pre[..., :hsz],
                        pre[..., hsz : 2 * hsz], pre[..., 2 * hsz :], xn, n,
                        strict=True)  # fmt: skip
            for h, h_next, p_t, rz_t, r_t, z_t, hn_t, xn_t, n_t in views:
                p_t.addmm_(h, w_hh_t)
                rz_t.sigmoid_()
                torch.addcmul(xn_t, r_t, hn_t, out=n_t).tanh_()
                torch.lerp(n_t, h, z_t, out=h_next)
            del xn
            out = hs[1:] + x if self.residual else hs[1:]
        saved = {"x": x, "h_prev": hs[:-1], "gates": pre, "n": n}  # gates: [r, z, W_hn·h + b_hn]
        return Trace(output=out, length=length, k=pre[..., hsz : 2 * hsz], saved=saved)

    def prepare(self, trace: Trace) -> None:
        """Turn the saved gates into the factors the J-vjp multiplies by (vectorised, in
        the gate buffer, slot by slot)."""
        s = trace.saved
        if "coef" in s:
            return
        with torch.no_grad():
            gates, n = s.pop("gates"), s.pop("n")
            coef = gates.view(*gates.shape[:2], 3, self.hidden_size)
            r, z, hn = coef.unbind(2)
            trace.k = z.contiguous()  # K = diag(z), before z's slot is overwritten
            omz = torch.rsub(z, 1)
            zz = torch.mul(omz, z)  # σ' = (1 − z) z, as autograd writes it
            torch.sub(s["h_prev"], n, out=z).mul_(zz)  # z pre-activation
            c_n = omz.addcmul_(omz, n.mul_(n), value=-1)  # (1 − z)(1 − n²)
            torch.mul(r, -1, out=zz).add_(1).mul_(r).mul_(c_n).mul_(hn)  # r pre-activation
            torch.mul(c_n, r, out=hn)  # W_hn·h + b_hn
            r.copy_(zz)
        s["coef"], s["c_n"] = coef, c_n

    separate_input_gates = True

    def _input_gates(self, trace: Trace, w: torch.Tensor, sl: slice, g: torch.Tensor) -> None:
        """The n gate's ``W_ih·x`` cotangent is ``w ⊙ c_n`` (``W_hh·h``'s also has ``r``)."""
        torch.mul(w[sl], trace.saved["c_n"][sl], out=g[:, :, 2])

    def _chunks(self, trace: Trace, w: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(steps, gate cotangents of W_hh·h)``, ``(steps, batch, 3, H)`` per chunk."""
        coef = trace.saved["coef"]
        for sl, out in self._chunk_buffers(trace, w):
            yield sl, torch.mul(coef[sl], w[sl].unsqueeze(2), out=out)

    def j_vjp(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        """``w_t J_t`` for all t: an element-wise product and a matmul per chunk of steps,
        into a buffer reused across calls (the engine may overwrite it until the next)."""
        jw, w_hh = self._jw_buffer(trace, w), self.weight_hh.detach()
        for sl, g in self._chunks(trace, w):
            torch.mm(g.view(-1, g.shape[-1] * 3), w_hh, out=jw[sl].view(-1, w.shape[-1]))
        return jw


class LSTMLayer(_RecurrentLayer):
    """One LSTM layer over time (``torch.nn.LSTM`` equations, gate order i, f, g, o).

    The highway state is ``[c_t, h_t]`` concatenated on the last axis; the layer's output
    is the sequence of ``h_t`` (plus ``x_t`` with ``residual=True``).
    """

    gates = 4
    direct_off_support = True  # the loss sees h; K = diag([f, 0]) moves only c

    def k_support(self) -> slice:
        return slice(0, self.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The autograd forward (what BPTT differentiates), one step at a time."""
        self._check(x, highway=False)
        length, batch, _ = x.shape
        hsz = self.hidden_size
        xi = torch.addmm(self.bias_ih, x.reshape(-1, self.input_size), self.weight_ih.t())
        steps = xi.reshape(length, batch, 4 * hsz).unbind(0)
        h = x.new_zeros(batch, hsz)
        c = x.new_zeros(batch, hsz)
        outs = []
        for xt in steps:
            pre = xt + torch.addmm(self.bias_hh, h, self.weight_hh.t())
            ifo = torch.sigmoid(pre[:, : 2 * hsz])
            o = torch.sigmoid(pre[:, 3 * hsz :])
            gg = torch.tanh(pre[:, 2 * hsz : 3 * hsz])
            c = torch.addcmul(ifo[:, hsz:] * c, ifo[:, :hsz], gg)
            h = o * torch.tanh(c)
            outs.append(h)
        hs = torch.stack(outs)
        return hs + x if self.residual else hs

    def trace(self, x: torch.Tensor) -> Trace:
        """No-grad forward into preallocated buffers, keeping the gates.

        The cell gate is formed as ``tanh(a) = 2σ(2a) − 1`` (its weight rows doubled), so
        one ``sigmoid_`` per step covers all four gates: a ``tanh`` of a strided slice
        runs multi-threaded at this size and costs 3-4× a ``sigmoid_`` at 2 threads."""
        self._check(x, highway=True)
        length, batch, _ = x.shape
        hsz = self.hidden_size
        with torch.no_grad():
            x = x.detach()
            cell = slice(2 * hsz, 3 * hsz)
            w_ih, w_hh = self.weight_ih.detach().clone(), self.weight_hh.detach().clone()
            bias = self.bias_ih.detach() + self.bias_hh.detach()  # both biases, added once
            for t in (w_ih, w_hh, bias):
                t[cell] *= 2
            pre = torch.addmm(bias, x.reshape(-1, self.input_size), w_ih.t())
            pre = pre.reshape(length, batch, 4 * hsz)  # becomes the gates, in place
            hs = x.new_empty(length + 1, batch, hsz)
            cs = x.new_empty(length + 1, batch, hsz)
            tc = x.new_empty(length, batch, hsz)
            hs[0].zero_()
            cs[0].zero_()
            w_hh_t = w_hh.t()
            # every per-step view made once (a Python select per use costs ~6% of the loop)
            views = zip(pre, pre[..., :hsz], pre[..., hsz : 2 * hsz], pre[..., cell],
                        pre[..., 3 * hsz :], hs[:-1], hs[1:], cs[:-1], cs[1:], tc,
                        strict=True)  # fmt: skip
            for p, p_i, p_f, p_s, p_o, h, h_next, c, c_next, tc_t in views:
                p.addmm_(h, w_hh_t)
                p.sigmoid_()  # i, f, s = σ(2a), o
                # c' = f ⊙ c + i ⊙ g with g = 2s − 1
                torch.mul(p_f, c, out=c_next).addcmul_(p_i, p_s, value=2).sub_(p_i)
                torch.mul(p_o, torch.tanh(c_next, out=tc_t), out=h_next)
            pre[..., cell].mul_(2).sub_(1)  # the cell gate g itself, for the backward
            out = hs[1:] + x if self.residual else hs[1:]
        saved = {"x": x, "h_prev": hs[:-1], "gates": pre, "tc": tc, "c_prev": cs[:-1]}
        return Trace(output=out, length=length, k=None, saved=saved)

    def prepare(self, trace: Trace) -> None:
        """The J-vjp factors and ``K = diag([f, 0])`` (``trace.k``: f, on the c half that
        :meth:`k_support` names, left in its gate slot) from the saved gates (vectorised);
        the other factors overwrite the gate buffer slot by slot, and ``a_f`` the buffer of
        the previous cell states, which nothing needs after it."""
        s = trace.saved
        if "coef" in s:
            return
        with torch.no_grad():
            gates, tc, c_prev = s.pop("gates"), s.pop("tc"), s.pop("c_prev")
            coef = gates.view(*gates.shape[:2], 4, self.hidden_size)
            i, f, gg, o = coef.unbind(2)
            trace.k = f
            s["q"] = torch.mul(tc, tc).neg_().add_(1).mul_(o)  # ∂h'/∂c'
            # With s = w_c + w_h ⊙ q (the cotangent reaching c'), the gate pre-activation
            # cotangents are s ⊙ [a_i, a_f, a_g] and w_h ⊙ a_o (σ' = (1 − σ) σ, as autograd
            # writes it: accurate where σ is near 1), formed in place: tc serves as scratch.
            o_tc = tc.mul_(o)
            o.neg_().add_(1).mul_(o_tc)  # a_o = (1 − o) o tanh(c')
            one_minus_f = torch.mul(f, -1, out=tc).add_(1)
            s["a_f"] = c_prev.mul_(f).mul_(one_minus_f)  # a_f = (1 − f) f c
            a_g = torch.mul(gg, gg, out=tc).neg_().add_(1).mul_(i)  # (1 − g²) i
            gg.mul_(i)
            i.neg_().add_(1).mul_(gg)  # a_i = (1 − i) i g
            gg.copy_(a_g)
        s["coef"] = coef

    def direct_grads(self, trace: Trace, dy: torch.Tensor) -> torch.Tensor:
        a = dy.new_empty(*dy.shape[:-1], 2 * self.hidden_size)  # [0, dy]: the loss sees h
        a[..., : self.hidden_size].zero_()
        a[..., self.hidden_size :] = dy
        return a

    def _chunks(self, trace: Trace, w: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(steps, gate pre-activation cotangents (rows, 4H))`` per chunk."""
        s, hsz = trace.saved, self.hidden_size
        for sl, out in self._chunk_buffers(trace, w):
            coef = s["coef"][sl]
            wc, wh = w[sl, :, :hsz], w[sl, :, hsz:]
            cot = torch.addcmul(wc, wh, s["q"][sl])  # the cotangent reaching c'
            ig = slice(0, 3, 2)  # the i and g slots (f's slot holds K)
            torch.mul(coef[:, :, ig], cot.unsqueeze(2), out=out[:, :, ig])
            torch.mul(s["a_f"][sl], cot, out=out[:, :, 1])
            torch.mul(coef[:, :, 3], wh, out=out[:, :, 3])
            yield sl, out.view(-1, 4 * hsz)

    def j_vjp(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        """Into a buffer reused across calls (the engine may overwrite it until the next)."""
        s, hsz = trace.saved, self.hidden_size
        jw, w_hh = self._jw_buffer(trace, w), self.weight_hh.detach()
        if "qf" not in s:  # made once, by the first J-vjp (k = 0 never needs it)
            s["qf"] = s["q"] * s["coef"][:, :, 1]  # q ⊙ f (f stays in its gate slot)
        torch.mul(w[..., hsz:], s["qf"], out=jw[..., :hsz])  # through c' = f ⊙ c + i ⊙ g
        for sl, g in self._chunks(trace, w):
            jw[sl, :, hsz:] = (g @ w_hh).view(sl.stop - sl.start, -1, hsz)
        return jw
