"""Randomness per rank under 2 local processes (gloo, issue 32), training backprop through
PyTorch's DistributedDataParallel: every rank draws its own
dropout masks (and estimator samples) from ``seed``, instead of all ranks drawing the same
ones, and a resumed run continues each rank's own stream, so it ends bit-equal to an
uninterrupted run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = r'''
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from leangrad import train

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
json.dump(res, open(out_dir / f"rank{ctx.rank}.json", "w"))
dist.barrier()  # no rank tears its connections down while another still uses them
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ranks_draw_their_own_masks_and_resume_their_own_streams(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    src = Path(__file__).resolve().parents[2] / "src"
    base = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": "2"}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                         env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["ddp_forwards"] >= 4 for r in ranks), "backprop trains through DDP"
    assert ranks[0]["mask"] != ranks[1]["mask"], "both ranks drew the same dropout mask"
    for r in ranks:
        assert len(r["ckpts"]) == 2, r["ckpts"]  # resumed from step 2 of 4
        assert r["resumed"] == r["whole"], "the resumed run left its rank's random stream"
    assert ranks[0]["whole"] == ranks[1]["whole"], "ranks hold different weights"
