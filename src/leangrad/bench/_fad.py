"""Bench suite ``fad``: nested forward-mode AD of activation chains (paper section V).

For each model (ResNet-style CNN, BERT-style encoder; :mod:`._fad_models`) and each
composite activation (Swish, tanh-GELU, Mish, written out of primitives), one
process measures, side by side:

- methods ``eager`` (autograd), ``recompute`` (``torch.utils.checkpoint`` around each
  activation), ``fad.nest`` (fx pass), ``fad.nested`` (eager mode) and ``torch.compile``
  (where it compiles on this machine);
- per method: bytes kept at the end of the forward (tracker) and saved by autograd
  (hooks), peak memory of a step (tracker), step time as a ratio to eager (Fig. 8),
  gradient error against eager autograd in float64, and the largest batch whose
  tracker peak fits the budget eager needs at ``budget_batch`` (Fig. 7, found by search);
- the activation alone (``kind = "fad-activation"``): saved bytes and forward+backward
  time of eager, recompute and the fused FAD op on the model's activation shape
  (section V-C: "FAD surpasses recomputation ... on the activation function").

Memory comes from :class:`~leangrad.measure.MemoryTracker` (allocator level); times
from :func:`~leangrad.measure.time_interleaved` (1 thread, interleaved medians).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import functools
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import fad
from .._sizes import fmt_bytes
from ..measure import (
    FORWARD_END,
    MemoryTracker,
    Timing,
    compare_grads,
    mark,
    num_threads,
    saved_tensor_bytes,
    time_across_threads,
    time_interleaved,
)
from ._fad_models import ACTIVATIONS, Act, fad_model, set_recompute
from ._report import at_threads, extra_threads
from ._runner import by_threads, machine_info, new_record, timing_fields
from ._search import bisect_last_fit
from ._suites import RunSettings, Suite, runner

__all__ = ["run_fad"]

METHODS = ("eager", "builtin", "recompute", "fad.nest", "fad.nest(paper)", "fad.nested",
           "torch.compile")  # fmt: skip
"""``builtin``: the model with PyTorch's fused kernel for its activation; ``fad.nest``: the
pass as shipped (a chain that *is* a fused kernel runs by it); ``fad.nest(paper)``: every
chain nested (``builtins=False``), the paper's method."""
_FAD_ACT: dict[str, Callable[[], nn.Module]] = {
    "swish": fad.Swish,
    "gelu": lambda: fad.GELU(approximate="tanh"),
    "mish": fad.Mish,
}
# PyTorch's own kernel for the same function: saves only its input, no primitive chain
_BUILTIN: dict[str, Callable[[], nn.Module]] = {
    "swish": nn.SiLU,
    "gelu": lambda: nn.GELU(approximate="tanh"),
    "mish": nn.Mish,
}
_BUILTIN_NAME = {"swish": "nn.SiLU", "gelu": "nn.GELU(approximate='tanh')", "mish": "nn.Mish"}
_COMPILE_MEMORY = (
    "saved bytes by hooks only; peak not measured: inductor kernels allocate outside the "
    "CPU dispatch-mode tracker"
)


class _Method:
    """One way to run a training step of the same model (parameters shared)."""

    def __init__(self, name: str, model: nn.Module, *, nested: bool = False) -> None:
        self.name, self.model, self.nested = name, model, nested

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        ctx = fad.nested() if self.nested else contextlib.nullcontext()
        with ctx:
            return F.cross_entropy(self.model(x), y)

    def step(self, x: Tensor, y: Tensor, params: list[nn.Parameter]) -> None:
        for p in params:
            p.grad = None
        loss = self.loss(x, y)
        mark(FORWARD_END)
        loss.backward()


def _methods(base: nn.Module, *, compiled: bool) -> dict[str, _Method]:
    rec = set_recompute(copy.deepcopy(base), True)
    rec.load_state_dict(base.state_dict())
    out = {
        "eager": _Method("eager", base),
        "recompute": _Method("recompute", rec),
        "builtin": _Method("builtin", _with_builtins(base)),
        "fad.nest": _Method("fad.nest", fad.nest(base)),
        "fad.nest(paper)": _Method("fad.nest(paper)", fad.nest(base, builtins=False)),
        "fad.nested": _Method("fad.nested", base, nested=True),
    }
    if compiled:
        out["torch.compile"] = _Method("torch.compile", cast(nn.Module, torch.compile(base)))
    return out


def _with_builtins(base: nn.Module) -> nn.Module:
    """A copy of ``base`` (same values) whose composite activations run PyTorch's kernel."""
    model = copy.deepcopy(base)
    for m in model.modules():
        if isinstance(m, Act):
            m.fn = _BUILTIN[m.name]()
    return model


def _params(m: _Method) -> list[nn.Parameter]:
    return [p for p in m.model.parameters() if p.requires_grad]


def _peak(m: _Method, x: Tensor, y: Tensor) -> tuple[int, int | None]:
    """Tracker peak of one step and live bytes at the forward's end, with ``.grad`` buffers
    allocated beforehand (they are baseline, not step memory)."""
    for p in _params(m):
        p.grad = torch.zeros_like(p)
    with MemoryTracker(baseline=(m.model, x, y)) as tracker:
        m.step(x, y, [])
    return tracker.report.peak_bytes, tracker.report.forward_live_bytes


def _memory(m: _Method, x: Tensor, y: Tensor) -> dict[str, int | None]:
    with saved_tensor_bytes(x, y, *m.model.parameters(), *m.model.buffers()) as saved:
        loss = m.loss(x, y)
    del loss
    peak, live = _peak(m, x, y)
    return {"saved_bytes": saved.bytes, "forward_live_bytes": live, "peak_bytes": peak}


def _max_batch(m: _Method, make: Callable[[int], tuple[Tensor, Tensor]], budget: int,
               start: int, cap: int) -> tuple[int, int]:  # fmt: skip
    """Largest batch whose tracker peak fits ``budget`` (doubling, then bisection)."""
    probes = 0

    def fits(b: int) -> bool:
        nonlocal probes
        probes += 1
        x, y = make(b)
        return _peak(m, x, y)[0] <= budget

    lo, hi = 0, start
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    lo = bisect_last_fit(fits, lo, min(hi, cap + 1), relative=64)
    return lo, probes


def _grad_errors(base: nn.Module, make: Callable[[int], tuple[Tensor, Tensor]],
                 names: list[str]) -> dict[str, float]:  # fmt: skip
    """Max relative gradient error of each method against eager autograd, in float64."""
    m64 = copy.deepcopy(base).double()
    x, y = make(4)
    x = x.double() if x.is_floating_point() else x
    methods = _methods(m64, compiled=False)
    ref_m = methods["eager"]
    ref_m.step(x, y, _params(ref_m))
    ref = {n: p.grad.clone() for n, p in m64.named_parameters() if p.grad is not None}
    out: dict[str, float] = {}
    for name in names:
        if name not in methods:
            continue
        m = methods[name]
        m.step(x, y, _params(m))
        got = {n: p.grad.clone() for n, p in m.model.named_parameters() if p.grad is not None}
        out[name] = compare_grads(got, ref).max_rel_err
    return out


def _activation_shape(base: nn.Module, x: Tensor, act: str) -> tuple[int, ...]:
    shapes: list[tuple[int, ...]] = []
    first = next(m for m in base.modules() if type(m).__name__ == "Act")
    hook = first.register_forward_pre_hook(lambda _m, inp: shapes.append(tuple(inp[0].shape)))
    with torch.no_grad():
        base(x)
    hook.remove()
    return shapes[0]


def _activation_records(act: str, shape: tuple[int, ...], repeats: int,
                        device: str) -> dict[str, Any]:  # fmt: skip
    """The activation alone: saved bytes (hooks), fwd+bwd times of eager (the chain of
    primitives), recompute, FAD and ``builtin`` (PyTorch's fused ``nn.SiLU``/``nn.GELU``/
    ``nn.Mish``, which FAD does not beat: it too saves one tensor)."""
    from torch.utils.checkpoint import checkpoint

    fn, fused = ACTIVATIONS[act], _FAD_ACT[act]().to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(shape, generator=gen, device=device)
    g = torch.randn(shape, generator=gen, device=device)
    variants: dict[str, Callable[[Tensor], Tensor]] = {
        "eager": fn,
        "recompute": lambda t: checkpoint(fn, t, use_reentrant=False),
        "fad": fused,
        "builtin": _BUILTIN[act]().to(device),
    }
    saved: dict[str, int] = {}
    for name, f in variants.items():
        x = (x0 * 1).requires_grad_()
        with saved_tensor_bytes() as s:
            out = f(x)
        saved[name] = s.bytes
        del out

    def run(f: Callable[[Tensor], Tensor]) -> Callable[[], None]:
        def go() -> None:
            x = x0.detach().requires_grad_()
            f(x).backward(g)

        return go

    times = time_interleaved({n: run(f) for n, f in variants.items()}, repeats=repeats,
                             warmup=2, reference="fad")  # fmt: skip
    return {"shape": list(shape), "act_saved_bytes": saved,
            "act_seconds": {n: t.median for n, t in times.items()},
            "act_time_ratio_to_fad": {n: t.ratio for n, t in times.items()}}  # fmt: skip


def _compile_ok(base: nn.Module, make: Callable[[int], tuple[Tensor, Tensor]],
                limit_s: float) -> str | None:  # fmt: skip
    """``None`` when torch.compile compiles and runs a step, else why not."""
    try:
        t0 = time.perf_counter()
        m = _Method("torch.compile", cast(nn.Module, torch.compile(copy.deepcopy(base))))
        x, y = make(2)
        m.step(x, y, _params(m))
        took = time.perf_counter() - t0
    except Exception as err:
        return f"torch.compile failed: {type(err).__name__}: {str(err)[:200]}"
    if took > limit_s:
        return f"torch.compile took {took:.0f} s to compile one step (> {limit_s:.0f} s limit)"
    return None


@runner(threads=True)
def run_fad(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Run the ``fad`` suite; one record per (model, activation, method) plus one
    ``fad-activation`` record per (model, activation). Steps are timed at every count of
    ``settings.threads`` side by side (``by_threads``; default one thread), the activation
    alone at the first."""
    quick = settings.quick
    threads = settings.threads or [1]
    machine = machine_info()
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    batch = int(suite.setting("batch", quick, 32))
    budget_batch = int(suite.setting("budget_batch", quick, 32))
    batch_cap = int(suite.setting("batch_cap", quick, 8 * budget_batch))
    repeats = int(suite.setting("repeats", quick, 7))
    act_repeats = int(suite.setting("act_repeats", quick, 21))  # milliseconds each: cheap
    compile_for = list(suite.setting("compile", quick, []))
    compile_limit = float(suite.setting("compile_limit_s", quick, 300))
    models: dict[str, dict[str, int]] = dict(suite.setting("models", quick, {}))
    acts = list(suite.setting("activations", quick, list(ACTIVATIONS)))
    jobs = [(k, a) for k in models for a in acts]
    records: list[dict[str, Any]] = []
    options = {"batch": batch, "budget_batch": budget_batch, "cap": batch_cap,
               "repeats": repeats, "act_repeats": act_repeats, "compile": compile_for,
               "compile_limit": compile_limit, "threads": threads}  # fmt: skip
    bar = tqdm(jobs, desc=f"bench {suite.name}", unit="config", disable=not settings.progress)
    with num_threads(threads[0]):
        for kind, act in bar:
            records += _run_config(
                suite, kind, act, models[kind], quick=quick, device=settings.device,
                settings=options, machine=machine, created=created, bar=bar,
            )  # fmt: skip
    bar.close()
    return records


@dataclasses.dataclass
class _Measured:
    """What :func:`_run_config` measured of every method on one (model, activation)."""

    x: Tensor
    y: Tensor
    mem: dict[str, dict[str, Any]]  # saved, forward-live and peak bytes (ints: fad's steps
    # always end a forward)
    budget: int
    maxb: dict[str, tuple[int, int]]
    errs: dict[str, float]
    times: dict[int, dict[str, Timing]]  # thread count -> method -> timing


def _measure(methods: dict[str, _Method], base: nn.Module,
             make: Callable[[int], tuple[Tensor, Tensor]],
             settings: dict[str, Any]) -> _Measured:  # fmt: skip
    """Memory at ``batch``, max batch under eager's peak at ``budget_batch``, gradient
    errors against eager float64 (torch.compile: against eager float32), interleaved times."""
    x, y = make(settings["batch"])
    mem = {n: _memory(m, x, y) for n, m in methods.items() if n != "torch.compile"}
    bx, by = make(settings["budget_batch"])
    budget = _peak(methods["eager"], bx, by)[0]
    maxb = {n: _max_batch(m, make, budget, settings["budget_batch"], settings["cap"])
            for n, m in methods.items() if n != "torch.compile"}  # fmt: skip
    errs = _grad_errors(base, make, list(methods))
    if "torch.compile" in methods:  # float32 only: a float64 compile would recompile
        f32 = {}
        for n in ("eager", "torch.compile"):
            methods[n].step(x, y, _params(methods[n]))
            f32[n] = {k: p.grad.clone() for k, p in base.named_parameters() if p.grad is not None}
        errs["torch.compile"] = compare_grads(f32["torch.compile"], f32["eager"]).max_rel_err
    steps = {n: (lambda m=m, x=x, y=y: m.step(x, y, _params(m))) for n, m in methods.items()}
    times = time_across_threads(steps, threads=settings["threads"], repeats=settings["repeats"],
                                warmup=2, reference="eager")  # fmt: skip
    return _Measured(x, y, mem, budget, maxb, errs, times)


def _method_fields(name: str, m: _Method, got: _Measured) -> dict[str, Any]:
    """The measured fields of a method that ran: times, error, memory against eager's."""
    first = next(iter(got.times))
    out: dict[str, Any] = dict(timing_fields(got.times[first][name]), threads=first,
                               by_threads=by_threads(got.times, name),
                               grad_max_rel_err=got.errs.get(name))  # fmt: skip
    if name in got.mem:
        mine, ref, maxb = got.mem[name], got.mem["eager"], got.maxb
        out.update(mine, budget_bytes=got.budget, max_batch=maxb[name][0],
                   max_batch_probes=maxb[name][1],
                   max_batch_ratio=maxb[name][0] / max(maxb["eager"][0], 1),
                   saved_ratio=mine["saved_bytes"] / ref["saved_bytes"],
                   forward_live_ratio=mine["forward_live_bytes"] / ref["forward_live_bytes"],
                   peak_ratio=mine["peak_bytes"] / ref["peak_bytes"])  # fmt: skip
    else:  # hooks still see what the compiled autograd function saves
        x, y = got.x, got.y
        with saved_tensor_bytes(x, y, *m.model.parameters(), *m.model.buffers()) as sv:
            loss = m.loss(x, y)
        del loss
        out.update(saved_bytes=sv.bytes, memory_note=_COMPILE_MEMORY,
                   saved_ratio=sv.bytes / got.mem["eager"]["saved_bytes"])  # fmt: skip
    return out


def _run_config(suite: Suite, kind: str, act: str, size: dict[str, int], *, quick: bool,
                device: str, settings: dict[str, Any], machine: Any, created: str,
                bar: Any) -> list[dict[str, Any]]:  # fmt: skip
    """All methods on one (model, activation): records of kind ``fad`` and ``fad-activation``."""
    series = f"{kind}-{act}"
    bar.set_description(f"{suite.name} {series}")
    torch.manual_seed(0)
    base, make0 = fad_model(kind, act, size)
    base = base.to(device)
    gen = torch.Generator().manual_seed(1)

    def make(b: int, make0=make0, gen=gen) -> tuple[Tensor, Tensor]:  # type: ignore[no-untyped-def]
        x, y = make0(b, gen)
        return x.to(device), y.to(device)

    compile_for = settings["compile"]
    want_compile = f"{kind}-{act}" in compile_for or "all" in compile_for
    compile_skip = _compile_ok(base, make, settings["compile_limit"]) if want_compile else (
        "not run for this configuration (suite setting `compile`)")  # fmt: skip
    methods = _methods(base, compiled=compile_skip is None)
    config = {"model": kind, "activation": act, **size, "batch": settings["batch"],
              "budget_batch": settings["budget_batch"], "dtype": "float32",
              "threads": settings["threads"][0]}  # fmt: skip
    got = _measure(methods, base, make, settings)
    stamp = {"config": config, "quick": quick, "machine": machine, "created": created}
    records: list[dict[str, Any]] = []
    for name in METHODS:
        rec = new_record(kind="fad", suite=suite.name, series=series, sweep="method", x=name,
                         engine=name, **stamp, skipped=None, memory_note=None)  # fmt: skip
        if name not in methods:
            rec["skipped"] = compile_skip
        else:
            rec.update(_method_fields(name, methods[name], got))
        if name in ("fad.nest", "fad.nest(paper)"):
            regions: list[fad.Region] = cast(Any, methods[name].model).fad_regions
            rec["fused_chains"] = [list(r.ops) for r in regions if r.name is not None]
            rec["builtin_chains"] = [r.builtin for r in regions if r.builtin is not None]
        records.append(rec)
    shape = _activation_shape(base, got.x, act)
    records.append(new_record(
        kind="fad-activation", suite=suite.name, series=series, sweep="method",
        x="activation", engine="activation", **stamp,
        **_activation_records(act, shape, settings["act_repeats"], device),
    ))  # fmt: skip
    nest_r = next(r for r in records if r["engine"] == "fad.nest")
    bar.set_postfix_str(
        f"saved {nest_r['saved_ratio']:.2f}x batch {nest_r['max_batch_ratio']:.2f}x "
        f"time {nest_r['time_ratio']:.2f}x", refresh=True)  # fmt: skip
    return records


# -- report -------------------------------------------------------------------------------
def _f(v: Any, spec: str = ".2f") -> str:
    return "—" if v is None else format(v, spec)


_mib = functools.partial(fmt_bytes, spec=".2f")
"""Sizes in this report's tables: MiB with two decimals."""


TARGETS = (
    "composite activation saved bytes ≤ 0.5× eager",
    "max batch under the same budget ≥ 1.3× eager",
    "step time ≤ 1.05× eager",
    "recompute ≥ 1.15× slower than FAD on the activation",
    "fad.nest step time ≤ 1.0× the model with PyTorch's built-in activation",
)


def _targets(records: list[dict[str, Any]]) -> list[str]:
    acts = [r for r in records if r.get("kind") == "fad-activation"]
    runs = [r for r in records if r.get("kind") == "fad" and not r.get("skipped")]
    lines = ["| target | measured | met |", "|---|---|---|"]
    saved = [r["act_saved_bytes"]["fad"] / r["act_saved_bytes"]["eager"] for r in acts]
    rec = [r["act_time_ratio_to_fad"]["recompute"] for r in acts]
    for name, vals, ok in (
        (TARGETS[0], saved, lambda v: v <= 0.5),
        (TARGETS[1], [r["max_batch_ratio"] for r in runs
                      if r["engine"].startswith("fad.") and r.get("max_batch_ratio")],
         lambda v: v >= 1.3),
        (TARGETS[2], [r["time_ratio"] for r in runs if r["engine"].startswith("fad.")],
         lambda v: v <= 1.05),
        (TARGETS[3], rec, lambda v: v >= 1.15),
        (TARGETS[4], _vs_builtin(runs), lambda v: v <= 1.0),
    ):  # fmt: skip
        lines += _target_line(name, vals, ok)
    for n in extra_threads(runs):  # the time targets again at each further thread count
        at = [v for r in runs if r["engine"].startswith("fad.")
              and (v := at_threads(r, n, "time_ratio")) is not None]  # fmt: skip
        lines += _target_line(f"{TARGETS[2]}, {n} threads", at, lambda v: v <= 1.05)
        lines += _target_line(f"{TARGETS[4]}, {n} threads", _vs_builtin(runs, n),
                              lambda v: v <= 1.0)  # fmt: skip
    return lines


def _target_line(name: str, vals: list[float], ok: Callable[[float], bool]) -> list[str]:
    if not vals:
        return []
    met = sum(ok(v) for v in vals)
    return [f"| {name} | {min(vals):.2f}–{max(vals):.2f} | {met}/{len(vals)} |"]


def _vs_builtin(runs: list[dict[str, Any]], threads: int | None = None) -> list[float]:
    """Per series: fad.nest's step time / the built-in model's (same interleaved run), at
    the records' own thread count or, given, at ``threads``."""
    by = {(r["series"], r["engine"]): r for r in runs}

    def secs(r: dict[str, Any]) -> Any:
        return r["seconds_median"] if threads is None else at_threads(r, threads, "seconds_median")

    pairs = [(secs(by[s, "fad.nest"]), secs(by[s, "builtin"]))
             for s, e in by if e == "fad.nest" and (s, "builtin") in by]  # fmt: skip
    return [a / b for a, b in pairs if a is not None and b]


def _plot(records: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r.get("kind") == "fad" and not r.get("skipped")]
    series = sorted({r["series"] for r in runs})
    names = [m for m in METHODS if any(r["engine"] == m for r in runs)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / max(len(names), 1)
    for i, m in enumerate(names):
        by = {r["series"]: r for r in runs if r["engine"] == m}
        xs = [j + i * width for j in range(len(series))]
        axes[0].bar(xs, [by[s].get("max_batch") or 0 if s in by else 0 for s in series],
                    width, label=m)  # fmt: skip
        axes[1].bar(xs, [by[s]["time_ratio"] if s in by else 0 for s in series], width, label=m)
    for ax, title in zip(axes, ("max batch under eager's budget (Fig. 7)",
                                "step time / eager (Fig. 8)"), strict=True):  # fmt: skip
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(series))], series, rotation=20)
        ax.set_title(title)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render(suite: str, records: list[dict[str, Any]], directory: Any, *,
           plots: bool = True) -> list[str]:  # fmt: skip
    """Markdown section of ``leangrad report`` for the ``fad`` suite."""
    from pathlib import Path

    lines = ["Nested forward-mode AD of activation chains (paper section V). Memory from the "
             "allocator-level tracker (peak with `.grad` preallocated; *kept* = live at the end "
             "of the forward) and from saved-tensor hooks (*saved*); max batch = largest batch "
             "whose tracker peak fits eager's peak at `budget_batch`. Times: medians of "
             "interleaved repeats, ratio to eager at the same thread count (every thread count "
             "side by side in one run; targets without a count: the first, "
             f"{records[0].get('threads', 1)}). Gradient error: float64 vs eager "
             "autograd (torch.compile: float32).", "", "### Targets", ""]  # fmt: skip
    extra = extra_threads([r for r in records if r.get("kind") == "fad"])
    lines += [*_targets(records), ""]
    if plots:
        png = Path("plots") / f"{suite}.png"
        _plot(records, Path(directory) / png)
        lines += [f"![{suite}]({png.as_posix()})", ""]
    for series in dict.fromkeys(r["series"] for r in records):
        rs = [r for r in records if r["series"] == series]
        cfg = rs[0]["config"]
        lines += [f"### {series}", "", f"`{cfg}`", "",
                  "| method | saved | kept | peak | saved ratio | peak ratio | max batch "
                  "| time ratio" + "".join(f" | time ratio ({n} thr)" for n in extra)
                  + " | s median | grad err | note |",
                  "|---|---|---|---|---|---|---|---|" + "---|" * (3 + len(extra))]  # fmt: skip
        for r in rs:
            if r.get("kind") != "fad":
                continue
            if r.get("skipped"):
                lines.append(f"| {r['engine']} | skipped: {r['skipped']} |||||||||| |"
                             + " |" * len(extra))  # fmt: skip
                continue
            mb = (f"{r['max_batch']} ({r['max_batch_ratio']:.2f}×)"
                  if r.get("max_batch") is not None else "—")  # fmt: skip
            note = r.get("memory_note") or ""
            nested, kernels = r.get("fused_chains") or [], r.get("builtin_chains") or []
            if nested or kernels:
                parts = [f"{len(nested)} chains nested"] if nested else []
                parts += [f"{len(kernels)} run by {kernels[0]}"] if kernels else []
                note = ", ".join(parts)
            lines.append(
                f"| {r['engine']} | {_mib(r.get('saved_bytes'))} "
                f"| {_mib(r.get('forward_live_bytes'))} | {_mib(r.get('peak_bytes'))} "
                f"| {_f(r.get('saved_ratio'))} | {_f(r.get('peak_ratio'))} | {mb} "
                f"| {_f(r.get('time_ratio'))} "
                + "".join(f"| {_f(at_threads(r, n, 'time_ratio'))} " for n in extra)
                + f"| {_f(r.get('seconds_median'), '.4f')} "
                f"| {_f(r.get('grad_max_rel_err'), '.1e')} | {note} |"
            )
        for r in rs:
            if r.get("kind") == "fad-activation":
                sv, tr = r["act_saved_bytes"], r["act_time_ratio_to_fad"]
                lines += ["", f"Activation alone on shape {tuple(r['shape'])}: saved bytes "
                          f"eager {_mib(sv['eager'])}, recompute {_mib(sv['recompute'])}, "
                          f"FAD {_mib(sv['fad'])} ({sv['fad'] / sv['eager']:.2f}× eager); "
                          f"fwd+bwd time / FAD: eager {tr['eager']:.2f}, "
                          f"recompute {tr['recompute']:.2f}."]  # fmt: skip
                if "builtin" in sv:
                    builtin = _BUILTIN_NAME[r["config"]["activation"]]
                    lines[-1] += (f" PyTorch's built-in ({builtin}) "
                                  f"saves {_mib(sv['builtin'])} ({sv['builtin'] / sv['fad']:.2f}× "
                                  f"FAD) and takes {tr['builtin']:.2f}× FAD's time.")  # fmt: skip
        lines.append("")
    return lines
