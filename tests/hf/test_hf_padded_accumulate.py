"""A padded batch under gradient accumulation, as a Hugging Face user trains a causal LM:
labels hold -100 past each text's end, and the model's own ``labels=`` loss is a mean over
the batch's counted tokens. Micro-batches weigh each by its counted tokens
(``per_example(..., ignore_index=-100)``) and add up to the whole batch's gradient; the
same declaration without ``ignore_index`` is refused, never weighted by examples."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import leangrad
from leangrad import hf
from leangrad._errors import EngineInputError
from leangrad.loss import per_example
from leangrad.measure import compare_grads


def _padded() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = hf.llama(vocab=64, dim=16, layers=2, heads=2, context=16,
                     dtype=torch.float64, seed=0)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (5, 10), generator=gen)
    lengths = torch.tensor([10, 3, 7, 2, 9])
    labels = ids.clone()
    labels[torch.arange(10) >= lengths[:, None]] = -100  # the collator's padding
    return model, ids, labels


def _shifted_ce(out: object, shifted: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position t predicts label t + 1, -100 ignored."""
    logits = out.logits[:, :-1]  # type: ignore[attr-defined]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


@pytest.mark.parametrize("name", ["accumulate", "checkpoint+accumulate"])
def test_padded_labels_under_micro_batches_equal_the_models_own_loss(name: str) -> None:
    model, ids, labels = _padded()
    shifted = labels[:, 1:]  # the labels the mean runs over
    ref = copy.deepcopy(model)
    whole = _shifted_ce(ref(input_ids=ids), shifted)
    whole.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    with torch.no_grad():  # the model's own labels= loss (it upcasts logits to float32)
        own = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(whole.detach(), own.double(), rtol=1e-6, atol=0)
    loss_fn = per_example(_shifted_ce, shifted, ignore_index=-100)
    res = leangrad.engine(name, micro_batches=3).backward(model, ids, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    assert compare_grads(got, want).max_rel_err <= 1e-9
    torch.testing.assert_close(res.loss.detach(), whole.detach(), rtol=1e-10, atol=0)


def test_the_same_labels_declared_as_a_mean_over_examples_are_refused() -> None:
    model, ids, labels = _padded()
    with pytest.raises(EngineInputError, match="ignore_index=-100"):
        leangrad.engine("accumulate", micro_batches=2).backward(
            model, ids, per_example(_shifted_ce, labels[:, 1:]))  # fmt: skip
