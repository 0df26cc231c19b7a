"""One training step inside Hugging Face's ``Trainer``, three ways, on GPT-2 at its
vocabulary (50,257; random weights, built offline): the plain Trainer,
``TrainingArguments(gradient_checkpointing=True)`` (the Trainer's own recipe), and
``leangrad.hf.attach(trainer, "checkpoint+chunked_ce")``. Peak: leangrad's tracker over
``trainer.training_step`` (live tensor bytes above the model, its gradients from the
previous step and the batch), after a warm-up step; time: median of interleaved steps
at 1 thread. Weights after the steps are compared with the plain Trainer's.

Run alone: .venv/bin/python results/hf/trainer_step.py [--out results/hf/trainer-step.json]
"""

from __future__ import annotations

import copy
import tempfile
import time
from typing import Any

import torch
import transformers

import leangrad.hf as hf
from leangrad.measure import MemoryTracker
from leangrad_bench._script import out_option, show_and_save

from _gpt2 import BATCH, MODEL, gpt2_and_ids  # results/hf/_gpt2.py, beside this script

REPEATS = 5


def trainer(model: torch.nn.Module, how: str) -> Any:
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3, seed=0,
        gradient_checkpointing=how == "TrainingArguments(gradient_checkpointing=True)")  # fmt: skip
    made = transformers.Trainer(model=model, args=args)
    made.create_optimizer_and_scheduler(num_training_steps=100)
    made.current_gradient_accumulation_steps = 1  # set by train(); training_step reads it
    if how.startswith("leangrad"):
        hf.attach(made, "checkpoint+chunked_ce")
    return made


def main() -> None:
    out = out_option()
    torch.set_num_threads(1)
    base, ids = gpt2_and_ids()
    batch = {"input_ids": ids, "labels": ids}
    hows = ["Trainer", "TrainingArguments(gradient_checkpointing=True)",
            "leangrad.hf.attach(trainer, 'checkpoint+chunked_ce')"]  # fmt: skip
    made = {h: trainer(copy.deepcopy(base), h) for h in hows}
    for t in made.values():  # what train() does first with gradient_checkpointing=True
        if t.args.gradient_checkpointing:
            enable = getattr(t.model, "activation_checkpointing_enable", None) or \
                t.model.gradient_checkpointing_enable  # transformers < 5
            enable(t.args.gradient_checkpointing_kwargs)
    peaks: dict[str, int] = {}
    for h, t in made.items():
        t.training_step(t.model, dict(batch))  # warm: the engine's probes, the allocator
        with MemoryTracker(baseline=(t.model, ids)) as tracker:
            t.training_step(t.model, dict(batch))
        peaks[h] = tracker.report.peak_bytes
    times: dict[str, list[float]] = {h: [] for h in hows}
    for _ in range(REPEATS):
        for h, t in made.items():
            t0 = time.perf_counter()
            t.training_step(t.model, dict(batch))
            times[h].append(time.perf_counter() - t0)
    grads = {h: [p.grad for p in t.model.parameters()] for h, t in made.items()}
    ref = grads["Trainer"]
    rows = []
    for h in hows:
        med = sorted(times[h])[REPEATS // 2]
        worst = max(float((a - b).abs().max()) for a, b in zip(grads[h], ref, strict=True))
        rows.append({"how": h, "peak_mib": peaks[h] / 2**20,
                     "peak_vs_trainer": peaks[h] / peaks["Trainer"], "seconds": med,
                     "time_vs_trainer": med / sorted(times["Trainer"])[REPEATS // 2],
                     "grad_max_diff_vs_trainer": worst})  # fmt: skip
    report = {"model": MODEL,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "repeats": REPEATS, "threads": 1, "rows": rows}  # fmt: skip
    show_and_save(report, out)


if __name__ == "__main__":
    main()
