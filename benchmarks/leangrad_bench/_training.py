"""Training suites: curves over steps or epochs rather than sweeps of one step.

Two runners, named by suite files with ``runner = "module:function"``:

- :func:`run_stability` (``moonwalk-v1-stability``, Moonwalk v1 section 6.6,
  Figs. 4-5): one RevNet with tanh couplings, trained from the same
  initialisation on the same batches by several engines (backprop, revbackprop,
  moonwalk). Every ``eval_every`` steps, each engine's gradient of the current
  batch *at its own current weights* is compared with autograd's float64
  gradient of the same weights and batch, and loss/accuracy are measured on
  the whole train and test sets.
- :func:`run_constrained` (``moonwalk-v2-constrained``, Moonwalk v2 section 6.4,
  Fig. 4): the same stride-2 conv net with channel-triangular
  ``SubmersiveConv2d`` layers (constrained) and with plain ``nn.Conv2d``
  (unconstrained), both trained with backprop; train loss/accuracy and test
  accuracy after every epoch.

Both are configs (:class:`_Stability`, :class:`_Constrained`) of the loop they share
with highway-train and rad-convergence, :func:`~leangrad_bench._side_by_side.train_side_by_side`.

Records carry :data:`~leangrad_bench.RECORD_FIELDS` (``None`` where not
measured) plus ``kind = "training"``, ``suite``, ``series``, ``sweep``
(``"step"`` or ``"epoch"``), ``x``, ``train_loss``, ``train_acc``, ``test_acc``,
``quick``, ``machine`` and ``created``. Nothing here decides what the curves
show: an engine that raises (e.g. tanh saturating in an inverse) or whose loss
is not finite gets a record with ``failed`` set and stops training.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from leangrad import data, models
from leangrad.measure import compare_grads, grads_of

from ._runner import EngineSpec, new_record
from ._side_by_side import Curves, Lane, make_optimizer, same_start, train_side_by_side
from ._suites import RunSettings, Suite

__all__ = ["run_constrained", "run_stability"]

NOT_FINITE = "batch loss is {loss}"


@torch.no_grad()
def _evaluate(model: nn.Module, ds: data.Dataset, batch: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` over the whole of ``ds``."""
    loss_sum, correct = 0.0, 0
    for x, y in ds.batches(batch, shuffle=False):
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += int((out.argmax(1) == y).sum().item())
    return loss_sum / len(ds), correct / len(ds)


def _train_step(lane: Lane, x: torch.Tensor, y: torch.Tensor) -> float:
    """One cross-entropy gradient by ``lane``'s engine into its model's ``.grad``; its loss.

    Raises:
        FloatingPointError: the loss is not finite (the lane stops there).
    """
    lane.model.zero_grad(set_to_none=True)
    loss = float(lane.engine.backward(lane.model, x, lambda out: F.cross_entropy(out, y)).loss)
    if not math.isfinite(loss):
        raise FloatingPointError(NOT_FINITE.format(loss=loss))
    return loss


def _forever(
    ds: data.Dataset, batch: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        yield from ds.batches(batch, shuffle=True, seed=seed + epoch, drop_last=True)
        epoch += 1


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Autograd's float64 gradient of the cross-entropy at ``model``'s current weights."""
    m64 = copy.deepcopy(model).to(torch.float64)
    params = {n: p for n, p in m64.named_parameters() if p.requires_grad}
    loss = F.cross_entropy(m64(x.to(torch.float64)), y)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def _param_dist(a: nn.Module, b: nn.Module) -> float:
    """``max|θ_a − θ_b| / max|θ_b|`` over all parameters together."""
    da = torch.cat([p.detach().double().reshape(-1) for p in a.parameters()])
    db = torch.cat([p.detach().double().reshape(-1) for p in b.parameters()])
    scale = db.abs().max().item()
    return (da - db).abs().max().item() / scale if scale > 0 else 0.0


def stability_model(config: Mapping[str, Any], depth: int) -> nn.Module:
    """The v1 stability RevNet: ``models.revnet(activation=...)``; with
    ``output_tanh`` a :class:`~leangrad.layers.Tanh` follows every coupling
    (v1 section 6.6: "an activation function added to the output of the layer")."""
    from leangrad.layers import AdditiveCoupling, Chain, Tanh

    model = models.revnet(
        config.get("in_channels", 1),
        config.get("channels", 8),
        config.get("classes", 10),
        blocks=config.get("blocks", 2),
        layers_per_block=depth,
        activation=config.get("activation", "tanh"),
    )
    if not config.get("output_tanh", False):
        return model
    layers: list[nn.Module] = []
    for layer in model.layers:
        layers.append(layer)
        if isinstance(layer, AdditiveCoupling):
            layers.append(Tanh())
    return Chain(*layers, stem=model.stem, head=model.head)


@dataclasses.dataclass
class _Settings:
    """The settings both training suites share."""

    batch: int
    lr: float
    optimizer: str
    seed: int
    fraction: float

    @classmethod
    def of(cls, suite: Suite, quick: bool, *, batch: int) -> _Settings:
        return cls(
            batch=int(suite.setting("batch", quick, batch)),
            lr=float(suite.setting("lr", quick, 1e-3)),
            optimizer=str(suite.setting("optimizer", quick, "adam")),
            seed=int(suite.setting("seed", quick, 0)),
            fraction=float(suite.setting("train_fraction", quick, 0.8)),
        )

    def config(self) -> dict[str, Any]:
        return {"batch": self.batch, "lr": self.lr, "optimizer": self.optimizer,
                "seed": self.seed, "dtype": "float32"}  # fmt: skip


@dataclasses.dataclass
class _Run(Curves):
    """What both suites' rounds share: one series' records (``sweep`` = the round's unit)
    and its train and test sets."""

    name: str
    config: dict[str, Any]
    train: data.Dataset
    test: data.Dataset
    bar: Any

    def record(self, lane: Lane, r: int) -> dict[str, Any]:
        head = dict(kind="training", series=self.name, sweep=self.unit, x=r, train_loss=None,
                    train_acc=None, test_acc=None, failed=None)  # fmt: skip
        return new_record(head, lane.fields, {"config": self.config})


@dataclasses.dataclass
class _Stability(_Run):
    """v1 stability: every lane's gradient of each batch, at its own weights, vs the oracle."""

    steps: int
    every: int
    ref: nn.Module | None

    def advance(self, lane: Lane, r: int, batch: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = _train_step(lane, *batch)
        dt = time.perf_counter() - t0
        lane.seconds += dt
        return loss, dt

    def measure(self, lane: Lane, r: int, batch: Any, out: Any) -> dict[str, Any] | None:
        if not (r % self.every == 0 or r == self.steps):
            return None
        (x, y), (loss, dt), model = batch, out, lane.model
        cmp = compare_grads(grads_of(model), _oracle(model, x, y))
        train_loss, train_acc = _evaluate(model, self.train)
        _, test_acc = _evaluate(model, self.test)
        return {
            "grad_max_rel_err": cmp.max_rel_err,
            "grad_cosine": cmp.cosine,
            "batch_loss": loss,
            "train_loss": train_loss,
            "train_acc": train_acc,
            "test_acc": test_acc,
            "param_dist_to_backprop": None if self.ref is None else _param_dist(model, self.ref),
            "train_seconds": lane.seconds,
            "seconds_median": dt,
        }

    def end_round(self, lanes: Sequence[Lane], r: int) -> None:
        if r < self.steps:  # after every engine's measurement of this step
            for lane in lanes:
                lane.opt.step()
                self.bar.update(1)


def _engine_lanes(base: nn.Module, specs: Sequence[EngineSpec], settings: _Settings) -> list[Lane]:
    """One lane per engine spec, each on its own copy of ``base``."""
    lanes = same_start(base, [s.display for s in specs], settings.optimizer, settings.lr)
    for lane, spec in zip(lanes, specs, strict=True):
        lane.engine = spec.make()
        lane.fields = {"engine": spec.display, "engine_name": spec.name, "options": spec.options}
        reason = lane.engine.supports(lane.model)
        lane.failed = f"not applicable: {reason}" if reason else None
    return lanes


def run_stability(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train one RevNet per engine side by side; gradient error vs the float64 oracle."""
    quick, device = settings.quick, settings.device
    steps = int(suite.setting("steps", quick, 300))
    every = int(suite.setting("eval_every", quick, 25))
    st = _Settings.of(suite, quick, batch=32)
    train, test = data.digits(device=device).split(st.fraction, seed=st.seed)
    jobs = suite.jobs(quick)
    total = sum(steps * len(suite.engines_for(s)) for s, _ in jobs)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=total, desc=f"train {suite.name}", unit="step", disable=not settings.progress)
    for series, depth in jobs:
        name = f"{series.name}-{suite.sweep}{depth}"
        config = {**series.config, suite.sweep: depth, "steps": steps, "eval_every": every,
                  **st.config()}  # fmt: skip
        bar.set_description(f"{suite.name} {name}")
        torch.manual_seed(st.seed)
        lanes = _engine_lanes(
            stability_model(series.config, depth).to(device), suite.engines_for(series), st
        )
        ref = next((ln.model for ln in lanes if ln.fields["engine_name"] == "backprop"), None)
        curves = _Stability(name, config, train, test, bar, steps, every, ref)
        rounds = zip(range(steps + 1), _forever(train, st.batch, st.seed), strict=False)
        records += train_side_by_side(lanes, rounds, curves)
        last = {r["engine"]: r for r in records if r["series"] == name}
        bar.set_postfix_str(
            " ".join(f"{lb}:{r['grad_max_rel_err'] or 0:.1e}" for lb, r in last.items()),
            refresh=True,
        )
    bar.close()
    return records


def _pad_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad (or centre-crop) square images to ``size`` x ``size``."""
    d = size - x.shape[-1]
    if d >= 0:
        return F.pad(x, (d // 2, d - d // 2, d // 2, d - d // 2))
    lo = -d // 2
    return x[..., lo : lo + size, lo : lo + size]


def constrained_model(config: Mapping[str, Any], constrained: bool) -> nn.Module:
    """``models.submersive_cnn`` (constrained), or the same net with ``nn.Conv2d``
    and ``nn.LeakyReLU`` in place of the submersive layers (unconstrained)."""
    cin, c = config.get("in_channels", 1), config.get("channels", 16)
    depth, classes = config.get("depth", 4), config.get("classes", 10)
    slope = config.get("negative_slope", 0.1)
    if constrained:
        return models.submersive_cnn(cin, c, depth, classes, negative_slope=slope)
    layers: list[nn.Module] = [nn.Conv2d(cin, c, 1)]
    for _ in range(depth):
        layers += [nn.Conv2d(c, c, 3, stride=2, padding=1), nn.LeakyReLU(slope)]
    layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


@dataclasses.dataclass
class _Constrained(_Run):
    """v2 constrained: round 0 measures the initialisation, round e trains epoch e."""

    settings: _Settings
    unit: str = "epoch"

    def advance(self, lane: Lane, r: int, batch: Any) -> None:
        if r == 0:
            return
        st, t0 = self.settings, time.perf_counter()
        try:
            for x, y in self.train.batches(st.batch, shuffle=True, seed=st.seed + r,
                                           drop_last=True):  # fmt: skip
                _train_step(lane, x, y)
                lane.opt.step()
                self.bar.update(1)
        finally:
            lane.seconds += time.perf_counter() - t0

    def measure(self, lane: Lane, r: int, batch: Any, out: Any) -> dict[str, Any]:
        train_loss, train_acc = _evaluate(lane.model, self.train)
        test_loss, test_acc = _evaluate(lane.model, self.test)
        self.bar.set_postfix_str(f"epoch {r} test acc {test_acc:.3f}")
        return {"train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss,
                "test_acc": test_acc, "train_seconds": lane.seconds}  # fmt: skip


def _constrained_data(
    suite: Suite, quick: bool, st: _Settings, device: str
) -> tuple[str, int, data.Dataset, data.Dataset]:
    """Dataset name, image size, and the train/test split (train cut to ``train_limit``)."""
    limit = suite.setting("train_limit", quick, None)
    dataset = str(suite.setting("dataset", quick, "mnist5k"))
    size = int(suite.setting("size", quick, 32))
    ds = data.load(dataset, device=device)
    ds = data.Dataset(_pad_to(ds.x, size), ds.y, ds.name, ds.num_classes)
    train, test = ds.split(st.fraction, seed=st.seed)
    if limit is not None and int(limit) < len(train):
        train = data.Dataset(train.x[: int(limit)], train.y[: int(limit)], ds.name, 10)
    return dataset, size, train, test


def run_constrained(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Constrained vs unconstrained conv nets, trained with backprop, per epoch."""
    quick, device = settings.quick, settings.device
    epochs = int(suite.setting("epochs", quick, 10))
    st = _Settings.of(suite, quick, batch=64)
    dataset, size, train, test = _constrained_data(suite, quick, st, device)
    jobs = suite.jobs(quick)
    variants = ("constrained", "unconstrained")
    total = len(jobs) * len(variants) * epochs * (len(train) // st.batch)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=total, desc=f"train {suite.name}", unit="batch", disable=not settings.progress)
    for series, value in jobs:
        name = f"{series.name}-{suite.sweep}{value}"
        config = {**series.config, suite.sweep: value, "dataset": dataset, "size": size,
                  "train_examples": len(train), "test_examples": len(test), "epochs": epochs,
                  **st.config()}  # fmt: skip
        curves = _Constrained(name, config, train, test, bar, st)
        for spec in suite.engines_for(series):
            for variant in variants:  # one lane at a time: records ordered by lane
                bar.set_description(f"{suite.name} {name} {variant}")
                torch.manual_seed(st.seed)
                model = constrained_model(config, variant == "constrained").to(device)
                lane = Lane(
                    f"{variant} ({spec.display})", model,
                    make_optimizer(st.optimizer, model.parameters(), st.lr), engine=spec.make(),
                    fields={"engine": f"{variant} ({spec.display})", "engine_name": spec.name,
                            "options": spec.options, "model": variant,
                            "num_params": sum(p.numel() for p in model.parameters())},
                )  # fmt: skip
                records += train_side_by_side([lane], ((e, e) for e in range(epochs + 1)), curves)
    bar.close()
    return records
