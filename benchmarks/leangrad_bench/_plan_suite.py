"""Suite ``plan``: ``leangrad.plan`` against what a PyTorch user can do by hand, at budgets
that are fractions of backprop's training-step memory.

A training step is backward and an SGD step (momentum 0.9; its state exists before the
measured step). For each model (a class-based ResNet-18-style CNN and GPT from
:mod:`leangrad.zoo`, and an MLP with dropout as an ``nn.Sequential``) and each budget
``baseline + f × backprop's step peak`` (f = 0.75, 0.5, 0.35, 0.25; baseline = parameters,
buffers and inputs):

- leangrad: :func:`leangrad.plan` (exact, ``optimizer=``) picks an engine and whether the
  optimizer steps per layer; its peak is re-measured (tracker) and cross-checked by the
  resident set of a fresh process;
- PyTorch eager, exact (:mod:`leangrad_bench._plan_peers`): ``checkpoint_sequential``,
  per-block and selective checkpointing, each with the optimizer after backward or inside
  it (gradient hooks); the fastest that fits is the peer's answer;
- ``torch.compile`` with ``activation_memory_budget`` (1.0 … 0.0), measured in fresh
  processes by the resident set (the tracker cannot see inductor's buffers), its time as
  a ratio to eager backprop timed beside it in that process.

Peak: tracker, above the baseline, ``.grad`` allocated by the step. Time: medians of
interleaved repeats, 1 thread; every side is reported as a ratio to eager backprop timed in
the same round-robin, so compile's ratio (another process) compares with the others'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tqdm.auto import tqdm

from leangrad import _step
from leangrad.measure import profile_step, time_interleaved
from leangrad.measure._rss import run_json_worker
from leangrad.measure._timer import num_threads
from leangrad.planner._plan import Plan, plan

from ._plan_peers import HOOKED, Step, make_sgd, optimizer_in_backward, peers, workload
from ._report import fmt_bytes
from ._runner import new_record
from ._suites import RunSettings, Suite

__all__ = ["render", "run_plan_suite"]

WORKER = "leangrad_bench._worker"
NOT_MEASURED = (
    "Rockmate: not measured — rockmate 2.0.0 installs beside torch 2.13.0 but does not "
    "import (its dependency rkgb 2.0.0 on PyPI lacks the rkgb.core subpackage), and it "
    'hard-codes CUDA (rockmate.py: self.device = torch.device("cuda"); torch.cuda.Stream '
    "in compiler.make_gd), so it cannot run on this CPU-only machine"
)


class _Stepper:
    """A peer's step as an engine for :func:`profile_step` (the same measurement)."""

    def __init__(self, label: str, step: Step) -> None:
        self.label, self._step = label, step

    def backward(self, model: Any, xs: Any, loss_fn: Any) -> None:
        del model, xs, loss_fn
        self._step()


def run_plan_suite(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """One record per (model, budget, side) and per (model, side) for the smallest peak."""
    if settings.device != "cpu":
        raise ValueError("the plan suite runs on cpu in this version")
    quick = settings.quick
    ctx = {
        "fractions": [float(f) for f in suite.setting("fractions", quick, [0.75, 0.5, 0.35, 0.25])],
        "segments": [int(s) for s in suite.setting("segments", quick, [2, 3, 4, 6])],
        "compile": [float(b) for b in suite.setting("compile_budgets", quick, [1.0, 0.0])],
        "repeats": suite.repeats(quick),
    }
    models: dict[str, dict[str, int]] = dict(suite.setting("models", quick, {}))
    records: list[dict[str, Any]] = []
    bar = tqdm(list(models), desc=f"bench {suite.name}", unit="model",
               disable=not settings.progress)  # fmt: skip
    with num_threads(1):
        for kind in bar:
            records += _run_model(kind, models[kind], ctx, bar)
    bar.close()
    return records


@dataclasses.dataclass
class _Peers:
    """One model's eager PyTorch peers, each profiled once (a hooked copy for those with
    the optimizer in backward)."""

    model: Any
    x: Any
    loss_fn: Any
    steps: dict[str, Step]
    prof: dict[str, Any]

    @classmethod
    def profile(cls, kind: str, size: dict[str, int], segments: list[int]) -> _Peers:
        model, x, loss_fn, parts = workload(kind, size)
        hooked, hx, hloss, hparts = workload(kind, size)  # its own copy: the hooks stay on it
        optimizer_in_backward(hooked)
        opt = make_sgd([p for p in model.parameters() if p.requires_grad])
        steps = {
            **peers(parts, loss_fn, segments, optimizer=opt),
            **peers(hparts, hloss, segments, optimizer=None, suffix=HOOKED),
        }
        prof = {
            n: profile_step(
                _Stepper(n, s),
                hooked if n.endswith(HOOKED) else model,
                hx if n.endswith(HOOKED) else x,
                loss_fn,
                repeats=0,
            )
            for n, s in steps.items()
        }
        return cls(model, x, loss_fn, steps, prof)


def _common(kind: str, size: dict[str, int], ctx: dict[str, Any], ref: Any) -> dict[str, Any]:
    """The fields every record of one model carries."""
    return {
        "series": kind,
        "baseline_bytes": ref.baseline_bytes,
        "backprop_peak_bytes": ref.peak_bytes,
        "not_measured": NOT_MEASURED,
        "config": {
            "model": kind,
            **size,
            "dtype": "float32",
            "threads": 1,
            "optimizer": "SGD(lr=1e-3, momentum=0.9)",
        },
    }


def _at_budget(
    f: float, kind: str, size: dict[str, int], ctx: dict[str, Any], pe: _Peers,
    compiled: dict[float, dict[str, Any]], common: dict[str, Any], reuse: Plan | None = None,
) -> tuple[list[dict[str, Any]], Plan]:  # fmt: skip
    """Plan at ``base + f`` backprop's peak (taking ``reuse``'s peaks: the plan at the
    previous fraction); the three sides' records, and the plan."""
    ref = pe.prof["backprop"]
    base = ref.baseline_bytes
    budget = base + int(f * ref.peak_bytes)
    p = plan(pe.model, pe.x, pe.loss_fn, budget=budget, optimizer=make_sgd,
             repeats=ctx["repeats"], reuse=reuse)  # fmt: skip
    fits = [n for n in pe.steps if pe.prof[n].total_bytes <= budget]
    timed = {"backprop": pe.steps["backprop"], **{n: pe.steps[n] for n in fits}}
    if p.engine is not None:
        timed["leangrad"] = _leangrad_step(p, pe.model, pe.x, pe.loss_fn)
    t = {n: v.median for n, v in time_interleaved(timed, repeats=ctx["repeats"], warmup=1).items()}
    rec = {**common, "sweep": "fraction", "x": f, "budget_bytes": budget}
    return _budget_records(rec, p, kind, size, pe.prof, fits, t, compiled, base), p


def _run_model(
    kind: str, size: dict[str, int], ctx: dict[str, Any], bar: Any
) -> list[dict[str, Any]]:
    pe = _Peers.profile(kind, size, ctx["segments"])
    ref = pe.prof["backprop"]
    base = ref.baseline_bytes
    bar.set_postfix_str(f"{kind}: torch.compile in fresh processes")
    compiled = {
        b: run_json_worker(
            WORKER,
            {
                "mode": "plan-compile",
                "kind": kind,
                "size": size,
                "budget": b,
                "repeats": ctx["repeats"],
            },
        )
        for b in ctx["compile"]
    }
    common = _common(kind, size, ctx, ref)
    records: list[dict[str, Any]] = []
    smallest: dict[str, tuple[str, int]] = {}
    p: Plan | None = None
    for f in ctx["fractions"]:
        bar.set_postfix_str(f"{kind}: plan at {f}")
        recs, p = _at_budget(f, kind, size, ctx, pe, compiled, common, reuse=p)
        records += recs
        measured = [c for c in p.table if c.peak_bytes is not None]
        low = min(measured, key=lambda c: c.peak_bytes or 0)
        smallest["leangrad"] = (low.label, (low.peak_bytes or 0) - base)
    eager = min(pe.prof, key=lambda n: pe.prof[n].peak_bytes)
    smallest["pytorch"] = (eager, pe.prof[eager].peak_bytes)
    low_b = min(compiled, key=lambda b: compiled[b]["rss_compiled"])
    smallest["compile"] = (f"torch.compile(budget={low_b})", compiled[low_b]["rss_compiled"])
    for side, (label, peak) in smallest.items():
        records.append(_record(common, side, label, peak, None, None, sweep="smallest", x=None))
    return records


def _leangrad_step(p: Plan, model: Any, x: Any, loss_fn: Any) -> Step:
    assert p.engine is not None
    step = _step.Step(p.engine, make_sgd, per_layer=p.per_layer)

    def run() -> None:
        step.backward(model, x, loss_fn)

    return run


def _record(
    common: dict[str, Any],
    side: str,
    label: str | None,
    peak: int | None,
    seconds: float | None,
    vs_backprop: float | None,
    **extra: Any,
) -> dict[str, Any]:
    return new_record(
        common,
        engine=side,
        choice=label,
        peak_bytes=peak,
        seconds_median=seconds,
        time_vs_backprop=vs_backprop,
        fits=label is not None,
        **extra,
    )


def _leangrad_side(
    rec: dict[str, Any], p: Plan, kind: str, size: dict[str, int], t: dict[str, float], base: int
) -> dict[str, Any]:
    """leangrad's plan at this budget, its peak re-measured by RSS in a fresh process."""
    row = p.chosen
    if row is None:
        return _record(rec, "leangrad", None, None, None, None)
    rss = run_json_worker(
        WORKER,
        {
            "mode": "plan-engine",
            "kind": kind,
            "size": size,
            "engine": row.name,
            "options": row.options,
            "per_layer": row.per_layer,
        },
    )
    return _record(
        rec,
        "leangrad",
        row.label,
        (row.peak_bytes or 0) - base,
        t["leangrad"],
        t["leangrad"] / t["backprop"],
        predicted_bytes=row.peak_bytes,
        remeasured_bytes=p.remeasured_peak_bytes,
        rss_bytes=rss["rss"],
        rss_backprop_bytes=rss["rss_backprop"],
    )


def _compile_side(
    rec: dict[str, Any], compiled: dict[float, dict[str, Any]], base: int
) -> dict[str, Any]:
    """The fastest ``torch.compile`` setting whose fresh-process peak fits the budget."""
    ok = [b for b, c in compiled.items() if base + c["rss_compiled"] <= rec["budget_bytes"]]
    cb = min(ok, key=lambda b: compiled[b]["t_compiled"] / compiled[b]["t_eager"]) if ok else None
    c = compiled[cb] if cb is not None else None
    return _record(
        rec,
        "compile",
        f"torch.compile(budget={cb})" if c else None,
        c["rss_compiled"] if c else None,
        c["t_compiled"] if c else None,
        c["t_compiled"] / c["t_eager"] if c else None,
        compile_seconds=c["compile_s"] if c else None,
        rss_eager_bytes=c["rss_eager"] if c else None,
    )


def _budget_records(
    rec: dict[str, Any],
    p: Plan,
    kind: str,
    size: dict[str, int],
    prof: dict[str, Any],
    fits: list[str],
    t: dict[str, float],
    compiled: dict[float, dict[str, Any]],
    base: int,
) -> list[dict[str, Any]]:
    """The three sides at one budget: leangrad's plan, the fastest eager peer that fits, and
    the fastest ``torch.compile`` setting whose fresh-process peak fits."""
    tb = t["backprop"]
    best = min(fits, key=lambda n: t[n]) if fits else None
    leangrad = _leangrad_side(rec, p, kind, size, t, base)
    pytorch = _record(
        rec,
        "pytorch",
        best,
        prof[best].peak_bytes if best else None,
        t[best] if best else None,
        t[best] / tb if best else None,
    )
    return [leangrad, pytorch, _compile_side(rec, compiled, base)]


def render(
    suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool = True
) -> list[str]:
    """Markdown: per model and budget the three sides, the smallest peak each reaches, and
    the plan's predicted peak beside its re-measured and fresh-process peaks."""
    del suite, directory, plots
    lines = [
        "A training step (backward + SGD with momentum) at budgets of parameters and inputs "
        "+ f × backprop's step peak. leangrad: `leangrad.plan(exact=True, optimizer=...)`. "
        "PyTorch eager: the fastest of checkpoint_sequential, per-block and selective "
        "checkpointing, each with the optimizer after backward or inside it (gradient "
        "hooks). torch.compile: `activation_memory_budget` settings, peak by fresh-process "
        "RSS. Peak: above parameters and inputs. Time: × eager backprop timed in the same "
        "round-robin (1 thread); last column: leangrad / the fastest exact peer that fits.",
        "",
        f"{records[0]['not_measured']}." if records else "",
        "",
    ]
    for series in dict.fromkeys(r["series"] for r in records):
        rs = [r for r in records if r["series"] == series]
        lines += _budget_table(series, rs) + _smallest_table(rs) + _check_table(rs)
    return lines


def _cell(r: dict[str, Any]) -> str:
    if not r["fits"]:
        return "nothing fits | — | —"
    return f"{r['choice']} | {fmt_bytes(r['peak_bytes'])} | {r['time_vs_backprop']:.2f}×"


def _budget_table(series: str, rs: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"### {series}",
        "",
        "| f | budget | leangrad | peak | time | PyTorch eager | peak | time "
        "| torch.compile | RSS peak | time | leangrad / best peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in dict.fromkeys(r["x"] for r in rs if r["sweep"] == "fraction"):
        side = {r["engine"]: r for r in rs if r["sweep"] == "fraction" and r["x"] == f}
        ours = side["leangrad"]
        peer_times = [
            side[k]["time_vs_backprop"] for k in ("pytorch", "compile") if side[k]["fits"]
        ]
        ratio = (
            f"{ours['time_vs_backprop'] / min(peer_times):.2f}"
            if ours["fits"] and peer_times
            else "—"
        )
        lines.append(
            f"| {f} | {fmt_bytes(ours['budget_bytes'])} | {_cell(ours)} | "
            f"{_cell(side['pytorch'])} | {_cell(side['compile'])} | {ratio} |"
        )
    return [*lines, ""]


def _smallest_table(rs: list[dict[str, Any]]) -> list[str]:
    bp = rs[0]["backprop_peak_bytes"]
    lines = [
        "Smallest step peak each side reaches (its lowest feasible budget):",
        "",
        "| side | how | peak | × backprop |",
        "|---|---|---|---|",
    ]
    for r in (r for r in rs if r["sweep"] == "smallest"):
        lines.append(
            f"| {r['engine']} | {r['choice']} | {fmt_bytes(r['peak_bytes'])} | "
            f"{r['peak_bytes'] / bp:.3f} |"
        )
    return [*lines, ""]


def _check_table(rs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "The plan's predicted peak (in all) against the same step re-measured (tracker) "
        "and in a fresh process (RSS + parameters and inputs):",
        "",
        "| f | predicted | re-measured | fresh-process RSS | RSS / predicted |",
        "|---|---|---|---|---|",
    ]
    for r in rs:
        if r["sweep"] != "fraction" or r["engine"] != "leangrad" or not r["fits"]:
            continue
        rss = r["rss_bytes"] + r["baseline_bytes"]
        lines.append(
            f"| {r['x']} | {fmt_bytes(r['predicted_bytes'])} | "
            f"{fmt_bytes(r['remeasured_bytes'])} | {fmt_bytes(rss)} | "
            f"{rss / r['predicted_bytes']:.3f} |"
        )
    return [*lines, ""]
