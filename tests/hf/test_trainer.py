"""leangrad inside Hugging Face's ``Trainer`` with one line (``leangrad.hf.attach``): on a
random-weight Llama in float64, full fine-tuning and PEFT LoRA, with the Trainer's own
gradient accumulation and its ``num_items_in_batch`` loss, every logged loss and every
weight after training equal to the plain Trainer's run (exact engines), and the plan made
on the first batch logged."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad._errors import EngineInputError, OptionError

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("leangrad.hf")

STEPS = 3


def _llama() -> torch.nn.Module:
    model = hf.llama(vocab=64, dim=16, layers=2, heads=2, context=16, dtype=torch.float64,
                     seed=0)  # fmt: skip
    return model


def _lora() -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8,
                                                          target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B off its zero initialisation, which would hide A's gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    return model


def _data() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (24, 10), generator=gen)
    rows = []
    for i in range(len(ids)):
        labels = ids[i].clone()
        labels[7 + i % 3:] = -100  # unequal counted tokens per example
        rows.append({"input_ids": ids[i], "labels": labels})
    return rows


def _train(model: torch.nn.Module, tmp_path: Any, attach: dict[str, Any] | None,
           **options: Any) -> tuple[torch.nn.Module, Any]:  # fmt: skip
    model = copy.deepcopy(model)
    settings: dict[str, Any] = {"per_device_train_batch_size": 4,
                                "gradient_accumulation_steps": 2, "learning_rate": 1e-2,
                                **options}  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, use_cpu=True, report_to=[],
        logging_steps=1, seed=0, save_strategy="no", disable_tqdm=True, **settings)  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data())
    if attach is not None:
        assert hf.attach(trainer, **attach) is trainer
    trainer.train()
    return model, trainer


def _losses(trainer: Any) -> list[float]:
    """The logged losses (the Trainer sums them in float32: compared to float32's rounding;
    the weights, in float64, are compared tightly)."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters(),
                                                          strict=True))  # fmt: skip


@pytest.mark.parametrize("engine", ["checkpoint+chunked_ce", "accumulate", "checkpoint"])
def test_full_fine_tuning_equals_the_plain_trainer(tmp_path: Any, engine: str) -> None:
    model = _llama()
    ref, plain = _train(model, tmp_path / "plain", None)
    got, trainer = _train(model, tmp_path / "lg", {"engine": engine})
    assert len(_losses(plain)) == STEPS
    assert _losses(trainer) == pytest.approx(_losses(plain), rel=1e-6)
    assert _same(ref, got) < 1e-10
    assert _same(ref, model) > 1e-3  # it did train
    assert trainer.leangrad.engine.label.startswith(engine.split("+")[0])


def test_lora_fine_tuning_equals_the_plain_trainer(tmp_path: Any) -> None:
    model = _lora()
    ref, plain = _train(model, tmp_path / "plain", None)
    got, trainer = _train(model, tmp_path / "lg", {"engine": "checkpoint+chunked_ce"})
    assert _losses(trainer) == pytest.approx(_losses(plain), rel=1e-6)
    assert _same(ref, got) < 1e-10
    frozen = [n for n, p in got.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in got.parameters() if not p.requires_grad)


def test_a_custom_loss_function_is_the_trainers(tmp_path: Any) -> None:
    # compute_loss_func: the Trainer pops the labels and hands the output to it.
    def loss_func(out: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
        logits = out.logits[:, :-1].flatten(0, 1)
        total = F.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum")
        return total / num_items_in_batch

    model = _llama()
    args = {"per_device_train_batch_size": 4}
    ref2, plain2 = _train_with_loss(model, tmp_path / "p2", None, loss_func, **args)
    got2, trainer = _train_with_loss(model, tmp_path / "l2", {"engine": "accumulate"},
                                     loss_func, **args)  # fmt: skip
    assert _losses(trainer) == pytest.approx(_losses(plain2), rel=1e-6)
    assert _same(ref2, got2) < 1e-10


def _train_with_loss(model: torch.nn.Module, tmp_path: Any, attach: dict[str, Any] | None,
                     loss_func: Any, **options: Any) -> tuple[torch.nn.Module, Any]:  # fmt: skip
    model = copy.deepcopy(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to=[], logging_steps=1,
        seed=0, save_strategy="no", disable_tqdm=True, learning_rate=1e-2, **options)  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                   compute_loss_func=loss_func)  # fmt: skip
    if attach is not None:
        hf.attach(trainer, **attach)
    trainer.train()
    return model, trainer


def test_a_split_step_is_refused_when_the_loss_is_not_a_sum(tmp_path: Any) -> None:
    def mean_loss(out: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
        del num_items_in_batch  # a per-batch mean: micro-batches would not add up
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    with pytest.raises(EngineInputError, match="not the sum of its losses on the two halves"):
        _train_with_loss(_llama(), tmp_path, {"engine": "accumulate"}, mean_loss,
                         per_device_train_batch_size=4)  # fmt: skip


def test_a_budget_plans_on_the_first_batch_and_logs_it(tmp_path: Any) -> None:
    model = _llama()
    ref, _ = _train(model, tmp_path / "plain", None)
    got, trainer = _train(model, tmp_path / "lg", {"budget": 0.97})
    assert _same(ref, got) < 1e-10
    logged = [h for h in trainer.state.log_history if "leangrad_engine" in h]
    assert len(logged) == 1
    row = logged[0]
    assert row["leangrad_engine"] == trainer.leangrad.engine.label
    assert 0 < row["leangrad_peak_mib"] <= row["leangrad_budget_mib"]
    plan = trainer.leangrad.plan
    assert plan is not None and trainer.leangrad.engine.exact
    # planned within the budget: no step over it ran (those rows are estimates), and the
    # exactness re-check ran on what fitted (the Trainer's loss is declared per example)
    assert all(c.verdict != "over budget" for c in plan.table)
    assert any(c.verdict == "over budget (estimate)" for c in plan.table)
    assert "; re-checked against loss.backward() on this model" in plan.message


def test_evaluation_runs_as_before(tmp_path: Any) -> None:
    model = copy.deepcopy(_llama())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to=[], per_device_eval_batch_size=4)
    plain = transformers.Trainer(model=model, args=args, eval_dataset=_data())
    want = plain.evaluate()["eval_loss"]
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=_data())
    hf.attach(trainer, leangrad.engine("checkpoint"))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want, rel=1e-12)


def test_attach_says_what_is_wrong(tmp_path: Any) -> None:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=_llama(), args=args)
    with pytest.raises(OptionError, match="not both"):
        hf.attach(trainer, "checkpoint", budget="1GiB")
    with pytest.raises(OptionError, match="give an engine"):
        hf.attach(trainer)
    with pytest.raises(OptionError, match="budget must be"):
        hf.attach(trainer, budget="lots")
    with pytest.raises(OptionError, match=r"expected a transformers\.Trainer"):
        hf.attach(object(), "checkpoint")
    hf.attach(trainer, "checkpoint")
    with pytest.raises(OptionError, match="already runs leangrad"):
        hf.attach(trainer, "backprop")
