"""Transforms: what autograd keeps inside the parts of a model a base engine leaves to
autograd (see :mod:`leangrad.engines._compose` for how they combine with engines).

- ``rad``: randomized AD (Oktay et al., ICLR 2021): linear maps keep a random
  ``fraction`` of their input for the weight gradient (unbiased), ReLUs one bit;
- ``fad``: nested forward-mode AD of element-wise chains (one derivative per chain
  instead of its intermediates; exact), by the ``torch.fx`` pass ``fad.nest`` with the
  eager ``fad.nested()`` mode as the automatic fallback for untraceable modules;
- ``bits``: exact 1-bit masks and pooling that keeps nothing (:mod:`leangrad.bits`).

Each ``apply(module)`` returns a transformed module sharing ``module``'s tensors, and a
report of what changed and what was left alone, and why.
"""

from __future__ import annotations

import abc
import inspect
import warnings
from typing import Any, ClassVar, cast

import torch
from torch import nn

from .. import _errors as errors
from ._base import Engine
from ._blocks import blocks as find_blocks
from ._prepare import share_copy

__all__ = [
    "BAD_FAD_MODE",
    "TRANSFORMS",
    "BitsTransform",
    "FadTransform",
    "RadTransform",
    "Transform",
    "kw_options",
    "label",
]

BAD_FAD_MODE = "fad mode must be 'auto', 'fx' or 'eager', got {value!r}"


class Transform(abc.ABC):
    """What a transform does to the autograd parts of a model (see module docstring)."""

    name: ClassVar[str]
    exact: ClassVar[bool]
    forward_mode_why: ClassVar[str] = ""

    def __init__(self, **options: Any) -> None:
        self.options = options

    @property
    def label(self) -> str:
        return label(self.name, type(self), self.options)

    @abc.abstractmethod
    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        """A transformed module sharing ``module``'s tensors, and a report of what changed."""


class RadTransform(Transform):
    """Randomized AD on every supported layer (``leangrad.rad.randomize``).

    Args:
        fraction: share of each linear map's input kept for its weight gradient, in
            (0, 1]; 1 is exact.
        mode: ``"different"`` (per-example samples), ``"same"`` or ``"project"``.
        replace: sample with replacement (the paper) instead of without.
        seed: seeds one generator owned by the prepared model, so the global RNG stream
            advances as under autograd; ``None`` draws samples from the global stream
            (like dropout does).
    """

    name = "rad"
    exact = False
    forward_mode_why = (
        "forward mode keeps nothing for a backward pass, so rad has nothing to sample"
    )

    def __init__(
        self, *, fraction: float = 0.1, mode: str = "different", replace: bool = False,
        seed: int | None = None,
    ) -> None:  # fmt: skip
        from ..rad._sampling import SampleSpec

        SampleSpec(fraction, mode, replace)  # validates now, not at the first step
        super().__init__(fraction=fraction, mode=mode, replace=replace, seed=seed)
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        """One stream for every preparation (a model switched to eval and back is prepared
        again, and must not restart its samples); saved with training checkpoints."""

    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        from .. import rad

        wrapped = nn.Sequential(share_copy(module))  # randomize swaps children, not the root
        opts = {**self.options, "seed": None}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report lists what stayed exact
            report = rad.randomize(wrapped, **opts)
        for m in wrapped.modules():
            if hasattr(m, "generator"):
                cast(Any, m).generator = self.generator
        return wrapped, {
            "swapped": {k.removeprefix("0."): v for k, v in report.swapped.items()},
            "left_exact": [k.removeprefix("0.") for k in report.left_exact],
        }


class FadTransform(Transform):
    """Nested forward-mode AD of element-wise chains (``leangrad.fad``); exact.

    Args:
        mode: ``"auto"`` — the fx pass ``fad.nest``, or the eager ``fad.nested()`` mode
            when fx cannot trace the module; ``"fx"`` or ``"eager"`` to force one.
        min_ops: chains with fewer primitives are left to autograd (fx pass).
    """

    name = "fad"
    exact = True
    forward_mode_why = (
        "forward mode runs no backward pass, so there is nothing for fad's fused "
        "chains to save"
    )

    def __init__(self, *, mode: str = "auto", min_ops: int = 2) -> None:
        if mode not in ("auto", "fx", "eager"):
            raise ValueError(BAD_FAD_MODE.format(value=mode))
        Engine._positive_int("min_ops", min_ops)
        super().__init__(mode=mode, min_ops=min_ops)

    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        from .. import fad

        mode, min_ops = self.options["mode"], self.options["min_ops"]
        if mode != "eager":
            try:
                gm = fad.nest(share_copy(module), min_ops=min_ops)
            except fad.FadTraceError as err:
                if mode == "fx":
                    raise
                reason = str(err)
                per_block = self._per_block(module)
                if per_block is not None:
                    return per_block
            else:
                return gm, _fad_report(gm)
        else:
            reason = "mode='eager'"
        return _Nested(module), {"used": "eager", "why": reason}

    def _per_block(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]] | None:
        """A module that is its blocks run one after another (a ``leangrad.Chain``, whose
        ``forward(*inputs)`` fx cannot trace) is nested block by block, each block by the
        fx pass where it traces and by the eager mode where it does not."""
        try:
            found = find_blocks(module)
        except errors.LeangradError:
            return None
        if not found.sequential:
            return None
        parts, fused, left, eager = [], [], [], []
        for name in found.names:
            block, what = self.apply(found.modules[name])
            parts.append(block)
            if what["used"] == "fx":
                fused += [f"{name}: {f}" for f in what["fused"]]
                left += [f"{name}: {f}" for f in what["left"]]
            else:
                eager.append(name)
        used = "fx+eager" if eager else "fx"
        report: dict[str, Any] = {"used": used, "fused": fused, "left": left}
        if eager:
            report["why"] = f"fx cannot trace blocks {', '.join(eager)}: eager mode there"
            left.append(report["why"])
        return nn.Sequential(*parts), report


_BUILTIN_ACTIVATIONS = (nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish)
"""PyTorch's fused activation modules that fad does not open (the pass lists its own
primitives, e.g. a lone ReLU, with the reason it left them)."""


def _fad_report(gm: Any) -> dict[str, Any]:
    """What the fx pass fused, what it left to autograd (and why), and PyTorch's fused
    activation modules it leaves alone (rewriting them saves no bytes: they keep only
    their input, like a fused chain)."""
    fused = [f"{r.name}: {' -> '.join(r.ops)} (from {r.source})"
             for r in gm.fad_regions if r.name is not None]  # fmt: skip
    left = [f"{' -> '.join(r.ops)} (from {r.source}): {r.skipped}"
            for r in gm.fad_regions if r.skipped is not None]  # fmt: skip
    left += [f"{' -> '.join(r.ops)} (from {r.source}): is PyTorch's fused {r.builtin}, which "
             "keeps the same one tensor and is faster: run by it"
             for r in gm.fad_regions if r.builtin is not None]  # fmt: skip
    for node in gm.graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if isinstance(mod, _BUILTIN_ACTIVATIONS):
                left.append(f"{type(mod).__name__} {node.target!r}: PyTorch's fused built-in "
                            "(it keeps only its input already): left alone")  # fmt: skip
    return {"used": "fx", "fused": fused, "left": left}


def _tree_map(fn: Any, out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_tree_map(fn, o) for o in out)
    if isinstance(out, dict):
        return {k: _tree_map(fn, v) for k, v in out.items()}
    return out


class _Nested(nn.Module):
    """Runs a module under ``fad.nested()`` (the eager mode, for untraceable modules)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *xs: Any) -> Any:
        from .. import fad

        with fad.nested():
            out = self.inner(*xs)
            # A chain value leaving the block would reach the loss after the mode ended
            # (its derivative never attached): pass each output tensor through one
            # non-element-wise op inside the block.
            return _tree_map(lambda t: torch.cat([t]) if t.requires_grad else t, out)


class BitsTransform(Transform):
    """Exact savings (:mod:`leangrad.bits`): ReLU, LeakyReLU and dropout keep 1-bit masks,
    average pooling keeps nothing. Exact; it pays where nothing else keeps the full
    tensor (the planner measures it)."""

    name = "bits"
    exact = True
    forward_mode_why = (
        "forward mode keeps nothing for a backward pass, so there is no mask to pack"
    )

    def __init__(self) -> None:
        super().__init__()

    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        from .. import bits

        wrapped = nn.Sequential(share_copy(module))  # the root may itself be a ReLU
        report = bits.swap(wrapped)
        return wrapped, {"swapped": {k.removeprefix("0."): v for k, v in report.swapped.items()}}


TRANSFORMS: dict[str, type[Transform]] = {
    "rad": RadTransform,
    "fad": FadTransform,
    "bits": BitsTransform,
}


def label(name: str, cls: type, options: dict[str, Any]) -> str:
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    shown = {k: v for k, v in options.items() if k not in params or params[k].default != v}
    if not shown:
        return name
    return f"{name}({','.join(f'{k}={v}' for k, v in shown.items())})"


def kw_options(cls: type) -> list[str]:
    """The keyword-only options of an engine or transform class."""
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    return [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY]
