"""Inputs as Hugging Face passes them: a batch that is a dict of ``input_ids``,
``attention_mask`` and ``labels`` (the loss computed by the model itself), given as it is
to every engine, to :func:`leangrad.plan` and to :func:`leangrad.measure.profile_step` —
each exact against ``model(**batch).loss.backward()`` in float64, with a Llama whose
weights are random (nothing zero-initialised hides a wrong gradient)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import leangrad
import model_corpus as mc
from leangrad._errors import EngineInputError, LeangradError
from leangrad._keywords import KeywordCall, positional
from leangrad.loss import per_example
from leangrad.measure import profile_step

pytest.importorskip("transformers")
hf = pytest.importorskip("leangrad.hf")

ENGINES = {
    **{k: v for k, v in mc.ENGINES.items() if "accumulate" not in k},
    "backprop": lambda: leangrad.engine("backprop"),
    "chunked_ce": lambda: leangrad.engine("chunked_ce"),
    "checkpoint+chunked_ce": lambda: leangrad.engine("checkpoint+chunked_ce"),
    "fad": lambda: leangrad.engine("fad"),
    "bits": lambda: leangrad.engine("bits"),
}
SPLIT = {k: v for k, v in mc.ENGINES.items() if "accumulate" in k}


def _llama() -> tuple[torch.nn.Module, dict[str, Any]]:
    model = hf.llama(vocab=64, dim=16, layers=2, heads=2, context=16, dtype=torch.float64,
                     seed=0)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (4, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # a padded row: the mask matters
    labels = ids.masked_fill(mask == 0, -100)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss(out: Any) -> torch.Tensor:
    return out.loss


def _step(model: torch.nn.Module, batch: dict[str, Any], engine: leangrad.Engine | None,
          loss_fn: Any = _loss) -> mc._Step:  # fmt: skip
    return mc.engine_step(model, batch, loss_fn, engine, autograd=lambda m: m(**batch).loss)


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_takes_a_dict_batch_and_is_exact(name: str) -> None:
    model, batch = _llama()
    ref = _step(model, batch, None)
    try:
        got = _step(model, batch, ENGINES[name]())
    except LeangradError as err:  # a refusal names why
        assert str(err)
        return
    assert mc.verdict(ref, got, torch.float64) == "exact"


@pytest.mark.parametrize("name", list(SPLIT))
def test_split_engines_split_every_tensor_and_pass_constants(name: str) -> None:
    # The model's loss divided by the batch's counted tokens (``num_items_in_batch``, as
    # Hugging Face's Trainer passes it) is a sum over examples: micro-batches add up.
    model, batch = _llama()
    batch["num_items_in_batch"] = int((batch["labels"][:, 1:] != -100).sum())
    ref = _step(model, batch, None)
    loss_fn = per_example(lambda out, _labels: out.loss, batch["labels"], reduction="sum")
    got = _step(model, batch, SPLIT[name](), loss_fn)
    assert mc.verdict(ref, got, torch.float64) == "exact"


def test_the_view_has_the_models_names_and_runs_its_hooks() -> None:
    model, batch = _llama()
    view, xs = positional(model, batch)
    assert isinstance(view, KeywordCall) and len(xs) == 3
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(view.state_dict()) == list(model.state_dict())
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    view(*xs)
    assert calls == [1]
    view.eval()
    assert not model.training and not model.model.layers[0].training


def test_plan_and_profile_step_take_a_dict_batch() -> None:
    model, batch = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prof = profile_step(leangrad.engine("checkpoint"), model, batch, _loss, repeats=1)
    assert prof.peak_bytes > 0
    found = leangrad.plan(model, batch, _loss, budget=2**34, repeats=1,
                          engines=[("backprop", {}), ("checkpoint", {})])  # fmt: skip
    assert found.engine is not None and found.engine.exact
    ref = _step(model, batch, None)
    got = _step(model, batch, found.engine)
    assert mc.verdict(ref, got, torch.float64) == "exact"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_keyword_inputs_are_checked() -> None:
    model, batch = _llama()
    with pytest.raises(EngineInputError, match="named by strings"):
        leangrad.engine("backprop").backward(model, {0: batch["input_ids"]}, _loss)
    with pytest.raises(EngineInputError, match="hold no tensor"):
        leangrad.engine("backprop").backward(model, {"use_cache": False}, _loss)
