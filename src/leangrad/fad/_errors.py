"""Errors and message templates of :mod:`leangrad.fad` (constants, so tests assert the text)."""

from __future__ import annotations

from .._errors import LeangradError

__all__ = [
    "BAD_APPROXIMATE",
    "DTYPE_NO_RULE",
    "ESCAPED",
    "FALLBACK",
    "INPLACE_INPUT",
    "NOT_A_FUNCTION",
    "NOT_A_TENSOR",
    "NOT_ELEMENTWISE",
    "NOT_ONE_TENSOR",
    "TWO_SOURCES",
    "UNKNOWN_PRIMITIVE",
    "UNSEEN_CONSUMER",
    "UNSUPPORTED_ARGS",
    "UNTRACEABLE",
    "FadDtypeError",
    "FadError",
    "FadOpError",
    "FadOptionError",
    "FadTraceError",
]


class FadError(LeangradError):
    """Base class of the nested forward-mode AD errors."""


class FadOpError(FadError, ValueError):
    """An operator that is not FAD-compatible where only compatible ones are allowed."""


class FadDtypeError(FadError, TypeError):
    """A dtype for which no forward-mode rule exists (integers, bool, complex)."""


class FadTraceError(FadError, RuntimeError):
    """``fad.nest`` could not trace the model with torch.fx."""


class FadOptionError(FadError, ValueError):
    """An option of a fad layer outside its allowed values (``GELU(approximate=...)``)."""


NOT_ELEMENTWISE = (
    "fad.elementwise: operator {op!r} is not a FAD-compatible element-wise primitive "
    "(paper section III-A); compatible operators are: {known}. Write the function out of "
    "these, or leave this part to autograd"
)
TWO_SOURCES = (
    "fad.elementwise: binary operator {op!r} mixes the source tensor with a second source "
    "({why}); FAD needs both operands to come from the one input (R^1 -> R^M, paper section "
    "III-A). Pass the other tensor as a constant without requires_grad and of a shape that "
    "broadcasts to the input's, or keep this operator outside fad.elementwise"
)
UNSUPPORTED_ARGS = (
    "fad.elementwise: operator {op!r} is a FAD primitive, but this call passes arguments its "
    "forward-mode rule does not take ({args}); call it with the tensor operands and the "
    "parameters {params} only (e.g. no out=, no rounding_mode=, no inplace=True), or leave "
    "this part to autograd"
)
UNKNOWN_PRIMITIVE = (
    "fad.Builder.op: {name!r} is not a FAD primitive (paper section III-A); primitives: {known}"
)
NOT_A_FUNCTION = (
    "fad.elementwise needs a function of one tensor, got {type}; pass e.g. "
    "fad.elementwise(lambda x: x * torch.sigmoid(x))"
)
NOT_A_TENSOR = "{layer}: the input must be a tensor, got {type}"
INPLACE_INPUT = (
    "fad.elementwise: in-place operator {op!r} writes into {target}; use the out-of-place "
    "form (e.g. x.mul(2) instead of x.mul_(2))"
)
NOT_ONE_TENSOR = (
    "fad.elementwise: the function must take one tensor and return a tensor or a non-empty "
    "tuple of tensors computed from it; it returned {what}"
)
DTYPE_NO_RULE = (
    "fad: operator {op!r} has no forward-mode rule for dtype {dtype}; FAD rules exist for "
    "floating dtypes (float16, bfloat16, float32, float64). Cast the input, or use plain "
    "autograd for this activation"
)
UNTRACEABLE = (
    "fad.nest: torch.fx cannot trace {model} ({error}); models fx cannot trace "
    "(data-dependent control flow, item assignment, ...) need the eager mode instead: "
    "`with leangrad.fad.nested(): loss = loss_fn(model(x))`"
)
FALLBACK = (
    "fad: the element-wise chain {ops} cannot be nested ({why}); it runs under plain "
    "autograd instead (same gradient, no memory saving)"
)
ESCAPED = (
    "fad.nested: a tensor computed by the nested element-wise chain {ops} outlived the "
    "`with fad.nested()` block and a gradient reached it through an operation the mode did "
    "not see, so its derivative was never attached: either it was used for a gradient after "
    "the `with fad.nested()` block ended (compute the loss inside the block), or inside the "
    "block by a custom torch.autograd.Function or code run with torch-function handling "
    "disabled (pass the value through a PyTorch operator first, e.g. torch.cat([t]))"
)
UNSEEN_CONSUMER = (
    "fad.nested: a tensor computed by the nested element-wise chain {ops} was used inside the "
    "`with fad.nested()` block by an operation the mode did not see (a custom "
    "torch.autograd.Function, or code run with torch-function handling disabled), so its "
    "derivative was never attached; pass the value through a PyTorch operator first "
    "(e.g. torch.cat([t])), or call that operation outside the block"
)
BAD_APPROXIMATE = "GELU approximate must be 'none' or 'tanh', got {value!r}"
