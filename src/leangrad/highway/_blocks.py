"""Residual blocks decomposed as f(x) = r(x, g(x)) (paper Table 1, Appendix C.3), and
:class:`ResidualStack`, which chains them for the highway engine.

========================  ==========================  ====================  =========
block                     g(x)                        r(x, z)               K
========================  ==========================  ====================  =========
:class:`PreActBlock`      BN-ReLU-conv ×2             x + z                 identity
:class:`PostReLUBlock`    conv-BN-ReLU-conv-BN        ReLU(x + z)           diagonal
:class:`PreLNSublayer`    Layer(LN(x)) + γx  (eq. 17) (1 − γ)x + z          scalar
:class:`PostLNSublayer`   [(1−γ)a, b + γ x⊙a] (eq.23) x ⊙ z1 + z2           diagonal
========================  ==========================  ====================  =========

The transformer sublayers follow the paper's split of one transformer layer into an
attention and a feed-forward sublayer, each with its residual (section 5.1.1).
:class:`ResidualStack` differentiates the blocks' ``g`` with autograd: the J-vjp of all
L blocks is one ``torch.autograd.grad`` call over the L detached block graphs (eq. 8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..layers._highway import (
    BLOCK_WIDTH,
    MISMATCHED_SIZES,
    HighwayBlock,
    HighwayError,
    HighwayStack,
    Trace,
    check_block,
    check_gamma,
    check_k,
)

__all__ = [
    "PostLNSublayer",
    "PostReLUBlock",
    "PreActBlock",
    "PreLNSublayer",
    "ResidualStack",
    "block_width",
]

_T = TypeVar("_T")
_CHANNEL_SIZES = ("in_channels", "num_features")  # sizes dimension 1 of the input
_FEATURE_SIZES = ("in_features", "embed_dim", "normalized_shape")  # size the last dimension


def _conv(channels: int) -> nn.Conv2d:
    return nn.Conv2d(channels, channels, 3, padding=1, bias=False)


class PreActBlock(HighwayBlock):
    """Pre-activation ResNet block (He et al. 2016): ``x + conv(relu(bn(conv(relu(bn x)))))``.

    Table 1 row 1 / eq. 14: ``g = Block``, ``r(x, z) = x + z``, ``K = I``.
    """

    k_structure = "identity"
    width_dim = 1

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.width = channels
        self.bn1, self.conv1 = nn.BatchNorm2d(channels), _conv(channels)
        self.bn2, self.conv2 = nn.BatchNorm2d(channels), _conv(channels)

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x))))))

    def r(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x + z

    def r_z_vjp(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w


class PostReLUBlock(HighwayBlock):
    """Original ResNet block: ``relu(x + bn(conv(relu(bn(conv x)))))`` (Table 1 row 2, eq. 15).

    ``r(x, z) = ReLU(x + z)``, so ``K = diag(1[x + z > 0])`` and ``∂r/∂z`` is the same mask.
    """

    k_structure = "diagonal"
    width_dim = 1

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.width = channels
        self.conv1, self.bn1 = _conv(channels), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = _conv(channels), nn.BatchNorm2d(channels)

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))

    def r(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return F.relu(x + z)

    def k_factor(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (x + z > 0).to(x.dtype)

    def r_z_vjp(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x + z > 0).to(w.dtype)


class _Sublayer(nn.Module):
    """Causal self-attention or a GELU MLP on ``(batch, tokens, d_model)``."""

    def __init__(self, d_model: int, heads: int, kind: str) -> None:
        super().__init__()
        if kind not in ("attention", "mlp"):
            raise ValueError(f"kind must be 'attention' or 'mlp', got {kind!r}")
        self.kind = kind
        if kind == "attention":
            self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            return self.mlp(x)
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


class PreLNSublayer(HighwayBlock):
    """Pre-LN transformer sublayer ``x + Layer(LN(x))`` with the γ split of eq. 17.

    ``g(x) = Layer(LN(x)) + γx`` and ``r(x, z) = (1 − γ)x + z``, so ``K = (1 − γ)I``:
    identity at γ = 0 (Table 1), the fixed-point-iteration baseline at γ = 1 (the paper
    used γ = 0.2 for GPT-2). The forward value does not depend on γ.

    Args:
        d_model: feature size; heads: attention heads; kind: ``"attention"`` or ``"mlp"``.
        gamma: in [0, 1].
    """

    k_structure = "scalar"

    def __init__(self, d_model: int, heads: int = 2, *, kind: str = "mlp", gamma: float = 0.0):
        super().__init__()
        self.width = d_model
        self.gamma = check_gamma(type(self).__name__, gamma)
        self.ln = nn.LayerNorm(d_model)
        self.layer = _Sublayer(d_model, heads, kind)

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.ln(x)) + self.gamma * x

    def r(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (1 - self.gamma) * x + z

    def k_factor(self, x: torch.Tensor, z: torch.Tensor) -> float:
        return 1.0 - self.gamma

    def r_z_vjp(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w


class PostLNSublayer(HighwayBlock):
    """Post-LN transformer sublayer ``LN(x + Layer(x))`` with the γ variant of eq. 23.

    With ``σ(x)`` the token's standard deviation of ``x + Layer(x)`` and ``α, β`` the
    LayerNorm affine, ``LN(x + Layer(x)) = x ⊙ a(x) + b(x)`` with ``a = α/σ`` and
    ``b = (Layer(x) − μ) ⊙ α/σ + β`` (eq. 18-21). Eq. 23: ``g = [(1−γ)a, b + γ x⊙a]``,
    ``r(x, z) = x ⊙ z1 + z2``, so ``K = diag((1−γ)a)``; γ = 1 is the FPI baseline.
    """

    k_structure = "diagonal"

    def __init__(self, d_model: int, heads: int = 2, *, kind: str = "mlp", gamma: float = 0.0):
        super().__init__()
        self.width = d_model
        self.gamma = check_gamma(type(self).__name__, gamma)
        self.layer = _Sublayer(d_model, heads, kind)
        self.ln = nn.LayerNorm(d_model)

    def g(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.layer(x)
        s = x + y
        mu = s.mean(-1, keepdim=True)
        sigma = torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + self.ln.eps)
        a = self.ln.weight / sigma
        b = (y - mu) * a + self.ln.bias
        return (1 - self.gamma) * a, b + self.gamma * x * a

    def r(self, x: torch.Tensor, z: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x * z[0] + z[1]

    def k_factor(self, x: torch.Tensor, z: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return z[0].expand_as(x)

    def r_z_vjp(
        self, x: torch.Tensor, z: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return w * x, w


def _unwrapped(block: nn.Module) -> nn.Module:
    """The user's block inside a wrapper an engine or PyTorch put around it (the checkpoint
    engine's ``inner``, ``torch.compile``'s ``_orig_mod``, DDP's ``module``)."""
    for _ in range(8):
        inner = next(
            (m for a in ("inner", "_orig_mod", "module")
             if isinstance(m := getattr(block, a, None), nn.Module)),
            None,
        )  # fmt: skip
        if inner is None:
            break
        block = inner
    return block


def block_width(block: nn.Module, *, declared_only: bool = False) -> tuple[int, int] | None:
    """``(width, dim)``: the input width ``block`` is built for and the input dimension that
    holds it. Its declared :attr:`~leangrad.highway.HighwayBlock.width` and ``width_dim``
    if set; else (unless ``declared_only``) a guess from its first submodule with a known
    input size — a conv's or BatchNorm's channels at dimension 1, a Linear's, LayerNorm's
    or attention's features at the last one; ``None`` if there is neither."""
    block = _unwrapped(block)
    width = getattr(block, "width", None)
    if isinstance(width, int) and not isinstance(width, bool):
        return width, int(getattr(block, "width_dim", -1))
    if declared_only:
        return None
    for m in block.modules():
        for attr, dim in [(a, 1) for a in _CHANNEL_SIZES] + [(a, -1) for a in _FEATURE_SIZES]:
            size = getattr(m, attr, None)
            if isinstance(size, (tuple, list, torch.Size)) and size:
                size = size[-1]
            if isinstance(size, int) and not isinstance(size, bool):
                return size, dim
    return None


def _detach(z: Any) -> Any:
    return tuple(t.detach() for t in z) if isinstance(z, tuple) else z.detach()


def _flat(z: Any) -> list[torch.Tensor]:
    return list(z) if isinstance(z, tuple) else [z]


class ResidualStack(HighwayStack):
    """A chain of :class:`HighwayBlock` s of one state shape: ``x -> f_L(… f_1(x))``.

    The loss sees only the last state (a classifier head), so ``∂L_t/∂h_t = 0`` for
    t < L. The J-vjp of every block is one ``torch.autograd.grad`` call over the blocks'
    own graphs, whose inputs are detached from each other (eq. 8).
    """

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(blocks) == 0:
            raise HighwayError("ResidualStack needs at least one block, got none")
        for b in blocks:
            check_block(b)
        for i in range(1, len(blocks)):
            prev, cur = (block_width(b, declared_only=True) for b in blocks[i - 1 : i + 1])
            if prev is not None and cur is not None and prev[0] != cur[0]:
                source = f"the output of block {i - 1} ({type(blocks[i - 1]).__name__})"
                raise HighwayError(self._width_message(i, blocks[i], cur[0], prev[0], source))
        self.blocks = nn.ModuleList(blocks)

    @staticmethod
    def _width_message(index: int, block: nn.Module, want: int, got: int, source: str) -> str:
        fix = (
            f"give the stack inputs of width {want} (e.g. a stem that maps to {want}), or "
            f"build its blocks with width {got}"
            if index == 0
            else f"build block {index} with width {got} like block {index - 1}, or end this "
            f"ResidualStack there and start another one after a projection to width {want}"
        )
        return BLOCK_WIDTH.format(
            where="ResidualStack", index=index, block=type(_unwrapped(block)).__name__, want=want,
            got=got, source=source, fix=fix,
        )  # fmt: skip

    def _width_error(self, index: int, x: torch.Tensor, *, declared_only: bool
                     ) -> HighwayError | None:  # fmt: skip
        """The error naming block ``index`` when ``x`` has another width than it expects."""
        block = self.blocks[index]
        found = block_width(block, declared_only=declared_only)
        if found is None or not -x.dim() <= found[1] < x.dim():
            return None
        want, got = found[0], x.shape[found[1]]
        if got == want:
            return None
        source = (
            f"the stack's input, shape {tuple(x.shape)}" if index == 0
            else f"the output of block {index - 1} "
            f"({type(_unwrapped(self.blocks[index - 1])).__name__}), "
            f"shape {tuple(x.shape)}"
        )  # fmt: skip
        return HighwayError(self._width_message(index, block, want, got, source))

    def _run_block(self, index: int, x: torch.Tensor, fn: Callable[[torch.Tensor], _T]) -> _T:
        """``fn(x)`` for block ``index``: a width that the block does not expect is named
        (declared widths before the call; guessed ones when the call fails) instead of
        surfacing as PyTorch's error from deep inside the block."""
        err = self._width_error(index, x, declared_only=True)
        if err is not None:
            raise err
        try:
            return fn(x)
        except RuntimeError as failure:
            err = self._width_error(index, x, declared_only=False)
            if err is None:
                raise
            raise err from failure

    @property
    def _each(self) -> list[HighwayBlock]:
        """The blocks, typed as the protocol ``check_block`` validated them against."""
        return cast("list[HighwayBlock]", list(self.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = self._run_block(i, x, b)
        return x

    def trace(self, x: torch.Tensor) -> Trace:
        xs: list[torch.Tensor] = []
        zs: list[Any] = []
        ks: list[Any] = []
        h = x.detach()
        for i, b in enumerate(self._each):
            xi = h.requires_grad_()
            with torch.enable_grad():
                z = self._run_block(i, xi, b.g)
            zd = _detach(z)
            with torch.no_grad():
                h = b.r(xi.detach(), zd)
                kf = b.k_factor(xi.detach(), zd)
            name = f"ResidualStack.blocks[{i}] ({type(b).__name__})"
            if h.shape != xi.shape:
                raise HighwayError(
                    MISMATCHED_SIZES.format(
                        where=name, detail=f"maps {tuple(xi.shape)} to {tuple(h.shape)}"
                    )
                )
            check_k(name, b.k_structure, kf, xi.shape)
            xs.append(xi)
            zs.append(z)
            ks.append(kf)
            h = h.detach()
        return Trace(output=h, length=len(xs), k=self._stack_k(ks, h), saved={"xs": xs, "zs": zs})

    @staticmethod
    def _stack_k(ks: list[Any], h: torch.Tensor) -> torch.Tensor | None:
        if all(k is None for k in ks):
            return None
        ones = (1,) * h.dim()
        if all(not isinstance(k, torch.Tensor) or k.numel() == 1 for k in ks):
            vals = [1.0 if k is None else float(k) for k in ks]
            return torch.tensor(vals, dtype=h.dtype, device=h.device).reshape(-1, *ones)
        full = [
            torch.ones_like(h) if k is None
            else (k if isinstance(k, torch.Tensor) and k.shape == h.shape
                  else torch.full_like(h, float(k)))
            for k in ks
        ]  # fmt: skip
        return torch.stack(full)

    def direct_grads(self, trace: Trace, dy: torch.Tensor) -> torch.Tensor:
        a = dy.new_zeros((trace.length, *dy.shape))
        a[-1] = dy
        return a

    def _cotangents(self, trace: Trace, w: torch.Tensor) -> list[torch.Tensor]:
        xs, zs = trace.saved["xs"], trace.saved["zs"]
        out: list[torch.Tensor] = []
        for b, x, z, wt in zip(self._each, xs, zs, w, strict=True):
            out += _flat(b.r_z_vjp(x.detach(), _detach(z), wt))
        return out

    def _outputs(self, trace: Trace) -> list[torch.Tensor]:
        return [t for z in trace.saved["zs"] for t in _flat(z)]

    def j_vjp(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(
            self._outputs(trace), trace.saved["xs"], self._cotangents(trace, w),
            retain_graph=True, allow_unused=True,
        )  # fmt: skip
        return torch.stack(
            [torch.zeros_like(x) if g is None else g for g, x in zip(grads, trace.saved["xs"],
                                                                      strict=True)]
        )

    def param_vjp(
        self, trace: Trace, w: torch.Tensor, dy: torch.Tensor
    ) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor]:
        del dy
        params = [p for p in self.parameters() if p.requires_grad]
        x0 = trace.saved["xs"][0]
        grads = torch.autograd.grad(
            self._outputs(trace), [*params, x0], self._cotangents(trace, w),
            allow_unused=True,
        )  # fmt: skip
        out = {p: g for p, g in zip(params, grads[:-1], strict=True) if g is not None}
        dx = grads[-1] if grads[-1] is not None else torch.zeros_like(x0)
        dx = dx + (w[0] if trace.k is None else w[0] * trace.k[0])
        return out, dx
