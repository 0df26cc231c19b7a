"""The chain-layer contract (DESIGN.md, "Layer rules"): the rules an engine may ask for.

A chain layer is an ``nn.Module`` mapping one tensor to one tensor, with these
rules beside its ``forward`` (each has a generic default where one exists):

- ``residual(x, y)``: minimal data to pull a cotangent back to ``x``
  (default: ``x`` itself);
- ``vjp_input(res, h_out)``: ``h_in = h_out · ∂y/∂x`` (default: autograd from ``x``);
- ``vijp(x, h_in)``: ``h_out = h_in · (∂y/∂x)⁺``, submersive layers only
  (default: raises :class:`NotSubmersiveError`);
- ``forward_vjp_params(x, h_out)``: ``(y, {name: h_out · ∂y/∂θ})`` in one forward
  (default: autograd on this layer alone);
- ``inverse(y)``: ``x`` from ``y``, invertible layers only (default: raises
  :class:`NotInvertibleError`);
- ``check(x=None)``: validate the layer's conditions (default: nothing to check).

Moonwalk v2 (Krylov, Karamzade, Fox, AISTATS 2026), eqs. (8)–(10): with the
input cotangent h₀ known, ``h_i = vijp(f_i, x_{i−1}, h_{i−1})`` and
``g_i = h_i ∂x_i/∂θ_i`` recover every parameter gradient in a forward sweep.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import torch
from torch import nn

from .._errors import LeangradError

__all__ = [
    "FRAGMENT_RULE",
    "INPUT_DTYPE",
    "NOT_POSITIVE_INT",
    "ChainLayer",
    "FragmentalLayer",
    "LayerConditionError",
    "NotInvertibleError",
    "NotSubmersiveError",
    "autograd_forward_vjp_params",
    "autograd_vjp_input",
    "check_input_dtype",
    "positive_int",
]


class NotSubmersiveError(LeangradError, TypeError):
    """A layer without a right-inverse Jacobian was asked for a vijp."""


class NotInvertibleError(LeangradError, TypeError):
    """A layer without an inverse was asked to invert."""


class LayerConditionError(LeangradError, ValueError):
    """A layer's construction or input violates a condition its rules rely on."""


NOT_SUBMERSIVE = (
    "{layer} is not submersive (its Jacobian has no right-inverse), so Moonwalk cannot "
    "rebuild its output cotangent from its input cotangent; make it submersive (e.g. "
    "leangrad.layers.SubmersiveConv2d, whose Lemma 1 conditions guarantee it), move it "
    "into the chain's head, or use the 'checkpoint' engine"
)
NOT_POSITIVE_INT = "{layer}: {name} must be a positive int, got {value!r}"
INPUT_DTYPE = (
    "{layer} has {param} parameters but got an input of dtype {dtype}; cast the input, "
    "e.g. x.to({param}), or the layer, e.g. layer.to({dtype})"
)
NOT_INVERTIBLE = (
    "{layer} is not invertible, so 'revbackprop' cannot recompute its input; "
    "use the 'moonwalk' or 'checkpoint' engine"
)
FRAGMENT_RULE = (
    "{layer} is a FragmentalLayer but does not implement {rule}; implement check_fragment, "
    "fragments and vijp_fragments (see leangrad.layers.FragmentalConv1d)"
)


def positive_int(layer: str, name: str, value: object) -> int:
    """``value`` as an int >= 1 (numpy ints too), else :class:`LayerConditionError`.

    Never rounds: ``4.7`` features is an error, not 4; ``True`` is not 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LayerConditionError(NOT_POSITIVE_INT.format(layer=layer, name=name, value=value))
    return int(value)


def check_input_dtype(layer: str, x: torch.Tensor, param: torch.Tensor) -> None:
    """A floating input must have its layer's parameter dtype (autocast regions excepted:
    there the kernels cast both), named here instead of as a raw kernel error."""
    if (
        x.dtype != param.dtype
        and x.is_floating_point()
        and not torch.is_autocast_enabled(x.device.type)
    ):
        raise LayerConditionError(INPUT_DTYPE.format(layer=layer, param=param.dtype, dtype=x.dtype))


def autograd_vjp_input(layer: nn.Module, x: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """``h_out · ∂layer/∂x`` by autograd (recomputes the layer's forward from ``x``)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        y = layer(xg)
        (h_in,) = torch.autograd.grad(y, xg, h_out)
    return h_in


def autograd_forward_vjp_params(
    layer: nn.Module, x: torch.Tensor, h_out: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(layer(x), {name: h_out · ∂layer/∂θ})`` with one forward and one backward."""
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    with torch.enable_grad():
        y = layer(x.detach())
        if not params:
            return y.detach(), {}
        grads = torch.autograd.grad(y, list(params.values()), h_out, allow_unused=True)
    out = {
        n: (g if g is not None else torch.zeros_like(p))
        for (n, p), g in zip(params.items(), grads, strict=True)
    }
    return y.detach(), out


class ChainLayer(nn.Module):
    """Base class of layers that carry Moonwalk/RevBackprop rules.

    Subclasses implement ``forward`` and override the rules they can do better
    than the defaults. Class attributes say what the layer is:

    Attributes:
        submersive: ``vijp`` is implemented (the Jacobian is right-invertible).
        invertible: ``inverse`` is implemented.
        vijp_needs_input: ``vijp`` reads ``x`` (``False`` for linear layers).
        fragmental: not submersive, but a :class:`FragmentalLayer`, whose
            ``vijp_fragments`` rebuilds the output cotangent from fragments of it kept in
            Phase II (Moonwalk v2 section 5.1, fragmental checkpointing).
    """

    submersive: ClassVar[bool] = False
    fragmental: ClassVar[bool] = False
    invertible: ClassVar[bool] = False
    vijp_needs_input: ClassVar[bool] = True
    """``False`` when ``vijp`` ignores ``x`` (a linear layer: its Jacobian is constant), so
    an engine may call ``vijp(None, h_in)`` and build ``x`` only afterwards."""

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        """What Phase I keeps to compute ``vjp_input`` later. Default: ``x`` itself."""
        del y
        return x

    def vjp_input(self, res: Any, h_out: torch.Tensor) -> torch.Tensor:
        """Input cotangent from the output cotangent. Default: autograd from ``res = x``."""
        return autograd_vjp_input(self, res, h_out)

    def vijp(self, x: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """Output cotangent from the input cotangent (right-inverse Jacobian product)."""
        del x, h_in
        raise NotSubmersiveError(NOT_SUBMERSIVE.format(layer=self._describe()))

    def forward_vjp_params(
        self, x: torch.Tensor, h_out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The output and the parameter gradients ``{name: h_out · ∂y/∂θ}``."""
        return autograd_forward_vjp_params(self, x, h_out)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """The input that produced ``y``."""
        del y
        raise NotInvertibleError(NOT_INVERTIBLE.format(layer=self._describe()))

    def check(self, x: torch.Tensor | None = None) -> None:
        """Raise :class:`LayerConditionError` naming a violated condition (``x``: an input)."""
        del x

    def _describe(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


class FragmentalLayer(ChainLayer):
    """Base class of chain layers that are not submersive but whose output cotangent can be
    rebuilt from their input cotangent and *fragments* of the output cotangent kept in
    Phase II: fragmental checkpointing (Moonwalk v2 section 5.1, Appendix 10, Algorithm 3),
    which ``moonwalk(fragment=B)`` runs through the three rules below.
    """

    submersive: ClassVar[bool] = False
    fragmental: ClassVar[bool] = True

    def check_fragment(self, block: int) -> None:
        """Raise :class:`LayerConditionError` unless fragments of blocks of ``block`` (B)
        positions can rebuild this layer's output cotangent."""
        raise NotImplementedError(
            FRAGMENT_RULE.format(layer=type(self).__name__, rule="check_fragment")
        )

    def fragments(self, h_out: torch.Tensor, block: int) -> Any:
        """What Phase II keeps of the output cotangent ``h_out`` (blocks of ``block``)."""
        raise NotImplementedError(
            FRAGMENT_RULE.format(layer=type(self).__name__, rule="fragments")
        )

    def vijp_fragments(
        self, x: torch.Tensor | None, h_in: torch.Tensor, frags: Any, block: int
    ) -> torch.Tensor:
        """The output cotangent, rebuilt from the input cotangent ``h_in`` and
        :meth:`fragments` of it (``x`` is ``None`` when ``vijp_needs_input`` is false)."""
        raise NotImplementedError(
            FRAGMENT_RULE.format(layer=type(self).__name__, rule="vijp_fragments")
        )
