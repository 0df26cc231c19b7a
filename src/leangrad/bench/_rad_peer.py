"""Suite ``rad-peer`` (issue 16): leangrad's randomized AD beside the official code and plain
backprop, and the batch where RAD's peak memory falls below backprop's.

Oktay et al. (ICLR 2021), section 4.3, on the paper's MNIST MLP (784-300-300-300-10, batch
150, fraction 0.1, a different sample per example):

- *peer rows*: backprop; leangrad ``rad`` without replacement (its default) and with
  replacement; the official PrincetonLIPS code (``RandMatMul``, ``full_random=True,
  sparse=True``: indices drawn with replacement, the input rebuilt dense in backward), its
  network ``MNISTFCNet`` with the same weights. Columns: median step time of interleaved
  repeats at 1 thread and at the machine's core count (``threads``), tracker peak, saved
  bytes, fresh-process peak RSS, and the gradient's mean squared error against the
  full-training-set gradient over ``draws`` random batches (as ``rad-variance``).
- *crossover rows*: for every model, mode and fraction the ``rad-*`` suites run, the
  smallest batch whose RAD step peaks below backprop's on the tracker (bisection between
  the batches where it does not and does), and both peaks and fresh-process RSS there.

The official code is not on PyPI: point ``LEANGRAD_RAD_OFFICIAL`` at the ``nn_experiments``
folder of a clone of github.com/PrincetonLIPS/RandomizedAutomaticDifferentiation; without it
the official rows are recorded as skipped, saying so. Its ``layers.py`` imports torchvision
without using it; where torchvision is not installed an empty module stands in for it.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import data, rad
from ..measure import MemoryTracker, run_rss_worker, time_across_threads
from ..measure._rss import measure_rss
from ._rad import _flat, _full_gradient, memory_of, rad_model
from ._runner import machine_info, new_record
from ._search import bisect_last_fit
from ._suites import RunSettings, Suite, runner
from ._training import _now

__all__ = ["OFFICIAL_ENV", "official_mlp", "peer_model", "render", "run_peer"]

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
               seed: int = 0) -> nn.Module:  # fmt: skip
    """Row ``row`` of :data:`ROWS` on ``base`` (``rad_model("mlp")``): a copy sharing nothing,
    randomized as the row says; the official network gets ``base``'s weights."""
    model = copy.deepcopy(base)
    if row == "backprop":
        return model
    if row.startswith("rad"):
        rad.randomize(model, fraction=fraction, mode="different", replace="replacement" in row,
                      seed=seed)  # fmt: skip
        return model
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


def _memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """Saved bytes (the ``rad-*`` suites' :func:`memory_of`) and the tracker's peak of a step
    whose batch the caller holds throughout (counted in the baseline, as in a training loop
    whose loop variable keeps it; ``memory_of``'s peak counts a kept input instead)."""
    saved = memory_of(model, x, y)["saved_bytes"]
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        _step(model, x, y)()
    model.zero_grad(set_to_none=True)
    return {"saved_bytes": saved, "peak_bytes": tracker.report.peak_bytes}


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    return step


def _mse(model: nn.Module, train: data.Dataset, full: torch.Tensor, batch: int, draws: int,
         seed: int) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    sq = torch.zeros_like(full)
    for _ in range(draws):
        idx = torch.randint(len(train), (batch,), generator=gen)
        _step(model, train.x[idx], train.y[idx])()
        sq += (_flat(model) - full).square()
    return float(sq.sum() / draws)


def _rss(payload: dict[str, Any]) -> int | None:
    try:
        rep = run_rss_worker("leangrad.bench._rad_peer", payload)
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
    common = {"suite": suite.name, "quick": quick, "machine": machine_info(), "created": _now()}
    seed = int(suite.setting("seed", quick, 0))
    train = data.load(str(suite.setting("dataset", quick, "mnist5k"))).split(0.8, seed=seed)[0]
    threads = settings.threads or sorted({1, os.cpu_count() or 1})
    records = _peer_rows(suite, quick, train, common, progress, threads)
    return records + _crossover_rows(suite, quick, train, common, progress)


def _peer_rows(suite: Suite, quick: bool, train: data.Dataset, common: dict[str, Any],
               progress: bool, threads: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    seed = int(suite.setting("seed", quick, 0))
    batch, fraction = (
        int(suite.setting("batch", quick, 150)),
        float(suite.setting("fraction", quick, 0.1)),
    )
    draws, repeats = (
        int(suite.setting("draws", quick, 50)),
        int(suite.setting("repeats", quick, 20)),
    )
    official = os.environ.get(OFFICIAL_ENV) or None
    torch.manual_seed(seed)
    base = rad_model("mlp", side=train.x.shape[-1])
    full = _full_gradient(base, train)
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
        out[r] = {**_memory(models[r], x, y), "rss_peak_bytes": _rss(payload),
                  "grad_mse": _mse(models[r], train, full, batch, draws, seed + 2)}  # fmt: skip
        bar.update()
    steps = {r: _step(models[r], x, y) for r in rows}
    timings = time_across_threads(steps, threads=threads, repeats=repeats, warmup=3,
                                  reference="backprop")  # fmt: skip
    bar.update()
    bar.close()
    records = []
    for n, times in timings.items():
        for r in rows:
            t = times[r]
            vs = times["official"].median if "official" in times else None
            records.append(new_record(
                common, out[r], kind="rad-peer", engine=r, config={**config, "threads": n},
                threads=n, seconds_median=t.median, time_ratio=t.ratio,
                vs_official=None if vs is None else t.median / vs,
                peak_ratio=out[r]["peak_bytes"] / out["backprop"]["peak_bytes"],
            ))  # fmt: skip
    if official is None:
        records.append(new_record(common, kind="rad-peer", engine="official",
                                  config=config, skipped=NO_OFFICIAL))  # fmt: skip
    return records


def _crossover_rows(suite: Suite, quick: bool, train: data.Dataset, common: dict[str, Any],
                    progress: bool) -> list[dict[str, Any]]:  # fmt: skip
    seed = int(suite.setting("seed", quick, 0))
    configs = list(suite.setting("crossover", quick, []))
    largest = min(int(suite.setting("largest_batch", quick, 4000)), len(train))
    records = []
    for c in tqdm(configs, desc=f"{suite.name} crossover", disable=not progress):
        kind, fraction, mode = c["model"], float(c["fraction"]), c.get("mode", "different")
        at = int(c.get("batch", 150))
        records.append(new_record(
            common, kind="rad-crossover", engine=f"rad {fraction} {mode}", batch=at,
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
    base = rad_model(kind, side=train.x.shape[-1])
    model = copy.deepcopy(base)
    rad.randomize(model, fraction=fraction, mode=mode, seed=seed + 1)
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
    train = data.load(p.get("dataset", "mnist5k")).split(0.8, seed=p["seed"])[0]
    x, y = train.x[: p["batch"]], train.y[: p["batch"]]
    torch.manual_seed(p["seed"])
    base = rad_model(p.get("model", "mlp"), side=train.x.shape[-1])
    if p.get("mode", "different") != "different" and p["row"] == "rad":
        model = copy.deepcopy(base)
        rad.randomize(model, fraction=p["fraction"], mode=p["mode"], seed=p["seed"] + 1)
    else:
        model = peer_model(p["row"], base, p["fraction"], official=p.get("official"),
                           seed=p["seed"] + 1)  # fmt: skip
    step = _step(model, x, y)
    step()
    model.zero_grad(set_to_none=True)
    rss = measure_rss(step)
    print(json.dumps({"rss_before": rss.rss_before, "rss_peak": rss.rss_peak}))


def render(suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool) -> list[str]:
    """Markdown for ``rad-peer``: the peer table per thread count, then the crossovers."""
    from ._rad_peer_report import render_peer

    return render_peer(records)


if __name__ == "__main__":
    main()
