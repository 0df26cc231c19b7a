"""The paper-only parts of the Randomized-AD suites (Oktay et al., ICLR 2021).

- :func:`run_pde` (``rad-pde``, section 5 and Fig. 7): the reaction-diffusion control
  problem (:mod:`leangrad.rad._pde`) optimised with Adam from exact and RAD gradients;
  loss curves and the measured stored state.
- :func:`run_peer` (``rad-peer``, section 4.3) on the paper's MNIST MLP
  (784-300-300-300-10, batch 150, fraction 0.1, a different sample per example):

  - *peer rows*: backprop; leangrad ``rad`` without replacement (its default) and with
    replacement; the official PrincetonLIPS code (``RandMatMul``, ``full_random=True,
    sparse=True``: indices drawn with replacement, the input rebuilt dense in backward), its
    network ``MNISTFCNet`` with the same weights. Columns: median step time of interleaved
    repeats at each of ``threads``, tracker peak, saved bytes, fresh-process peak RSS, and
    the gradient's mean squared error against the full-training-set gradient over
    ``draws`` random batches (as ``rad-variance``).
  - *crossover rows*: for every model, mode and fraction the ``rad-*`` suites run, the
    smallest batch whose RAD step peaks below backprop's on the tracker (bisection between
    the batches where it does not and does), and both peaks and fresh-process RSS there.

The official code is not on PyPI: point ``LEANGRAD_RAD_OFFICIAL`` at the ``nn_experiments``
folder of a clone of github.com/PrincetonLIPS/RandomizedAutomaticDifferentiation; without it
the official rows are recorded as skipped, saying so. Its ``layers.py`` imports torchvision
without using it; where torchvision is not installed an empty module stands in for it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from leangrad import data
from leangrad._sizes import fmt_bytes
from leangrad.measure import MemoryTracker, run_rss_worker, time_across_threads
from leangrad.measure._rss import measure_rss

from ._models import rad_network
from ._rad import (
    SAVED_NOTE,
    _load,
    _record,
    band_records,
    bands,
    final_bands,
    fmt_band,
    full_gradient,
    memory_of,
    plot_band,
    randomized,
    series_sections,
    squared_errors,
)
from ._report import md_table, pyplot, save_series_figure
from ._runner import new_record
from ._search import bisect_last_fit
from ._suites import RunSettings, Suite, runner

__all__ = ["OFFICIAL_ENV", "official_mlp", "peer_model", "render_pde", "render_peer",
           "run_pde", "run_peer"]  # fmt: skip

PDE_SEED_STRIDE = 100_000
"""Replicate r of a RAD lane draws iteration i's sample from seed ``seed + r·stride + i``,
so the replicates' streams never overlap (iteration i of one is not i+1 of another)."""


def run_pde(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Adam on the reaction-diffusion control from exact and RAD gradients (Fig. 7): the
    exact lane once (deterministic), each RAD fraction over ``seeds`` replicates of its
    random samples from the same initial control; per-replicate ``rad-pde`` records and
    their ``rad-pde-band`` summaries (median and min–max band of the loss per iteration)."""
    from leangrad.rad._pde import ReactionDiffusion, optimize, pde_gradient

    quick = settings.quick
    seed = int(suite.setting("seed", quick, 0))
    seeds = int(suite.setting("seeds", quick, 1))
    iterations = int(suite.setting("iterations", quick, 300))
    lr = float(suite.setting("lr", quick, 0.05))
    fractions = [float(f) for f in suite.setting("fractions", quick, [1.0, 0.1, 0.01])]
    problem = ReactionDiffusion(
        n=int(suite.setting("n", quick, 15)),
        steps=int(suite.setting("steps", quick, 1024)),
        t_end=float(suite.setting("t_end", quick, 2.0)),
        D=float(suite.setting("D", quick, 0.25)),
    )
    theta0 = problem.initial_theta(seed=seed, device=settings.device)
    lanes = [(f, r) for f in fractions for r in range(1 if f >= 1.0 else seeds)]
    records: list[dict[str, Any]] = []
    bar = tqdm(total=iterations * len(lanes), desc=suite.name, disable=not settings.progress)
    for fraction, rep in lanes:
        label = "exact" if fraction >= 1.0 else f"RAD {fraction}"
        stream = seed + rep * PDE_SEED_STRIDE
        bar.set_description(f"{suite.name} {label} seed {rep}")
        with MemoryTracker(baseline=(theta0,)) as tracker:
            res = pde_gradient(problem, theta0, fraction=fraction, seed=stream)
            del res
        t0 = time.perf_counter()
        run = optimize(
            problem, theta0, fraction=fraction, iterations=iterations, lr=lr, seed=stream,
            tick=lambda: bar.update(1),
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        config = {"n": problem.n, "steps": problem.steps, "t_end": problem.t_end,
                  "D": problem.D, "dt": problem.dt, "dx": problem.dx,
                  "ftcs_ratio": problem.D * problem.dt / problem.dx**2, "fraction": fraction,
                  "iterations": iterations, "lr": lr, "seed": seed}  # fmt: skip
        last = len(run.losses) - 1
        for i, loss in enumerate(run.losses):
            records.append(_record(
                "rad-pde", engine=label, series="reaction-diffusion",
                sweep="iteration", x=i, train_loss=loss, fraction=fraction, config=config,
                peak_bytes=tracker.report.peak_bytes, stored_values=run.stored_values,
                saved_bytes=tracker.report.forward_live_bytes, seed=rep,
                train_seconds=seconds if i == last else None,
                theta=run.theta.tolist() if i == last else None,
            ))  # fmt: skip
    bar.close()
    return records + bands(records, kind="rad-pde", band_kind="rad-pde-band")


def render_pde(suite: str, records: list[dict[str, Any]], directory: Any, *,
               plots: bool) -> list[str]:  # fmt: skip
    """The PDE control's loss per Adam iteration: each lane's median over its replicates
    with the min–max band shaded (the exact lane is one deterministic run)."""
    recs = band_records(records, "rad-pde", "rad-pde-band")
    seeds = max(len(r["seeds"]) for r in recs)
    note = (
        f"Lines: median over {seeds} replicates of each RAD lane's random samples (same "
        "initial control); shaded: min–max over them. The exact lane is deterministic: one "
        "run. Table cells: median [min–max] at the last iteration."
    )

    def figure(series: str, rs: list[dict[str, Any]]) -> list[str]:
        fig, ax = pyplot().subplots(figsize=(7, 4))
        plot_band(ax, rs, "train_loss", ylabel="control loss", log=True, reference="exact",
                  xlabel="Adam iteration")  # fmt: skip
        ax.legend(fontsize=8)
        least = min((r for r in final_bands(rs).values() if r.get("fraction", 1) < 1),
                    key=lambda r: r["fraction"], default=None)  # fmt: skip
        what = ("loss per iteration" if least is None else
                f"storing {least['fraction']:g} of the state, RAD optimises as the exact "
                "gradient does")  # fmt: skip
        ax.set_title(f"{suite}: {what}\n(median, min–max band over {seeds} replicates)",
                     fontsize=10)  # fmt: skip
        return save_series_figure(fig, suite, series, directory)

    def table(series: str, rs: list[dict[str, Any]]) -> list[str]:
        return md_table(
            ("run", "fraction", "saved", "peak", "final iteration", "replicates", "loss",
             "train s"),
            ((label, (r.get("config") or {}).get("fraction"), fmt_bytes(r.get("saved_bytes")),
              fmt_bytes(r.get("peak_bytes")), r["x"], r["n_seeds"],
              fmt_band(r, "train_loss", ".4g"), fmt_band(r, "train_seconds", ".1f"))
             for label, r in final_bands(rs).items()),
        )  # fmt: skip

    return [SAVED_NOTE, "", *series_sections(recs, note=note, table=table,
                                             figure=figure if plots else None)]  # fmt: skip


OFFICIAL_ENV = "LEANGRAD_RAD_OFFICIAL"
NO_OFFICIAL = (
    "the official RAD code was not found: set LEANGRAD_RAD_OFFICIAL to the nn_experiments "
    "folder of a clone of github.com/PrincetonLIPS/RandomizedAutomaticDifferentiation"
)
ROWS = ("backprop", "rad", "rad (with replacement)", "official")
"""The peer rows: labels, in the order they are reported."""


def official_mlp(path: str, fraction: float) -> nn.Module:
    """The official ``MNISTFCNet(300)`` with RAD on its linear layers (``keep_frac=fraction``,
    a sample per example, by sampling), imported from the ``nn_experiments`` folder ``path``."""
    if importlib.util.find_spec("torchvision") is None:  # imported by layers.py, never used
        sys.modules.setdefault("torchvision", types.ModuleType("torchvision"))
    if path not in sys.path:
        sys.path.insert(0, path)
    models = importlib.import_module("models")
    args = {"keep_frac": fraction, "full_random": True, "sparse": True}
    net: nn.Module = models.MNISTFCNet(300, rp_args=args)
    return net


def peer_model(row: str, base: nn.Module, fraction: float, *, official: str | None,
               seed: int = 0, mode: str = "different") -> nn.Module:  # fmt: skip
    """Row ``row`` of :data:`ROWS` on ``base`` (``rad_network("mlp")`` for the official row): a
    copy sharing nothing, randomized as the row says (``rad`` rows in ``mode``); the official
    network gets ``base``'s weights."""
    if row != "official":
        return randomized(base, None if row == "backprop" else fraction, mode, seed,
                          replace="replacement" in row)  # fmt: skip
    if official is None:
        raise ValueError(NO_OFFICIAL)
    net = official_mlp(official, fraction)
    mine = [m for m in base.modules() if isinstance(m, nn.Linear)]
    theirs = [m for m in net.modules() if isinstance(m, nn.Linear)]  # fc1..fc4
    with torch.no_grad():
        for a, b in zip(theirs, mine, strict=True):
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)
    return net  # its forward ends in log_softmax: cross-entropy of it is the same loss


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    return step


def _memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """Saved bytes (the ``rad-*`` suites' :func:`memory_of`) and the tracker's peak of a step
    whose batch the caller holds throughout (counted in the baseline, as in a training loop
    whose loop variable keeps it; ``memory_of``'s peak counts a kept input instead)."""
    saved = memory_of(model, x, y)["saved_bytes"]
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        _step(model, x, y)()
    model.zero_grad(set_to_none=True)
    return {"saved_bytes": saved, "peak_bytes": tracker.report.peak_bytes}


def _rss(payload: dict[str, Any]) -> int | None:
    try:
        rep = run_rss_worker("leangrad_bench._rad_paper", payload)
    except Exception:  # RSS is a cross-check; the tracker's numbers stand without it
        return None
    return rep.rss_peak - rep.rss_before


@runner(threads=True)
def run_peer(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """The peer rows, then the crossover rows (module docstring)."""
    quick, progress = settings.quick, settings.progress
    if settings.device != "cpu":
        raise ValueError(
            f"the rad-peer suite runs on cpu in this version, got {settings.device!r}"
        )
    seed = int(suite.setting("seed", quick, 0))
    train = _load(str(suite.setting("dataset", quick, "mnist5k")), seed)[0]
    threads = settings.threads or sorted({1, os.cpu_count() or 1})
    records = _peer_rows(suite, quick, train, progress, threads)
    return records + _crossover_rows(suite, quick, train, progress)


def _peer_rows(suite: Suite, quick: bool, train: data.Dataset,
               progress: bool, threads: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    seed = int(suite.setting("seed", quick, 0))
    batch = int(suite.setting("batch", quick, 150))
    fraction = float(suite.setting("fraction", quick, 0.1))
    draws = int(suite.setting("draws", quick, 50))
    repeats = int(suite.setting("repeats", quick, 20))
    official = os.environ.get(OFFICIAL_ENV) or None
    torch.manual_seed(seed)
    base = rad_network("mlp", side=train.x.shape[-1])
    full = full_gradient(base, train)
    x, y = train.x[:batch], train.y[:batch]
    rows = [r for r in ROWS if r != "official" or official is not None]
    models = {r: peer_model(r, base, fraction, official=official, seed=seed + 1) for r in rows}
    config = {"model": "mlp", "batch": batch, "fraction": fraction, "mode": "different",
              "dataset": train.name, "draws": draws, "repeats": repeats}  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    bar = tqdm(total=len(rows) + 1, desc=f"{suite.name} peers", disable=not progress)
    for r in rows:
        payload = {"row": r, "batch": batch, "fraction": fraction, "seed": seed,
                   "official": official, "dataset": train.name}  # fmt: skip
        out[r] = {**_memory(models[r], x, y), "rss_peak_bytes": _rss(payload)}
        sq = squared_errors(models[r], train, full, batch=batch, draws=draws, seed=seed + 2)
        out[r]["grad_mse"] = float(sq.sum() / draws)
        bar.update()
    timings = time_across_threads({r: _step(models[r], x, y) for r in rows}, threads=threads,
                                  repeats=repeats, warmup=3, reference="backprop")  # fmt: skip
    bar.update()
    bar.close()
    records = []
    for n, times in timings.items():
        vs = times["official"].median if "official" in times else None
        for r in rows:
            records.append(new_record(
                out[r], kind="rad-peer", engine=r, config={**config, "threads": n},
                threads=n, seconds_median=times[r].median, time_ratio=times[r].ratio,
                vs_official=None if vs is None else times[r].median / vs,
                peak_ratio=out[r]["peak_bytes"] / out["backprop"]["peak_bytes"],
            ))  # fmt: skip
    if official is None:
        records.append(new_record(kind="rad-peer", engine="official",
                                  config=config, skipped=NO_OFFICIAL))  # fmt: skip
    return records


def _crossover_rows(suite: Suite, quick: bool, train: data.Dataset,
                    progress: bool) -> list[dict[str, Any]]:  # fmt: skip
    seed = int(suite.setting("seed", quick, 0))
    largest = min(int(suite.setting("largest_batch", quick, 4000)), len(train))
    records = []
    for c in tqdm(list(suite.setting("crossover", quick, [])), desc=f"{suite.name} crossover",
                  disable=not progress):  # fmt: skip
        kind, fraction, mode = c["model"], float(c["fraction"]), c.get("mode", "different")
        at = int(c.get("batch", 150))
        records.append(new_record(
            kind="rad-crossover", engine=f"rad {fraction} {mode}", batch=at,
            config={"model": kind, "fraction": fraction, "mode": mode, "batch": at,
                    "dataset": train.name},
            **_crossover(kind, fraction, mode, at, largest, train, seed),
        ))  # fmt: skip
    return records


def _crossover(kind: str, fraction: float, mode: str, at: int, largest: int,
               train: data.Dataset, seed: int) -> dict[str, Any]:  # fmt: skip
    """The smallest batch ``<= largest`` where RAD's tracker peak is below backprop's
    (``None``: none), found by bisection from ``at``; both peaks and RSS there."""
    torch.manual_seed(seed)
    base = rad_network(kind, side=train.x.shape[-1])
    model = randomized(base, fraction, mode, seed + 1)
    peaks: dict[int, tuple[int, int]] = {}

    def not_below(b: int) -> bool:
        if b not in peaks:
            xb, yb = train.x[:b], train.y[:b]
            peaks[b] = (_memory(model, xb, yb)["peak_bytes"],
                        _memory(base, xb, yb)["peak_bytes"])  # fmt: skip
        return peaks[b][0] >= peaks[b][1]

    cross = None
    if not not_below(largest):
        lo, hi = (at, largest) if not_below(at) else (0, at)
        cross = bisect_last_fit(not_below, lo, hi) + 1
    not_below(at)
    fields: dict[str, Any] = {"crossover_batch": cross, "largest_batch": largest,
                              "peak_ratio_at_batch": peaks[at][0] / peaks[at][1]}  # fmt: skip
    if cross is not None:
        not_below(cross)
        rss = {r: _rss({"model": kind, "row": r, "batch": cross, "fraction": fraction,
                        "mode": mode, "seed": seed, "dataset": train.name})
               for r in ("rad", "backprop")}  # fmt: skip
        fields.update(peak_ratio_at_crossover=peaks[cross][0] / peaks[cross][1],
                      rss_rad_bytes=rss["rad"], rss_backprop_bytes=rss["backprop"])  # fmt: skip
    return {**fields, "probes": len(peaks)}


def main() -> None:
    """Fresh-process RSS of one row's step: JSON payload on stdin, RssReport JSON out."""
    p = json.loads(sys.stdin.read())
    torch.set_num_threads(1)
    train = _load(p.get("dataset", "mnist5k"), p["seed"])[0]
    x, y = train.x[: p["batch"]], train.y[: p["batch"]]
    torch.manual_seed(p["seed"])
    base = rad_network(p.get("model", "mlp"), side=train.x.shape[-1])
    model = peer_model(p["row"], base, p["fraction"], official=p.get("official"),
                       seed=p["seed"] + 1, mode=p.get("mode", "different"))  # fmt: skip
    step = _step(model, x, y)
    step()
    model.zero_grad(set_to_none=True)
    rss = measure_rss(step)
    print(json.dumps({"rss_before": rss.rss_before, "rss_peak": rss.rss_peak}))


def _x(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}×"


def render_peer(suite: str, records: list[dict[str, Any]], directory: Any, *,
                plots: bool) -> list[str]:  # fmt: skip
    """Markdown for ``rad-peer``: the peer table (rows per thread count), then the crossovers."""
    peers = [r for r in records if r.get("kind") == "rad-peer" and not r.get("skipped")]
    skipped = [r for r in records if r.get("kind") == "rad-peer" and r.get("skipped")]
    lines = [
        "MNIST MLP 784-300-300-300-10 on MNIST-5k, one step (forward and backward). *time × "
        "official*: median step time / the official code's, interleaved repeats in one run; "
        "*peak*: tracker; *RSS*: fresh-process peak above its start; *grad MSE*: against "
        "the full-training-set gradient over random batches.",
        "",
        "| threads | method | time × backprop | time × official | peak | × backprop | saved "
        "| RSS | grad MSE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['threads']} | {r['engine']} | {_x(r['time_ratio'])} "
              f"| {_x(r.get('vs_official'))} | {fmt_bytes(r['peak_bytes'])} "
              f"| {_x(r['peak_ratio'])} | {fmt_bytes(r['saved_bytes'])} "
              f"| {fmt_bytes(r.get('rss_peak_bytes'))} | {r['grad_mse']:.4g} |"
              for r in peers]  # fmt: skip
    lines += [f"*{r['engine']}: skipped — {r['skipped']}*" for r in skipped]
    cross = [r for r in records if r.get("kind") == "rad-crossover"]
    if cross:
        lines += [
            "",
            "Where RAD's peak (tracker) falls below backprop's: the smallest such batch, "
            "bisected on real MNIST batches; RSS of both at that batch (fresh processes).",
            "",
            "| model | method | peak × backprop at batch | crossover batch | peak × there "
            "| RSS rad / backprop there |",
            "|---|---|---|---|---|---|",
        ]
    for r in cross:
        c, rss = r["crossover_batch"], (r.get("rss_rad_bytes"), r.get("rss_backprop_bytes"))
        ratio = _x(rss[0] / rss[1]) if rss[0] and rss[1] else "—"
        where = f"{c}" if c is not None else f"none ≤ {r['largest_batch']}"
        lines.append(
            f"| {r['config']['model']} | {r['engine']} | {_x(r['peak_ratio_at_batch'])} at "
            f"{r['batch']} | {where} | {_x(r.get('peak_ratio_at_crossover'))} | {ratio} |"
        )
    return [*lines, ""]


if __name__ == "__main__":
    main()
