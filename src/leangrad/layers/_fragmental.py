"""Fragmental convolutions: non-submersive, but their output cotangent is rebuilt from fragments.

Moonwalk v2 (Krylov, Karamzade, Fox, AISTATS 2026), section 5.1, eq. (15),
Appendix 10, eq. (20) and Algorithm 3. A stride-1 convolution that keeps the
length (padding ``p = (k−1)/2``) is *not* submersive: its input cotangent ``h``
does not determine its output cotangent ``h'`` (the first ``p`` positions never
lead an equation). But with PyTorch's layout ``y[i'] = Σ_j w[:, :, j] x[i'+j−p]``
the vjp is

    h[T−p] = h'[T] A + Σ_{j=1}^{k−1} h'[T−j] w[:, :, j],    A = w[:, :, 0]      (20)

(row vectors over channels), so when the *first tap* ``A`` is channel-triangular
(``w[c', c, 0] = 0`` for ``c < c'``) with a non-zero (by default unit) diagonal,
``h'[T] = (h[T−p] − Σ_j h'[T−j] w_j) A⁻¹`` rebuilds position T from the k−1
positions before it. *Fragmental checkpointing*: during Moonwalk's Phase II keep,
for every block of ``B`` positions, only its first ``k−1`` slices of ``h'``
(:meth:`fragments`); in Phase III rebuild the other ``B−k+1`` positions of every
block from them, all blocks at once (:meth:`vijp_fragments`, Algorithm 3) —
``(k−1)/B`` of the cotangent stored (k=3: half at B=4, 1/8 at B=16).

2D (:class:`FragmentalConv2d`, not in the paper, whose section 6.3 says the idea
"is equally applicable to higher spatial dimensions"): blocks run along the
height. The equation for ``h[T−p_h, col]`` involves all of row T of ``h'``
through the kernel's first row ``w[:, :, 0, :]``; if that row had off-centre
taps, each row would be a banded system along the width whose triangular
elimination needs ``p_w`` more seed columns per row and ``W`` sequential steps
(or an LU of the row operator, whose invertibility nothing guarantees). So
:class:`FragmentalConv2d` zeroes the first row's off-centre taps (2 of 9 taps of
a 3×3 kernel) and keeps its centre tap channel-triangular: each row is then
rebuilt pixel by pixel in parallel, exactly as in 1D, with ``k_h−1`` rows
stored per block of ``B`` rows.

Numerics: eq. (20) is a causal recursion (an IIR filter over positions), so
rounding errors can grow along a block; blocks bound the growth to ``B−k+1``
steps. Measured in ``tests/layers/test_fragmental.py`` and the ``fragmental-1d`` suite.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._base import (
    FragmentalLayer,
    LayerConditionError,
    NotSubmersiveError,
    check_input_dtype,
)
from ._linear import triangular_inverse

__all__ = [
    "BLOCK_TOO_SMALL",
    "FragmentalConv1d",
    "FragmentalConv2d",
    "fragment_blocks",
    "rebuild_blocks",
]

BLOCK_TOO_SMALL = (
    "{layer}: fragment block size B={block} must be at least the kernel size k={k} "
    "(each block stores its first k−1 = {k_1} positions and rebuilds the rest; "
    "B < k would store whole blocks): use fragment ≥ {k}"
)
EVEN_KERNEL = (
    "{layer}: kernel_size must be odd (got {k}): fragmental checkpointing needs the "
    "length-preserving padding (k−1)/2 on both sides"
)
UNSUPPORTED_STRIDE = (
    "{layer}: only stride 1 is supported (got stride={stride}); a strided convolution "
    "with padding < stride is submersive: use leangrad.layers.SubmersiveConv2d"
)
UNSUPPORTED_PADDING = (
    "{layer}: only 'same' padding (k−1)/2 = {p} is supported (got padding={padding}); "
    "eq. (20) assumes the length is kept"
)
ZERO_DIAGONAL = (
    "{layer}: first-tap diagonal entry w[{c}, {c}, 0] is zero (|w| = {value:.3g}); the "
    "forward substitution of eq. (20) divides by it: use unit_diagonal=True (the paper's "
    "normalisation) or keep the diagonal away from 0"
)
NOT_FLOAT = "{layer} needs a floating-point input, got dtype {dtype}; cast it, e.g. x.float()"
BAD_INPUT = "{layer} needs an input of shape {want}, got shape {shape}"
NEEDS_FRAGMENTS = (
    "{layer} is not submersive (stride 1 with 'same' padding: its first p positions never "
    "lead an equation), so its output cotangent cannot be rebuilt from the input cotangent "
    "alone; run moonwalk with fragment=B (B ≥ {k}) to keep the k−1 = {k_1} cotangent slices "
    "that seed each block of B positions, or fragment='full'"
)
DIAG_TOL = 1e-12


class _FragmentalConv(FragmentalLayer):
    """Shared rules; subclasses fix the spatial rank (1 or 2). Internally 4D ``(N, C, H, W)``."""

    vijp_needs_input = False
    _rank: int

    def __init__(
        self,
        channels: int,
        kernel_size: int | tuple[int, ...],
        *,
        stride: int = 1,
        padding: int | str = "same",
        bias: bool = True,
        unit_diagonal: bool = True,
    ) -> None:
        super().__init__()
        ks = (kernel_size,) * self._rank if isinstance(kernel_size, int) else tuple(kernel_size)
        name = type(self).__name__
        if len(ks) != self._rank or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks
        ):
            raise LayerConditionError(f"{name}: kernel_size must be a positive int, got {ks!r}")
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            raise LayerConditionError(f"{name}: channels must be a positive int, got {channels!r}")
        layer = f"{name}(channels={channels}, kernel_size={kernel_size})"
        for k in ks:
            if k % 2 == 0:
                raise LayerConditionError(EVEN_KERNEL.format(layer=layer, k=k))
        pads = tuple((k - 1) // 2 for k in ks)
        if stride != 1:
            raise LayerConditionError(UNSUPPORTED_STRIDE.format(layer=layer, stride=stride))
        same = {"same", pads, *((pads[0],) if len(set(pads)) == 1 else ())}
        if padding not in same:
            raise LayerConditionError(
                UNSUPPORTED_PADDING.format(layer=layer, p=pads[0], padding=padding)
            )
        self.channels, self.kernel_size, self.padding = channels, ks, pads
        self.unit_diagonal = unit_diagonal
        shape = (channels, channels, *ks)
        self.weight_raw = nn.Parameter(torch.empty(shape))
        nn.init.kaiming_uniform_(self.weight_raw, a=math.sqrt(5))  # nn.Conv's default
        if not unit_diagonal:
            with torch.no_grad():
                self._lead(self.weight_raw).fill_diagonal_(1.0)
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def extra_repr(self) -> str:
        k = self.kernel_size[0] if self._rank == 1 else self.kernel_size
        extra = "" if self.unit_diagonal else ", unit_diagonal=False"
        return f"channels={self.channels}, kernel_size={k}, bias={self.bias is not None}{extra}"

    # -- parametrisation -----------------------------------------------------------
    def _lead(self, w: torch.Tensor) -> torch.Tensor:
        """The leading tap ``A`` (a view): ``w[:, :, 0]`` (1D) or ``w[:, :, 0, p_w]`` (2D)."""
        return w[:, :, 0] if self._rank == 1 else w[:, :, 0, self.padding[1]]

    def _mask(self, like: torch.Tensor) -> torch.Tensor:
        m = torch.ones_like(like)
        if self._rank == 2:
            m[:, :, 0, :] = 0  # the first row keeps only its centre tap
        lead = self._lead(m)
        lead.copy_(torch.triu(torch.ones_like(lead), diagonal=0 if not self.unit_diagonal else 1))
        return m

    @property
    def weight(self) -> torch.Tensor:
        """The effective kernel: first tap channel-triangular, unit diagonal by default."""
        w = self.weight_raw * self._mask(self.weight_raw)
        if self.unit_diagonal:
            eye = torch.zeros_like(w)
            self._lead(eye).fill_diagonal_(1.0)
            w = w + eye
        return w

    # -- the layer -------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._as4d(x)  # shape and channels, named (not a raw conv error)
        if not x.is_floating_point():
            raise LayerConditionError(NOT_FLOAT.format(layer=self._describe(), dtype=x.dtype))
        check_input_dtype(self._describe(), x, self.weight_raw)
        conv = F.conv1d if self._rank == 1 else F.conv2d
        return conv(x, self.weight, self.bias, padding=self.padding)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Nothing: the layer is linear in ``x``."""
        del x, y

    def vjp_input(self, res: None, h_out: torch.Tensor) -> torch.Tensor:
        """``h_out · ∂y/∂x`` by the kernel autograd itself uses (``convolution_backward``
        for the input only: 1.5× faster than ``conv_transpose1d`` on CPU, measured at
        N=8, C=32, L=1024). Input and output shapes agree, so ``h_out`` stands in for
        the input, whose values this does not read."""
        del res
        one, zero = [1] * self._rank, [0] * self._rank
        return torch.ops.aten.convolution_backward(
            h_out, h_out, self.weight, None, one, list(self.padding), one, False, zero, 1,
            [True, False, False],
        )[0]  # fmt: skip

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        del x, h_in
        k = self.kernel_size[0]
        raise NotSubmersiveError(NEEDS_FRAGMENTS.format(layer=self._describe(), k=k, k_1=k - 1))

    # -- fragmental rules --------------------------------------------------------------
    def check_fragment(self, block: int) -> None:
        """Raise unless fragments of ``block`` (B) positions can rebuild this layer's output
        cotangent: B ≥ k along the blocked axis, and a non-zero first-tap diagonal."""
        k = self.kernel_size[0]
        if not isinstance(block, int) or isinstance(block, bool) or block < k:
            raise LayerConditionError(
                BLOCK_TOO_SMALL.format(layer=self._describe(), block=block, k=k, k_1=k - 1)
            )
        self._check_diagonal()

    def fragments(self, h_out: torch.Tensor, block: int) -> torch.Tensor:
        """What Phase II keeps of ``h_out``: the first k−1 positions of every block
        (a compact copy, ``(N, C, M, k−1, W)``)."""
        self.check_fragment(block)
        return fragment_blocks(self._as4d(h_out), block, self.kernel_size[0] - 1)

    def vijp_fragments(
        self, x: torch.Tensor | None, h_in: torch.Tensor, frags: torch.Tensor, block: int
    ) -> torch.Tensor:
        """``h_out`` rebuilt exactly from ``h_in`` and :meth:`fragments` (Algorithm 3)."""
        del x
        self._check_diagonal()
        h4 = self._as4d(h_in)
        w = self.weight.detach()
        w4 = w.unsqueeze(-1) if self._rank == 1 else w
        with torch.no_grad():  # a cotangent, not differentiated further
            out = rebuild_blocks(h4, frags, w4.to(h4.dtype), block, layer=self._describe())
        return out.squeeze(-1) if self._rank == 1 else out

    # -- checks -----------------------------------------------------------------------
    def check(self, x: torch.Tensor | None = None) -> None:
        self._check_diagonal()
        if x is not None:
            self._as4d(x)

    def _check_diagonal(self) -> None:
        if self.unit_diagonal:
            return
        d = self._lead(self.weight.detach()).diagonal().abs()
        bad = d <= DIAG_TOL * max(1.0, float(d.max()))
        if bool(bad.any()):
            c = int(bad.nonzero()[0])
            raise LayerConditionError(
                ZERO_DIAGONAL.format(layer=self._describe(), c=c, value=float(d[c]))
            )

    def _as4d(self, t: torch.Tensor) -> torch.Tensor:
        want = ("(N, {c}, L)" if self._rank == 1 else "(N, {c}, H, W)").format(c=self.channels)
        if t.dim() != self._rank + 2 or t.shape[1] != self.channels:
            raise LayerConditionError(
                BAD_INPUT.format(layer=self._describe(), want=want, shape=tuple(t.shape))
            )
        return t.unsqueeze(-1) if self._rank == 1 else t


class FragmentalConv1d(_FragmentalConv):
    """Stride-1, length-keeping 1D convolution with fragmental-checkpointing rules.

    Moonwalk v2, section 5.1 / Appendix 10 (eq. 20, Algorithm 3). The kernel's
    first tap ``w[:, :, 0]`` is channel-triangular (``w[c', c, 0] = 0`` for
    ``c < c'``) with unit diagonal, so output cotangents can be rebuilt by
    forward substitution from ``k−1`` stored positions per block.

    Args:
        channels: input = output channels.
        kernel_size: odd k (padding (k−1)/2 keeps the length).
        stride, padding: accepted only as 1 and ``"same"``/(k−1)/2 (checked).
        bias: add a learned bias.
        unit_diagonal: ``True`` fixes the first tap's diagonal to 1 (the paper's
            assumption); ``False`` learns it (init 1) and checks it is non-zero.
    """

    _rank = 1


class FragmentalConv2d(_FragmentalConv):
    """Stride-1, size-keeping 2D convolution, fragments in blocks of rows.

    Not in the paper (see the module docstring): the first kernel row keeps only
    its centre tap, which is channel-triangular with unit diagonal; blocks of
    ``B`` rows store their first ``k_h−1`` rows.
    """

    _rank = 2


def fragment_blocks(h: torch.Tensor, block: int, keep: int) -> torch.Tensor:
    """The first ``keep`` rows of every block of ``block`` rows of ``h`` ``(N, C, H, W)``,
    as a compact ``(N, C, M, keep, W)`` copy (a ragged last block is zero-padded)."""
    height = h.shape[2]
    full, rem = divmod(height, block)
    parts = []
    if full:
        parts.append(h[:, :, : full * block].unflatten(2, (full, block))[:, :, :, :keep])
    if rem:
        last = h[:, :, full * block : full * block + min(keep, rem)]
        if rem < keep:
            last = F.pad(last, (0, 0, 0, keep - rem))
        parts.append(last.unsqueeze(2))
    if len(parts) > 1:
        return torch.cat(parts, dim=2)
    return parts[0].clone(memory_format=torch.contiguous_format)


def rebuild_blocks(
    h_in: torch.Tensor, frags: torch.Tensor, weight: torch.Tensor, block: int, *, layer: str
) -> torch.Tensor:
    """Algorithm 3: every block's rows ``k−1 … B−1`` of ``h'`` from eq. (20), all blocks at once.

    Args:
        h_in: the layer's input cotangent ``(N, C, H, W)``.
        frags: :func:`fragment_blocks` of the true ``h'`` ``(N, C, M, k−1, W)``.
        weight: the effective kernel ``(C, C, k_h, k_w)`` (first row: centre tap only).
        block: B.
        layer: for warnings (ill-conditioned first tap).

    Returns:
        ``h'`` of shape ``(N, C, H, W)`` (a view of a ``(N, C, M·B, W)`` buffer).
    """
    n, c, height, width = h_in.shape
    kh, kw = weight.shape[2], weight.shape[3]
    if width == 1 and kw == 1:
        out1 = _rebuild_1d(h_in[..., 0], frags[..., 0], weight[..., 0], block, layer=layer)
        return out1.unsqueeze(-1)
    ph, pw = (kh - 1) // 2, (kw - 1) // 2
    m = frags.shape[2]
    rows = m * block
    hin = h_in if rows == height else F.pad(h_in, (0, 0, 0, rows - height))
    hin = hin.unflatten(2, (m, block))  # (N, C, M, B, W)
    out = h_in.new_empty(n, c, m, block, width)
    out[:, :, :, : kh - 1] = frags
    a_inv = triangular_inverse(weight[:, :, 0, pw], layer)  # h'[T] = r A⁻¹
    rest = weight[:, :, 1:].flip(2)  # taps j = k−1 … 1, matching rows T−k+1 … T−1
    if kw == 1:
        rest_mat = rest[..., 0].permute(2, 0, 1)  # (k−1, C', C)
    else:
        rest_t = rest.permute(2, 0, 1, 3).reshape((kh - 1) * c, c, kw)
    for t in range(kh - 1, block):
        window = out[:, :, :, t - kh + 1 : t]  # (N, C', M, k−1, W)
        if kh == 1:
            r = hin[:, :, :, t - ph]
        elif kw == 1:
            r = hin[:, :, :, t - ph] - torch.einsum("ncmjw,jcd->ndmw", window, rest_mat)
        else:
            win = window.permute(0, 2, 3, 1, 4).reshape(n * m, (kh - 1) * c, width)
            contrib = F.conv_transpose1d(win, rest_t, padding=pw).view(n, m, c, width)
            r = hin[:, :, :, t - ph] - contrib.permute(0, 2, 1, 3)
        out[:, :, :, t] = torch.einsum("ncmw,cd->ndmw", r, a_inv)
    return out.flatten(2, 3)[:, :, :height]


def _rebuild_1d(
    h_in: torch.Tensor, frags: torch.Tensor, weight: torch.Tensor, block: int, *, layer: str
) -> torch.Tensor:
    """:func:`rebuild_blocks` for one spatial axis, channels-last, in one ``(N, M·B, C)``
    buffer ``F``. Eq. (20) as ``h'[T] = h[T−p] A⁻¹ − [h'[T−k+1] … h'[T−1]] R A⁻¹``: first
    ``F[T] = h[T−p] A⁻¹`` for all positions (one GEMM per example), then the seeds, then
    each of the B−k+1 steps is one in-place GEMM over all (example, block) pairs reading
    the window as a view of ``F`` (measured 2.3× faster than the general path at N=8,
    C=32, L=1000, before this layout saved another GEMM and copy per step).

    The result is a transposed (channels-last) view. A contiguous result was tried and
    measured (``fragmental-1d`` quick, depth 8, B=4): 5% faster steps (LeakyReLU's vijp
    and the weight gradient prefer the contiguous layout) but a 0.5-activation higher
    peak (the gathered windows), and chunking the gather to bound that cost the speed
    back; memory is this method's point, so the zero-copy layout stays."""
    n, c, height = h_in.shape
    k = weight.shape[2]
    ph = (k - 1) // 2
    m = frags.shape[2]
    rows = m * block
    a_inv = triangular_inverse(weight[:, :, 0], layer)
    buf = h_in.new_empty(n, rows, c)
    h_cl = h_in.transpose(1, 2)  # (N, L, C), a view
    filled = min(height, rows - ph)
    for i in range(n):
        torch.mm(h_cl[i, :filled], a_inv, out=buf[i, ph : ph + filled])
    buf[:, :ph].zero_()
    buf[:, ph + filled :].zero_()
    out = buf.view(n, m, block, c)
    out[:, :, : k - 1] = frags.permute(0, 2, 3, 1)
    if k > 1:
        rest = weight[:, :, 1:].flip(2).permute(2, 0, 1).reshape((k - 1) * c, c) @ a_inv
        for t in range(k - 1, block):
            window = out[:, :, t - k + 1 : t].reshape(n * m, (k - 1) * c)
            out[:, :, t].view(n * m, c).addmm_(window, rest, alpha=-1)
    return buf[:, :height].transpose(1, 2)
