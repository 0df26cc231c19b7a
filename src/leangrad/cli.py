"""The ``leangrad`` command: a thin layer over :func:`leangrad.plan`,
:func:`leangrad.train.fit` and the benchmarks (``demo``, ``bench``, ``report``: the
``leangrad_bench`` package in the repository's ``benchmarks/``, installed beside the library).

leangrad demo [--out DIR]
leangrad bench --list
leangrad bench SUITE [--quick] [--out DIR] [--no-rss] [--threads 1,cores]
leangrad report DIR [--headline | --reproduction | --wins]
leangrad train [--model NAME] [--data DATA] [--engine NAME | --budget SIZE | --plan FILE] ...
leangrad plan --model NAME --batch-size B --budget 2GiB [--save FILE]      (alias: advise)
leangrad plan ... --nproc N [--parallel ddp|fsdp]      (what each of N processes holds)

Every user error prints one line, ``leangrad: error: ...``, naming the option and the
fix, and exits with code 2; the checks on outputs (a file where a directory is wanted)
run before any work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from . import _cli_types as cli_types
from ._cli_types import OUT_CANNOT_MAKE as OUT_CANNOT_MAKE  # moved to _cli_types, kept here
from ._cli_types import OUT_NOT_WRITABLE as OUT_NOT_WRITABLE
from ._cli_types import OUT_UNDER_FILE as OUT_UNDER_FILE
from ._cli_types import check_out_dir

__all__ = ["check_out_dir", "main"]

INTERRUPTED = "leangrad: interrupted"

_VALUE_OPTIONS = ("--budget", "--lr", "--epochs", "--batch-size", "--max-steps",
                  "--threads", "--test-fraction", "--repeats", "--checkpoint-every",
                  "--keep", "--track-memory-every", "--max-step-seconds", "--seed")  # fmt: skip
"""Options whose value may look like a flag (``--budget -1GiB``): joined with ``=`` so the
value reaches its check instead of argparse's "expected one argument"."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line ``leangrad: error: ...`` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        from ._rank_errors import print_error

        print_error(f"leangrad: error: {message}")  # once under torchrun
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
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
    d.add_argument("--out", default="leangrad-demo", type=cli_types.out_dir,
                   help="directory for demo.json and its figures (PNG)")  # fmt: skip
    d.add_argument(
        "--repeats", type=cli_types.positive_int, default=3, help="timed repeats per engine"
    )
    d.add_argument("--rss", action="store_true", help="also run the fresh-process RSS check")
    b = sub.add_parser(
        "bench",
        help="run a named benchmark suite",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("suite", nargs="?", help="suite name (see --list)")
    b.add_argument("--list", action="store_true", help="list the suites and exit")
    b.add_argument("--quick", action="store_true", help="smaller sweep and fewer repeats")
    b.add_argument(
        "--out", default="results", type=cli_types.out_dir, help="directory for SUITE.json"
    )
    b.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS cross-check")
    b.add_argument("--device", default="cpu", type=cli_types.device, help="cpu or cuda")
    b.add_argument("--only", type=cli_types.name_list, default=None, metavar="SERIES[,SERIES]",
                   help="run just these series (the zoo: models) and merge them into "
                        "OUT/SUITE.json, replacing their records")  # fmt: skip
    b.add_argument("--threads", type=cli_types.thread_list, default=None, metavar="N[,N]",
                   help="torch thread counts to time at, side by side in one run (e.g. "
                        "1,cores; default: the suite's own, else 1)")  # fmt: skip
    r = sub.add_parser("report", help="render every SUITE.json in DIR into DIR/report.md")
    r.add_argument("dir", help="directory holding suite JSON files")
    table = r.add_mutually_exclusive_group()
    table.add_argument("--headline", action="store_true",
                       help="print the results page's opening table from DIR/zoo.json")  # fmt: skip
    table.add_argument("--reproduction", action="store_true",
                       help="print the papers' numbers beside ours, from DIR/*.json")  # fmt: skip
    table.add_argument("--wins", action="store_true",
                       help="print the README's table of where leangrad wins, from "
                            "DIR/zoo.json, DIR/full/zoo.json, DIR/model-corpus-zoo.json")
    for sp in (d, b):
        sp.add_argument("--no-progress", action="store_true", help="hide progress bars")
    from .train._cli import add_plan_parser, add_train_parser

    add_train_parser(sub)
    add_plan_parser(sub)
    return p


def _join_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--"):  # fmt: skip
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args_list = _join_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = _parser().parse_args(args_list)
    except SystemExit as exit_:
        return int(exit_.code) if isinstance(exit_.code, int) else 2
    from ._errors import LeangradError

    try:
        return _dispatch(args)
    except LeangradError as err:  # every error leangrad raises on purpose: the user's input
        from ._rank_errors import print_error

        print_error(f"leangrad: error: {err}")  # once under torchrun, unless ranks differ
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside training (which checkpoints and exits 130)
        print(INTERRUPTED, file=sys.stderr)
        return 130


NO_BENCHMARKS = (
    "`leangrad {command}` runs the benchmarks, which live beside the library in its "
    "repository (benchmarks/, the leangrad-bench package) and are not installed here; "
    "from a checkout: pip install -e benchmarks (make install does it)"
)


BENCHMARKS_GROUP = "leangrad.benchmarks"
"""The entry-point group through which the benchmark package makes itself known: the
library names no module of it (it lives above the library, and imports it)."""


def _benchmarks(command: str) -> ModuleType:
    """The benchmark package (``leangrad_bench``: suites, demo, report), installed from the
    repository's ``benchmarks/`` beside the library and found by its entry point; a
    one-line error where it is not installed."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=BENCHMARKS_GROUP))
    if not found:
        from ._errors import OptionalDependencyError

        raise OptionalDependencyError(NO_BENCHMARKS.format(command=command))
    module: ModuleType = found[0].load()
    return module


def _dispatch(args: argparse.Namespace) -> int:
    import torch

    if args.command == "train":
        from .train._cli import run_train

        return run_train(args)
    if args.command in ("plan", "advise"):
        from .train._cli import run_plan

        return run_plan(args)
    bench = _benchmarks(args.command)
    if args.command == "demo":
        check_out_dir(args.out)
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
        suite = bench.load_suite(args.suite)
        suite.check()  # a suite that cannot run: before any work
        counts = bench.timing_threads(suite, quick=args.quick, threads=args.threads)
        check_out_dir(args.out)
        torch.set_num_threads(1)
        print(
            f"leangrad bench {args.suite}: quick={args.quick}, out={args.out}, "
            f"rss={not args.no_rss}, device={args.device}, "
            f"threads={','.join(map(str, counts))}"
        )
        path = bench.run_suite(
            args.suite,
            out=args.out,
            quick=args.quick,
            rss=not args.no_rss,
            device=args.device,
            progress=not args.no_progress,
            only=args.only,
            threads=counts,
        )
        print(f"wrote {path}")
        return 0
    if args.headline:
        print(bench.zoo_headline(args.dir))
        return 0
    if args.reproduction:
        print(bench.reproduction_markdown(args.dir))
        return 0
    if args.wins:
        print(bench.wins_table(args.dir))
        return 0
    path = bench.render_report(args.dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
