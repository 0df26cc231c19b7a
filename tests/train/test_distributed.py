"""Data parallel on 2 local processes (gloo): gradients equal one process on the combined
batch, for backprop (averaged after backward) and Moonwalk (averaged as each layer's
gradient is handed over), and ``fit`` under torchrun's environment trains like one
process with the combined batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import models, train
from two_processes import run_two

WORKER = r'''
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
import leangrad
from leangrad import models, train

torch.set_num_threads(1)
sys.path.insert(0, sys.argv[2])
from test_distributed import CASES, FIT, batch

ctx = train.init_distributed(torch.device("cpu"))
assert ctx.enabled and ctx.world_size == 2 and ctx.backend == "gloo"
out = {}
for name, (build, shape, per_layer) in CASES.items():
    torch.manual_seed(ctx.rank)  # different inits: broadcast_parameters must unify them
    model = build()
    from leangrad.train._distributed import broadcast_parameters
    broadcast_parameters(model, ctx)
    x, y = batch(shape)
    half = slice(ctx.rank * 8, ctx.rank * 8 + 8)
    loss_fn = lambda o, y=y[half]: F.cross_entropy(o, y)
    grads = {}
    def keep(n, p):
        grads[n] = p.grad.clone()
        p.grad = None  # as a per-layer optimizer step would
    eng = leangrad.engine(name)
    if per_layer:
        eng.backward(model, x[half], loss_fn, on_grad=train.averaging_on_grad(ctx, keep))
    else:
        eng.backward(model, x[half], loss_fn)
        train.average_gradients(model.named_parameters(), ctx)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out[name] = grads
for model, kw in FIT.items():
    res = train.fit(model, **kw, batch_size=8)
    out["fit-" + model] = res.model.state_dict()
torch.save(out, f"{sys.argv[1]}/rank{ctx.rank}.pt")
dist.barrier()  # no rank tears its connections down while another still uses them
dist.destroy_process_group()
'''

CASES = {
    "backprop": (lambda: models.mlp(64, 16, 2, 10), (64,), False),
    "moonwalk": (lambda: models.submersive_cnn(1, 8, 3, 10), (1, 8, 8), True),
}
FIT = {
    "mlp": {"data": "synthetic", "data_options": {"n": 80}, "max_steps": 3,
            "optimizer": "sgd", "lr": 0.5, "progress": False, "track_memory_every": 1},
    "submersive_cnn": {"data": "synthetic", "data_options": {"n": 80, "shape": [1, 8, 8]},
                       "engine": "moonwalk", "step_per_layer": True, "max_steps": 3,
                       "optimizer": "sgd", "lr": 0.5, "progress": False, "track_memory_every": 0},
}  # fmt: skip


def batch(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The combined batch of 16 both processes split in halves."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, *shape, generator=gen), torch.randint(0, 10, (16,), generator=gen)



@pytest.mark.slow
def test_two_processes_equal_one_on_the_combined_batch(tmp_path) -> None:
    run_two(WORKER, tmp_path, str(Path(__file__).resolve().parent))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, (build, shape, _) in CASES.items():
        torch.manual_seed(0)  # rank 0's init, which the broadcast gave both processes
        model = build()
        x, y = batch(shape)
        leangrad.engine(name).backward(model, x, lambda o, y=y: F.cross_entropy(o, y))
        for r in range(2):
            assert ranks[r][name].keys() == dict(model.named_parameters()).keys()
            for n, p in model.named_parameters():
                torch.testing.assert_close(ranks[r][name][n], p.grad, rtol=1e-5, atol=1e-6)
    for model, kw in FIT.items():
        one = train.fit(model, **kw, batch_size=16).model.state_dict()
        for r in range(2):
            for k, v in one.items():
                torch.testing.assert_close(ranks[r][f"fit-{model}"][k], v, rtol=1e-5, atol=1e-6)
