"""Randomness per rank under 2 local processes (gloo), training backprop through
PyTorch's DistributedDataParallel: every rank draws its own
dropout masks (and estimator samples) from ``seed``, instead of all ranks drawing the same
ones, and a resumed run continues each rank's own stream, so it ends bit-equal to an
uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from two_processes import run_two_json

WORKER = r'''
import sys
from pathlib import Path
import torch
from torch import nn
from leangrad import train
from two_processes import finish

torch.set_num_threads(1)
out_dir = Path(sys.argv[1])
from torch.nn.parallel import DistributedDataParallel as DDP
ddp_forwards = []
plain = DDP.forward
def counted(self, *args, **kwargs):
    ddp_forwards.append(1)
    return plain(self, *args, **kwargs)
DDP.forward = counted
ctx = train.init_distributed(torch.device("cpu"))

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))

masks = []
def keep(module, args, output):
    masks.append((output == 0).flatten().tolist())

kw = {"data": "synthetic", "data_options": {"n": 160}, "optimizer": "sgd", "lr": 0.1,
      "progress": False, "track_memory_every": 0, "batch_size": 8, "plots": False}
net = build()
net[2].register_forward_hook(keep)
whole = train.fit(net, max_steps=4, checkpoint_every=2, **kw, out=out_dir / "whole")
first_mask = masks[0]
ckpt = out_dir / "whole" / "checkpoints"
part = train.fit(build(), max_steps=4, checkpoint_every=2, **kw,
                 resume=sorted(ckpt.glob("*.pt"))[0],
                 out=out_dir / "whole")
res = {"mask": first_mask, "ddp_forwards": len(ddp_forwards),
       "ckpts": sorted(p.name for p in ckpt.glob("*.pt")),
       "whole": [p.detach().flatten().tolist() for p in whole.model.parameters()],
       "resumed": [p.detach().flatten().tolist() for p in part.model.parameters()]}
finish(res)
'''



@pytest.mark.slow
def test_ranks_draw_their_own_masks_and_resume_their_own_streams(tmp_path: Path) -> None:
    ranks = run_two_json(WORKER, tmp_path)
    assert all(r["ddp_forwards"] >= 4 for r in ranks), "backprop trains through DDP"
    assert ranks[0]["mask"] != ranks[1]["mask"], "both ranks drew the same dropout mask"
    for r in ranks:
        assert len(r["ckpts"]) == 2, r["ckpts"]  # resumed from step 2 of 4
        assert r["resumed"] == r["whole"], "the resumed run left its rank's random stream"
    assert ranks[0]["whole"] == ranks[1]["whole"], "ranks hold different weights"
