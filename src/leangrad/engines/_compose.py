"""Composition: a base engine plus transforms, one spelling everywhere (DESIGN.md,
"Composition and planning").

A step is a *base engine* — how gradients flow (backprop, checkpoint, moonwalk, …) — plus
*transforms* — what autograd keeps inside the parts the base engine leaves to autograd
(``rad``, ``fad``, ``bits``: :mod:`leangrad.engines._transforms`).

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

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from .. import _errors as errors
from ..loss import Head, PerExample, final_linear
from ._backprop import Backprop
from ._base import (
    Engine,
    LossFn,
    OnGrad,
    PlanOffer,
    PlanOrder,
    StepResult,
    Trainable,
)
from ._blocks import Blocks
from ._catalog import available, engine_class, register
from ._contract import BufferGuard
from ._coupling import batch_coupling
from ._prepare import PreparedCache
from ._transforms import (
    TRANSFORMS,
    AccumulateTransform,
    BitsTransform,
    ChunkedCETransform,
    FadTransform,
    RadTransform,
    StepRun,
    Transform,
    kw_options,
)
from .checkpoint._offers import all_but_last
from .checkpoint._time_chunks import fused_recurrent

__all__ = ["IDLE", "INCOMPATIBLE", "Accumulate", "Bits", "ChunkedCE", "Composed", "Fad",
           "OnBackprop", "Rad", "compose"]  # fmt: skip

INCOMPATIBLE = "engine {pair!r} cannot work: {why}"
RAD_FRACTIONS = (0.5, 0.25, 0.1)
"""The fractions the planner tries for randomized AD (``exact=False`` only)."""
MICRO_BATCHES = (2, 4, 8)
ACCUMULATE_TIME_CHUNKS = (4, 16)
"""Time chunks offered inside micro-batches (``checkpoint+accumulate``): a few and many. On
the zoo's LSTM LM, 16 chunks alone reach 0.14× of backprop's peak, just above ⅛."""
"""Micro-batch counts the planner tries (those up to the batch's examples)."""
IDLE = ("{names} change(s) nothing on this model, so {label} is its base engine again "
        "(leangrad.explain says why)")  # fmt: skip
BASE_FIRST = (
    "{name!r}: write the base engine first and the transforms after it, e.g. "
    "{suggestion!r}; base engines: {bases}; transforms: {transforms}"
)
NOT_IN_TABLE = (
    "{cls}: its transform {name!r} is not the one TRANSFORMS lists under that name (known: "
    "{known}); add the transform to leangrad.engines._transforms.TRANSFORMS first"
)
TWICE = "{name!r} names the transform {transform!r} twice; apply each transform once"
AMBIGUOUS = (
    "engine {name!r}: option {option!r} belongs to {owners}; write it as one of "
    "{spelled} to say which"
)
STEP_BASES = (
    "{name} works under {bases}, which leave the model's output layer and the loss to "
    "plain autograd; {base} runs them itself"
)
EAGER_WITH_RAD = (
    "fad falls back to its eager mode on the {part} ({reason}), and the eager mode cannot "
    "see inside rad's autograd Functions; use one of the two, or make the {part} "
    "traceable by torch.fx"
)


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
        # Transforms of the step alone (chunked_ce, accumulate) leave the modules and the
        # backward to the base engine: a wrapped model runs as the base runs it.
        self.wrapped_models = (base.wrapped_models  # type: ignore[misc]
                               and all(t.scope == "step" for t in transforms))  # fmt: skip
        for t in transforms:
            pair = f"{base.name}+{t.name}"
            if base.forward_mode:
                raise errors.EngineInputError(
                    INCOMPATIBLE.format(pair=pair, why=t.forward_mode_why)
                )
            if t.bases is not None and base.name not in t.bases:
                raise errors.EngineInputError(INCOMPATIBLE.format(pair=pair, why=STEP_BASES.format(
                    name=t.name, bases=" and ".join(t.bases), base=base.name)))
        # Generators the transforms own, as an attribute: training checkpoints save them.
        owned = {t.name: getattr(t, "generator", None) for t in transforms}
        self.generators: dict[str, torch.Generator] = {
            n: g for n, g in owned.items() if g is not None
        }
        self._prepared: PreparedCache[tuple[nn.Module, dict[str, Any], Engine]] = (
            PreparedCache()
        )

    @property
    def label(self) -> str:
        return "+".join([self.base.label, *(t.label for t in self.transforms)])

    def wrapped_why(self, model: nn.Module, wrapper: str) -> str | None:
        """The base engine's reason (the transforms of the step add none)."""
        return self.base.wrapped_why(model, wrapper)

    @property
    def probes(self) -> bool:
        return self.base.probes

    @property
    def costly_estimate(self) -> bool:
        return self.base.costly_estimate

    def autocast_why(self) -> str | None:
        """The base engine's reason, else the first transform not checked under autocast."""
        if (why := self.base.autocast_why()) is not None:
            return why
        for t in self.transforms:
            if not t.autocast:
                return (f"transform {t.name}'s own backward rules are not checked under "
                        "reduced precision")  # fmt: skip
        return None

    def state_dict(self) -> dict[str, Any]:
        """The base engine's state and the states of the transforms' own generators."""
        gens = {n: g.get_state() for n, g in self.generators.items()}
        return {"base": self.base.state_dict(), "generators": gens}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.base.load_state_dict(state.get("base", {}))
        for name, st in state.get("generators", {}).items():
            if name not in self.generators:
                raise errors.EngineInputError(
                    f"{self.label}: the state holds a generator of transform {name!r}, which "
                    "this engine does not seed; make it with the run's options (seed=...)"
                )
            self.generators[name].set_state(st)

    def blocks(self, model: nn.Module) -> Blocks:
        """The base engine's blocks of ``model`` (the user's model: the transforms keep a
        block one block)."""
        return self.base.blocks(model)

    def idle_transforms(self, model: nn.Module) -> list[str]:
        """The transforms that change nothing on ``model``: fad fused no chain (and did not
        fall back to its eager mode), bits or rad swapped no module. Such a composition
        computes what its base engine does; :func:`leangrad.plan` does not offer it."""
        _, report = self.prepare(model)
        idle = []
        for t in self.transforms:
            parts = report[t.name].values()
            if not any(what.get("used") == "eager" or what.get("fused") or what.get("swapped")
                       for what in parts):  # fmt: skip
                idle.append(t.name)
        return idle

    def idle_reason(self, model: nn.Module) -> str | None:
        """Why this composition is its base engine again on ``model`` (some transform changes
        nothing: :meth:`idle_transforms`); ``None`` when every transform does something."""
        idle = self.idle_transforms(model)
        if not idle:
            return None
        return IDLE.format(names=" and ".join(idle), label=self.label)

    def explain_lines(self, model: nn.Module) -> list[str]:
        """The base engine's lines, then what each transform changed on each part."""
        lines = self.base.explain_lines(model)
        _, report = self.prepare(model)
        for t in self.transforms:
            for part, what in report[t.name].items():
                lines += t.explain(part, what)
        return lines

    def supports(self, model: nn.Module) -> str | None:
        reason = self.base.supports(model)
        if reason is None:
            try:
                self.prepare(model)
            except errors.LeangradError as err:
                return str(err)
        return reason

    def prepare(self, model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        """The transformed model (cached per model) and what each transform changed."""
        prepared, report, _ = self._prepared.get(model, self._build)
        return prepared, report

    def _build(self, model: nn.Module) -> tuple[nn.Module, dict[str, Any], Engine]:
        """``(prepared model, report, the engine that runs it)``; step transforms
        (``scope == "step"``) report on the model as a whole, under the name ``"model"``."""
        prepared, report, runner = self._build_modules(model)
        step = [t for t in self.transforms if t.scope == "step"]
        if step:
            recomputed = self.base.transform_blocks(model)
            for t in step:
                report[t.name]["model"] = t.inspect(model, blocks=recomputed)
        return prepared, report, runner

    def _build_modules(self, model: nn.Module) -> tuple[nn.Module, dict[str, Any], Engine]:
        report: dict[str, Any] = {t.name: {} for t in self.transforms}
        module_transforms = [t for t in self.transforms if t.scope == "module"]

        def transform(part: str, module: nn.Module) -> nn.Module:
            for t in module_transforms:
                module, what = t.apply(module)
                report[t.name][part] = what
                if "eager" in what.get("used", "") and "rad" in report:
                    why = EAGER_WITH_RAD.format(part=part, reason=what["why"])
                    raise errors.EngineInputError(INCOMPATIBLE.format(pair=self.label, why=why))
            return module

        if not module_transforms:  # transforms of the step only: the model as it is
            return model, report, self.base
        prepared, runner = self.base.apply_transforms(model, transform)
        return prepared, report, runner

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        if (reason := self.base.supports(model)) is not None:
            raise errors.EngineInputError(reason)
        # raises when the transforms cannot apply
        prepared, report, runner = self._prepared.get(model, self._build)
        names: dict[int, str] = {}  # the prepared model's parameters by the model's names

        def handed(name: str, p: nn.Parameter) -> None:
            assert on_grad is not None
            if not names:
                names.update({id(q): n for n, q in params.items()})
            on_grad(names.get(id(p), name), p)

        checked: list[Mapping[str, nn.Parameter]] = []

        def once(xs: tuple[torch.Tensor, ...], lf: LossFn, og: OnGrad | None) -> StepResult:
            hand = handed if og is not None else None
            if not checked or hand is not None:
                # the first run (of k micro-batches) validates, as any step; the one that
                # hands gradients over does so through the engine's own announcer (which
                # waits for a wrapper's reduction)
                checked[:] = [Trainable(prepared)]
                return runner.backward(prepared, xs, lf, on_grad=hand)
            # later micro-batches: same model, same kinds of inputs; the per-call checks
            # cost ~10% of a small micro-batch's time (profiled), so only the buffers'
            # guard is kept
            guard = BufferGuard(prepared) if runner.reruns else contextlib.nullcontext()
            with guard:
                return runner._backward(prepared, xs, lf, checked[0], hand)

        run: StepRun = once

        step = [t for t in self.transforms if t.scope == "step"]
        for t in step:  # e.g. accumulate: the step as micro-batches
            run = t.wrap(run, report[t.name]["model"], model=model)
        with contextlib.ExitStack() as around:
            for t in step:  # e.g. chunked_ce: a mode around the whole step
                around.enter_context(t.during(model, report[t.name]["model"]))
            res = run(inputs, loss_fn, on_grad)
        return StepResult(loss=res.loss, engine=self.label, info={**res.info, **report})


class OnBackprop(Composed):
    """``backprop`` with one transform, registered as an engine under the transform's
    name (``"rad"`` is ``backprop+rad``) and labelled as the transform. Subclasses name
    :attr:`transform` and spell its options out as their own keyword-only ``__init__``
    arguments (:func:`leangrad.engine` checks a name's options against that signature).

    The engine's name and ``exact`` are its transform's, read from the transform table
    (:data:`~leangrad.engines._transforms.TRANSFORMS`): a subclass that names its
    :attr:`transform` is registered under that name as it is defined
    (:meth:`__init_subclass__`), so no class spells the name a second time."""

    transform: ClassVar[type[Transform]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "transform" not in vars(cls):  # a subclass of Rad, say: Rad's name stays Rad's
            return
        name = cls.transform.name
        if TRANSFORMS.get(name) is not cls.transform:
            raise ValueError(NOT_IN_TABLE.format(cls=cls.__name__, name=name,
                                                 known=", ".join(TRANSFORMS)))  # fmt: skip
        cls.exact = cls.transform.exact
        register(name)(cls)

    def __init__(self, **options: Any) -> None:
        t = self.transform(**options)
        super().__init__(Backprop(), [t])
        self.options = dict(t.options)

    @property
    def label(self) -> str:
        return self.transforms[0].label


class Rad(OnBackprop):
    """``backprop`` with randomized AD (:class:`RadTransform`): unbiased gradients that
    keep ``fraction`` of each linear map's input (Oktay et al., ICLR 2021, section 4).

    Trade-off: saved activations of linear maps fall to about ``fraction`` of autograd's
    (ReLU masks to one bit); the gradient is an unbiased estimate whose variance grows
    as ``fraction`` falls; ``fraction=1`` is exact.
    """

    transform = RadTransform

    def __init__(
        self, *, fraction: float = 0.1, mode: str = "different", replace: bool = False,
        seed: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(fraction=fraction, mode=mode, replace=replace, seed=seed)

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        """Only where ``exact=False``: keeping half, a quarter and a tenth, each alone and
        under checkpointing where blocks were found."""
        del model, loss_fn
        if exact:
            return []
        out = []
        for f in RAD_FRACTIONS:
            out.append(PlanOffer("rad", {"fraction": f}, PlanOrder.ESTIMATORS))
            if found is not None:
                out.append(PlanOffer("checkpoint+rad", {"fraction": f}, PlanOrder.ESTIMATORS))
        return out


class Fad(OnBackprop):
    """``backprop`` with nested forward-mode AD of element-wise chains
    (:class:`FadTransform`; paper: nested forward-AD of activations, sections III–IV).

    Exact. Trade-off: one saved derivative per custom element-wise chain instead of its
    intermediates; PyTorch's fused built-ins (``nn.SiLU``, ``nn.GELU``, ``nn.Mish``) are
    single opaque modules and are left alone. ``StepResult.info["fad"]`` says which pass
    ran (``"fx"`` or the eager fallback, and why) and what was fused.
    """

    transform = FadTransform
    plan_offers = (PlanOffer("fad", {}, PlanOrder.FAD),)
    """The whole model nested (checkpointing offers ``checkpoint+fad``)."""

    def __init__(self, *, mode: str = "auto", min_ops: int = 2) -> None:
        super().__init__(mode=mode, min_ops=min_ops)


def compose(name: str, options: dict[str, Any]) -> Engine:
    """Build the engine for a ``BASE+TRANSFORM[+...]`` name (see the module docstring)."""
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
                raise errors.UnknownNameError(BASE_FIRST.format(
                    name=name, suggestion=order, bases=", ".join(bases),
                    transforms=", ".join(TRANSFORMS)))  # fmt: skip
            raise errors.UnknownNameError(
                errors.UNKNOWN_NAME.format(kind="transform", name=t, known=", ".join(TRANSFORMS))
            )
    if len(set(tnames)) != len(tnames):
        dup = next(t for t in tnames if tnames.count(t) > 1)
        raise errors.UnknownNameError(TWICE.format(name=name, transform=dup))
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
            raise errors.UnknownNameError(AMBIGUOUS.format(
                name=name, option=key, owners=" and ".join(matches),
                spelled=", ".join(f"{m}_{key}" for m in matches)))  # fmt: skip
        elif len(prefixed) == 1:
            routed[prefixed[0]][key[len(prefixed[0]) + 1 :]] = value
        else:
            known = sorted({o for _, cls in owners for o in kw_options(cls)})
            raise errors.UnknownNameError(
                errors.UNKNOWN_OPTION.format(engine=name, option=key, known=", ".join(known))
            )
    base = base_cls(**routed[base_name])
    return Composed(base, [TRANSFORMS[t](**routed[t]) for t in tnames])


class Bits(OnBackprop):
    """``backprop`` with exact savings (:class:`BitsTransform`, :mod:`leangrad.bits`):
    1-bit masks for ReLU, LeakyReLU and dropout, average pooling that keeps nothing.

    Exact. Trade-off: pays where no other layer keeps the full tensor (dropout masks; a
    ReLU read only by dropout or a residual add); next to a ``Linear`` or BatchNorm that
    keeps its input anyway it adds 1/32. Packing costs a little time.
    """

    transform = BitsTransform
    plan_offers = (PlanOffer("bits", {}, PlanOrder.BITS),)
    """The whole model's masks (checkpointing offers ``checkpoint+bits``)."""

    def __init__(self) -> None:
        super().__init__()


class ChunkedCE(OnBackprop):
    """``backprop`` with a loss that never holds its logits (:class:`ChunkedCETransform`,
    :mod:`leangrad.loss`): the model's final ``nn.Linear`` hands ``F.cross_entropy`` its
    input and weight, and the loss and its gradients are computed in chunks of rows.

    Exact. Trade-off: a language model's ``(N, T, V)`` logits, their log-softmax and their
    gradient (most of the step's peak at a real vocabulary) shrink to one chunk; the loss's
    matmuls are autograd's count (mean or sum reduction). Spelled ``checkpoint+chunked_ce``
    under checkpointing. The loss must hand the logits straight to ``F.cross_entropy``
    (views of their leading dimensions allowed), else :class:`leangrad.loss.LogitsReadError`
    names what read them.
    """

    transform = ChunkedCETransform

    def __init__(self, *, chunk_size: int | None = None) -> None:
        super().__init__(chunk_size=chunk_size)

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        """Where the model ends in a vocabulary-sized ``nn.Linear`` (logits worth never
        computing): alone, and under checkpointing where blocks were found."""
        del loss_fn, exact
        if not isinstance(final_linear(model), Head):
            return []
        out = [PlanOffer("chunked_ce", {}, PlanOrder.LOGITS)]
        if found is not None:  # beaten by chunked_ce alone: it only adds recomputation
            opts: dict[str, Any] = {"segments": "auto"} if found.sequential else {}
            out.append(PlanOffer("checkpoint+chunked_ce", opts, PlanOrder.LOGITS,
                                 (("chunked_ce", {}),)))  # fmt: skip
        return out


class Accumulate(OnBackprop):
    """``backprop`` over micro-batches, their gradients added in ``.grad`` — gradient
    accumulation (:class:`AccumulateTransform`). Spelled ``checkpoint+accumulate`` with
    per-block checkpointing inside each micro-batch.

    Exact where no layer couples the examples and the loss is declared a mean or sum over
    them (:func:`leangrad.loss.per_example`). Trade-off: about 1/k of the activations for k
    forward and backward passes of smaller batches (little extra time where each
    micro-batch still fills the machine).
    """

    transform = AccumulateTransform

    def __init__(self, *, micro_batches: int = 2) -> None:
        super().__init__(micro_batches=micro_batches)

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        """Where they are exact — a loss declared per example, no layer coupling the
        examples or drawing masks — 2, 4 and 8 micro-batches (those up to the batch's
        examples), alone and under checkpointing where blocks were found; in a model run
        as written also with every block but the last checkpointed, PyTorch's per-block
        loop inside each micro-batch (:func:`all_but_last`: first, for it beats every
        block checkpointed with as many micro-batches; each checkpointed one is beaten by
        as many micro-batches alone); where the model has fused
        recurrent modules (``nn.LSTM``, ``nn.GRU``), with them checkpointed in
        :data:`ACCUMULATE_TIME_CHUNKS` time chunks inside each micro-batch (each beaten by
        as many micro-batches alone: the same step plus the recomputation of each chunk)."""
        del exact
        if not isinstance(loss_fn, PerExample) or batch_coupling(model, random=False) is not None:
            return []
        ks = [k for k in MICRO_BATCHES if k <= loss_fn.batch]
        out = [PlanOffer("accumulate", {"micro_batches": k}, PlanOrder.MICRO_BATCHES)
               for k in ks]  # fmt: skip
        if fused_recurrent(model):  # each beaten by as many micro-batches alone
            out += [PlanOffer("checkpoint+accumulate", {"time_chunks": c, "micro_batches": k},
                              PlanOrder.MICRO_BATCHES, (("accumulate", {"micro_batches": k}),))
                    for c in ACCUMULATE_TIME_CHUNKS for k in ks]  # fmt: skip
        if found is None:
            return out
        name = "checkpoint+accumulate"
        but_last = all_but_last(found)
        # each beaten by the same micro-batches without checkpointing, or with fewer blocks
        alone: dict[int, tuple[str, dict[str, Any]]] = {
            k: ("accumulate", {"micro_batches": k}) for k in ks}  # fmt: skip
        if but_last is not None:  # first: it beats every block checkpointed (more work)
            out += [PlanOffer(name, {"blocks": but_last, "micro_batches": k},
                              PlanOrder.MICRO_BATCHES, (alone[k],)) for k in ks]  # fmt: skip
        out += [PlanOffer(name, {"micro_batches": k}, PlanOrder.MICRO_BATCHES,
                          (alone[k],) if but_last is None else
                          (alone[k], (name, {"blocks": but_last, "micro_batches": k})))
                for k in ks]  # fmt: skip
        return out
