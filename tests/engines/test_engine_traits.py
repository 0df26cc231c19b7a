"""What callers outside the engines ask an engine instead of checking its class:
:meth:`Engine.blocks` and :meth:`Engine.idle_reason`; the one-transform engines' names
and exactness read from the transform table; the parallel modes' one home."""

from __future__ import annotations

import pytest
from torch import nn

import leangrad
from leangrad import _errors as errors
from leangrad.engines._catalog import engine_class
from leangrad.engines._compose import NOT_IN_TABLE, OnBackprop
from leangrad.engines._transforms import TRANSFORMS, RadTransform
from leangrad.planner._parallel import (
    BAD_PARALLEL,
    FSDP_ENGINE,
    PARALLEL,
    check_parallel,
    fsdp_refusal,
)


def _stack() -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)),
                         nn.Linear(4, 2))  # fmt: skip


def test_blocks_are_the_finders_unless_the_engine_says_otherwise() -> None:
    model = _stack()
    found = leangrad.blocks(model).names
    assert leangrad.engine("backprop").blocks(model).names == found
    assert leangrad.engine("rad").blocks(model).names == found
    chosen = leangrad.engine("checkpoint", blocks=["0", "2"])
    assert chosen.blocks(model).names == ("0", "2")
    assert leangrad.engine("checkpoint+fad", blocks=["1"]).blocks(model).names == ("1",)


def test_only_a_composition_that_changes_nothing_is_idle() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # no ReLU or dropout for bits
    assert leangrad.engine("backprop").idle_reason(model) is None
    why = leangrad.engine("checkpoint+bits").idle_reason(_stack())
    assert why is None  # ReLUs swapped in every block
    idle = leangrad.engine("bits").idle_reason(model)
    assert idle is not None and "bits" in idle


def test_each_transform_is_an_engine_under_its_own_name() -> None:
    for name, transform in TRANSFORMS.items():
        cls = engine_class(name)
        assert issubclass(cls, OnBackprop) and cls.transform is transform
        assert cls.name == name and cls.exact == transform.exact
        assert (name in leangrad.available(exact=True)) == transform.exact


def test_a_transform_outside_the_table_is_refused() -> None:
    class Stray(RadTransform):
        name = "stray"

    with pytest.raises(ValueError) as err:
        type("StrayEngine", (OnBackprop,), {"transform": Stray})
    assert str(err.value) == NOT_IN_TABLE.format(cls="StrayEngine", name="stray",
                                                 known=", ".join(TRANSFORMS))  # fmt: skip
    assert "stray" not in leangrad.available()


def test_parallel_modes_and_fsdp_refusals_have_one_home() -> None:
    assert all(check_parallel(p) == p for p in PARALLEL)
    with pytest.raises(errors.OptionError) as err:
        check_parallel("zero")
    assert str(err.value) == BAD_PARALLEL.format(names="ddp, fsdp", value="zero")
    model = _stack()
    assert fsdp_refusal(leangrad.engine("backprop"), model) is None
    rad = leangrad.engine("rad", fraction=0.5)
    assert fsdp_refusal(rad, model) == FSDP_ENGINE.format(engine=rad.label)
