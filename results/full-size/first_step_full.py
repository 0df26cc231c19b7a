"""Full-size zoo rows that plans at 1/2 tracked twice (over budget by less than FIRST_STEP_MARGIN, no estimate to
confirm it): each row's first tracked step against its second, in one process per model
(run as `python results/full-size/first_step_full.py <repo> > first-step-full.jsonl`, 1 thread; ratio = first / second
total bytes)."""
import json
import sys
import time
import tomllib
import warnings
from pathlib import Path

warnings.simplefilter("ignore")
repo = Path(sys.argv[1])
sys.path.insert(0, str(repo / "src"))
import torch  # noqa: E402

torch.set_num_threads(1)
import leangrad  # noqa: E402
from leangrad_bench._models import build  # noqa: E402
from leangrad.measure import profile_step  # noqa: E402

STEM = ["stem", *[f"stages.{i}.{j}" for i in range(4) for j in range(2)]]
ROWS = {
    "gpt": [("checkpoint", {"blocks": [f"blocks.{i}" for i in range(4)]}), ("accumulate", {})],
    "lstm_lm": [("accumulate", {}), ("checkpoint+accumulate", {}), ("checkpoint", {"time_chunks": 2}),
                ("checkpoint", {"fragments": 2})],
    "gru_lm": [("accumulate", {}), ("checkpoint+accumulate", {}), ("checkpoint", {"time_chunks": 2})],
    "resnet": [("checkpoint", {"blocks": STEM, "fragments": 4, "fragment_blocks": 1}),
               ("checkpoint", {"blocks": STEM, "fragments": 8, "fragment_blocks": 1}),
               ("checkpoint", {"trace": True}), ("checkpoint", {"blocks": STEM, "levels": 2}),
               ("checkpoint", {"blocks": STEM})],
}
suite = tomllib.loads((repo / "benchmarks/leangrad_bench/suites/zoo.toml").read_text())
for name in sys.argv[2].split(",") if len(sys.argv) > 2 else ROWS:
    w = build(name, dict(suite["settings"]["models"][name]))
    for eng_name, opts in ROWS[name]:
        e = leangrad.engine(eng_name, **opts)
        t = time.perf_counter()
        a = profile_step(e, w.model, w.inputs, w.loss_fn, repeats=0, warmup=0).total_bytes
        b = profile_step(e, w.model, w.inputs, w.loss_fn, repeats=0, warmup=0).total_bytes
        print(json.dumps({"model": name, "engine": e.label[:80], "first": a, "second": b,
                          "ratio": round(a / b, 5), "s": round(time.perf_counter() - t, 1)}), flush=True)
