"""Transforms: what autograd keeps inside the parts of a model a base engine leaves to
autograd (see :mod:`leangrad.engines._compose` for how they combine with engines).

- ``rad``: randomized AD (Oktay et al., ICLR 2021): linear maps keep a random
  ``fraction`` of their input for the weight gradient (unbiased), ReLUs one bit;
- ``fad``: nested forward-mode AD of element-wise chains (one derivative per chain
  instead of its intermediates; exact), by the ``torch.fx`` pass ``fad.nest`` with the
  eager ``fad.nested()`` mode as the automatic fallback for untraceable modules;
- ``bits``: exact 1-bit masks and pooling that keeps nothing (:mod:`leangrad.bits`);
- ``chunked_ce``: the loss's logits are never computed — the model's final linear layer
  hands ``F.cross_entropy`` its input and weight, and the loss runs in chunks of rows
  (:mod:`leangrad.loss`; exact). It acts on the step, not on modules (``scope = "step"``).

Each ``apply(module)`` returns a transformed module sharing ``module``'s tensors, and a
report of what changed and what was left alone, and why. The transformed module stands
where ``module`` stood, so it takes the same positional and keyword arguments, returns
the same output type (a ``ModelOutput``, a tuple, a dict) and keeps ``module``'s
attributes (a parent's ``forward`` may read them): rad and bits return ``module``'s own
copy with layers swapped inside; fad a :class:`~._prepare.Wrapper` running the eager mode
or the fx pass's code, whose attribute reads reach ``module``.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from .. import _errors as errors
from ._base import Engine, StepResult
from ._batch_draws import BatchDraws
from ._blocks import blocks as find_blocks
from ._coupling import BATCH_COUPLED, RANDOM_LAYER, Watched, batch_coupling, watched_coupling
from ._prepare import Wrapper, share_copy
from ._signature import untraceable_signature
from ._wrapped import gradient_sync

__all__ = [
    "BAD_FAD_MODE",
    "BATCH_COUPLED",
    "RANDOM_LAYER",
    "TRANSFORMS",
    "AccumulateTransform",
    "BitsTransform",
    "ChunkedCETransform",
    "FadTransform",
    "RadTransform",
    "Transform",
    "batch_coupling",
    "kw_options",
    "label",
]

BAD_FAD_MODE = "fad mode must be 'auto', 'fx' or 'eager', got {value!r}"
StepRun = Callable[[tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor], Any], Any]
"""``run(inputs, loss_fn, on_grad) -> StepResult``: one step of the base engine."""


class Transform(abc.ABC):
    """What a transform does to the autograd parts of a model (see module docstring)."""

    name: ClassVar[str]
    exact: ClassVar[bool]
    forward_mode_why: ClassVar[str] = ""
    scope: ClassVar[str] = "module"
    autocast: ClassVar[bool] = False
    """Checked under ``torch.autocast`` (as :attr:`Engine.autocast`)."""
    """``"module"``: :meth:`apply` swaps modules in the parts the base engine leaves to
    autograd; ``"step"``: the transform acts around the whole step (:meth:`during`)."""
    bases: ClassVar[tuple[str, ...] | None] = None
    """The base engines a step transform works under (``None``: every one)."""

    def __init__(self, **options: Any) -> None:
        self.options = options

    @functools.cached_property
    def label(self) -> str:  # options are fixed when made: read the signature once
        return label(self.name, type(self), self.options)

    @abc.abstractmethod
    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        """A transformed module sharing ``module``'s tensors, and a report of what changed."""

    def inspect(self, model: nn.Module, *, blocks: tuple[str, ...]) -> dict[str, Any]:
        """A step transform's report on ``model`` (``blocks``: the names the base engine
        recomputes as a whole); ``"swapped"`` non-empty when it changes something."""
        return {}

    def during(self, model: nn.Module, report: dict[str, Any]) -> Any:
        """A step transform's context around the step (``report``: :meth:`inspect`'s)."""
        return contextlib.nullcontext()

    def wrap(self, run: StepRun, report: dict[str, Any], *, model: nn.Module) -> StepRun:
        """A step transform's way of running the step: ``run(inputs, loss_fn, on_grad)``
        runs it once, as the base engine does (default: as is)."""
        return run

    def explain(self, part: str, what: dict[str, Any]) -> list[str]:
        """What :func:`leangrad.explain` prints of this transform's report ``what`` on
        ``part`` of the model: the modules it swapped and those it left alone (and why)."""
        swapped = what.get("swapped", {})
        if not swapped:
            why = what.get("why")
            return [f"{self.name} on {part}: nothing to swap" + (f" ({why})" if why else "")]
        out = [f"{self.name} on {part}: swapped {len(swapped)}"]
        out += [f"  {k}: {v}" for k, v in swapped.items()]
        out += [f"  left exact: {k} (no randomized version)" for k in what.get("left_exact", [])]
        return out


_RAD_STREAM = 0x5EED_4AD
"""Added to ``torch.initial_seed()`` for ``rad``'s own stream: not the global one's seed."""


class RadTransform(Transform):
    """Randomized AD on every supported layer (``leangrad.rad.randomize``).

    Args:
        fraction: share of each linear map's input kept for its weight gradient, in
            (0, 1]; 1 is exact.
        mode: ``"different"`` (per-example samples), ``"same"`` or ``"project"``.
        replace: sample with replacement (the paper) instead of without.
        seed: seeds the generator the samples are drawn from, one the engine owns, so the
            global RNG streams advance exactly as under autograd (every dropout mask after
            the step is the one ``loss.backward()`` would have seen); ``None`` seeds it from
            ``torch.initial_seed()``, so a run seeded with ``torch.manual_seed`` repeats.
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
        own = (torch.initial_seed() + _RAD_STREAM) % 2**63 if seed is None else seed
        self.generator = torch.Generator().manual_seed(own)
        """One stream for every preparation (a model switched to eval and back is prepared
        again, and must not restart its samples); saved with training checkpoints."""

    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        from .. import rad

        holder = nn.Sequential(share_copy(module))  # randomize swaps children, not the root
        # layers the user randomized are the user's estimators, on the user's streams:
        # they keep their settings and generators (fuzz finding F3)
        before = list(holder.modules())  # held: a replaced module's id must not be reused
        theirs = {id(m) for m in before}
        opts = {**self.options, "seed": None, "keep_randomized": True}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report lists what stayed exact
            report = rad.randomize(holder, **opts)
        out = holder[0]  # the copy itself (or its root's replacement): no wrapper
        for m in out.modules():
            if hasattr(m, "generator") and id(m) not in theirs:
                cast(Any, m).generator = self.generator
        del before
        return out, {
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

    def explain(self, part: str, what: dict[str, Any]) -> list[str]:
        """Which pass ran on ``part`` (the fx pass, or the eager fallback and why) and the
        chains it fused and left."""
        if what.get("used") == "eager":
            return [f"fad on {part} (eager fallback): {what['why']}"]
        how = "fx pass" if what["used"] == "fx" else "fx pass per block, eager where it fails"
        out = [f"fad on {part} ({how}): {len(what['fused'])} chain(s) fused"]
        out += [f"  fused: {f}" for f in what["fused"]]
        out += [f"  left: {f}" for f in what["left"]]
        return out

    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        from .. import fad

        mode, min_ops = self.options["mode"], self.options["min_ops"]
        if mode != "eager" and (why := untraceable_signature(module)) is not None:
            # fx would trace it wrong, not fail: the fx pass is not tried
            if mode == "fx":
                raise fad.FadTraceError(f"fad mode='fx' on {type(module).__name__}: {why}; "
                                        "use mode='auto' (the eager mode there)")  # fmt: skip
            reason = f"{type(module).__name__}: {why}"
            per_block = self._per_block(module)
            return per_block if per_block is not None else (
                _Nested(module), {"used": "eager", "why": reason})  # fmt: skip
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
                # the fx code runs; attribute reads reach the module as written
                return _FxCode(gm, module), _fad_report(gm)
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
    """``out`` with ``fn`` applied to every tensor in it, its containers of the same types:
    a named tuple stays one, a ``dict`` subclass (``transformers``' ``ModelOutput``,
    ``diffusers``' ``BaseOutput``) is copied and its items set, so ``out.logits`` still
    reads what ``out["logits"]`` holds."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(_tree_map(fn, o) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_tree_map(fn, o) for o in out)
    if isinstance(out, dict):
        items = {k: _tree_map(fn, v) for k, v in out.items()}
        if type(out) is dict:
            return items
        new = copy.copy(out)
        for k, v in items.items():
            new[k] = v
        return new
    return out


class _FxCode(Wrapper):
    """fad's fx code standing in for ``module``: attribute reads reach ``module``, and an
    output fx's code returns as a plain ``dict`` (it rebuilds every dict it traced as one)
    is handed back as the type ``module`` returns (a ``ModelOutput``-like dict subclass)."""

    def __init__(self, gm: Any, module: nn.Module) -> None:
        super().__init__(gm, looks_like=module)
        self.__dict__["_out_type"] = _dict_output_type(gm, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        kind = self.__dict__["_out_type"]
        if kind is None or type(out) is not dict:
            return out
        try:
            return kind(**out)
        except TypeError:
            return kind(out)


def _dict_output_type(gm: Any, module: nn.Module) -> type | None:
    """The ``dict`` subclass ``module`` returns where its fx code returns a plain dict
    (found by tracing it once more, recording the output object); ``None`` otherwise."""
    from torch import fx

    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not isinstance(out_node.args[0], dict):
        return None

    class Recorder(fx.Tracer):
        depth = 0
        last: Any = None

        def create_arg(self, a: Any) -> Any:
            if self.depth == 0:
                self.last = a  # the last top-level argument is the output
            self.depth += 1
            try:
                return super().create_arg(a)
            finally:
                self.depth -= 1

    rec = Recorder()
    try:
        rec.trace(module)
    except Exception:  # fad.nest traced it already; should this fail, keep the dict
        return None
    kind = type(rec.last)
    return kind if isinstance(rec.last, dict) and kind is not dict else None


class _Nested(Wrapper):
    """Runs a module under ``fad.nested()`` (the eager mode, for untraceable modules),
    with any positional and keyword arguments, its output of the same type."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from .. import fad

        with fad.nested():
            out = self.inner(*args, **kwargs)
            # A chain value leaving the block would reach the loss after the mode ended
            # (its derivative never attached): pass each output tensor through one
            # non-element-wise op inside the block (a 0-d one, such as a loss the model
            # computes from ``labels=``, as a 1-element row and back; any other keeps its
            # memory format, which later random draws fill in order).
            return _tree_map(_through_cat, out)


def _through_cat(t: Any) -> Any:
    if not t.requires_grad:
        return t
    return torch.cat([t]) if t.dim() else torch.cat([t.reshape(1)]).reshape(())


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

        holder = nn.Sequential(share_copy(module))  # the root may itself be a ReLU
        report = bits.swap(holder)
        # the copy itself (or its root's replacement), not the holder: the module keeps its
        # type, attributes, arguments and output for the code that calls it
        return holder[0], {"swapped": {k.removeprefix("0."): v for k, v in report.swapped.items()}}


class ChunkedCETransform(Transform):
    """Cross-entropy without the logits (:mod:`leangrad.loss`): during the step the model's
    final linear layer (:func:`leangrad.loss.final_linear`, an ``nn.Linear`` with a
    vocabulary-sized output outside the recomputed blocks) returns
    :class:`~leangrad.loss.LazyLogits`, and the loss's ``F.cross_entropy`` on them runs
    in chunks of ``chunk_size`` rows. Exact. A loss that reads the logits otherwise raises
    :class:`~leangrad.loss.LogitsReadError` naming what read them.

    Args:
        chunk_size: rows per chunk (default: about 8 MiB of float32 logits).

    Anchors: Cut Cross-Entropy (Wijmans et al., ICLR 2025); torchtune's chunked loss.
    """

    name = "chunked_ce"
    exact = True
    scope = "step"
    autocast = True
    forward_mode_why = (
        "forward mode differentiates the loss with jvps, and the chunked loss has only a "
        "backward rule"
    )
    bases = ("backprop", "checkpoint")  # they leave the output layer and loss to autograd

    def __init__(self, *, chunk_size: int | None = None) -> None:
        if chunk_size is not None:
            Engine._positive_int("chunk_size", chunk_size)
        super().__init__(chunk_size=chunk_size)

    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        return module, {}  # the step is changed, not the modules

    def inspect(self, model: nn.Module, *, blocks: tuple[str, ...]) -> dict[str, Any]:
        from ..loss import CHUNK_BYTES, CHUNKS, final_linear

        head = final_linear(model, outside=blocks)
        if isinstance(head, str):
            return {"left": [head], "why": head}
        size = self.options["chunk_size"]
        chunks = (f"{size} rows" if size is not None else
                  f"at least {CHUNKS}, of at most {CHUNK_BYTES // 2**20} MiB of logits each")
        return {"swapped": {head.name: f"logits never computed: cross-entropy in chunks "
                                       f"({chunks})"}, "head": head}  # fmt: skip

    def during(self, model: nn.Module, report: dict[str, Any]) -> Any:
        from ..loss import chunked_logits

        head = report.get("head")
        if head is None:
            return contextlib.nullcontext()
        if (why := fsdp_head_why(model, head.name)) is not None:
            raise errors.EngineInputError(why)
        return chunked_logits(head, chunk_size=self.options["chunk_size"])


HEAD_UNIT = (
    "chunked_ce on an FSDP2 model whose output layer {head!r} lies in an FSDP unit of its own "
    "({unit!r}): FSDP2 frees that unit's gathered weight after its forward, before the "
    "chunked loss reads it; shard the output layer with the root (fully_shard(model) last, "
    "no fully_shard on the head or a module holding it), or leave chunked_ce out"
)


def fsdp_head_why(model: nn.Module, head: str) -> str | None:
    """Why the chunked loss cannot read ``head``'s weight on an FSDP2 ``model`` (the head's
    nearest ``fully_shard`` unit is not the root, which alone keeps its parameters gathered
    after its forward), or ``None``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    parts = head.split(".")
    for i in range(len(parts), 0, -1):
        unit = ".".join(parts[:i])
        if isinstance(model.get_submodule(unit), FSDPModule):
            return HEAD_UNIT.format(head=head, unit=unit)
    return None


NEEDS_PER_EXAMPLE = (
    "accumulate splits the batch into micro-batches, and so must split the targets your "
    "loss_fn closes over: declare the loss with leangrad.loss.per_example(fn, *targets) "
    "(fn(out, *targets) a mean or sum over examples), got {type}"
)
MICRO_ROWS = (
    "accumulate: input {index} has {rows} rows along dimension 0 and the loss's targets "
    "{batch}; every input holds one row per example"
)


class AccumulateTransform(Transform):
    """Gradient accumulation: the step runs the batch as ``micro_batches`` micro-batches,
    one after another, each through the base engine, and their gradients add up in
    ``.grad`` — what a practitioner writes by hand first, at about 1/k of the activations.

    Exact where no layer couples the examples (training-mode BatchNorm does: refused) and
    the loss is a mean or sum over examples, declared with
    :func:`leangrad.loss.per_example` (the targets are split with the inputs). Random draws
    (any op PyTorch tags as seeded: ``nn.Dropout``, ``F.dropout`` inside a ``forward``,
    stochastic depth, attention's ``dropout_p``) are found by watching the model's forward
    on two examples once per kind of input, and replayed: the first micro-batch draws what
    the whole batch would have drawn, and each micro-batch gets its rows
    (:mod:`._batch_draws`), so masks, gradients and the RNG streams are autograd's; a draw
    that cannot be replayed so is refused, named, as is a forward that changes a buffer or
    mixes its examples. ``on_grad`` is called once per parameter, after the last
    micro-batch.

    Args:
        micro_batches: how many micro-batches (sizes differ by at most one; a batch with
            fewer examples, e.g. an epoch's last, runs one example per micro-batch).
    """

    name = "accumulate"
    exact = True
    scope = "step"
    autocast = True
    forward_mode_why = (
        "forward mode engines differentiate with jvps and keep nothing between micro-batches "
        "that accumulation would save"
    )
    bases = ("backprop", "checkpoint")

    def __init__(self, *, micro_batches: int = 2) -> None:
        Engine._positive_int("micro_batches", micro_batches)
        super().__init__(micro_batches=micro_batches)
        self._watched: weakref.WeakKeyDictionary[nn.Module, dict[Any, Watched]] = (
            weakref.WeakKeyDictionary())  # fmt: skip
        """Per model and kind of input: why micro-batches are not exact (or ``None``) and the
        random draws they replay."""

    def watched(self, model: nn.Module, xs: tuple[torch.Tensor, ...]) -> Watched:
        """:func:`watched_coupling` of ``model`` on ``xs``, once per kind of input (the
        shapes less the batch, dtypes, devices) and training flags."""
        seen = self._watched.setdefault(model, {})
        key = (tuple((tuple(x.shape[1:]), x.dtype, x.device) for x in xs),
               tuple(m.training for m in model.modules()))  # fmt: skip
        if key not in seen:
            seen[key] = watched_coupling(model, xs)
        return seen[key]

    def apply(self, module: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        return module, {}

    def inspect(self, model: nn.Module, *, blocks: tuple[str, ...]) -> dict[str, Any]:
        if (why := batch_coupling(model, random=False)) is not None:
            raise errors.EngineInputError(why)
        k = self.options["micro_batches"]
        if k == 1:
            return {"left": ["one micro-batch: the step as it is"], "why": "micro_batches=1"}
        return {"swapped": {"batch": f"{k} micro-batches, gradients accumulated in .grad"}}

    def wrap(self, run: StepRun, report: dict[str, Any], *, model: nn.Module) -> StepRun:
        k = self.options["micro_batches"]

        def micro(xs: tuple[torch.Tensor, ...], loss_fn: Any, on_grad: Any) -> Any:
            from ..loss import PerExample

            if not isinstance(loss_fn, PerExample):
                raise errors.EngineInputError(NEEDS_PER_EXAMPLE.format(
                    type=type(loss_fn).__name__))  # fmt: skip
            n = loss_fn.batch
            for i, x in enumerate(xs):
                if x.dim() == 0 or x.shape[0] != n:
                    rows = x.shape[0] if x.dim() else 0
                    raise errors.EngineInputError(MICRO_ROWS.format(index=i, rows=rows, batch=n))
            m = min(k, n)  # a short last batch of an epoch: one example per micro-batch
            seen = self.watched(model, xs) if m > 1 else Watched(None)
            if seen.why is not None:
                raise errors.EngineInputError(seen.why)
            edges = [n * i // m for i in range(m + 1)]
            replay = BatchDraws(seen.draws, edges=edges) if seen.draws else None
            total: torch.Tensor | None = None
            res: Any = None
            for i in range(m):
                a, b = edges[i], edges[i + 1]
                last = i == m - 1
                with (replay.piece(i) if replay is not None else contextlib.nullcontext(),
                      gradient_sync(model, last)):  # fmt: skip
                    res = run(tuple(x[a:b] for x in xs), loss_fn.rows(a, b),
                              on_grad if last else None)  # fmt: skip
                total = res.loss if total is None else total + res.loss
            assert total is not None
            return StepResult(loss=total, engine=res.engine,
                              info={**res.info, "micro_batches": m})  # fmt: skip

        return micro


TRANSFORMS: dict[str, type[Transform]] = {
    "rad": RadTransform,
    "fad": FadTransform,
    "bits": BitsTransform,
    "chunked_ce": ChunkedCETransform,
    "accumulate": AccumulateTransform,
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
