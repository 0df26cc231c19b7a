"""Suite ``moonwalk-v1-depth``: pure Moonwalk's speed-up over Forward as
the RevNet deepens, beside the work bound P/(2d).

Moonwalk v1 (Krylov et al.), Fig. 3 and section 6.4: Forward takes 1839 s per batch and
Moonwalk 67 s at 6 layers (27x); > 80000 s and 700 s at 60 layers (110x). Table 1: Forward
O(n²dL²), Moonwalk O(n³L + ndL) (their d: parameters per layer, n: activation size).

What is timed: one gradient step of ``forward`` and of ``moonwalk(mode="pure",
per_example=True)`` on ``models.revnet`` with one block of L additive couplings
(``blocks = 1``, no ψ: every coupling has the same parameters and the same cost, which the
count below assumes), on real 8x8 digits padded to ``channels`` channels. Medians of
interleaved rounds after warm-up (the two engines alternate in each round, every thread
count side by side); gradients are those of the last timed step, compared with autograd's
in float64. Directions per vmapped chunk (``forward_chunk_size``, ``moonwalk_chunk_size``)
are set so that both engines push vmapped batches of about 2000 examples: Forward one chunk
per parameter tensor (576 directions x batch 4), as each chunk has a fixed cost; Moonwalk
512 (on the suite's 2-core CPU, one thread, batch 4, its tangent pass through a coupling
measured 25 µs a direction in chunks of 512 and 38 µs in chunks of 1024 — 4096-example
batches; Forward's 25–33 µs in its chunks).

The work bound. Count *passes*: one coupling's F (two 3x3 convs over its half of the
channels) run once for the whole batch — a forward, the tangent of one direction (a jvp)
or a vjp, which cost about the same; elementwise work is not counted.

- Forward pushes one tangent per parameter coordinate: P directions. A coordinate of
  coupling i (0-based, of L) has a zero tangent until coupling i, so its jvp costs the
  passes from coupling i to the last: L − i, less the part of coupling i before it (s:
  0 for the first conv's weight, ½ for its bias and the second conv's weight, 1 for the
  second conv's bias). Summed over couplings of p coordinates each,
  Σ_i p·(L − i − ½) = P·L/2: *on average a parameter's tangent crosses half the chain*.
- Pure Moonwalk pushes one tangent per coordinate of one example's chain input (the padded
  image, d = channels·size², for all examples at once: ``per_example``), each through all
  L couplings — d·L passes — then its reverse-like sweep (Phase III: per coupling a vijp,
  F and a vjp through it, and F with the parameter vjp: about 4.5 passes), which does not
  grow with d.

So W_Forward / W_Moonwalk ≈ (P·L/2) / (d·L) = **P/(2d)**: parameter directions over input
directions, halved because Forward's tangents start where their parameter sits and
Moonwalk's at the input. It grows linearly with depth (P ∝ L, d fixed). The exact count
for this implementation (:func:`work_bound`: the s above, each vmapped chunk's primal
pass, the extra real forward of each engine and Phase III) is recorded beside it as
``counted_ratio``; it is within (1 + 0.5/L) of P/(2d) here — so 2 is the right constant
(not, e.g., 1: Forward does not push every direction through the whole chain) — and the
report shows both. The head's parameters (a Linear on the pooled features) count in P
although their directions cross no coupling. What the count leaves out is time that is not
arithmetic: Forward pays a fixed cost per vmapped chunk (dispatch, vmap and jvp set-up; fitted
at about 8 ms a chunk on the quick run's CPU, four chunks a coupling), which its tangent work
outgrows with depth — so the measured ratio sits above P/(2d) at 6 couplings and comes down
to it as L grows (quick run, one thread: 1.39x the bound at 6 couplings, 1.07x at 60).

Forward at 60 couplings is slow (P/(2d) × Moonwalk's time), so at each depth it is timed on
the parameters of ``forward_couplings`` couplings only (the rest frozen; their directions
are independent chunks, so its cost is linear in them) and scaled by P/N, the records and
the report saying "extrapolated from N of P directions". The timed couplings are placed
symmetrically about the middle of the chain (:func:`timed_couplings`): a direction's cost
is affine in its coupling's position, so their mean cost is the whole chain's. At the
depths of ``forward_whole`` Forward is also timed on all P directions, and both numbers are
recorded (``extrapolation_error``), to show that the scaling holds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leangrad import _errors as errors
from leangrad import engines
from leangrad.layers import AdditiveCoupling, Chain, SwapHalves
from leangrad.measure import Timing, compare_grads, grads_of, time_across_threads

from ._report import fmt, md_table, pyplot, save_figure
from ._runner import new_record, reference_grads, step_of
from ._suites import RunSettings, Suite, runner
from ._workloads import Workload, build

__all__ = [
    "PAPER_SPEEDUP",
    "WorkBound",
    "render",
    "run_depth",
    "timed_couplings",
    "work_bound",
]

PAPER_SPEEDUP = {6: 27.0, 60: 110.0}
"""Moonwalk v1 section 6.4: Forward's time over Moonwalk's at 6 and at 60 layers."""
PAPER_SECONDS = {6: (1839.0, 67.0), 60: (80000.0, 700.0)}
"""The same, as (Forward s, Moonwalk s) per batch of 512 on 32x32x18 inputs (RTX A4500)."""
TARGET = 0.7
"""The target: each measured ratio at least this fraction of its bound P/(2d)."""
PHASE_III_PASSES = 4.5
"""Passes per coupling of Moonwalk's Phase III: vijp (F, one vjp through F: 2) and the
parameter gradient (F, the vjp of two weights and one input through F: 2.5)."""
LABEL_FORWARD = "forward"
LABEL_PURE = "moonwalk(mode=pure)"

NOT_ONE_BLOCK = (
    "the work count P/(2d) of suite moonwalk-v1-depth assumes couplings of one size, but the "
    "chain also has {others}, which change the couplings' size (ψ between blocks); set "
    "blocks = 1 in the series config"
)
NO_COUPLINGS = "the model has no AdditiveCoupling layers to count; use model = \"revnet\""
BAD_SAMPLE = (
    "forward_couplings must be an even int >= 2 (the timed couplings come in pairs placed "
    "symmetrically about the middle of the chain), got {value!r}"
)
NOT_CPU = "suite moonwalk-v1-depth times on the CPU in this version, got device {device!r}"


@dataclasses.dataclass(frozen=True)
class WorkBound:
    """Forward's and pure Moonwalk's work on one model, counted in passes (module
    docstring): ``bound`` = P/(2d), ``counted_ratio`` = the exact count's ratio."""

    couplings: int
    params: int
    """P: the trainable parameters, one Forward direction each."""
    input_size: int
    """d: one example's chain input (after the stem), one Moonwalk direction each."""
    forward_passes: float
    moonwalk_passes: float

    @property
    def bound(self) -> float:
        return self.params / (2 * self.input_size)

    @property
    def counted_ratio(self) -> float:
        return self.forward_passes / self.moonwalk_passes


def _couplings(model: Chain) -> list[AdditiveCoupling]:
    layers = list(model.layers)
    found = [m for m in layers if isinstance(m, AdditiveCoupling)]
    if not found:
        raise errors.EngineInputError(NO_COUPLINGS)
    others = [type(m).__name__ for m in layers if not isinstance(m, AdditiveCoupling | SwapHalves)]
    if others:
        raise errors.EngineInputError(NOT_ONE_BLOCK.format(others=", ".join(others)))
    return found


def work_bound(model: Chain, example: torch.Tensor, *, forward_chunk: int,
               moonwalk_chunk: int) -> WorkBound:  # fmt: skip
    """P, d and the passes Forward and pure Moonwalk (``per_example``) make on ``model`` for
    inputs shaped like ``example`` (one example or a batch), with ``forward_chunk`` and
    ``moonwalk_chunk`` directions per vmapped chunk (module docstring).

    Raises:
        EngineInputError: a model without couplings, or with layers between them that
            change their size (ψ: ``blocks`` > 1).
    """
    couplings = _couplings(model)
    n = len(couplings)
    with torch.no_grad():
        d = model.stem(example[:1]).numel()
    forward = 0.0
    chunks = 0
    counted: set[int] = set()
    for i, layer in enumerate(couplings):
        convs = [m for m in layer.F.modules() if isinstance(m, nn.Conv2d)]
        for j, conv in enumerate(convs):
            for name, p in conv.named_parameters():
                if not p.requires_grad:
                    continue
                skipped = (j + (name == "bias")) / len(convs)
                forward += p.numel() * (n - i - skipped)
                chunks += math.ceil(p.numel() / forward_chunk)
                counted.add(id(p))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in counted]
    chunks += sum(math.ceil(p.numel() / forward_chunk) for p in rest)  # the head: no coupling
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    forward += n * (chunks + 1)  # each chunk's primal pass, and one real forward
    moonwalk = n * (d + math.ceil(d / moonwalk_chunk) + 2 + PHASE_III_PASSES)
    return WorkBound(couplings=n, params=params, input_size=d, forward_passes=forward,
                     moonwalk_passes=moonwalk)  # fmt: skip


def timed_couplings(depth: int, count: int) -> list[int]:
    """``count`` coupling indices out of ``depth`` (all of them when ``count >= depth``), in
    mirrored pairs i, depth − 1 − i spread evenly: their mean index is (depth − 1)/2, the
    whole chain's, so the mean cost of their Forward directions is the whole chain's.

    Raises:
        OptionError: ``count`` is not an even int >= 2.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 2 or count % 2:
        raise errors.OptionError(BAD_SAMPLE.format(value=count))
    if count >= depth:
        return list(range(depth))
    low = [math.floor((k + 0.5) * depth / count) for k in range(count // 2)]
    return sorted(low + [depth - 1 - i for i in low])


def _freeze_except(model: Chain, keep: list[int]) -> int:
    """Leave trainable only the parameters of the couplings ``keep`` (indices among the
    couplings; all of them: nothing is frozen, the head included); returns how many
    coordinates remain trainable (N, Forward's timed directions)."""
    couplings = _couplings(model)
    if len(keep) < len(couplings):
        for p in model.parameters():
            p.requires_grad_(False)
    for i in keep:
        for p in couplings[i].parameters():
            p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _on(wl: Workload, model: nn.Module) -> Workload:
    """``wl``'s step on another copy of its model (the same inputs and loss)."""
    return dataclasses.replace(wl, model=model)


def _errors(model: nn.Module, ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Max relative error and cosine of ``model``'s trainable ``.grad`` against ``ref``."""
    mine = grads_of(model)
    cmp = compare_grads(mine, {n: ref[n] for n in mine})
    return cmp.max_rel_err, cmp.cosine


def _settings(suite: Suite, quick: bool) -> dict[str, Any]:
    return {
        "forward_chunk": int(suite.setting("forward_chunk_size", quick, 1024)),
        "moonwalk_chunk": int(suite.setting("moonwalk_chunk_size", quick, 512)),
        "batch": suite.setting("batch", quick, None),
        "forward_couplings": suite.setting("forward_couplings", quick, 2),
        "forward_whole": [int(v) for v in suite.setting("forward_whole", quick, [])],
        "repeats": suite.repeats(quick),
        "warmup": int(suite.setting("warmup", quick, 1)),
    }


@runner(threads=True)
def run_depth(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """One record per depth and thread count: P, d, the bound, Forward's and pure
    Moonwalk's seconds, their ratio, ratio / bound, gradient errors (module docstring)."""
    if settings.device != "cpu":
        raise errors.OptionError(NOT_CPU.format(device=settings.device))
    quick = settings.quick
    s = _settings(suite, quick)
    threads = settings.threads or sorted({1, os.cpu_count() or 1})
    common = {"sweep": suite.sweep}
    jobs = suite.jobs(quick)
    for _, depth in jobs:  # refuse a bad sample size before any work
        timed_couplings(int(depth), s["forward_couplings"])
    records: list[dict[str, Any]] = []
    bar = tqdm(jobs, desc=suite.name, unit="depth", disable=not settings.progress)
    for series, depth in bar:
        bar.set_postfix_str(f"{depth} couplings")
        config = {**series.config, suite.sweep: int(depth), "forward_chunk_size":
                  s["forward_chunk"], "moonwalk_chunk_size": s["moonwalk_chunk"]}  # fmt: skip
        if s["batch"] is not None:
            config["batch"] = int(s["batch"])
        for rec in _measure_depth(config, s, threads=threads):
            records.append(new_record(common, rec, series=series.name, x=int(depth)))
    return records


def _measure_depth(config: dict[str, Any], s: dict[str, Any], *,
                   threads: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    """Time Forward (on the timed couplings, and whole where asked) and pure Moonwalk at one
    depth; one record per thread count."""
    wl = build(config)
    assert isinstance(wl.model, Chain)
    depth = int(config["depth"])
    bound = work_bound(wl.model, wl.inputs[0], forward_chunk=s["forward_chunk"],
                       moonwalk_chunk=s["moonwalk_chunk"])  # fmt: skip
    keep = timed_couplings(depth, s["forward_couplings"])
    sub = copy.deepcopy(wl.model)
    timed = _freeze_except(sub, keep)
    whole = depth in s["forward_whole"] and len(keep) < depth
    fwd = engines.engine("forward", chunk_size=s["forward_chunk"])
    pure = engines.engine("moonwalk", mode="pure", per_example=True,
                          chunk_size=s["moonwalk_chunk"])  # fmt: skip
    mw_model = copy.deepcopy(wl.model)
    steps = {LABEL_FORWARD: step_of(fwd, _on(wl, sub)),
             LABEL_PURE: step_of(pure, _on(wl, mw_model))}  # fmt: skip
    full_model = copy.deepcopy(wl.model) if whole else None
    if full_model is not None:
        steps["forward (all directions)"] = step_of(fwd, _on(wl, full_model))
    timings = time_across_threads(steps, threads=threads, repeats=s["repeats"],
                                  warmup=s["warmup"])  # fmt: skip
    ref = reference_grads(config, "cpu")  # autograd's gradient of the same step in float64
    f_err, f_cos = _errors(sub, ref)
    m_err, m_cos = _errors(mw_model, ref)
    fixed: dict[str, Any] = {
        "kind": "moonwalk-depth", "engine": LABEL_PURE, "reference": LABEL_FORWARD,
        "config": config, "couplings": depth, "params": bound.params,
        "input_size": bound.input_size, "bound": bound.bound,
        "counted_ratio": bound.counted_ratio, "forward_passes": bound.forward_passes,
        "moonwalk_passes": bound.moonwalk_passes, "forward_chunk_size": s["forward_chunk"],
        "moonwalk_chunk_size": s["moonwalk_chunk"],
        "forward_timed_couplings": keep, "forward_timed_directions": timed,
        "forward_grad_max_rel_err": f_err, "forward_grad_cosine": f_cos,
        "moonwalk_grad_max_rel_err": m_err, "moonwalk_grad_cosine": m_cos,
        "grad_max_rel_err": max(f_err, m_err), "grad_cosine": min(f_cos, m_cos),
        "paper_speedup": PAPER_SPEEDUP.get(depth), "repeats": s["repeats"],
        "warmup": s["warmup"], "threads_timed": threads,
        "timing": (f"medians of {s['repeats']} interleaved rounds after {s['warmup']} "
                   "warm-up round(s); Forward and pure Moonwalk alternate in each round, "
                   f"at torch threads {threads} side by side"),
    }  # fmt: skip
    if full_model is not None:
        fixed["forward_whole_grad_max_rel_err"] = _errors(full_model, ref)[0]
    out = []
    for n, ts in timings.items():
        out.append({**fixed, **_times(ts, bound, timed, n)})
    return out


def _times(ts: Mapping[str, Timing], bound: WorkBound, timed: int, threads: int
           ) -> dict[str, Any]:  # fmt: skip
    """The time fields of one thread count's record."""
    sub, mw = ts[LABEL_FORWARD], ts[LABEL_PURE]
    scale = bound.params / timed
    extrapolated = sub.median * scale if timed < bound.params else None
    whole = ts.get("forward (all directions)")
    if whole is not None:
        fwd, note = whole.median, f"measured on all {bound.params} directions"
    elif extrapolated is not None:
        fwd = extrapolated
        note = f"extrapolated from {timed} of {bound.params} directions"
    else:
        fwd, note = sub.median, f"measured on all {bound.params} directions"
    if whole is not None and extrapolated is not None:
        note += f" (also extrapolated from {timed} of {bound.params}: {extrapolated:.3g} s)"
    speedup = fwd / mw.median
    return {
        "threads": threads, "seconds_median": mw.median, "seconds_min": mw.minimum,
        "seconds_max": mw.maximum, "time_ratio": mw.median / fwd,
        "forward_seconds": fwd, "forward_extrapolated": whole is None and extrapolated is not None,
        "forward_note": note, "forward_measured_seconds": sub.median,
        "forward_extrapolated_seconds": extrapolated,
        "forward_whole_seconds": None if whole is None else whole.median,
        "extrapolation_error": (None if whole is None or extrapolated is None
                                else extrapolated / whole.median - 1),
        "moonwalk_seconds": mw.median, "speedup": speedup,
        "speedup_over_bound": speedup / bound.bound,
        "speedup_over_counted": speedup / bound.counted_ratio,
    }  # fmt: skip


# -- report -------------------------------------------------------------------------


def _by_threads(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "moonwalk-depth":
            out.setdefault(int(r["threads"]), []).append(r)
    return {n: sorted(rs, key=lambda r: r["couplings"]) for n, rs in sorted(out.items())}


def _targets(n: int, rs: list[dict[str, Any]]) -> list[str]:
    """The two targets at one thread count."""
    sp = [r["speedup"] for r in rs]
    grows = all(b > a for a, b in itertools.pairwise(sp))
    worst = min(rs, key=lambda r: r["speedup_over_bound"])
    near = worst["speedup_over_bound"] >= TARGET
    at = f"{n} thread{'s' if n > 1 else ''}"
    return [
        f"- {at}: the ratio {'increases' if grows else 'does NOT increase'} with depth "
        f"({' → '.join(f'{v:.1f}×' for v in sp)}): {'met' if grows else 'NOT met'}",
        f"- {at}: every ratio ≥ {TARGET} × its bound: {'met' if near else 'NOT met'} (lowest "
        f"ratio/bound {worst['speedup_over_bound']:.2f} at {worst['couplings']} couplings)",
    ]


_TABLE = ("couplings", "P", "d", "bound P/(2d)", "counted", "Forward s", "pure Moonwalk s",
          "ratio", "ratio / bound", "paper", "Forward timed on")  # fmt: skip


def _table(rs: list[dict[str, Any]]) -> list[str]:
    return md_table(_TABLE, (
        (r["couplings"], r["params"], r["input_size"], f"{r['bound']:.1f}×",
         f"{r['counted_ratio']:.1f}×",
         f"{r['forward_seconds']:.3g}{'*' if r['forward_extrapolated'] else ''}",
         f"{r['moonwalk_seconds']:.3g}", f"{r['speedup']:.1f}×",
         f"{r['speedup_over_bound']:.2f}",
         f"{fmt(r.get('paper_speedup'), '.0f')}{'×' if r.get('paper_speedup') else ''}",
         r["forward_note"]) for r in rs))  # fmt: skip


def _plot(path: Path, groups: dict[int, list[dict[str, Any]]]) -> None:
    from matplotlib.ticker import NullFormatter

    fig, ax = pyplot().subplots(figsize=(6.4, 4.4))
    first = next(iter(groups.values()))
    xs = [r["couplings"] for r in first]
    ax.plot(xs, [r["bound"] for r in first], "k--", label="bound P/(2d)")
    for (n, rs), style in zip(groups.items(), ("o-", "s-", "^-"), strict=False):
        ax.plot([r["couplings"] for r in rs], [r["speedup"] for r in rs], style,
                label=f"measured Forward / pure Moonwalk, {n} thread{'s' if n > 1 else ''}")
    ax.plot(list(PAPER_SPEEDUP), list(PAPER_SPEEDUP.values()), "r*", markersize=10,
            label="paper (GPU, 32×32×18 input)")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("additive couplings in the chain (L)")
    ax.set_ylabel("Forward time / pure Moonwalk time (×)")
    grows = all(b["speedup"] > a["speedup"] for a, b in itertools.pairwise(first))
    ax.set_title("Moonwalk's speed-up over Forward grows with depth, as P/(2d) does"
                 if grows else "Moonwalk's speed-up over Forward vs depth, beside P/(2d)",
                 fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def render(suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool) -> list[str]:
    """Markdown for ``moonwalk-v1-depth``: targets, one table per thread count, the
    extrapolation check, gradient errors and the plot."""
    groups = _by_threads(records)
    if not groups:
        return ["No moonwalk-depth records.", ""]
    r0 = next(iter(groups.values()))[0]
    c = r0["config"]
    lines = [
        f"Pure Moonwalk (`per_example`) against Forward on a RevNet of one block of L "
        f"additive couplings (F = conv-ReLU-conv, {c.get('channels')} channels, "
        f"{c.get('size')}×{c.get('size')} digits, batch {c.get('batch')}, "
        f"{c.get('dtype', 'float32')}; directions per vmapped chunk: Forward "
        f"{r0['forward_chunk_size']}, Moonwalk {r0['moonwalk_chunk_size']}). Time: "
        f"{r0['timing']}. *bound* P/(2d): Forward's P parameter directions over Moonwalk's d "
        "input directions, halved because a parameter's tangent crosses on average half "
        "the chain; *counted*: the exact count of passes of this implementation (module "
        "docstring of `leangrad_bench._moonwalk_depth`). *ratio*: Forward s / pure "
        "Moonwalk s; *ratio / bound* above 1 is time the count of passes leaves out, mostly "
        "Forward's fixed cost per vmapped chunk, which weighs less as its tangents cross "
        "more couplings. \\* Forward extrapolated from the directions of the couplings it was "
        "timed on (the rest frozen) × P / N, as the last column says. Paper: Forward "
        f"{PAPER_SECONDS[6][0]:.0f} s vs Moonwalk {PAPER_SECONDS[6][1]:.0f} s at 6 layers "
        f"(27×), > {PAPER_SECONDS[60][0]:.0f} s vs {PAPER_SECONDS[60][1]:.0f} s at 60 "
        "(110×), on a GPU with 32×32×18 inputs, batch 512.",
        "",
        "Targets:",
        "",
    ]
    for n, rs in groups.items():
        lines += _targets(n, rs)
    lines.append("")
    for n, rs in groups.items():
        lines += [f"At {n} thread{'s' if n > 1 else ''}:", "", *_table(rs), ""]
        for r in rs:
            if r.get("extrapolation_error") is not None:
                lines.append(
                    f"- Scaling check at {r['couplings']} couplings, {n} thread(s): Forward "
                    f"on all {r['params']} directions {r['forward_whole_seconds']:.3g} s; "
                    f"extrapolated from {r['forward_timed_directions']} of {r['params']} "
                    f"{r['forward_extrapolated_seconds']:.3g} s "
                    f"({r['extrapolation_error']:+.1%})"
                )
        lines.append("")
    errs = ", ".join(f"{r['couplings']}: Forward {r['forward_grad_max_rel_err']:.1e}, "
                     f"Moonwalk {r['moonwalk_grad_max_rel_err']:.1e}"
                     for r in next(iter(groups.values())))  # fmt: skip
    lines += [f"Gradient max relative error against float64 autograd (couplings: …): {errs}.",
              ""]  # fmt: skip
    if plots:
        png = Path("plots") / f"{suite}.png"
        with contextlib.suppress(ImportError):  # no matplotlib (the [plot] extra): no plot
            _plot(Path(directory) / png, groups)
            lines += [f"![{suite}]({png.as_posix()})", ""]
    return lines
