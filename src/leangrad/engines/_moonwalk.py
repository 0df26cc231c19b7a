"""``moonwalk``: exact gradients by a forward sweep of vector–inverse-Jacobian products.

Moonwalk v1 (Krylov et al., Algorithm 1) and v2 (Krylov, Karamzade, Fox,
AISTATS 2026, section 4, eqs. (8)–(10)). For a chain ``head(f_L ∘ … ∘ f_1(stem(x)))``
of submersive layers, given the input cotangent h₀ = ∂J/∂x₀,

    h_i = vijp(f_i, x_{i−1}, h_{i−1}) = h_{i−1} (∂x_i/∂x_{i−1})⁺      (9)
    g_i = h_i ∂x_i/∂θ_i                                               (10)

recover every parameter gradient in one forward sweep (Phase III), handing
each g_i to ``on_grad`` at once. h₀ comes from:

- ``mode="mixed"`` (default): Phase I runs the chain storing only each layer's
  *minimal residual* (e.g. 1 bit per LeakyReLU element, nothing for a conv);
  Phase II pulls the head's cotangent back through those residuals with
  ``vjp_input`` only — no parameter gradients, so nothing else is kept.
- ``mode="pure"``: forward-mode, one jvp per input coordinate (vmapped in
  chunks) — no residuals at all, time growing with the input size.

``fragment=`` admits non-submersive layers (v2 section 5.1, Appendix 10,
Algorithm 3): Phase II keeps part of their output cotangent — ``"full"``: all of
it (cotangent checkpointing, any layer); an int B: only the k−1 slices that seed
every block of B positions of a fragmental layer (e.g.
:class:`~leangrad.layers.FragmentalConv1d`), from which Phase III rebuilds the
rest of every block, all blocks at once, exactly.

``segments=`` adds activation checkpointing to Phase I/II (v2 Appendix 11,
"Moonwalk + checkpoint"): only segment inputs are kept and each segment's
residuals are recomputed when Phase II reaches it.

The stem and the head are differentiated by autograd: the head during Phase
I/II (its graph lives only until h_L exists), the stem after Phase II from a
replay of its forward (same RNG state), which also gives Phase III its input x₀ —
so Phase I keeps nothing but the residuals. Chain layers must be deterministic
functions of their input (no dropout): Phase III recomputes them.

Precision: Phase III rebuilds h_i from h₀ as stored, and a LeakyReLU's vijp divides by
its slope where x ≤ 0 only, so after channel-mixing layers the rounding error of h₀
comes back amplified by about Π √(1/slope) (estimate; worst case Π 1/slope): in float32
through deep LeakyReLU chains the gradient can lose most of its digits. Mixed mode
therefore keeps Phase II's own output cotangent at the few small layers
``leangrad.layers._base.precision_keep_points`` names (measured in ``docs/layers.md``:
back to autograd's error for a few percent of h₁'s bytes). Pure mode has no backward
pass to keep from: it emits a :class:`~leangrad.layers._base.PrecisionWarning` (once per
condition) when the estimate exceeds 256x autograd's error and 3e-5; the fixes: float64,
a slope closer to 1, mode="mixed", or the ``checkpoint`` engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.func import jvp, vmap

from .. import _errors as errors
from ..layers._base import (
    NOT_SUBMERSIVE,
    ChainLayer,
    FragmentalLayer,
    NotSubmersiveError,
    chain_dtype,
    precision_keep_points,
    warn_vijp_precision,
)
from ..layers._chain import Chain
from ._base import LossFn, OnGrad, PlanOffer, PlanOrder, StepResult, check_loss, run_forward
from ._catalog import register
from ._chain_run import (
    LAYER_ERROR,
    ChainEngine,
    GradSink,
    StemRun,
    chain_of,
    head_backward,
    refuse_random_layers,
)
from ._contract import RngReplay, batch_coupling, forward_end, random_module, used_parameters
from ._dropout import DropoutTape
from .checkpoint._engine import split_segments

__all__ = ["NEEDS_FRAGMENT", "NO_FRAGMENT_RULE", "Moonwalk", "Seed"]

BAD_MODE = "mode must be 'mixed' or 'pure', got {value!r}"
BAD_FRAGMENT = (
    "fragment must be None, 'full' or a block size (an int ≥ 1), got {value!r}"
)
FRAGMENT_NEEDS_MIXED = (
    "fragment applies to mode='mixed' only: the cotangent fragments are taken during "
    "Phase II's backward pass, which mode='pure' does not run"
)
NEEDS_FRAGMENT = (
    "{layer} is not submersive (its Jacobian has no right-inverse) but supports fragmental "
    "checkpointing: run moonwalk with fragment=B (a block size ≥ its kernel size) to keep "
    "the cotangent slices that seed each block, or fragment='full'"
)
NO_FRAGMENT_RULE = (
    "{layer} is not submersive and has no fragment rule, so fragment={block} cannot "
    "rebuild its output cotangent; use fragment='full' to keep its whole output cotangent "
    "in Phase II, or a fragmental layer such as leangrad.layers.FragmentalConv1d"
)
STEM_CHUNKS_COUPLED = (
    "stem_chunks={chunks} runs the {where} on chunks of the batch, which is exact only "
    "when it treats examples independently and deterministically, but it has {module} "
    "in training mode; use stem_chunks=1 (or put that module in eval mode)"
)
STEM_CHUNKS_UNUSED = (
    "stem_chunks did not apply (one chunk): {why}; the batch-chunked stem of the h1 seed "
    "(v2 section 4.3) needs a mixed-mode chain whose first layer's vijp ignores its input "
    "and a stem that takes no gradient (e.g. parameter-free, or frozen)"
)
RANDOM_DRAW = "a random draw (such as F.dropout) that no module type shows"
AUTO_STEM_CHUNKS = 4
"""``stem_chunks="auto"``: the measured best of the ``moonwalk-v2-cnn`` suite."""
AUTO_ONE_CHUNK = (
    "stem_chunks='auto' used 1 chunk: the {where} has {module} in training mode, so running "
    "it on chunks of the batch would change the gradient (eval mode allows chunks)"
)
PER_EXAMPLE_COUPLED = (
    "per_example=True pushes one input direction for all examples at once, which is "
    "exact only when the chain layers treat examples independently, but chain layer "
    "{index} has {module} in training mode; use per_example=False"
)
PURE_BUFFERS = (
    "mode='pure' runs the chain and head under forward-mode transforms that cannot "
    "update running statistics once per step, but {where} has {module} in training mode; "
    "use mode='mixed' (or put that module in eval mode)"
)


@dataclass
class Seed:
    """What seeding hands Phase III (Moonwalk v1 Algorithm 1's input cotangent, or v2
    section 4.3's alternative seed h₁).

    ``state = [x_s, h_s]`` (the input and output cotangent of layer ``start`` − 1, x₀ and
    h₀ when ``start`` is 0) and ``kept`` (what Phase II kept of the output cotangents of
    layers ``start``, ``start`` + 1, …) belong to Phase III, which empties them as it
    goes, so each is freed once used: nothing else may hold them.
    """

    loss: torch.Tensor
    """The step's loss J (detached)."""
    start: int
    """The first chain layer Phase III runs: 0 or 1 (layer 0 done while seeding)."""
    state: list[torch.Tensor]
    kept: list[Any]
    info: dict[str, Any]
    """``StepResult.info`` entries of the seeding (kept bytes, stem chunks)."""
    head_rng: RngReplay | None = None
    """Pure mode without ``per_example``: rewinds the RNG to where the head's runs under
    forward mode began, so that its backward after Phase III draws the same masks."""


@dataclass(frozen=True)
class _Run:
    """What the phases of one step share: the stem's run (and through it the chain), the
    loss function, and where the parameter gradients go."""

    stem: StemRun
    loss_fn: LossFn
    sink: GradSink

    @property
    def chain(self) -> Chain:
        return self.stem.chain

    def head_backward(self, engine: str, x_last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and h_L, the head run by autograd from the chain's output x_L."""
        return head_backward(engine, self.chain, x_last, self.loss_fn, self.sink)


@register("moonwalk")
class Moonwalk(ChainEngine):
    """Moonwalk on a :class:`~leangrad.Chain` of submersive layers; exact gradients.

    Args:
        mode: ``"mixed"`` — h₀ by a backward pass through minimal residuals
            (memory O(M_x·L + M_θ), time ≈ backprop + one forward);
            ``"pure"`` — h₀ by forward mode, one jvp per input coordinate
            (no residuals; time grows with the input size).
        segments: mixed mode only. ``None`` keeps every layer's residual;
            an int or ``"sqrt"`` keeps only segment inputs in Phase I and
            recomputes a segment's residuals when Phase II reaches it.
        chunk_size: pure mode: input directions pushed through at once (vmap).
        per_example: pure mode: push each input coordinate for all examples of
            the batch at once. Valid only when the chain layers treat examples
            independently (no BatchNorm in training mode inside them); it divides
            the number of jvps by the batch size.
        fragment: ``None`` — every chain layer must be submersive; ``"full"`` — a
            non-submersive layer's whole output cotangent is kept in Phase II
            (cotangent checkpointing; any layer); an int B — fragmental layers
            keep only the first k−1 positions of every block of B positions of
            their output cotangent and Phase III rebuilds the rest by eq. (20)
            (Algorithm 3): (k−1)/B of the cotangent stored, B−k+1 sequential
            steps per layer. Mixed mode only.
        stem_chunks: when the first chain layer's vijp ignores its input (a conv)
            and the stem has no trainable parameters, Phase II stops at h₁ (the
            first layer's output cotangent; v2 section 4.3's "alternative seed") and
            Phase III rebuilds x₀ only to form g₁ — in this many batch chunks, so the
            full-resolution x₀ never lives whole. Chunks > 1 require the stem and the
            first layer to treat examples independently and the stem to be
            deterministic: an int > 1 is refused otherwise. ``"auto"`` (default) uses
            4 chunks where that holds (the measured best of ``moonwalk-v2-cnn``: peak
            0.41x backprop's instead of 0.83x) and 1 where it does not, saying why in
            ``StepResult.info["stem_chunks_note"]``.

    Trade-off (v2 Table 1): same time order as backprop, one extra forward
    (Phase III recomputes activations); memory of residuals that are often
    16–32× smaller than activations, and parameter gradients can be applied
    and freed layer by layer through ``on_grad``.
    """

    exact = True
    plan_offers = tuple(PlanOffer("moonwalk", opts, PlanOrder.CHAIN)
                        for opts in ({}, {"segments": "sqrt"}, {"fragment": "full"}))  # fmt: skip
    """On a :class:`~leangrad.Chain`: per layer, in √L segments, and with full fragments."""

    def __init__(
        self,
        *,
        mode: Literal["mixed", "pure"] = "mixed",
        segments: int | Literal["sqrt"] | None = None,
        chunk_size: int = 16,
        per_example: bool = False,
        stem_chunks: int | Literal["auto"] = "auto",
        fragment: int | Literal["full"] | None = None,
    ) -> None:
        if mode not in ("mixed", "pure"):
            raise ValueError(BAD_MODE.format(value=mode))
        if fragment is not None and fragment != "full" and (
            not isinstance(fragment, int) or isinstance(fragment, bool) or fragment < 1
        ):
            raise ValueError(BAD_FRAGMENT.format(value=fragment))
        if fragment is not None and mode == "pure":
            raise ValueError(FRAGMENT_NEEDS_MIXED)
        super().__init__(
            mode=mode,
            segments=segments,
            chunk_size=chunk_size,
            per_example=per_example,
            stem_chunks=stem_chunks,
            fragment=fragment,
        )
        self.fragment = fragment
        self.stem_chunks: int | Literal["auto"] = (
            "auto" if stem_chunks == "auto" else self._positive_int("stem_chunks", stem_chunks)
        )
        if segments is not None and segments != "sqrt":
            self._positive_int("segments", segments)
        if segments is not None and mode == "pure":
            raise ValueError("segments applies to mode='mixed' only (pure mode stores nothing)")
        self.mode = mode
        self.segments = segments
        self.chunk_size = self._positive_int("chunk_size", chunk_size)
        self.per_example = per_example

    def _layers(self, model: nn.Module) -> tuple[Chain, list[ChainLayer]]:
        chain = chain_of(model, self.label)
        layers = chain.rule_layers(self.label)
        for i, layer in enumerate(layers):
            if layer.submersive or self.fragment == "full":
                continue
            block = self.fragment  # None or a block size here
            if not isinstance(block, int) or not isinstance(layer, FragmentalLayer):
                template = (
                    NO_FRAGMENT_RULE if block is not None
                    else NEEDS_FRAGMENT if layer.fragmental
                    else NOT_SUBMERSIVE
                )  # fmt: skip
                msg = template.format(layer=layer._describe(), block=block)
                raise NotSubmersiveError(LAYER_ERROR.format(index=i, error=msg))
            layer.check_fragment(block)
        return chain, layers

    @property
    def _reruns_head(self) -> bool:
        return self.mode == "pure"  # the head runs under forward mode, then for its backward

    @staticmethod
    def _chunk_blocker(chain: Chain, layers: list[ChainLayer]) -> tuple[str, str] | None:
        """``(where, module)`` of the first module that forbids running the stem in batch
        chunks (couples examples, or draws random numbers), else ``None``."""
        for where, mod in (("stem", chain.stem), ("first chain layer", layers[0])):
            found = batch_coupling(mod) or random_module(mod)
            if found is not None:
                return where, found
        return None

    def _chunks(self, chain: Chain, layers: list[ChainLayer]) -> tuple[int, dict[str, Any]]:
        """The stem chunks the h₁ seed uses, and what ``info`` says about the choice."""
        if self.stem_chunks != "auto":
            return self.stem_chunks, {"stem_chunks": self.stem_chunks}
        found = self._chunk_blocker(chain, layers)
        if found is None:
            return AUTO_STEM_CHUNKS, {"stem_chunks": AUTO_STEM_CHUNKS}
        note = AUTO_ONE_CHUNK.format(where=found[0], module=found[1])
        return 1, {"stem_chunks": 1, "stem_chunks_note": note}

    def _preconditions(self, chain: Chain, layers: list[ChainLayer], seed_h1: bool) -> None:
        """The documented preconditions of the options, enforced (a silent ~5% gradient
        error otherwise, e.g. ``stem_chunks`` with a training-mode BatchNorm stem)."""
        refuse_random_layers(self.label, layers)
        if seed_h1 and self.stem_chunks != "auto" and self.stem_chunks > 1:
            blocker = self._chunk_blocker(chain, layers)
            if blocker is not None:
                where, module = blocker
                raise errors.EngineInputError(
                    STEM_CHUNKS_COUPLED.format(chunks=self.stem_chunks, where=where, module=module)
                )
        if self.mode == "pure":
            if self.per_example:
                for i, layer in enumerate(layers):
                    found = batch_coupling(layer)
                    if found is not None:
                        raise errors.EngineInputError(
                            PER_EXAMPLE_COUPLED.format(index=i, module=found)
                        )
            for where, mod in (("the chain", chain.layers), ("the head", chain.head)):
                found = batch_coupling(mod)
                if found is not None:
                    raise errors.EngineInputError(PURE_BUFFERS.format(where=where, module=found))

    def _kept(self, layer: ChainLayer, h_out: torch.Tensor) -> Any:
        """What Phase II keeps of a layer's output cotangent (None for submersive layers)."""
        if layer.submersive:
            return None
        if isinstance(layer, FragmentalLayer) and isinstance(self.fragment, int):
            return layer.fragments(h_out, self.fragment)
        return h_out  # fragment="full" (``_layers`` refused any other non-submersive layer)

    def _precision_keep(self, layers: list[ChainLayer], inputs: tuple[torch.Tensor, ...]
                        ) -> set[int]:  # fmt: skip
        """Mixed mode: the chain positions whose output cotangent Phase II keeps for Phase
        III, so that no run of vijps amplifies rounding errors past 1/16 of the
        :class:`~leangrad.layers._base.PrecisionWarning` limit (float32 through deep
        LeakyReLU chains; measured in ``docs/layers.md``)."""
        dtype = chain_dtype(layers, inputs)
        if self.mode != "mixed" or dtype is None:
            return set()
        return set(precision_keep_points(layers, dtype))

    def _kept_info(self, kept: list[Any]) -> dict[str, Any]:
        """``StepResult.info`` entry: bytes Phase II keeps for Phase III (``fragment=``)."""
        kept_any = any(k is not None for k in kept)
        return {"kept_cotangent_bytes": _storage_bytes(kept)} if self.fragment or kept_any else {}

    def _out_cotangent(
        self, layer: ChainLayer, x: torch.Tensor | None, h: torch.Tensor, kept: Any
    ) -> torch.Tensor:
        """h_i from h_{i−1}: the vijp (eq. 9), the kept cotangent, or the rebuilt one."""
        if layer.submersive:  # x is None only where the vijp ignores it (vijp_needs_input)
            # (kept: Phase II's own cotangent, where the vijps would lose digits)
            return layer.vijp(cast(torch.Tensor, x), h) if kept is None else kept
        if isinstance(layer, FragmentalLayer) and isinstance(self.fragment, int):
            return layer.vijp_fragments(x, h, kept, self.fragment)
        return cast(torch.Tensor, kept)  # fragment="full": the whole cotangent was kept

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        chain, layers = self._layers(model)
        sink = GradSink(params, on_grad)
        stem = StemRun(chain, inputs, self.label)
        seed_h1 = (
            self.mode == "mixed" and bool(layers) and not layers[0].vijp_needs_input
            and not sink.of(chain, chain.stem) and not stem.input_grads
        )  # fmt: skip
        self._preconditions(chain, layers, seed_h1)
        keep = self._precision_keep(layers, inputs)
        warn_vijp_precision(self.label, layers, inputs, kept=keep)  # pure mode: no keeping
        if self.mode == "pure":  # forward mode sees no graph: refuse a model-free loss first
            # (a real forward: fake tensors fail on a layer's .item(), e.g. rad's seed draw,
            # and the engine's failure would hide which layer cannot run under forward mode)
            used_parameters(
                model, inputs, loss_fn, params, lambda fn, xs: run_forward(self.label, fn, xs),
                real=True,
            )
        run = _Run(stem, loss_fn, sink)
        seed = self._seed(run, layers, seed_h1=seed_h1, keep=keep)
        x_last = self._phase_three(layers[seed.start :], seed, sink)
        if self.mode == "pure" and not self.per_example:
            # Forward mode gave h₀ but no head gradients: the head's backward from x_L,
            # drawing the masks its runs under forward mode drew.
            assert seed.head_rng is not None
            seed.head_rng.before_run()
            run.head_backward(self.label, x_last)
        info = dict(seed.info)
        if not seed_h1 and self.stem_chunks != 1:  # say why chunking the stem did not apply
            why = self._no_h1_seed(layers, bool(sink.of(chain, chain.stem)), stem.input_grads)
            info.update(stem_chunks=1, stem_chunks_note=STEM_CHUNKS_UNUSED.format(why=why))
        return self._result(seed.loss, **info)

    def _no_h1_seed(self, layers: list[ChainLayer], stem_params: bool, input_grads: bool) -> str:
        """Why the h₁ seed (and with it ``stem_chunks``) does not apply to this step."""
        if self.mode != "mixed":
            return "mode='pure' forms h0 by forward mode"
        if not layers or layers[0].vijp_needs_input:
            return "the first chain layer's vijp needs its input x0"
        if stem_params:
            return "the stem has parameters to train, whose gradient needs h0 whole"
        assert input_grads, "the h1 seed's four conditions"
        return "an input wants a gradient, which needs h0 whole"

    # -- seeding: the loss and the cotangent Phase III starts from ------------------
    def _seed(self, run: _Run, layers: list[ChainLayer], *, seed_h1: bool, keep: set[int]
              ) -> Seed:  # fmt: skip
        """The loss J and where Phase III starts. ``seed_h1``: :meth:`_seed_h1`. Otherwise
        h₀ = ∂J/∂x₀ by Phases I and II (mixed) or forward mode (pure) gives the stem its
        gradients, and Phase III starts at x₀, h₀ — or at x₁, h₁ when the first layer's
        vijp ignores x₀ (a conv): h₀ is then freed before x₀ is replayed."""
        if seed_h1:
            return self._seed_h1(run, layers, keep={i - 1 for i in keep if i})
        chain, stem, sink = run.chain, run.stem, run.sink
        head_rng = None
        if self.mode == "mixed":
            loss, h0, kept = self._phase_one_two(run, layers, [stem.take()], keep=keep)
            info = self._kept_info(kept)
        else:
            info = {}
            kept = [None] * len(layers)
            loss, h0, head_rng = self._pure_h0(run, layers, stem.take())
        if not layers or layers[0].vijp_needs_input:
            x0 = stem.backward(h0, sink)  # replayed: x0 was not kept meanwhile
            assert x0 is not None
            state = [x0, h0]
            del x0, h0  # Phase III owns them now and frees each as soon as it is used
            return Seed(
                loss=loss, start=0, state=state, kept=kept, info=info, head_rng=head_rng
            )
        # The first layer's vijp ignores x0 (a conv): take h1 from h0 and free h0
        # before x0 is replayed, so the two full-size tensors never coexist.
        stem.backward(h0, sink, keep=False, announce=False)
        h = self._out_cotangent(layers[0], None, h0, kept[0])
        del h0
        kept = kept[1:]  # Phase III must hold the only reference to the rest
        x = self._apply(layers[0], stem.replay(), h, sink)
        sink.announce(chain, chain.stem)  # only now: a step on the stem would change the replay
        state = [x, h]
        del x, h
        return Seed(loss=loss, start=1, state=state, kept=kept, info=info, head_rng=head_rng)

    def _seed_h1(self, run: _Run, layers: list[ChainLayer], *, keep: set[int]) -> Seed:
        """v2 section 4.3's alternative seed, when the first layer's vijp ignores x₀ and
        the stem takes no gradient: Phase II stops at h₁, and x₀ is rebuilt only to form
        g₁, in ``stem_chunks`` batch chunks, so the full-size x₀ never lives whole."""
        chain, stem, sink = run.chain, run.stem, run.sink
        chunks, chunk_info = self._chunks(chain, layers)
        # x1 = f1(x0) with x0 made chunk by chunk: the full-size x0 never lives whole.
        with torch.no_grad():
            x1, chunks, chunk_info = self._x1(stem, layers[0], chunks, chunk_info)
            handed = [x1]
            del x1  # Phase I takes the only reference and drops it once layer 2 has run
            loss, h1, kept = self._phase_one_two(run, layers[1:], handed, keep=keep)
        info = {**self._kept_info(kept), **chunk_info}
        x = self._first_layer(stem, layers[0], h1, sink, chunks=chunks)
        state = [x, h1]
        del x, h1  # Phase III owns them now and frees each as soon as it is used
        return Seed(loss=loss, start=1, state=state, kept=kept, info=info)

    def _x1(
        self, stem: StemRun, layer: ChainLayer, chunks: int, info: dict[str, Any]
    ) -> tuple[torch.Tensor, int, dict[str, Any]]:
        """x₁ = f₁(stem(x)), the stem run in ``chunks`` batch chunks; returns x₁ and the
        chunks and ``info`` that apply. A stem (or first layer) that draws random numbers
        the module check cannot see — ``F.dropout`` in a forward, a dropout that a
        transform turned into a traced function (fuzz finding F2) — moves the RNG
        on the first chunk: chunks would draw other masks than autograd's one run, so the
        stream is rewound and the batch run whole (``"auto"``) or the option refused."""
        ranges = stem.chunks(chunks)
        first = run_forward(self.label, layer, (stem.on_chunk(*ranges[0]),))
        if len(ranges) == 1:
            return first, chunks, info
        if stem.rng_moved():
            del first
            if self.stem_chunks != "auto":
                raise errors.EngineInputError(STEM_CHUNKS_COUPLED.format(
                    chunks=self.stem_chunks, where="stem or first chain layer",
                    module=RANDOM_DRAW))  # fmt: skip
            stem.rewind()
            x1 = run_forward(self.label, layer, (stem.on_chunk(0, ranges[-1][1]),))
            note = AUTO_ONE_CHUNK.format(where="stem or first chain layer", module=RANDOM_DRAW)
            return x1, 1, {"stem_chunks": 1, "stem_chunks_note": note}
        rest = [run_forward(self.label, layer, (stem.on_chunk(a, b),)) for a, b in ranges[1:]]
        return torch.cat([first, *rest]), chunks, info

    # -- Phase I + II: h0 through minimal residuals ------------------------------
    def _phase_one_two(
        self, run: _Run, layers: list[ChainLayer], handed: list[torch.Tensor], *,
        keep: Collection[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        """Loss, the cotangent of x₀ (the input of ``layers``) and what each layer keeps
        of its output cotangent for Phase III (``fragment=``; ``keep``: the whole one).

        x₀ comes as the one item of ``handed``, which this empties: the caller holds no
        reference, so x₀ is freed once the first layer has run (a local variable in the
        caller would keep a full-size activation alive through Phase II)."""
        n = len(layers)
        keep_all = self.segments is None  # else: keep segment inputs, recompute residuals
        if self.segments is None:
            groups = [range(i, i + 1) for i in range(n)]
        else:
            s = math.ceil(math.sqrt(n)) if self.segments == "sqrt" else self.segments
            groups = split_segments(n, s) if n else []
        residuals: list[Any] = [None] * n
        kept: list[Any] = [None] * n
        boundary: list[torch.Tensor | None] = [None] * len(groups)
        x = handed.pop()  # replayed from the stem for Phase III, not kept
        with torch.no_grad():
            for gi, group in enumerate(groups):
                if not keep_all:
                    boundary[gi] = x
                for i in group:
                    y = run_forward(self.label, layers[i], (x,))
                    if keep_all:
                        residuals[i] = layers[i].residual(x, y)
                    x = y
        loss, h = run.head_backward(self.label, x)
        del x
        with torch.no_grad():
            for gi in reversed(range(len(groups))):
                group = groups[gi]
                if not keep_all:  # recompute this segment's residuals from its input
                    xb = boundary[gi]
                    assert xb is not None
                    boundary[gi] = None
                    for i in group:
                        y = layers[i](xb)
                        residuals[i] = layers[i].residual(xb, y)
                        xb = y
                    del xb, y
                for i in reversed(group):
                    kept[i] = h if i in keep else self._kept(layers[i], h)
                    h = layers[i].vjp_input(residuals[i], h)
                    residuals[i] = None
        return loss, h, kept

    # -- pure mode: h0 by forward mode --------------------------------------------
    def _pure_h0(
        self, run: _Run, layers: list[ChainLayer], x0: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, RngReplay | None]:
        """Loss and h₀ by forward mode: one jvp per input coordinate (``per_example``: per
        coordinate of one example, for all examples at once, against h_L from the head).

        The modules run as they are, their parameters constants of the jvps (no graph is
        recorded): ``torch.func.functional_call`` would put plain tensors in place of the
        Parameters of a layer listed twice. Buffers are only read (``_preconditions``
        refuses training-mode BatchNorm in pure mode). x₀ is taken in the standard layout:
        under vmap, a channels-last input makes normalisation layers clone in a layout
        vmap does not support. Without ``per_example``, the head (dropout included) runs
        in every chunk and again for its backward; each run starts from the RNG state of
        the first, so all draw the masks one autograd forward draws: the returned
        :class:`RngReplay` rewinds the stream before the head's backward. The masks are
        recorded on one real forward from x₀ in its own layout and replayed under the
        transforms (:class:`DropoutTape`): vmap would draw them in another memory layout
        (fuzz finding F1)."""
        x_own = x0
        x0 = x0.contiguous()

        def run_body(x: torch.Tensor) -> torch.Tensor:
            for layer in layers:
                x = layer(x)
            return x

        forward_end()
        if self.per_example:
            with torch.no_grad():
                x_last = run_body(x0)
            loss, h_last = run.head_backward(self.label, x_last)
            del x_last
            per = x0[0].numel()

            def along(v: torch.Tensor) -> torch.Tensor:
                t = v.reshape(1, *x0.shape[1:]).expand_as(x0)
                tout = jvp(run_body, (x0,), (t,))[1]
                return (tout * h_last).flatten(1).sum(1)  # one value per example

            cols = torch.cat(self._chunked(along, per, x0))
            return loss, cols.t().reshape(x0.shape), None

        def full(x: torch.Tensor) -> torch.Tensor:
            return check_loss(run.loss_fn(run.chain.head(run_body(x))), needs_graph=False)

        tape = DropoutTape(self.label)
        cuda = [x0.device] if x0.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            tape.recording(lambda fn, xs: fn(*xs))(full, (x_own,))
        del x_own

        def along_full(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with tape.replaying():
                value, slope = jvp(full, (x0,), (v.reshape(x0.shape),))[:2]
            return value, slope  # (J, ∂J/∂x₀ · v)

        rng = RngReplay([x0])
        outs = self._chunked(along_full, x0.numel(), x0, rng=rng)
        loss = outs[0][0][0].clone()  # the primal J, the same along every direction
        h0 = torch.cat([dj for _, dj in outs]).reshape(x0.shape)
        return loss, h0, rng

    def _chunked(
        self, fn: Callable[[torch.Tensor], Any], n: int, like: torch.Tensor, *,
        rng: RngReplay | None = None,
    ) -> list[Any]:  # fmt: skip
        """``fn(e_j)`` over the n one-hot directions, vmapped ``chunk_size`` at a time: one
        output per chunk, stacked along its first dimension. With ``rng``, every chunk
        starts from the RNG state of the first (the same dropout masks in all)."""
        batched = vmap(fn, randomness="same")
        outs = []
        for start in range(0, n, self.chunk_size):
            k = min(self.chunk_size, n - start)
            eye = torch.zeros(k, n, dtype=like.dtype, device=like.device)
            eye[torch.arange(k), torch.arange(start, start + k)] = 1
            if rng is not None:
                rng.before_run()
            with torch.no_grad():  # the parameters are constants here: record no graph
                outs.append(batched(eye))
            if rng is not None:
                rng.after_run()
        return outs

    # -- Phase III: the forward sweep ---------------------------------------------
    @staticmethod
    def _apply(layer: ChainLayer, x: torch.Tensor, h: torch.Tensor, sink: GradSink) -> torch.Tensor:
        """y = f(x) and g = h ∂y/∂θ (eq. 10), handed to ``.grad`` and ``on_grad`` at once."""
        with torch.no_grad():
            y, grads = layer.forward_vjp_params(x, h)
        sink.deliver(layer, grads)
        return y

    def _first_layer(
        self, stem: StemRun, layer: ChainLayer, h1: torch.Tensor, sink: GradSink, *, chunks: int
    ) -> torch.Tensor:
        """x₁ and g₁ from h₁, replaying x₀ in ``chunks`` batch chunks."""
        if chunks == 1:
            return self._apply(layer, stem.replay(), h1, sink)
        ys: list[torch.Tensor] = []
        total: dict[str, torch.Tensor] = {}
        for a, b in stem.chunks(chunks):
            with torch.no_grad():
                x0 = stem.on_chunk(a, b)
                y, grads = layer.forward_vjp_params(x0, h1[a:b])
            del x0
            ys.append(y)
            for name, g in grads.items():
                total[name] = total[name] + g if name in total else g
        sink.deliver(layer, total)
        return torch.cat(ys)

    def _phase_three(self, layers: list[ChainLayer], seed: Seed, sink: GradSink) -> torch.Tensor:
        """Algorithm 1's loop: h_i = vijp(x_{i−1}, h_{i−1}) (eq. 9), then g_i (eq. 10), over
        the layers from ``seed.start`` on; returns x_L.

        ``seed.state = [x, h]`` and ``seed.kept`` are emptied: the caller must hold no other
        reference, so each x_{i−1}, h_{i−1} and kept fragment is freed once used.
        """
        x, h = seed.state
        seed.state.clear()
        kept = seed.kept
        for i, layer in enumerate(layers):
            with torch.no_grad():
                h = self._out_cotangent(layer, x, h, kept[i])
            kept[i] = None
            x = self._apply(layer, x, h, sink)
        return x


def _storage_bytes(kept: list[Any]) -> int:
    """Bytes of the distinct storages behind the kept cotangents (what Phase II holds)."""
    seen: dict[int, int] = {}
    for t in kept:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
