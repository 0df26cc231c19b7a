"""Randomized-AD suites (Oktay et al., ICLR 2021): runners and their report section.

- :func:`run_variance` (``rad-variance``, Fig. 5): at fixed weights, the mean
  squared error of each stochastic gradient (a random mini-batch, and RAD at
  several fractions on top of it) against the full-training-set gradient,
  beside the memory each one measurably keeps for backward.
- :func:`run_convergence` (``rad-convergence``, Fig. 6): training curves on
  real MNIST-5k for backprop at batch 150, RAD 0.1 (same / different /
  project) at batch 150, and backprop at the *reduced batch* whose measured
  saved bytes match RAD's; an IRNN on row-by-row MNIST does the same (section 4.3).
  Every curve is trained at several seeds (:class:`Replicate`: a bootstrap resample of
  the training set each, as the paper's appendix) and summarised by :func:`bands` as a
  median with a min–max band; ``rad-fractions`` (:mod:`._rad_fractions`) shares this.
- :func:`run_pde` (``rad-pde``, Fig. 7): the reaction-diffusion control problem
  optimised with exact and RAD gradients; loss curves and measured stored state.

Memory is measured, never computed from shapes: ``saved_bytes`` is what
autograd keeps (:func:`~leangrad.measure.saved_tensor_bytes`, parameters and
targets excluded), ``forward_bytes`` the tracker's live bytes after the forward
(the input batch is copied inside the region, so it counts when it is kept) and
``peak_bytes`` the tracker's peak over forward and backward.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import data, rad
from .._sizes import fmt_bytes
from ..measure import MemoryTracker, num_threads, saved_tensor_bytes
from ._report import by_series, pyplot, save_figure, save_series_figure, series_png
from ._runner import machine_info, new_record
from ._search import bisect_last_fit
from ._side_by_side import Curves, Lane, make_optimizer, train_side_by_side
from ._suites import RunSettings, Suite
from ._training import _now

__all__ = [
    "BAND", "BAND_KEYS", "BAND_NOTE", "Replicate", "SeedStart", "TrainRun", "TrainingSetup",
    "bands", "eval_sets", "final_bands",
    "fmt_band", "memory_of", "plot_band", "render", "replicates", "run_convergence", "run_pde",
    "run_variance", "save_figure", "series_sections", "train_lanes",
]  # fmt: skip


class RowRNN(nn.Module):
    """An IRNN reading a 28x28 image row by row (28 steps of 28 pixels), then a linear head."""

    def __init__(self, hidden: int, *, rows: int = 28) -> None:
        super().__init__()
        self.cell = nn.RNNCell(rows, hidden, nonlinearity="relu")
        self.head = nn.Linear(hidden, 10)
        with torch.no_grad():  # Appendix A: identity W_hh, N(0, 0.001) W_ih, zero biases
            self.cell.weight_hh.copy_(torch.eye(hidden))
            self.cell.weight_ih.normal_(0.0, 0.001)
            self.cell.bias_ih.zero_()
            self.cell.bias_hh.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        h = None
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


def rad_model(kind: str, *, side: int = 28) -> nn.Module:
    """``mlp``: Appendix A's 784-300-300-300-10 ReLU net; ``cnn``: a small ReLU/avg-pool
    convnet (a CPU-sized stand-in for the paper's CIFAR-10 net); ``irnn``: :class:`RowRNN`
    with 100 hidden units. ``side``: the images' side (28 for MNIST, 8 for digits)."""
    if kind == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(side * side, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(),
            nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 10),
        )  # fmt: skip
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
            nn.Flatten(), nn.Linear(16 * (side // 4) ** 2, 10),
        )  # fmt: skip
    if kind == "irnn":
        return RowRNN(100, rows=side)
    raise ValueError(f"model must be 'mlp', 'cnn' or 'irnn', got {kind!r}")


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


def _load(dataset: str, seed: int, device: str) -> tuple[data.Dataset, data.Dataset]:
    """80/20 train/test split of ``dataset`` (4000/1000 for MNIST-5k)."""
    return data.load(dataset, device=device).split(0.8, seed=seed)


def _flat(model: nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "every parameter of these models has a gradient"
    return torch.cat([g.reshape(-1).double() for g in grads if g is not None])


def _full_gradient(model: nn.Module, ds: data.Dataset) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    for x, y in ds.batches(500, shuffle=False):
        (F.cross_entropy(model(x), y, reduction="sum") / len(ds)).backward()
    g = _flat(model)
    model.zero_grad(set_to_none=True)
    return g


def _layer_slices(model: nn.Module) -> dict[str, slice]:
    out, i = {}, 0
    for n, p in model.named_parameters():
        out[n] = slice(i, i + p.numel())
        i += p.numel()
    return out


def _record(suite: Suite, kind: str, quick: bool, **fields: Any) -> dict[str, Any]:
    return new_record(dict(kind=kind, suite=suite.name, quick=quick), fields)


def _estimators(suite: Suite, quick: bool) -> list[dict[str, Any]]:
    """``[{label, batch, fraction, mode}]`` from the suite's ``estimators`` setting."""
    out = []
    for e in suite.setting("estimators", quick, []):
        f = e.get("fraction")
        label = e.get("label") or (
            f"batch {e['batch']}" if f is None else f"RAD {f} {e.get('mode', 'different')}"
        )
        out.append({"label": label, "batch": e["batch"], "fraction": f,
                    "mode": e.get("mode", "different")})  # fmt: skip
    return out


def run_variance(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Gradient MSE vs the full-data gradient, beside measured memory (Fig. 5)."""
    quick, device = settings.quick, settings.device
    machine, created = machine_info(), _now()
    seed = int(suite.setting("seed", quick, 0))
    draws = int(suite.setting("draws", quick, 50))
    pretrain = int(suite.setting("pretrain_steps", quick, 0))
    models = list(suite.setting("models", quick, ["mlp", "cnn"]))
    train, _ = _load(str(suite.setting("dataset", quick, "mnist5k")), seed, device)
    ests = _estimators(suite, quick)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(models) * len(ests) * draws, desc=suite.name,
               disable=not settings.progress)  # fmt: skip
    for kind in models:
        torch.manual_seed(seed)
        base = rad_model(kind, side=train.x.shape[-1]).to(device)
        if pretrain:  # move away from the initialisation, as a gradient mid-training
            opt = torch.optim.Adam(base.parameters(), lr=1e-3)
            for _, (x, y) in zip(range(pretrain), _forever(train, 150, seed), strict=False):
                opt.zero_grad()
                F.cross_entropy(base(x), y).backward()
                opt.step()
        full = _full_gradient(base, train)
        slices = _layer_slices(base)
        for est in ests:
            bar.set_description(f"{suite.name} {kind} {est['label']}")
            model = randomized(base, est["fraction"], est["mode"], seed + 1)
            mem = memory_of(model, train.x[: est["batch"]], train.y[: est["batch"]])
            gen = torch.Generator().manual_seed(seed + 2)
            sq = torch.zeros_like(full)
            for _ in range(draws):
                idx = torch.randint(len(train), (est["batch"],), generator=gen)
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(train.x[idx.to(train.x.device)]), train.y[idx]).backward()
                sq += (_flat(model) - full).square()
                bar.update(1)
            sq /= draws
            records.append(_record(
                suite, "rad-variance", quick, engine=est["label"], model=kind,
                batch=est["batch"], fraction=est["fraction"], mode=est["mode"],
                config={"model": kind, "batch": est["batch"], "fraction": est["fraction"],
                        "mode": est["mode"], "draws": draws, "pretrain_steps": pretrain,
                        "seed": seed, "dataset": train.name, "train_examples": len(train)},
                grad_mse=sq.sum().item(), full_grad_sq=full.square().sum().item(),
                layer_mse={n: sq[s].sum().item() for n, s in slices.items()},
                machine=machine, created=created, **mem,
            ))  # fmt: skip
    bar.close()
    return records


def _forever(
    ds: data.Dataset, batch: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches sampled with replacement from ``ds`` (Appendix A), forever."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(len(ds), (batch,), generator=gen).to(ds.x.device)
        yield ds.x[idx], ds.y[idx]


@torch.no_grad()
def _loss_on(model: nn.Module, ds: data.Dataset) -> tuple[float, float]:
    loss, correct = 0.0, 0
    for x, y in ds.batches(1000, shuffle=False):
        out = model(x)
        loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += int((out.argmax(1) == y).sum())
    return loss / len(ds), correct / len(ds)


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
    dataset" (Appendix A); here each seed resamples the training split with replacement,
    initialises the model, seeds RAD's samples and draws its batch order, each from its
    own stream. Within a seed, every method starts from the same weights and (at the same
    batch size) sees the same batches.
    """

    seed: int

    @property
    def init_seed(self) -> int:
        return self.seed

    @property
    def rad_seed(self) -> int:
        return self.seed + 1

    @property
    def batch_seed(self) -> int:
        return self.seed + 3

    @property
    def bootstrap_seed(self) -> int:
        return self.seed + 7

    def bootstrap(self, ds: data.Dataset) -> data.Dataset:
        """``ds`` resampled with replacement to its own size."""
        gen = torch.Generator().manual_seed(self.bootstrap_seed)
        idx = torch.randint(len(ds), (len(ds),), generator=gen)
        return dataclasses.replace(ds, x=ds.x[idx.to(ds.x.device)], y=ds.y[idx.to(ds.y.device)])


def replicates(suite: Suite, quick: bool) -> list[Replicate]:
    """The suite's ``seeds`` (a count, 5 by default) seeds, from its ``seed`` on."""
    first, count = int(suite.setting("seed", quick, 0)), int(suite.setting("seeds", quick, 5))
    return [Replicate(first + i) for i in range(count)]


def eval_sets(
    train: data.Dataset, test: data.Dataset, examples: int | None
) -> tuple[data.Dataset, data.Dataset]:
    """The sets the curves are measured on: the first ``examples`` of each (``None``: all).

    ``train`` is a seed's bootstrapped set (a random draw, so its head is a random sample
    of it); ``test`` the held-out split (randomly permuted by the split)."""
    if examples is None:
        return train, test
    head = slice(0, int(examples))
    return (dataclasses.replace(train, x=train.x[head], y=train.y[head]),
            dataclasses.replace(test, x=test.x[head], y=test.y[head]))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """One entry of a training suite's ``runs``: the model and how it is trained."""

    kind: str
    steps: int
    every: int
    lr: float
    optimizer: str

    @classmethod
    def of(cls, run: dict[str, Any]) -> TrainRun:
        return cls(run["model"], int(run["steps"]), int(run["eval_every"]), float(run["lr"]),
                   str(run.get("optimizer", "adam")))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SeedStart:
    """Where every lane of one seed starts: its bootstrapped training set, the sets its
    curves are measured on (:func:`eval_sets`) and the initial model they all copy."""

    rep: Replicate
    boot: data.Dataset
    seen: data.Dataset
    held_out: data.Dataset
    base: nn.Module


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """What ``rad-convergence`` and ``rad-fractions`` read alike from their suite: the
    batch, the ``runs``, torch threads, the evaluation examples, the seeds
    (:func:`replicates`) and the data (the dataset split with the suite's ``seed``, on
    ``device``)."""

    name: str
    device: str
    batch: int
    runs: list[TrainRun]
    threads: int
    examples: int | None
    seeds: list[Replicate]
    train: data.Dataset
    test: data.Dataset

    @classmethod
    def of(cls, suite: Suite, quick: bool, device: str) -> TrainingSetup:
        seed = int(suite.setting("seed", quick, 0))
        train, test = _load(str(suite.setting("dataset", quick, "mnist5k")), seed, device)
        return cls(
            name=suite.name,
            device=device,
            batch=int(suite.setting("batch", quick, 150)),
            runs=[TrainRun.of(r) for r in suite.setting("runs", quick, [])],
            threads=int(suite.setting("torch_threads", quick, 1)),
            examples=suite.setting("eval_examples", quick, None),
            seeds=replicates(suite, quick),
            train=train,
            test=test,
        )

    def starts(self, kind: str, bar: Any) -> Iterator[SeedStart]:
        """Every seed's start, in order; the model is drawn after the seed's bootstrap, from
        ``torch.manual_seed(rep.init_seed)`` (the progress ``bar`` names the seed at work)."""
        for rep in self.seeds:
            bar.set_description(f"{self.name} {kind} seed {rep.seed}")
            boot = rep.bootstrap(self.train)
            seen, held_out = eval_sets(boot, self.test, self.examples)
            torch.manual_seed(rep.init_seed)
            base = rad_model(kind, side=self.train.x.shape[-1]).to(self.device)
            yield SeedStart(rep, boot, seen, held_out, base)


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
    tick: Callable[[], None]
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
        tl, ta = _loss_on(lane.model, self.train)
        vl, va = _loss_on(lane.model, self.test)
        if not math.isfinite(tl):
            lane.failed = f"train loss {tl} at step {r}"  # the curve ends here
        fields = {"x": r, "train_loss": tl, "train_acc": ta, "test_loss": vl, "test_acc": va,
                  "train_seconds": lane.seconds}  # fmt: skip
        times = self.step_times.get(lane.label, [])
        if (r == self.steps or lane.failed) and times:
            timed = times[TIMING_WARMUP:] or times
            fields.update(step_seconds=statistics.median(timed), timed_steps=len(timed))
        return fields


def train_lanes(
    lanes: list[Lane],
    *,
    head: dict[str, Any],
    train: data.Dataset,
    test: data.Dataset,
    steps: int,
    every: int,
    batch: int,
    batch_seed: int,
    tick: Callable[[], None],
) -> list[dict[str, Any]]:
    """Train ``lanes`` side by side for ``steps`` batches of ``batch`` drawn with replacement
    from ``train`` (stream ``batch_seed``); a record per lane at step 0, every ``every``
    steps and at the end, measured on ``train`` and ``test`` (``head``: fields of all)."""
    curves = _RadTraining(head, train, test, steps, every, tick)
    rounds = zip(range(1, steps + 1), _forever(train, batch, batch_seed), strict=False)
    return train_side_by_side(lanes, itertools.chain([(0, None)], rounds), curves)


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
        rec.update(kind=band_kind, band=BAND, seeds=[r["seed"] for r in rs])
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


def run_convergence(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train loss vs iteration at equal measured memory (Fig. 6 and the RNN analogue), at
    every seed of :func:`replicates` (bootstrapped training set, own init, RAD samples and
    batch order); per-seed ``rad-training`` records and their ``rad-band`` summaries."""
    quick, device = settings.quick, settings.device
    machine, created = machine_info(), _now()
    seed = int(suite.setting("seed", quick, 0))
    fraction = float(suite.setting("fraction", quick, 0.1))
    modes = list(suite.setting("modes", quick, ["same", "different", "project"]))
    setup = TrainingSetup.of(suite, quick, device)
    batch, threads, examples, train = setup.batch, setup.threads, setup.examples, setup.train
    records: list[dict[str, Any]] = []
    total = sum(r.steps * (len(modes) + 2) * len(setup.seeds) for r in setup.runs)
    bar = tqdm(total=total, desc=suite.name, disable=not settings.progress)
    head = {"suite": suite, "kind": "rad-training", "quick": quick}
    with num_threads(threads):
        for run in setup.runs:
            kind, steps, lr, optimizer = run.kind, run.steps, run.lr, run.optimizer
            torch.manual_seed(setup.seeds[0].init_seed)  # memory does not depend on the weights
            base = rad_model(kind, side=train.x.shape[-1]).to(device)
            probe = randomized(base, fraction, "different", seed)
            target = memory_of(probe, train.x[:batch], train.y[:batch])["saved_bytes"]
            reduced, _ = equal_memory_batch(base, target, train, largest=batch)
            configs: list[tuple[str, int, float | None, str]] = [("baseline", batch, None, "-")]
            configs += [(f"RAD {fraction} {m}", batch, fraction, m) for m in modes]
            configs.append((f"reduced batch {reduced}", reduced, None, "-"))
            mine: list[dict[str, Any]] = []
            for start in setup.starts(kind, bar):
                rep = start.rep
                lanes: dict[int, list[Lane]] = {}
                for label, b, frac, mode in configs:
                    model = randomized(start.base, frac, mode, rep.rad_seed)
                    mem = memory_of(model, train.x[:b], train.y[:b])
                    config = {"model": kind, "batch": b, "fraction": frac, "mode": mode,
                              "lr": lr, "optimizer": optimizer, "steps": steps,
                              "seed": rep.seed, "dataset": train.name, "bootstrap": True,
                              "train_examples": len(train), "eval_examples": examples,
                              "threads": threads, "equal_memory_target_bytes": target}  # fmt: skip
                    opt = make_optimizer(optimizer, model.parameters(), lr, momentum=0.0)
                    lanes.setdefault(b, []).append(Lane(label, model, opt, fields={
                        "model": kind, "series": kind, "sweep": "step", "config": config,
                        "seed": rep.seed, "threads": threads, "machine": machine,
                        "created": created, **mem,
                    }))  # fmt: skip
                for b, group in lanes.items():  # same batch size: side by side, same batches
                    mine += train_lanes(
                        group, head=head, train=start.seen, test=start.held_out, steps=steps,
                        every=run.every, batch=b, batch_seed=rep.batch_seed,
                        tick=lambda: bar.update(1),
                    )  # fmt: skip
            records += mine + bands(mine)
    bar.close()
    return records


PDE_SEED_STRIDE = 100_000
"""Replicate r of a RAD lane draws iteration i's sample from seed ``seed + r·stride + i``,
so the replicates' streams never overlap (iteration i of one is not i+1 of another)."""


def run_pde(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Adam on the reaction-diffusion control from exact and RAD gradients (Fig. 7): the
    exact lane once (deterministic), each RAD fraction over ``seeds`` replicates of its
    random samples from the same initial control; per-replicate ``rad-pde`` records and
    their ``rad-pde-band`` summaries (median and :data:`BAND` of the loss per iteration)."""
    from ..rad._pde import ReactionDiffusion, optimize, pde_gradient

    quick = settings.quick
    machine, created = machine_info(), _now()
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
        for i, loss in enumerate(run.losses):
            records.append(_record(
                suite, "rad-pde", quick, engine=label, series="reaction-diffusion",
                sweep="iteration", x=i, train_loss=loss, fraction=fraction, config=config,
                peak_bytes=tracker.report.peak_bytes, stored_values=run.stored_values,
                saved_bytes=tracker.report.forward_live_bytes, seed=rep,
                train_seconds=seconds if i == len(run.losses) - 1 else None,
                theta=run.theta.tolist() if i == len(run.losses) - 1 else None,
                machine=machine, created=created,
            ))  # fmt: skip
    bar.close()
    return records + bands(records, kind="rad-pde", band_kind="rad-pde-band")


def _curves(recs: list[dict[str, Any]], title: str, path: Any, *, log: bool) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4))
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in recs:
        if r.get("train_loss") is not None:
            lines.setdefault(r["engine"], []).append((r["x"], r["train_loss"]))
    for label, pts in lines.items():
        ax.plot(*zip(*sorted(pts), strict=True), label=label)
    ax.set_xlabel(recs[0].get("sweep", "iteration"))
    ax.set_ylabel("train loss")
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_band(ax: Any, recs: list[dict[str, Any]], key: str, *, ylabel: str,
              log: bool = False, reference: str = "baseline",
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
    """``median [min–max]`` of ``key`` in a ``rad-band`` record (``—`` when missing)."""
    if r.get(f"{key}_median") is None:
        return "—"
    mid, lo, hi = (scale * r[f"{key}_{s}"] for s in ("median", "min", "max"))
    return f"{mid:{spec}} [{lo:{spec}}–{hi:{spec}}]"


def final_bands(recs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Engine -> its ``rad-band`` record at the last step, in record order."""
    out: dict[str, dict[str, Any]] = {}
    for r in recs:
        if r["engine"] not in out or r["x"] >= out[r["engine"]]["x"]:
            out[r["engine"]] = r
    return out


BAND_NOTE = (
    "Lines: median over the seeds; shaded: min–max over the seeds (each seed trains on its "
    "own bootstrap resample of the training split, with its own initialisation — shared by "
    "all methods of that seed —, RAD samples and batch order). Train loss/accuracy are "
    "measured on the seed's bootstrapped set, test on the held-out split. Table cells: "
    "median [min–max] over the seeds at the last step; s/step = median step time "
    f"(zero_grad, forward, backward, optimizer step) after {TIMING_WARMUP} warm-up steps, lanes "
    "of one batch size interleaved step by step, at the records' torch thread count."
)


def _convergence_message(finals: dict[str, dict[str, Any]]) -> str:
    """The figure's one message: where the best RAD lane ends against the reduced batch."""
    loss = {k: r["train_loss_median"] for k, r in finals.items() if "train_loss_median" in r}
    rads = [k for k in loss if k.startswith("RAD ")]
    reduced = next((k for k in loss if k.startswith("reduced batch")), None)
    if not rads or reduced is None:
        return "train loss per method"
    best = min(rads, key=lambda k: loss[k])
    where = "below" if loss[best] < loss[reduced] else "not below"
    return f"{best} ends {where} the {reduced} at equal saved bytes"


Section = Callable[[str, list[dict[str, Any]]], list[str]]
"""A part of one series' report section: ``(series, its records) -> Markdown lines``."""


def series_sections(
    recs: list[dict[str, Any]], *, table: Section, figure: Section | None = None,
    note: tuple[str, ...] = (),
) -> list[str]:  # fmt: skip
    """The paragraphs of ``note``, then per series of ``recs`` (:func:`by_series`) its
    heading, ``figure``'s lines (``None``: no plots) and ``table``'s; each followed by a
    blank line."""
    lines = [line for paragraph in note for line in (paragraph, "")]
    for series, rs in by_series(recs).items():
        lines += [f"### {series}", ""]
        if figure is not None:
            lines += figure(series, rs)
        lines += [*table(series, rs), ""]
    return lines


def _render_bands(
    suite: str, recs: list[dict[str, Any]], directory: Any, *, plots: bool
) -> list[str]:
    def figure(series: str, rs: list[dict[str, Any]]) -> list[str]:
        seeds = max(len(r["seeds"]) for r in rs)
        fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
        plot_band(axes[0], rs, "train_loss", ylabel="train loss (cross-entropy, nats)",
                  log=True)  # fmt: skip
        plot_band(axes[1], rs, "test_acc", ylabel="test accuracy")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{suite} — {series}: {_convergence_message(final_bands(rs))}\n"
                     f"(median, min–max band over {seeds} seeds)")  # fmt: skip
        return save_series_figure(fig, suite, series, directory)

    def table(series: str, rs: list[dict[str, Any]]) -> list[str]:
        lines = [
            "| run | batch | saved | peak | final step | seeds | train loss | test acc | ms/step |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label, last in final_bands(rs).items():
            lines.append(
                f"| {label} | {(last.get('config') or {}).get('batch', '')} "
                f"| {fmt_bytes(last.get('saved_bytes'))} | {fmt_bytes(last.get('peak_bytes'))} "
                f"| {last['x']} | {last['n_seeds']} | {fmt_band(last, 'train_loss', '.3f')} "
                f"| {fmt_band(last, 'test_acc', '.3f')} "
                f"| {fmt_band(last, 'step_seconds', '.1f', scale=1e3)} |"
            )
        return lines

    return series_sections(recs, note=(BAND_NOTE,), figure=figure if plots else None,
                           table=table)  # fmt: skip


def _render_pde_bands(
    suite: str, recs: list[dict[str, Any]], directory: Any, *, plots: bool
) -> list[str]:
    """The PDE control's loss per Adam iteration: each lane's median over its replicates
    with the :data:`BAND` shaded (the exact lane is one deterministic run)."""
    finals = final_bands(recs)
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
        least = min((r for r in finals.values() if r.get("fraction", 1) < 1),
                    key=lambda r: r["fraction"], default=None)  # fmt: skip
        what = ("loss per iteration" if least is None else
                f"storing {least['fraction']:g} of the state, RAD optimises as the exact "
                "gradient does")  # fmt: skip
        ax.set_title(f"{suite}: {what}\n(median, min–max band over {seeds} replicates)",
                     fontsize=10)  # fmt: skip
        return save_series_figure(fig, suite, series, directory)

    def table(series: str, rs: list[dict[str, Any]]) -> list[str]:
        lines = [
            "| run | fraction | saved | peak | final iteration | replicates | loss | train s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, last in finals.items():
            if last["series"] != series:
                continue
            lines.append(
                f"| {label} | {(last.get('config') or {}).get('fraction')} "
                f"| {fmt_bytes(last.get('saved_bytes'))} | {fmt_bytes(last.get('peak_bytes'))} "
                f"| {last['x']} | {last['n_seeds']} | {fmt_band(last, 'train_loss', '.4g')} "
                f"| {fmt_band(last, 'train_seconds', '.1f')} |"
            )
        return lines

    return series_sections(recs, note=(note,), figure=figure if plots else None, table=table)


def _render_variance(recs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "Gradient MSE against the full-training-set gradient (sum over parameters, "
        "mean over draws) beside measured memory (Fig. 5). Lower-left is better.",
        "",
        "| model | estimator | batch | saved | saved / batch-150 | peak | grad MSE "
        "| MSE / batch-150 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in dict.fromkeys(r["model"] for r in recs):
        rs = [r for r in recs if r["model"] == kind]
        ref = next((r for r in rs if r["fraction"] is None and r["batch"] == 150), rs[0])
        for r in rs:
            lines.append(
                f"| {kind} | {r['engine']} | {r['batch']} | {fmt_bytes(r['saved_bytes'])} "
                f"| {r['saved_bytes'] / ref['saved_bytes']:.3f} | {fmt_bytes(r['peak_bytes'])} "
                f"| {r['grad_mse']:.4g} | {r['grad_mse'] / ref['grad_mse']:.2f} |"
            )
    return [*lines, ""]


def _render_curves(
    suite: str, recs: list[dict[str, Any]], directory: Any, *, plots: bool, log: bool
) -> list[str]:
    def figure(series: str, rs: list[dict[str, Any]]) -> list[str]:
        path, shown = series_png(suite, series, directory)
        _curves(rs, f"{suite} — {series}", path, log=log)
        return shown

    def table(series: str, rs: list[dict[str, Any]]) -> list[str]:
        lines = [
            "| run | batch / fraction | saved | peak | final step | train loss | test acc "
            "| train s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label in dict.fromkeys(r["engine"] for r in rs):
            ls = [r for r in rs if r["engine"] == label]
            last = max(ls, key=lambda r: r["x"])
            cfg = last.get("config") or {}
            how = cfg.get("batch", "") if "batch" in cfg else f"fraction {cfg.get('fraction')}"
            acc = last.get("test_acc")
            secs = next((r["train_seconds"] for r in reversed(ls) if r.get("train_seconds")), None)
            lines.append(
                f"| {label} | {how} | {fmt_bytes(last.get('saved_bytes'))} "
                f"| {fmt_bytes(last.get('peak_bytes'))} | {last['x']} "
                f"| {last['train_loss']:.4g} | {'' if acc is None else f'{acc:.3f}'} "
                f"| {'' if secs is None else f'{secs:.1f}'} |"
            )
        return lines

    return series_sections(recs, figure=figure if plots else None, table=table)


def render(suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool) -> list[str]:
    """Markdown for the rad-* suites: a variance/memory table, or curves with memory."""
    kinds = {r.get("kind") for r in records}
    lines = [
        "*saved* = bytes autograd keeps for backward (parameters, targets excluded; the "
        "input counts when kept); *peak* = tracker peak over forward and backward.",
        "",
    ]
    if "rad-variance" in kinds:
        lines += _render_variance([r for r in records if r.get("kind") == "rad-variance"])
    if "rad-band" in kinds:  # per-seed curves summarised: median and band over the seeds
        rs = [r for r in records if r.get("kind") == "rad-band"]
        lines += _render_bands(suite, rs, directory, plots=plots)
    elif "rad-training" in kinds:  # results written before the seeds: one curve per run
        rs = [r for r in records if r.get("kind") == "rad-training"]
        lines += _render_curves(suite, rs, directory, plots=plots, log=False)
    if "rad-pde-band" in kinds:
        rs = [r for r in records if r.get("kind") == "rad-pde-band"]
        lines += _render_pde_bands(suite, rs, directory, plots=plots)
    elif "rad-pde" in kinds:  # results written before the replicates: one curve per lane
        rs = [r for r in records if r.get("kind") == "rad-pde"]
        lines += _render_curves(suite, rs, directory, plots=plots, log=True)
    return lines
