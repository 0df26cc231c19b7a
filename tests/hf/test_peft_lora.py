"""A PEFT LoRA-wrapped Llama as PEFT users train it (``get_peft_model``, r = 8 on q and v),
with its LoRA ``B`` moved off its zero initialisation (which makes ``A``'s gradient 0 and
hides a wrong one): every engine exact in float64 against ``loss.backward()`` —
gradients, the frozen base weights' ``.grad`` left None, the RNG — or refused naming why
(:func:`model_corpus.verdict`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import leangrad
import model_corpus as mc
from leangrad._errors import LeangradError
from leangrad.loss import per_example

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
hf = pytest.importorskip("leangrad.hf")

ENGINES = {**mc.ENGINES, "checkpoint+chunked_ce": lambda: leangrad.engine("checkpoint+chunked_ce")}


def _lora() -> tuple[torch.nn.Module, torch.Tensor]:
    base = hf.llama(vocab=64, dim=16, layers=2, heads=2, context=16, dtype=torch.float64,
                    seed=0)  # fmt: skip
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16,
                                                      target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    ids = torch.randint(0, 64, (4, 10), generator=gen)
    return model.train(), ids


def _loss(out: Any, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tgt.flatten())


def _step(model: torch.nn.Module, ids: torch.Tensor,
          engine: leangrad.Engine | None) -> mc._Step:  # fmt: skip
    return mc.engine_step(model, ids, per_example(_loss, ids[:, 1:]), engine)


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_on_a_lora_llama_is_exact_or_refuses(name: str) -> None:
    model, ids = _lora()
    ref = _step(model, ids, None)
    frozen = [n for n, g in ref.grads.items() if g is None]
    assert frozen and all("lora_" not in n for n in frozen)  # the base weights: no .grad
    try:
        got = _step(model, ids, ENGINES[name]())
    except LeangradError as err:
        assert str(err)  # a refusal names why
        return
    assert mc.verdict(ref, got, torch.float64) == "exact"


def test_peft_input_grad_hooks_are_understood_not_refused() -> None:
    # PEFT users call enable_input_require_grads() beside gradient checkpointing (often
    # twice): its hook only sets requires_grad on the embedding's output, so engines that
    # run the embedding again are planned, not skipped; a hook of the user's still is.
    model, ids = _lora()
    model.enable_input_require_grads()
    model.enable_input_require_grads()
    batch = {"input_ids": ids, "labels": ids}
    eng = leangrad.engine("checkpoint", blocks=["base_model"], fragments=2)
    ref = copy.deepcopy(model)
    ref(**batch).loss.backward()
    got = copy.deepcopy(model)
    eng.backward(got, batch, lambda out: out.loss)
    for (n, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=n)
    embed = got.get_input_embeddings()
    embed.register_forward_hook(lambda *_: None)  # the user's own: refused, named
    with pytest.raises(LeangradError, match="forward hook would fire more than once"):
        eng.backward(got, batch, lambda out: out.loss)
