"""Every exact plan candidate of every quick zoo model: its first tracked step against its second
(run as `python results/full-size/first_step_peaks.py . > first-step-peaks.jsonl`, 1 thread, 2026-11-28 after 8c532c0;
ratio = first / second total bytes)."""
import sys, tomllib, json, time, warnings
from pathlib import Path
warnings.simplefilter("ignore")
repo = Path(sys.argv[1]); sys.path.insert(0, str(repo / "src"))
import torch; torch.set_num_threads(1)
import leangrad
from leangrad.planner._plan import candidates
from leangrad_bench._models import build
from leangrad.measure import profile_step
suite = tomllib.loads((repo / "benchmarks/leangrad_bench/suites/zoo.toml").read_text())
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(suite["settings"]["quick_models"])
for name in names:
    w = build(name, dict(suite["settings"]["quick_models"][name]))
    for eng_name, opts in candidates(w.model, exact=True, loss_fn=w.loss_fn):
        try:
            e = leangrad.engine(eng_name, **opts)
            t = time.perf_counter()
            a = profile_step(e, w.model, w.inputs, w.loss_fn, repeats=0, warmup=0).total_bytes
            b = profile_step(e, w.model, w.inputs, w.loss_fn, repeats=0, warmup=0).total_bytes
            print(json.dumps({"model": name, "engine": eng_name, "opts": {k: str(v)[:40] for k, v in opts.items()}, "first": a, "second": b, "ratio": round(a / b, 4), "s": round(time.perf_counter() - t, 2)}), flush=True)
        except Exception as err:
            print(json.dumps({"model": name, "engine": eng_name, "opts": {k: str(v)[:40] for k, v in opts.items()}, "error": f"{type(err).__name__}: {str(err)[:100]}"}), flush=True)
