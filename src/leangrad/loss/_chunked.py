"""Cross-entropy of a linear layer's output, in chunks of rows: the ``(rows, classes)``
logits never exist whole, in the forward pass or the backward.

A language model with a real vocabulary spends most of a step's peak on its logits:
``(N, T, V)`` floats, their log-softmax and their gradient (GPT-2: V = 50,257). The loss
only needs, per row, the log-sum-exp of the logits and the target's logit; the gradient of
the hidden states and of the weight only needs ``softmax - onehot`` one chunk of rows at a
time. So :func:`linear_cross_entropy` computes ``z = h W^T + b`` a chunk of rows at a time
and keeps nothing of size ``V`` per row.

When the loss is a mean or a sum and a gradient is wanted, the gradients of ``h``, ``W``
and ``b`` are computed in the same pass as the loss (one matmul for the logits, two for
the gradients: autograd's count) and the backward pass only scales them by the incoming
gradient. With ``reduction="none"`` the backward pass rebuilds each chunk's logits (one
matmul more). Exact: equal to ``F.cross_entropy(F.linear(h, W, b), target)`` up to
floating-point rounding (float64: ~1e-15).

Anchors: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (Cut
Cross-Entropy, ICLR 2025) and torchtune's chunked cross-entropy, which do the same
computation with fused kernels; here it is plain PyTorch matmuls, chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _errors as errors

__all__ = ["CHUNKS", "CHUNK_BYTES", "GradSink", "chunk_rows", "linear_cross_entropy"]

CHUNK_BYTES = 8 * 2**20
"""Most bytes of one chunk's logits (float32) when ``chunk_size`` is not given."""
CHUNKS = 8
"""At least this many chunks when ``chunk_size`` is not given (and there are as many rows):
one chunk's logits are then at most 1/8 of the whole."""
BAD_REDUCTION = "linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {value!r}"
BAD_SMOOTHING = "linear_cross_entropy: label_smoothing must be in [0, 1], got {value!r}"
BAD_Z_LOSS = "linear_cross_entropy: z_loss must be a float >= 0, got {value!r}"
BAD_CHUNK = "linear_cross_entropy: chunk_size must be a positive int or None, got {value!r}"
TWICE = (
    "linear_cross_entropy: backward ran twice through a loss whose gradients were computed "
    "with it (mean or sum reduction); compute the loss again for a second backward pass"
)
BAD_SHAPES = (
    "linear_cross_entropy: hidden {hidden} and weight {weight} do not match (hidden's last "
    "dimension is the weight's second), or target {target} is not hidden's leading shape"
)


def chunk_rows(classes: int, *, rows: int | None = None, chunk_size: int | None = None) -> int:
    """Rows per chunk: ``chunk_size``, or as many as keep one chunk's float32 logits within
    :data:`CHUNK_BYTES` and, given the loss's ``rows``, at most 1/:data:`CHUNKS` of them."""
    if chunk_size is not None:
        return chunk_size
    most = max(1, CHUNK_BYTES // (4 * max(1, classes)))
    return most if rows is None else max(1, min(most, -(-rows // CHUNKS)))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` without the logits.

    Args:
        hidden: ``(..., D)``: the input of the final linear layer (e.g. the last hidden
            states of a language model, ``(N, T, D)``).
        weight: ``(V, D)``: the linear layer's weight (``nn.Linear.weight``; a tied
            embedding matrix works as is).
        target: class indices of shape ``hidden.shape[:-1]``; ``ignore_index`` marks rows
            that do not count.
        bias: ``(V,)`` or ``None``.
        ignore_index, reduction, label_smoothing: as :func:`torch.nn.functional.cross_entropy`
            (``"mean"`` divides by the rows not ignored).
        z_loss: weight ``w`` of the z-loss (PaLM, Chowdhery et al. 2022; Liger Kernel's
            ``lse_square_scale``): each counted row's loss gains ``w * logsumexp(z)**2``,
            which keeps the softmax normaliser near 1 in low-precision training. 0 (the
            default) is plain cross-entropy.
        chunk_size: rows per chunk (default: :func:`chunk_rows`: at most 8 MiB of float32
            logits, and at least 8 chunks).

    Returns:
        The loss: a scalar, or per row of shape ``target.shape`` for ``reduction="none"``.
        Differentiable once in ``hidden``, ``weight`` and ``bias`` (not twice).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(BAD_REDUCTION.format(value=reduction))
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(BAD_SMOOTHING.format(value=label_smoothing))
    if isinstance(z_loss, bool) or not isinstance(z_loss, int | float) or not z_loss >= 0.0:
        raise ValueError(BAD_Z_LOSS.format(value=z_loss))
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):  # fmt: skip
        raise ValueError(BAD_CHUNK.format(value=chunk_size))
    if (weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]
            or tuple(target.shape) != tuple(hidden.shape[:-1])):  # fmt: skip
        raise errors.EngineInputError(BAD_SHAPES.format(
            hidden=tuple(hidden.shape), weight=tuple(weight.shape),
            target=tuple(target.shape)))  # fmt: skip
    return _apply(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                  chunk_size, None, z_loss=float(z_loss))  # fmt: skip


class GradSink:
    """Where the loss leaves the weight's gradient it hands to autograd, so that a tied
    embedding's backward (:mod:`._lazy`) adds its rows into that tensor instead of
    returning a second ``(V, D)`` gradient for autograd to sum (which holds three at once).

    Attributes:
        weight_grad: the weight gradient the loss returned, until the last pending
            embedding backward has added into it.
        pending: embedding forwards whose backward has not run yet.
    """

    def __init__(self) -> None:
        self.weight_grad: torch.Tensor | None = None
        self.pending = 0


def _apply(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
           bias: torch.Tensor | None, ignore_index: int, reduction: str, smoothing: float,
           chunk_size: int | None, sink: GradSink | None, *,
           z_loss: float = 0.0) -> torch.Tensor:  # fmt: skip
    rows = chunk_rows(weight.shape[0], rows=target.numel(), chunk_size=chunk_size)
    grads_now = reduction != "none" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))  # fmt: skip
    out: torch.Tensor = _LinearCrossEntropy.apply(
        hidden, weight, bias, target, ignore_index, reduction, smoothing, rows, grads_now, sink,
        z_loss,
    )
    return out


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits, in float32 at least (a low-precision model's log-sum-exp is
    taken in float32, as ``F.cross_entropy`` accumulates it)."""
    z = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    return z if z.dtype in (torch.float32, torch.float64) else z.float()


def _dlogits_(p: torch.Tensor, t: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor,
              smoothing: float, z_loss: float, lse: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``p`` (one chunk's softmax) overwritten with d(loss)/dz: per row
    ``scale * ((1 + 2 w lse) softmax(z) - (1 - s) onehot(t) - s / V)``, zero on ignored
    rows (``w`` the z-loss weight: d(w lse^2)/dz = 2 w lse softmax(z))."""
    if z_loss:
        p.mul_((1.0 + 2.0 * z_loss * lse)[:, None].to(p.dtype))
    rows = torch.arange(p.shape[0], device=p.device)
    p[rows, t] -= (1.0 - smoothing) * valid.to(p.dtype)
    if smoothing:
        p.sub_((smoothing / p.shape[1]) * valid.to(p.dtype)[:, None])
    return p.mul_(scale.masked_fill(~valid, 0.0)[:, None].to(p.dtype))  # 0, not inf * 0


def _add_grads(dz: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, gh: torch.Tensor | None,
               gw: torch.Tensor | None, gb: torch.Tensor | None) -> None:  # fmt: skip
    """One chunk's share of the gradients from its ``dz`` = d(loss)/d(logits): its rows of
    the hidden states' gradient written into ``gh``, the weight's and bias's added."""
    if gh is not None:
        torch.mm(dz, weight, out=gh)
    if gw is not None:
        gw.addmm_(dz.t(), h)
    if gb is not None:
        gb.add_(dz.sum(0))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        target: torch.Tensor, ignore_index: int, reduction: str, smoothing: float, rows: int,
        grads_now: bool, sink: GradSink | None, z_loss: float,
    ) -> torch.Tensor:  # fmt: skip
        h = hidden.reshape(-1, hidden.shape[-1])
        t_all = target.reshape(-1)
        valid_all = t_all != ignore_index
        safe_all = torch.where(valid_all, t_all, torch.zeros_like(t_all))
        m = h.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        per = torch.empty(m, dtype=acc, device=h.device)
        lse = torch.empty(m, dtype=acc, device=h.device)
        count = valid_all.sum()
        if grads_now:
            scale = torch.ones(m, dtype=acc, device=h.device)
            if reduction == "mean":
                scale.div_(count.to(acc))
            gh = torch.empty_like(h) if hidden.requires_grad else None
            gw = torch.zeros_like(weight) if weight.requires_grad else None
            gb = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        for s in range(0, m, rows):
            e = min(m, s + rows)
            z = _logits(h[s:e], weight, bias)  # the chunk's one buffer of V per row
            safe, valid = safe_all[s:e], valid_all[s:e]
            picked = z.gather(1, safe[:, None]).squeeze(1)
            mean = z.mean(dim=1) if smoothing else None
            top = z.amax(dim=1)
            total = z.sub_(top[:, None]).exp_().sum(dim=1)  # z is now exp(z - max)
            lse_c = top + total.log()
            nll = lse_c - picked
            if mean is not None:
                nll = (1.0 - smoothing) * nll + smoothing * (lse_c - mean)
            if z_loss:
                nll = nll + z_loss * lse_c.square()
            per[s:e] = nll.masked_fill(~valid, 0.0)
            lse[s:e] = lse_c
            if grads_now:
                softmax = z.div_(total[:, None])
                dz = _dlogits_(softmax, safe, valid, scale[s:e], smoothing, z_loss,
                               lse_c).to(h.dtype)  # fmt: skip
                _add_grads(dz, h[s:e], weight, None if gh is None else gh[s:e], gw, gb)
            del z
        if reduction == "none":
            loss = per.reshape(target.shape).to(hidden.dtype)
        elif reduction == "sum":
            loss = per.sum().to(hidden.dtype)
        else:
            loss = (per.sum() / count).to(hidden.dtype)
        ctx.shape, ctx.rows, ctx.smoothing, ctx.reduction = hidden.shape, rows, smoothing, reduction
        ctx.has_bias, ctx.grads_now, ctx.sink = bias is not None, grads_now, sink
        ctx.z_loss = z_loss
        if grads_now:
            ctx.pre = (gh, gw, gb)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, lse)
            ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        none = (None,) * 8
        if ctx.grads_now:
            if ctx.pre is None:
                raise RuntimeError(TWICE)
            # handed over, not copied: autograd then adopts them as the .grad tensors
            gh, gw, gb = ctx.pre
            ctx.pre = None
            for g in (gh, gw, gb):
                if g is not None:
                    g.mul_(grad.to(g.dtype))
            _leave(ctx.sink, gw)
            return (None if gh is None else gh.reshape(ctx.shape), gw, gb, *none)
        hidden, weight, bias, target, lse = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        t_all = target.reshape(-1)
        valid_all = t_all != ctx.ignore_index
        safe_all = torch.where(valid_all, t_all, torch.zeros_like(t_all))
        scale_all = grad.reshape(-1).to(lse.dtype) if ctx.reduction == "none" else (
            grad.to(lse.dtype) * valid_all.to(lse.dtype)
            / (valid_all.sum().to(lse.dtype) if ctx.reduction == "mean" else 1.0))  # fmt: skip
        scale_all = scale_all.expand(h.shape[0]) if scale_all.dim() == 0 else scale_all
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(weight) if need_w else None
        gb = torch.zeros_like(bias) if need_b else None
        for s in range(0, h.shape[0], ctx.rows):
            e = min(h.shape[0], s + ctx.rows)
            softmax = _logits(h[s:e], weight, bias).sub_(lse[s:e, None]).exp_()
            dz = _dlogits_(softmax, safe_all[s:e], valid_all[s:e], scale_all[s:e],
                           ctx.smoothing, ctx.z_loss, lse[s:e]).to(h.dtype)  # fmt: skip
            _add_grads(dz, h[s:e], weight, None if gh is None else gh[s:e], gw, gb)
            del softmax, dz
        _leave(ctx.sink, gw)
        return (None if gh is None else gh.reshape(ctx.shape), gw, gb, *none)


def _leave(sink: GradSink | None, gw: torch.Tensor | None) -> None:
    """Tell a tied embedding where the weight's gradient is (only while one is pending)."""
    if sink is not None and gw is not None and sink.pending > 0:
        sink.weight_grad = gw
