"""Exactness of the issue-31 engines on a device (written for CUDA, runs on the CPU too).

``python results/full-size/cuda_exactness.py [--device cuda] [--out FILE]``: every zoo model at
its ``--quick`` size, each engine variant below against autograd on the same device, in
float64 and float32 (the global RNG reseeded before each step, so dropout draws the same
masks), then under bf16 autocast against autograd under the same autocast. Prints one
line per (model, variant, dtype) and writes the table as JSON. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import torch

import leangrad
from leangrad import blocks
from leangrad_bench._models import build
from leangrad.loss import PerExample
from leangrad.measure import compare_grads

SUITE = Path(__file__).resolve().parents[2] / "benchmarks/leangrad_bench/suites/zoo.toml"
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
MODELS = ["gpt", "llama", "gpt_50k", "bert", "vit", "resnet", "unet", "lstm_lm", "gru_lm"]


def variants(name: str, model: torch.nn.Module) -> dict[str, tuple[str, dict[str, Any]]]:
    """The engine variants tried on zoo model ``name``: label -> (engine, options)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {
        "checkpoint": ("checkpoint", {}),
        "checkpoint(fragments=2)": ("checkpoint", {"fragments": 2}),
        "checkpoint(fragments=4)": ("checkpoint", {"fragments": 4}),
    }
    if name in ("gpt", "llama", "gpt_50k", "bert", "vit"):
        out["checkpoint(fragments=2,sequence_fragments=2)"] = (
            "checkpoint", {"fragments": 2, "sequence_fragments": 2})  # fmt: skip
    if name in ("gpt", "llama", "gpt_50k"):
        out["chunked_ce"] = ("chunked_ce", {})
        out["checkpoint+chunked_ce(fragments=2)"] = ("checkpoint+chunked_ce", {"fragments": 2})
    if name == "resnet":
        every = ["stem", *blocks(model).names]
        out["checkpoint(stem+blocks,fragments=4)"] = (
            "checkpoint", {"blocks": every, "fragments": 4})  # fmt: skip
    if name in ("lstm_lm", "gru_lm"):
        out["checkpoint(time_chunks=4)"] = ("checkpoint", {"time_chunks": 4})
    if name not in ("resnet",):
        out["accumulate(micro_batches=2)"] = ("accumulate", {"micro_batches": 2})
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return got


def _as(dtype: torch.dtype, model: torch.nn.Module, x: Any, loss_fn: Any) -> tuple[Any, ...]:
    """A copy of the workload in ``dtype`` (the same numbers: float tensors cast)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    xs = tuple(cast(t) for t in (x if isinstance(x, tuple) else (x,)))
    lf = loss_fn
    if isinstance(loss_fn, PerExample):
        lf = PerExample(loss_fn.fn, tuple(cast(t) for t in loss_fn.targets), loss_fn.reduction)
    return copy.deepcopy(model).to(dtype), xs, lf


def check(name: str, size: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """Every variant's gradient against autograd's, one model: float64 (held to 1e-10),
    float32 (held to 1e-4 of autograd's float32 gradient, or closer than it to the float64
    gradient of the same weights: BatchNorm's backward in float32 loses digits) and bf16
    autocast (measured against autograd under the same autocast and against float64)."""
    wl = build(name, size, device=device)
    rows = []
    truth: dict[str, torch.Tensor] = {}
    for dtype, autocast in ((torch.float64, False), (torch.float32, False),
                            (torch.float32, True)):  # fmt: skip
        model, xs, loss_fn = _as(dtype, wl.model, wl.inputs, wl.loss_fn)

        def ctx(autocast: bool = autocast) -> Any:
            return torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                                  enabled=autocast)  # fmt: skip

        torch.manual_seed(0)
        with ctx():
            loss = loss_fn(model(*xs))
        loss.backward()
        ref = _grads(model)
        if dtype == torch.float64:
            truth = ref
        ref_vs_truth = compare_grads(ref, truth).max_rel_err
        for label, (eng_name, opts) in variants(name, model).items():
            row: dict[str, Any] = {"model": name, "variant": label, "dtype": str(dtype),
                                   "autocast": "bf16" if autocast else None}  # fmt: skip
            eng = leangrad.engine(eng_name, **opts)
            why = eng.supports(model)
            if why is not None:
                row["refused"] = why[:200]
                rows.append(row)
                continue
            torch.manual_seed(0)
            try:
                with ctx():
                    eng.backward(model, xs, loss_fn)
            except Exception as err:  # a refusal at run time is recorded, not hidden
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                model.zero_grad(set_to_none=True)
                rows.append(row)
                continue
            got = _grads(model)
            cmp = compare_grads(got, ref)
            vs_truth = compare_grads(got, truth).max_rel_err
            row.update(same_params=set(got) == set(ref), max_rel_err=cmp.max_rel_err,
                       cosine=cmp.cosine, worst=cmp.worst_param, vs_float64=vs_truth,
                       autograd_vs_float64=ref_vs_truth)  # fmt: skip
            if not autocast:
                close = cmp.max_rel_err <= TOL[dtype] or vs_truth <= ref_vs_truth
                row["ok"] = bool(row["same_params"] and close)
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="/tmp/cuda-exactness.json")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tf32", action="store_true", help="keep cuDNN's TF32 convolutions on")
    args = ap.parse_args()
    if not args.tf32:  # float32 held to float32's precision, not TF32's (10 mantissa bits)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    sizes = tomllib.loads(SUITE.read_text())["settings"]["quick_models"]
    rows: list[dict[str, Any]] = []
    start = time.time()
    for name in args.models.split(","):
        for r in check(name, dict(sizes[name]), args.device):
            rows.append(r)
            verdict = ("ok" if r.get("ok") else "FAIL") if "ok" in r else (
                r.get("refused") or r.get("error") or "measured")
            err, e64 = r.get("max_rel_err"), r.get("vs_float64")
            far = "" if e64 is None else f"(f64 {e64:.1e} autograd {r['autograd_vs_float64']:.1e})"
            print(f"{name:9s} {r['dtype'][6:]:8s} {r['autocast'] or '':4s} "
                  f"{r['variant']:45s} {'' if err is None else f'{err:.1e}':8s} "
                  f"{far:34s} "
                  f"{str(verdict)[:90]}", flush=True)  # fmt: skip
        Path(args.out).write_text(json.dumps({
            "device": args.device, "torch": torch.__version__, "tf32": args.tf32,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "seconds": time.time() - start, "rows": rows}, indent=1))  # fmt: skip
    fails = [r for r in rows if r.get("ok") is False or "error" in r]
    print(f"{len(rows)} rows, {len(fails)} failing, {time.time() - start:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
