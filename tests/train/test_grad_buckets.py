"""GradBuckets on 2 local processes (gloo): gradients handed over by an engine that is not
autograd's own backward are averaged in buckets whose all-reduces start while the backward
still runs (not one blocking all-reduce per parameter after it), equal to one process on
the combined batch; with ``then`` (per-layer optimizer steps) each parameter is handed on
once, after its bucket is averaged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import models, train
from leangrad.train._buckets import GradBuckets
from two_processes import run_two

WORKER = r'''
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
import leangrad
from leangrad import models, train
from leangrad.train import _buckets

torch.set_num_threads(1)
ctx = train.init_distributed(torch.device("cpu"))
events = []
real = dist.all_reduce
def logged(t, *a, **k):
    events.append(("all_reduce", t.numel()))
    return real(t, *a, **k)
_buckets.dist.all_reduce = logged
out = {}
for engine, per_layer in [("forward", False), ("moonwalk", True), ("checkpoint", True)]:
    torch.manual_seed(0)
    model = models.submersive_cnn(1, 8, 3, 10).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (16,), generator=gen)
    half = slice(ctx.rank * 8, ctx.rank * 8 + 8)
    got = {}
    def then(n, p):
        events.append(("then", n))
        got[n] = p.grad.clone()
        p.grad = None  # as a per-layer optimizer step does
    buckets = _buckets.GradBuckets(ctx, then=then if per_layer else None, bucket_bytes=2048)
    def on_grad(n, p):
        events.append(("on_grad", n))
        buckets.on_grad(n, p)
    events.clear()
    leangrad.engine(engine).backward(model, x[half], lambda o: F.cross_entropy(o, y[half]),
                                     on_grad=on_grad)
    events.append(("returned", None))
    buckets.finish(model.named_parameters())
    if not per_layer:
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    out[engine] = {"grads": got, "events": list(events)}
torch.save(out, f"{sys.argv[1]}/rank{ctx.rank}.pt")
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_buckets_average_while_the_backward_runs(tmp_path: Path) -> None:
    run_two(WORKER, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for engine in ("forward", "moonwalk", "checkpoint"):
        torch.manual_seed(0)
        model = models.submersive_cnn(1, 8, 3, 10).double()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(16, 1, 8, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (16,), generator=gen)
        leangrad.engine("backprop").backward(model, x, lambda o, y=y: F.cross_entropy(o, y))
        for rank in ranks:
            got, events = rank[engine]["grads"], rank[engine]["events"]
            assert set(got) == {n for n, _ in model.named_parameters()}, engine
            for n, p in model.named_parameters():
                torch.testing.assert_close(got[n], p.grad, rtol=1e-12, atol=1e-14)
            kinds = [e[0] for e in events]
            assert kinds.count("all_reduce") >= 2, (engine, events)  # several buckets
            # fewer collectives than parameters: buckets, not one per parameter
            assert kinds.count("all_reduce") < len(got), (engine, events)
            if engine == "forward":
                continue  # forward-mode forms every gradient at the end: nothing to overlap
            # the first bucket is on the wire before the engine hands over its last gradient
            last_handover = max(i for i, k in enumerate(kinds) if k == "on_grad")
            assert kinds.index("all_reduce") < last_handover, (engine, events)
            if engine in ("moonwalk", "checkpoint"):
                thens = [e[1] for e in events if e[0] == "then"]
                assert sorted(thens) == sorted(got), engine  # each parameter once


def test_one_process_hands_on_unchanged() -> None:
    """Without a process group the buckets only pass gradients on, in hand-over order."""
    torch.manual_seed(0)
    model = models.mlp(8, 4, 2, 3)
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    seen: list[str] = []
    buckets = GradBuckets(train.DistContext(), then=lambda n, p: seen.append(n),
                          bucket_bytes=1)  # fmt: skip
    leangrad.engine("backprop").backward(model, x, lambda o: F.cross_entropy(o, y),
                                         on_grad=buckets.on_grad)  # fmt: skip
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    buckets.finish(model.named_parameters())
    assert sorted(seen) == sorted(want) and len(seen) == len(want)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n])
