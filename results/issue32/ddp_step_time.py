"""Issue 32: step time of `leangrad.train.fit(engine="backprop")` under torchrun against a
plain PyTorch DDP loop on the same model, data shards, optimizer and batch.

Run alone: torchrun --nproc-per-node 2 results/issue32/ddp_step_time.py [--out FILE]

Each round runs both, in alternating order, from freshly built models: `fit` (which logs
the mean loss over ranks and checks for a stop request every step, two small all-reduces)
and a loop of `opt.zero_grad(); F.cross_entropy(ddp(x), y).backward(); opt.step()`. Time
per step = wall time of the training loop / steps (both include their first steps).
Medians over rounds; the ratio is fit's over the plain loop's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from leangrad import data, models, train

STEPS, ROUNDS, BATCH, WIDTH, DEPTH = 60, 5, 64, 512, 4


def plain(ctx: train.DistContext, ds: data.Dataset) -> float:
    torch.manual_seed(0)
    net = models.mlp(64, WIDTH, DEPTH, 10)
    ddp = DDP(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    per_step = BATCH * ctx.world_size
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step in range(STEPS):
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = train.init_distributed(torch.device("cpu"))
    ds = data.synthetic_classification(BATCH * ctx.world_size * STEPS, shape=(64,))
    times: dict[str, list[float]] = {"plain DDP loop": [], "leangrad fit": []}
    for r in range(ROUNDS):
        for name in (["plain DDP loop", "leangrad fit"] if r % 2 == 0
                     else ["leangrad fit", "plain DDP loop"]):  # fmt: skip
            dist.barrier()
            times[name].append(plain(ctx, ds) if name == "plain DDP loop" else leangrad_fit(ctx, ds))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"world_size": ctx.world_size, "steps": STEPS, "rounds": ROUNDS, "batch_per_rank": BATCH,
           "model": f"mlp(64, {WIDTH}, {DEPTH}, 10)", "threads_per_rank": 1,
           "seconds_per_step_median": med, "seconds_per_step": times,
           "ratio_fit_over_plain": med["leangrad fit"] / med["plain DDP loop"],
           "torch": torch.__version__}  # fmt: skip
    if ctx.rank == 0:
        print(json.dumps(out, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
