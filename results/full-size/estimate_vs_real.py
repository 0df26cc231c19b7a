"""Fake-tensor estimate vs the tracked peak of every full-size plan row measured for real in
the plan-wall logs (CPU, float32, 1 thread): est / real, and the estimate's seconds."""
import json, re, sys, time, tomllib
from pathlib import Path
repo = Path(sys.argv[1]); sys.path.insert(0, str(repo / "src"))
import torch
torch.set_num_threads(1)
import leangrad
from leangrad_bench._models import build
from leangrad.measure import estimate_step
from leangrad.planner._plan import candidates
model = sys.argv[2]
logs = sys.argv[3:]
real: dict[str, float] = {}
for log in logs:
    cur = None
    for line in Path(log).read_text().splitlines():
        if line.startswith("## "):
            cur = line[3:].split()[0]
            continue
        if cur != model:
            continue
        m = re.match(r"^(\S+(?:\(.*?\))?)\s+(yes|no)\s+([0-9.e+]+) MiB\s", line)
        if m and "estimate" not in line:
            real.setdefault(m.group(1), float(m.group(3)))
suite = tomllib.loads((repo / "benchmarks/leangrad_bench/suites/zoo.toml").read_text())
w = build(model, dict(suite["settings"]["models"][model]))
for cname, opts in candidates(w.model, loss_fn=w.loss_fn):
    eng = leangrad.engine(cname, **opts)
    if eng.label not in real:
        continue
    t = time.perf_counter()
    try:
        est = estimate_step(eng, w.model, w.inputs, w.loss_fn).total_bytes / 2**20
    except Exception as e:
        print(json.dumps({"model": model, "engine": eng.label, "error": repr(e)[:100]}), flush=True)
        continue
    r = real[eng.label]
    print(json.dumps({"model": model, "engine": eng.label, "real_MiB": r, "estimate_MiB": round(est, 2),
                      "est_over_real": round(est / r, 4), "estimate_s": round(time.perf_counter() - t, 2),
                      "costly": eng.costly_estimate}), flush=True)
