"""Randomized-AD suites on MNIST-5k (Oktay et al., ICLR 2021): runners and their report.

- :func:`run_variance` (``rad-variance``, Fig. 5): at fixed weights, the mean squared
  error of each stochastic gradient (a random mini-batch, and RAD at several fractions on
  top of it) against the full-training-set gradient, beside the memory each keeps.
- :func:`run_convergence` (``rad-convergence``, Fig. 6): training curves for backprop at
  batch 150, RAD 0.1 (same / different / project) at batch 150, and backprop at the
  *reduced batch* whose measured saved bytes match RAD's; an IRNN on row-by-row MNIST too.
- :func:`run_fractions` (``rad-fractions``, appendix Figs. 9-10): RAD "different sample"
  at a sweep of fractions beside backprop, and the paper's note (Fig. 10) that fraction 1.0
  without replacement "would be equivalent to baseline", checked bit for bit
  (:func:`fraction_one_check`: gradients ``torch.equal`` at the same weights and batch;
  curves and final weights identical).

Both training suites train every lane of a seed side by side (:func:`train_suite`) at
every seed of :func:`replicates` (a bootstrap resample of the training set each, as the
paper's appendix), summarised by :func:`bands` as a median with a min–max band. The
paper-only parts (the reaction-diffusion PDE, the official code as a peer) are in
:mod:`._rad_paper`.

Memory is measured, never computed from shapes: ``saved_bytes`` is what autograd keeps
(:func:`~leangrad.measure.saved_tensor_bytes`, parameters and targets excluded),
``forward_bytes`` the tracker's live bytes after the forward (the input batch is copied
inside the region, so it counts when it is kept) and ``peak_bytes`` the tracker's peak
over forward and backward.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from leangrad import data, rad
from leangrad._sizes import fmt_bytes
from leangrad.measure import MemoryTracker, grads_of, num_threads, saved_tensor_bytes

from ._models import build
from ._report import by_series, md_table, pyplot, save_series_figure
from ._runner import new_record
from ._search import bisect_last_fit
from ._side_by_side import Curves, Lane, make_optimizer, train_side_by_side
from ._suites import RunSettings, Suite
from ._training import _evaluate

__all__ = [
    "BAND", "BAND_KEYS", "BAND_NOTE", "BASELINE", "SAVED_NOTE", "LaneConfig", "Replicate",
    "SeedStart", "TrainRun", "band_records", "bands", "final_bands", "fmt_band",
    "fraction_one_check", "full_gradient", "memory_of", "plot_band",
    "randomized", "render", "replicates", "run_convergence", "run_fractions", "run_variance",
    "series_sections", "squared_errors", "train_suite",
]  # fmt: skip

BASELINE = "baseline"
"""Label of the backprop lane (no RAD) at the suite's batch."""


def _network(kind: str, side: int, seed: int, device: str) -> nn.Module:
    """The registry's ``rad_<kind>`` for images of side ``side``, weights from ``seed``."""
    return build(f"rad_{kind}", {"side": side, "seed": seed}, batch=1, device=device).model


def memory_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """Measured bytes of one cross-entropy step: saved, live after forward, peak."""
    model.zero_grad(set_to_none=True)
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        with saved_tensor_bytes(*model.parameters(), y) as saved:
            loss = F.cross_entropy(model(x.clone()), y)
        forward = tracker.current_bytes()
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    rep = tracker.report
    return {"saved_bytes": saved.bytes, "forward_bytes": forward, "peak_bytes": rep.peak_bytes}


def randomized(
    model: nn.Module, fraction: float | None, mode: str, seed: int, *, replace: bool = False
) -> nn.Module:
    """A deep copy of ``model``, randomized unless ``fraction`` is ``None``."""
    m = copy.deepcopy(model)
    if fraction is not None:
        rad.randomize(m, fraction=fraction, mode=mode, replace=replace, seed=seed)
    return m


def _load(dataset: str, seed: int, device: str = "cpu") -> tuple[data.Dataset, data.Dataset]:
    """80/20 train/test split of ``dataset`` (4000/1000 for MNIST-5k)."""
    return data.load(dataset, device=device).split(0.8, seed=seed)


def _flat(model: nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "every parameter of these models has a gradient"
    return torch.cat([g.reshape(-1).double() for g in grads if g is not None])


def full_gradient(model: nn.Module, ds: data.Dataset) -> torch.Tensor:
    """The gradient of the mean cross-entropy over all of ``ds``, flat, in float64."""
    model.zero_grad(set_to_none=True)
    for x, y in ds.batches(500, shuffle=False):
        (F.cross_entropy(model(x), y, reduction="sum") / len(ds)).backward()
    g = _flat(model)
    model.zero_grad(set_to_none=True)
    return g


def _forever(
    ds: data.Dataset, batch: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches sampled with replacement from ``ds`` (Appendix A), forever."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(len(ds), (batch,), generator=gen).to(ds.x.device)
        yield ds.x[idx], ds.y[idx]


def squared_errors(
    model: nn.Module, train: data.Dataset, full: torch.Tensor, *, batch: int, draws: int,
    seed: int, tick: Callable[[], object] = lambda: None,
) -> torch.Tensor:  # fmt: skip
    """``Σ_draws (g − full)²`` per parameter entry, ``g`` the gradient of ``model`` on a
    batch of ``batch`` examples drawn with replacement from ``train`` (stream ``seed``)."""
    sq = torch.zeros_like(full)
    for _, (x, y) in zip(range(draws), _forever(train, batch, seed), strict=False):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sq += (_flat(model) - full).square()
        tick()
    return sq


def _record(kind: str, **fields: Any) -> dict[str, Any]:
    return new_record(dict(kind=kind), fields)


def run_variance(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Gradient MSE vs the full-data gradient, beside measured memory (Fig. 5)."""
    quick, device = settings.quick, settings.device
    seed = int(suite.setting("seed", quick, 0))
    draws = int(suite.setting("draws", quick, 50))
    pretrain = int(suite.setting("pretrain_steps", quick, 0))
    models = list(suite.setting("models", quick, ["mlp", "cnn"]))
    train, _ = _load(str(suite.setting("dataset", quick, "mnist5k")), seed, device)
    ests = list(suite.setting("estimators", quick, []))
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(models) * len(ests) * draws, desc=suite.name,
               disable=not settings.progress)  # fmt: skip
    for kind in models:
        base = _network(kind, train.x.shape[-1], seed, device)
        if pretrain:  # move away from the initialisation, as a gradient mid-training
            opt = torch.optim.Adam(base.parameters(), lr=1e-3)
            for _, (x, y) in zip(range(pretrain), _forever(train, 150, seed), strict=False):
                opt.zero_grad()
                F.cross_entropy(base(x), y).backward()
                opt.step()
        full = full_gradient(base, train)
        for e in ests:
            b, f, mode = e["batch"], e.get("fraction"), e.get("mode", "different")
            label = e.get("label") or (f"batch {b}" if f is None else f"RAD {f} {mode}")
            bar.set_description(f"{suite.name} {kind} {label}")
            model = randomized(base, f, mode, seed + 1)
            mem = memory_of(model, train.x[:b], train.y[:b])
            sq = squared_errors(model, train, full, batch=b, draws=draws, seed=seed + 2,
                                tick=bar.update) / draws  # fmt: skip
            layers, i = {}, 0
            for n, p in base.named_parameters():
                layers[n], i = sq[i : i + p.numel()].sum().item(), i + p.numel()
            records.append(_record(
                "rad-variance", engine=label, model=kind, batch=b, fraction=f,
                mode=mode, config={"model": kind, "batch": b, "fraction": f, "mode": mode,
                                   "draws": draws, "pretrain_steps": pretrain, "seed": seed,
                                   "dataset": train.name, "train_examples": len(train)},
                grad_mse=sq.sum().item(), full_grad_sq=full.square().sum().item(),
                layer_mse=layers, **mem,
            ))  # fmt: skip
    bar.close()
    return records


BAND = "min-max"
"""What the band around every RAD training curve spans: the minimum and maximum over the
seeds at each evaluated step (the paper's appendix shows all 5 bootstrapped runs); the
line is the median over the seeds."""

BAND_KEYS = ("train_loss", "train_acc", "test_loss", "test_acc", "train_seconds", "step_seconds")
"""Per-seed record fields that a band record summarises as ``KEY_median``, ``KEY_min``,
``KEY_max``."""

TIMING_WARMUP = 5
"""Steps of each lane left out of its median step time (allocator, caches, lazy init)."""


@dataclasses.dataclass(frozen=True)
class Replicate:
    """One seed of a training suite: its bootstrapped training set and its random streams.

    The paper trains "5 times on separate bootstrapped resamplings of the full training
    dataset" (Appendix A); here each seed resamples the training split with replacement
    (stream ``seed + 7``), initialises the model (``seed``), seeds RAD's samples
    (:attr:`rad_seed`) and draws its batch order (:attr:`batch_seed`). Within a seed,
    every method starts from the same weights and (at the same batch size) sees the same
    batches.
    """

    seed: int

    @property
    def rad_seed(self) -> int:
        return self.seed + 1

    @property
    def batch_seed(self) -> int:
        return self.seed + 3

    def bootstrap(self, ds: data.Dataset) -> data.Dataset:
        """``ds`` resampled with replacement to its own size."""
        gen = torch.Generator().manual_seed(self.seed + 7)
        idx = torch.randint(len(ds), (len(ds),), generator=gen)
        return dataclasses.replace(ds, x=ds.x[idx.to(ds.x.device)], y=ds.y[idx.to(ds.y.device)])


def replicates(suite: Suite, quick: bool) -> list[Replicate]:
    """The suite's ``seeds`` (a count, 5 by default) seeds, from its ``seed`` on."""
    first, count = int(suite.setting("seed", quick, 0)), int(suite.setting("seeds", quick, 5))
    return [Replicate(first + i) for i in range(count)]


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """One entry of a training suite's ``runs``, and the data every run trains on."""

    kind: str
    steps: int
    every: int
    lr: float
    optimizer: str
    batch: int
    train: data.Dataset
    device: str


class SeedStart(NamedTuple):
    """Where every lane of one seed starts: its bootstrapped training set, the sets its
    curves are measured on (the first ``eval_examples`` of the bootstrap and of the
    held-out split; all of them without the setting) and the initial model all copy."""

    rep: Replicate
    boot: data.Dataset
    seen: data.Dataset
    held_out: data.Dataset
    base: nn.Module


@dataclasses.dataclass
class _RadTraining(Curves):
    """The RAD training suites: lanes side by side on one batch stream; round 0 measures the
    initialisation, round r trains one batch (autograd through the lane's model, RAD or
    not) and times it (``time.perf_counter`` around zero_grad, forward, backward and the
    optimizer step; the lanes' steps interleave round by round); a lane whose train loss
    is not finite stops after that point. The last record of a lane carries
    ``step_seconds``: the median of its step times after :data:`TIMING_WARMUP` steps."""

    record_fields: dict[str, Any]
    train: data.Dataset
    test: data.Dataset
    steps: int
    every: int
    tick: Callable[[], object]
    step_times: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def record(self, lane: Lane, r: int) -> dict[str, Any]:
        return _record(**self.record_fields, engine=lane.label, **lane.fields)

    def advance(self, lane: Lane, r: int, batch: Any) -> None:
        if r == 0:
            return
        x, y = batch
        t0 = time.perf_counter()
        lane.opt.zero_grad(set_to_none=True)
        F.cross_entropy(lane.model(x), y).backward()
        lane.opt.step()
        took = time.perf_counter() - t0
        lane.seconds += took
        self.step_times.setdefault(lane.label, []).append(took)
        self.tick()

    def measure(self, lane: Lane, r: int, batch: Any, out: Any) -> dict[str, Any] | None:
        if not (r % self.every == 0 or r == self.steps):
            return None
        tl, ta = _evaluate(lane.model, self.train, 1000)
        vl, va = _evaluate(lane.model, self.test, 1000)
        if not math.isfinite(tl):
            lane.failed = f"train loss {tl} at step {r}"  # the curve ends here
        fields = {"x": r, "train_loss": tl, "train_acc": ta, "test_loss": vl, "test_acc": va,
                  "train_seconds": lane.seconds}  # fmt: skip
        times = self.step_times.get(lane.label, [])
        if (r == self.steps or lane.failed) and times:
            timed = times[TIMING_WARMUP:] or times
            fields.update(step_seconds=statistics.median(timed), timed_steps=len(timed))
        return fields


@dataclasses.dataclass(frozen=True)
class LaneConfig:
    """One lane of a training suite: backprop (``fraction`` ``None``) or RAD at ``batch``;
    ``config`` and ``fields`` add to its records' ``config`` and top-level fields."""

    label: str
    batch: int
    fraction: float | None
    mode: str
    replace: bool = False
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)


SeedCheck = Callable[[SeedStart], Callable[[dict[str, Lane], list[dict[str, Any]]], Any]]
"""Called at each seed's start (before its lanes are made); what it returns is called with
the seed's lanes and records after training. Its results, per run, go to ``run_record``."""


def train_suite(
    suite: Suite, settings: RunSettings, lanes_of: Callable[[TrainRun], list[LaneConfig]], *,
    lanes: int, check: SeedCheck | None = None,
    run_record: Callable[[TrainRun, list[Any]], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every run of the suite's ``runs`` at every seed of :func:`replicates`: the lanes of
    ``lanes_of(run)`` (``lanes`` of them: the progress bar's count) from the seed's start,
    those of one batch size side by side on the same batches (drawn with replacement);
    per-seed ``rad-training`` records at step 0, every ``eval_every`` steps and the last,
    then their ``rad-band`` summaries (:func:`bands`), then ``run_record(run, check
    results)`` if given. Data: the suite's ``dataset`` split with its ``seed``."""
    quick = settings.quick
    seeds, examples = replicates(suite, quick), suite.setting("eval_examples", quick, None)
    threads = int(suite.setting("torch_threads", quick, 1))
    train, test = _load(str(suite.setting("dataset", quick, "mnist5k")),
                        int(suite.setting("seed", quick, 0)), settings.device)  # fmt: skip
    runs = [TrainRun(r["model"], int(r["steps"]), int(r["eval_every"]), float(r["lr"]),
                     str(r.get("optimizer", "adam")), int(suite.setting("batch", quick, 150)),
                     train, settings.device) for r in suite.setting("runs", quick, [])]  # fmt: skip
    bar = tqdm(total=sum(r.steps * lanes * len(seeds) for r in runs), desc=suite.name,
               disable=not settings.progress)  # fmt: skip
    head = {"kind": "rad-training"}
    records: list[dict[str, Any]] = []
    with num_threads(threads):
        for run in runs:
            configs, mine, checks = lanes_of(run), [], []
            for rep in seeds:
                bar.set_description(f"{suite.name} {run.kind} seed {rep.seed}")
                boot = rep.bootstrap(train)
                cut = slice(0, None if examples is None else int(examples))
                seen = dataclasses.replace(boot, x=boot.x[cut], y=boot.y[cut])
                held_out = dataclasses.replace(test, x=test.x[cut], y=test.y[cut])
                # the model is drawn after the seed's bootstrap
                base = _network(run.kind, train.x.shape[-1], rep.seed, settings.device)
                finish = None if check is None else check(SeedStart(rep, boot, seen, held_out,
                                                                    base))  # fmt: skip
                by_batch: dict[int, dict[str, Lane]] = {}
                for c in configs:
                    model = randomized(base, c.fraction, c.mode, rep.rad_seed, replace=c.replace)
                    mem = memory_of(model, train.x[: c.batch], train.y[: c.batch])
                    config = {"model": run.kind, "batch": c.batch, "fraction": c.fraction,
                              "mode": c.mode, "lr": run.lr, "optimizer": run.optimizer,
                              "steps": run.steps, "seed": rep.seed, "dataset": train.name,
                              "bootstrap": True, "train_examples": len(train),
                              "eval_examples": examples, "threads": threads,
                              **c.config}  # fmt: skip
                    opt = make_optimizer(run.optimizer, model.parameters(), run.lr, momentum=0.0)
                    by_batch.setdefault(c.batch, {})[c.label] = Lane(c.label, model, opt, {
                        "model": run.kind, "series": run.kind, "sweep": "step", **c.fields,
                        "config": config, "seed": rep.seed, "threads": threads, **mem,
                    })  # fmt: skip
                recs: list[dict[str, Any]] = []
                for b, group in by_batch.items():  # same batch size: side by side, same batches
                    curves = _RadTraining(head, seen, held_out, run.steps, run.every, bar.update)
                    rounds = zip(range(1, run.steps + 1), _forever(seen, b, rep.batch_seed),
                                 strict=False)  # fmt: skip
                    recs += train_side_by_side(list(group.values()),
                                               itertools.chain([(0, None)], rounds), curves)
                mine += recs
                if finish is not None:
                    checks.append(finish({k: v for g in by_batch.values() for k, v in g.items()},
                                         recs))  # fmt: skip
            records += mine + bands(mine)
            if run_record is not None:
                records.append(run_record(run, checks))
    bar.close()
    return records


def bands(records: list[dict[str, Any]], *, kind: str = "rad-training",
          band_kind: str = "rad-band") -> list[dict[str, Any]]:  # fmt: skip
    """One ``band_kind`` record per (series, engine, step) of per-seed ``kind``
    records: the median, minimum and maximum over the seeds (:data:`BAND`) of each of
    :data:`BAND_KEYS`, from the seeds whose value is finite (``n_seeds``; ``seeds`` lists
    the seeds that reached the step). The per-seed records stay beside them."""
    groups: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") == kind and r.get("failed") is None:
            groups.setdefault((r["series"], r["engine"], r["x"]), []).append(r)
    out = []
    for rs in groups.values():
        first = rs[0]
        rec = {k: v for k, v in first.items() if k not in (*BAND_KEYS, "seed", "timed_steps")}
        rec.update(kind=band_kind, band=BAND, seeds=[r.get("seed") for r in rs])
        rec["config"] = {k: v for k, v in (first.get("config") or {}).items() if k != "seed"}
        for key in BAND_KEYS:
            vals = [float(r[key]) for r in rs if r.get(key) is not None
                    and math.isfinite(float(r[key]))]  # fmt: skip
            if key == "train_loss":
                rec["n_seeds"] = len(vals)
            if vals:
                rec.update({f"{key}_median": statistics.median(vals), f"{key}_min": min(vals),
                            f"{key}_max": max(vals)})  # fmt: skip
        rec["seconds_median"] = rec.get("step_seconds_median")
        out.append(rec)
    return out


def equal_memory_batch(
    model: nn.Module, target_bytes: int, ds: data.Dataset, *, largest: int
) -> tuple[int, int]:
    """The largest exact batch whose measured saved bytes are at most ``target_bytes``."""
    saved: dict[int, int] = {}

    def fits(b: int) -> bool:
        saved[b] = memory_of(model, ds.x[:b], ds.y[:b])["saved_bytes"]
        return saved[b] <= target_bytes

    best = bisect_last_fit(fits, 0, largest + 1)
    return (best, saved[best]) if best else (1, 0)


def run_convergence(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train loss vs iteration at equal measured memory (Fig. 6 and the RNN analogue), at
    every seed of :func:`replicates` (:func:`train_suite`): backprop, RAD at ``fraction``
    in each of ``modes``, and backprop at the largest batch whose saved bytes are at most
    RAD "different"'s (measured at the first seed's initial weights)."""
    quick = settings.quick
    fraction = float(suite.setting("fraction", quick, 0.1))
    modes = list(suite.setting("modes", quick, ["same", "different", "project"]))

    def lanes_of(run: TrainRun) -> list[LaneConfig]:
        b, train, seed = run.batch, run.train, int(suite.setting("seed", quick, 0))
        # the first seed's initial weights (memory does not depend on them)
        base = _network(run.kind, train.x.shape[-1], seed, run.device)
        probe = randomized(base, fraction, "different", seed)
        target = memory_of(probe, train.x[:b], train.y[:b])["saved_bytes"]
        reduced, _ = equal_memory_batch(base, target, train, largest=b)
        lanes = [(BASELINE, b, None, "-"), *((f"RAD {fraction} {m}", b, fraction, m)
                                             for m in modes)]  # fmt: skip
        lanes.append((f"reduced batch {reduced}", reduced, None, "-"))
        return [LaneConfig(*lane, config={"equal_memory_target_bytes": target})
                for lane in lanes]  # fmt: skip

    return train_suite(suite, settings, lanes_of, lanes=len(modes) + 2)


CURVE_KEYS = ("train_loss", "train_acc", "test_loss", "test_acc")
"""What two lanes must agree on, bit for bit, at every evaluated step to count as identical."""


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return list(grads_of(model).values())


def fraction_one_check(
    base: nn.Module, x: torch.Tensor, y: torch.Tensor, *, mode: str, seed: int
) -> dict[str, Any]:
    """Backprop's gradients of ``base`` on ``(x, y)`` against RAD at fraction 1.0, at the same
    weights and batch: ``grads_equal`` (every parameter ``torch.equal``, without
    replacement), ``grads_equal_with_replacement`` and ``grad_max_abs_diff`` (without)."""
    ref = _grads(copy.deepcopy(base), x, y)
    out: dict[str, Any] = {}
    for replace, key in ((False, "grads_equal"), (True, "grads_equal_with_replacement")):
        got = _grads(randomized(base, 1.0, mode, seed, replace=replace), x, y)
        out[key] = len(got) == len(ref) and all(
            torch.equal(a, b) for a, b in zip(got, ref, strict=True)
        )
        if not replace:
            out["grad_max_abs_diff"] = max(
                (a - b).abs().max().item() for a, b in zip(got, ref, strict=True)
            )
    return out


def _same_training(
    lanes: dict[str, Lane], recs: list[dict[str, Any]], one: str
) -> dict[str, bool | None]:
    """Whether lane ``one`` trained exactly as the baseline: every curve point, final weights."""
    if one not in lanes:
        return {"curves_identical": None, "weights_equal_at_end": None}

    def curve(label: str) -> list[tuple[Any, ...]]:
        rows = [r for r in recs if r["engine"] == label]
        return [(r["x"], r.get("failed"), *(r.get(k) for k in CURVE_KEYS)) for r in rows]

    pairs = zip(lanes[one].model.parameters(), lanes[BASELINE].model.parameters(), strict=True)
    weights = all(torch.equal(a, b) for a, b in pairs)
    return {"curves_identical": curve(one) == curve(BASELINE), "weights_equal_at_end": weights}


def run_fractions(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train each model with backprop and RAD at each fraction, at every seed (Figs. 9-10).

    Per-seed ``rad-training`` curves, their ``rad-band`` summaries (median and :data:`BAND`
    over the seeds) and, per model, one ``rad-fraction-one`` record: the fraction-1.0 check
    at every seed (:func:`fraction_one_check`, curve and weight identity).
    """
    quick = settings.quick
    mode = str(suite.setting("mode", quick, "different"))
    replace = bool(suite.setting("replace", quick, False))
    fractions = [float(f) for f in suite.setting("fractions", quick, [0.05, 0.1, 0.2, 0.5, 1.0])]
    one = f"RAD 1.0 {mode}"

    def lanes_of(run: TrainRun) -> list[LaneConfig]:
        return [LaneConfig(BASELINE if f is None else f"RAD {f} {mode}", run.batch, f,
                           mode if f is not None else "-", replace, {"replace": replace},
                           {"fraction": f}) for f in (None, *fractions)]  # fmt: skip

    def check(start: SeedStart) -> Callable[[dict[str, Lane], list[dict[str, Any]]], Any]:
        batch = int(suite.setting("batch", quick, 150))
        x0, y0 = next(_forever(start.boot, batch, start.rep.batch_seed))  # the first batch
        pre = {"seed": start.rep.seed, **fraction_one_check(start.base, x0, y0, mode=mode,
                                                             seed=start.rep.rad_seed)}  # fmt: skip
        return lambda lanes, recs: {**pre, **_same_training(lanes, recs, one)}

    def run_record(run: TrainRun, checks: list[Any]) -> dict[str, Any]:
        def every(key: str) -> bool | None:
            vals = [c[key] for c in checks]
            return None if any(v is None for v in vals) else all(vals)

        return _record(
            "rad-fraction-one", engine=one, model=run.kind, series=run.kind,
            fraction=1.0, replace=False, trained_with_replacement=replace,
            config={"model": run.kind, "fraction": 1.0, "mode": mode, "replace": False,
                    "seeds": [c["seed"] for c in checks]},
            per_seed=checks, grads_equal=every("grads_equal"),
            grads_equal_with_replacement=every("grads_equal_with_replacement"),
            grad_max_abs_diff=max(c["grad_max_abs_diff"] for c in checks),
            curves_identical=every("curves_identical"),
            weights_equal_at_end=every("weights_equal_at_end"),
        )  # fmt: skip

    return train_suite(suite, settings, lanes_of, lanes=len(fractions) + 1, check=check,
                       run_record=run_record)  # fmt: skip


# --- the report -------------------------------------------------------------------------

SAVED_NOTE = (
    "*saved* = bytes autograd keeps for backward (parameters, targets excluded; the input "
    "counts when kept); *peak* = tracker peak over forward and backward."
)
BAND_NOTE = (
    "Lines: median over the seeds; shaded: min–max over the seeds (each seed trains on its "
    "own bootstrap resample of the training split, with its own initialisation — shared by "
    "all methods of that seed —, RAD samples and batch order). Train loss/accuracy are "
    "measured on the seed's bootstrapped set, test on the held-out split. Table cells: "
    "median [min–max] over the seeds at the last step; ms/step = median step time "
    f"(zero_grad, forward, backward, optimizer step) after {TIMING_WARMUP} warm-up steps, lanes "
    "of one batch size interleaved step by step, at the records' torch thread count."
)


def plot_band(ax: Any, recs: list[dict[str, Any]], key: str, *, ylabel: str,
              log: bool = False, reference: str = BASELINE,
              xlabel: str = "training step (iteration)") -> None:  # fmt: skip
    """On ``ax``, each engine's median of ``key`` over the seeds vs step, with its
    :data:`BAND` shaded, from band records; the ``reference`` lane dashed black, on top."""
    for label in dict.fromkeys(r["engine"] for r in recs):
        pts = sorted((r["x"], r[f"{key}_median"], r[f"{key}_min"], r[f"{key}_max"])
                     for r in recs if r["engine"] == label and f"{key}_median" in r)  # fmt: skip
        if not pts:
            continue
        x, mid, lo, hi = zip(*pts, strict=True)
        style = {"color": "k", "ls": "--", "zorder": 3} if label == reference else {}
        (line,) = ax.plot(x, mid, label=label, lw=1.4, **style)
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def fmt_band(r: dict[str, Any], key: str, spec: str, *, scale: float = 1.0) -> str:
    """``median [min–max]`` of ``key`` in a band record (``—`` when missing)."""
    if r.get(f"{key}_median") is None:
        return "—"
    mid, lo, hi = (scale * r[f"{key}_{s}"] for s in ("median", "min", "max"))
    return f"{mid:{spec}} [{lo:{spec}}–{hi:{spec}}]"


def final_bands(recs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Engine -> its band record at the last step, in record order."""
    out: dict[str, dict[str, Any]] = {}
    for r in recs:
        if r["engine"] not in out or r["x"] >= out[r["engine"]]["x"]:
            out[r["engine"]] = r
    return out


def band_records(records: list[dict[str, Any]], kind: str, band_kind: str) -> list[dict[str, Any]]:
    """The ``band_kind`` records of ``records``; summarised from their per-seed ``kind``
    records by :func:`bands` where they have none (results written before the seeds)."""
    have = [r for r in records if r.get("kind") == band_kind]
    return have or bands(records, kind=kind, band_kind=band_kind)


Section = Callable[[str, list[dict[str, Any]]], list[str]]
"""A part of one series' report section: ``(series, its records) -> Markdown lines``."""


def series_sections(recs: list[dict[str, Any]], *, table: Section, figure: Section | None,
                    note: str) -> list[str]:  # fmt: skip
    """``note``, then per series of ``recs`` (:func:`by_series`) its heading, ``figure``'s
    lines (``None``: no plots) and ``table``'s; each followed by a blank line."""
    lines = [note, ""]
    for series, rs in by_series(recs).items():
        lines += [f"### {series}", "", *(figure(series, rs) if figure else []), *table(series, rs),
                  ""]  # fmt: skip
    return lines


def _ratio(r: dict[str, Any], base: dict[str, Any], key: str, spec: str) -> str:
    return f"{r[key] / base[key]:{spec}}" if r.get(key) and base.get(key) else ""


def _band_table(series: str, rs: list[dict[str, Any]]) -> list[str]:
    """Each lane of a training suite at its last step (median [min–max] over the seeds)."""
    finals = final_bands(rs)
    base = finals.get(BASELINE, {})
    return md_table(
        ("run", "batch", "saved", "saved / baseline", "peak", "final step", "seeds",
         "train loss", "test loss", "test acc", "ms/step", "time / baseline"),
        ((label, (r.get("config") or {}).get("batch", ""), fmt_bytes(r.get("saved_bytes")),
          _ratio(r, base, "saved_bytes", ".3f"), fmt_bytes(r.get("peak_bytes")), r["x"],
          r["n_seeds"], fmt_band(r, "train_loss", ".3f"), fmt_band(r, "test_loss", ".3f"),
          fmt_band(r, "test_acc", ".3f"), fmt_band(r, "step_seconds", ".1f", scale=1e3),
          _ratio(r, base, "step_seconds_median", ".2f")) for label, r in finals.items()),
    )  # fmt: skip


def _message(finals: dict[str, dict[str, Any]], identical: bool | None, *,
             fractions: bool) -> str:  # fmt: skip
    """The figure's one message: where the best RAD lane ends against the reduced batch
    (``rad-convergence``), or how the final loss goes with the fraction (``rad-fractions``)."""
    loss = {k: r["train_loss_median"] for k, r in finals.items() if "train_loss_median" in r}
    rads = [k for k in loss if k.startswith("RAD ")]
    reduced = next((k for k in loss if k.startswith("reduced batch")), None)
    if not fractions and rads and reduced is not None:
        best = min(rads, key=lambda k: loss[k])
        where = "below" if loss[best] < loss[reduced] else "not below"
        return f"{best} ends {where} the {reduced} at equal saved bytes"
    if not fractions:
        return "train loss per method"
    by_fraction = [loss[k] for k in sorted(rads, key=lambda k: finals[k]["fraction"])]
    msg = ("the larger the fraction, the lower the final train loss"
           if len(by_fraction) > 1 and all(a >= b for a, b in itertools.pairwise(by_fraction))
           else "final train loss is not monotone in the fraction")  # fmt: skip
    return msg + ("; fraction 1.0 trains bit-identically to backprop" if identical else "")


def _by_fraction(ax: Any, finals: dict[str, dict[str, Any]], key: str, *, scale: float,
                 ylabel: str, log: bool = False) -> None:  # fmt: skip
    """``key`` (median, min–max over seeds) against the fraction; the baseline as a line."""
    pts = sorted((r["fraction"], r) for r in finals.values() if r.get("fraction") is not None)
    if pts:
        mid = [scale * r[f"{key}_median"] for _, r in pts]
        err = [[m - scale * r[f"{key}_min"] for m, (_, r) in zip(mid, pts, strict=True)],
               [scale * r[f"{key}_max"] - m for m, (_, r) in zip(mid, pts, strict=True)]]
        ax.errorbar([f for f, _ in pts], mid, yerr=err, marker="o", capsize=3, label="RAD")
    base = finals.get(BASELINE)
    if base is not None and f"{key}_median" in base:
        ax.axhline(scale * base[f"{key}_median"], color="k", ls="--", lw=1, label=BASELINE)
    ax.set(xscale="log", xlabel="fraction of activations kept", ylabel=ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


YLABELS = {"train_loss": "train loss (cross-entropy, nats)", "train_acc": "train accuracy",
           "test_loss": "test loss (cross-entropy, nats)", "test_acc": "test accuracy"}  # fmt: skip


def _band_figure(suite: str, series: str, rs: list[dict[str, Any]], directory: Any, *,
                 identical: dict[str, Any] | None) -> list[str]:  # fmt: skip
    """Train loss and test accuracy bands (``rad-convergence``); with the fraction-1.0
    checks (``rad-fractions``: ``identical`` by model) also test loss, train accuracy, and
    step time and final train loss against the fraction."""
    finals, fractions = final_bands(rs), identical is not None
    fig, grid = pyplot().subplots(*((2, 3) if fractions else (1, 2)),
                                  figsize=(15, 8) if fractions else (11, 4))  # fmt: skip
    axes = list(grid.flat)
    keys = ("train_loss", "test_loss", None, "train_acc", "test_acc") if fractions else (
        "train_loss", "test_acc")  # fmt: skip
    for ax, key in zip(axes, keys, strict=False):
        if key is not None:
            plot_band(ax, rs, key, ylabel=YLABELS[key], log=key == "train_loss")
    if fractions:
        _by_fraction(axes[2], finals, "step_seconds", scale=1e3,
                     ylabel="time per iteration (ms, median step)")  # fmt: skip
        _by_fraction(axes[5], finals, "train_loss", scale=1.0,
                     ylabel="final train loss (nats)", log=True)  # fmt: skip
    axes[0].legend(fontsize=8)
    message = _message(finals, (identical or {}).get(series), fractions=fractions)
    seeds = max(len(r["seeds"]) for r in rs)
    fig.suptitle(f"{suite} — {series}: {message}\n(median, min–max band over {seeds} seeds)")
    return save_series_figure(fig, suite, series, directory)


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "**no**")


FRACTION_ONE_NOTE = (
    "Fraction 1.0 against backprop (the paper, Fig. 10: without replacement, fraction 1.0 "
    "“would be equivalent to baseline”). *grads*: every parameter's gradient `torch.equal` "
    "to backprop's at the same initial weights and first batch, at every seed; *curves*: "
    "every evaluated train/test loss and accuracy equal bit for bit; *weights*: the final "
    "weights `torch.equal`."
)


def _render_variance(recs: list[dict[str, Any]]) -> list[str]:
    rows = []
    for kind in dict.fromkeys(r["model"] for r in recs):
        rs = [r for r in recs if r["model"] == kind]
        ref = next((r for r in rs if r["fraction"] is None and r["batch"] == 150), rs[0])
        rows += [(kind, r["engine"], r["batch"], fmt_bytes(r["saved_bytes"]),
                  f"{r['saved_bytes'] / ref['saved_bytes']:.3f}", fmt_bytes(r["peak_bytes"]),
                  f"{r['grad_mse']:.4g}", f"{r['grad_mse'] / ref['grad_mse']:.2f}")
                 for r in rs]  # fmt: skip
    return ["Gradient MSE against the full-training-set gradient (sum over parameters, mean "
            "over draws) beside measured memory (Fig. 5). Lower-left is better.", "",
            *md_table(("model", "estimator", "batch", "saved", "saved / batch-150", "peak",
                       "grad MSE", "MSE / batch-150"), rows), ""]  # fmt: skip


def render(suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool) -> list[str]:
    """Markdown for ``rad-variance``, ``rad-convergence`` and ``rad-fractions``: the
    variance/memory table; or per model the curves (median and band over the seeds) and a
    table at the last step, then (``rad-fractions``) the fraction-1.0 check."""
    lines = [SAVED_NOTE, ""]
    variance = [r for r in records if r.get("kind") == "rad-variance"]
    band = band_records(records, "rad-training", "rad-band")
    if variance:
        lines += _render_variance(variance)
    if not band:
        return lines
    ones = [r for r in records if r.get("kind") == "rad-fraction-one"]
    identical = {r["model"]: r.get("curves_identical") for r in ones} if ones else None

    def figure(series: str, rs: list[dict[str, Any]]) -> list[str]:
        return _band_figure(suite, series, rs, directory, identical=identical)

    lines += series_sections(band, note=BAND_NOTE, figure=figure if plots else None,
                             table=_band_table)  # fmt: skip
    if ones:
        lines += [FRACTION_ONE_NOTE, "", *md_table(
            ("model", "seeds", "grads equal (without replacement)", "max abs diff",
             "grads equal (with replacement)", "curves identical", "weights equal at end"),
            ((r["model"], len(r["per_seed"]), _yes(r["grads_equal"]),
              f"{r['grad_max_abs_diff']:.3g}", _yes(r["grads_equal_with_replacement"]),
              _yes(r["curves_identical"]), _yes(r["weights_equal_at_end"])) for r in ones),
        ), ""]  # fmt: skip
    return lines
