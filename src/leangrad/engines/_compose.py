"""Composition: a base engine plus transforms, one spelling everywhere (DESIGN.md,
"Composition and planning").

A step is a *base engine* — how gradients flow (backprop, checkpoint, moonwalk, …) — plus
*transforms* — what autograd keeps inside the parts the base engine leaves to autograd:

- ``rad``: randomized AD (Oktay et al., ICLR 2021): linear maps keep a random
  ``fraction`` of their input for the weight gradient (unbiased), ReLUs one bit;
- ``fad``: nested forward-mode AD of element-wise chains (one derivative per chain
  instead of its intermediates; exact), by the ``torch.fx`` pass ``fad.nest`` with the
  eager ``fad.nested()`` mode as the automatic fallback for untraceable modules.

``leangrad.engine("checkpoint+fad", segments="sqrt")`` runs checkpointing on a model
whose blocks were each nested; ``"rad"`` and ``"fad"`` alone mean ``backprop+rad`` and
``backprop+fad``. Options go to the one part that knows them (``fraction`` to rad,
``segments`` to checkpoint); a name two parts share is written ``<part>_<option>``
(``rad_seed=0``).

The transformed model is prepared once per model (again only when its parameters,
modules or train/eval modes change) and shares the user's ``Parameter`` and buffer
objects, so ``.grad`` lands where the user's optimizer looks; the user's module is
never modified. Where the transforms apply depends on the base engine: the whole model
(backprop), each block (checkpoint: a block stays a block), or the stem and head
(moonwalk, revbackprop, highway: the chain's layers keep their rules).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect
import warnings
from typing import Any, ClassVar

import torch
from torch import nn

from .. import _errors as E
from ._base import Engine, LossFn, OnGrad, StepResult
from ._blocks import blocks as find_blocks
from ._checkpoint import Checkpoint
from ._prepare import PreparedCache, share_copy
from ._registry import register

__all__ = [
    "INCOMPATIBLE",
    "TRANSFORMS",
    "Bits",
    "BitsTransform",
    "Composed",
    "Explanation",
    "Fad",
    "FadTransform",
    "Rad",
    "RadTransform",
    "Transform",
    "compose",
    "explain",
    "share_copy",
]

INCOMPATIBLE = "engine {pair!r} cannot work: {why}"
BASE_FIRST = (
    "{name!r}: write the base engine first and the transforms after it, e.g. "
    "{suggestion!r}; base engines: {bases}; transforms: {transforms}"
)
TWICE = "{name!r} names the transform {transform!r} twice; apply each transform once"
AMBIGUOUS = (
    "engine {name!r}: option {option!r} belongs to {owners}; write it as one of "
    "{spelled} to say which"
)
EAGER_WITH_RAD = (
    "fad falls back to its eager mode on the {part} ({reason}), and the eager mode cannot "
    "see inside rad's autograd Functions; use one of the two, or make the {part} "
    "traceable by torch.fx"
)
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
        return _label(self.name, type(self), self.options)

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
                m.generator = self.generator
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
        except E.LeangradError:
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
        report = {"used": "fx+eager" if eager else "fx", "fused": fused, "left": left}
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
             for r in gm.fad_regions if r.skipped is None]  # fmt: skip
    left = [f"{' -> '.join(r.ops)} (from {r.source}): {r.skipped}"
            for r in gm.fad_regions if r.skipped is not None]  # fmt: skip
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


class Composed(Engine):
    """A base engine run on the model as the transforms prepare it (module docstring).

    Made by :func:`leangrad.engine` from a name such as ``"checkpoint+fad"``; ``"rad"``
    and ``"fad"`` are registered as engines of their own (``backprop`` + the transform).
    ``exact`` holds when the base engine and every transform are exact.
    """

    name = "composed"

    def __init__(self, base: Engine, transforms: list[Transform]) -> None:
        super().__init__()
        self.base = base
        self.transforms = transforms
        self.exact = base.exact and all(t.exact for t in transforms)  # type: ignore[misc]
        self.input_gradients = base.input_gradients  # type: ignore[misc]
        for t in transforms:
            if base.name in ("forward", "projforward"):
                pair = f"{base.name}+{t.name}"
                raise E.EngineInputError(INCOMPATIBLE.format(pair=pair, why=t.forward_mode_why))
        # Generators the transforms own, as an attribute: training checkpoints save them.
        self.generators: dict[str, torch.Generator] = {
            t.name: t.generator for t in transforms if getattr(t, "generator", None) is not None
        }
        self._prepared: PreparedCache[tuple[nn.Module, dict[str, Any], Engine]] = (
            PreparedCache()
        )

    @property
    def label(self) -> str:
        return "+".join([self.base.label, *(t.label for t in self.transforms)])

    def supports(self, model: nn.Module) -> str | None:
        reason = self.base.supports(model)
        if reason is None:
            try:
                self.prepare(model)
            except E.LeangradError as err:
                return str(err)
        return reason

    def prepare(self, model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        """The transformed model (cached per model) and what each transform changed."""
        prepared, report, _ = self._prepared.get(model, self._build)
        return prepared, report

    def _build(self, model: nn.Module) -> tuple[nn.Module, dict[str, Any], Engine]:
        """``(prepared model, report, the engine that runs it)``."""
        report: dict[str, Any] = {t.name: {} for t in self.transforms}

        def transform(part: str, module: nn.Module) -> nn.Module:
            for t in self.transforms:
                module, what = t.apply(module)
                report[t.name][part] = what
                if "eager" in what.get("used", "") and "rad" in report:
                    why = EAGER_WITH_RAD.format(part=part, reason=what["why"])
                    raise E.EngineInputError(INCOMPATIBLE.format(pair=self.label, why=why))
            return module

        base = self.base
        if isinstance(base, Checkpoint):  # each block stays one block
            found = find_blocks(model, names=base.block_names)
            if found.sequential:
                mods = [transform(n, found.modules[n]) for n in found.names]
                return nn.Sequential(*mods), report, base
            new = share_copy(model)
            for name in found.names:
                new.set_submodule(name, transform(name, new.get_submodule(name)))
            return new, report, Checkpoint(blocks=list(found.names))
        if base.name in ("moonwalk", "revbackprop", "highway"):
            stem, head = getattr(model, "stem", None), getattr(model, "head", None)
            new = copy.copy(model)  # the same layers and rules; only stem and head change
            new._modules = dict(model._modules)
            for part, module in (("stem", stem), ("head", head)):
                if isinstance(module, nn.Module):
                    setattr(new, part, transform(part, module))
            return new, report, base
        return transform("model", model), report, base

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: dict[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        if (reason := self.base.supports(model)) is not None:
            raise E.EngineInputError(reason)
        # raises when the transforms cannot apply
        prepared, report, runner = self._prepared.get(model, self._build)
        names = {id(p): n for n, p in params.items()}

        def handed(name: str, p: nn.Parameter) -> None:
            assert on_grad is not None
            on_grad(names.get(id(p), name), p)

        res = runner.backward(
            prepared, inputs, loss_fn, on_grad=handed if on_grad is not None else None
        )
        return StepResult(loss=res.loss, engine=self.label, info={**res.info, **report})


def _label(name: str, cls: type, options: dict[str, Any]) -> str:
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    shown = {k: v for k, v in options.items() if k not in params or params[k].default != v}
    if not shown:
        return name
    return f"{name}({','.join(f'{k}={v}' for k, v in shown.items())})"


def kw_options(cls: type) -> list[str]:
    """The keyword-only options of an engine or transform class."""
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    return [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY]


@register("rad")
class Rad(Composed):
    """``backprop`` with randomized AD (:class:`RadTransform`): unbiased gradients that
    keep ``fraction`` of each linear map's input (Oktay et al., ICLR 2021, section 4).

    Trade-off: saved activations of linear maps fall to about ``fraction`` of autograd's
    (ReLU masks to one bit); the gradient is an unbiased estimate whose variance grows
    as ``fraction`` falls; ``fraction=1`` is exact.
    """

    exact = False

    def __init__(
        self, *, fraction: float = 0.1, mode: str = "different", replace: bool = False,
        seed: int | None = None,
    ) -> None:  # fmt: skip
        from ._backprop import Backprop

        t = RadTransform(fraction=fraction, mode=mode, replace=replace, seed=seed)
        super().__init__(Backprop(), [t])
        self.options = dict(t.options)

    @property
    def label(self) -> str:
        return self.transforms[0].label


@register("fad")
class Fad(Composed):
    """``backprop`` with nested forward-mode AD of element-wise chains
    (:class:`FadTransform`; paper: nested forward-AD of activations, sections III–IV).

    Exact. Trade-off: one saved derivative per custom element-wise chain instead of its
    intermediates; PyTorch's fused built-ins (``nn.SiLU``, ``nn.GELU``, ``nn.Mish``) are
    single opaque modules and are left alone. ``StepResult.info["fad"]`` says which pass
    ran (``"fx"`` or the eager fallback, and why) and what was fused.
    """

    exact = True

    def __init__(self, *, mode: str = "auto", min_ops: int = 2) -> None:
        from ._backprop import Backprop

        t = FadTransform(mode=mode, min_ops=min_ops)
        super().__init__(Backprop(), [t])
        self.options = dict(t.options)

    @property
    def label(self) -> str:
        return self.transforms[0].label


def compose(name: str, options: dict[str, Any]) -> Engine:
    """Build the engine for a ``BASE+TRANSFORM[+...]`` name (see the module docstring)."""
    from ._registry import available, engine_class

    parts = name.split("+")
    if parts[0] in TRANSFORMS:
        base_name, tnames = "backprop", parts
    else:
        base_name, tnames = parts[0], parts[1:]
    bases = [n for n in available() if n not in TRANSFORMS]
    for t in tnames:
        if t not in TRANSFORMS:
            if t in bases:
                order = "+".join([t, *(p for p in parts if p != t)])
                raise E.UnknownNameError(BASE_FIRST.format(
                    name=name, suggestion=order, bases=", ".join(bases),
                    transforms=", ".join(TRANSFORMS)))  # fmt: skip
            raise E.UnknownNameError(
                E.UNKNOWN_NAME.format(kind="transform", name=t, known=", ".join(TRANSFORMS))
            )
    if len(set(tnames)) != len(tnames):
        dup = next(t for t in tnames if tnames.count(t) > 1)
        raise E.UnknownNameError(TWICE.format(name=name, transform=dup))
    base_cls = engine_class(base_name)
    owners: list[tuple[str, type]] = [(base_name, base_cls)] + [(t, TRANSFORMS[t]) for t in tnames]
    routed: dict[str, dict[str, Any]] = {part: {} for part, _ in owners}
    for key, value in options.items():
        matches = [part for part, cls in owners if key in kw_options(cls)]
        prefixed = [
            part for part, cls in owners
            if key.startswith(f"{part}_") and key[len(part) + 1:] in kw_options(cls)
        ]  # fmt: skip
        if len(matches) == 1:
            routed[matches[0]][key] = value
        elif len(matches) > 1:
            raise E.UnknownNameError(AMBIGUOUS.format(
                name=name, option=key, owners=" and ".join(matches),
                spelled=", ".join(f"{m}_{key}" for m in matches)))  # fmt: skip
        elif len(prefixed) == 1:
            routed[prefixed[0]][key[len(prefixed[0]) + 1 :]] = value
        else:
            known = sorted({o for _, cls in owners for o in kw_options(cls)})
            raise E.UnknownNameError(
                E.UNKNOWN_OPTION.format(engine=name, option=key, known=", ".join(known))
            )
    base = base_cls(**routed[base_name])
    return Composed(base, [TRANSFORMS[t](**routed[t]) for t in tnames])


@register("bits")
class Bits(Composed):
    """``backprop`` with exact savings (:class:`BitsTransform`, :mod:`leangrad.bits`):
    1-bit masks for ReLU, LeakyReLU and dropout, average pooling that keeps nothing.

    Exact. Trade-off: pays where no other layer keeps the full tensor (dropout masks; a
    ReLU read only by dropout or a residual add); next to a ``Linear`` or BatchNorm that
    keeps its input anyway it adds 1/32. Packing costs a little time.
    """

    exact = True

    def __init__(self) -> None:
        from ._backprop import Backprop

        super().__init__(Backprop(), [BitsTransform()])

    @property
    def label(self) -> str:
        return "bits"


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What an engine does to a model, printable: the blocks it checkpoints, and for each
    transform and part what it changed and what it left alone, and why."""

    engine: str
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join([f"engine {self.engine}", *self.lines])


def explain(eng: Engine | str, model: nn.Module) -> Explanation:
    """Say what ``eng`` (an engine or a name) does to ``model``, in one place."""
    from ._registry import engine as make

    eng = make(eng) if isinstance(eng, str) else eng
    lines: list[str] = []
    if (why := eng.supports(model)) is not None:
        return Explanation(eng.label, (f"cannot run this model: {why}",))
    base = eng.base if isinstance(eng, Composed) else eng
    if isinstance(base, Checkpoint):
        lines += str(base.blocks(model)).splitlines()
    if isinstance(eng, Composed):
        _, report = eng.prepare(model)
        for t in eng.transforms:
            for part, what in report[t.name].items():
                lines += _explain_part(t.name, part, what)
    return Explanation(eng.label, tuple(lines))


def _explain_part(name: str, part: str, what: dict[str, Any]) -> list[str]:
    if name == "fad":
        if what.get("used") == "eager":
            return [f"fad on {part} (eager fallback): {what['why']}"]
        how = "fx pass" if what["used"] == "fx" else "fx pass per block, eager where it fails"
        out = [f"fad on {part} ({how}): {len(what['fused'])} chain(s) fused"]
        out += [f"  fused: {f}" for f in what["fused"]]
        out += [f"  left: {f}" for f in what["left"]]
        return out
    swapped = what.get("swapped", {})
    if not swapped:
        return [f"{name} on {part}: nothing to swap"]
    out = [f"{name} on {part}: swapped {len(swapped)}"]
    out += [f"  {k}: {v}" for k, v in swapped.items()]
    out += [f"  left exact: {k} (no randomized version)" for k in what.get("left_exact", [])]
    return out
