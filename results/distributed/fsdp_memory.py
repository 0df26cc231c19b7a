"""Bytes of parameters + gradients + Adam state each process holds under
`leangrad train --parallel fsdp` (FSDP2 over every block and the root) against one
process holding the whole model, measured after a backprop step and an Adam step (the
moment all three are alive), as the storage bytes of each process's local tensors.

Run: torchrun --nproc-per-node 2 results/distributed/fsdp_memory.py [--out FILE]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import leangrad
from leangrad import models, train
from leangrad.train._sharded import local, shard
from leangrad_bench._script import out_option, show_and_save

WIDTH, DEPTH = 1024, 8


def held_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    def nbytes(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = [p for p in model.parameters()]
    return {
        "parameters": sum(nbytes(p) for p in params),
        "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "adam_state": sum(nbytes(v) for st in opt.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0),
    }


def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    leangrad.engine("backprop").backward(model, x, lambda o: F.cross_entropy(o, y))
    opt.step()  # gradients kept: parameters, gradients and Adam state all alive
    return held_bytes(model, opt)


def main() -> None:
    out = out_option()
    ctx = train.init_distributed(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    torch.manual_seed(0)
    whole = step(models.mlp(64, WIDTH, DEPTH, 10), x, y)
    torch.manual_seed(0)
    model = models.mlp(64, WIDTH, DEPTH, 10)
    shard(model, leangrad.engine("backprop"), per_layer=False)
    half = slice(ctx.rank * 8, ctx.rank * 8 + 8)
    mine = step(model, x[half], y[half])
    ranks = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    if ctx.rank == 0:
        total = {r: sum(v.values()) for r, v in enumerate(ranks)}  # type: ignore[union-attr]
        report = {"model": f"mlp(64, {WIDTH}, {DEPTH}, 10)", "world_size": ctx.world_size,
                  "one_process": whole, "per_rank": ranks,
                  "ratio_per_rank": {r: t / sum(whole.values()) for r, t in total.items()},
                  "torch": torch.__version__}  # fmt: skip
        show_and_save(report, out, newline=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
