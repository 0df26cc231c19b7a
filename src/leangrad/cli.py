"""The ``leangrad`` command: a thin layer over :mod:`leangrad.bench`.

leangrad demo [--out DIR]
leangrad bench --list
leangrad bench SUITE [--quick] [--out DIR] [--no-rss]
leangrad report DIR
leangrad train [--model NAME] [--data DATA] [--engine NAME] [--engine-opt K=V ...] ...
leangrad advise --model NAME --batch-size B --budget 2GiB
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leangrad",
        description="Gradients with less memory or time than backprop, measured side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="every engine on a small MLP and CNN on real digits",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument("--out", default="leangrad-demo", help="directory for demo.json and demo.png")
    d.add_argument("--repeats", type=int, default=3, help="timed repeats per engine")
    d.add_argument("--rss", action="store_true", help="also run the fresh-process RSS check")
    b = sub.add_parser(
        "bench",
        help="run a named benchmark suite",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("suite", nargs="?", help="suite name (see --list)")
    b.add_argument("--list", action="store_true", help="list the suites and exit")
    b.add_argument("--quick", action="store_true", help="smaller sweep and fewer repeats")
    b.add_argument("--out", default="results", help="directory for SUITE.json")
    b.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS cross-check")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    r = sub.add_parser("report", help="render every SUITE.json in DIR into DIR/report.md")
    r.add_argument("dir", help="directory holding suite JSON files")
    for sp in (d, b):
        sp.add_argument("--no-progress", action="store_true", help="hide progress bars")
    from .train._cli import add_advise_parser, add_train_parser

    add_train_parser(sub)
    add_advise_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    from ._errors import LeangradError

    try:
        return _dispatch(args)
    except LeangradError as err:
        print(f"leangrad: error: {err}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    import torch

    if args.command in ("train", "advise"):
        from .train._cli import run_advise, run_train

        return run_train(args) if args.command == "train" else run_advise(args)
    from . import bench

    if args.command == "demo":
        torch.set_num_threads(1)
        bench.run_demo(
            out=args.out, repeats=args.repeats, rss=args.rss, progress=not args.no_progress
        )
        return 0
    if args.command == "bench":
        if args.list or not args.suite:
            for name, desc in bench.list_suites().items():
                print(f"{name:24s} {desc}")
            return 0
        torch.set_num_threads(1)
        print(
            f"leangrad bench {args.suite}: quick={args.quick}, out={args.out}, "
            f"rss={not args.no_rss}, device={args.device}, threads=1"
        )
        path = bench.run_suite(
            args.suite,
            out=args.out,
            quick=args.quick,
            rss=not args.no_rss,
            device=args.device,
            progress=not args.no_progress,
        )
        print(f"wrote {path}")
        return 0
    path = bench.render_report(args.dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
