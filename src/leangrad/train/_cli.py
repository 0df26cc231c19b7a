"""``leangrad train`` and ``leangrad plan``: thin argument parsing over :func:`fit`
and :func:`leangrad.plan`. Every setting is printed before the run starts."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .. import _cli_types as cli_types
from .._cli_types import check_out_dir
from ..planner._parallel import PARALLEL

__all__ = ["add_plan_parser", "add_train_parser", "run_plan", "run_train"]

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
    "precision": "float32",
    "parallel": "ddp",
    "test_fraction": 0.2,
}
"""Defaults of the settings a resumed run takes from its checkpoint instead."""

_OPTS = ("engine_options", "model_options", "data_options")
PRECISION_CHOICES = ("float32", "bf16", "fp16")
MAX_SEED = 2**63 - 1
"""Largest seed: torch's generators take 64 bits, and epoch ``e`` reshuffles with seed + e."""
BAD_SEED = "must be at most 2**63 - 1, got {value}; pick a smaller seed"
BAD_ENGINE_OPTION = "--engine-opt (engine {engine!r}): {error}"
NO_ENGINES = (
    "--engines {value!r} names no engine; give comma-separated names, e.g. "
    "backprop,checkpoint+fad, or leave --engines out to try every one that applies"
)
TOKENIZER_NEEDS_TEXT = (
    "--tokenizer {tokenizer!r} tokenizes text data, but --data is {data!r}; use --data text "
    "or text:PATH, or leave --tokenizer out"
)
TOKENIZER_HELP = (
    "with --data text[:PATH]: windows of tokens instead of characters, so the model gets a "
    "real vocabulary size. bpe:N trains a byte-level BPE of vocabulary N on the text (cached; "
    "e.g. bpe:50257 as GPT-2, bpe:32000 as Llama); a FILE is a Hugging Face tokenizer.json. "
    "Needs the tokenizers package (leangrad[hf]). Same as --data-opt tokenizer=SPEC "
    "(default: characters)"
)
PLAN_AND_BUDGET = (
    "--plan trains with a saved plan's engine and --budget plans one now; give one of them"
)
PLAN_AND_ENGINE = (
    "--plan chooses the engine ({engine!r} given with --engine); drop --engine, or drop --plan"
)
PLAN_AND_RESUME = (
    "--resume keeps the checkpoint's engine (a planned one included) and reads no plan; "
    "drop --plan"
)
NO_PLAN_FILE = "--plan {path}: no such file; give the file `leangrad plan --save` wrote"
SAVE_IS_DIR = "--save {path}: is a directory; name the JSON file to write, e.g. plan.json"
RETIRED_MAX_STEP_SECONDS = (
    "`leangrad plan` (formerly advise) has no per-step time limit; drop --max-step-seconds "
    "(to skip slow engines, name the ones to try with --engines)"
)


def _seed(raw: str) -> int:
    """A seed: a whole number that torch's generators take."""
    value = cli_types.whole(raw)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(BAD_SEED.format(value=value))
    return value


def _with_tokenizer(data: str, options: dict[str, Any], tokenizer: str | None) -> dict[str, Any]:
    """``--tokenizer SPEC``: the data options with ``tokenizer=SPEC`` (text data only)."""
    if tokenizer is None:
        return options
    if data != "text" and not data.startswith("text:"):
        from .._errors import OptionError

        raise OptionError(TOKENIZER_NEEDS_TEXT.format(tokenizer=tokenizer, data=data))
    return {**options, "tokenizer": tokenizer}


def _retired_max_step_seconds(raw: str) -> float:
    """The old advise's option: refused with what to do instead, never silently ignored."""
    del raw
    raise argparse.ArgumentTypeError(RETIRED_MAX_STEP_SECONDS)


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
    opt("--data", "data", "digits, mnist5k, synthetic, synthetic-seq, text[:PATH] (characters, "
        "or tokens with --tokenizer), module:factory")
    opt("--engine", "engine", "engine name (see leangrad.available())")
    for flag, key in (("--engine-opt", "engine_options"), ("--model-opt", "model_options"),
                      ("--data-opt", "data_options")):  # fmt: skip
        t.add_argument(flag, dest=key, action="append", default=None, metavar="KEY=VALUE",
                       help="keyword option, repeatable (default: none)")  # fmt: skip
    t.add_argument("--tokenizer", default=None, metavar="bpe:N|FILE", help=TOKENIZER_HELP)
    opt("--epochs", "epochs", "passes over the training split", type=cli_types.positive_int)
    opt("--batch-size", "batch_size", "examples per step (per process under torchrun)",
        type=cli_types.positive_int)  # fmt: skip
    opt("--lr", "lr", "learning rate", type=cli_types.positive_float)
    opt("--optimizer", "optimizer", "adam or sgd", choices=("adam", "sgd"))
    opt("--seed", "seed", "seed of init, split, data order and each process's random stream",
        type=_seed)  # fmt: skip
    opt("--step-per-layer", "step_per_layer", "optimizer step per parameter inside on_grad; "
        "gradients never all live at once (saving measured and printed)", action="store_const",
        const=True)  # fmt: skip
    opt("--checkpoint-every", "checkpoint_every", "checkpoint every N steps (always at the end)",
        type=cli_types.positive_int)  # fmt: skip
    opt("--max-steps", "max_steps", "stop after N steps in total", type=cli_types.positive_int)
    opt("--dtype", "dtype", "float32 or float64", choices=("float32", "float64"))
    opt("--precision", "precision", "float32, or bf16/fp16: each step under torch.autocast "
        "(engines not checked under it refuse, naming why)", choices=PRECISION_CHOICES)
    opt("--parallel", "parallel", "under torchrun: ddp (DDP for backprop, the others averaged "
        "after their step) or fsdp (FSDP2: each process holds 1/N of the parameters, "
        "gradients and optimizer state; backprop only)", choices=("ddp", "fsdp"))  # fmt: skip
    opt("--test-fraction", "test_fraction", "held-out share for test accuracy, in [0, 1)",
        type=cli_types.fraction)  # fmt: skip
    _add_run_arguments(t)


def _add_run_arguments(t: Any) -> None:
    """``train``'s options outside the training settings: the engine from a plan, the run
    directory and resuming, device and threads, what is measured and shown."""
    t.add_argument("--budget", default=None, type=cli_types.size,
                   help="plan the step instead of naming an engine: train with the fastest "
                   "exact engine whose memory fits, e.g. 64MiB (see `leangrad plan`)")
    t.add_argument("--engines", default=None,
                   help="with --budget: comma-separated engines the plan may choose from, "
                   "e.g. backprop,checkpoint (default: every one that applies)")
    t.add_argument("--plan", default=None, metavar="FILE",
                   help="train with the engine of a plan saved by `leangrad plan --save` "
                   "(refused if made for another model, batch shape or device)")
    t.add_argument("--out", default=None, type=cli_types.out_dir,
                   help="run directory (default: leangrad-run, or the --resume directory)")
    t.add_argument("--resume", default=None, metavar="DIR|FILE",
                   help="continue bit-exactly from the newest checkpoint of DIR (or FILE)")
    t.add_argument("--overwrite", action="store_true",
                   help="--out may hold an earlier run: delete its checkpoints, metrics, "
                   "run.json and plot first, nothing else (default: refuse such a directory)")
    t.add_argument(
        "--keep", type=cli_types.positive_int, default=3, help="checkpoints kept (default: 3)"
    )
    t.add_argument("--device", default=None, type=cli_types.device,
                   help="cpu, cuda, cuda:1 (default: cuda if present)")
    t.add_argument("--threads", type=cli_types.positive_int, default=None,
                   help="torch.set_num_threads (default: torch's choice)")
    t.add_argument("--track-memory-every", type=cli_types.whole, default=50,
                   help="measure a step's peak memory every N steps, 0: never (default: 50)")
    t.add_argument("--no-measure-saving", action="store_true",
                   help="with --step-per-layer, skip measuring the saving on model copies")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t.add_argument("--no-plots", action="store_true", help="skip plots at the end")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line values, else the resumed checkpoint's, else the defaults."""
    from ._registry import parse_options
    from ._snapshot import load_checkpoint, resolve_resume

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
    out["data_options"] = _with_tokenizer(out["data"], out["data_options"], args.tokenizer)
    out["plan"] = args.plan if args.plan is not None else saved.get("plan")  # a record
    return out


def _run_dir(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return Path(args.out)
    if args.resume is None:
        return Path("leangrad-run")
    r = Path(args.resume)
    from ._snapshot import is_sharded_checkpoint

    if r.is_file() or is_sharded_checkpoint(r):  # a .pt file or a step-N.dcp/ directory
        return r.parent.parent if r.parent.name == "checkpoints" else r.parent
    return r


def run_train(args: argparse.Namespace) -> int:
    """Run ``leangrad train``; exit code 0, 130 after SIGINT, 3 on a non-finite loss."""
    import torch

    from ._config import NonFiniteLossError
    from ._fit import fit

    if args.resume is not None and args.overwrite:
        from ._snapshot import RESUME_AND_OVERWRITE, RunDirectoryError

        raise RunDirectoryError(RESUME_AND_OVERWRITE)
    _check_plan_options(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    s = _settings(args)
    if s["engine_options"] and args.budget is None and args.plan is None:
        _check_engine_options(s["engine"], s["engine_options"])
    out = _run_dir(args)
    check_out_dir(out, "--out" if args.out is not None or args.resume is None else "--resume")
    planned = {"engine": "from the plan"} if args.plan is not None else {}
    shown = {**s, **planned, "out": str(out), "resume": args.resume, "overwrite": args.overwrite,
             "budget": args.budget, "plan_engines": args.engines or (
                 "all that apply" if args.budget is not None else None),
             "device": args.device or "auto",
             "threads": torch.get_num_threads(), "keep": args.keep,
             "world_size": os.environ.get("WORLD_SIZE", "1")}  # fmt: skip
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print("leangrad train: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    try:
        res = fit(
            s.pop("model"), s.pop("data"), **s, out=out, resume=args.resume,
            overwrite=args.overwrite, budget=args.budget,
            plan_engines=_engine_list(args.engines, needs_budget=args.budget is None),
            keep_checkpoints=args.keep, device=args.device, progress=not args.no_progress,
            plots=not args.no_plots, track_memory_every=args.track_memory_every,
            measure_saving=not args.no_measure_saving,
        )  # fmt: skip
    except NonFiniteLossError as err:
        print(f"leangrad: error: {err}", file=sys.stderr)
        return 3
    _summary(res)
    return 130 if res.stopped == "interrupted" else 0


def _check_plan_options(args: argparse.Namespace) -> None:
    """``--plan`` names the engine: not with --budget, --engine or --resume."""
    from .._errors import OptionError

    if args.plan is None:
        return
    if args.budget is not None:
        raise OptionError(PLAN_AND_BUDGET)
    if args.engine is not None:
        raise OptionError(PLAN_AND_ENGINE.format(engine=args.engine))
    if args.resume is not None:
        raise OptionError(PLAN_AND_RESUME)
    if not Path(args.plan).is_file():
        raise OptionError(NO_PLAN_FILE.format(path=args.plan))


def _check_engine_options(name: str, options: dict[str, Any]) -> None:
    """Make the engine once before any work, so that an option value it refuses (of any
    error type: an unknown ``mode``, a bad ``fraction``) is reported as ``--engine-opt``'s;
    an unknown engine name is reported as it is."""
    from .. import engines
    from .._errors import LeangradError, OptionError

    engines.engine(name)
    try:
        engines.engine(name, **options)
    except (LeangradError, ValueError, TypeError) as err:
        if str(err).startswith("--engine-opt"):
            raise
        raise OptionError(BAD_ENGINE_OPTION.format(engine=name, error=err)) from None


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


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` subcommand (``advise`` is the same command under its old name)."""
    a = sub.add_parser(
        "plan",
        aliases=["advise"],
        help="the fastest engine whose memory fits a budget, measured on your model",
        description="Measure every engine and composition that applies to the model "
        "(leangrad.plan) on one batch and print the table and the fastest whose memory "
        "(parameters, inputs and the step's peak) fits the budget. A custom model is "
        "'package.module:factory': the factory is called with its --model-opt keywords, "
        "plus input_shape=(C, H, W) / (T,) and num_classes=K when its signature names them, "
        "and returns an nn.Module taking a batch (N, *input_shape) of --data.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a.add_argument("--model", default="mlp", help="model name or package.module:factory")
    a.add_argument("--data", default="digits", help="data the model is built for (shapes)")
    a.add_argument("--model-opt", dest="model_options", action="append", default=None,
                   metavar="KEY=VALUE", help="model option, repeatable")  # fmt: skip
    a.add_argument("--data-opt", dest="data_options", action="append", default=None,
                   metavar="KEY=VALUE", help="data option, repeatable (e.g. shape=3,32,32)")
    a.add_argument("--tokenizer", default=None, metavar="bpe:N|FILE", help=TOKENIZER_HELP)
    a.add_argument(
        "--batch-size", type=cli_types.positive_int, default=64, help="examples per step"
    )
    a.add_argument("--budget", type=cli_types.size, default="2GiB",
                   help="memory budget, e.g. 512MiB, 2GiB, 1e9")
    a.add_argument("--engines", default=None,
                   help="comma-separated engines to try, e.g. backprop,checkpoint+fad "
                   "(default: every one that applies)")
    _add_plan_settings(a)


def _add_plan_settings(a: Any) -> None:
    """``plan``'s options beyond the model, data and budget: timing, device and precision,
    which candidates, the optimizer, saving, and the per-process estimate."""
    a.add_argument("--repeats", type=cli_types.positive_int, default=3, help="timed repeats")
    a.add_argument("--max-step-seconds", type=_retired_max_step_seconds, default=None,
                   help=argparse.SUPPRESS)  # the old advise's; refused with the fix
    a.add_argument("--device", default=None, type=cli_types.device,
                   help="cpu or cuda (default: cuda if present)")
    a.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    a.add_argument("--precision", default="float32", choices=PRECISION_CHOICES,
                   help="plan the step under torch.autocast with bf16 or fp16 (as "
                   "`leangrad train --precision` runs it)")
    a.add_argument("--inexact", action="store_true",
                   help="also consider estimating engines (rad, highway)")
    a.add_argument("--optimizer", choices=("none", "sgd", "adam"), default="none",
                   help="plan the training step with this optimizer's step: every candidate "
                   "is also tried with the optimizer stepped per layer (train with "
                   "--step-per-layer when that is chosen)")
    a.add_argument("--lr", type=cli_types.positive_float, default=0.01, help="with --optimizer")
    a.add_argument("--compile", action="store_true",
                   help="also try torch.compile: of the whole model, default and with an "
                   "activation_memory_budget, and of each repeated block (regional "
                   "compilation, alone and checkpointed), each compiled cold and measured "
                   "in a fresh process (about 20-60 s per setting on a small model)")
    a.add_argument("--save", default=None, metavar="FILE",
                   help="write the plan to FILE as JSON, for `leangrad train --plan FILE` "
                   "or leangrad.Plan.load (also when nothing fits)")
    a.add_argument("--no-progress", action="store_true",
                   help="no progress bar while measuring")
    a.add_argument("--nproc", type=cli_types.positive_int, default=None, metavar="N",
                   help="also estimate what each of N processes holds (`leangrad train "
                   "--parallel` under torchrun --nproc-per-node N; the batch size is per "
                   "process): parameters, gradients, optimizer state counted, activations "
                   "measured (default without --parallel: ddp)")
    a.add_argument("--parallel", choices=PARALLEL, default=None,
                   help="with --nproc: ddp runs the plan, then prints the per-rank estimate "
                   "of its choice; fsdp prints instead of a plan the per-rank estimate of "
                   "each engine FSDP2 can train (--engines, default backprop) against "
                   "--budget")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``leangrad plan``: exit code 0 with a plan, 1 when nothing fits (with
    ``--parallel fsdp``, which plans nothing: when the per-rank estimate is over budget)."""
    import torch

    from .._sizes import fmt_bytes
    from ..planner._plan import plan
    from ._fit import _loss_fn, _make_optimizer, autocast_dtype
    from ._registry import build_model, data_info, example_batch, load_data, parse_options

    names = _engine_list(args.engines)
    parallel = _check_parallel_options(args)
    if args.save is not None:
        _check_save(Path(args.save))
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    print(f"leangrad plan: model={args.model} data={args.data} batch_size={args.batch_size} "
          f"budget={fmt_bytes(args.budget)} ({args.budget} bytes) "
          f"engines={args.engines or 'all that apply'} repeats={args.repeats} device={dev} "
          f"dtype={args.dtype} precision={args.precision} inexact={args.inexact} "
          f"optimizer={args.optimizer} compile={args.compile} "
          f"save={args.save}" + (f" nproc={args.nproc} parallel={parallel}" if parallel else ""),
          flush=True)  # fmt: skip
    data_opts = _with_tokenizer(args.data, parse_options(args.data_options), args.tokenizer)
    info = data_info(args.data, load_data(args.data, **data_opts))
    torch.manual_seed(0)
    model = build_model(args.model, info, **parse_options(args.model_options))
    model = model.to(device=dev, dtype=dtype)
    x, y = example_batch(info, args.batch_size, device=dev, dtype=dtype)
    if parallel == "fsdp":
        return _print_fsdp(args, model, x, _loss_fn(y), names or ["backprop"])
    result = plan(model, x, _loss_fn(y), budget=args.budget, exact=not args.inexact,
                  engines=[(n, {}) for n in names] if names else None,
                  optimizer=None if args.optimizer == "none" else
                  _make_optimizer(args.optimizer, args.lr),
                  repeats=args.repeats, progress=not args.no_progress,
                  autocast=autocast_dtype(args.precision), compile=args.compile)  # fmt: skip
    print(result)
    if args.save is not None:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {result.save(args.save)} (train with it: leangrad train --plan "
              f"{args.save}, with the same model, data, batch size and dtype)")  # fmt: skip
    if result.per_layer:
        print("the optimizer steps per layer in this plan: train it with --step-per-layer "
              "(leangrad.train.PerLayerOptimizer in your own loop)")
    if parallel is not None:
        chosen = result.chosen
        engine = None if chosen is None or chosen.name == "compile" else result.engine
        _print_per_rank(args, model, x, _loss_fn(y), parallel, engine)
        if result.per_layer:
            print(PER_LAYER_NOTE)
    return 0 if result.engine is not None else 1


PARALLEL_NEEDS_NPROC = (
    "--parallel {parallel} estimates each of several processes' memory and needs their "
    "number: add --nproc N (e.g. --nproc 2), or drop --parallel"
)
PER_LAYER_NOTE = (
    "note: the plan steps the optimizer per layer, so its gradients never all live at once; "
    "the per-rank estimate counts them all (an upper bound)"
)
FSDP_NO_PLAN = (
    "--parallel fsdp prints per-rank estimates instead of searching a plan (a plan measures "
    "one process holding the whole model), so {option} has no effect; drop {option}, or use "
    "--parallel ddp"
)


def _check_parallel_options(args: argparse.Namespace) -> str | None:
    """``--nproc N`` (alone: ddp) and ``--parallel``: the parallel mode, or ``None``.
    ``--parallel`` needs ``--nproc``; options that shape a plan are refused with fsdp,
    which prints an estimate instead of a plan."""
    from .._errors import OptionError

    if args.parallel is not None and args.nproc is None:
        raise OptionError(PARALLEL_NEEDS_NPROC.format(parallel=args.parallel))
    if args.nproc is None:
        return None
    parallel: str = args.parallel or "ddp"
    if parallel == "fsdp":
        given = {"--save": args.save is not None, "--compile": args.compile,
                 "--inexact": args.inexact}  # fmt: skip
        for option, on in given.items():
            if on:
                raise OptionError(FSDP_NO_PLAN.format(option=option))
    return parallel


def _print_fsdp(args: argparse.Namespace, model: Any, x: Any, loss_fn: Any,
                names: list[str]) -> int:  # fmt: skip
    """``--parallel fsdp``: each named engine's per-rank estimate (one line for an engine
    FSDP2 cannot train); exit code 0 when one fits ``--budget``, else 1."""
    from .. import engines as _engines
    from ..planner._parallel import fsdp_refusal

    codes = []
    for name in names:
        why = fsdp_refusal(_engines.engine(name), model)
        if why is not None:
            print(f"{name}: not under --parallel fsdp: {why}")
            continue
        codes.append(_print_per_rank(args, model, x, loss_fn, "fsdp", _engines.engine(name)))
    return 0 if 0 in codes else 1


def _print_per_rank(args: argparse.Namespace, model: Any, x: Any, loss_fn: Any,
                    parallel: str, engine: Any) -> int:  # fmt: skip
    """Print the per-rank estimate (:func:`leangrad.planner._ranks.estimate_per_rank`) and
    how it compares with ``--budget``: exit code 0 when it fits, 1 when it does not (with
    ddp the plan's exit code stands: the caller ignores this one)."""
    from ..planner._ranks import estimate_per_rank

    est = estimate_per_rank(model, x, loss_fn, nproc=args.nproc, parallel=parallel,
                            optimizer=args.optimizer, engine=engine)  # fmt: skip
    print(est)
    print(est.summary(args.budget))
    return 0 if est.fits(args.budget) else 1


def _check_save(path: Path) -> None:
    """``--save FILE``: writable before any work (a directory, or a missing or read-only
    folder, is refused now, not after minutes of measuring)."""
    from .._errors import OptionError

    if path.is_dir():
        raise OptionError(SAVE_IS_DIR.format(path=path))
    check_out_dir(path.parent, "--save")


ENGINES_WITHOUT_BUDGET = (
    "--engines lists the engines a plan may choose from and needs --budget; to train with "
    "one engine, name it with --engine"
)


def _engine_list(value: str | None, *, needs_budget: bool = False) -> list[str] | None:
    """``--engines a,b``: the names, each checked now (an unknown one is an error here, not
    a row of the plan later)."""
    from .. import engines as _engines
    from .._errors import OptionError

    if value is None:
        return None
    if needs_budget:
        raise OptionError(ENGINES_WITHOUT_BUDGET)
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise OptionError(NO_ENGINES.format(value=value))
    for n in names:
        _engines.engine(n)
    return names
