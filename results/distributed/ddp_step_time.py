"""Step time of `leangrad.train.fit(engine="backprop")` under torchrun against a
plain PyTorch DDP loop on the same model, data shards, optimizer and batch.

Run alone: torchrun --nproc-per-node 2 results/distributed/ddp_step_time.py [--out FILE]

Each round runs both, in alternating order, from freshly built models: `fit` (which logs
the mean loss over ranks of every step and checks for a stop request: one small
all-reduce per 8 steps, `SYNC_EVERY`) and a loop of
`opt.zero_grad(); F.cross_entropy(ddp(x), y).backward(); opt.step()`.

Two measures, on rank 0:
- the step time: the period between the starts of consecutive steps (fit's stamped by
  wrapping `_Run._update`, the plain loop's at the top of its body), warm-up steps left
  out, median over every step of every round;
- the loop time: a whole loop's wall time / steps (first steps included), median over
  rounds.
Two processes share this machine's 2 cores with gloo's threads, so single steps spread
from about 0.8x to 1.3x their median; many short interleaved rounds keep drift out of the
comparison.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from leangrad import data, models, train
from leangrad.train import _fit
from leangrad_bench._script import out_option, show_and_save

STEPS, ROUNDS, WARMUP, BATCH, WIDTH, DEPTH = 40, 21, 3, 64, 512, 4
stamps: list[float] = []


def plain(ctx: train.DistContext, ds: data.Dataset) -> float:
    torch.manual_seed(0)
    net = models.mlp(64, WIDTH, DEPTH, 10)
    ddp = DDP(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    per_step = BATCH * ctx.world_size
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step in range(STEPS):
        stamps.append(time.perf_counter())
        idx = order[step * per_step + ctx.rank * BATCH:][:BATCH]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(ds.x[idx]), ds.y[idx]).backward()
        opt.step()
    return (time.perf_counter() - start) / STEPS


def leangrad_fit(ctx: train.DistContext, ds: data.Dataset) -> float:
    res = train.fit(models.mlp(64, WIDTH, DEPTH, 10), ds, engine="backprop", batch_size=BATCH,
                    max_steps=STEPS, lr=1e-3, progress=False, track_memory_every=0,
                    test_fraction=0.0, plots=False)  # fmt: skip
    assert res.examples_per_s is not None and res.steps == STEPS
    return BATCH * ctx.world_size / res.examples_per_s  # its loop's wall time / steps


def _stamped(update: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        stamps.append(time.perf_counter())
        return update(self, *args, **kwargs)

    return wrapper


def main() -> None:
    out = out_option()
    torch.set_num_threads(1)
    _fit._Run._update = _stamped(_fit._Run._update)  # type: ignore[method-assign]
    ctx = train.init_distributed(torch.device("cpu"))
    ds = data.synthetic_classification(BATCH * ctx.world_size * STEPS, shape=(64,))
    names = ["plain DDP loop", "leangrad fit"]
    loops: dict[str, list[float]] = {n: [] for n in names}
    steps: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ROUNDS):
        for name in names[:: 1 if r % 2 == 0 else -1]:
            dist.barrier()
            stamps.clear()
            loops[name].append(plain(ctx, ds) if name == names[0] else leangrad_fit(ctx, ds))
            steps[name] += [b - a for a, b in itertools.pairwise(stamps[WARMUP:])]
    step = {k: statistics.median(v) for k, v in steps.items()}
    loop = {k: statistics.median(v) for k, v in loops.items()}
    report = {"world_size": ctx.world_size, "steps": STEPS, "rounds": ROUNDS, "warmup": WARMUP,
              "batch_per_rank": BATCH, "model": f"mlp(64, {WIDTH}, {DEPTH}, 10)",
              "threads_per_rank": 1, "step_seconds_median": step,
              "step_ratio_fit_over_plain": step[names[1]] / step[names[0]],
              "loop_seconds_per_step_median": loop,
              "loop_ratio_fit_over_plain": loop[names[1]] / loop[names[0]],
              "loop_seconds_per_step": loops, "torch": torch.__version__}  # fmt: skip
    if ctx.rank == 0:
        show_and_save(report, out, newline=False,
                      shown={k: v for k, v in report.items() if k != "loop_seconds_per_step"})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
