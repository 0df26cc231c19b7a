"""Where a full-size zoo plan's wall time goes: Engine.backward calls and seconds per phase
(peak measurements, timing), fake-tensor estimates, with the progress timestamps.
``PYTHONPATH=src python results/issue31/plan_steps.py bert 0.5`` (alone: it times)."""
import sys, time, collections, torch
torch.set_num_threads(1)
from leangrad.bench._models import build
from leangrad import plan
from leangrad.engines import Engine
from leangrad.measure import profile_step
import leangrad.measure as M, leangrad._plan_measure as PM
name = sys.argv[1]; frac = float(sys.argv[2])
sizes = {"bert": dict(vocab=256, dim=256, layers=8, heads=4, context=256, batch=32),
         "gru_lm": dict(vocab=128, embed=64, hidden=512, layers=2, length=256, batch=128)}
wl = build(name, sizes[name], device="cpu")
model, x, loss_fn = wl.model, wl.inputs, wl.loss_fn
from leangrad.engines import engine
bp = profile_step(engine("backprop"), model, x, loss_fn, repeats=0)
budget = bp.baseline_bytes + int(frac * bp.peak_bytes)
counts = collections.Counter(); secs = collections.Counter()
phase = ["?"]
orig = Engine.backward
def counted(self, *a, **k):
    t = time.perf_counter()
    try: return orig(self, *a, **k)
    finally:
        counts[phase[0]] += 1; secs[phase[0]] += time.perf_counter() - t
Engine.backward = counted
oest = PM.estimate_step
def est(*a, **k):
    t = time.perf_counter()
    try: return oest(*a, **k)
    finally: counts["estimate"] += 1; secs["estimate"] += time.perf_counter() - t
PM.estimate_step = est
t0 = time.perf_counter()
def prog(msg):
    phase[0] = "timing" if msg.startswith(("timing", "round", "race", "again")) or "round" in msg else ("peak" if msg.startswith("peak") else msg[:30])
    print(f"{time.perf_counter()-t0:7.1f}s {msg}", flush=True)
p = plan(model, x, loss_fn, budget=budget, exact=True, repeats=3, progress=prog)
print("wall", round(p.wall_seconds, 1), "backprop step bytes", bp.peak_bytes)
for k in counts: print(f"{k:32s} calls {counts[k]:3d}  {secs[k]:7.1f}s")
print(p)
