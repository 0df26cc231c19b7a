"""The planner's candidates, collected from what each registered engine offers
(``Engine.plan_candidates``), are exactly the hand-written list they replaced:
the same ``(name, options)`` in the same order for the registered training models, the
zoo's, a HighwayNet and a Chain, with and without a per-example loss, exact or not.

``plan_candidates.json`` was written by the hand-written ``leangrad.planner._plan.candidates``
and ``last_resorts`` before the change (tests/plan_candidate_models.py builds the
models). One change since, on purpose: ``checkpoint`` with ``blocks=`` naming every block
found (with and without ``trace=True``) is no longer offered beside ``checkpoint()``, which
finds the same blocks (:func:`test_checkpoint_of_every_block_is_checkpoint`): the same
step was measured and timed twice. And one reordering: in a model run as written, the
lists of fewer blocks now come before ``checkpoint()`` and per-block checkpointing with
micro-batches (every block but the last) before every block with as many, for each beats
what follows it where it fits (``tests/test_plan_beaten.py``): the same rows, reordered.
And one addition: ``accumulate`` is offered on the HighwayNet, whose dropout no longer
keeps it out (micro-batches replay the whole batch's draws, ``engines/_batch_draws``)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from leangrad.engines import engine
from leangrad.engines._blocks import blocks
from leangrad.planner._plan import candidates, last_resorts

from .plan_candidate_models import MODELS, loss

FROZEN: dict[str, list[list[Any]]] = json.loads(
    (pathlib.Path(__file__).parent / "plan_candidates.json").read_text()
)


def _as_data(got: list[tuple[str, dict[str, Any]]]) -> list[list[Any]]:
    return json.loads(json.dumps([[n, o] for n, o in got]))  # tuples as lists, as frozen


def test_every_model_and_setting_is_frozen() -> None:
    keys = {f"{m} per_example={p} exact={e}" for m in MODELS for p in (False, True)
            for e in (True, False)} | {f"{m} last_resorts" for m in MODELS}  # fmt: skip
    assert keys == set(FROZEN)


@pytest.mark.parametrize("name", list(MODELS))
def test_candidates_equal_the_hand_written_list(name: str) -> None:
    for per_ex in (False, True):
        for exact in (True, False):
            torch.manual_seed(0)
            got = candidates(MODELS[name](), exact=exact, loss_fn=loss(per_ex))
            key = f"{name} per_example={per_ex} exact={exact}"
            assert _as_data(got) == FROZEN[key], key
    torch.manual_seed(0)
    assert _as_data(last_resorts(MODELS[name]())) == FROZEN[f"{name} last_resorts"]


def test_the_frozen_lists_cover_every_offering_engine() -> None:
    names = {n for rows in FROZEN.values() for n, _ in rows}
    assert {"backprop", "fad", "bits", "chunked_ce", "checkpoint+chunked_ce", "checkpoint",
            "checkpoint+fad", "checkpoint+bits", "accumulate", "checkpoint+accumulate",
            "moonwalk", "revbackprop", "rad", "checkpoint+rad", "highway",
            "forward"} <= names  # fmt: skip


@pytest.mark.parametrize("name", [n for n in MODELS if n.startswith("zoo_") or n == "highway"])
def test_checkpoint_of_every_block_is_checkpoint(name: str) -> None:
    """Why ``checkpoint(blocks=<every block found>)`` is not a candidate of its own: on a
    model run as written, ``checkpoint()`` checkpoints the very same modules, so the two
    are one step (the planner offers the default only)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    found = blocks(model)
    if found.sequential or found.runner is not None:
        pytest.skip(f"{name}: blocks= is not offered for a sequence or an fx split")
    default = engine("checkpoint")._find(model)
    named = engine("checkpoint", blocks=list(found.names))._find(model)
    assert default.names == named.names == found.names
    assert all(default.modules[n] is named.modules[n] for n in found.names)
    assert (default.sequential, default.runner) == (named.sequential, named.runner)
    offered = candidates(model, exact=True, loss_fn=loss(False))
    assert ("checkpoint", {}) in offered and ("checkpoint", {"trace": True}) in offered
    assert not [o for n, o in offered if n == "checkpoint" and o.get("blocks") == list(found.names)
                and set(o) <= {"blocks", "trace"}]
