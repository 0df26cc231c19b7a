"""Engines given a model wrapped by PyTorch's DistributedDataParallel or FSDP2, on 2 local
processes (gloo): plain backprop is DDP's (and FSDP2's) own backward, so its gradients —
and what ``on_grad`` receives — are the average over processes, equal to one process on the
combined batch; every other engine (and ``plan``) refuses, naming how to unwrap the model,
instead of leaving each process its own local gradient in silence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import models
from two_processes import run_two

WORKER = r'''
import json, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import leangrad
from leangrad import models, _errors as errors

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = models.mlp(32, 16, 2, 10).double()
gen = torch.Generator().manual_seed(1)
x = torch.randn(16, 32, generator=gen, dtype=torch.float64)
y = torch.randint(0, 10, (16,), generator=gen)
half = slice(rank * 8, rank * 8 + 8)
loss_fn = lambda o: F.cross_entropy(o, y[half])
out = {"seen": {}, "refused": {}}
ddp = DDP(model)
def keep(name, p):
    out["seen"][name] = p.grad.flatten().tolist()
leangrad.engine("backprop").backward(ddp, x[half], loss_fn, on_grad=keep)
out["grads"] = {n: p.grad.flatten().tolist() for n, p in ddp.named_parameters()}
for name in ["forward", "accumulate", "backprop+fad", "checkpoint+rad"]:  # checkpoint runs
    try:
        leangrad.engine(name).backward(ddp, x[half], loss_fn)
        out["refused"][name] = "ran"
    except errors.EngineInputError as err:
        out["refused"][name] = str(err)
try:
    leangrad.plan(ddp, x[half], loss_fn, budget=2**30)
    out["plan"] = "ran"
except errors.EngineInputError as err:
    out["plan"] = str(err)
try:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)  # the same initial weights as the DDP model
    sharded = models.mlp(32, 16, 2, 10).double()
    fully_shard(sharded)
    leangrad.engine("backprop").backward(sharded, x[half], loss_fn)
    out["fsdp_grads"] = {n: p.grad.full_tensor().flatten().tolist()
                         for n, p in sharded.named_parameters()}
    leangrad.engine("accumulate").backward(sharded, x[half], loss_fn)
    out["fsdp"] = "ran"
except errors.EngineInputError as err:
    out["fsdp"] = str(err)
except Exception as err:  # FSDP2 not usable on this CPU build: the refusal is not reached
    out["fsdp"] = f"unavailable: {type(err).__name__}: {err}"
json.dump(out, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
dist.barrier()  # no rank tears its connections down while another still uses them
dist.destroy_process_group()
'''



@pytest.mark.slow
def test_backprop_through_ddp_and_refusals_elsewhere(tmp_path: Path) -> None:
    run_two(WORKER, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    model = models.mlp(32, 16, 2, 10).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (16,), generator=gen)
    leangrad.engine("backprop").backward(model, x, lambda o: F.cross_entropy(o, y))
    for rank in ranks:
        for n, p in model.named_parameters():
            want = p.grad.flatten()
            for got in (rank["grads"][f"module.{n}"], rank["seen"][f"module.{n}"]):
                torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                           rtol=1e-12, atol=1e-14)  # fmt: skip
        for name, why in rank["refused"].items():
            assert "DistributedDataParallel" in why and "ddp.module" in why, (name, why)
        assert "plan" in rank["plan"] and "ddp.module" in rank["plan"], rank["plan"]
        if not rank["fsdp"].startswith("unavailable"):
            assert "FSDP2 (fully_shard)" in rank["fsdp"], rank["fsdp"]
            for n, p in model.named_parameters():  # backprop through FSDP2: sharded, averaged
                torch.testing.assert_close(torch.tensor(rank["fsdp_grads"][n],
                                                        dtype=torch.float64),
                                           p.grad.flatten(), rtol=1e-12, atol=1e-14)  # fmt: skip
