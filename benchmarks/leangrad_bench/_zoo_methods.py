"""The ways the ``zoo`` suite computes one step's gradients, rebuildable by name in a fresh
process: leangrad engines and compositions, and what a PyTorch user writes by hand.

A :class:`Method` is a label, a side and a JSON spec; :meth:`Method.make` gives an
engine-like object (``backward(model, inputs, loss_fn)``) that finds what it needs on the
model it is given, so the same method runs on a real model, on a fake-tensor copy
(:func:`leangrad.measure.estimate_memory`) and in the suite's worker process.

PyTorch's side (each marks the end of its forward phase, so its kept bytes are measured):

- ``torch per-block``, ``torch selective``, ``checkpoint_sequential(s)``: the ``plan``
  suite's peers (:func:`leangrad_bench._plan_peers.peers`) over the model's stem, blocks
  and head, written out per zoo class; the U-Net (skip connections: not a sequence of
  blocks) has ``torch per-block`` only, through its own ``checkpointing`` flag (every
  ``ResBlock`` and ``AttnBlock`` under ``torch.utils.checkpoint``, as diffusers'
  ``enable_gradient_checkpointing()`` does), switched on for the step;
- ``torch bf16 autocast``: forward and loss under ``torch.autocast(<the input's device
  type>, bfloat16)``;
- recurrent LMs (one fused ``nn.LSTM``/``nn.GRU``, no blocks to wrap):
  ``torch checkpoint(rnn)`` around the whole recurrent module, and ``torch time
  chunks(k)``: the sequence cut into ``k`` chunks run one after another with the state
  carried, each but the last under ``torch.utils.checkpoint``;
- Hugging Face models (:data:`leangrad_bench._models.HF_MODELS`, opt-in, from :mod:`leangrad.hf`):
  ``hf_checkpointing``, the library's own one-liner (transformers'
  ``model.gradient_checkpointing_enable()``, diffusers' ``enable_gradient_checkpointing()``)
  then plain backprop; per-block and selective checkpointing are not written out for
  them (their stems and heads are the libraries' own code);
- gradient accumulation, what a practitioner writes first (``micro_batches`` in the suite
  file, each k up to the batch): ``torch accumulate(k)``, the loop ``for`` each of k
  micro-batches (rows ``n*i//k`` to ``n*(i+1)//k``, sizes differing by at most one, as in
  leangrad's ``accumulate`` engine) ``loss_fn.rows(a, b)(model(x[a:b])).backward()``, the
  gradients adding up in ``.grad``; ``torch accumulate(k) + per-block``, the same with
  ``torch per-block`` inside each micro-batch (Hugging Face models: ``hf_checkpointing +
  accumulate(k)``, the library's own checkpointing on for all k; the recurrent LMs:
  ``torch accumulate(k) + time chunks(c)``, the fused module in the suite's most time
  chunks inside each micro-batch). Offered only where it
  is exact: the loss is declared a mean over examples (:func:`leangrad.loss.per_example`)
  and no layer couples the examples or draws random masks
  (:func:`leangrad.engines._transforms.batch_coupling`: training-mode BatchNorm, dropout);
  elsewhere skipped with the reason. A row's time is that of the whole batch's step (all
  k micro-batches), like every other row's. Its kept bytes are those live when the
  *first* micro-batch's loss is computed (the first mark wins, as for leangrad's
  ``accumulate`` engine): each later micro-batch keeps about as much, its predecessor's
  activations freed by its own backward (only ``.grad``, allocated by the first backward,
  stays beside them, and the peak counts it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from leangrad import _errors as errors
from leangrad import zoo
from leangrad.engines import available, engine, engine_class
from leangrad.engines._coupling import watched_coupling
from leangrad.engines._transforms import TRANSFORMS, AccumulateTransform, batch_coupling
from leangrad.loss import PerExample
from leangrad.measure import FORWARD_END, mark

from ._models import Inputs, LossFn, gpt_parts, resnet_parts
from ._plan_peers import peers

__all__ = [
    "ACCUMULATE_ENGINES",
    "HF_CHECKPOINTING",
    "NOT_PER_EXAMPLE",
    "TIMM_CHECKPOINTING",
    "TOO_FEW_EXAMPLES",
    "Method",
    "Skipped",
    "call",
    "leangrad_methods",
    "library_checkpointing",
    "pytorch_methods",
]

HAND_DRAWS = (
    "the model draws random numbers in its forward ({op}, found by watching it): a "
    "hand-written loop's micro-batches draw other masks than one forward of the whole "
    "batch (leangrad's accumulate hands them the whole batch's)"
)
HF_CHECKPOINTING = "hf_checkpointing"
TIMM_CHECKPOINTING = "timm set_grad_checkpointing"
"""The label of the libraries' own gradient checkpointing row."""
ACCUMULATE_ENGINES = ("accumulate", "checkpoint+accumulate")
"""leangrad's gradient accumulation rows, one per micro-batch count of the suite file."""
NOT_PER_EXAMPLE = (
    "the loss is not declared a mean over examples (leangrad.loss.per_example; e.g. a "
    "masked LM's mean over its masked positions, which differ per row), so micro-batches "
    "cannot be weighted to add up to the whole batch's gradient"
)
TOO_FEW_EXAMPLES = "{k} micro-batches but the batch has {batch} examples"
NOT_A_SEQUENCE = (
    "{model} is not a stem, a sequence of blocks and a head (skip connections join its down "
    "and up paths), so the recipes written over that sequence (checkpoint_sequential, "
    "selective checkpointing) are not written out for it; its torch per-block row "
    "checkpoints every block through the model's own checkpointing flag"
)
NO_BLOCKS_TO_WRAP = (
    "no per-block torch.utils.checkpoint written out for {model}; torch accumulate({k}) "
    "is its accumulation row"
)
_TRANSFORM_ORDER = ("fad", "bits", "rad")


def call(model: Callable[..., Any], inputs: Inputs) -> Any:
    """``model(inputs)`` for one tensor, ``model(*inputs)`` for a tuple."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to compute a step's gradients.

    Attributes:
        label: the row's name (``leangrad.engine`` spelling, or the PyTorch recipe).
        side: ``"reference"`` (backprop), ``"leangrad"``, ``"plan"`` or ``"pytorch"``.
        exact: the gradient equals autograd's (up to float rounding).
        spec: ``{"engine": name, "options": {...}}`` or ``{"torch": kind, "arg": n}``.
    """

    label: str
    side: str
    exact: bool
    spec: dict[str, Any]

    def make(self) -> Any:
        """A fresh engine-like object: ``.backward(model, inputs, loss_fn)``."""
        if "engine" in self.spec:
            return engine(self.spec["engine"], **self.spec.get("options", {}))
        return TorchStep(self.label, self.spec["torch"], self.spec.get("arg"),
                         chunks=self.spec.get("chunks"))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A method that was not run on a model, and why."""

    label: str
    side: str
    reason: str


def engine_names(*, max_transforms: int = len(_TRANSFORM_ORDER)) -> list[str]:
    """Every registered engine and every base + transforms composition with at most
    ``max_transforms`` transforms (forward-mode bases take none: they keep nothing for a
    backward pass, so compose refuses them), and ``chunked_ce`` alone and under
    ``checkpoint`` (idle, so skipped, where the model has no vocabulary-sized output), and
    gradient accumulation (:data:`ACCUMULATE_ENGINES`) alone and under ``checkpoint``."""
    bases = [n for n in available() if n not in TRANSFORMS]
    out = list(bases)
    for base in (b for b in bases if not engine_class(b).forward_mode):
        for k in range(1, min(max_transforms, len(_TRANSFORM_ORDER)) + 1):
            for combo in itertools.combinations(_TRANSFORM_ORDER, k):
                out.append("+".join(combo if base == "backprop" else (base, *combo)))
    # the loss without its logits, under the bases that leave the loss to autograd
    out += ["chunked_ce", "checkpoint+chunked_ce"]
    out += list(ACCUMULATE_ENGINES)
    return out


def leangrad_methods(
    model: nn.Module,
    *,
    options: dict[str, dict[str, Any]],
    skip: dict[str, str],
    forward_max_params: int,
    max_transforms: int = len(_TRANSFORM_ORDER),
    micro_batches: list[int] | None = None,
    loss_fn: LossFn | None = None,
) -> tuple[list[Method], list[Skipped]]:
    """The leangrad rows for ``model``: every name of :func:`engine_names` whose engine
    ``supports`` it, with ``options[name]`` (or, for a composition, the options of its
    parts); the others as :class:`Skipped` with the reason.

    :data:`ACCUMULATE_ENGINES` give one row per count in ``micro_batches`` (labelled
    ``accumulate(micro_batches=k)``; ``None`` or empty: one row with their options), each
    skipped where not exact: the engine refuses the model (a layer couples the examples),
    or ``loss_fn`` (when given) is not a :class:`leangrad.loss.PerExample` or has fewer
    examples than ``k``."""
    methods: list[Method] = []
    skipped: list[Skipped] = []
    n_params = sum(p.numel() for p in model.parameters())
    for name in engine_names(max_transforms=max_transforms):
        opts: dict[str, Any] = {}
        for part in name.split("+"):
            opts.update(options.get(part, {}))
        opts.update(options.get(name, {}))
        why = skip.get(name)
        if name == "forward" and n_params > forward_max_params:
            why = (
                f"one jvp per parameter: {n_params:,} parameters, above the suite's "
                f"forward_max_params={forward_max_params:,}"
            )
        variants: list[tuple[str | None, dict[str, Any]]] = [(None, opts)]
        if name in ACCUMULATE_ENGINES and micro_batches:
            variants = [(f"{name}(micro_batches={k})", {**opts, "micro_batches": k})
                        for k in micro_batches]  # fmt: skip
        for label, o in variants:
            row = _leangrad_row(model, name, o, why=why, label=label, loss_fn=loss_fn)
            if isinstance(row, Method):
                methods.append(row)
            else:
                skipped.append(row)
    return methods, skipped


def _leangrad_row(
    model: nn.Module,
    name: str,
    opts: dict[str, Any],
    *,
    why: str | None,
    label: str | None,
    loss_fn: LossFn | None,
) -> Method | Skipped:
    """One leangrad row of :func:`leangrad_methods` (``why``: a reason found already;
    ``label``: the row's, else the engine's)."""
    eng = None
    if why is None:
        try:
            eng = engine(name, **opts)
            why = eng.supports(model)
            if why is None:  # a composition that changes nothing: not offered under its name
                why = eng.idle_reason(model)
        except Exception as err:  # a bug in supports() is a finding, not a crash
            why = f"supports() raised {type(err).__name__}: {err}"
    if why is None and name in ACCUMULATE_ENGINES and loss_fn is not None:
        k = opts.get("micro_batches", AccumulateTransform().options["micro_batches"])
        why = _accumulate_loss_why(loss_fn, int(k))
    label = label or (eng.label if eng is not None else name)
    if why is not None:
        return Skipped(label, "leangrad", why)
    assert eng is not None
    side = "reference" if name == "backprop" else "leangrad"
    return Method(label, side, bool(eng.exact), {"engine": name, "options": opts})


def _accumulate_loss_why(loss_fn: LossFn | None, k: int) -> str | None:
    """Why ``k`` micro-batches of ``loss_fn``'s batch would not be exact, or ``None``."""
    if not isinstance(loss_fn, PerExample):
        return NOT_PER_EXAMPLE
    if k > loss_fn.batch:
        return TOO_FEW_EXAMPLES.format(k=k, batch=loss_fn.batch)
    return None


def pytorch_methods(
    model: nn.Module,
    *,
    segments: list[int],
    chunks: list[int],
    micro_batches: list[int] | None = None,
    loss_fn: LossFn | None = None,
    inputs: Inputs | None = None,
) -> tuple[list[Method], list[Skipped]]:
    """The PyTorch-only rows for ``model`` (module docstring): checkpointing and autocast,
    then gradient accumulation over each of ``micro_batches`` (none: no such rows), exact
    only for a ``loss_fn`` declared per example on a model whose layers do not couple the
    examples nor draw random numbers, watched on ``inputs`` where given (else skipped, with
    the reason: a hand-written loop's micro-batches draw other masks than one forward)."""
    methods, skipped = _checkpoint_methods(model, segments=segments, chunks=chunks)
    acc, acc_skipped = _accumulate_methods(model, list(micro_batches or []), loss_fn,
                                           chunks=max(chunks, default=None),
                                           inputs=inputs)  # fmt: skip
    return methods + acc, skipped + acc_skipped


def _checkpoint_methods(
    model: nn.Module, *, segments: list[int], chunks: list[int]
) -> tuple[list[Method], list[Skipped]]:
    """bf16 autocast and PyTorch's checkpointing recipes for ``model``."""
    methods = [Method("torch bf16 autocast", "pytorch", False, {"torch": "bf16"})]
    skipped: list[Skipped] = []
    if (own := library_checkpointing(model)) is not None:
        why = (
            f"{type(model).__name__} is a library's model: its stem and head are the "
            "library's code, not written out per block here; its own gradient "
            f"checkpointing ({own}) is the PyTorch-side row"
        )
        methods.append(Method(own, "pytorch", True, {"torch": "library_checkpointing"}))
        skipped += [Skipped(lb, "pytorch", why) for lb in ("torch per-block", "torch selective")]
        return methods, skipped
    if isinstance(model, zoo.RNNLM):
        methods.append(Method("torch checkpoint(rnn)", "pytorch", True, {"torch": "rnn"}))
        methods += [
            Method(f"torch time chunks({k})", "pytorch", True, {"torch": "chunks", "arg": k})
            for k in chunks
        ]
        why = (
            "one fused nn.LSTM/nn.GRU: no blocks to wrap (selective checkpointing would "
            "save the fused op whole)"
        )
        skipped += [Skipped(lb, "pytorch", why) for lb in ("torch per-block", "torch selective")]
        return methods, skipped
    if isinstance(model, zoo.UNet):  # its own flag checkpoints every block
        methods.append(Method("torch per-block", "pytorch", True, {"torch": "per-block"}))
        why = NOT_A_SEQUENCE.format(model=type(model).__name__)
        labels = ["torch selective", *(f"checkpoint_sequential({s})" for s in segments)]
        return methods, [*skipped, *(Skipped(lb, "pytorch", why) for lb in labels)]
    if type(model) not in _PARTS:
        why = f"{type(model).__name__} is not a zoo model with stem, blocks and head written out"
        return [], [Skipped("torch per-block", "pytorch", why)]
    methods += [
        Method("torch per-block", "pytorch", True, {"torch": "per-block"}),
        Method("torch selective", "pytorch", True, {"torch": "selective"}),
    ]
    n_blocks = len(_PARTS[type(model)](model, torch.zeros(1, 1))[1])
    for s in segments:
        label = f"checkpoint_sequential({s})"
        if s < n_blocks:
            methods.append(Method(label, "pytorch", True, {"torch": "sequential", "arg": s}))
        else:
            skipped.append(Skipped(label, "pytorch", f"{s} segments >= {n_blocks} blocks"))
    return methods, skipped


def _accumulate_methods(
    model: nn.Module, micro_batches: list[int], loss_fn: LossFn | None, *,
    chunks: int | None = None, inputs: Inputs | None = None,
) -> tuple[list[Method], list[Skipped]]:  # fmt: skip
    """``torch accumulate(k)`` and, with checkpointing inside each micro-batch, ``torch
    accumulate(k) + per-block`` (Hugging Face models: ``hf_checkpointing +
    accumulate(k)``; the recurrent LMs: ``torch accumulate(k) + time chunks(c)``, the
    fused module in the most time ``chunks``) for each ``k``, or why not."""
    methods: list[Method] = []
    skipped: list[Skipped] = []
    own = library_checkpointing(model)
    coupled = batch_coupling(model)
    if coupled is None and micro_batches and inputs is not None:
        xs = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
        seen = watched_coupling(model, xs)
        coupled = seen.why or (HAND_DRAWS.format(op=seen.draws[0].op) if seen.draws else None)
    for k in micro_batches:
        plain = (f"torch accumulate({k})", "accumulate")
        ck = ((f"{own} + accumulate({k})", "library_checkpointing+accumulate") if own
              else (f"torch accumulate({k}) + per-block", "accumulate+per-block"))  # fmt: skip
        if isinstance(model, zoo.RNNLM) and chunks is not None:
            ck = (f"torch accumulate({k}) + time chunks({chunks})", "accumulate+chunks")
        why = coupled or _accumulate_loss_why(loss_fn, k)
        for label, kind in (plain, ck):
            if why is not None:
                skipped.append(Skipped(label, "pytorch", why))
            elif kind == "accumulate+per-block" and not _per_block(model):
                name = type(model).__name__
                skipped.append(Skipped(label, "pytorch", NO_BLOCKS_TO_WRAP.format(model=name, k=k)))
            else:
                extra = {"chunks": chunks} if kind == "accumulate+chunks" else {}
                methods.append(Method(label, "pytorch", True, {"torch": kind, "arg": k, **extra}))
    return methods, skipped


def _bert_parts(model: zoo.BERT, idx: torch.Tensor) -> tuple[Any, list[nn.Module], Any]:
    t = idx.shape[-1]
    return (
        lambda: model.ln_emb(model.tok(idx) + model.pos[:t]),
        list(model.blocks),
        lambda h: model.head(h[:, 0]),
    )


def _llama_parts(model: zoo.Llama, idx: torch.Tensor) -> tuple[Any, list[nn.Module], Any]:
    return (lambda: model.embed(idx), list(model.blocks),
            lambda h: model.lm_head(model.norm(h)))  # fmt: skip


def _vit_parts(model: zoo.ViT, x: torch.Tensor) -> tuple[Any, list[nn.Module], Any]:
    def stem() -> torch.Tensor:
        h = model.patch(x).flatten(2).transpose(1, 2)
        return torch.cat([model.cls.expand(h.shape[0], -1, -1), h], 1) + model.pos

    return stem, list(model.blocks), lambda h: model.head(model.ln(h[:, 0]))


_PARTS: dict[type, Callable[[Any, torch.Tensor], Any]] = {
    zoo.GPT: gpt_parts,
    zoo.ResNet: resnet_parts,
    zoo.BERT: _bert_parts,
    zoo.ViT: _vit_parts,
    zoo.Llama: _llama_parts,
}


def _per_block(model: nn.Module) -> bool:
    """Whether ``torch per-block`` is written out for ``model``: by its parts
    (:data:`_PARTS`) or, for the U-Net, its own checkpointing flag."""
    return type(model) in _PARTS or isinstance(model, zoo.UNet)


@contextlib.contextmanager
def _unet_checkpointing(model: zoo.UNet) -> Iterator[None]:
    """The U-Net's own per-block checkpointing, on inside the ``with`` only. Every block is
    checkpointed, the last one too (``torch per-block`` over a sequence leaves the last
    block plain: its recomputation would follow at once)."""
    before = model.checkpointing
    model.checkpointing = True
    try:
        yield
    finally:
        model.checkpointing = before


def library_checkpointing(model: nn.Module) -> str | None:
    """The row label of a library model's own gradient checkpointing — Hugging Face's
    (:func:`hf_checkpointing`), or timm's ``set_grad_checkpointing()`` (a model from
    ``timm.models``) — or ``None``."""
    if hf_checkpointing(model) is not None:
        return HF_CHECKPOINTING
    if (type(model).__module__.startswith("timm.")
            and callable(getattr(model, "set_grad_checkpointing", None))):  # fmt: skip
        return TIMM_CHECKPOINTING
    return None


def hf_checkpointing(model: nn.Module) -> tuple[str, str] | None:
    """``(enable, disable)`` method names of a Hugging Face model's own gradient
    checkpointing (transformers' ``gradient_checkpointing_enable``, spelled
    ``activation_checkpointing_enable`` from transformers 5.x on, which deprecates the old
    name; diffusers' ``enable_gradient_checkpointing``), or ``None`` when ``model`` has none
    or does not support it."""
    for on, off, flag in (
        ("activation_checkpointing_enable", "activation_checkpointing_disable",
         "supports_gradient_checkpointing"),
        ("gradient_checkpointing_enable", "gradient_checkpointing_disable",
         "supports_gradient_checkpointing"),
        ("enable_gradient_checkpointing", "disable_gradient_checkpointing",
         "_supports_gradient_checkpointing"),
    ):  # fmt: skip
        if callable(getattr(model, on, None)) and getattr(model, flag, False):
            return on, off
    return None


class TorchStep:
    """A PyTorch recipe as an engine-like object; it finds its parts on the model given."""

    exact = True

    def __init__(self, label: str, kind: str, arg: int | None = None, *,
                 chunks: int | None = None) -> None:  # fmt: skip
        self.label, self.kind, self.arg, self.chunks = label, kind, arg, chunks
        self.exact = kind != "bf16"

    def backward(self, model: nn.Module, inputs: Any, loss_fn: LossFn) -> None:
        xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        x = xs[0]

        marked = _marked(loss_fn)
        if self.kind in _ACCUMULATE_KINDS:
            self._accumulate(model, xs, loss_fn)
        elif self.kind == "bf16":
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                loss = marked(model(*xs))
            loss.backward()
        elif self.kind == "library_checkpointing":  # switched on for this step only
            with _library_checkpointing(model):
                marked(model(*xs)).backward()
        elif self.kind in ("rnn", "chunks"):
            assert isinstance(model, zoo.RNNLM)
            marked(model.head(_rnn_forward(model, x, self.arg))).backward()
        elif isinstance(model, zoo.UNet):
            assert self.kind == "per-block", f"{self.kind} is not written out for the U-Net"
            with _unet_checkpointing(model):
                marked(model(x)).backward()
        else:
            segs = [int(self.arg)] if self.kind == "sequential" and self.arg else []
            steps = peers(_PARTS[type(model)](model, x), marked, segs, optimizer=None)
            steps[self.label]()

    def _accumulate(self, model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: Any) -> None:
        """The practitioner's loop: each micro-batch's weighted loss, backward, gradients
        adding up in ``.grad`` (``torch per-block`` or the library's own checkpointing
        inside each micro-batch, by ``kind``)."""
        if not isinstance(loss_fn, PerExample):
            raise errors.EngineInputError(NOT_PER_EXAMPLE)
        n, k = loss_fn.batch, int(self.arg or 1)
        if k > n:
            raise errors.EngineInputError(TOO_FEW_EXAMPLES.format(k=k, batch=n))
        edges = [n * i // k for i in range(k + 1)]
        unet = isinstance(model, zoo.UNet) and self.kind == "accumulate+per-block"
        around: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.kind == "library_checkpointing+accumulate":
            around = _library_checkpointing(model)
        elif unet:  # the U-Net's own flag: every block checkpointed in each micro-batch
            assert isinstance(model, zoo.UNet)
            around = _unet_checkpointing(model)
        with around:
            for a, b in itertools.pairwise(edges):
                part = _marked(loss_fn.rows(a, b))  # the first micro-batch's mark wins
                if self.kind == "accumulate+per-block" and not unet:
                    steps = peers(_PARTS[type(model)](model, xs[0][a:b]), part, [],
                                  optimizer=None)  # fmt: skip
                    steps["torch per-block"]()
                elif self.kind == "accumulate+chunks":
                    assert isinstance(model, zoo.RNNLM)
                    part(model.head(_rnn_forward(model, xs[0][a:b], self.chunks))).backward()
                else:
                    part(call(model, tuple(x[a:b] for x in xs))).backward()


_ACCUMULATE_KINDS = ("accumulate", "accumulate+per-block", "library_checkpointing+accumulate",
                     "accumulate+chunks")  # fmt: skip


def _marked(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` that marks the end of the forward phase once it has the loss (a
    tracker keeps the first mark: what is live then is kept for the backward pass)."""

    def marked(out: Any) -> torch.Tensor:
        loss = loss_fn(out)
        mark(FORWARD_END)  # the forward phase ends here: what is live is kept
        return loss

    return marked


@contextlib.contextmanager
def _library_checkpointing(model: nn.Module) -> Iterator[None]:
    """A library model's own gradient checkpointing (Hugging Face's, timm's), on for the
    block only (the hooks an enable leaves behind removed: :func:`_drop_new_hooks`)."""
    names = hf_checkpointing(model)
    hooks = _hooks(model)
    if names is None:
        assert library_checkpointing(model) == TIMM_CHECKPOINTING, type(model).__name__
        switch: Callable[[bool], Any] = getattr(model, "set_grad_checkpointing")  # noqa: B009
        on: Callable[[], Any] = lambda: switch(True)  # noqa: E731
        off: Callable[[], Any] = lambda: switch(False)  # noqa: E731
    else:
        on, off = getattr(model, names[0]), getattr(model, names[1])
    on()
    try:
        yield
    finally:
        off()
        _drop_new_hooks(model, hooks)


def _hooks(model: nn.Module) -> dict[int, tuple[set[int], set[int]]]:
    return {id(m): (set(m._forward_hooks), set(m._forward_pre_hooks)) for m in model.modules()}


def _drop_new_hooks(model: nn.Module, before: dict[int, tuple[set[int], set[int]]]) -> None:
    """Remove the forward hooks a step added: transformers' ``gradient_checkpointing_enable``
    registers one on the input embedding (``enable_input_require_grads``, for reentrant
    checkpointing) that its ``disable`` leaves behind, and the hook would follow every
    other method of the run (engines that run a module more than once refuse it)."""
    for m in model.modules():
        fwd, pre = before.get(id(m), (set(), set()))
        for key in [k for k in m._forward_hooks if k not in fwd]:
            del m._forward_hooks[key]
        for key in [k for k in m._forward_pre_hooks if k not in pre]:
            del m._forward_pre_hooks[key]


def _rnn_forward(model: zoo.RNNLM, idx: torch.Tensor, chunks: int | None) -> torch.Tensor:
    """The recurrent module's output, checkpointed whole (``chunks=None``) or in time chunks
    (the state carried from one chunk to the next, the last chunk not checkpointed)."""
    emb = model.embed(idx)
    if chunks is None:
        return checkpoint(lambda e: model.rnn(e)[0], emb, use_reentrant=False)

    def run(e: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hx = None if not state else (state if len(state) == 2 else state[0])
        out, new = model.rnn(e, hx)
        return (out, *new) if isinstance(new, tuple) else (out, new)

    pieces = emb.split(math.ceil(emb.shape[1] / chunks), dim=1)
    outs: list[torch.Tensor] = []
    state: tuple[torch.Tensor, ...] = ()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        res = run(piece, *state) if last else checkpoint(run, piece, *state, use_reentrant=False)
        outs.append(res[0])
        state = tuple(res[1:])
    return torch.cat(outs, 1)
