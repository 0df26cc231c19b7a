"""FSDP2 on a model whose block's submodule is reached under a second name outside the
block: ``self.alias = self.layers[1].fc``, or the tied GPT whose first two
blocks share one MLP, also called as ``extra``. ``fully_shard`` on each block, then the
root, failed inside torch (``Invariant encountered: value was None``: the alias's
parameters sharded twice); such blocks are now left to the root's unit, with a warning
naming the block and the alias. On 2 local processes (gloo), float64: backprop and
checkpoint give gradients equal to one process's backprop on the combined batch, the
other blocks are still units of their own, and ``fit(parallel="fsdp")`` trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from two_processes import run_two

WORKER = r'''
import copy, json, sys, warnings
from pathlib import Path
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
import leangrad
from leangrad import train, zoo
from leangrad.train._sharded import shard

torch.set_num_threads(1)
out_dir = Path(sys.argv[1])
ctx = train.init_distributed(torch.device("cpu"))
DT = torch.float64


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.fc(x)


class AliasMLP(nn.Module):  # layers.1.fc also called as alias, after the blocks
    def __init__(self, d_in=4, classes=3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d_in, 6)
        self.layers = nn.ModuleList([Block(6) for _ in range(3)])
        self.alias = self.layers[1].fc
        self.out = nn.Linear(6, classes)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(torch.tanh(x + self.alias(x)))


class SharedGPT(nn.Module):  # tied head; blocks 0 and 1 share one MLP, also called as extra
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = zoo.gpt(vocab=12, dim=8, layers=3, heads=2, context=8)
        self.g.head.weight = self.g.tok.weight
        self.g.blocks[1].mlp = self.g.blocks[0].mlp
        self.extra = self.g.blocks[0].mlp

    def forward(self, idx):
        g = self.g
        x = g.tok(idx) + g.pos[: idx.shape[1]]
        for block in g.blocks:
            x = block(x)
        return g.head(g.ln_f(x + self.extra(x)))


torch.manual_seed(1)
cases = {"mlp": (AliasMLP, torch.randn(8, 4, dtype=DT), torch.randint(0, 3, (8,))),
         "gpt": (SharedGPT, torch.randint(0, 12, (8, 6)), torch.randint(0, 12, (8, 6)))}
half = slice(4 * ctx.rank, 4 * ctx.rank + 4)
out = {}
for kind, (cls, x, y) in cases.items():
    def loss_of(o, y):
        return F.cross_entropy(o.flatten(0, -2), y.flatten())
    ref = cls().to(DT)
    loss_of(ref(x), y).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for name in ("backprop", "checkpoint"):
        eng = leangrad.engine(name)
        model = cls().to(DT)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shard(model, eng, per_layer=False)
        units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
        for _ in range(2):  # a second step too
            model.zero_grad(set_to_none=True)
            eng.backward(model, x[half], lambda o: loss_of(o, y[half]))
        err = max(float((p.grad.full_tensor() - want[n]).abs().max() / want[n].abs().max())
                  for n, p in model.named_parameters())
        out[f"{kind} {name}"] = {"units": units, "err": err,
                                 "warned": [str(w.message) for w in caught]}
kw = {"data": "synthetic", "data_options": {"n": 64}, "optimizer": "adam", "lr": 0.01,
      "progress": False, "track_memory_every": 0, "batch_size": 8, "plots": False,
      "parallel": "fsdp", "test_fraction": 0.0, "max_steps": 2}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fitted = train.fit(AliasMLP(64, 10), **kw)
out["fit"] = [fitted.steps, fitted.final_loss]
json.dump(out, open(out_dir / f"rank{ctx.rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_aliased_blocks_are_left_to_the_root_and_gradients_are_exact(tmp_path: Path) -> None:
    run_two(WORKER, tmp_path)
    units = {"mlp": ["", "layers.0", "layers.2"], "gpt": ["", "g.blocks.2"]}
    alias = {"mlp": ["layers.1 (also as alias.0.weight"],
             "gpt": ["g.blocks.0 (also as g.blocks.1.mlp.", "g.blocks.1 (also as g.blocks.0.mlp."]}
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        for kind in ("mlp", "gpt"):
            for name in ("backprop", "checkpoint"):
                case = got[f"{kind} {name}"]
                assert case["err"] <= 1e-12, (kind, name, case["err"])
                assert case["units"] == units[kind], (kind, name, case["units"])
                assert len(case["warned"]) == 1, case["warned"]
                msg = case["warned"][0]
                assert "not an FSDP unit" in msg and "drop the second name" in msg, msg
                assert all(a in msg for a in alias[kind]), msg
        steps, loss = got["fit"]
        assert steps == 2 and loss == loss and loss < 10, got["fit"]  # trained, finite
