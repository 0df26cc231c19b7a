"""Planning inside a Trainer run stays within the budget: ``leangrad.hf.attach(trainer,
budget=f)`` plans on the first batch with ``plan(within_budget=True)`` — no candidate runs
whose fake-tensor estimate is over the budget, the fraction is of backprop's *estimated*
peak, and the exactness re-check runs on the largest slice of the batch that fits. On
GPT-2 at its vocabulary (50,257; random weights, built offline), the first training step
(planning included) is tracked: bytes held at its peak, model and batch included, beside
the budget and beside the plain step's (which planning used to reach: it stepped backprop
for the fraction and for the re-check).

Run alone: .venv/bin/python results/hf/plan_in_run.py [--out results/hf/plan-in-run.json]
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import transformers
from trainer_step import trainer  # results/hf/trainer_step.py, beside this script

import leangrad.hf as hf
from leangrad.measure import MemoryTracker
from leangrad_bench._script import out_option, show_and_save

SIZE = {"vocab": 50257, "dim": 128, "layers": 2, "heads": 4, "context": 64}
BATCH, LENGTH, FRACTIONS = 4, 64, (0.5, 0.7, 0.9)


def _trainer(model: torch.nn.Module, budget: float | None) -> Any:
    made = trainer(model, "Trainer")
    if budget is not None:
        hf.attach(made, budget=budget)
    return made


def _first_step(made: Any, batch: dict[str, torch.Tensor],
                items: torch.Tensor) -> tuple[int, float]:  # fmt: skip
    """Bytes held at the step's peak (model, gradients and batch included), and seconds."""
    start = time.perf_counter()
    with MemoryTracker(baseline=(made.model, *batch.values())) as tracker:
        made.training_step(made.model, dict(batch), num_items_in_batch=items)
    report = tracker.report
    return report.baseline_bytes + report.peak_bytes, time.perf_counter() - start


def main() -> None:
    out = out_option()
    torch.set_num_threads(1)
    base = hf.gpt2(**SIZE, seed=0, dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SIZE["vocab"], (BATCH, LENGTH), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    items = torch.tensor(int(ids[:, 1:].numel()))  # what Trainer.train passes: counted labels
    plain = _trainer(copy.deepcopy(base), None)
    _first_step(plain, batch, items)  # warm
    plain_bytes, plain_s = _first_step(plain, batch, items)
    rows = []
    for fraction in FRACTIONS:
        made = _trainer(copy.deepcopy(base), fraction)
        held, seconds = _first_step(made, batch, items)
        found = made.leangrad.plan
        rows.append({"budget_fraction": fraction, "budget_mib": made.leangrad.budget / 2**20,
                     "first_step_held_mib": held / 2**20,
                     "within_budget": held <= made.leangrad.budget,
                     "first_step_seconds": seconds, "engine": made.leangrad.engine.label,
                     "chosen_peak_mib": found.peak_bytes / 2**20,
                     "check": found.message.split("; ", 1)[-1]})  # fmt: skip
    report = {"model": f"GPT-2 (transformers) {SIZE}, batch {BATCH} x {LENGTH}, float32",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "threads": 1, "plain_step_held_mib": plain_bytes / 2**20,
              "plain_step_seconds": plain_s, "rows": rows}  # fmt: skip
    show_and_save(report, out)


if __name__ == "__main__":
    main()
