"""The engine x {DDP, FSDP2} x {whole step, per-layer} matrix: on 2 local
processes (gloo), ``fit`` trains every exact engine that applies, 3 float64 steps with each
``parallel`` and each ``step_per_layer``, and either ends with the weights one process
reaches on the combined batch (max |delta| <= 1e-12), or refuses, naming the engine and a
fix (``--engine X`` / ``--parallel Y``).

Engines: every exact registered engine (``leangrad.available(exact=True)``) and every
composition of an exact base engine with an exact transform that ``leangrad.engine``
builds (``checkpoint+fad``, ``moonwalk+bits``, ...; ``backprop+T`` is the registered
engine ``T``). Each runs on the first model it applies to: a tiny MLP, else a small RevNet
(``models.revnet``, a Chain of invertible couplings), which moonwalk and revbackprop need.
Compositions that cannot be built (``forward+fad``: forward mode has no backward pass) are
listed as not applicable, with the reason. Estimators (rad, highway, projforward:
``exact=False``) are left out: each rank draws its own samples (``seed_per_rank``), so two
processes do not equal one by design (tests/train/test_distributed_rad_variance.py checks
their averaging).

Ground truth is one process on the combined batch, not today's set of refusals: under DDP
every engine one process trains must train (backprop through PyTorch's DDP, the others
averaged after the step or inside ``on_grad``); under FSDP2 an engine may run (then it
must be equal) or refuse (then clearly). SGD, not Adam: Adam divides by sqrt(v), so a
rounding difference in a near-zero gradient becomes a 1e-9 step, and 1e-12 would test
Adam's conditioning rather than the averaging.

One spawn runs the whole matrix; the table (engine | model | parallel | steps | result) is
printed (``pytest -s``) and written to ``tmp_path/matrix.txt``.
``results/distributed/matrix.py`` runs the same matrix into ``results/distributed/matrix.md``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import leangrad
from leangrad import _errors as errors
from leangrad import data, models, train
from leangrad.engines._transforms import TRANSFORMS
from two_processes import run_two

HERE = Path(__file__).resolve().parent
TOLERANCE = 1e-12
BATCH = 16  # per process; the one-process reference trains on the combined 32
PARALLEL = ("ddp", "fsdp")
STEPPING = (False, True)
FIT: dict[str, Any] = {
    "dtype": "float64", "max_steps": 3, "optimizer": "sgd", "lr": 0.1, "seed": 0,
    "progress": False, "plots": False, "measure_saving": False, "test_fraction": 0.0,
    "track_memory_every": 0, "handle_sigint": False,
}  # fmt: skip
RECIPE = re.compile(r"--(engine|parallel) [\w+]+")
"""A refusal's fix: a flag and a value the user can type."""


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return models.mlp(64, 16, 2, 10)


def _revnet() -> nn.Module:
    torch.manual_seed(0)
    return models.revnet(1, channels=4, classes=10, blocks=2)


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": _mlp, "revnet": _revnet}
"""In order of preference: each engine runs on the first one it applies to."""


def engine_names() -> list[str]:
    """Every exact registered engine, then every exact base + exact transform composition
    (``backprop+T`` is left out: it is the registered engine ``T``)."""
    names = leangrad.available(exact=True)
    exact_transforms = [t for t, cls in TRANSFORMS.items() if cls.exact]
    bases = [n for n in names if n not in TRANSFORMS and n != "backprop"]
    return names + [f"{b}+{t}" for b in bases for t in exact_transforms]


def matrix() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(engine, model)`` pairs to train, and ``(engine, reason)`` for those that apply to
    no model here."""
    run, skipped = [], []
    for name in engine_names():
        try:
            eng = leangrad.engine(name)
        except errors.LeangradError as err:
            skipped.append((name, str(err)))
            continue
        reasons = {m: eng.supports(build()) for m, build in MODELS.items()}
        model = next((m for m, why in reasons.items() if why is None), None)
        if model is None:
            skipped.append((name, "; ".join(f"{m}: {why}" for m, why in reasons.items())))
        else:
            run.append((name, model))
    return run, skipped


def key(name: str, parallel: str, per_layer: bool) -> str:
    return f"{name}|{parallel}|{'per-layer' if per_layer else 'whole'}"


def train_once(name: str, model: str, ds: data.Dataset, *, batch_size: int,
               parallel: str = "ddp", per_layer: bool) -> dict[str, Any]:  # fmt: skip
    """One 3-step fit: ``{"weights": {name: full tensor}}``, ``{"refused": message}`` for a
    leangrad error, or ``{"error": ...}`` for anything else."""
    try:
        res = train.fit(MODELS[model](), ds, engine=name, parallel=parallel,
                        step_per_layer=per_layer, batch_size=batch_size, **FIT)  # fmt: skip
    except errors.LeangradError as err:
        return {"refused": str(err)}
    except Exception as err:  # an engine that breaks is a finding, not a crash of the matrix
        return {"error": f"{type(err).__name__}: {err}"}
    return {"weights": {n: _full(p) for n, p in res.model.named_parameters()}}


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded parameter (a ``DTensor``) gathered from every rank (a
    collective: every rank calls it, in the same order), else a copy."""
    gather = getattr(p, "full_tensor", None)
    return (gather() if callable(gather) else p).detach().clone()


def worker(out_dir: str) -> None:
    """Each of 2 processes: the whole matrix, saved as ``rank{r}.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    ctx = train.init_distributed(torch.device("cpu"))
    ds = data.load("digits")
    runs, _ = matrix()
    out = {key(name, par, pl): train_once(name, model, ds, batch_size=BATCH, parallel=par,
                                         per_layer=pl)
           for name, model in runs for par in PARALLEL for pl in STEPPING}  # fmt: skip
    torch.save(out, Path(out_dir) / f"rank{ctx.rank}.pt")
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


WORKER = r"""
import sys
sys.path.insert(0, sys.argv[2])
from test_parallel_matrix import worker
worker(sys.argv[1])
"""


@dataclasses.dataclass
class Row:
    """One cell of the matrix: what 2 processes did, against one on the combined batch."""

    engine: str
    model: str
    parallel: str
    steps: str
    delta: float | None = None
    refused: str | None = None
    alone_refuses: bool = False
    problem: str | None = None


def _max_delta(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    if got.keys() != want.keys():
        raise KeyError(f"parameters {sorted(got)} != {sorted(want)}")
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def judge(name: str, model: str, parallel: str, per_layer: bool,
          ranks: list[dict[str, Any]], one: dict[str, Any]) -> Row:  # fmt: skip
    """The row for one cell: equal, refused clearly, or the problem found."""
    row = Row(name, model, parallel, "per-layer" if per_layer else "whole")
    if "error" in one:
        row.problem = f"one process failed: {one['error']}"
        return row
    broke = [r["error"] for r in ranks if "error" in r]
    refusals = [r["refused"] for r in ranks if "refused" in r]
    if broke:
        row.problem = f"failed: {broke[0]}"
    elif refusals and len(refusals) < len(ranks):
        row.problem = f"one rank refused, the other trained: {refusals[0]}"
    elif refusals:
        row.refused = refusals[0]
        if "refused" in one:  # the setting itself is refused, on one process too
            row.alone_refuses = True
            return row
        if parallel == "ddp":
            row.problem = "DDP refused an engine that one process trains"
        elif name not in row.refused:
            row.problem = "the refusal does not name the engine"
        elif not RECIPE.search(row.refused):
            row.problem = "the refusal gives no fix (--engine X / --parallel Y)"
    elif "refused" in one:
        row.problem = f"2 processes trained what one process refuses: {one['refused']}"
    else:
        try:
            row.delta = max(_max_delta(r["weights"], one["weights"]) for r in ranks)
        except KeyError as err:
            row.problem = str(err)
            return row
        if not row.delta <= TOLERANCE:
            row.problem = f"max |delta| {row.delta:.3g} > {TOLERANCE:g}"
    return row


def run_matrix(work: Path) -> tuple[list[Row], list[tuple[str, str]]]:
    """Spawn the 2-process matrix in ``work``, train each engine on one process with the
    combined batch, and judge every cell; also the engines that apply to no model."""
    run_two(WORKER, work, str(HERE), timeout=600)
    ranks = [torch.load(work / f"rank{r}.pt", weights_only=True) for r in range(2)]
    ds = data.load("digits")
    runs, skipped = matrix()
    rows = []
    for name, model in runs:
        for per_layer in STEPPING:
            one = train_once(name, model, ds, batch_size=2 * BATCH, per_layer=per_layer)
            for par in PARALLEL:
                k = key(name, par, per_layer)
                rows.append(judge(name, model, par, per_layer, [r[k] for r in ranks], one))
    rows.sort(key=lambda r: (r.parallel, r.steps == "per-layer"))  # stable: engines in order
    return rows, skipped


def _template(message: str, name: str) -> str:
    """``message`` with its first mention of the engine ``name`` written ``<engine>``, so
    the refusals one template makes for every engine are noted once."""
    mention = rf"(?<![\w+]){re.escape(name)}(?![\w+])"
    return re.sub(mention, "<engine>", message, count=1)


def table(rows: list[Row], skipped: list[tuple[str, str]]) -> str:
    """The matrix as a Markdown table, each distinct refusal written once below it (with
    ``<engine>`` for the engine's name)."""
    notes: dict[str, int] = {}
    lines = ["| engine | model | parallel | steps | result |", "|---|---|---|---|---|"]
    for r in rows:
        if r.refused is not None:
            n = notes.setdefault(_template(r.refused, r.engine), len(notes) + 1)
            result = f"refused: [{n}]" + (" (so does one process)" if r.alone_refuses else "")
        else:
            result = "" if r.delta is None else f"max \\|Δ\\| = {r.delta:.1e}"
        if r.problem is not None:
            result = f"{result} **FAIL: {r.problem}**".strip()
        lines.append(f"| {r.engine} | {r.model} | {r.parallel} | {r.steps} | {result} |")
    lines += ["", *(f"[{n}] {msg}" for msg, n in notes.items())]
    if skipped:
        lines += ["", "Not applicable to either model:"]
        lines += [f"- {name}: {why}" for name, why in skipped]
    return "\n".join(lines)


@pytest.mark.slow
def test_every_engine_equals_one_process_or_refuses_clearly(tmp_path: Path) -> None:
    rows, skipped = run_matrix(tmp_path)
    text = table(rows, skipped)
    print("\n" + text)
    (tmp_path / "matrix.txt").write_text(text + "\n")
    where = f"\n(table: {tmp_path / 'matrix.txt'})\n{text}"
    engines = {r.engine for r in rows}
    assert {"backprop", "checkpoint", "checkpoint+fad", "moonwalk", "revbackprop"} <= engines, where
    assert len(rows) == len(engines) * len(PARALLEL) * len(STEPPING), where
    assert not [r for r in rows if r.problem is not None], where
    # the matrix is not vacuous: backprop trains under both, and per-layer under DDP
    ran = {(r.engine, r.parallel, r.steps) for r in rows if r.delta is not None}
    assert {("backprop", "ddp", "whole"), ("backprop", "fsdp", "whole"),
            ("moonwalk", "ddp", "per-layer")} <= ran, where  # fmt: skip


def test_judge_flags_each_way_a_cell_can_fail() -> None:
    """The matrix's verdicts, without processes: every failure mode becomes a problem."""
    same, off = {"weights": {"w": torch.zeros(3)}}, {"weights": {"w": torch.full((3,), 1e-9)}}
    clear = {"refused": "checkpoint cannot: use --engine backprop, or --parallel ddp"}

    def cell(parallel: str, ranks: list[dict[str, Any]], one: dict[str, Any]) -> Row:
        return judge("checkpoint", "mlp", parallel, False, ranks, one)

    assert cell("ddp", [same, same], same).delta == 0.0
    assert cell("fsdp", [clear, clear], same).problem is None
    problems = {
        "max |delta|": cell("ddp", [same, off], same),
        "DDP refused": cell("ddp", [clear, clear], same),
        "does not name": cell("fsdp", [{"refused": "use --engine backprop"}] * 2, same),
        "gives no fix": cell("fsdp", [{"refused": "checkpoint cannot"}] * 2, same),
        "one rank refused": cell("fsdp", [clear, same], same),
        "one process refuses": cell("fsdp", [same, same], clear),
        "failed: boom": cell("ddp", [{"error": "boom"}, same], same),
    }
    for want, row in problems.items():
        assert row.problem is not None and want in row.problem, (want, row)
