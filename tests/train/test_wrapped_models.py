"""Engines given a model wrapped by PyTorch's DistributedDataParallel or FSDP2, on 2 local
processes (gloo): plain backprop is DDP's (and FSDP2's) own backward, so its gradients —
and what ``on_grad`` receives — are the average over processes, equal to one process on the
combined batch. Under DDP every other engine runs on the module DDP wraps and hands its
gradients to DDP's own backward (``leangrad.surrogate_loss``): equal too. ``plan``, and
under FSDP2 an engine whose backward is not the wrapper's, refuse, naming how to unwrap
the model, instead of leaving each process its own local gradient in silence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import models
from two_processes import run_two_json

WORKER = r'''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import leangrad
from leangrad import models, _errors as errors
from leangrad.loss import per_example
from two_processes import finish

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
out["ran"] = {}
for name in ["forward", "accumulate", "backprop+fad", "checkpoint+rad"]:
    ddp.zero_grad(set_to_none=True)
    lf = per_example(F.cross_entropy, y[half]) if name == "accumulate" else loss_fn
    leangrad.engine(name).backward(ddp, x[half], lf)
    out["ran"][name] = {n: p.grad.flatten().tolist() for n, p in ddp.named_parameters()}
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
    leangrad.engine("forward").backward(sharded, x[half], loss_fn)
    out["fsdp"] = "ran"
except errors.EngineInputError as err:
    out["fsdp"] = str(err)
except Exception as err:  # FSDP2 not usable on this CPU build: the refusal is not reached
    out["fsdp"] = f"unavailable: {type(err).__name__}: {err}"
finish(out)
'''



@pytest.mark.slow
def test_every_engine_through_ddp_and_refusals_elsewhere(tmp_path: Path) -> None:
    ranks = run_two_json(WORKER, tmp_path)
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
        for name, grads in rank["ran"].items():
            if name == "checkpoint+rad":  # an estimator: each rank draws its own
                assert set(grads) == set(rank["grads"])
                continue
            for n, p in model.named_parameters():
                torch.testing.assert_close(torch.tensor(grads[f"module.{n}"],
                                                        dtype=torch.float64),
                                           p.grad.flatten(), rtol=1e-12, atol=1e-14)  # fmt: skip
        assert "plan" in rank["plan"] and "ddp.module" in rank["plan"], rank["plan"]
        if not rank["fsdp"].startswith("unavailable"):
            assert "FSDP2 (fully_shard)" in rank["fsdp"], rank["fsdp"]
            for n, p in model.named_parameters():  # backprop through FSDP2: sharded, averaged
                torch.testing.assert_close(torch.tensor(rank["fsdp_grads"][n],
                                                        dtype=torch.float64),
                                           p.grad.flatten(), rtol=1e-12, atol=1e-14)  # fmt: skip
