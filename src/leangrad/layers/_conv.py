"""``SubmersiveConv2d``: a convolution whose vijp is an exact, mostly parallel elimination.

Moonwalk v2 (Krylov, Karamzade, Fox, AISTATS 2026), Lemma 1 (section 5, proof
in Appendix 9): the convolution of eq. (11),
``x'_{i',c'} = Σ_{j,c} w_{j,c,c'} x_{s i'+j−p, c}`` (PyTorch layout
``w[c', c, j₁, j₂]``), is submersive — its input Jacobian is right-invertible —
when

- (i)   ``k > p``, ``s > p`` and ``n > s(n'−1)`` in every spatial dimension;
- (ii)  ``w[c', c, p, p] = 0`` for ``c < c'`` (implying ``c_out ≤ c_in``);
- (iii) ``w[c', c', p, p] ≠ 0``.

Then the vjp of eq. (13) restricted to the input positions ``s i'`` and the
first ``c_out`` channels is triangular: ``h'_{i'}`` is the lexicographically
last unknown in the equation for ``h_{s i'}``, with coefficient matrix the
centre tap ``A = w[:, :c_out, p, p]`` (upper-triangular, ``h_{s i'} = h'_{i'} A
+ …``), and eq. (14) recovers it from already-recovered ``h'`` through the
off-centre taps ``p + s m`` (``m ≥ 0``, ``m ≠ 0``) that reach back to
``h'_{i'−m}``. :meth:`SubmersiveConv2d.vijp` has two paths:

- ``"parallel"`` (valid when ``s > k − 1 − p``, e.g. 3×3/s2/p1 of section 6.2
  or 2×2/s2/p0): no off-centre tap reaches ``s i'``, so every position is
  one row of a single matrix product ``h' = h[:, :c_out, ::s, ::s] A⁻¹``
  (Algorithm 2, all positions at once).
- ``"wavefront"`` (always valid): eq. (14) by anti-diagonals ``t = i'₁ + i'₂``:
  all positions of one anti-diagonal at once, ``n'₁ + n'₂ − 1`` sequential
  steps, each subtracting the recovered ``h'`` at the few offsets ``m`` by one
  matrix product per offset on contiguous views of a skewed buffer; total
  work ≈ one conv.

``"auto"`` picks ``"parallel"`` whenever it is valid.

Parametrisation (section 6.4, "constrained convolutions"): the effective
weight :meth:`~SubmersiveConv2d.weight` is ``weight_raw · mask`` (the mask
zeroes the centre-tap entries with ``c ≤ c'``) plus the diagonal
``1 + 0.5·tanh(diag_raw)`` ∈ (0.5, 1.5) at ``(c', c', p, p)`` (init 1, the
paper's normalisation in Algorithm 2 and eq. (15)). Why bounded: the vijp's
error grows with ``κ(A)``; a floor keeps the diagonal from drifting to 0 and
a ceiling caps its own spread at a factor 3 of ``κ``. The parallel path's error is set
by ``κ(A)`` alone; the wavefront path's also grows with the off-centre taps and the
spatial size (eq. (14) is a causal 2D recursion). ``vijp`` warns when ``κ₁(A)·eps``
exceeds ``COND_WARN_RTOL``. ``forward`` keeps the caller's memory format; ``vjp_input``
and ``vijp`` return channels-last strides (their faster layout on the CPU). The
measurements behind these choices are in ``docs/layers.md``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import UNKNOWN_NAME, UnknownNameError
from ._base import LayerConditionError, check_input_dtype, positive_int
from ._linear import TriangularLead, diag_grad_from_raw

__all__ = ["VIJP_MODES", "SubmersiveConv2d"]

VIJP_MODES = ("auto", "parallel", "wavefront")

KERNEL_LE_PADDING = (
    "{layer} violates Lemma 1 (i): kernel_size > padding (got kernel_size={k}, padding={p}); "
    "the centre tap p must lie inside the kernel: use padding ≤ {k_1}"
)
STRIDE_LE_PADDING = (
    "{layer} violates Lemma 1 (i): stride > padding (got stride={s}, padding={p}); output "
    "position i'+1 would also read input position s·i' (through tap p − s), so the "
    "elimination of eq. (14) could not solve positions in order: use stride ≥ {p_1} or "
    "padding ≤ {s_1} "
    "(e.g. 3×3 with stride 2, padding 1; or padding 0 with stride 1)"
)
TOO_MANY_OUT_CHANNELS = (
    "{layer} violates Lemma 1 (ii): out_channels ≤ in_channels (got out_channels={c_out} > "
    "in_channels={c_in}); a channel-triangular centre tap needs at least as many input "
    "channels as output channels: use out_channels ≤ {c_in}, or widen the input first"
)
SPATIAL_TOO_SMALL = (
    "{layer} violates Lemma 1 (i): n > s(n'−1) in spatial dimension {dim} (input size "
    "n={n}, output size n'={n_out}, stride s={s}): the last output position's centre tap "
    "falls in the padding, so its cotangent cannot be recovered; crop or pad that dimension "
    "to a size the lemma allows, e.g. {fix}"
)
INPUT_SMALLER_THAN_KERNEL = (
    "{layer}: input size {n} in spatial dimension {dim} plus padding 2·{p} is smaller than "
    "the kernel ({k}); use inputs of at least {need} in that dimension"
)
NOT_FLOAT = "{layer} needs a floating-point input, got dtype {dtype}; cast it, e.g. x.float()"
BAD_INPUT = (
    "{layer} needs an input of shape (N, {c_in}, H, W), got shape {shape}; "
    "add a batch dimension or match in_channels"
)
PARALLEL_INVALID = (
    "{layer}: vijp_mode='parallel' needs stride > kernel_size − 1 − padding in every "
    "dimension (got stride={s}, kernel_size={k}, padding={p}), so that only the centre tap "
    "reaches positions s·i'; use vijp_mode='wavefront' or 'auto'"
)


def _pair(v: int | tuple[int, int], name: str) -> tuple[int, int]:
    t = (v, v) if isinstance(v, int) else tuple(v)
    if len(t) != 2 or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in t):
        raise LayerConditionError(f"SubmersiveConv2d: {name} must be an int ≥ 0 or a pair")
    return t


def _size_ok(n: int, k: int, s: int, p: int) -> bool:
    """Lemma 1 (i)'s spatial bound ``n > s(n'−1)`` (and ``n' ≥ 1``)."""
    return n + 2 * p >= k and n > s * ((n + 2 * p - k) // s)


def _check_mode(mode: str) -> str:
    if mode not in VIJP_MODES:
        raise UnknownNameError(
            UNKNOWN_NAME.format(kind="vijp_mode", name=mode, known=", ".join(VIJP_MODES))
        )
    return mode


class SubmersiveConv2d(TriangularLead):
    """A 2D convolution satisfying Lemma 1 by construction, with an exact vijp.

    Parameters: ``weight_raw`` (c_out, c_in, k₁, k₂; masked to exactly zero at
    the centre tap for ``c ≤ c'``), ``diag_raw`` (c_out; the centre-tap
    diagonal is ``1 + 0.5·tanh(diag_raw)``), ``bias`` (optional). Default
    init: ``nn.Conv2d``'s for ``weight_raw`` and ``bias``, diagonal 1.

    Rules: ``residual`` keeps only the input's spatial size (a
    ``torch.Size``); ``vjp_input`` is ``conv_transpose2d`` (eq. (12));
    ``vijp`` is the elimination of eq. (14) (see the module docstring for the
    two paths); ``forward_vjp_params`` uses ``convolution_backward`` for the
    effective weight and chains through the mask and the diagonal map.

    Args:
        in_channels, out_channels: ``out_channels ≤ in_channels`` (Lemma 1 (ii)).
        kernel_size, stride, padding: ints or pairs; ``kernel_size > padding``
            and ``stride > padding`` (Lemma 1 (i)).
        bias: learn an additive bias.
        vijp_mode: ``"auto"`` (parallel when valid, else wavefront),
            ``"parallel"`` (raises unless ``stride > kernel_size − 1 − padding``)
            or ``"wavefront"`` (always valid; ``n'₁ + n'₂ − 1`` sequential steps).
        device, dtype: factory arguments of the parameters.

    Raises:
        LayerConditionError: a Lemma 1 condition fails (at construction; the
            spatial bound ``n > s(n'−1)`` when an input is seen).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        *,
        bias: bool = True,
        vijp_mode: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_channels = positive_int("SubmersiveConv2d", "in_channels", in_channels)
        self.out_channels = positive_int("SubmersiveConv2d", "out_channels", out_channels)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.padding = _pair(padding, "padding")
        self.vijp_mode = _check_mode(vijp_mode)
        self.has_bias = bias
        self.check()
        c_out, c_in, (k1, k2) = out_channels, in_channels, self.kernel_size
        weight = torch.empty(c_out, c_in, k1, k2, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Conv2d's default
        self._init_parameters(weight, bias=bias, bound=1.0 / math.sqrt(c_in * k1 * k2))

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, bias={self.has_bias}"
        )

    @property
    def parallel_vijp_valid(self) -> bool:
        """``stride > kernel_size − 1 − padding``: only the centre tap reaches ``s i'``."""
        return all(
            s > k - 1 - p
            for k, s, p in zip(self.kernel_size, self.stride, self.padding, strict=True)
        )

    def _centre(self) -> tuple[int, ...]:
        """The centre tap, where ``A`` lies: ``(p₁, p₂)``."""
        return self.padding

    def output_size(self, n: tuple[int, ...]) -> tuple[int, int]:
        """Spatial output size ``n' = ⌊(n + 2p − k)/s⌋ + 1`` for input size ``n``."""
        return tuple(  # type: ignore[return-value]
            (nd + 2 * p - k) // s + 1
            for nd, k, s, p in zip(n, self.kernel_size, self.stride, self.padding, strict=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        check_input_dtype(self._describe(), x, self.weight_raw)
        return F.conv2d(x, self.weight(), self.bias, self.stride, self.padding)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Size:
        """Only the input's spatial size (``conv_transpose2d`` needs it to restore ``n``)."""
        del y
        return x.shape[-2:]

    def vjp_input(self, res: torch.Size, h_out: torch.Tensor) -> torch.Tensor:
        """``h = TransposeConv(h', w, n, p, s)`` (eq. (12)); ``res`` is the input size ``n``."""
        out_pad = tuple(
            (n + 2 * p - k) % s
            for n, k, s, p in zip(res, self.kernel_size, self.stride, self.padding, strict=True)
        )
        h_out = h_out.contiguous(memory_format=torch.channels_last)  # 2-3x faster on CPU
        return F.conv_transpose2d(h_out, self.weight(), None, self.stride, self.padding, out_pad)

    def vijp(
        self, x: torch.Tensor | None, h_in: torch.Tensor, *, mode: str | None = None
    ) -> torch.Tensor:
        """``h'`` with ``vjp_input(h') = h`` (``h`` in the row space; eq. (14)).

        Args:
            x: the layer's input (unused: the Jacobian does not depend on it).
            h_in: the input cotangent, shape (N, c_in, H, W).
            mode: overrides ``self.vijp_mode`` (``"auto"``, ``"parallel"``, ``"wavefront"``).

        Returns:
            The output cotangent, shape (N, c_out, H', W'), in channels-last strides,
            computed without autograd. Only ``h[:, :c_out]`` at the positions
            ``s·i'`` is read; the rest is implied by the row-space assumption.
        """
        del x
        mode = _check_mode(mode if mode is not None else self.vijp_mode)
        self._check_input(h_in)
        if mode == "parallel" and not self.parallel_vijp_valid:
            raise LayerConditionError(
                PARALLEL_INVALID.format(
                    layer=self._describe(), s=self.stride, k=self.kernel_size, p=self.padding
                )
            )
        n_out = self.output_size(tuple(h_in.shape[-2:]))
        with torch.no_grad():
            w = self.weight().to(h_in.dtype)
            inv = self._lead_inverse(w)
            if mode == "wavefront" or not self.parallel_vijp_valid:
                return self._vijp_wavefront(w, inv, h_in, n_out)
            s1, s2 = self.stride
            rhs = h_in[:, : self.out_channels, ::s1, ::s2][:, :, : n_out[0], : n_out[1]]
            return torch.einsum("bchw,cd->bdhw", rhs, inv)  # channels-last strides

    def _vijp_wavefront(
        self, w: torch.Tensor, inv: torch.Tensor, h_in: torch.Tensor, n_out: tuple[int, int]
    ) -> torch.Tensor:
        """Eq. (14) by anti-diagonals ``t = i'₁ + i'₂`` of the output positions.

        ``h'`` is stored skewed, ``sk[t, i'₁] = h'[:, :, i'₁, t − i'₁]`` (each entry a
        (batch, channel) block), so one anti-diagonal is one contiguous slice and
        its neighbour at offset ``m`` is the contiguous slice of anti-diagonal
        ``t − m₁ − m₂`` shifted by ``m₁``: every step is ``|offsets|`` matrix
        products on views and one product with ``A⁻¹``, no gathers. Entries off
        the grid are never written and stay 0, which is the zero padding of eq. (14).
        """
        (k1, k2), (s1, s2), (p1, p2) = self.kernel_size, self.stride, self.padding
        c, (n1, n2), b = self.out_channels, n_out, h_in.shape[0]
        big1, big2 = (k1 - 1 - p1) // s1, (k2 - 1 - p2) // s2  # largest offsets m
        offs = [(a, d) for a in range(big1 + 1) for d in range(big2 + 1) if (a, d) != (0, 0)]
        # coefficient of h'_{i'−m, c'} in h_{s i', c} is w[c', c, p + s m] (eq. (13))
        taps = [w[:, :c, p1 + s1 * a, p2 + s2 * d] for a, d in offs]
        lag = big1 + big2  # zero anti-diagonals in front of t = 0
        rows = h_in[:, :c, ::s1, ::s2][:, :, :n1, :n2].permute(2, 3, 0, 1).contiguous()
        sk = h_in.new_zeros(n1 + n2 - 1 + lag, n1 + big1, b, c)
        dev = h_in.device
        for t in range(n1 + n2 - 1):
            lo, hi = max(0, t - n2 + 1), min(t, n1 - 1) + 1
            i1 = torch.arange(lo, hi, device=dev)
            rhs = rows[i1, t - i1].reshape(-1, c)  # h_{s i'} on this anti-diagonal
            for (a, d), tap in zip(offs, taps, strict=True):
                done = sk[t + lag - a - d, lo + big1 - a : hi + big1 - a]
                rhs.addmm_(done.reshape(-1, c), tap, alpha=-1)
            torch.mm(rhs, inv, out=sk[t + lag, lo + big1 : hi + big1].view(-1, c))
        i1 = torch.arange(n1, device=dev)[:, None]
        i2 = torch.arange(n2, device=dev)[None, :]
        out = sk[i1 + i2 + lag, i1 + big1]  # (n1, n2, b, c)
        return out.permute(2, 0, 1, 3).contiguous().permute(0, 3, 1, 2)  # channels-last strides

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(y, grads)``: effective-weight gradient by ``convolution_backward``, then
        chained through the mask (``weight_raw``) and ``tanh`` (``diag_raw``)."""
        with torch.no_grad():
            self._check_input(x)
            w = self.weight()
            y = F.conv2d(x, w, self.bias, self.stride, self.padding)
            _, gw, gb = torch.ops.aten.convolution_backward(
                h_out,
                x,
                w,
                [self.out_channels] if self.bias is not None else None,
                list(self.stride),
                list(self.padding),
                [1, 1],
                False,
                [0, 0],
                1,
                [False, True, self.bias is not None],
            )
            idx = torch.arange(self.out_channels, device=w.device)
            p1, p2 = self.padding
            g_raw = gw * self._mask
            # index_put overwrote the diagonal taps, so autograd gives weight_raw exactly
            # zero there (not gw·mask, which is NaN where gw is NaN).
            g_raw[idx, idx, p1, p2] = 0
            full = {
                "weight_raw": g_raw,
                "diag_raw": gw[idx, idx, p1, p2] * diag_grad_from_raw(self.diag_raw),
            }
            if self.bias is not None:
                full["bias"] = gb
        return y, {n: full[n] for n, p in self.named_parameters() if p.requires_grad}

    def check(self, x: torch.Tensor | None = None) -> None:
        """Raise :class:`LayerConditionError` naming the violated Lemma 1 condition.

        Without ``x``: ``k > p``, ``s > p`` (i) and ``c_out ≤ c_in`` (ii); (iii)
        holds by the parametrisation, and a warning is raised when the centre
        tap is ill-conditioned. With ``x``: also its shape and ``n > s(n'−1)``.
        """
        me = self._describe()
        for k, s, p in zip(self.kernel_size, self.stride, self.padding, strict=True):
            if not k > p:
                raise LayerConditionError(KERNEL_LE_PADDING.format(layer=me, k=k, p=p, k_1=k - 1))
            if not s > p:
                raise LayerConditionError(
                    STRIDE_LE_PADDING.format(layer=me, s=s, p=p, p_1=p + 1, s_1=s - 1)
                )
        if self.out_channels > self.in_channels:
            raise LayerConditionError(
                TOO_MANY_OUT_CHANNELS.format(
                    layer=me, c_out=self.out_channels, c_in=self.in_channels
                )
            )
        if x is not None:
            self._check_input(x)
        if hasattr(self, "diag_raw"):
            self._lead_inverse()

    def _check_input(self, x: torch.Tensor) -> None:
        """Shape and Lemma 1 (i)'s ``n > s(n'−1)``; cheap (Python ints only)."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise LayerConditionError(
                BAD_INPUT.format(
                    layer=self._describe(), c_in=self.in_channels, shape=tuple(x.shape)
                )
            )
        if not x.is_floating_point():
            raise LayerConditionError(NOT_FLOAT.format(layer=self._describe(), dtype=x.dtype))
        for dim, (n, k, s, p) in enumerate(
            zip(x.shape[-2:], self.kernel_size, self.stride, self.padding, strict=True)
        ):
            if _size_ok(n, k, s, p):
                continue
            if n + 2 * p < k:
                raise LayerConditionError(
                    INPUT_SMALLER_THAN_KERNEL.format(
                        layer=self._describe(), n=n, dim=dim, p=p, k=k, need=k - 2 * p
                    )
                )
            below = next((m for m in range(n - 1, 0, -1) if _size_ok(m, k, s, p)), None)
            above = next(m for m in range(n + 1, n + 2 * s + k + 1) if _size_ok(m, k, s, p))
            fix = f"{below} or {above}" if below is not None else str(above)
            raise LayerConditionError(
                SPATIAL_TOO_SMALL.format(
                    layer=self._describe(),
                    dim=dim,
                    n=n,
                    n_out=(n + 2 * p - k) // s + 1,
                    s=s,
                    fix=fix,
                )
            )
