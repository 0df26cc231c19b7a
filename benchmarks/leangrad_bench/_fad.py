"""Bench suite ``fad``: nested forward-mode AD of activation chains (paper section V).

For each model of the registry (``fad_resnet``, a ResNet-style CNN, and ``fad_bert``, a
BERT-style encoder; :mod:`._models`) and each composite activation (Swish, tanh-GELU,
Mish, written out of primitives), one process measures, side by side:

- methods ``eager`` (autograd), ``builtin`` (PyTorch's fused kernel for the activation),
  ``recompute`` (``torch.utils.checkpoint`` around each activation), ``fad.nest`` (fx
  pass), ``fad.nest(paper)`` (every chain nested), ``fad.nested`` (eager mode) and
  ``torch.compile`` (where it compiles on this machine);
- per method: bytes kept at the end of the forward (tracker) and saved by autograd
  (hooks), peak memory of a step (tracker), step time as a ratio to eager (Fig. 8),
  gradient error against eager autograd in float64, and the largest batch whose
  tracker peak fits the budget eager needs at ``budget_batch`` (Fig. 7, found by search);
- the activation alone (``kind = "fad-activation"``): saved bytes and forward+backward
  time of eager, recompute, the fused FAD op and the built-in on the model's activation
  shape (section V-C: "FAD surpasses recomputation ... on the activation function").

Memory comes from :class:`~leangrad.measure.MemoryTracker` (allocator level); times
from :func:`~leangrad.measure.time_across_threads` (interleaved medians at every thread
count of the run). Every batch of a configuration is drawn from one stream
(:func:`._models.fad_batch`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from leangrad import fad
from leangrad.measure import (
    FORWARD_END,
    MemoryTracker,
    compare_grads,
    mark,
    num_threads,
    saved_tensor_bytes,
    time_across_threads,
    time_interleaved,
)

from ._models import ACTIVATIONS, Act, build, fad_batch
from ._report import (
    at_threads,
    by_series,
    extra_threads,
    fmt,
    md_table,
    mib,
    pyplot,
    save_figure,
)
from ._runner import by_threads, new_record, timing_fields
from ._search import bisect_last_fit
from ._suites import RunSettings, Suite, runner

__all__ = ["METHODS", "render", "run_fad"]

METHODS = ("eager", "builtin", "recompute", "fad.nest", "fad.nest(paper)", "fad.nested",
           "torch.compile")  # fmt: skip
"""``builtin``: the model with PyTorch's fused kernel for its activation; ``fad.nest``: the
pass as shipped (a chain that *is* a fused kernel runs by it); ``fad.nest(paper)``: every
chain nested (``builtins=False``), the paper's method."""
_TANH = {"approximate": "tanh"}
_KERNELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], str]] = {
    "swish": (fad.Swish, nn.SiLU, "nn.SiLU"),
    "gelu": (lambda: fad.GELU(**_TANH), lambda: nn.GELU(**_TANH), "nn.GELU(approximate='tanh')"),
    "mish": (fad.Mish, nn.Mish, "nn.Mish"),
}
"""Activation -> (FAD's fused op, PyTorch's own kernel for the same function, which saves
only its input and no primitive chain, and that kernel's name)."""
_COMPILE_MEMORY = (
    "saved bytes by hooks only; peak not measured: inductor kernels allocate outside the "
    "CPU dispatch-mode tracker"
)
Make = Callable[[int], tuple[Tensor, Tensor]]
"""Batch size -> the next batch of that size from the configuration's stream."""


class _Method:
    """One way to run a training step of the same model (parameters shared)."""

    def __init__(self, name: str, model: nn.Module, *, nested: bool = False) -> None:
        self.name, self.model, self.nested = name, model, nested

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        with fad.nested() if self.nested else contextlib.nullcontext():
            return F.cross_entropy(self.model(x), y)

    def step(self, x: Tensor, y: Tensor, params: list[nn.Parameter]) -> None:
        for p in params:
            p.grad = None
        loss = self.loss(x, y)
        mark(FORWARD_END)
        loss.backward()

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def grads(self, x: Tensor, y: Tensor, of: nn.Module | None = None) -> dict[str, Tensor]:
        """One step's gradients, by the names of ``of`` (default: the method's model)."""
        self.step(x, y, self.params())
        named = (of or self.model).named_parameters()
        return {n: p.grad.clone() for n, p in named if p.grad is not None}

    def saved(self, x: Tensor, y: Tensor) -> int:
        """Bytes autograd saves in the forward (hooks; parameters, buffers, batch excluded)."""
        with saved_tensor_bytes(x, y, *self.model.parameters(), *self.model.buffers()) as s:
            loss = self.loss(x, y)
        del loss
        return s.bytes


def _methods(base: nn.Module, *, compiled: bool) -> dict[str, _Method]:
    rec, builtin = copy.deepcopy(base), copy.deepcopy(base)
    for m in rec.modules():
        if isinstance(m, Act):
            m.recompute = True
    for m in builtin.modules():
        if isinstance(m, Act):
            m.fn = _KERNELS[m.name][1]()
    out = {
        "eager": _Method("eager", base),
        "recompute": _Method("recompute", rec),
        "builtin": _Method("builtin", builtin),
        "fad.nest": _Method("fad.nest", fad.nest(base)),
        "fad.nest(paper)": _Method("fad.nest(paper)", fad.nest(base, builtins=False)),
        "fad.nested": _Method("fad.nested", base, nested=True),
    }
    if compiled:
        out["torch.compile"] = _Method("torch.compile", cast(nn.Module, torch.compile(base)))
    return out


def _peak(m: _Method, x: Tensor, y: Tensor) -> tuple[int, int | None]:
    """Tracker peak of one step and live bytes at the forward's end, with ``.grad`` buffers
    allocated beforehand (they are baseline, not step memory)."""
    for p in m.params():
        p.grad = torch.zeros_like(p)
    with MemoryTracker(baseline=(m.model, x, y)) as tracker:
        m.step(x, y, [])
    return tracker.report.peak_bytes, tracker.report.forward_live_bytes


def _max_batch(m: _Method, make: Make, budget: int, start: int, cap: int) -> tuple[int, int]:
    """Largest batch whose tracker peak fits ``budget`` (doubling, then bisection), and
    the probes it took."""
    probes = 0

    def fits(b: int) -> bool:
        nonlocal probes
        probes += 1
        return _peak(m, *make(b))[0] <= budget

    lo, hi = 0, start
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    return bisect_last_fit(fits, lo, min(hi, cap + 1), relative=64), probes


def _grad_errors(base: nn.Module, make: Make, names: list[str]) -> dict[str, float]:
    """Max relative gradient error of each method against eager autograd, in float64."""
    x, y = make(4)
    x = x.double() if x.is_floating_point() else x
    methods = _methods(copy.deepcopy(base).double(), compiled=False)
    ref = methods["eager"].grads(x, y)
    return {n: compare_grads(methods[n].grads(x, y), ref).max_rel_err
            for n in names if n in methods}  # fmt: skip


def _activation_records(act: str, shape: tuple[int, ...], repeats: int,
                        device: str) -> dict[str, Any]:  # fmt: skip
    """The activation alone: saved bytes (hooks), fwd+bwd times of eager (the chain of
    primitives), recompute, FAD and ``builtin`` (PyTorch's fused ``nn.SiLU``/``nn.GELU``/
    ``nn.Mish``, which FAD does not beat: it too saves one tensor)."""
    from torch.utils.checkpoint import checkpoint

    fn, (fused, kernel, _) = ACTIVATIONS[act], _KERNELS[act]
    gen = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(shape, generator=gen, device=device)
    g = torch.randn(shape, generator=gen, device=device)
    variants: dict[str, Callable[[Tensor], Tensor]] = {
        "eager": fn,
        "recompute": lambda t: checkpoint(fn, t, use_reentrant=False),
        "fad": fused().to(device),
        "builtin": kernel().to(device),
    }
    saved: dict[str, int] = {}
    for name, f in variants.items():
        x = (x0 * 1).requires_grad_()
        with saved_tensor_bytes() as s:
            out = f(x)
        saved[name] = s.bytes
        del out

    def run(f: Callable[[Tensor], Tensor]) -> Callable[[], None]:
        return lambda: f(x0.detach().requires_grad_()).backward(g)

    times = time_interleaved({n: run(f) for n, f in variants.items()}, repeats=repeats,
                             warmup=2, reference="fad")  # fmt: skip
    return {"shape": list(shape), "act_saved_bytes": saved,
            "act_seconds": {n: t.median for n, t in times.items()},
            "act_time_ratio_to_fad": {n: t.ratio for n, t in times.items()}}  # fmt: skip


def _compile_ok(base: nn.Module, make: Make, limit_s: float) -> str | None:
    """``None`` when torch.compile compiles and runs a step, else why not."""
    try:
        t0 = time.perf_counter()
        m = _Method("torch.compile", cast(nn.Module, torch.compile(copy.deepcopy(base))))
        x, y = make(2)
        m.step(x, y, m.params())
        took = time.perf_counter() - t0
    except Exception as err:
        return f"torch.compile failed: {type(err).__name__}: {str(err)[:200]}"
    if took > limit_s:
        return f"torch.compile took {took:.0f} s to compile one step (> {limit_s:.0f} s limit)"
    return None


@dataclasses.dataclass(frozen=True)
class _Options:
    """The suite's settings for one run (``quick_*`` values in quick mode)."""

    batch: int
    budget_batch: int
    cap: int
    repeats: int
    act_repeats: int
    compile: list[str]
    compile_limit: float
    threads: list[int]

    @classmethod
    def of(cls, suite: Suite, settings: RunSettings) -> _Options:
        def get(key: str, default: Any) -> Any:
            return suite.setting(key, settings.quick, default)

        budget_batch = int(get("budget_batch", 32))
        return cls(int(get("batch", 32)), budget_batch, int(get("batch_cap", 8 * budget_batch)),
                   int(get("repeats", 7)), int(get("act_repeats", 21)),
                   list(get("compile", [])), float(get("compile_limit_s", 300)),
                   settings.threads or [1])  # fmt: skip


@runner(threads=True)
def run_fad(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Run the ``fad`` suite; one record per (model, activation, method) plus one
    ``fad-activation`` record per (model, activation). Steps are timed at every count of
    ``settings.threads`` side by side (``by_threads``; default one thread), the activation
    alone at the first."""
    opts = _Options.of(suite, settings)
    models: dict[str, dict[str, int]] = dict(suite.setting("models", settings.quick, {}))
    acts = list(suite.setting("activations", settings.quick, list(ACTIVATIONS)))
    jobs = [(k, a) for k in models for a in acts]
    records: list[dict[str, Any]] = []
    bar = tqdm(jobs, desc=f"bench {suite.name}", unit="config", disable=not settings.progress)
    with num_threads(opts.threads[0]):
        for kind, act in bar:
            bar.set_description(f"{suite.name} {kind}-{act}")
            records += _run_config(kind, act, models[kind], opts, settings.device)
            nest = next(r for r in records[::-1] if r["engine"] == "fad.nest")
            bar.set_postfix_str(f"saved {nest['saved_ratio']:.2f}x batch "
                                f"{nest['max_batch_ratio']:.2f}x time {nest['time_ratio']:.2f}x",
                                refresh=True)  # fmt: skip
    bar.close()
    return records


def _measure(methods: dict[str, _Method], base: nn.Module, make: Make,
             opts: _Options) -> tuple[Tensor, dict[str, dict[str, Any]]]:  # fmt: skip
    """The batch at ``batch`` and every method's measured fields: memory at that batch
    against eager's, max batch under eager's peak at ``budget_batch``, gradient error
    against eager in float64 (torch.compile: in float32), interleaved times."""
    x, y = make(opts.batch)
    tracked = {n: m for n, m in methods.items() if n != "torch.compile"}
    mem: dict[str, dict[str, Any]] = {}
    for n, m in tracked.items():
        saved = m.saved(x, y)
        peak, live = _peak(m, x, y)
        mem[n] = {"saved_bytes": saved, "forward_live_bytes": live, "peak_bytes": peak}
    budget = _peak(methods["eager"], *make(opts.budget_batch))[0]
    maxb = {n: _max_batch(m, make, budget, opts.budget_batch, opts.cap)
            for n, m in tracked.items()}  # fmt: skip
    errs = _grad_errors(base, make, list(methods))
    if "torch.compile" in methods:  # float32 only: a float64 compile would recompile
        f32 = {n: methods[n].grads(x, y, of=base) for n in ("eager", "torch.compile")}
        errs["torch.compile"] = compare_grads(f32["torch.compile"], f32["eager"]).max_rel_err
    steps = {n: functools.partial(m.step, x, y, m.params()) for n, m in methods.items()}
    times = time_across_threads(steps, threads=opts.threads, repeats=opts.repeats, warmup=2,
                                reference="eager")  # fmt: skip
    first, ref = next(iter(times)), mem["eager"]
    out: dict[str, dict[str, Any]] = {}
    for n, m in methods.items():
        out[n] = dict(timing_fields(times[first][n]), threads=first,
                      by_threads=by_threads(times, n), grad_max_rel_err=errs.get(n))  # fmt: skip
        if n not in mem:  # hooks still see what the compiled autograd function saves
            saved = m.saved(x, y)
            out[n].update(saved_bytes=saved, memory_note=_COMPILE_MEMORY,
                          saved_ratio=saved / ref["saved_bytes"])  # fmt: skip
            continue
        mine, (best, probes) = mem[n], maxb[n]
        out[n].update(mine, budget_bytes=budget, max_batch=best, max_batch_probes=probes,
                      max_batch_ratio=best / max(maxb["eager"][0], 1),
                      **{f"{k.removesuffix('_bytes')}_ratio": v / ref[k] for k, v in mine.items()})
    return x, out


def _run_config(kind: str, act: str, size: dict[str, int], opts: _Options,
                device: str) -> list[dict[str, Any]]:  # fmt: skip
    """All methods on one (model, activation): records of kind ``fad`` and ``fad-activation``."""
    series, name, reg = f"{kind}-{act}", f"fad_{kind}", {**size, "activation": act}
    base = build(name, reg, batch=opts.batch, device=device).model
    gen = torch.Generator().manual_seed(1)  # the registry's stream for seed 0

    def make(b: int) -> tuple[Tensor, Tensor]:
        x, y = fad_batch(name, reg, b, gen)
        return x.to(device), y.to(device)

    want = series in opts.compile or "all" in opts.compile
    compile_skip = _compile_ok(base, make, opts.compile_limit) if want else (
        "not run for this configuration (suite setting `compile`)")  # fmt: skip
    methods = _methods(base, compiled=compile_skip is None)
    config = {"model": kind, "activation": act, **size, "batch": opts.batch,
              "budget_batch": opts.budget_batch, "dtype": "float32",
              "threads": opts.threads[0]}  # fmt: skip
    x, fields = _measure(methods, base, make, opts)
    head = {"kind": "fad", "series": series, "sweep": "method"}
    records: list[dict[str, Any]] = []
    for method in METHODS:
        rec = new_record(head, x=method, engine=method, config=config, skipped=None,
                         memory_note=None)  # fmt: skip
        if method not in methods:
            rec["skipped"] = compile_skip
        else:
            rec.update(fields[method])
        if method in ("fad.nest", "fad.nest(paper)"):
            regions: list[fad.Region] = cast(Any, methods[method].model).fad_regions
            rec["fused_chains"] = [list(r.ops) for r in regions if r.name is not None]
            rec["builtin_chains"] = [r.builtin for r in regions if r.builtin is not None]
        records.append(rec)
    shapes: list[tuple[int, ...]] = []  # the first activation's input shape
    first = next(m for m in base.modules() if isinstance(m, Act))
    hook = first.register_forward_pre_hook(lambda _m, inp: shapes.append(tuple(inp[0].shape)))
    with torch.no_grad():
        base(x)
    hook.remove()
    records.append(new_record(
        head, kind="fad-activation", x="activation", engine="activation", config=config,
        **_activation_records(act, shapes[0], opts.act_repeats, device),
    ))  # fmt: skip
    return records


# -- report -------------------------------------------------------------------------------
TARGETS = (
    "composite activation saved bytes ≤ 0.5× eager",
    "max batch under the same budget ≥ 1.3× eager",
    "step time ≤ 1.05× eager",
    "recompute ≥ 1.15× slower than FAD on the activation",
    "fad.nest step time ≤ 1.0× the model with PyTorch's built-in activation",
)


def _runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "fad" and not r.get("skipped")]


def _targets(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Rows ``(target, measured range, met/of)`` of every target with values; the step
    time targets again at each further thread count."""
    acts = [r for r in records if r.get("kind") == "fad-activation"]
    runs = _runs(records)
    fads = [r for r in runs if r["engine"].startswith("fad.")]
    rows = [
        (TARGETS[0], [r["act_saved_bytes"]["fad"] / r["act_saved_bytes"]["eager"] for r in acts],
         lambda v: v <= 0.5),
        (TARGETS[1], [r["max_batch_ratio"] for r in fads if r.get("max_batch_ratio")],
         lambda v: v >= 1.3),
        (TARGETS[2], [r["time_ratio"] for r in fads], lambda v: v <= 1.05),
        (TARGETS[3], [r["act_time_ratio_to_fad"]["recompute"] for r in acts],
         lambda v: v >= 1.15),
        (TARGETS[4], _vs_builtin(runs), lambda v: v <= 1.0),
    ]  # fmt: skip
    for n in extra_threads(runs):
        at = [v for r in fads if (v := at_threads(r, n, "time_ratio")) is not None]
        rows += [(f"{TARGETS[2]}, {n} threads", at, lambda v: v <= 1.05),
                 (f"{TARGETS[4]}, {n} threads", _vs_builtin(runs, n), lambda v: v <= 1.0)]
    return [(name, f"{min(vals):.2f}–{max(vals):.2f}", f"{sum(map(ok, vals))}/{len(vals)}")
            for name, vals, ok in rows if vals]  # fmt: skip


def _vs_builtin(runs: list[dict[str, Any]], threads: int | None = None) -> list[float]:
    """Per series: fad.nest's step time / the built-in model's (same interleaved run), at
    the records' own thread count or, given, at ``threads``."""
    by = {(r["series"], r["engine"]): r for r in runs}

    def secs(r: dict[str, Any]) -> Any:
        return r["seconds_median"] if threads is None else at_threads(r, threads, "seconds_median")

    pairs = [(secs(by[s, "fad.nest"]), secs(by[s, "builtin"]))
             for s, e in by if e == "fad.nest" and (s, "builtin") in by]  # fmt: skip
    return [a / b for a, b in pairs if a is not None and b]


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    """Fig. 7 (max batch under eager's budget) and Fig. 8 (step time / eager) as bars per
    (model, activation) and method."""
    plt = pyplot()
    runs = _runs(records)
    series = sorted({r["series"] for r in runs})
    names = [m for m in METHODS if any(r["engine"] == m for r in runs)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / max(len(names), 1)
    for i, m in enumerate(names):
        by = {r["series"]: r for r in runs if r["engine"] == m}
        xs = [j + i * width for j in range(len(series))]
        axes[0].bar(xs, [(by[s].get("max_batch") or 0) if s in by else 0 for s in series],
                    width, label=m)  # fmt: skip
        axes[1].bar(xs, [by[s]["time_ratio"] if s in by else 0 for s in series], width, label=m)
    for ax, title, ylabel in (
        (axes[0], "FAD fits larger batches in eager's budget (Fig. 7)", "max batch (examples)"),
        (axes[1], "step time / eager at the same thread count (Fig. 8)", "time ratio (×)"),
    ):  # fmt: skip
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(series))], series, rotation=20)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def _method_row(r: dict[str, Any], extra: list[int]) -> list[Any]:
    """One method's cells of a series table."""
    if r.get("skipped"):
        return [r["engine"], f"skipped: {r['skipped']}", *[""] * (9 + len(extra))]
    mb = (f"{r['max_batch']} ({r['max_batch_ratio']:.2f}×)"
          if r.get("max_batch") is not None else "—")  # fmt: skip
    note = r.get("memory_note") or ""
    nested, kernels = r.get("fused_chains") or [], r.get("builtin_chains") or []
    if nested or kernels:
        parts = [f"{len(nested)} chains nested"] if nested else []
        note = ", ".join(parts + ([f"{len(kernels)} run by {kernels[0]}"] if kernels else []))
    ratios = [r.get("saved_ratio"), r.get("peak_ratio")]
    times = [r.get("time_ratio"), *(at_threads(r, n, "time_ratio") for n in extra)]
    return [r["engine"], mib(r.get("saved_bytes")), mib(r.get("forward_live_bytes")),
            mib(r.get("peak_bytes")), *(fmt(v, ".2f") for v in ratios), mb,
            *(fmt(v, ".2f") for v in times), fmt(r.get("seconds_median"), ".4f"),
            fmt(r.get("grad_max_rel_err"), ".1e"), note]  # fmt: skip


def _activation_line(r: dict[str, Any]) -> str:
    sv, tr = r["act_saved_bytes"], r["act_time_ratio_to_fad"]
    line = (f"Activation alone on shape {tuple(r['shape'])}: saved bytes eager "
            f"{mib(sv['eager'])}, recompute {mib(sv['recompute'])}, FAD {mib(sv['fad'])} "
            f"({sv['fad'] / sv['eager']:.2f}× eager); fwd+bwd time / FAD: eager "
            f"{tr['eager']:.2f}, recompute {tr['recompute']:.2f}.")  # fmt: skip
    if "builtin" in sv:
        builtin = _KERNELS[r["config"]["activation"]][2]
        line += (f" PyTorch's built-in ({builtin}) saves {mib(sv['builtin'])} "
                 f"({sv['builtin'] / sv['fad']:.2f}× FAD) and takes {tr['builtin']:.2f}× "
                 "FAD's time.")  # fmt: skip
    return line


def render(suite: str, records: list[dict[str, Any]], directory: Any, *,
           plots: bool = True) -> list[str]:  # fmt: skip
    """Markdown section of ``leangrad report`` for the ``fad`` suite."""
    lines = ["Nested forward-mode AD of activation chains (paper section V). Memory from the "
             "allocator-level tracker (peak with `.grad` preallocated; *kept* = live at the end "
             "of the forward) and from saved-tensor hooks (*saved*); max batch = largest batch "
             "whose tracker peak fits eager's peak at `budget_batch`. Times: medians of "
             "interleaved repeats, ratio to eager at the same thread count (every thread count "
             "side by side in one run; targets without a count: the first, "
             f"{records[0].get('threads', 1)}). Gradient error: float64 vs eager "
             "autograd (torch.compile: float32).", "", "### Targets", "",
             *md_table(("target", "measured", "met"), _targets(records)), ""]  # fmt: skip
    if plots:
        png = Path("plots") / f"{suite}.png"
        _plot(records, Path(directory) / png)
        lines += [f"![{suite}]({png.as_posix()})", ""]
    extra = extra_threads([r for r in records if r.get("kind") == "fad"])
    header = ("method", "saved", "kept", "peak", "saved ratio", "peak ratio", "max batch",
              "time ratio", *(f"time ratio ({n} thr)" for n in extra), "s median", "grad err",
              "note")  # fmt: skip
    for series, rs in by_series(records).items():
        lines += [f"### {series}", "", f"`{rs[0]['config']}`", "",
                  *md_table(header, (_method_row(r, extra) for r in rs if r["kind"] == "fad"))]
        for r in rs:
            if r["kind"] == "fad-activation":
                lines += ["", _activation_line(r)]
        lines.append("")
    return lines
