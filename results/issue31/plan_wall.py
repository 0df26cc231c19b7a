"""Wall time of leangrad.plan on a full-size zoo model at a fraction of backprop's peak (1 thread).

Usage: python plan_wall.py REPO [FRACTION] [--model NAME] [--log] [--vs-backprop]
(default llama at 0.5; --log prints the progress timestamps: where the wall time went;
--vs-backprop then times the chosen engine beside backprop, 3 interleaved rounds after a
warm-up, for its time ratio)."""
import json
import sys
import time
import tomllib
from pathlib import Path

repo = Path(sys.argv[1])
sys.path.insert(0, str(repo / "src"))
import torch  # noqa: E402

torch.set_num_threads(1)
import leangrad  # noqa: E402
from leangrad.bench._models import build  # noqa: E402
from leangrad.measure import profile_step, time_interleaved  # noqa: E402

args = sys.argv[2:]
name = args[args.index("--model") + 1] if "--model" in args else "llama"
numbers = [a for a in args if a.replace(".", "", 1).isdigit()]
frac = float(numbers[0]) if numbers else 0.5
suite = tomllib.loads((repo / "src/leangrad/bench/suites/zoo.toml").read_text())
w = build(name, dict(suite["settings"]["models"][name]))
bp = profile_step(leangrad.engine("backprop"), w.model, w.inputs, w.loss_fn, repeats=0)
budget = bp.baseline_bytes + int(frac * bp.peak_bytes)
t0 = time.perf_counter()
log = []  # (seconds since start, what the plan was doing)
p = leangrad.plan(w.model, w.inputs, w.loss_fn, budget=budget, exact=True,
                  progress=lambda what: log.append((round(time.perf_counter() - t0, 1), what)))
wall = time.perf_counter() - t0
chosen = p.chosen
print(json.dumps({"model": name, "fraction": frac, "wall_s": round(wall, 1),
                  "backprop_peak_bytes": bp.peak_bytes, "budget_bytes": budget,
                  "chosen": None if chosen is None else chosen.label,
                  "chosen_peak_ratio": None if chosen is None or chosen.peak_bytes is None
                  else round((chosen.peak_bytes - bp.baseline_bytes) / bp.peak_bytes, 3),
                  "chosen_seconds": None if chosen is None else chosen.seconds}))
print(p)
if "--log" in args:
    for t, what in log:
        print(f"{t:7.1f}  {what}")
if "--vs-backprop" in args and p.engine is not None:

    def stepper(eng):
        def step() -> None:
            w.model.zero_grad(set_to_none=True)
            eng.backward(w.model, w.inputs, w.loss_fn)

        return step

    t = time_interleaved({"backprop": stepper(leangrad.engine("backprop")),
                          "chosen": stepper(p.engine)}, repeats=3, warmup=1,
                         reference="backprop")
    print(json.dumps({k: {"median_s": round(v.median, 3), "ratio": v.ratio and round(v.ratio, 3)}
                      for k, v in t.items()}))
