"""``leangrad train`` and ``leangrad advise``: thin argument parsing over :func:`fit`
and :func:`advise`. Every setting is printed before the run starts."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_advise_parser", "add_train_parser", "run_advise", "run_train"]

TRAIN_DEFAULTS: dict[str, Any] = {
    "model": "mlp",
    "data": "digits",
    "engine": "backprop",
    "epochs": 1,
    "batch_size": 64,
    "lr": 1e-2,
    "optimizer": "adam",
    "seed": 0,
    "step_per_layer": False,
    "checkpoint_every": None,
    "max_steps": None,
    "dtype": "float32",
    "test_fraction": 0.2,
}
"""Defaults of the settings a resumed run takes from its checkpoint instead."""

_OPTS = ("engine_options", "model_options", "data_options")


def add_train_parser(sub: Any) -> None:
    """Add the ``train`` subcommand to the CLI's subparsers."""
    t = sub.add_parser(
        "train",
        help="train a model with any engine (checkpoints, resume, per-layer steps, DDP)",
        description="Train with any engine. Under `torchrun --nproc-per-node N` the same "
        "command trains data-parallel (gloo on CPU, NCCL on GPU).",
    )
    d = TRAIN_DEFAULTS

    def opt(flag: str, key: str, help: str, **kw: Any) -> None:
        t.add_argument(flag, dest=key, default=None, help=f"{help} (default: {d[key]})", **kw)

    opt("--model", "model", "model name or module:factory")
    opt("--data", "data", "digits, mnist5k, synthetic, synthetic-seq, text[:PATH], module:factory")
    opt("--engine", "engine", "engine name (see leangrad.available())")
    for flag, key in (("--engine-opt", "engine_options"), ("--model-opt", "model_options"),
                      ("--data-opt", "data_options")):  # fmt: skip
        t.add_argument(flag, dest=key, action="append", default=None, metavar="KEY=VALUE",
                       help="keyword option, repeatable (default: none)")  # fmt: skip
    opt("--epochs", "epochs", "passes over the training split", type=int)
    opt("--batch-size", "batch_size", "examples per step (per process under torchrun)", type=int)
    opt("--lr", "lr", "learning rate", type=float)
    opt("--optimizer", "optimizer", "adam or sgd", choices=("adam", "sgd"))
    opt("--seed", "seed", "seed of init, split and data order", type=int)
    opt("--step-per-layer", "step_per_layer", "optimizer step per parameter inside on_grad; "
        "gradients never all live at once (saving measured and printed)", action="store_const",
        const=True)  # fmt: skip
    opt("--checkpoint-every", "checkpoint_every", "checkpoint every N steps (always at the end)",
        type=int)  # fmt: skip
    opt("--max-steps", "max_steps", "stop after N steps in total", type=int)
    opt("--dtype", "dtype", "float32 or float64", choices=("float32", "float64"))
    opt("--test-fraction", "test_fraction", "held-out share for test accuracy", type=float)
    t.add_argument("--out", default=None,
                   help="run directory (default: leangrad-run, or the --resume directory)")
    t.add_argument("--resume", default=None, metavar="DIR|FILE",
                   help="continue bit-exactly from the newest checkpoint of DIR (or FILE)")
    t.add_argument("--overwrite", action="store_true",
                   help="--out may hold an earlier run: delete its checkpoints, metrics, "
                   "run.json and plot first, nothing else (default: refuse such a directory)")
    t.add_argument("--keep", type=int, default=3, help="checkpoints kept (default: 3)")
    t.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)")
    t.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's choice)")
    t.add_argument("--track-memory-every", type=int, default=50,
                   help="measure a step's peak memory every N steps, 0: never (default: 50)")
    t.add_argument("--no-measure-saving", action="store_true",
                   help="with --step-per-layer, skip measuring the saving on model copies")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t.add_argument("--no-plots", action="store_true", help="skip plots at the end")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line values, else the resumed checkpoint's, else the defaults."""
    from ._checkpoint import load_checkpoint, resolve_resume
    from ._registry import parse_options

    saved: dict[str, Any] = {}
    if args.resume is not None:
        saved = load_checkpoint(resolve_resume(args.resume), map_location="cpu")["config"]
    out: dict[str, Any] = {}
    for key, default in TRAIN_DEFAULTS.items():
        given = getattr(args, key)
        out[key] = given if given is not None else saved.get(key, default)
    for key in _OPTS:
        given = getattr(args, key)
        out[key] = parse_options(given) if given is not None else saved.get(key, {})
    return out


def _run_dir(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return Path(args.out)
    if args.resume is None:
        return Path("leangrad-run")
    r = Path(args.resume)
    if r.is_file():
        return r.parent.parent if r.parent.name == "checkpoints" else r.parent
    return r


def run_train(args: argparse.Namespace) -> int:
    """Run ``leangrad train``; exit code 0, 130 after SIGINT, 3 on a non-finite loss."""
    import torch

    from ._config import NonFiniteLossError
    from ._fit import fit

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    s = _settings(args)
    out = _run_dir(args)
    shown = {**s, "out": str(out), "resume": args.resume, "device": args.device or "auto",
             "threads": torch.get_num_threads(), "keep": args.keep,
             "world_size": os.environ.get("WORLD_SIZE", "1")}  # fmt: skip
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print("leangrad train: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    try:
        res = fit(
            s.pop("model"), s.pop("data"), **s, out=out, resume=args.resume,
            overwrite=args.overwrite,
            keep_checkpoints=args.keep, device=args.device, progress=not args.no_progress,
            plots=not args.no_plots, track_memory_every=args.track_memory_every,
            measure_saving=not args.no_measure_saving,
        )  # fmt: skip
    except NonFiniteLossError as err:
        print(f"leangrad: error: {err}", file=sys.stderr)
        return 3
    _summary(res)
    return 130 if res.stopped == "interrupted" else 0


def _summary(res: Any) -> None:
    if os.environ.get("RANK", "0") != "0":
        return

    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    print(f"{res.stopped}: {res.steps} steps, loss {fmt(res.final_loss, '.4f')}, "
          f"test loss {fmt(res.test_loss, '.4f')}, test acc {fmt(res.test_acc, '.4f')}, "
          f"{fmt(res.examples_per_s, '.0f')} examples/s, tracked peak "
          f"{fmt(res.peak_bytes and res.peak_bytes / 2**20, '.2f')} MiB")  # fmt: skip
    if res.grad_memory is not None:
        g = res.grad_memory
        print(f"step-per-layer gradient memory ({g.engine}, tracker, one step incl. optimizer): "
              f"peak {g.full_peak_bytes / 2**20:.3f} MiB -> {g.per_layer_peak_bytes / 2**20:.3f}"
              f" MiB, saving {g.saving_bytes / 2**20:.3f} MiB ({100 * g.saving_fraction:.1f}%)"
              f"; all gradients {g.grad_bytes / 2**20:.3f} MiB")  # fmt: skip
    for path in (res.checkpoint, res.metrics, res.plot):
        if path is not None:
            print(f"wrote {path}")
    for note in res.notes:
        print(f"note: {note}")


def add_advise_parser(sub: Any) -> None:
    """Add the ``advise`` subcommand."""
    a = sub.add_parser(
        "advise",
        help="measure the engines on a model and recommend the fastest that fits a budget",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a.add_argument("--model", default="mlp", help="model name or module:factory")
    a.add_argument("--data", default="digits", help="data the model is built for (shapes)")
    a.add_argument("--model-opt", dest="model_options", action="append", default=None,
                   metavar="KEY=VALUE", help="model option, repeatable")  # fmt: skip
    a.add_argument("--batch-size", type=int, default=64, help="examples per step")
    a.add_argument("--budget", default="2GiB", help="memory budget, e.g. 512MiB, 2GiB, 1e9")
    a.add_argument("--engines", default=None,
                   help="comma-separated engines to try (default: every registered engine)")
    a.add_argument("--repeats", type=int, default=3, help="timed repeats per engine")
    a.add_argument("--max-step-seconds", type=float, default=20.0,
                   help="stop and skip an engine whose single step takes longer")
    a.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    a.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    a.add_argument("--inexact", action="store_true",
                   help="also recommend estimating engines (e.g. projforward)")
    a.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_advise(args: argparse.Namespace) -> int:
    """Run ``leangrad advise``; exit code 0 with a recommendation, 1 when nothing fits."""
    from ._advise import advise, parse_bytes
    from ._registry import parse_options

    budget = parse_bytes(args.budget)
    print(f"leangrad advise: model={args.model} data={args.data} batch_size={args.batch_size} "
          f"budget={args.budget} ({budget} bytes) engines={args.engines or 'all'} "
          f"repeats={args.repeats} max_step_seconds={args.max_step_seconds} "
          f"device={args.device or 'auto'} dtype={args.dtype} "
          f"inexact={args.inexact}", flush=True)  # fmt: skip
    adv = advise(
        args.model, args.batch_size, budget, data=args.data,
        model_options=parse_options(args.model_options),
        engines=args.engines.split(",") if args.engines else None, repeats=args.repeats,
        device=args.device, dtype=args.dtype, exact_only=not args.inexact,
        max_step_seconds=args.max_step_seconds,
        progress=not args.no_progress,
    )  # fmt: skip
    print(adv.table())
    print(adv.message)
    return 0 if adv.recommended is not None else 1
