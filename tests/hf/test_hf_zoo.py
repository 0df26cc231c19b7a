"""The zoo suite's opt-in Hugging Face models (``hf_gpt2``, ``hf_llama``, ``hf_bert``,
``hf_unet``): built from the suite's sizes, with the library's own gradient checkpointing
(``hf_checkpointing``) as the PyTorch-side row. Tiny sizes; nothing here asserts a time."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from leangrad import hf
from leangrad._errors import OptionError
from leangrad.measure import compare_grads
from leangrad_bench import RunSettings, load_suite
from leangrad_bench._models import HF_MODELS, build
from leangrad_bench._zoo import run_zoo
from leangrad_bench._zoo_methods import (
    HF_CHECKPOINTING,
    call,
    hf_checkpointing,
    pytorch_methods,
)

TINY = {
    "hf_gpt2": {**hf.TINY["gpt2"], "batch": 2},
    "hf_llama": {**hf.TINY["llama"], "batch": 2},
    "hf_bert": {**hf.TINY["bert"], "batch": 2},
    "hf_unet": {**hf.TINY["unet"], "batch": 2},
}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_suite_sizes_every_hf_model_and_keeps_them_opt_in() -> None:
    suite = load_suite("zoo")
    for quick in (False, True):
        assert set(suite.setting("hf_models", quick)) == set(HF_MODELS)
        assert not set(suite.setting("models", quick)) & set(HF_MODELS)
    assert suite.setting("hf_models", True)["hf_gpt2"]["vocab"] == 50257


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_checkpointing_row_gives_autograds_gradient(name: str) -> None:
    wl = build(name, TINY[name])
    wl.model.double()
    xs = tuple(x.double() if x.is_floating_point() else x for x in wl.inputs)
    methods, skipped = pytorch_methods(wl.model, segments=[2], chunks=[4])
    assert [m.label for m in methods] == ["torch bf16 autocast", HF_CHECKPOINTING]
    assert {s.label for s in skipped} == {"torch per-block", "torch selective"}
    wl.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    wl.loss_fn(call(wl.model, xs)).backward()
    ref = {n: p.grad.clone() for n, p in wl.model.named_parameters() if p.grad is not None}
    wl.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    methods[1].make().backward(wl.model, xs, wl.loss_fn)
    got = {n: p.grad for n, p in wl.model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-9
    assert hf_checkpointing(wl.model) is not None
    assert not wl.model.is_gradient_checkpointing, "the step left checkpointing on"


def test_hf_models_run_only_when_named() -> None:
    suite = load_suite("zoo")
    with pytest.raises(OptionError, match=r"opt-in .*hf_gpt2"):
        run_zoo(suite, RunSettings(quick=True, progress=False, only=["hf_gpt3"]))
    settings = {**suite.settings, "quick_models": {}, "quick_estimate_models": {}}
    quiet = RunSettings(quick=True, progress=False)
    assert run_zoo(dataclasses.replace(suite, settings=settings), quiet) == []


def test_hf_checkpointing_leaves_no_hook_behind() -> None:
    """transformers' enable registers a forward hook on the input embedding that its disable
    keeps; the row removes it, or every later method of the run would see it."""
    wl = build("hf_gpt2", TINY["hf_gpt2"])
    before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in wl.model.modules()]
    methods, _ = pytorch_methods(wl.model, segments=[2], chunks=[4])
    methods[1].make().backward(wl.model, wl.inputs, wl.loss_fn)
    after = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in wl.model.modules()]
    assert after == before


def test_profile_compares_against_a_reference_with_the_same_dropout_masks() -> None:
    """GPT-2 keeps dropout 0.1 in training: the tracked step of ``profile_step`` starts from
    the RNG state the call found, so a reference computed from that state is comparable."""
    import leangrad
    from leangrad.measure import profile_step

    wl = build("hf_gpt2", TINY["hf_gpt2"])
    wl.model.double()
    with torch.random.fork_rng(devices=[]):
        wl.loss_fn(call(wl.model, wl.inputs)).backward()
    ref = {n: p.grad.clone() for n, p in wl.model.named_parameters()}
    wl.model.zero_grad(set_to_none=True)
    prof = profile_step(
        leangrad.engine("checkpoint"), wl.model, wl.inputs, wl.loss_fn, repeats=0, reference=ref
    )
    assert prof.grad_max_rel_err is not None and prof.grad_max_rel_err <= 1e-9
