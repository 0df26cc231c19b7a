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
import leangrad._plan as planner
from leangrad._plan import _offered, beaters_first
from leangrad._plan_measure import BEATEN, BEATEN_BECAUSE
from leangrad.engines._blocks import blocks
from leangrad.engines._checkpoint_plan import BN_PASSES, MICRO_BATCHED
from leangrad.engines._fragments_bn import is_bn_only
from leangrad.measure import Timing

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
    equal. Two other kinds say why: blocks recomputed in k fragments of the batch, beaten by
    as many micro-batches alone (:data:`MICRO_BATCHED`), and, where every block holds a
    BatchNorm, one block more in fragments, beaten by one fewer (:data:`BN_PASSES`)."""
    seen = micro = bn = 0
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
    if name.startswith("zoo_"):
        assert seen, name  # every zoo model has beaten offers
    if name in ("zoo_gpt", "zoo_lstm", "zoo_unet"):
        assert micro, name  # their fragments, under a loss declared per example
    if name == "zoo_resnet":
        assert bn, name  # BatchNorm in every block


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
    levels are rows saying so, never stepped; ``trace=True`` (another mechanism) and the
    fragments are measured as before."""
    model, idx, loss_fn = tiny_gpt_step()
    monkeypatch.setattr(planner, "time_interleaved", _flat())
    p = leangrad.plan(model, idx, loss_fn, budget=1_000_000, repeats=3)
    rows = {c.label: c for c in p.table}
    assert rows[B2].verdict == "fits"
    for label in (B3, "checkpoint", "checkpoint(levels=2)"):
        assert rows[label].verdict == BEATEN.format(by=B2), label
        assert rows[label].peak_bytes is None and rows[label].seconds is None
        assert label not in _real(counted)
    assert {"checkpoint(trace=True)", "checkpoint(fragments=2)"} <= _real(counted)
    assert rows["checkpoint(trace=True)"].peak_bytes is not None


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
    micro-batches by ``accumulate(micro_batches=m)`` (which fits where backprop does)."""
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
        by = "backprop" if m is None else leangrad.engine("accumulate", micro_batches=m).label
        assert rows[label].verdict == BEATEN.format(by=by), label
        assert label not in _real(counted)
    assert rows["backprop"].verdict.startswith(("fits", "chosen"))


def test_fragments_are_not_run_where_as_many_micro_batches_fit(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """On the tiny GPT under a loss declared per example, at a budget backprop fits,
    ``accumulate(micro_batches=k)`` fits, so blocks recomputed in k fragments (and in two
    levels, beaten by those) are rows saying why, never stepped, though the fragments are
    offered after the micro-batches are measured; the table keeps the offers' order. Under
    the same loss not declared per example there are no micro-batches, and the fragments
    are measured as before."""
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
    for label in fragmented:
        k = rows[label].options["fragments"]
        by = leangrad.engine("accumulate", micro_batches=k).label
        assert rows[by].verdict.startswith(("fits", "chosen")), by
        assert rows[label].verdict == BEATEN_BECAUSE.format(by=by, why=MICRO_BATCHED), label
        assert rows[label].peak_bytes is None and label not in _real(counted)
    counted.clear()
    q = leangrad.plan(model, idx, plain, budget=10**9, repeats=3)
    measured = {c.label for c in q.table if c.peak_bytes is not None}
    assert set(fragmented) - {"checkpoint(fragments=4,levels=2)"} <= measured & _real(counted)


def test_more_batchnorm_blocks_in_fragments_are_not_run_where_fewer_fit(
    monkeypatch: pytest.MonkeyPatch, counted: collections.Counter[tuple[str, str]],
) -> None:  # fmt: skip
    """On a small ResNet (BatchNorm in every block) at a budget everything fits, the stem
    and blocks with only the largest block in fragments fits, so two and three blocks in
    fragments (each fragmented BatchNorm block recomputed once per pass) are rows saying
    why, never stepped."""
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
    more = [c.label for c in p.table if c.options.get("fragment_blocks", 1) > 1]
    assert len(more) == 4, more
    for label in more:
        by = fewest[rows[label].options["fragments"]]
        assert rows[by].verdict.startswith(("fits", "chosen")) and by in _real(counted)
        assert rows[label].verdict == BEATEN_BECAUSE.format(by=by, why=BN_PASSES), label
        assert rows[label].peak_bytes is None and label not in _real(counted)


def test_more_fragments_of_the_same_step_are_not_timed_at_about_the_same_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """On the small ResNet at a budget everything fits, a row with more fragments than a
    fitting row of the same step (:attr:`~leangrad.engines._base.PlanOffer.coarser`) is
    timed only where its peak is more than :data:`~leangrad._plan.FINER_GAIN` lower; else
    its row fits, says which coarser row it stays near, and no round times it."""
    torch.manual_seed(0)
    model = leangrad.zoo.resnet(10, width=4)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    timed: collections.Counter[str] = collections.Counter()
    flat = _flat()

    def timer(fns: Mapping[str, Callable[[], object]], **kw: Any) -> dict[str, Timing]:
        timed.update(list(fns))
        return flat(fns, **kw)

    monkeypatch.setattr(planner, "time_interleaved", timer)
    p = leangrad.plan(model, x, lambda out: torch.nn.functional.cross_entropy(out, y),
                      budget=10**9, repeats=3)  # fmt: skip
    rows = {c.label: c for c in p.table}
    offers = {c.name + repr(c.options): c for c in _offered(model, exact=True, loss_fn=None)}
    left_out = 0
    for c in p.table:
        offer = offers[c.name + repr(c.options)]
        near = [rows[leangrad.engine(n, **o).label] for n, o in offer.coarser]
        near = [r for r in near if r.verdict in ("fits", "chosen") or r.verdict.startswith(
            "chosen")]  # fmt: skip
        if c.peak_bytes is None or not c.verdict.startswith(("fits", "chosen")) or not near:
            continue
        close = [r for r in near if c.peak_bytes >= (1 - planner.FINER_GAIN) * r.peak_bytes]  # type: ignore[operator]
        if close:
            left_out += 1
            assert c.verdict.startswith("fits; not timed: "), c.label
            assert any(c.verdict == "fits; " + planner.SAME_IN_MORE_PIECES.format(by=r.label)
                       for r in close), c.verdict  # fmt: skip
            assert c.seconds is None and timed[c.label] == 0
        else:
            assert timed[c.label] > 0, c.label
    assert left_out >= 1
