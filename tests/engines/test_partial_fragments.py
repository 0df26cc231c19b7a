"""Fragments only where they pay: ``checkpoint(fragments=k, fragment_blocks=...)``
runs the named checkpointed blocks — or the ``n`` that save the most bytes inside, sized on
fake tensors — in ``k`` fragments of the batch, and recomputes the others whole. Held to
autograd: float64 within 1e-10, float32 within 1e-4, training-mode BatchNorm's running
statistics advanced once; the fake-tensor sizes equal the bytes a real forward saves; the
peak (tracker bytes, deterministic) is the all-fragments one where the largest blocks set
it. Nothing here asserts a time."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import _errors as errors
from leangrad import zoo
from leangrad.engines._blocks import blocks
from leangrad.engines.checkpoint import _fragments
from leangrad.engines.checkpoint._segments import largest, saved_inside
from leangrad.measure import compare_grads, profile_step
from leangrad.planner._plan import candidates

LossFn = Callable[[Any], torch.Tensor]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
STEM_FIRST = ["stem", "stages.0.0"]


def _resnet(dtype: torch.dtype = torch.float64, batch: int = 6, image: int = 8,
            width: int = 4) -> tuple[nn.Module, torch.Tensor, LossFn]:  # fmt: skip
    torch.manual_seed(0)
    model = zoo.resnet(18, width=width).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, image, image, generator=gen).to(dtype)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return model, x, lambda out: F.cross_entropy(out, y)


def _every(model: nn.Module) -> list[str]:
    return ["stem", *blocks(model).names]


Tensors = dict[str, torch.Tensor]


def _reference(model: nn.Module, x: torch.Tensor, loss_fn: LossFn) -> tuple[Tensors, Tensors]:
    """Autograd's gradients (x's as ``"input"`` where it requires grad) and the buffers it
    leaves; the model's state and ``.grad`` put back."""
    start = copy.deepcopy(model.state_dict())
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if x.grad is not None:
        grads["input"] = x.grad.clone()
        x.grad = None
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    model.load_state_dict(start)
    return grads, buffers


def _step(model: nn.Module, x: torch.Tensor, loss_fn: LossFn,
          **options: Any) -> tuple[leangrad.StepResult, dict[str, torch.Tensor]]:  # fmt: skip
    res = leangrad.engine("checkpoint", **options).backward(model, x, loss_fn)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if x.grad is not None:
        grads["input"] = x.grad.clone()
        x.grad = None
    model.zero_grad(set_to_none=True)
    return res, grads


@pytest.fixture
def fragmented(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """Per fragmented call, the ids of the parameters it differentiated (which block ran in
    pieces)."""
    seen: list[set[int]] = []
    apply = _fragments._apply

    def recording(call: Any, tensors: list[torch.Tensor], params: list[nn.Parameter]) -> Any:
        seen.append({id(p) for p in params})
        return apply(call, tensors, params)

    monkeypatch.setattr(_fragments, "_apply", recording)
    return seen


def _owners(model: nn.Module, seen: list[set[int]]) -> set[str]:
    """The blocks (of :func:`_every`) whose parameters a fragmented call differentiated."""
    return {n for n in _every(model) for ids in seen
            if {id(p) for p in model.get_submodule(n).parameters()} <= ids}  # fmt: skip


@pytest.mark.parametrize("k", [2, 3])
def test_named_blocks_in_fragments_exact_with_running_stats_once(
        k: int, fragmented: list[set[int]]) -> None:  # fmt: skip
    model, x, loss_fn = _resnet()
    ref, ref_buffers = _reference(model, x, loss_fn)
    res, got = _step(model, x, loss_fn, blocks=_every(model), fragments=k,
                     fragment_blocks=STEM_FIRST)  # fmt: skip
    assert set(got) == set(ref)
    assert compare_grads(got, ref).max_rel_err <= TOL[torch.float64]
    assert _owners(model, fragmented) == set(STEM_FIRST)  # only those ran in pieces
    assert res.info["fragmented"] == sorted(STEM_FIRST)
    others = set(_every(model)) - set(STEM_FIRST)
    assert set(res.info["whole"]) == others
    assert all("not named by fragment_blocks" in res.info["whole"][n] for n in others)
    after = dict(model.named_buffers())
    assert int(after["stem.1.num_batches_tracked"]) == 1  # advanced once, as autograd
    for n, b in ref_buffers.items():
        torch.testing.assert_close(after[n], b, rtol=1e-12, atol=0, msg=n)


def test_float32_with_input_gradients() -> None:
    model, x, loss_fn = _resnet(torch.float32, batch=7)
    x.requires_grad_(True)
    ref, _ = _reference(model, x, loss_fn)
    _, got = _step(model, x, loss_fn, blocks=_every(model), fragments=3,
                   fragment_blocks=["stem", "stages.0.1", "stages.2.0"])  # fmt: skip
    assert "input" in got
    assert compare_grads(got, ref).max_rel_err <= TOL[torch.float32]


def test_fake_sizes_equal_the_bytes_a_real_forward_saves() -> None:
    """:func:`saved_inside` on fake tensors counts what a real forward's saved-tensor hooks
    see inside each block (its inputs, parameters and buffers left out), and leaves the
    model untouched."""
    model, x, _ = _resnet(torch.float32, batch=4, image=16)
    names = _every(model)
    mods = {n: model.get_submodule(n) for n in names}
    before = {n: t.clone() for n, t in model.state_dict().items()}
    fake = saved_inside(model, model, mods, (x,))
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n
    real = dict.fromkeys(names, 0)
    stack: list[tuple[str, set[int]]] = []
    seen = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if stack and key not in stack[-1][1] and key not in seen:
            seen.add(key)
            real[stack[-1][0]] += t.untyped_storage().nbytes()
        return t

    def enter(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            stack.append((name, {t.untyped_storage().data_ptr() for t in args}))

        return hook

    def leave(*_: object) -> None:
        stack.pop()

    for n, m in mods.items():
        m.register_forward_pre_hook(enter(n))
        m.register_forward_hook(leave)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    assert fake == real
    assert fake["stages.0.0"] > fake["stages.1.1"] > fake["stages.2.1"] > fake["stages.3.1"]


def test_a_number_fragments_the_largest_blocks(fragmented: list[set[int]]) -> None:
    model, x, loss_fn = _resnet(image=16)
    ref, _ = _reference(model, x, loss_fn)
    res, got = _step(model, x, loss_fn, blocks=_every(model), fragments=2, fragment_blocks=3)
    assert compare_grads(got, ref).max_rel_err <= TOL[torch.float64]
    sizes = res.info["block_bytes"]
    assert set(sizes) == set(_every(model))
    top = largest(sizes, 3)
    assert res.info["fragmented"] == sorted(top)
    assert _owners(model, fragmented) == set(top)
    assert min(sizes[n] for n in top) >= max(sizes[n] for n in sizes if n not in top)
    assert {"stages.0.0", "stages.0.1"} <= set(top)  # the first stage, at full resolution
    assert all("not among the 3 largest" in why for why in res.info["whole"].values())


def test_the_largest_blocks_alone_reach_the_peak_of_all_fragments() -> None:
    """At image 32 the first stage sets the peak: fragmenting the stem and its two blocks
    gives the peak of fragmenting every block (tracker bytes)."""
    model, x, loss_fn = _resnet(torch.float32, batch=16, image=32, width=16)
    every = _every(model)

    def peak(**options: Any) -> int:
        eng = leangrad.engine("checkpoint", blocks=every, **options)
        return profile_step(eng, model, x, loss_fn, repeats=0).peak_bytes

    plain, full, part = peak(), peak(fragments=4), peak(fragments=4, fragment_blocks=3)
    assert part <= 1.02 * full
    assert part <= 0.9 * plain


@pytest.mark.parametrize("options", [{"levels": 2}, {"segments": 2}, {}])
def test_sequences_and_two_levels(options: dict[str, Any],
                                  fragmented: list[set[int]]) -> None:  # fmt: skip
    """A Sequential of BatchNorm MLP blocks: only the named block (or segment holding it)
    runs in pieces; exact, with running statistics as autograd's."""
    torch.manual_seed(0)
    dim = 6

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.Tanh())

    model = nn.Sequential(*[block() for _ in range(5)]).double()
    x = torch.randn(7, dim, dtype=torch.float64)
    target = torch.randn(7, dim, dtype=torch.float64)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    ref, ref_buffers = _reference(model, x, loss_fn)
    res, got = _step(model, x, loss_fn, fragments=3, fragment_blocks=["1"], **options)
    assert compare_grads(got, ref).max_rel_err <= TOL[torch.float64]
    assert res.info["fragmented"] == ["1"]
    ran = {n for n, m in model.named_children()
           for ids in fragmented if {id(p) for p in m.parameters()} <= ids}  # fmt: skip
    assert "1" in ran and "3" not in ran
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[n], rtol=1e-12, atol=0, msg=n)


@pytest.mark.parametrize("bad", [0, -1, True, [], [3], "", 2.5, {"stem": 2}])
def test_bad_fragment_blocks_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="fragment_blocks must be"):
        leangrad.engine("checkpoint", fragments=2, fragment_blocks=bad)


def test_fragment_blocks_need_fragments() -> None:
    with pytest.raises(ValueError, match="add fragments=k"):
        leangrad.engine("checkpoint", fragment_blocks=2)


def test_the_cli_spelling_and_the_label() -> None:
    assert leangrad.engine("checkpoint", fragments=2, fragment_blocks="3").options[
        "fragment_blocks"] == 3  # fmt: skip
    eng = leangrad.engine("checkpoint", fragments=2, fragment_blocks="stem, stages.0.0")
    assert eng.options["fragment_blocks"] == STEM_FIRST
    assert "fragment_blocks=2" in leangrad.engine("checkpoint", fragments=4,
                                                  fragment_blocks=2).label  # fmt: skip


def test_a_name_that_is_not_recomputed_is_refused() -> None:
    model, x, loss_fn = _resnet()
    eng = leangrad.engine("checkpoint", fragments=2, fragment_blocks=["stem"])  # blocks only
    with pytest.raises(errors.EngineInputError, match="does not recompute"):
        eng.backward(model, x, loss_fn)


def test_explain_says_which_blocks_and_why() -> None:
    model, x, loss_fn = _resnet(image=16)
    every = _every(model)
    named = leangrad.engine("checkpoint", blocks=every, fragments=2, fragment_blocks=STEM_FIRST)
    lines = "\n".join(leangrad.explain(named, model).lines)
    assert "stages.0.0" in lines and "not named by fragment_blocks" in lines
    rows = {ln.split()[0]: ln for ln in leangrad.explain(named, model).lines[1:]}
    assert "in 2 fragments of the batch" in rows["stem"]
    assert "whole: not named by fragment_blocks" in rows["stages.3.1"]
    sized = leangrad.engine("checkpoint", blocks=every, fragments=2, fragment_blocks=2)
    before = "\n".join(leangrad.explain(sized, model).lines)
    assert "sized on fake tensors at the first step" in before
    sized.backward(model, x, loss_fn)
    rows = {ln.split()[0]: ln for ln in leangrad.explain(sized, model).lines[1:]}
    assert "(among the 2 largest)" in rows["stages.0.0"]
    assert "whole: not among the 2 largest" in rows["stages.3.1"]


def test_the_planner_offers_the_largest_blocks_in_fragments() -> None:
    model = zoo.resnet(18, width=4)
    offers = [o for n, o in candidates(model, exact=True) if n == "checkpoint"]
    partial = [o for o in offers if "fragment_blocks" in o]
    assert partial
    for o in partial:
        assert o["blocks"] == _every(model) and isinstance(o["fragment_blocks"], int)
