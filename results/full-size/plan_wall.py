"""Wall time of leangrad.plan on a full-size zoo model at a fraction of backprop's peak (1 thread).

Usage: python plan_wall.py REPO [FRACTION] [--model NAME] [--log] [--steps] [--vs-backprop] [--compile]
(default llama at 0.5; --log prints the progress timestamps: where the wall time went;
--steps counts Engine.backward calls (nested ones included) and their seconds per phase,
peak measurements or timing, and the fake-tensor estimates, and prints each engine's
outermost real steps in order: phase and seconds (a peak measurement's tracked step against
its timed rounds);
--vs-backprop then times the chosen engine beside backprop, 3 interleaved rounds after a
warm-up, for its time ratio;
--compile plans with compile=True: torch.compile rows, each compiled cold in a worker process)."""
import collections
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
from leangrad_bench._models import build  # noqa: E402
from leangrad.measure import profile_step, time_interleaved  # noqa: E402

args = sys.argv[2:]
name = args[args.index("--model") + 1] if "--model" in args else "llama"
numbers = [a for a in args if a.replace(".", "", 1).isdigit()]
frac = float(numbers[0]) if numbers else 0.5
suite = tomllib.loads((repo / "benchmarks/leangrad_bench/suites/zoo.toml").read_text())
w = build(name, dict(suite["settings"]["models"][name]))
bp = profile_step(leangrad.engine("backprop"), w.model, w.inputs, w.loss_fn, repeats=0)
budget = bp.baseline_bytes + int(frac * bp.peak_bytes)
calls: collections.Counter[str] = collections.Counter()
spent: collections.Counter[str] = collections.Counter()
phase = ["setup"]


steps: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)  # label -> outermost
depth = [0]


def counted(fn, kind=None):  # fn's calls and seconds, under kind or the plan's phase
    def run(*a, **k):
        t = time.perf_counter()
        depth[0] += 1
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= 1
            dt = time.perf_counter() - t
            calls[kind or phase[0]] += 1
            spent[kind or phase[0]] += dt
            if kind is None and depth[0] == 0:  # an estimate's fake step runs at depth 1
                steps[a[0].label].append((phase[0], round(dt, 3)))

    return run


if "--steps" in args:
    import leangrad.planner._measure as plan_measure
    from leangrad.engines import Engine

    Engine.backward = counted(Engine.backward)
    plan_measure.estimate_step = counted(plan_measure.estimate_step, "estimate")
t0 = time.perf_counter()
log = []  # (seconds since start, what the plan was doing)


def progress(what: str) -> None:
    phase[0] = "timing" if what.startswith("timing") else "peak" if what.startswith("peak") \
        else what[:30]
    log.append((round(time.perf_counter() - t0, 1), what))


p = leangrad.plan(w.model, w.inputs, w.loss_fn, budget=budget, exact=True, progress=progress,
                  compile="--compile" in args)
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
for k in calls:
    print(f"{k:32s} calls {calls[k]:3d}  {spent[k]:7.1f} s")
for label, seq in steps.items():
    print(json.dumps({"engine": label, "steps": seq}))
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
