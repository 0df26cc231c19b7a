"""RAD averaged over ranks: with each rank drawing its own samples
(``train.seed_per_rank``, as ``fit`` does under torchrun), the all-reduced RAD gradient of
one batch over N = 2 processes has about 1/N of one process's variance — the estimators
are independent. (Before, every rank drew the same samples and averaging changed nothing.)

Statistic: the variance over D draws of each coordinate, summed over coordinates, for 2
processes over 1; independent estimators give 0.5. With D = 300 draws and ~2,000
coordinates the summed variance is known to a few percent, so the window [0.4, 0.62] fails
an identical-samples run (ratio 1.0) and passes an independent one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import models
from two_processes import run_two

DRAWS = 300

WORKER = r'''
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
import leangrad
from leangrad import models, train

torch.set_num_threads(1)
ctx = train.init_distributed(torch.device("cpu"))
torch.manual_seed(0)
model = models.mlp(32, 32, 2, 10).double()
gen = torch.Generator().manual_seed(1)
x = torch.randn(64, 32, generator=gen, dtype=torch.float64)
y = torch.randint(0, 10, (64,), generator=gen)
train.seed_per_rank(0, ctx)
eng = leangrad.engine("rad", fraction=0.1)
draws = []
for _ in range(int(sys.argv[2])):
    model.zero_grad(set_to_none=True)
    eng.backward(model, x, lambda o: F.cross_entropy(o, y))
    train.average_gradients(model.named_parameters(), ctx)
    draws.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
if ctx.rank == 0:
    torch.save(torch.stack(draws), f"{sys.argv[1]}/draws.pt")
dist.barrier()  # no rank tears its connections down while another still uses them
dist.destroy_process_group()
'''



def _one_process_draws() -> torch.Tensor:
    torch.manual_seed(0)
    model = models.mlp(32, 32, 2, 10).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (64,), generator=gen)
    eng = leangrad.engine("rad", fraction=0.1)
    draws = []
    for _ in range(DRAWS):
        model.zero_grad(set_to_none=True)
        eng.backward(model, x, lambda o: F.cross_entropy(o, y))
        draws.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(draws)


@pytest.mark.slow
def test_rad_variance_falls_by_the_number_of_ranks(tmp_path: Path) -> None:
    run_two(WORKER, tmp_path, str(DRAWS))
    two = torch.load(tmp_path / "draws.pt", weights_only=True)
    one = _one_process_draws()
    ratio = (two.var(dim=0).sum() / one.var(dim=0).sum()).item()
    assert 0.4 < ratio < 0.62, ratio
    assert torch.allclose(two.mean(0), one.mean(0), atol=4 * one.std(0).max().item() / DRAWS**0.5)
