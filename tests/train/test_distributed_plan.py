"""``fit(budget=...)`` on 2 local processes (gloo): rank 0 plans alone and every rank
trains with its choice ( each rank planning on its own chose differently and gloo
aborted on mismatched collectives); a budget nothing fits is refused on every rank, none
left waiting. Rank 1's planner is made to fail here, so a pass shows it never ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from two_processes import run_two

WORKER = r'''
import json, sys
import torch
import torch.distributed as dist
from leangrad import _errors as errors, train
import leangrad.planner._plan

torch.set_num_threads(1)
ctx = train.init_distributed(torch.device("cpu"))
if ctx.rank != 0:
    def refuse(*args, **kwargs):
        raise AssertionError("rank 1 planned")
    leangrad.planner._plan.plan = refuse
kw = {"data": "synthetic", "data_options": {"n": 64}, "max_steps": 2, "optimizer": "sgd",
      "lr": 0.1, "progress": False, "track_memory_every": 0, "batch_size": 8,
      "plan_engines": ["backprop", "checkpoint", "accumulate"]}
res = train.fit("mlp", budget=sys.argv[2], **kw)
out = {"engine": res.config.engine, "options": res.config.engine_options,
       "per_layer": res.config.step_per_layer,
       "weights": [p.detach().sum().item() for p in res.model.parameters()]}
try:
    train.fit("mlp", budget=1, **kw)
    out["tiny"] = "trained"
except errors.LeangradError as err:
    out["tiny"] = type(err).__name__
json.dump(out, open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w"))
dist.barrier()  # no rank tears its connections down while another still uses them
dist.destroy_process_group()
'''



@pytest.mark.slow
def test_rank_zero_plans_and_every_rank_trains_its_choice(tmp_path: Path) -> None:
    logs = run_two(WORKER, tmp_path, "1GiB")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for key in ("engine", "options", "per_layer", "weights"):
        assert ranks[0][key] == ranks[1][key], (key, ranks)
    assert [r["tiny"] for r in ranks] == ["EngineInputError"] * 2
    assert "chosen" in logs[0] and "nothing fits" in logs[0], logs[0]
    assert "chosen" not in logs[1] and "fits" not in logs[1], logs[1]  # printed once
