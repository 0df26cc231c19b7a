"""FSDP2 with leangrad's ``checkpoint+chunked_ce`` beside the torchtitan-style recipe
written by hand in PyTorch: ``fully_shard`` on each block and then the root, each block's
forward under ``torch.utils.checkpoint`` (non-reentrant), and a chunked loss that never
holds the whole batch's logits (each chunk's head matmul and cross-entropy under
``torch.utils.checkpoint``, summed). Plain FSDP2 backprop is the third row.

Per rank: the step's peak (leangrad's tracker: live tensor bytes above what existed
before the step — the rank's shards, its inputs) and the step time (median of interleaved
repeats after warm-up, 1 thread per process); gradients checked equal across the three.

Run alone: torchrun --nproc-per-node 2 results/distributed/fsdp_recipe.py [--out FILE]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import leangrad
from leangrad.loss import per_example
from leangrad.measure import MemoryTracker
from leangrad_bench._script import out_option, show_and_save

VOCAB, DIM, LAYERS, SEQ, BATCH = 8192, 256, 4, 128, 8  # BATCH per rank
CHUNKS = 8
REPEATS, WARMUP = 7, 2


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return self.head(self.hidden(ids))
        # The recipe's loss, inside the root's forward (where FSDP2 has gathered the head):
        # chunks of tokens, each chunk's head matmul and cross-entropy checkpointed, so no
        # chunk's logits outlive its own backward.
        h, y = self.hidden(ids).flatten(0, 1), targets.flatten()

        def chunk_loss(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(hc @ w.t(), yc, reduction="sum")

        total = sum(checkpoint(chunk_loss, hc, self.head.weight, yc, use_reentrant=False)
                    for hc, yc in zip(h.chunk(CHUNKS), y.chunk(CHUNKS), strict=True))
        return total / y.numel()  # type: ignore[no-any-return]


def sharded(*, recipe: bool) -> LM:
    torch.manual_seed(0)
    model = LM()
    for b in model.blocks:
        if recipe:  # torchtitan: the block's forward checkpointed, then the block sharded
            b.forward = _checkpointed(b.forward)  # type: ignore[method-assign]
        fully_shard(b)
    fully_shard(model)
    return model


def _checkpointed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(*args: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(fn, *args, use_reentrant=False)
        return out

    return run


def recipe_step(model: LM, ids: torch.Tensor, tgt: torch.Tensor) -> None:
    """The hand-written recipe: per-block checkpointing (in the model) and the chunked,
    checkpointed loss computed in the root's forward."""
    model(ids, tgt).backward()


def main() -> None:
    out = out_option()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)

    def ce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1))

    models = {"fsdp2 backprop": sharded(recipe=False), "torchtitan-style recipe":
              sharded(recipe=True), "leangrad checkpoint+chunked_ce": sharded(recipe=False)}
    engines = {"fsdp2 backprop": leangrad.engine("backprop"),
               "leangrad checkpoint+chunked_ce": leangrad.engine("checkpoint+chunked_ce")}

    def step(name: str) -> None:
        model = models[name]
        model.zero_grad(set_to_none=True)
        if name in engines:
            engines[name].backward(model, ids, per_example(ce, tgt))
        else:
            recipe_step(model, ids, tgt)

    peaks, grads = {}, {}
    for name, model in models.items():
        step(name)  # warm: the engine's probes, the allocator
        model.zero_grad(set_to_none=True)
        with MemoryTracker(baseline=(model, ids, tgt)) as tracker:
            step(name)
        peaks[name] = tracker.report.peak_bytes
        grads[name] = [p.grad.full_tensor() for p in model.parameters()]
    ref = grads["fsdp2 backprop"]
    worst = {n: max(float((a - b).abs().max()) for a, b in zip(g, ref, strict=True))
             for n, g in grads.items()}  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(WARMUP):
        for name in models:
            step(name)
    for _ in range(REPEATS):
        for name in models:  # interleaved
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    rows = [{"step": n, "peak_mib": peaks[n] / 2**20, "seconds": median[n],
             "time_vs_recipe": median[n] / median["torchtitan-style recipe"],
             "peak_vs_recipe": peaks[n] / peaks["torchtitan-style recipe"],
             "max_grad_diff_vs_backprop": worst[n]} for n in models]  # fmt: skip
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        report = {"model": f"LM vocab {VOCAB}, d {DIM}, {LAYERS} blocks, seq {SEQ}, batch "
                           f"{BATCH} per rank, float32", "torch": torch.__version__,
                  "processes": dist.get_world_size(), "repeats": REPEATS, "ranks": gathered}
        show_and_save(report, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
