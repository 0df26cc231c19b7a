"""The speed-gap rows, measured side by side for two versions of leangrad (before and after).

Run as a file, not a module, so the same measurement runs against another checkout::

    python tools/gaps.py --before OLD/src --out results/gaps.json

For each row and thread count (1 and the machine's cores) it starts one worker process per
version, alternating before/after, with ``PYTHONPATH`` set to that version's ``src``; a
worker times the row's methods as medians of interleaved repeats in one process and prints
ratios only. It uses only APIs both versions have (``leangrad.engine``, the bench workload
builders). Rows:

- ``rad``: rad "different" 0.1 step time / the official PrincetonLIPS code's and /
  backprop's, MNIST MLP 784-300-300-300-10 at batch 150 (official: ``LEANGRAD_RAD_OFFICIAL``),
  and the tracker peak / backprop's with the batch held by the caller;
- ``forward``: the forward engine / a plain ``torch.func`` ``vmap(jvp)`` loop, same chunks;
- ``fad``: ``fad.nest`` on a ResNet with x*sigmoid(x) written out / the same model with
  ``nn.SiLU``, and with Mish written out / ``nn.Mish``;
- ``pure``: Forward / pure Moonwalk step time, RevNet with 6 couplings (digits);
- ``mixed``: Moonwalk (defaults) / backprop step time and tracker peak, moonwalk-v2-cnn at
  depth 6, and a no-grad forward / backprop's step (what Phase III runs again);
- ``highway``: nn.GRU / highway (k=0, k=2) step time, L=256 H=128 B=32; nn.LSTM / highway k=0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

ROWS = ("rad", "forward", "fad", "pure", "mixed", "highway")


def _timed(fns: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function: :func:`leangrad.measure.time_interleaved` (both
    versions have it) at the worker's own thread count."""
    from leangrad.measure import time_interleaved

    times = time_interleaved(fns, repeats=repeats, warmup=1, threads=None)
    return {k: t.median for k, t in times.items()}


def _engine_step(eng: Any, model: Any, inputs: Any, loss_fn: Any) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        eng.backward(model, inputs, loss_fn)

    return step


def _row_rad() -> dict[str, float]:
    import copy
    import types

    import torch
    import torch.nn.functional as F

    import leangrad
    from leangrad import data, rad
    try:  # the registry's RAD networks
        from leangrad_bench._models import rad_network as rad_model
    except ImportError:  # an older checkout: the RAD suites' own name
        from leangrad_bench._rad import rad_model
    from leangrad.measure import MemoryTracker

    train = data.load("mnist5k").split(0.8, seed=0)[0]
    x, y = train.x[:150], train.y[:150]
    torch.manual_seed(0)
    base = rad_model("mlp")
    model = copy.deepcopy(base)
    rad.randomize(model, fraction=0.1, mode="different", seed=1)

    def step(m: Any) -> Callable[[], None]:
        def s() -> None:
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()

        return s

    fns = {"backprop": step(base), "rad": step(model)}
    official = os.environ.get("LEANGRAD_RAD_OFFICIAL")
    if official:
        sys.modules.setdefault("torchvision", types.ModuleType("torchvision"))
        sys.path.insert(0, official)
        import models

        net = models.MNISTFCNet(300, rp_args={"keep_frac": 0.1, "full_random": True,
                                              "sparse": True})  # fmt: skip
        theirs = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
        mine = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for a, b in zip(theirs, mine, strict=True):
                a.weight.copy_(b.weight)
                a.bias.copy_(b.bias)
        fns["official"] = step(net)
    t = _timed(fns, 30)
    peaks = {}
    for name, m in (("backprop", base), ("rad", model)):
        m.zero_grad(set_to_none=True)
        with MemoryTracker(baseline=(m, x, y)) as tracker:
            step(m)()
        peaks[name] = tracker.report.peak_bytes
    del leangrad
    out = {"rad_vs_backprop": t["rad"] / t["backprop"],
           "rad_peak_vs_backprop": peaks["rad"] / peaks["backprop"]}  # fmt: skip
    if "official" in t:
        out["rad_vs_official"] = t["rad"] / t["official"]
    return out


def _row_forward() -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, jvp, vmap

    import leangrad
    from leangrad import models

    torch.manual_seed(0)
    model = models.mlp(32, 32, 2, 10)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    chunk = 16
    params = {n: p.detach() for n, p in model.named_parameters()}

    def plain() -> None:
        for name, theta in params.items():
            n = theta.numel()

            def along(v: torch.Tensor, name: str = name, theta: torch.Tensor = theta) -> Any:
                def f(t: torch.Tensor) -> torch.Tensor:
                    return loss_fn(functional_call(model, {**params, name: t}, (x,)))

                return jvp(f, (theta,), (v,))[1]

            g = torch.empty(n)
            for s in range(0, n, chunk):
                k = min(chunk, n - s)
                tang = torch.zeros(k, n)
                tang[torch.arange(k), torch.arange(s, s + k)] = 1
                g[s : s + k] = vmap(along)(tang.view(k, *theta.shape))

    eng = leangrad.engine("forward", chunk_size=chunk)
    t = _timed({"torch.func": plain, "forward": _engine_step(eng, model, x, loss_fn)}, 7)
    return {"forward_vs_func": t["forward"] / t["torch.func"]}


def _row_fad() -> dict[str, float]:
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn

    from leangrad import fad

    size = {"channels": 16, "stages": 2, "blocks": 1, "side": 32}
    try:  # a checkout with the FAD models in the bench's registry
        from leangrad_bench._models import Act, build

        def made(act: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
            w = build("fad_resnet", {**size, "activation": act}, batch=32)
            return w.model, w.inputs[0], w.targets
    except ImportError:  # an older one: their own module
        from leangrad_bench._fad_models import Act, fad_model

        def made(act: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
            torch.manual_seed(0)
            base, make = fad_model("resnet", act, size)
            x, y = make(32, torch.Generator().manual_seed(1))
            return base, x, y

    out = {}
    for act, builtin in (("swish", nn.SiLU), ("mish", nn.Mish)):
        base, x, y = made(act)
        kernel = copy.deepcopy(base)
        for m in kernel.modules():
            if isinstance(m, Act):
                m.fn = builtin()
        nested = fad.nest(base)

        def step(m: nn.Module, x: torch.Tensor = x, y: torch.Tensor = y) -> Callable[[], None]:
            def s() -> None:
                for p in m.parameters():
                    p.grad = None
                F.cross_entropy(m(x), y).backward()

            return s

        t = _timed({"eager": step(base), "builtin": step(kernel), "fad": step(nested)}, 9)
        out[f"fad_vs_builtin_{act}"] = t["fad"] / t["builtin"]
        out[f"fad_vs_eager_{act}"] = t["fad"] / t["eager"]
    return out


def _row_pure() -> dict[str, float]:
    import leangrad
    from leangrad_bench._workloads import build

    wl = build({"model": "revnet", "data": "digits", "in_channels": 1, "channels": 8,
                "size": 8, "blocks": 2, "batch": 32, "classes": 10, "dtype": "float32",
                "seed": 0, "depth": 3})  # fmt: skip
    pure = leangrad.engine("moonwalk", mode="pure", per_example=True, chunk_size=32)
    fwd = leangrad.engine("forward", chunk_size=32)
    t = _timed({e.label: _engine_step(e, wl.model, wl.inputs, wl.loss_fn)
                for e in (pure, fwd)}, 2)  # fmt: skip
    return {"forward_over_pure": t[fwd.label] / t[pure.label]}


def _row_mixed() -> dict[str, float]:
    import torch

    import leangrad
    from leangrad.measure import profile_step
    from leangrad_bench._workloads import build

    wl = build({"model": "subcnn", "stem": "repeat", "in_channels": 3, "channels": 32,
                "size": 128, "batch": 8, "classes": 10, "dtype": "float32", "seed": 0,
                "depth": 6})  # fmt: skip
    bp, mw = leangrad.engine("backprop"), leangrad.engine("moonwalk")
    def forward() -> None:  # what Phase III must run again: one forward of every layer
        with torch.no_grad():
            wl.model(*wl.inputs)

    t = _timed({"backprop": _engine_step(bp, wl.model, wl.inputs, wl.loss_fn),
                "moonwalk": _engine_step(mw, wl.model, wl.inputs, wl.loss_fn),
                "forward": forward}, 7)  # fmt: skip
    peak = {n: profile_step(e, wl.model, wl.inputs, wl.loss_fn, repeats=0).peak_bytes
            for n, e in (("backprop", bp), ("moonwalk", mw))}  # fmt: skip
    return {"mixed_vs_backprop": t["moonwalk"] / t["backprop"],
            "forward_vs_backprop": t["forward"] / t["backprop"],
            "mixed_peak_vs_backprop": peak["moonwalk"] / peak["backprop"]}  # fmt: skip


def _row_highway() -> dict[str, float]:
    import torch

    import leangrad
    try:  # the paper models' own module
        from leangrad_bench._highway_paper import TorchLM as _TorchLM
        from leangrad_bench._highway_paper import char_lm
        from leangrad_bench._highway_paper import lm_loss as _lm_loss
    except ImportError:  # an older checkout: the highway suites' names
        from leangrad_bench._highway import (
            _lm_loss,
            _TorchLM,
            char_lm,
        )

    out = {}
    for cell in ("gru", "lstm"):
        torch.manual_seed(0)
        net = char_lm(cell, 64, 128)
        tokens = torch.randint(0, 64, (256, 32))
        loss_fn = _lm_loss(torch.randint(0, 64, (256, 32)), 64)
        torch_lm = _TorchLM(net, cell)
        bp = leangrad.engine("backprop")
        fns = {"nn": _engine_step(bp, torch_lm, (tokens,), loss_fn)}
        for k in (0, 2) if cell == "gru" else (0,):
            eng = leangrad.engine("highway", k=k)
            fns[f"k{k}"] = _engine_step(eng, net, (tokens,), loss_fn)
        t = _timed(fns, 7)
        for label in [key for key in t if key != "nn"]:
            out[f"{cell}_{label}_speedup_vs_nn"] = t["nn"] / t[label]
    return out


def _worker(row: str, threads: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    fn = {"rad": _row_rad, "forward": _row_forward, "fad": _row_fad, "pure": _row_pure,
          "mixed": _row_mixed, "highway": _row_highway}[row]  # fmt: skip
    return fn()


def _run(src: str, row: str, threads: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", row, "--threads", str(threads)],
        capture_output=True, text=True, env=env, check=False, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
        return {"error": why}
    got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="src/ of the version before")
    ap.add_argument("--after", help="src/ of the version after (default: this checkout's)",
                    default=os.path.join(os.path.dirname(__file__), "..", "src"))  # fmt: skip
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out")
    ap.add_argument("--worker")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(_worker(a.worker, a.threads)))
        return
    versions = {"before": a.before, "after": os.path.abspath(a.after)}
    versions = {k: v for k, v in versions.items() if v}
    records = []
    for row in a.rows.split(","):
        for threads in sorted({1, os.cpu_count() or 1}):
            for name, src in versions.items():  # alternating: before, after
                got = _run(src, row, threads)
                records.append({"row": row, "threads": threads, "version": name, **got})
                print(json.dumps(records[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
