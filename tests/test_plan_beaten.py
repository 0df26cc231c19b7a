"""A candidate that does all of another's work and more — the same checkpointing of more
blocks, or of the same blocks in two levels, or time chunks of a fused recurrent module
beside the same step without them — is not run where that other one fits
(:attr:`leangrad.engines._base.PlanOffer.beaten_by`): it cannot be faster. Checked on the
offers of every frozen model (each beaten row's beater comes first and differs from it only
by recomputing less), and through ``leangrad.plan`` on the tiny GPT, counting steps."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

import leangrad
import leangrad.planner._plan as planner
from leangrad.engines._base import PlanOffer
from leangrad.engines._blocks import blocks
from leangrad.engines.checkpoint._batchnorm import is_bn_only
from leangrad.engines.checkpoint._offers import BN_EVERY, BN_PASSES, MICRO_BATCHED, TRACED
from leangrad.measure import Timing
from leangrad.planner._measure import BEATEN, BEATEN_BECAUSE
from leangrad.planner._plan import MORE_PIECES, PIECES, _offered, beaters_first, coarser

from .plan_candidate_models import MODELS, loss
from .shared_models import tiny_gpt_step

B1, B2, B3 = (f"checkpoint(blocks={[f'blocks.{i}' for i in range(m)]!r})" for m in (1, 2, 3))


def _parts(name: str) -> set[str]:
    """A composition's parts (``backprop``: none)."""
    return set() if name == "backprop" else set(name.split("+"))


def _work(model: torch.nn.Module, options: dict[str, Any]) -> tuple[set[str], int]:
    """The blocks a checkpointing option set recomputes, and its levels."""
    found = blocks(model)
    return set(options.get("blocks", found.names)), options.get("levels", 1)


WORK = ("blocks", "levels", "segments", "time_chunks")
"""The options that say how much is recomputed (more of them: more work)."""


@pytest.mark.parametrize("name", list(MODELS))
def test_what_beats_an_offer_is_measured_first_and_only_recomputes_less(name: str) -> None:
    """Each offer that beats another is measured before it (:func:`beaters_first`) and is
    the same step with less recomputation: the same parts and checkpointing of fewer blocks
    or in one level, or no checkpointing at all (time chunks beside the same step without
    them), every other option (fragments, ``trace=True``: other ways of running the work)
    equal. Other kinds say why: blocks recomputed in k fragments of the batch, beaten by
    as many micro-batches alone (:data:`MICRO_BATCHED`); where every block holds a
    BatchNorm, one block more in fragments, beaten by one fewer (:data:`BN_PASSES`), and
    every block in k fragments, beaten by the stem and blocks with the largest few in k
    (:data:`BN_EVERY`); every block as fx code, beaten by plain checkpointing of as many
    or fewer (:data:`TRACED`); and the same step in fewer pieces (:func:`coarser`), measured
    first too."""
    seen = micro = bn = every = pieces = traced = 0
    for per_ex in (False, True):
        torch.manual_seed(0)
        model = MODELS[name]()
        offers = _offered(model, exact=True, loss_fn=loss(per_ex))
        keys = [(o.name, o.options) for o in offers]
        order = [(o.name, o.options) for o in beaters_first(offers)]
        assert sorted(map(repr, order)) == sorted(map(repr, keys))
        for offer in offers:
            for by in offer.beaten_by:
                if by not in keys:  # not offered on this model: it beats nothing
                    continue
                seen += 1
                assert order.index(by) < order.index((offer.name, offer.options)), (offer, by)
                if offer.beaten_why == MICRO_BATCHED:
                    micro += 1
                    assert offer.name == "checkpoint"
                    assert by == ("accumulate", {"micro_batches": offer.options["fragments"]})
                    assert not {"fragment_blocks", "levels"} & offer.options.keys()
                    continue
                if offer.beaten_why == BN_PASSES:  # one block fewer in fragments
                    bn += 1
                    found = blocks(model)
                    assert all(is_bn_only([found.modules[n]]) for n in found.names)
                    assert by[0] == offer.name == "checkpoint"
                    fewer = {**offer.options, "fragment_blocks": by[1]["fragment_blocks"]}
                    assert by[1] == fewer
                    assert by[1]["fragment_blocks"] < offer.options["fragment_blocks"]
                    continue
                assert offer.beaten_why is None
                mine, theirs = _parts(offer.name), _parts(by[0])
                assert "checkpoint" in mine and mine - {"checkpoint"} == theirs - {"checkpoint"}
                rest = {k: v for k, v in offer.options.items() if k not in WORK}
                assert rest == {k: v for k, v in by[1].items() if k not in WORK}
                if "checkpoint" in theirs:  # the same checkpointing, of less
                    more, less = _work(model, offer.options), _work(model, by[1])
                    assert more[0] >= less[0] and more[1] >= less[1] and more != less
            for n, o, why in offer.beaten_because:
                assert (n, o) in keys and why in (BN_EVERY, TRACED)
                assert order.index((n, o)) < order.index((offer.name, offer.options))
                if why == TRACED:  # every block traced, by a plain checkpoint of as many or fewer
                    traced += 1
                    assert (offer.name, offer.options) == ("checkpoint", {"trace": True})
                    assert n == "checkpoint" and "trace" not in o and set(o) <= {"blocks"}
                    continue
                every += 1
                found = blocks(model)
                assert all(is_bn_only([found.modules[b]]) for b in found.names)
                assert offer.name == n == "checkpoint" and set(offer.options) == {"fragments"}
                assert o["fragments"] == offer.options["fragments"] and "fragment_blocks" in o
            for c in coarser(offer, offers):
                pieces += 1
                assert order.index((c.name, c.options)) < order.index((offer.name, offer.options))
    if name.startswith("zoo_"):
        assert pieces, name  # every zoo model has fragments, time chunks or micro-batches
    if name == "zoo_gpt":
        assert traced, name  # a model run as written: its blocks as fx code
    if name.startswith("zoo_"):
        assert seen, name  # every zoo model has beaten offers
    if name in ("zoo_gpt", "zoo_lstm", "zoo_unet"):
        assert micro, name  # their fragments, under a loss declared per example
    if name == "zoo_resnet":
        assert bn and every, name  # BatchNorm in every block


def test_the_same_step_in_fewer_pieces_is_coarser() -> None:
    """:func:`coarser`: the same engine and options but fewer fragments, time chunks or
    micro-batches (each piece option set in both, none more); not another engine, other
    options, a piece option set in one only, or more pieces."""
    def offer(name: str, **options: Any) -> PlanOffer:
        return PlanOffer(name, options)

    ca = "checkpoint+accumulate"
    offers = [offer("checkpoint", fragments=2), offer("checkpoint", fragments=8),
              offer("checkpoint", fragments=4, levels=2), offer("checkpoint"),
              offer("accumulate", micro_batches=2), offer(ca, time_chunks=4, micro_batches=2),
              offer(ca, time_chunks=16, micro_batches=2), offer(ca, time_chunks=4, micro_batches=8),
              offer(ca, time_chunks=16, micro_batches=8)]  # fmt: skip
    got = {repr(o): [repr(c) for c in coarser(o, offers)] for o in offers}
    assert got[repr(offers[1])] == [repr(offers[0])]  # 8 fragments: 2
    assert got[repr(offers[0])] == [] and got[repr(offers[2])] == [] == got[repr(offers[3])]
    assert got[repr(offers[4])] == []  # no other engine's micro-batches
    assert got[repr(offers[6])] == [repr(offers[5])] == got[repr(offers[7])]
    assert got[repr(offers[8])] == [repr(o) for o in offers[5:8]]
    assert set(PIECES) == {"fragments", "time_chunks", "micro_batches"}


def _flat(seconds: float = 1.0) -> Callable[..., dict[str, Timing]]:
    """A timer that runs nothing and answers ``seconds`` for every step."""

    def timer(fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int,
              **_: object) -> dict[str, Timing]:  # fmt: skip
        return {k: Timing(seconds, seconds, seconds, None, repeats) for k in fns}

    return timer


def _real(steps: collections.Counter[tuple[str, str]]) -> set[str]:
    return {lb for (lb, kind), n in steps.items() if kind == "real" and n}


def test_more_blocks_are_not_run_where_fewer_fit(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """At 1 MB on the tiny GPT (blocks.0 1.23 MB, blocks.0-1 948 kB, checkpoint 770 kB):
    blocks.0-1 fits, so blocks.0-2, every block (``checkpoint()``) and every block in two
    levels are rows saying so, never stepped, and so is ``trace=True`` (every block as fx
    code: :data:`TRACED`); the fragments are measured as before."""
    model, idx, loss_fn = tiny_gpt_step()
    monkeypatch.setattr(planner, "time_interleaved", _flat())
    p = leangrad.plan(model, idx, loss_fn, budget=1_000_000, repeats=3)
    rows = {c.label: c for c in p.table}
    assert rows[B2].verdict == "fits"
    for label in (B3, "checkpoint", "checkpoint(levels=2)"):
        assert rows[label].verdict == BEATEN.format(by=B2), label
        assert rows[label].peak_bytes is None and rows[label].seconds is None
        assert label not in _real(counted)
    # every block traced: beaten by the plain row of fewer blocks that fits (TRACED)
    assert rows["checkpoint(trace=True)"].verdict == BEATEN_BECAUSE.format(by=B2, why=TRACED)
    assert "checkpoint(trace=True)" not in _real(counted)
    assert "checkpoint(fragments=2)" in _real(counted)


@pytest.mark.slow
def test_they_are_run_where_fewer_do_not_fit_and_a_reusing_plan_runs_them(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """At 800 kB blocks.0-1 no longer fits, so blocks.0-2 (770 kB: as low as every block,
    on this tiny model) is measured and fits, and beats ``checkpoint()``; a plan at 800 kB
    reusing the 1 MB plan (where blocks.0-2 was not run) measures it now, and its rows are
    the fresh plan's."""
    model, idx, loss_fn = tiny_gpt_step()
    monkeypatch.setattr(planner, "time_interleaved", _flat())
    fresh = leangrad.plan(model, idx, loss_fn, budget=800_000, repeats=3)
    rows = {c.label: c for c in fresh.table}
    assert rows[B2].verdict.startswith("over budget") and rows[B3].peak_bytes == 770_056
    assert rows["checkpoint"].verdict == BEATEN.format(by=B3)
    high = leangrad.plan(model, idx, loss_fn, budget=1_000_000, repeats=3)
    counted.clear()
    low = leangrad.plan(model, idx, loss_fn, budget=800_000, repeats=3, reuse=high)
    assert B3 in _real(counted) and "checkpoint" not in _real(counted)

    def verdicts(p: leangrad.Plan) -> dict[str, tuple[str, int | None]]:
        return {c.label: (c.verdict.removesuffix(" (estimate)"), c.peak_bytes)
                for c in p.table}  # fmt: skip

    assert verdicts(low) == verdicts(fresh)


def test_time_chunks_are_not_run_beside_the_same_step_that_fits(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """On an LSTM LM at a budget backprop fits, every time-chunked row is beaten and never
    stepped: ``checkpoint(time_chunks=k)`` by backprop, and time chunks under m
    micro-batches by ``accumulate(micro_batches=m)`` (which fits where backprop does), or,
    where that one is in more pieces than 2 micro-batches, which fit, by those."""
    torch.manual_seed(0)
    model = MODELS["zoo_lstm"]()
    idx = torch.randint(0, 32, (8, 12))
    loss_fn = leangrad.loss.per_example(
        lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()), idx)
    monkeypatch.setattr(planner, "time_interleaved", _flat())
    p = leangrad.plan(model, idx, loss_fn, budget=10**9, repeats=3)
    rows = {c.label: c for c in p.table}
    chunked = [lb for lb in rows if "time_chunks" in lb]
    assert len(chunked) == 4 + 2 * 3, chunked  # TIME_CHUNKS, and (4, 16) x micro-batches 2-8
    for label in chunked:
        m = rows[label].options.get("micro_batches")
        by = "backprop" if m is None else leangrad.engine("accumulate", micro_batches=2).label
        want = BEATEN.format(by=by) if m in (None, 2) else BEATEN_BECAUSE.format(
            by=by, why=MORE_PIECES)  # fmt: skip
        assert rows[label].verdict == want, label
        assert label not in _real(counted)
    assert rows["backprop"].verdict.startswith(("fits", "chosen"))
    assert rows["accumulate"].verdict.startswith(("fits", "chosen"))


@pytest.mark.slow
def test_fragments_are_not_run_where_as_many_micro_batches_fit(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """On the tiny GPT under a loss declared per example, at a budget backprop fits,
    ``accumulate(micro_batches=k)`` fits, so blocks recomputed in k fragments (and in two
    levels, beaten by those) are rows saying why, never stepped, though the fragments are
    offered after the micro-batches are measured; the table keeps the offers' order. Under
    the same loss not declared per example there are no micro-batches, and the fragments
    are measured as before: 2 of them, which fit, and so no more."""
    model, idx, _ = tiny_gpt_step()
    tgt = torch.randint(0, 32, idx.shape)
    monkeypatch.setattr(planner, "time_interleaved", _flat())
    per_ex = leangrad.loss.per_example(leangrad.zoo.GPT.loss, tgt)

    def plain(out: torch.Tensor) -> torch.Tensor:
        return leangrad.zoo.GPT.loss(out, tgt)

    p = leangrad.plan(model, idx, per_ex, budget=10**9, repeats=3)
    rows = {c.label: c for c in p.table}
    assert [c.label for c in p.table] == [
        leangrad.engine(n, **o).label for n, o in planner.candidates(model, loss_fn=per_ex)]
    fragmented = [lb for lb in rows if "fragments" in lb and "chunked_ce" not in lb]
    assert len(fragmented) >= 3, fragmented  # 2 and 4 fragments, and two levels of 4
    by = leangrad.engine("accumulate", micro_batches=2).label
    assert rows[by].verdict.startswith(("fits", "chosen")), by
    for label in fragmented:  # 2 fragments by 2 micro-batches; more, by those, in more pieces
        why = MICRO_BATCHED if rows[label].options["fragments"] == 2 else MORE_PIECES
        assert rows[label].verdict == BEATEN_BECAUSE.format(by=by, why=why), label
        assert rows[label].peak_bytes is None and label not in _real(counted)
    counted.clear()
    q = leangrad.plan(model, idx, plain, budget=10**9, repeats=3)
    measured = {c.label for c in q.table if c.peak_bytes is not None}
    assert "checkpoint(fragments=2)" in measured & _real(counted)  # more pieces: by it
    more = {c.label: c.verdict for c in q.table if c.options.get("fragments") == 4}
    assert more and set(more.values()) == {BEATEN_BECAUSE.format(by="checkpoint(fragments=2)",
                                                                 why=MORE_PIECES)}, more


@pytest.mark.slow
def test_more_batchnorm_blocks_in_fragments_are_not_run_where_fewer_fit(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """On a small ResNet (BatchNorm in every block) at a budget everything fits, the stem
    and blocks with only the largest block in 4 fragments fits, so two and three blocks in
    fragments (each fragmented BatchNorm block recomputed once per pass) and every block in
    4 fragments are rows saying why, never stepped; so are the same in 8 fragments, the
    same steps in more pieces."""
    torch.manual_seed(0)
    model = leangrad.zoo.resnet(10, width=4)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    monkeypatch.setattr(planner, "time_interleaved", _flat())
    p = leangrad.plan(model, x, lambda out: torch.nn.functional.cross_entropy(out, y),
                      budget=10**9, repeats=3)  # fmt: skip
    rows = {c.label: c for c in p.table}
    fewest = {c.options["fragments"]: c.label for c in p.table
              if c.options.get("fragment_blocks") == 1}  # fmt: skip
    assert set(fewest) == {4, 8}
    by = fewest[4]
    assert rows[by].verdict.startswith(("fits", "chosen")) and by in _real(counted)
    more = [c.label for c in p.table if c.options.get("fragment_blocks", 1) > 1]
    assert len(more) == 4, more
    every = [c.label for c in p.table if c.options == {"fragments": 4}]
    assert every == ["checkpoint(fragments=4)"]
    for label in [*more, fewest[8], *every]:
        k, n = rows[label].options["fragments"], rows[label].options.get("fragment_blocks")
        why = (MORE_PIECES if k == 8 else BN_EVERY if n is None else BN_PASSES)
        assert rows[label].verdict == BEATEN_BECAUSE.format(by=by, why=why), label
        assert rows[label].peak_bytes is None and label not in _real(counted)


@pytest.mark.slow
def test_the_same_step_in_more_pieces_is_not_run_where_fewer_fit(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """On an LSTM LM under a loss declared per example, at a budget backprop fits: 2
    micro-batches fit, so 4 and 8 are rows saying so (:data:`MORE_PIECES`), never stepped
    nor timed; with ``engines=`` naming them, each is run."""
    torch.manual_seed(0)
    model = MODELS["zoo_lstm"]()
    idx = torch.randint(0, 32, (8, 12))
    loss_fn = leangrad.loss.per_example(
        lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()), idx)
    timed: collections.Counter[str] = collections.Counter()
    flat = _flat()

    def timer(fns: Mapping[str, Callable[[], object]], **kw: Any) -> dict[str, Timing]:
        timed.update(list(fns))
        return flat(fns, **kw)

    monkeypatch.setattr(planner, "time_interleaved", timer)
    p = leangrad.plan(model, idx, loss_fn, budget=10**9, repeats=3)
    rows = {c.label: c for c in p.table}
    two = leangrad.engine("accumulate", micro_batches=2).label
    assert rows[two].verdict.startswith(("fits", "chosen")) and timed[two] > 0
    for k in (4, 8):
        label = leangrad.engine("accumulate", micro_batches=k).label
        assert rows[label].verdict == BEATEN_BECAUSE.format(by=two, why=MORE_PIECES)
        assert label not in _real(counted) and timed[label] == 0
    named = [("accumulate", {"micro_batches": k}) for k in (2, 4, 8)]
    q = leangrad.plan(model, idx, loss_fn, budget=10**9, repeats=3, engines=named)
    assert all(c.peak_bytes is not None and c.seconds is not None for c in q.table)
