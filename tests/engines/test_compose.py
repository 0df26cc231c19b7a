"""Composition of a base engine with transforms (``"checkpoint+fad"``, ``"rad"``, ...):
the spelling, option routing, what is refused, and that the user's module is never
changed. Gradients and the backward contract are covered by the reference test
(test_engines.py) and the contract test (test_contract.py)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from fad_cases import Untraceable
from leangrad import _errors as E
from leangrad.engines._compose import AMBIGUOUS, BASE_FIRST, INCOMPATIBLE, TWICE, Composed
from leangrad.train._snapshot import load_engine_state


class Swish(nn.Module):
    """Swish with beta = 1.5: a custom chain (beta = 1 is F.silu, which fad runs by the kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.5 * x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Swish(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).double()  # fmt: skip


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))


@pytest.mark.parametrize(
    ("name", "options", "label"),
    [
        ("rad", {"fraction": 0.5}, "rad(fraction=0.5)"),
        ("fad", {}, "fad"),
        ("checkpoint+fad", {"segments": 2}, "checkpoint(segments=2)+fad"),
        ("checkpoint+rad", {"segments": 2, "fraction": 0.2},
         "checkpoint(segments=2)+rad(fraction=0.2)"),
        ("fad+rad", {}, "backprop+fad+rad"),
        ("moonwalk+rad", {"moonwalk_mode": "pure", "rad_mode": "same"},
         "moonwalk(mode=pure)+rad(mode=same)"),
    ],
)  # fmt: skip
def test_spelling_and_labels(name: str, options: dict[str, object], label: str) -> None:
    assert leangrad.engine(name, **options).label == label


def test_rad_and_fad_are_registered_engines() -> None:
    assert {"rad", "fad"} <= set(leangrad.available())
    assert "fad" in leangrad.available(exact=True)
    assert "rad" in leangrad.available(exact=False)
    assert leangrad.engine("checkpoint+fad").exact
    assert not leangrad.engine("checkpoint+rad").exact


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("forward+fad", {}, INCOMPATIBLE.format(pair="forward+fad", why="forward mode runs")),
        ("forward+rad", {}, INCOMPATIBLE.format(pair="forward+rad", why="forward mode keeps")),
        ("projforward+rad", {}, "engine 'projforward+rad' cannot work"),
        ("rad+checkpoint", {}, "'rad+checkpoint': write the base engine first"),
        ("checkpoint+fad+fad", {}, TWICE.format(name="checkpoint+fad+fad", transform="fad")),
        ("checkpoint+nosuch", {}, "unknown transform 'nosuch'; known transforms: rad, fad"),
        ("nosuch+fad", {}, "unknown engine 'nosuch'"),
        ("moonwalk+rad", {"mode": "pure"}, AMBIGUOUS.format(
            name="moonwalk+rad", option="mode", owners="moonwalk and rad",
            spelled="moonwalk_mode, rad_mode")),
        ("checkpoint+fad", {"fraction": 0.1}, "engine 'checkpoint+fad' has no option 'fraction'"),
    ],
)  # fmt: skip
def test_bad_compositions_name_the_pair_and_why(
    name: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(E.LeangradError, match=re.escape(message.split("{")[0][:60])):
        leangrad.engine(name, **options)


def test_base_first_message_suggests_the_order() -> None:
    with pytest.raises(E.UnknownNameError) as info:
        leangrad.engine("rad+checkpoint")
    assert "'checkpoint+rad'" in str(info.value)
    assert BASE_FIRST.split("{")[0] in str(info.value)


@pytest.mark.parametrize("value", [0.0, 1.5, float("nan")])
def test_rad_options_are_validated_when_the_engine_is_made(value: float) -> None:
    with pytest.raises(E.LeangradError, match="fraction"):
        leangrad.engine("rad", fraction=value)


def test_fad_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="fad mode must be 'auto', 'fx' or 'eager'"):
        leangrad.engine("fad", mode="lazy")


@pytest.mark.parametrize("name", ["rad", "fad", "checkpoint+fad", "checkpoint+rad"])
def test_the_users_module_is_never_modified(name: str) -> None:
    model = _model()
    before = copy.deepcopy(model)
    types = [type(m) for m in model.modules()]
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built on the original
    leangrad.engine(name).backward(model, x, lambda out: F.cross_entropy(out, y))
    assert [type(m) for m in model.modules()] == types
    assert all(p.grad is not None for p in model.parameters())  # on the user's Parameters
    opt.step()
    moved = [not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters(),
                                                   strict=True)]  # fmt: skip
    assert all(moved)


def test_prepared_once_per_model_and_again_after_a_mode_switch() -> None:
    eng = leangrad.engine("fad")
    assert isinstance(eng, Composed)
    model = _model()
    first, report = eng.prepare(model)
    assert eng.prepare(model)[0] is first
    assert report["fad"]["model"]["used"] == "fx" and len(report["fad"]["model"]["fused"]) == 1
    model.eval()
    again, _ = eng.prepare(model)
    assert again is not first and not again.training
    model.train()
    assert eng.prepare(model)[0].training


def test_fad_reports_its_eager_fallback_and_why() -> None:
    torch.manual_seed(0)
    model = Untraceable(6).double()  # data-dependent control flow: fx cannot trace it
    x, y = _data()
    with torch.no_grad():  # take the branch: the output is an element-wise chain's value
        model.lin.bias.fill_(10.0)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    res = leangrad.engine("fad").backward(model, x, lambda out: F.cross_entropy(out, y))
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=1e-12)
    info = res.info["fad"]["model"]
    assert info["used"] == "eager" and "torch.fx cannot trace" in info["why"]
    with pytest.raises(E.LeangradError, match=r"torch\.fx cannot trace"):
        leangrad.engine("fad", mode="fx").backward(model, x, lambda out: F.cross_entropy(out, y))


def test_seeded_rad_stream_continues_across_preparations_and_checkpoints() -> None:
    """A model switched to eval and back is prepared again: its samples must go on, not
    restart; the generator is saved and restored with the engine's RNG state."""
    x, y = _data()
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731

    def grads(eng: leangrad.Engine, model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        eng.backward(model, x, loss_fn)
        return [p.grad.clone() for p in model.parameters()]

    eng, model = leangrad.engine("rad", fraction=0.3, seed=3), _model()
    g1 = grads(eng, model)
    state = eng.state_dict()
    assert state["generators"], "the seeded generator is in the engine's state"
    model.eval()
    model.train()
    g2 = grads(eng, model)
    assert not all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))  # new samples

    resumed = leangrad.engine("rad", fraction=0.3, seed=3)
    resumed.load_state_dict(state)
    g2b = grads(resumed, _model())
    for a, b in zip(g2, g2b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda: leangrad.engine("projforward", samples=2, seed=5),
        lambda: leangrad.engine("checkpoint+rad", fraction=0.3, seed=3),
    ],
    ids=["projforward", "checkpoint+rad"],
)
def test_engine_state_dict_continues_the_random_stream(make: Any) -> None:
    """A fresh engine given ``state_dict()`` draws what the original draws next, as a
    resumed training run needs; a legacy checkpoint's ``engine_rng`` list still loads."""
    x, y = _data()
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    eng, model = make(), _model()
    eng.backward(model, x, loss_fn)
    state = eng.state_dict()
    model.zero_grad(set_to_none=True)
    eng.backward(model, x, loss_fn)
    want = [p.grad.clone() for p in model.parameters()]
    for restore in ("state_dict", "legacy"):
        resumed, copy_ = make(), _model()
        if restore == "state_dict":
            resumed.load_state_dict(state)
        else:  # what checkpoints held before engines had state_dict
            attr = "generators" if "base" in state else "_generators"  # compose, projforward
            legacy = [[attr, k, st] for k, st in state["generators"].items()]
            load_engine_state(resumed, {"engine_rng": legacy})
        resumed.backward(copy_, x, loss_fn)
        for a, b in zip(want, [p.grad for p in copy_.parameters()], strict=True):
            assert torch.equal(a, b), restore


def test_a_stateless_engine_refuses_a_state_naming_the_fix() -> None:
    with pytest.raises(E.EngineInputError, match=r"keeps no state.*Resume with the engine"):
        leangrad.engine("backprop").load_state_dict({"generators": {}})
    with pytest.raises(E.EngineInputError, match="does not seed; make it with the run's"):
        leangrad.engine("checkpoint+fad").load_state_dict({"generators": {"rad": None}})


def test_rad_draws_from_a_generator_of_its_own_and_leaves_the_global_stream_alone() -> None:
    """Without ``seed=``, rad's samples come from the engine's own stream (seeded from
    ``torch.initial_seed()``): the global RNG stands where autograd's step leaves it, so
    every dropout mask after the step is the one ``loss.backward()`` would have drawn."""
    torch.manual_seed(3)
    model = _model()
    x, _ = _data()
    eng = leangrad.engine("rad", fraction=0.5)
    before = torch.get_rng_state()
    eng.backward(model, x, lambda out: out.square().mean())
    assert torch.equal(torch.get_rng_state(), before)
    assert "rad" in eng.state_dict()["generators"]  # saved with a training checkpoint
    torch.manual_seed(3)
    again = leangrad.engine("rad", fraction=0.5)
    assert torch.equal(again.state_dict()["generators"]["rad"],
                       leangrad.engine("rad", fraction=0.5).state_dict()["generators"]["rad"])


def test_explain_says_what_each_transform_changed_and_left_alone_and_why() -> None:
    model = leangrad.zoo.gpt(vocab=16, dim=8, layers=2, heads=2, context=8)
    text = str(leangrad.explain("checkpoint+fad+bits", model))
    assert "2 blocks (repeated children of 'blocks': 2 x GPTBlock)" in text
    assert "GELU 'mlp.1': PyTorch's fused built-in" in text  # per block, as the engine sees it
    assert "fad on blocks.0 (fx pass)" in text
    assert "bits on blocks.0: nothing to swap" in text
    mlp = _model()
    text = str(leangrad.explain("fad", mlp))
    assert "fused: fad_chain_0: mul" in text or "fused: fad_chain_0" in text
    assert "relu" in text and "< min_ops=2" in text  # the lone ReLU, and why
    text = str(leangrad.explain("rad", _model()))
    assert "rad on model: swapped 4" in text and "left exact: 1 (Swish)" in text


def test_fads_eager_block_keeps_its_outputs_memory_format() -> None:
    # A random draw after the block fills its mask in memory order: a channels-last output
    # that came out contiguous would be dropped elsewhere than under autograd.
    from leangrad.engines._transforms import _through_cat

    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    y = _through_cat(x * 1.0)
    assert y.stride() == x.stride() and torch.equal(y, x)
    loss = (x * 2.0).sum()
    z = _through_cat(loss)
    assert z.dim() == 0 and torch.equal(z, loss) and z.grad_fn is not None
