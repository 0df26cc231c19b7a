"""``fit(parallel="fsdp")`` on 2 local processes (gloo): FSDP2 shards every
block and the root, so each rank holds half of the parameters, gradients and Adam state;
training equals one process on the combined batch; a checkpoint holds the whole state and
a resume from it ends bit-equal to the uninterrupted run; an engine that does not run
FSDP2's own backward is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leangrad import models, train
from two_processes import run_two_json

WORKER = r'''
import sys
from pathlib import Path
import torch
from leangrad import models, train, _errors as errors
from two_processes import finish

torch.set_num_threads(1)
out_dir = Path(sys.argv[1])
ctx = train.init_distributed(torch.device("cpu"))
kw = {"data": "synthetic", "data_options": {"n": 160}, "optimizer": "adam", "lr": 0.01,
      "progress": False, "track_memory_every": 1, "batch_size": 8, "plots": False,
      "parallel": "fsdp", "test_fraction": 0.0}
def build():
    torch.manual_seed(0)
    return models.mlp(64, 32, 3, 10)
whole = train.fit(build(), max_steps=4, checkpoint_every=2, **kw, out=out_dir / "run")
params = dict(whole.model.named_parameters())
local = sum(p.to_local().numel() for p in params.values())
full = {n: p.full_tensor().flatten().tolist() for n, p in params.items()}
ckpt = sorted((out_dir / "run" / "checkpoints").glob("step-*"))
part = train.fit(build(), max_steps=4, checkpoint_every=2, **kw, resume=ckpt[0],
                 out=out_dir / "run")
resumed = {n: p.full_tensor().flatten().tolist() for n, p in part.model.named_parameters()}
try:
    train.fit(build(), max_steps=1, engine="forward", **kw)
    refused = "trained"
except errors.LeangradError as err:
    refused = str(err)
planned = train.fit(build(), max_steps=1, budget="64MiB", **kw).config
finish({"planned": [planned.engine, planned.step_per_layer], "local": local, "full": full,
        "resumed": resumed, "refused": refused, "ckpts": [p.name for p in ckpt]})
'''



@pytest.mark.slow
def test_fsdp_shards_trains_like_one_process_and_resumes(tmp_path: Path) -> None:
    ranks = run_two_json(WORKER, tmp_path)
    torch.manual_seed(0)
    one = train.fit(models.mlp(64, 32, 3, 10), "synthetic", data_options={"n": 160},
                    optimizer="adam", lr=0.01, progress=False, track_memory_every=0,
                    batch_size=16, plots=False, max_steps=4, test_fraction=0.0)  # fmt: skip
    total = sum(p.numel() for p in one.model.parameters())
    for r in ranks:
        assert r["local"] <= total // 2 + 64, (r["local"], total)  # half, up to padding
        assert len(r["ckpts"]) == 2, r["ckpts"]
        assert r["resumed"] == r["full"], "the resumed run differs from the whole one"
        assert "--parallel fsdp" in r["refused"] and "backprop" in r["refused"], r["refused"]
        assert r["planned"] == ["backprop", False], r["planned"]  # per-rank budget, one choice
        for n, p in one.model.named_parameters():
            torch.testing.assert_close(torch.tensor(r["full"][n]), p.detach().flatten(),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
    assert ranks[0]["full"] == ranks[1]["full"]
