"""``checkpoint``: activation checkpointing over a model's blocks (non-reentrant).

Chen et al., "Training deep nets with sublinear memory cost" (2016): keep only
the inputs of ``s`` segments during the forward pass and recompute each
segment's activations during the backward pass. With ``s ≈ √L`` memory grows as
O(√L) instead of O(L), for one extra forward pass.

The blocks come from :func:`leangrad.blocks`: an ``nn.Sequential`` (or a module with
``checkpoint_blocks()``) is a sequence of blocks, split into segments; a model written
the ordinary way (a class with its own ``forward``) is run as written, with each of its
repeated blocks (a transformer's layers, a ResNet's residual blocks) checkpointed on its
own — inside a copy of the model that shares its tensors. The wrapper around each block
takes whatever arguments the model's code passes (Hugging Face blocks take
``attention_mask=...``), returns the block's output unchanged and answers attribute reads
for the block (``UNet2DModel`` reads ``block.resnets``).

With ``trace=True`` a checkpointed block runs as torch.fx code where that is safe:
generated code drops each intermediate at its last use, while a Python ``forward`` keeps
its locals alive until they are rebound or it returns. Nothing is saved while a
checkpointed block runs, so those lifetimes are its memory: on a ResNet basic block
(``h = bn2(conv2(h))`` keeps the first ReLU's output alive through ``bn2``) the
checkpointed step's peak falls by one activation (tests/engines/test_checkpoint.py). It is
not the default: the generated code ran 2% (ResNet) to 6% (GPT, no memory gained) slower
here, so :func:`leangrad.plan` measures both and keeps what pays.

A model wrapped by ``DistributedDataParallel`` or FSDP2 (``fully_shard``) trains as
PyTorch's own per-block checkpointing does with them, its gradients averaged in
the backward as backprop's are. Under DDP the step is prepared for ``ddp.module`` as for any
model and runs *through* DDP's forward (:func:`~leangrad.engines._wrapped.through_ddp`), so
DDP prepares its reducer and its hooks on autograd's backward average the gradients: every
option works. FSDP2 gathers a unit's parameters in hooks around the unit's forward and
frees them after it, and a prepared copy cannot copy its sharded parameters, so on an FSDP2
model each checkpointed block's own ``forward`` is checkpointed in place for the forward
pass (:class:`_InPlace`): the hooks stay outside the checkpointed function, and in the
backward FSDP's pre-backward hook gathers the block's parameters before the recomputation
runs (torchtitan's composition: checkpoint each block, then ``fully_shard`` the blocks).
Each block is checkpointed alone there, as its fx trace with ``trace=True``, or in
``fragments`` of the batch (the fragments' recomputation runs in their backward, after FSDP's
pre-backward hook has gathered the parameters); the options that group blocks, run blocks
again outside their FSDP unit or copy modules are refused (:meth:`Checkpoint.wrapped_why`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.checkpoint import checkpoint

from ... import _errors as errors
from .._backprop import grad_hooks
from .._base import Engine, LossFn, OnGrad, PlanOffer, StepResult, forward_loss
from .._blocks import ALIASED_BLOCKS, Blocks, blocks
from .._catalog import register
from .._generators import generator_replay
from .._prepare import PreparedCache, Wrapper, share_copy
from .._signature import untraceable_signature
from .._wrapped import DDP, FSDP1, FSDP2, forward_replaced, through_ddp, wrapped_by
from .._writes import InputWrites
from ._explain import block_lines
from ._fragments import BAD_FRAGMENTS, Fragmenter
from ._offers import block_offers, time_chunk_offers
from ._segments import auto_segments, block_sizes, largest, saved_inside
from ._time_chunks import BAD_TIME_CHUNKS, chunk_recurrent, fused_recurrent, unchunkable
from ._two_level import (
    BAD_LEVELS,
    LEVELS_AND_AUTO,
    LEVELS_AND_CHUNKS,
    TwoLevel,
    TwoLevelStats,
    outer_segments,
)

__all__ = ["ALIASED_BLOCKS", "BAD_SEGMENTS", "SEGMENTS_NEED_SEQUENCE", "Checkpoint",
           "model_blocks", "split_segments", "trace_block", "traced",
           "untraceable_signature"]  # fmt: skip

BAD_SEGMENTS = (
    "segments must be a positive int, 'sqrt', 'auto' or None (one per block), got {value!r}"
)
SEGMENTS_NEED_SEQUENCE = (
    "segments={value!r} groups consecutive blocks, which needs a model that is its blocks "
    "run one after another (nn.Sequential, or checkpoint_blocks()); {model} runs its own "
    "forward, so each of its blocks is checkpointed alone ({found}); drop segments=, or "
    "add levels=2, where segments= counts outer segments of block calls on any model"
)
NO_RECURRENT = (
    "time_chunks={value!r} checkpoints fused recurrent modules (nn.LSTM, nn.GRU, nn.RNN) "
    "along time, and {model} has none; drop time_chunks="
)
FSDP2_OPTION = (
    "checkpoint({option}) on an FSDP2 (fully_shard) model: {why}; drop {option} (each "
    "block is then checkpointed inside its own FSDP unit), or wrap the model in "
    "DistributedDataParallel instead, where checkpoint takes every option"
)
FSDP2_WHY = {
    "segments": "segments group several blocks into one checkpointed function, while FSDP2 "
                "gathers each unit's parameters in hooks that must run outside it",
    "levels": "levels=2 runs blocks again to rebuild dropped inputs at the start of a "
              "segment's backward, before FSDP2 has gathered those blocks' parameters",
    "time_chunks": "time_chunks runs a copy of the model's modules, and a module FSDP2 "
                   "sharded (its parameters, its hooks) cannot be copied",
    "fragment_blocks": "fragment_blocks sizes its choice of blocks on a copy of the "
                       "model's step, and a module FSDP2 sharded cannot be copied",
    "sequence_fragments": "sequence_fragments runs copies of the blocks' children, and a "
                          "module FSDP2 sharded cannot be copied",
}  # fmt: skip
FSDP2_GRAPH = (
    "checkpoint on an FSDP2 (fully_shard) model whose module tree repeats no block ({how}): "
    "its blocks would be pieces of a torch.fx copy of the model, and a module FSDP2 sharded "
    "cannot be copied; name the blocks with blocks=[...] (and fully_shard those), or wrap "
    "the model in DistributedDataParallel instead"
)
FSDP1_REFUSED = (
    "checkpoint on a FullyShardedDataParallel (FSDP1) model: checkpoint runs through "
    "DistributedDataParallel and FSDP2 only (checked to average its gradients as backprop's); "
    "shard the model with fully_shard (FSDP2), or wrap it in DistributedDataParallel"
)
BAD_FRAGMENT_BLOCKS = (
    "fragment_blocks must be a positive int (that many of the largest checkpointed blocks), "
    "a list of block names or None (every checkpointed block), got {value!r}"
)
FRAGMENT_BLOCKS_NEED_FRAGMENTS = (
    "fragment_blocks={value!r} names the blocks that run in fragments of the batch, and "
    "fragments= is not set; add fragments=k (e.g. fragments=4), or drop fragment_blocks="
)
FRAGMENT_BLOCKS_UNKNOWN = (
    "fragment_blocks names {names}, which {model}'s checkpointing does not recompute; the "
    "recomputed blocks: {known} (name them, or add them to blocks=)"
)
NOT_NAMED = "not named by fragment_blocks: runs whole"
NOT_LARGEST = (
    "not among the {n} largest (saves {size} inside, the smallest fragmented {smallest}; "
    "sized on fake tensors at this step's shapes): runs whole"
)
UNSIZED = (
    "fragment_blocks={n}: the blocks could not be sized on fake tensors ({error}); every "
    "checkpointed block runs in fragments"
)
CHUNKS_AND_SEGMENTS = (
    "time_chunks= and segments= cannot be combined: with time_chunks each block is "
    "checkpointed alone; drop one of them"
)


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a Sequential-like model, in execution order (see :func:`blocks`)."""
    found = blocks(model)
    return [found.modules[n] for n in found.names]


def traced(block: nn.Module) -> nn.Module:
    """``block`` as torch.fx code, which drops every intermediate at its last use; the
    block itself where that is not safe (:func:`trace_block` says why)."""
    return trace_block(block)[0]


def trace_block(block: nn.Module) -> tuple[nn.Module, str | None]:
    """``(module, why not)``: ``block`` as torch.fx code and ``None``, or ``block`` itself
    and the reason it runs as written:

    - fx cannot trace it (data-dependent Python; every Hugging Face block), or it is fx
      code already;
    - its ``forward`` takes optional or variadic arguments (a default would be baked in);
    - tracing had a Python side effect — it changed a module attribute that is not a
      tensor (a counter, a cache), a generator a module holds (a layer drawing its own
      seed, as ``leangrad.rad``'s do), or the global RNGs (torch, ``random``, numpy):
      the trace would replay that effect's result forever instead of running it.

    A block that cannot be traced never fails the step: it runs as written, and the other
    blocks are still traced (``leangrad.explain`` lists which ran how, and why).

    The traced module shares the block's submodules, parameters and buffers. What tracing
    reads once — ``self.training``, flags and numbers held by the modules — is the key
    :class:`_Traced` traces under, so a changed flag or mode never runs a stale trace."""
    if isinstance(block, fx.GraphModule):
        return block, None
    if (why := untraceable_signature(block)) is not None:
        return block, why
    before = _python_state(block)
    try:
        with _undo_side_effects(block) as after:
            gm = fx.symbolic_trace(block)
    except Exception as err:  # any Python fx cannot trace: run the block as written
        first = (str(err).strip().splitlines() or [""])[0][:120]
        return block, f"torch.fx cannot trace it ({type(err).__name__}: {first})"
    if after != [before]:
        return block, (
            "tracing it had a Python side effect (a module attribute, a "
            "generator or a global RNG changed), which a trace would replay"
        )
    return gm, None


def _attrs(block: nn.Module) -> tuple[Any, ...]:
    """Each module's training flag and non-tensor public attributes (by ``repr``): what a
    trace may read once."""
    out: list[tuple[str, Any]] = []
    for m in block.modules():
        out.append(("training", m.training))
        out += [(k, repr(v)) for k, v in vars(m).items()
                if not k.startswith("_") and k != "forward"  # an _InPlace, not read by fx
                and not isinstance(v, (torch.Tensor, nn.Module, torch.Generator))]  # fmt: skip
    return tuple(out)


def _generators(block: nn.Module) -> list[torch.Generator]:
    return [v for m in block.modules() for v in vars(m).values() if isinstance(v, torch.Generator)]


def _python_state(block: nn.Module) -> tuple[Any, ...]:
    """:func:`_attrs`, plus the states of the generators the modules hold and of the global
    RNGs."""
    with unset_fake_temporarily():  # under an estimate's fake mode: the real states
        gens = tuple(bytes(g.get_state().numpy()) for g in _generators(block))
        rng = (bytes(torch.get_rng_state().numpy()), repr(random.getstate()),
               repr(np.random.get_state()))  # fmt: skip
    return (_attrs(block), gens, rng)


@contextlib.contextmanager
def _undo_side_effects(block: nn.Module) -> Iterator[list[tuple[Any, ...]]]:
    """Run a trace; the list it yields then holds the state the trace left (for
    :func:`traced`'s check), and the RNGs, the generators and the modules' public
    non-tensor attributes are put back as they were."""
    with unset_fake_temporarily():
        gens = [(g, g.get_state()) for g in _generators(block)]
    attrs = [(m, {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in
             block.modules()]  # fmt: skip
    py, npy = random.getstate(), np.random.get_state()
    with unset_fake_temporarily():
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    after: list[tuple[Any, ...]] = []
    try:
        yield after
    finally:
        after.append(_python_state(block))
        random.setstate(py)
        np.random.set_state(npy)
        with unset_fake_temporarily():
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            for g, state in gens:
                g.set_state(state)
    for m, d in attrs:
        for k, v in d.items():
            if vars(m).get(k, v) is not v:
                setattr(m, k, v)


class _Traced:
    """A block's fx trace per state of what tracing reads (training flags, the modules'
    non-tensor attributes), made on first use of that state."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self._by_state: dict[tuple[Any, ...], nn.Module] = {}

    def __call__(self) -> nn.Module:
        key = _attrs(self.block)
        if key not in self._by_state:
            self._by_state[key] = traced(self.block)
            # tracing leaves garbage cycles that reach the running step's frames (fx's
            # patching, lazy imports), so the step's block inputs outlived their use until
            # the collector happened to run: up to 9% of the quick BERT's first-step peak
            gc.collect()
        return self._by_state[key]


def split_segments(n_blocks: int, segments: int) -> list[range]:
    """Split ``range(n_blocks)`` into ``segments`` contiguous, near-equal ranges."""
    segments = max(1, min(segments, n_blocks))
    bounds = [round(i * n_blocks / segments) for i in range(segments + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


@register("checkpoint")
class Checkpoint(Engine):
    """Checkpointing over the blocks of an ``nn.Sequential``-like model.

    Args:
        segments: number of segments. ``None`` (default) checkpoints every block;
            ``"sqrt"`` uses ⌈√L⌉ segments for L blocks (memory O(√L)); an int
            uses that many; ``"auto"`` places the boundaries from measured block sizes
            (each block's input and saved bytes, one measuring forward per input shape;
            :mod:`leangrad.engines.checkpoint._segments`). Every segment but the last is
            checkpointed: the last one's activations are the first the backward pass needs, so
            recomputing them would cost time and save no peak memory
            (as ``torch.utils.checkpoint.checkpoint_sequential``). A model run as written
            has every block checkpointed, the last one too: a final norm, the head and
            the loss come after it, and its saved tensors would sit beside theirs (as
            ``gradient_checkpointing_enable()`` of Hugging Face models does).
        blocks: names of the blocks to checkpoint (every one of them; see
            :func:`leangrad.blocks`).
        trace: run each checkpointed block as torch.fx code where that is safe
            (:func:`traced`): intermediates die at their last use — a lower peak where a
            block's Python keeps them longer, at a few percent of time. ``False`` (the
            default) runs the blocks' own ``forward``.
        time_chunks: run each fused recurrent module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``)
            that is not inside a checkpointed block over its sequence in this many time
            chunks, the state carried, every chunk but the last checkpointed
            (:mod:`leangrad.engines.checkpoint._time_chunks`; Chen et al. 2016). A fused
            recurrent module is one op with no block boundary inside it, so this is the only
            way to checkpoint it. Where the module tree repeats nothing, the chunks are the
            only blocks (no fx split). ``None`` (the default) runs such modules whole.
        fragments: run each checkpointed block's forward and recomputation in this many
            pieces of the batch, one after another (:mod:`leangrad.engines.checkpoint._fragments`;
            Moonwalk v2's fragmental checkpointing): about ``1/fragments`` of a block's
            internals are alive during its backward instead of all of them. A block that
            couples its examples (training-mode BatchNorm, dropout) or fails the first
            call's probe runs whole; :func:`leangrad.explain` and the step's
            ``info["whole"]`` say which and why. ``None`` (the default): every block whole.
        fragment_blocks: which checkpointed blocks run in ``fragments`` (the others are
            recomputed whole, as plain checkpointing): a list of block names, or an int
            ``n``, the ``n`` blocks that save the most bytes inside (measured on fake
            tensors at each new input shape,
            :func:`~leangrad.engines.checkpoint._segments.saved_inside`).
            Fragments cost time (with training-mode BatchNorm, two extra recomputations of
            a ResNet block): where a few blocks hold most of the activations (a CNN's first
            stage at high resolution) fragmenting only those lowers the peak about as much
            for a fraction of the time. ``None`` (the default): every checkpointed block.
            The step's ``info["fragmented"]`` lists the blocks chosen.
        sequence_fragments: inside each checkpointed block, run each child module with at
            least two parametrized layers that works position by position (an MLP; the
            first call's probe decides: attention mixes positions and runs whole) in this
            many pieces of its second (sequence) dimension, forward and recomputation
            alike: for a small batch of long sequences, where ``fragments`` has nothing to
            cut. Composes with ``fragments``.
        levels: ``1`` (the default): one level, as above. ``2``: two-level checkpointing
            (:mod:`leangrad.engines.checkpoint._two_level`; the √L scheme applied to the block
            boundaries): every block is checkpointed on its own, on any model (one written
            the ordinary way too), and ``segments`` then counts *outer* segments of
            consecutive block calls (``None`` or ``"sqrt"``: ⌈√L⌉ for L blocks; an int:
            that many; ``"auto"`` is refused). Only the first input of each outer segment
            is kept through the forward pass; the inputs of its other blocks are dropped
            and rebuilt from it when that segment's backward begins (each block call made
            again as the forward made it, dropout's RNG and layers' generators replayed,
            no graph kept), each kept until its block has been recomputed. Boundaries
            fall from L to about ``s + L/s`` (2√L) for about one more forward pass of the
            blocks. Composes with ``fragments``,
            ``sequence_fragments`` and ``trace``; not with ``time_chunks``. The step's info
            says how many outer segments formed, how many inputs were dropped and how many
            boundaries were rebuilt.

    Trade-off: one extra forward pass of the checkpointed segments; exact
    gradients (RNG state is restored for dropout). BatchNorm running statistics
    advance once per step, as under autograd: the recomputation's update is undone
    (:class:`~leangrad.engines._contract.BufferGuard`). Modules that are recomputed
    may not carry forward hooks (they would fire twice; the error names the module).

    A model wrapped by ``DistributedDataParallel`` takes every option; an FSDP2 model
    (``fully_shard`` on the blocks and the root) takes ``blocks``, ``trace`` and
    ``fragments``, each block checkpointed inside its FSDP unit (module docstring;
    :meth:`wrapped_why` names what is refused and why).
    """

    exact = True
    autocast = True
    reruns = True
    wrapped_models = True  # runs through DDP's forward; inside FSDP2's units (wrapped_why)
    transforms_act_on = "blocks"

    def __init__(
        self,
        *,
        segments: int | Literal["sqrt", "auto"] | None = None,
        blocks: Sequence[str] | None = None,
        trace: bool = False,
        time_chunks: int | None = None,
        fragments: int | None = None,
        sequence_fragments: int | None = None,
        levels: int = 1,
        fragment_blocks: Sequence[str] | int | None = None,
    ) -> None:
        ok = segments is None or segments in ("sqrt", "auto")
        ok = ok or (isinstance(segments, int) and not isinstance(segments, bool) and segments > 0)
        if not ok:
            raise ValueError(BAD_SEGMENTS.format(value=segments))
        if isinstance(blocks, str):  # from the CLI: --engine-opt blocks=stages,head
            blocks = [b.strip() for b in blocks.split(",") if b.strip()]
        if not isinstance(trace, bool):
            raise ValueError(f"trace must be True or False, got {trace!r}")
        if time_chunks is not None and (
            not isinstance(time_chunks, int) or isinstance(time_chunks, bool) or time_chunks < 2
        ):
            raise ValueError(BAD_TIME_CHUNKS.format(value=time_chunks))
        if time_chunks is not None and segments is not None:
            raise ValueError(CHUNKS_AND_SEGMENTS)
        for value in (fragments, sequence_fragments):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 2):  # fmt: skip
                raise ValueError(BAD_FRAGMENTS.format(value=value))
        fragment_blocks = _fragment_blocks(fragment_blocks, fragments)
        if levels not in (1, 2) or isinstance(levels, bool) or not isinstance(levels, int):
            raise ValueError(BAD_LEVELS.format(value=levels))
        if levels == 2 and segments == "auto":
            raise ValueError(LEVELS_AND_AUTO)
        if levels == 2 and time_chunks is not None:
            raise ValueError(LEVELS_AND_CHUNKS)
        super().__init__(segments=segments, blocks=blocks, trace=trace, time_chunks=time_chunks,
                         fragments=fragments, sequence_fragments=sequence_fragments,
                         levels=levels, fragment_blocks=fragment_blocks)  # fmt: skip
        self.segments = segments
        self.fragment_blocks = fragment_blocks
        self.trace = trace
        self.time_chunks = time_chunks
        self.fragments = fragments
        self.sequence_fragments = sequence_fragments
        self.levels = levels
        self.block_names = None if blocks is None else list(blocks)
        self._found: PreparedCache[Blocks] = PreparedCache()
        self._reruns: PreparedCache[list[tuple[str, nn.Module]]] = PreparedCache()
        self._wrapped: PreparedCache[nn.Module] = PreparedCache()
        self._auto: PreparedCache[dict[Any, list[range]]] = PreparedCache()
        self._traces: PreparedCache[list[_Traced]] = PreparedCache()
        self._fragmenters: PreparedCache[dict[tuple[int, ...], Fragmenter]] = PreparedCache()
        self._writes: PreparedCache[dict[tuple[int, ...], InputWrites]] = PreparedCache()
        self._by_position: PreparedCache[list[nn.Module]] = PreparedCache()
        self._cells: PreparedCache[tuple[TwoLevel, list[_Checkpointed]]] = PreparedCache()
        self._in_place: PreparedCache[list[tuple[nn.Module, _InPlace]]] = PreparedCache()
        self._chosen: PreparedCache[_Chosen] = PreparedCache()

    @property
    def probes(self) -> bool:
        # fragments probe each block on the first step; a trace is made on the first step,
        # whose peak is then higher than the later steps' (4.7% on the quick GPT and BERT);
        # segments="auto" runs a measuring forward on the first step of each input shape
        return (self.fragments is not None or self.sequence_fragments is not None
                or self.trace or self.segments == "auto")  # fmt: skip

    @property
    def costly_estimate(self) -> bool:
        return self.fragments is not None or self.sequence_fragments is not None

    def blocks(self, model: nn.Module) -> Blocks:
        """The blocks this engine checkpoints on ``model`` (see :func:`leangrad.blocks`; on a
        DDP model, those of ``ddp.module``, by their names there); found once per model (a
        step asks two or three times, and the fx fallback traces)."""
        model, _ = _unwrap(model)
        found = self._found.get(model, self._find)
        if not found.sequential and self.segments is not None and self.levels == 1:
            raise errors.EngineInputError(SEGMENTS_NEED_SEQUENCE.format(
                value=self.segments, model=type(model).__name__, found=found.how))  # fmt: skip
        return found

    def _find(self, model: nn.Module) -> Blocks:
        if self.time_chunks is None:  # FSDP2: the fx split would be a copy (wrapped_why)
            graph = _unwrap(model)[1] != FSDP2
            return blocks(model, names=self.block_names, graph=graph)
        if not fused_recurrent(model):
            raise errors.EngineInputError(
                NO_RECURRENT.format(value=self.time_chunks, model=type(model).__name__)
            )
        try:  # the module tree's blocks; where it repeats nothing, the chunks alone
            return blocks(model, names=self.block_names, graph=False)
        except errors.EngineInputError:
            if self.block_names is not None:
                raise
            return Blocks((), False, "none but the time chunks of fused recurrent modules", {})

    def _chunked(self, model: nn.Module, found: Blocks) -> list[tuple[str, nn.RNNBase]]:
        """The fused recurrent modules that run in time chunks: those outside the
        checkpointed blocks (the ones inside are recomputed whole already)."""
        if self.time_chunks is None:
            return []
        skip = self.recomputed(found)
        return [(n, m) for n, m in fused_recurrent(model)
                if not any(n == s or n.startswith(f"{s}.") for s in skip)]  # fmt: skip

    def supports(self, model: nn.Module) -> str | None:
        try:
            found = self.blocks(model)
        except errors.EngineInputError as err:
            return str(err)
        for name, rnn in self._chunked(model, found):
            if (why := unchunkable(name or type(model).__name__, rnn)) is not None:
                return why
        return None

    def _groups(self, n: int) -> list[range]:
        if self.segments is None or self.segments == "auto":  # auto: measured in _backward
            s = n
        elif self.segments == "sqrt":
            s = math.ceil(math.sqrt(n))
        else:
            s = int(self.segments)
        return split_segments(n, s)

    def recomputed(self, found: Blocks) -> list[str]:
        """Names of the blocks that are recomputed: every segment but the last of a
        sequence (the last one's activations are the first the backward pass needs);
        every block of a model run as written, and every block named by ``blocks=``; every
        block with ``levels=2``."""
        if found.sequential and self.levels == 1:
            groups = self._groups(len(found.names))
            return [found.names[j] for group in groups[:-1] for j in group]
        # A model run as written has more after its blocks (a final norm, the head, the
        # loss), whose saved tensors coexist with the last block's at the end of the
        # forward: checkpointing that block too lowers the peak (GPT-2, Llama; as
        # gradient_checkpointing_enable() does), unlike the last segment of a sequence.
        return list(found.names)

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        """Checkpointing of the blocks found, alone, in fragments and under ``fad`` and
        ``bits``; fused recurrent modules in time chunks
        (:mod:`leangrad.engines.checkpoint._offers`)."""
        del exact
        offers = block_offers(model, found, loss_fn) if found is not None else []
        return offers + time_chunk_offers(model)

    def apply_transforms(self, model: nn.Module,
                         transform: Callable[[str, nn.Module], nn.Module],
                         ) -> tuple[nn.Module, Engine]:  # fmt: skip
        """Each block transformed, and still one block: a sequence of them, or a copy of
        the model (or of its fx split) with each block replaced, run by a checkpointing
        engine told their names; with only time chunks, the whole model."""
        chunks = self.time_chunks
        found = blocks(model, names=self.block_names) if chunks is None else self.blocks(model)
        if found.sequential and chunks is None:
            mods = [transform(n, found.modules[n]) for n in found.names]
            return nn.Sequential(*mods), self
        if not found.names:  # only time chunks: the transforms apply to the whole model
            return transform("model", model), self
        # the fx split of a model whose module tree repeats nothing is run instead of it
        new = share_copy(found.runner if found.runner is not None else model)
        for name in found.names:
            new.set_submodule(name, transform(name, new.get_submodule(name)))
        runner = Checkpoint(blocks=list(found.names), trace=self.trace, time_chunks=chunks,
                            fragments=self.fragments,
                            sequence_fragments=self.sequence_fragments, levels=self.levels,
                            segments=self.segments if self.levels == 2 else None,
                            fragment_blocks=self.fragment_blocks)  # fmt: skip
        return new, runner

    def transform_blocks(self, model: nn.Module) -> tuple[str, ...]:
        """The blocks found: a step transform leaves them to checkpointing."""
        return tuple(self.blocks(model).names)

    def explain_lines(self, model: nn.Module) -> list[str]:
        """The blocks, each checkpointed or left plain and why
        (:func:`leangrad.engines.checkpoint._explain.block_lines`)."""
        return block_lines(self, model, trace_why=lambda block: trace_block(block)[1],
                           position_children=position_children)  # fmt: skip

    def wrapped_why(self, model: nn.Module, wrapper: str) -> str | None:
        """``None`` under DDP (every option). On an FSDP2 model (or one about to be
        sharded) each block is checkpointed inside its own FSDP unit: refused are the
        options that group blocks or run them again outside it (``segments``, ``levels=2``;
        ``fragments``, not checked there), those that copy modules (``time_chunks``,
        ``sequence_fragments``) and blocks found by cutting the fx graph (a copy too).
        FSDP1 is refused."""
        if wrapper == FSDP1:
            return FSDP1_REFUSED
        if wrapper != FSDP2:
            return None
        given = {"segments": self.segments, "levels": None if self.levels == 1 else self.levels,
                 "time_chunks": self.time_chunks, "fragment_blocks": self.fragment_blocks,
                 "sequence_fragments": self.sequence_fragments}  # fmt: skip
        for option, value in given.items():
            if value is not None:
                return FSDP2_OPTION.format(option=f"{option}={value!r}", why=FSDP2_WHY[option])
        try:
            found = self.blocks(model)
        except errors.EngineInputError as err:
            return str(err)
        return None if found.runner is None else FSDP2_GRAPH.format(how=found.how)

    def rerun_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Every module of the checkpointed blocks: recomputed during the backward pass (on
        an FSDP2 model, a block's own hooks run around its checkpoint, once: its
        submodules). Listed once per model (its hooks are read each step)."""
        return self._reruns.get(model, self._rerun_modules)

    def _rerun_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        found = self.blocks(model)
        if _unwrap(model)[1] == FSDP2:
            return [(n, m) for name in self.recomputed(found)
                    for n, m in found.modules[name].named_modules(prefix=name)
                    if m is not found.modules[name]]  # fmt: skip
        if found.runner is not None:  # fx split: hooks live on the model's own modules
            return list(model.named_modules())
        return [
            (n, m)
            for name in self.recomputed(found)
            for n, m in found.modules[name].named_modules(prefix=name or "block")
        ] + [
            (n, m)
            for name, rnn in self._chunked(model, found)
            for n, m in rnn.named_modules(prefix=name or "rnn")
        ]

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        found = self.blocks(model)
        outer, (model, wrapper) = model, _unwrap(model)
        if wrapper == FSDP2:
            return self._in_fsdp_units(model, found, inputs, loss_fn, params, on_grad)

        def via(forward: Callable[..., Any]) -> Callable[..., Any]:
            return forward if wrapper is None else through_ddp(outer, forward)  # DDP's own

        chosen = self._choose(model, found, inputs)
        if self.levels == 2 and found.sequential:
            return self._two_level_sequence(model, found, via, inputs, loss_fn, params,
                                            on_grad)  # fmt: skip
        step = (inputs, loss_fn, params, on_grad)
        if not found.sequential or self.time_chunks is not None:  # the model as written
            return self._as_written(model, found, via if wrapper is not None else None,
                                    chosen, *step)  # fmt: skip
        return self._in_segments(model, found, via, chosen, *step)

    def _as_written(self, model: nn.Module, found: Blocks, via: Callable[..., Any] | None,
                    chosen: _Chosen | None, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn,
                    params: Mapping[str, nn.Parameter], on_grad: OnGrad | None,
                    ) -> StepResult:  # fmt: skip
        """The model's own forward, its blocks replaced by checkpointed wrappers (fused
        recurrent modules in time chunks); ``via`` runs it through DDP where wrapped."""
        for name, rnn in self._chunked(model, found):
            if (why := unchunkable(name or type(model).__name__, rnn)) is not None:
                raise errors.EngineInputError(why)
        wrapped = self._wrapped.get(model, lambda m: self._wrap(m, found))
        chain: TwoLevel | None = wrapped.__dict__.get("_two_level")
        # under DDP, ddp.module's own __call__ runs the hooks: the copy's forward alone
        run_model = wrapped if via is None else via(wrapped.forward)
        with chain.forward() if chain is not None else _no_stats() as stats:
            loss = forward_loss(self.label, run_model, inputs, loss_fn)
        with grad_hooks(params, on_grad):
            loss.backward()
        info: dict[str, Any] = {"blocks": len(found),
                                "checkpointed": len(self.recomputed(found))}  # fmt: skip
        on_copies = [m.__dict__["block_name"] for m in wrapped.modules()
                     if isinstance(m, _Checkpointed) and m.__dict__["writes"].last]
        if on_copies:
            info["input_copied"] = on_copies  # blocks writing their input in place
        if stats is not None:
            info.update(levels=2, **stats.info())
        if self.time_chunks is not None:
            info["time_chunked"] = len(self._chunked(model, found))
        if self.fragments is not None:
            info["whole"] = {n: m.fragmenter.last for n, m in wrapped.named_modules()
                             if isinstance(m, _Checkpointed) and m.fragmenter is not None
                             and m.fragmenter.last is not None}  # fmt: skip
            info.update(_chosen_info(chosen, info["whole"]))
        return self._result(loss, **info)

    def _segment_blocks(self, model: nn.Module, found: Blocks,
                        inputs: tuple[torch.Tensor, ...],
                        ) -> tuple[list[Any], list[range]]:  # fmt: skip
        """A sequence's blocks as they run (copies cut along the sequence, traced
        recomputations) and their segments (``"auto"``: from measured block sizes, once
        per input shape)."""
        mods: list[Any] = [found.modules[n] for n in found.names]
        groups = self._groups(len(mods))
        if self.sequence_fragments is not None:  # copies of the recomputed blocks
            k = self.sequence_fragments
            cut = {j for group in groups[:-1] for j in group}
            copies = self._by_position.get(model, lambda _m: [
                by_position(b, k) if j in cut else b for j, b in enumerate(mods)])  # fmt: skip
            mods = list(copies)
        if self.segments == "auto":  # boundaries from measured block sizes, once per shape
            by_shape = self._auto.get(model, lambda _m: {})
            key = tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)
            if key not in by_shape:
                by_shape[key] = auto_segments(*block_sizes(mods, inputs))
            groups = by_shape[key]
        if self.trace:  # the recomputed blocks run as fx code; the last segment as written
            traces = self._traces.get(model, lambda _m: [_Traced(b) for b in mods])
            last = set(groups[-1])
            mods = [b if j in last else traces[j]() for j, b in enumerate(mods)]
        return mods, groups

    def _in_segments(self, model: nn.Module, found: Blocks, via: Callable[..., Any],
                     chosen: _Chosen | None, inputs: tuple[torch.Tensor, ...],
                     loss_fn: LossFn, params: Mapping[str, nn.Parameter],
                     on_grad: OnGrad | None) -> StepResult:  # fmt: skip
        """A sequence of blocks run segment by segment, every segment but the last
        checkpointed (in fragments of the batch where asked)."""
        mods, groups = self._segment_blocks(model, found, inputs)
        frags = self._fragmenters.get(model, lambda _m: {})
        probes = self._writes.get(model, lambda _m: {})
        whole: dict[str, str] = {}
        copied: list[str] = []

        def run(xs: tuple[torch.Tensor, ...]) -> object:
            # The first block takes the engine's inputs unpacked; every later block
            # takes the previous output whole (a tuple stays one argument), as
            # nn.Sequential does.
            out: object = None
            for i, group in enumerate(groups):
                seg = _Segment([mods[j] for j in group])
                args = xs if i == 0 else (out,)
                if i == len(groups) - 1:
                    out = seg(*args)
                    continue
                names = [found.names[j] for j in group]
                key = tuple(id(b) for b in seg.blocks)
                writes = probes.get(key)
                if writes is None:
                    writes = probes[key] = InputWrites(seg.blocks)
                # a segment writing its input in place runs on copies (_writes)
                run_seg = writes.wrap(seg, args, {})

                def plain(*a: Any, seg: _Segment = seg, run_seg: Any = run_seg) -> Any:
                    return checkpoint(run_seg, *a, use_reentrant=False,
                                      context_fn=generator_replay(seg.blocks))  # fmt: skip

                skip = chosen is not None and not any(chosen.allows(n) for n in names)
                if self.fragments is None or skip:
                    out = plain(*args)
                else:
                    frag = frags.get(key)
                    if frag is None:
                        frag = frags[key] = Fragmenter(seg.blocks, fragments=self.fragments)
                    out = frag(run_seg, plain, *args)
                    if frag.last is not None:
                        whole[",".join(names)] = frag.last
                if writes.last:
                    copied.append(",".join(names))
            return out

        loss = forward_loss(self.label, via(lambda *xs: run(xs)), inputs, loss_fn)
        with grad_hooks(params, on_grad):
            loss.backward()
        more: dict[str, Any] = {"whole": whole} if self.fragments is not None else {}
        if copied:
            more["input_copied"] = copied  # segments writing their input in place
        if self.fragments is not None:
            more.update(_chosen_info(chosen, whole))
        return self._result(loss, segments=len(groups), **more)

    def _choose(self, model: nn.Module, found: Blocks,
                inputs: tuple[torch.Tensor, ...]) -> _Chosen | None:  # fmt: skip
        """With ``fragment_blocks``, the blocks that run in fragments this step (the
        :class:`_Chosen` the model's block wrappers read): the names given (refused where
        a name is not recomputed), or the ``n`` recomputed blocks that save the most bytes
        inside, sized on fake tensors once per input shape (:func:`saved_inside`)."""
        if self.fragment_blocks is None or self.fragments is None:
            return None
        chosen = self._chosen.get(model, lambda _m: _Chosen())
        recomputed = self.recomputed(found)
        key = tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)
        if key not in chosen.by_shape:
            chosen.by_shape[key] = self._select(model, found, recomputed, inputs)
        chosen.now = chosen.by_shape[key]
        return chosen

    def _select(self, model: nn.Module, found: Blocks, recomputed: list[str],
                inputs: tuple[torch.Tensor, ...]) -> _Selection:  # fmt: skip
        """What :meth:`_choose` sets for one input shape."""
        if not isinstance(self.fragment_blocks, int):
            named = list(self.fragment_blocks or [])
            unknown = [n for n in named if n not in recomputed]
            if unknown:
                raise errors.EngineInputError(FRAGMENT_BLOCKS_UNKNOWN.format(
                    names=unknown, model=type(model).__name__, known=recomputed))  # fmt: skip
            return _Selection(set(named), {n: NOT_NAMED for n in recomputed if n not in named},
                              None, None)  # fmt: skip
        n = self.fragment_blocks
        if found.sequential:
            root: nn.Module = model
            run: Callable[..., object] = _Segment([found.modules[b] for b in found.names])
        else:
            root = found.runner if found.runner is not None else model
            run = root
        try:
            sizes = saved_inside(root, run, {b: found.modules[b] for b in recomputed}, inputs)
        except Exception as err:  # a forward that reads values: every block in fragments
            first = (str(err).strip().splitlines() or [""])[0][:120]
            why = UNSIZED.format(n=n, error=f"{type(err).__name__}: {first}")
            return _Selection(set(recomputed), {}, None, why)
        top = largest(sizes, n)
        smallest = min((sizes[b] for b in top), default=0)
        whole = {b: NOT_LARGEST.format(n=n, size=_fmt(sizes[b]), smallest=_fmt(smallest))
                 for b in recomputed if b not in top}  # fmt: skip
        return _Selection(set(top), whole, sizes, None)

    def _two_level_sequence(
        self,
        model: nn.Module,
        found: Blocks,
        via: Callable[[Callable[..., Any]], Callable[..., Any]],
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        """``levels=2`` on a sequence of blocks: each block checkpointed alone, run one
        after another (the first takes the inputs unpacked, every later one the previous
        output whole), in outer segments (:mod:`leangrad.engines.checkpoint._two_level`); ``via``
        runs the sequence (through DDP's forward, on a DDP model)."""
        chain, cells = self._cells.get(model, lambda m: self._two_level_cells(m, found))

        def run(*xs: torch.Tensor) -> object:
            out: object = cells[0](*xs)
            for cell in cells[1:]:
                out = cell(out)
            return out

        with chain.forward() as stats:
            loss = forward_loss(self.label, via(run), inputs, loss_fn)
        with grad_hooks(params, on_grad):
            loss.backward()
        info: dict[str, Any] = {"blocks": len(found), "checkpointed": len(found), "levels": 2,
                                **stats.info()}  # fmt: skip
        if self.fragments is not None:
            frags = [(n, c.fragmenter) for n, c in zip(found.names, cells, strict=True)]
            info["whole"] = {n: f.last for n, f in frags
                             if f is not None and f.last is not None}  # fmt: skip
            info.update(_chosen_info(self._chosen_now(model), info["whole"]))
        return self._result(loss, **info)

    def _in_fsdp_units(
        self,
        model: nn.Module,
        found: Blocks,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        """An FSDP2 model: the model itself runs (its root's hooks gather and free), each
        checkpointed block's ``forward`` checkpointed in place for the forward pass, inside
        the block's FSDP hooks (:class:`_InPlace`); FSDP's own backward reduces."""
        names = self.recomputed(found)

        def build(_m: nn.Module) -> list[tuple[nn.Module, _InPlace]]:
            seen: dict[int, nn.Module] = {}  # a block registered under two names: once
            for name in names:
                seen.setdefault(id(found.modules[name]), found.modules[name])
            return [(b, _InPlace(b, trace=self.trace, fragments=self.fragments))
                    for b in seen.values()]  # fmt: skip

        with contextlib.ExitStack() as stack:
            for block, forward in self._in_place.get(model, build):
                stack.enter_context(forward_replaced(block, forward))
            loss = forward_loss(self.label, model, inputs, loss_fn)
        with grad_hooks(params, on_grad):
            loss.backward()
        return self._result(loss, blocks=len(found), checkpointed=len(names))

    def fragment_choice(self, model: nn.Module) -> tuple[set[str] | None, dict[str, str]]:
        """For :func:`leangrad.explain`: the blocks ``fragment_blocks`` runs in fragments and
        why each other one runs whole; ``(None, {})`` where it is every block, or a number
        of blocks not yet sized (that happens at the first step, per input shape)."""
        if self.fragment_blocks is None or self.fragments is None:
            return None, {}
        if not isinstance(self.fragment_blocks, int):
            named = set(self.fragment_blocks)
            return named, {n: NOT_NAMED for n in self.recomputed(self.blocks(model))
                           if n not in named}  # fmt: skip
        chosen = self._chosen_now(_unwrap(model)[0])
        if chosen is None or not chosen.by_shape:
            return None, {}
        return set(chosen.now.names), dict(chosen.now.whole)

    def _chosen_now(self, model: nn.Module) -> _Chosen | None:
        """The model's :class:`_Chosen` (shared by its block wrappers), or ``None`` without
        ``fragment_blocks``."""
        if self.fragment_blocks is None or self.fragments is None:
            return None
        return self._chosen.get(model, lambda _m: _Chosen())

    def _two_level_cells(self, model: nn.Module,
                         found: Blocks) -> tuple[TwoLevel, list[_Checkpointed]]:  # fmt: skip
        chain = TwoLevel(len(found), outer_segments(len(found), self.segments))
        chosen = self._chosen_now(model)
        cells = []
        for name in found.names:
            block = found.modules[name]
            if self.sequence_fragments is not None:
                block = by_position(block, self.sequence_fragments)
            cells.append(_Checkpointed(block, trace=self.trace, fragments=self.fragments,
                                       two_level=chain, name=name, chosen=chosen))  # fmt: skip
        return chain, cells

    def _wrap(self, model: nn.Module, found: Blocks) -> nn.Module:
        """A copy of ``model`` (or of the fx split that stands for it) sharing its tensors,
        each checkpointed block wrapped."""
        new = share_copy(found.runner if found.runner is not None else model)
        checkpointed = self.recomputed(found)
        chosen = self._chosen_now(model)
        chain = None
        if self.levels == 2:
            chain = TwoLevel(len(checkpointed), outer_segments(len(checkpointed), self.segments))
            new.__dict__["_two_level"] = chain
        for name in checkpointed:
            block = new.get_submodule(name)
            if self.sequence_fragments is not None:
                block = by_position(block, self.sequence_fragments)
            new.set_submodule(name, _Checkpointed(block, trace=self.trace,
                                                  fragments=self.fragments, two_level=chain,
                                                  name=name, chosen=chosen))  # fmt: skip
        if self.time_chunks is not None:
            chunk_recurrent(new, self.time_chunks, skip=tuple(checkpointed))
        return new


def _fragment_blocks(value: Sequence[str] | int | str | None,
                     fragments: int | None) -> list[str] | int | None:  # fmt: skip
    """``fragment_blocks=`` checked: a list of names, a positive int or ``None`` (from the
    CLI, ``"a,b"`` or ``"3"``)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else [
            v.strip() for v in value.split(",") if v.strip()]  # fmt: skip
    if isinstance(value, bool) or (isinstance(value, int) and value < 1):
        raise ValueError(BAD_FRAGMENT_BLOCKS.format(value=value))
    if not isinstance(value, int):
        if not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(v, str) for v in value):  # fmt: skip
            raise ValueError(BAD_FRAGMENT_BLOCKS.format(value=value))
        value = list(value)
    if fragments is None:
        raise ValueError(FRAGMENT_BLOCKS_NEED_FRAGMENTS.format(value=value))
    return value


@dataclasses.dataclass(frozen=True)
class _Selection:
    """The checkpointed blocks that run in fragments for one input shape (``names``), why
    each other one runs whole (``whole``), the sizes that chose them (bytes saved inside
    each block; ``None`` for a list of names) and why nothing was sized (``note``)."""

    names: set[str]
    whole: dict[str, str]
    sizes: dict[str, int] | None
    note: str | None


class _Chosen:
    """``fragment_blocks`` on one model: the selection of the step running now (``now``,
    read by the blocks' wrappers), per input shape (``fragment_blocks=n`` is sized once per
    shape)."""

    def __init__(self) -> None:
        self.now = _Selection(set(), {}, None, None)
        self.by_shape: dict[Any, _Selection] = {}

    def allows(self, name: str) -> bool:
        return name in self.now.names


def _chosen_info(chosen: _Chosen | None, whole: dict[str, str]) -> dict[str, Any]:
    """The step's info under ``fragment_blocks``: the blocks fragmented (``fragmented``),
    the others added to ``whole`` with why, the sizes that chose them (``block_bytes``);
    nothing without it."""
    if chosen is None:
        return {}
    sel = chosen.now
    whole.update(sel.whole)
    info: dict[str, Any] = {"fragmented": sorted(sel.names)}
    if sel.sizes is not None:
        info["block_bytes"] = dict(sel.sizes)
    if sel.note is not None:
        info["fragment_note"] = sel.note
    return info


def _fmt(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class _Checkpointed(Wrapper):
    """A block whose activations are recomputed in the backward pass (any positional and
    keyword arguments, its output as it returns it, its attributes readable through the
    wrapper), run as its fx trace where that is safe (``trace``; called with keyword
    arguments: as written); with ``two_level``, a call in that forward's outer segments
    (:mod:`leangrad.engines.checkpoint._two_level`; ``name`` names the block in its errors)."""

    def __init__(self, inner: nn.Module, *, trace: bool, fragments: int | None = None,
                 two_level: TwoLevel | None = None, name: str = "",
                 chosen: _Chosen | None = None) -> None:  # fmt: skip
        super().__init__(inner)
        self.__dict__["chosen"] = chosen
        self._traced = _Traced(inner) if trace else None
        self.__dict__["fragmenter"] = (None if fragments is None
                                       else Fragmenter([inner], fragments=fragments))  # fmt: skip
        self.__dict__["two_level"] = two_level
        self.__dict__["block_name"] = name or type(inner).__name__
        self.__dict__["writes"] = InputWrites([inner])

    @property
    def fragmenter(self) -> Fragmenter | None:
        frag: Fragmenter | None = self.__dict__["fragmenter"]
        return frag

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        own = self._traced() if self._traced is not None and not kwargs else self.inner
        # a block writing its input in place runs on copies (_writes)
        writes: InputWrites = self.__dict__["writes"]
        run = writes.wrap(own, args, kwargs)
        replay = generator_replay([self.inner])  # layers' own generators, rewound

        def plain(*a: Any, **kw: Any) -> Any:
            return checkpoint(run, *a, use_reentrant=False, context_fn=replay, **kw)

        frag: Fragmenter | None = self.__dict__["fragmenter"]
        chosen: _Chosen | None = self.__dict__["chosen"]
        if chosen is not None and not chosen.allows(self.__dict__["block_name"]):
            frag = None  # fragment_blocks: recomputed whole

        def call(*a: Any, **kw: Any) -> Any:
            return plain(*a, **kw) if frag is None else frag(run, plain, *a, **kw)

        chain: TwoLevel | None = self.__dict__["two_level"]
        if chain is None:
            return call(*args, **kwargs)
        return chain.call(self.inner, self.__dict__["block_name"], call, args, kwargs)


class _InPlace:
    """The ``forward`` a block of an FSDP2 model has for one forward pass: its own
    ``forward``, checkpointed (non-reentrant; as its fx trace with ``trace``, where that is
    safe). ``block(...)`` still runs the block's hooks around it: FSDP2 gathers the
    parameters before the checkpointed call and frees them after it, and in the backward
    its pre-backward hook on the block's output gathers them again before the recomputation
    (which calls the block's own ``forward``, no hooks). ``inspect.signature`` sees the
    block's own (what :func:`untraceable_signature` reads)."""

    def __init__(self, block: nn.Module, *, trace: bool, fragments: int | None = None) -> None:
        self.block = block
        self.own: Callable[..., Any] = block.forward
        self.__wrapped__ = self.own
        self.traced = _Traced(block) if trace else None
        self.replay = generator_replay([block])  # layers' own generators, rewound
        self.writes = InputWrites([block])
        # In fragments: the pieces' recomputation runs in the fragments' backward, after
        # FSDP2's pre-backward hook on the block's output has gathered the parameters (the
        # forward's, as registered on the block then, get the summed gradients).
        self.fragmenter = None if fragments is None else Fragmenter([block], fragments=fragments)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.own(*args, **kwargs)
        run = self.traced() if self.traced is not None and not kwargs else self.own
        run = self.writes.wrap(run, args, kwargs)  # a block writing its input: on copies

        def plain(*a: Any, **kw: Any) -> Any:
            return checkpoint(run, *a, use_reentrant=False, context_fn=self.replay, **kw)

        if self.fragmenter is None:
            return plain(*args, **kwargs)
        return self.fragmenter(run, plain, *args, **kwargs)


def _unwrap(model: nn.Module) -> tuple[nn.Module, str | None]:
    """``(the module the engine prepares, the wrapper's name or None)``: ``ddp.module``
    under DDP, else the model itself (an FSDP2 model runs as it is)."""
    wrapper = wrapped_by(model)
    if wrapper is None:
        return model, None
    if wrapper[0] == DDP:
        return model.get_submodule("module"), DDP
    return model, wrapper[0]


@contextlib.contextmanager
def _no_stats() -> Iterator[TwoLevelStats | None]:
    yield None


def position_children(block: nn.Module) -> list[str]:
    """The children of ``block`` worth cutting along the sequence: those with at least two
    parametrized layers (an MLP, an attention module: the probe tells which work position
    by position); a lone linear or norm keeps nothing inside to save."""
    return [n for n, c in block.named_children()
            if sum(1 for m in c.modules() if m._parameters) >= 2]  # fmt: skip


def by_position(block: nn.Module, fragments: int) -> nn.Module:
    """A copy of ``block`` (sharing its tensors) whose children with at least two
    parametrized layers run in ``fragments`` pieces of the sequence where the probe finds
    them position-wise (:class:`_ByPosition`); ``block`` itself when it has none."""
    picked = position_children(block)
    if not picked:
        return block
    new = share_copy(block)
    for n in picked:
        new.set_submodule(n, _ByPosition(new.get_submodule(n), fragments=fragments))
    return new


class _ByPosition(Wrapper):
    """A child of a checkpointed block run in pieces of its sequence (dimension 1), where
    the first call's probe finds it position-wise; as written where not."""

    def __init__(self, inner: nn.Module, *, fragments: int) -> None:
        super().__init__(inner)
        self.__dict__["fragmenter"] = Fragmenter([inner], fragments=fragments, dim=1)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        frag: Fragmenter = self.__dict__["fragmenter"]
        return frag(self.inner, self.inner, *args, **kwargs)


class _Segment:
    """Consecutive blocks run as one function (what ``checkpoint`` recomputes)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.blocks = blocks

    def __call__(self, *xs: object) -> object:
        out: object = self.blocks[0](*xs)
        for block in self.blocks[1:]:
            out = block(out)
        return out
