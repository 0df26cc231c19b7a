"""The loss head of GPT-2 at its vocabulary (50,257), four ways, one training step each:
plain cross-entropy of the logits, leangrad's ``chunked_ce`` engine, torchtune's
``CEWithChunkedOutputLoss`` (the model's logits in 8 chunks along the sequence, each
upcast and reduced on its own, as torchtune's recipes write it) and Cut Cross-Entropy's
``linear_cross_entropy(impl="torch_compile")`` (hidden states and the head's weight, no
logits). The peers run where they import (``pip install cut-cross-entropy torchtune``, in
an environment of its own: torchtune 0.6 needs ``torchao<0.12``, which PEFT 0.21 refuses
to import beside); a row says why where not.

Peak: leangrad's tracker over the step above the model and batch; time: median of
interleaved steps after warm-up (CCE compiles in its first), 1 thread; gradients compared
with the plain step's.

Run alone: .venv/bin/python results/hf/loss_head.py [--out results/hf/loss-head.json]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import leangrad
from leangrad.measure import MemoryTracker
from leangrad_bench._script import out_option, show_and_save

from _gpt2 import BATCH, MODEL, gpt2_and_ids  # results/hf/_gpt2.py, beside this script

REPEATS, CHUNKS = 5, 8


def main() -> None:
    out = out_option()
    torch.set_num_threads(1)
    model, ids = gpt2_and_ids()
    tgt = ids[:, 1:]

    def ce(out: Any) -> torch.Tensor:
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tgt.flatten())

    def hidden() -> torch.Tensor:
        h: torch.Tensor = model.transformer(ids).last_hidden_state
        return h

    steps: dict[str, Callable[[], None]] = {
        "plain cross-entropy": lambda: ce(model(ids)).backward(),
        "leangrad chunked_ce": lambda: leangrad.engine("chunked_ce").backward(model, ids, ce),
    }
    missing: dict[str, str] = {}
    try:
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        tt = CEWithChunkedOutputLoss(num_output_chunks=CHUNKS)
        labels = torch.cat([tgt, torch.full((BATCH, 1), -100)], dim=1)  # torchtune shifts

        def torchtune_step() -> None:
            chunks = [model.lm_head(h) for h in hidden().chunk(CHUNKS, dim=1)]
            tt(chunks, labels).backward()

        steps["torchtune CEWithChunkedOutputLoss"] = torchtune_step
    except Exception as err:  # not installed, or its torchao does not import
        missing["torchtune CEWithChunkedOutputLoss"] = f"{type(err).__name__}: {err}"
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce_step() -> None:
            h = hidden()[:, :-1]
            linear_cross_entropy(h, model.lm_head.weight, tgt, impl="torch_compile").backward()

        steps["Cut Cross-Entropy (torch_compile)"] = cce_step
    except Exception as err:
        missing["Cut Cross-Entropy (torch_compile)"] = f"{type(err).__name__}: {err}"

    def run(name: str) -> None:
        model.zero_grad(set_to_none=True)
        steps[name]()

    grads, peaks = {}, {}
    for name in steps:
        run(name)  # warm (compiles CCE's kernels)
        model.zero_grad(set_to_none=True)
        with MemoryTracker(baseline=(model, ids)) as tracker:
            steps[name]()
        peaks[name] = tracker.report.peak_bytes
        grads[name] = [q.grad.clone() for q in model.parameters()]
    times: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(REPEATS):
        for name in steps:
            t0 = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - t0)
    ref = grads["plain cross-entropy"]
    plain_time = sorted(times["plain cross-entropy"])[REPEATS // 2]
    rows: list[dict[str, Any]] = []
    for name in steps:
        med = sorted(times[name])[REPEATS // 2]
        rel = max(float((a - b).abs().max() / (b.abs().max() + 1e-30))
                  for a, b in zip(grads[name], ref, strict=True))  # fmt: skip
        rows.append({"loss": name, "peak_mib": peaks[name] / 2**20,
                     "peak_vs_plain": peaks[name] / peaks["plain cross-entropy"],
                     "seconds": med, "time_vs_plain": med / plain_time,
                     "grad_rel_diff_vs_plain": rel})  # fmt: skip
    rows += [{"loss": n, "not_run": why} for n, why in missing.items()]
    report = {"model": MODEL,
              "torch": torch.__version__, "repeats": REPEATS, "threads": 1, "rows": rows}
    show_and_save(report, out)


if __name__ == "__main__":
    main()
