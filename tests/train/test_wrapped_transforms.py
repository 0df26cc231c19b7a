"""The transforms of the step on a model wrapped by DDP or sharded by FSDP2 (2 local
processes, gloo): ``chunked_ce``, ``accumulate(2)``, ``checkpoint+accumulate(2)``,
``checkpoint+chunked_ce`` and ``checkpoint(fragments=2)`` given the wrapped model, as
torchtitan's recipes shard a language model (each block a unit of its own, then the root),
each equal to one process on the combined batch (float64, within 1e-10), with as many
gradient reductions per step as plain backprop's (DDP: one per bucket; FSDP2: one per
unit) — accumulation reduces once, after its last micro-batch — and ``on_grad`` handed
the averaged gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from two_processes import run_two

ENGINES = ["backprop", "chunked_ce", "accumulate(2)", "checkpoint+accumulate(2)",
           "checkpoint+chunked_ce", "checkpoint(fragments=2)"]  # fmt: skip

WORKER = r'''
import json, sys
import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
import leangrad
from leangrad.loss import per_example

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
REDUCED = [0]
reduce_units = fsdp_group.foreach_reduce
def counted(*a, **k):
    REDUCED[0] += 1
    return reduce_units(*a, **k)
fsdp_group.foreach_reduce = counted
def bucket_hook(state, bucket):
    REDUCED[0] += 1
    work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)
    return work.get_future().then(lambda f: f.value()[0])

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))

class LM(nn.Module):
    def __init__(self, vocab=1100, d=16, n=3):  # a vocabulary chunked_ce chunks (>= 1024)
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))

def made():
    torch.manual_seed(0)
    model = LM().double()
    with torch.no_grad():  # norms off their initialisation
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.3); m.bias.normal_(0.0, 0.3)
    return model

def engine(name):
    if name == "checkpoint(fragments=2)":
        return leangrad.engine("checkpoint", fragments=2)
    base, _, k = name.partition("(")
    return leangrad.engine(base, micro_batches=int(k[:-1])) if k else leangrad.engine(base)

def ce(out, t):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))

gen = torch.Generator().manual_seed(1)
ids = torch.randint(0, 1100, (8, 12), generator=gen)
tgt = torch.randint(0, 1100, (8, 12), generator=gen)
mine = slice(rank * 4, rank * 4 + 4)
ref = made()
leangrad.engine("backprop").backward(ref, ids, per_example(ce, tgt))
want = {n: p.grad for n, p in ref.named_parameters()}
out = {}
for wrap in ("ddp", "fsdp"):
    for name in sys.argv[2].split(","):
        model = made()
        if wrap == "ddp":
            wrapped = DDP(model)
            wrapped.register_comm_hook(None, bucket_hook)
        else:
            for b in model.blocks:
                fully_shard(b)
            wrapped = fully_shard(model)
        seen = {}
        REDUCED[0] = 0
        res = engine(name).backward(wrapped, ids[mine], per_example(ce, tgt[mine]),
                                    on_grad=lambda n, p: seen.setdefault(n, p.grad))
        chunked = bool(res.info.get("chunked_ce", {}).get("model", {}).get("swapped"))
        def full(g):
            return g.full_tensor() if hasattr(g, "full_tensor") else g
        worst = max(float((full(p.grad) - want[n]).abs().max())
                    for n, p in model.named_parameters())
        handed = max(float((full(g) - want[n.removeprefix("module.")]).abs().max())
                     for n, g in seen.items())
        out[f"{wrap} {name}"] = {"worst": worst, "handed": handed, "count": len(seen),
                                 "reductions": REDUCED[0], "chunked": chunked}
# the head as an FSDP unit of its own frees its weight after its forward: refused, named
model = made()
for b in model.blocks:
    fully_shard(b)
fully_shard(model.head)
try:
    engine("chunked_ce").backward(fully_shard(model), ids[mine], per_example(ce, tgt[mine]))
    out["head unit"] = "ran"
except leangrad.EngineInputError as err:
    out["head unit"] = str(err)
json.dump(out, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow  # two processes: make test-slow
def test_step_transforms_on_ddp_and_fsdp2_equal_one_process(tmp_path: Path) -> None:
    run_two(WORKER, tmp_path, ",".join(ENGINES))
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for wrap in ("ddp", "fsdp"):
            plain = got[f"{wrap} backprop"]
            for name in ENGINES:
                cell = got[f"{wrap} {name}"]
                assert cell["worst"] <= 1e-10, (wrap, name, cell)
                assert cell["handed"] <= 1e-10, (wrap, name, cell)
                assert cell["count"] == plain["count"] > 0, (wrap, name, cell)
                assert cell["reductions"] == plain["reductions"] > 0, (wrap, name, cell)
                assert cell["chunked"] == ("chunked_ce" in name), (wrap, name, cell)
        assert "FSDP unit of its own" in got["head unit"] and "'head'" in got["head unit"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_the_refusals_that_remain_name_why(wrap: str) -> None:
    import leangrad
    from leangrad.engines._wrapped import DDP, FSDP2

    name = DDP if wrap == "ddp" else FSDP2
    eng = leangrad.engine("checkpoint", fragments=2, fragment_blocks=1)
    why = eng.wrapped_why(leangrad.models.mlp(4, 4, 1, 2), name)
    if wrap == "ddp":
        assert why is None
    else:
        assert why is not None and "fragment_blocks" in why and "copied" in why
