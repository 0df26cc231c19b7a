"""Llama (zoo, full size) with 8 micro-batches on both sides: the k the 2026-11-27 zoo row
did not give PyTorch ("Llama with k=8"). Peaks by the tracker, times as medians of
5 interleaved repeats, 1 thread. ``PYTHONPATH=src python results/full-size/llama_k8.py OUT.json``
(about 4 minutes; run it alone: the times are spoiled by anything beside it)."""
import json, platform, sys, time, tomllib
from pathlib import Path
import torch
torch.set_num_threads(1)
from leangrad_bench._models import build
from leangrad_bench._zoo_methods import Method, call, pytorch_methods
from leangrad.measure import profile_step, time_interleaved

size = dict(tomllib.loads((Path(__file__).parents[2] / "benchmarks/leangrad_bench/suites/zoo.toml")
                        .read_text())["settings"]["models"]["llama"])  # the zoo's full size
wl = build("llama", size, device="cpu")
model, x, loss_fn = wl.model, wl.inputs, wl.loss_fn
torch_rows, _ = pytorch_methods(model, segments=[], chunks=[], micro_batches=[4, 8], loss_fn=loss_fn)
torch_rows = [m for m in torch_rows if "accumulate" in m.label]
ours = [Method(lb, "leangrad", True, {"engine": e, "options": o}) for lb, e, o in [
    ("backprop", "backprop", {}),
    ("accumulate(micro_batches=8)", "accumulate", {"micro_batches": 8}),
    ("checkpoint+accumulate(micro_batches=8)", "checkpoint+accumulate", {"micro_batches": 8}),
    ("checkpoint(fragments=8)+chunked_ce", "checkpoint+chunked_ce", {"fragments": 8}),
    ("checkpoint(fragments=4)+chunked_ce", "checkpoint+chunked_ce", {"fragments": 4}),
]]
methods = ours + torch_rows
engines = {m.label: m.make() for m in methods}
model.zero_grad(set_to_none=True)
with torch.random.fork_rng():
    loss_fn(call(model, x)).backward()
ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
model.zero_grad(set_to_none=True)
prof = {}
for m in methods:
    prof[m.label] = profile_step(engines[m.label], model, x, loss_fn, repeats=0, reference=ref)
    print(f"peak {m.label}: {prof[m.label].peak_bytes/2**20:.1f} MiB", flush=True)
def step(e):
    def s():
        model.zero_grad(set_to_none=True); e.backward(model, x, loss_fn)
    return s
times = time_interleaved({m.label: step(engines[m.label]) for m in methods}, repeats=5, warmup=1, reference="backprop")
bp = prof["backprop"].peak_bytes
rows = []
for m in methods:
    p, t = prof[m.label], times[m.label]
    rows.append(dict(label=m.label, side=m.side, peak_bytes=p.peak_bytes, peak_ratio=p.peak_bytes / bp,
                     baseline_bytes=p.baseline_bytes, seconds_median=t.median, seconds_min=t.minimum,
                     seconds_max=t.maximum, time_ratio=t.ratio, grad_max_rel_err=p.grad_max_rel_err))
out = dict(model="llama", size=size, threads=1, repeats=5, torch=torch.__version__,
           platform=platform.platform(), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rows=rows)
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(f"{'option':42s} {'side':9s} {'peak':>7s} {'time':>6s}  spread (s)   max rel err")
for r in rows:
    print(f"{r['label']:42s} {r['side']:9s} {r['peak_ratio']:6.3f}x {r['time_ratio']:5.2f}x  {r['seconds_min']:.2f}-{r['seconds_max']:.2f}  {r['grad_max_rel_err']:.1e}")
