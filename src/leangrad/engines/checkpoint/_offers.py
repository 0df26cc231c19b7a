"""The candidates checkpointing offers :func:`leangrad.plan` (its
:meth:`~leangrad.engines._base.Engine.plan_candidates`): per block, ``"auto"``, ``"sqrt"``
and fewer segments for a sequence; every block, fewer blocks and the fx code of blocks for
a model run as written; the module transforms under checkpointing; blocks recomputed in
fragments of the batch (every block, or a CNN's largest few), a CNN's stem beside its
blocks, two levels, the stages that group a U-Net's blocks (its skips then cross stage
boundaries only); fused recurrent modules in time chunks (Chen et al. 2016, "Training
Deep Nets with Sublinear Memory Cost")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...loss import Head, PerExample, final_linear
from .._base import PlanOffer, PlanOrder
from .._blocks import Blocks
from ._batchnorm import is_bn_only
from ._fragments import split_reason
from ._time_chunks import fused_recurrent

__all__ = ["BN_EVERY", "BN_PASSES", "FRAGMENTS", "LARGEST_BLOCKS", "MICRO_BATCHED", "TIME_CHUNKS",
           "TRACED", "TWO_LEVEL_BLOCKS", "all_but_last", "block_offers", "fragment_offers",
           "stage_modules", "stem_modules", "time_chunk_offers"]  # fmt: skip

FRAGMENTS = (2, 4, 8)
"""Fragment counts the planner tries for checkpointed blocks (those up to the batch's
examples, where the loss says how many)."""
LARGEST_BLOCKS = (1, 2, 3)
"""``fragment_blocks=n`` the planner tries beside a CNN's stem: the ``n`` checkpointed
blocks that save the most inside run in fragments (fewest first), sized at the step."""
TWO_LEVEL_BLOCKS = 4
"""Two-level checkpointing (``levels=2``) is a candidate where at least this many blocks
were found: below it, ⌈√L⌉ outer segments keep about as many boundaries as one level."""
TIME_CHUNKS = (2, 4, 8, 16)
"""Time chunks the planner tries for fused recurrent modules."""

Offers = list[PlanOffer]
Item = tuple[str, dict[str, Any]]
BACKPROP: Item = ("backprop", {})
"""Beats checkpointing without fragments or tracing where it fits: the same step, minus
the recomputation."""


MICRO_BATCHED = ("runs the same pieces of the batch without recomputing a block (0.56-0.86× "
                 "this step's time on every zoo model timed, CPU and CUDA)")
"""Why ``accumulate(micro_batches=k)`` beats blocks recomputed in ``fragments=k``
(:attr:`~leangrad.engines._base.PlanOffer.beaten_why`). Both run every block's forward and
backward on k pieces of the batch; the fragments also run the whole forward once more
without gradients, and the layers outside the blocks on the whole batch instead of its
pieces. Timed side by side, accumulate's step over the fragments' was 0.56-0.86 on every
zoo model where both ran (quick and full size on the CPU: GPT, BERT, Llama, ViT, LSTM and
GRU LMs, U-Net, the GPT at vocabulary 50,257; quick on CUDA; ``results/*zoo.json``), and
0.62-0.78 in each of 45 pairs timed by full-size plans (``results/full-size/plan-wall-*``).
Micro-batches are offered only where they are exact; where they do not fit, the fragments
are measured as before ( fragments are for where micro-batching cannot go)."""

BN_PASSES = ("fragments one block fewer: each block with BatchNorm in fragments is recomputed "
             "once per pass over its fragments, 2-3 times, whole once (1.04-1.10× this step's "
             "time, full-size ResNet-18)")
"""Why ``fragment_blocks=n`` beats ``fragment_blocks=n+1`` where every block holds a
training-mode BatchNorm (:attr:`~leangrad.engines._base.PlanOffer.beaten_why`): the
block that one more fragments is recomputed whole once under ``n``, and once per pass over
its fragments under ``n+1`` (:mod:`leangrad.engines.checkpoint._batchnorm`: two passes and a last
one on a ResNet basic block) — the same work with two more recomputations of it. Timed side
by side in four full-size ResNet-18 plans, ``fragment_blocks=3`` over ``2`` was 1.04-1.10
(8 pairs, 4 and 8 fragments; ``results/full-size/plan-wall-*``), and a tie-break by its peak
(1 MiB lower) had chosen it."""


BN_EVERY = ("fragments only the few largest blocks, where this fragments every block and each "
            "block with BatchNorm in fragments is recomputed once per pass over them (1.20-1.35× "
            "this step's time, full-size ResNet-18)")
"""Why ``checkpoint(fragments=k)`` (every block in fragments) is beaten by a CNN's stem and
blocks with only its ``fragment_blocks=n`` largest blocks in ``k`` fragments, where every
block holds a training-mode BatchNorm (:attr:`~leangrad.engines._base.PlanOffer.
beaten_because`): :data:`BN_PASSES` for every block past the few largest, against one
recomputation of the stem. Timed side by side in nine full-size ResNet-18 plans, the
every-block row over a ``fragment_blocks`` row of the same count was 1.20-1.35× (29 pairs,
median 1.29; ``results/full-size/plan-wall-*``), and it was never chosen."""


TRACED = ("recomputes a strict part of its blocks without tracing them (every block as fx code "
          "took 0.96-1.16× the time of the fastest plain checkpointing of fewer blocks, median "
          "1.065×, in 29 full-size plans)")
"""Why ``checkpoint(trace=True)`` (every block recomputed as fx code, its intermediates freed
at their last use) is beaten by plain checkpointing of the same or fewer blocks
(:attr:`~leangrad.engines._base.PlanOffer.beaten_because`): the trace can only lower the
peak, and it recomputes every block. Timed beside the fastest plain row of fewer blocks in
29 full-size plans at ½ (GPT, BERT, ViT, U-Net; ``results/full-size/plan-wall-*.txt``), it
took 0.96-1.16× its time (median 1.065×), and it was never chosen; its lower peak (on the
GPT 282 MiB against 435 MiB) is what a budget those rows miss needs, and there it is run."""


def _offers(items: list[Item], beaten: dict[int, list[Item]] | None = None,
            why: dict[int, str] | None = None,
            because: dict[int, list[tuple[str, dict[str, Any], str]]] | None = None,
            ) -> Offers:  # fmt: skip
    """``items`` as offers; ``beaten``: item index -> the offers that beat it
    (:attr:`~leangrad.engines._base.PlanOffer.beaten_by`; one not offered beats nothing),
    ``why``: item index -> why, where they are not a strict part of its work;
    ``because``: item index -> :attr:`~leangrad.engines._base.PlanOffer.beaten_because`."""
    by, said, also = beaten or {}, why or {}, because or {}
    return [PlanOffer(name, options, PlanOrder.BLOCKS,
                      tuple(b for j, b in enumerate(by.get(i, [])) if b not in by[i][:j]),
                      said.get(i), tuple(also.get(i, ())))
            for i, (name, options) in enumerate(items)]  # fmt: skip


def all_but_last(found: Blocks) -> list[str] | None:
    """The blocks PyTorch's per-block loop checkpoints — every one but the last — where
    ``blocks=`` can name them (a model run as written, with at least two blocks), else
    ``None``. On the zoo's GPT the last block's recomputation lowers no peak and costs a
    block's forward."""
    if found.sequential or found.runner is not None or len(found.names) < 2:
        return None
    return list(found.names[:-1])


def block_offers(model: nn.Module, found: Blocks,
                 loss_fn: Callable[[Any], torch.Tensor] | None) -> Offers:  # fmt: skip
    """Checkpointing of the blocks found (and ``+fad``/``+bits`` under it), then
    :func:`fragment_offers`. In a model run as written, fewer blocks come first (fewest
    first), each beaten by those before it and ``checkpoint()`` (every block) by all of
    them: where fewer checkpointed blocks fit, recomputing more of them only adds work;
    and each is beaten by backprop (:data:`BACKPROP`)."""
    out: list[Item] = []
    beaten: dict[int, list[Item]] = {}
    if found.sequential:
        out += [("checkpoint", {}), ("checkpoint", {"segments": "auto"}),
                ("checkpoint", {"segments": "sqrt"}),
                ("checkpoint", {"segments": "auto", "trace": True})]  # fmt: skip
        # fewer segments than blocks: less recomputation where the budget allows it
        n = len(found.names)
        out += [("checkpoint", {"segments": k}) for k in (2, 3, 4) if k < n - 1]
        beaten.update({i: [BACKPROP] for i, (_, o) in enumerate(out) if "trace" not in o})
        out += [("checkpoint+fad", {"segments": "auto"}),
                ("checkpoint+bits", {"segments": "auto"})]  # fmt: skip
    elif found.runner is not None:  # an fx split: blocks= cannot name its blocks
        out += [("checkpoint", {}), ("checkpoint+fad", {}), ("checkpoint+bits", {})]
    else:
        # fewer checkpointed blocks: less recomputation where the budget allows it; n - 1
        # is PyTorch's per-block recipe (all_but_last)
        n = len(found.names)
        out += [("checkpoint", {"blocks": list(found.names[:m])})
                for m in sorted({max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4), n - 1}
                                - {n, 0})]  # fmt: skip
        beaten.update({i: [BACKPROP, *out[:i]] for i in range(len(out))})
        beaten[len(out)] = [BACKPROP, *out]
        out += [("checkpoint", {}), ("checkpoint+fad", {}), ("checkpoint+bits", {})]
        # blocks as fx code: intermediates freed at last use (measured: it may not pay).
        # Not offered again with blocks= naming every block found: checkpoint() finds the
        # same blocks (tests/test_plan_candidates.py), so it was the same step measured and
        # timed twice (a full-size BERT plan: two of its 27 candidates). Beaten by every
        # plain row above (TRACED): each recomputes a strict part of its blocks, untraced
        because = {len(out): [(n, o, TRACED) for n, o in out if n == "checkpoint"]}
        out += [("checkpoint", {"trace": True})]
        return _offers(out, beaten, None, because) + fragment_offers(model, found, loss_fn)
    return _offers(out, beaten) + fragment_offers(model, found, loss_fn)


def fragment_offers(model: nn.Module, found: Blocks,
                    loss_fn: Callable[[Any], torch.Tensor] | None) -> Offers:  # fmt: skip
    """Checkpointing with blocks recomputed in fragments of the batch, where some block
    can be split
    (:func:`leangrad.engines.checkpoint._fragments.split_reason`); under the loss head's
    chunked cross-entropy too where there is one."""
    if all(split_reason([found.modules[n]]) is not None for n in found.names):
        return []
    ks = [k for k in FRAGMENTS if not isinstance(loss_fn, PerExample) or k <= loss_fn.batch]
    head = isinstance(final_linear(model), Head)
    out: list[Item] = [("checkpoint", {"fragments": k}) for k in ks]
    # each beaten by as many micro-batches (offered where exact): MICRO_BATCHED says why
    beaten: dict[int, list[Item]] = {i: [("accumulate", {"micro_batches": k})]
                                     for i, k in enumerate(ks)}  # fmt: skip
    why = dict.fromkeys(beaten, MICRO_BATCHED)

    because: dict[int, list[tuple[str, dict[str, Any], str]]] = {}

    def add(item: Item, *by: Item) -> None:  # ``by``: offers that beat it (earlier ones)
        beaten[len(out)] = list(by)
        out.append(item)

    if head:
        out += [("checkpoint+chunked_ce", {"fragments": k}) for k in ks]
    stem = stem_modules(model, found)
    if stem:  # a ResNet's stem: conv, norm, at full size
        every = [*stem, *found.names]
        add(("checkpoint", {"blocks": every}), ("checkpoint", {}), BACKPROP)  # + the stem
        for k in ks:
            add(("checkpoint", {"blocks": every, "fragments": k}),
                ("checkpoint", {"fragments": k}))  # fmt: skip
        if not stage_modules(model, found):  # a U-Net's stages are offered below
            # where a few blocks at high resolution hold most activations (a ResNet's first
            # stage): only the largest in fragments (fewest first), the others whole
            # with BatchNorm in every block, each beaten by one block fewer in fragments,
            # and every block in as many fragments beaten by each (BN_EVERY)
            bn = all(is_bn_only([found.modules[n]]) for n in found.names)
            for k in ks[1:]:
                for i, n in enumerate(LARGEST_BLOCKS):
                    item: Item = ("checkpoint", {"blocks": every, "fragments": k,
                                                 "fragment_blocks": n})  # fmt: skip
                    if bn:
                        because.setdefault(ks.index(k), []).append((*item, BN_EVERY))
                    if bn and i:
                        why[len(out)] = BN_PASSES
                        fewer = {**item[1], "fragment_blocks": LARGEST_BLOCKS[i - 1]}
                        add(item, ("checkpoint", fewer))
                    else:
                        out.append(item)
    if len(found.names) >= TWO_LEVEL_BLOCKS and ks:  # boundaries: the floor under fragments
        # two levels recompute every block of one level, and each segment once more
        two: dict[str, Any] = {"levels": 2}
        one: dict[str, Any] = {}
        if stem:
            two["blocks"] = one["blocks"] = [*stem, *found.names]
        add(("checkpoint", two), ("checkpoint", one), ("checkpoint", {}), BACKPROP)
        add(("checkpoint", {**two, "fragments": ks[-1]}),
            ("checkpoint", {**one, "fragments": ks[-1]}))  # fmt: skip
        if head:
            add(("checkpoint+chunked_ce", {**two, "fragments": ks[-1]}),
                ("checkpoint+chunked_ce", {**one, "fragments": ks[-1]}))  # fmt: skip
    stages = stage_modules(model, found)
    if stages and ks:  # a U-Net: whole stages (and the head) recomputed in fragments
        every = _in_module_order(model, [*stages, *stem])
        for k in ks:  # beaten by as many micro-batches, as the blocks' fragments are
            why[len(out)] = MICRO_BATCHED
            add(("checkpoint", {"blocks": every, "fragments": k}),
                ("accumulate", {"micro_batches": k}))  # fmt: skip
        if len(every) >= TWO_LEVEL_BLOCKS:
            add(("checkpoint", {"levels": 2, "blocks": every, "fragments": ks[-1]}),
                ("checkpoint", {"blocks": every, "fragments": ks[-1]}))  # fmt: skip
    return _offers(out, beaten, why, because)


def stage_modules(model: nn.Module, found: Blocks) -> list[str]:
    """The found blocks with each block that a *stage* holds replaced by that stage, or
    ``[]`` where no block has one: a stage is the nearest module above a block, below the
    model, that is no ``nn.ModuleList`` / ``nn.Sequential`` and runs a ``forward`` of its
    own (the zoo's :class:`~leangrad.zoo.UNetStage`, a diffusers down or up block). A
    U-Net's skips and resampling live in its stages: with the stages as blocks, the tensors
    kept between them are the low-resolution ones and the skips, and fragments of the
    batch cover the rest."""
    if found.sequential or found.runner is not None:
        return []
    subs = dict(model.named_modules(remove_duplicate=False))
    out: list[str] = []
    for name in found.names:
        stage = name
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            above = subs.get(".".join(parts[:i]))
            if above is not None and _own_forward(above):
                stage = ".".join(parts[:i])  # the outermost one, below the model
        if stage not in out:
            out.append(stage)
    return out if out != list(found.names) else []


def _own_forward(module: nn.Module) -> bool:
    """A module that computes (its class defines ``forward``), not a container."""
    if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return False
    return type(module).forward is not nn.Module.forward


def _in_module_order(model: nn.Module, names: list[str]) -> list[str]:
    order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return sorted(names, key=lambda n: order.get(n, len(order)))


def stem_modules(model: nn.Module, found: Blocks) -> list[str]:
    """Top-level children of a model run as written that hold no block and at least two
    parametrized layers (a CNN's stem: conv and norm at the highest resolution), which
    checkpointing beside the blocks can recompute too."""
    if found.sequential or found.runner is not None:
        return []
    out = []
    for name, child in model.named_children():
        holds = any(b == name or b.startswith(f"{name}.") for b in found.names)
        if not holds and sum(1 for m in child.modules() if m._parameters) >= 2:
            out.append(name)
    return out


def time_chunk_offers(model: nn.Module) -> Offers:
    """Fused recurrent modules (one op each, no block inside) checkpointed along time, each
    beaten by backprop (:data:`BACKPROP`: the same step, minus the recomputation of each
    chunk)."""
    if not fused_recurrent(model):
        return []
    return [PlanOffer("checkpoint", {"time_chunks": k}, PlanOrder.TIME_CHUNKS, (BACKPROP,))
            for k in TIME_CHUNKS]  # fmt: skip
