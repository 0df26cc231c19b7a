"""Wall time of leangrad.plan on the full-size zoo llama at 1/2 (1 thread). Usage: python plan_wall.py REPO"""
import sys, time, tomllib, json
from pathlib import Path
repo = Path(sys.argv[1]); sys.path.insert(0, str(repo / "src"))
import torch
torch.set_num_threads(1)
import leangrad
from leangrad.bench._models import build
from leangrad.measure import profile_step
size = dict(tomllib.loads((repo / "src/leangrad/bench/suites/zoo.toml").read_text())["settings"]["models"]["llama"])
w = build("llama", size)
bp = profile_step(leangrad.engine("backprop"), w.model, w.inputs, w.loss_fn, repeats=0)
frac = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
budget = bp.baseline_bytes + int(frac * bp.peak_bytes)
t0 = time.perf_counter()
log = []  # (seconds since start, what the plan was doing): where the wall time goes
p = leangrad.plan(w.model, w.inputs, w.loss_fn, budget=budget, exact=True,
                  progress=lambda what: log.append((round(time.perf_counter() - t0, 1), what)))
wall = time.perf_counter() - t0
print(json.dumps({"repo": str(repo), "fraction": frac, "wall_s": wall, "chosen": str(getattr(p, "chosen", None))[:300]}))
print(p)
if "--log" in sys.argv:
    for t, what in log:
        print(f"{t:7.1f}  {what}")
