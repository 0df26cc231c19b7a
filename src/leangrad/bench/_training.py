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

Records carry :data:`~leangrad.bench.RECORD_FIELDS` (``None`` where not
measured) plus ``kind = "training"``, ``suite``, ``series``, ``sweep``
(``"step"`` or ``"epoch"``), ``x``, ``train_loss``, ``train_acc``, ``test_acc``,
``quick``, ``machine`` and ``created``. Nothing here decides what the curves
show: an engine that raises (e.g. tanh saturating in an inverse) or whose loss
is not finite gets a record with ``failed`` set and stops training.
"""

from __future__ import annotations

import copy
import datetime
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import data, models
from ..measure import compare_grads, grads_of
from ._runner import RECORD_FIELDS, EngineSpec, machine_info
from ._suites import Suite

__all__ = ["run_constrained", "run_stability"]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _record(suite: Suite, series: str, sweep: str, x: int, quick: bool, **fields: Any) -> dict:
    rec: dict[str, Any] = dict.fromkeys(RECORD_FIELDS)
    rec.update(
        kind="training",
        suite=suite.name,
        series=series,
        sweep=sweep,
        x=x,
        train_loss=None,
        train_acc=None,
        test_acc=None,
        failed=None,
        quick=quick,
    )
    rec.update(fields)
    return rec


def _optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


@torch.no_grad()
def _evaluate(model: nn.Module, ds: data.Dataset, batch: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` over the whole of ``ds``."""
    loss_sum, correct = 0.0, 0
    for x, y in ds.batches(batch, shuffle=False):
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += int((out.argmax(1) == y).sum().item())
    return loss_sum / len(ds), correct / len(ds)


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
    from ..layers import AdditiveCoupling, Chain, Tanh

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


def run_stability(
    suite: Suite, *, quick: bool = False, device: str = "cpu", progress: bool = True
) -> list[dict[str, Any]]:
    """Train one RevNet per engine side by side; gradient error vs the float64 oracle."""
    machine, created = machine_info(), _now()
    steps = int(suite.setting("steps", quick, 300))
    every = int(suite.setting("eval_every", quick, 25))
    batch = int(suite.setting("batch", quick, 32))
    lr = float(suite.setting("lr", quick, 1e-3))
    opt_name = str(suite.setting("optimizer", quick, "adam"))
    seed = int(suite.setting("seed", quick, 0))
    fraction = float(suite.setting("train_fraction", quick, 0.8))
    train, test = data.digits(device=device).split(fraction, seed=seed)
    jobs = [(s, v) for s in suite.series for v in (s.quick_values if quick else s.values)]
    specs_all = {s.name: suite.engines_for(s) for s in suite.series}
    total = sum(steps * len(specs_all[s.name]) for s, _ in jobs)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=total, desc=f"train {suite.name}", unit="step", disable=not progress)
    for series, depth in jobs:
        name = f"{series.name}-{suite.sweep}{depth}"
        config = {
            **series.config,
            suite.sweep: depth,
            "steps": steps,
            "eval_every": every,
            "batch": batch,
            "lr": lr,
            "optimizer": opt_name,
            "seed": seed,
            "dtype": "float32",
        }
        bar.set_description(f"{suite.name} {name}")
        torch.manual_seed(seed)
        base = stability_model(series.config, depth).to(device)
        specs: list[EngineSpec] = specs_all[series.name]
        runs: dict[str, dict[str, Any]] = {}
        for spec in specs:
            model = copy.deepcopy(base)
            engine = spec.make()
            reason = engine.supports(model)
            runs[spec.display] = {
                "spec": spec,
                "engine": engine,
                "model": model,
                "opt": _optimizer(opt_name, model.parameters(), lr),
                "failed": f"not applicable: {reason}" if reason else None,
                "seconds": 0.0,
            }
        ref_label = next((lb for lb, r in runs.items() if r["spec"].name == "backprop"), None)
        for step, (x, y) in zip(range(steps + 1), _forever(train, batch, seed), strict=False):
            evaluate = step % every == 0 or step == steps
            for label, run in runs.items():
                if run["failed"] is not None:
                    continue
                model, engine = run["model"], run["engine"]
                rec = _record(
                    suite, name, "step", step, quick,
                    engine=label, engine_name=run["spec"].name, options=run["spec"].options,
                    config=config, machine=machine, created=created,
                )  # fmt: skip
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                try:
                    res = engine.backward(model, x, lambda out, y=y: F.cross_entropy(out, y))
                    loss = float(res.loss)
                    if not math.isfinite(loss):
                        raise FloatingPointError(f"batch loss is {loss}")
                except Exception as err:  # record what happened, stop this engine
                    run["failed"] = f"step {step}: {type(err).__name__}: {err}"
                    rec["failed"] = run["failed"]
                    records.append(rec)
                    continue
                dt = time.perf_counter() - t0
                run["seconds"] += dt
                if evaluate:
                    cmp = compare_grads(grads_of(model), _oracle(model, x, y))
                    train_loss, train_acc = _evaluate(model, train)
                    _, test_acc = _evaluate(model, test)
                    ref = runs[ref_label]["model"] if ref_label else None
                    rec.update(
                        grad_max_rel_err=cmp.max_rel_err,
                        grad_cosine=cmp.cosine,
                        batch_loss=loss,
                        train_loss=train_loss,
                        train_acc=train_acc,
                        test_acc=test_acc,
                        param_dist_to_backprop=None if ref is None else _param_dist(model, ref),
                        train_seconds=run["seconds"],
                        seconds_median=dt,
                    )
                    records.append(rec)
            if step < steps:  # after every engine's measurement of this step
                for run in runs.values():
                    if run["failed"] is None:
                        run["opt"].step()
                        bar.update(1)
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


def run_constrained(
    suite: Suite, *, quick: bool = False, device: str = "cpu", progress: bool = True
) -> list[dict[str, Any]]:
    """Constrained vs unconstrained conv nets, trained with backprop, per epoch."""
    machine, created = machine_info(), _now()
    epochs = int(suite.setting("epochs", quick, 10))
    batch = int(suite.setting("batch", quick, 64))
    lr = float(suite.setting("lr", quick, 1e-3))
    opt_name = str(suite.setting("optimizer", quick, "adam"))
    seed = int(suite.setting("seed", quick, 0))
    fraction = float(suite.setting("train_fraction", quick, 0.8))
    limit = suite.setting("train_limit", quick, None)
    dataset = str(suite.setting("dataset", quick, "mnist5k"))
    size = int(suite.setting("size", quick, 32))
    ds = data.load(dataset, device=device)
    ds = data.Dataset(_pad_to(ds.x, size), ds.y, ds.name, ds.num_classes)
    train, test = ds.split(fraction, seed=seed)
    if limit is not None and int(limit) < len(train):
        train = data.Dataset(train.x[: int(limit)], train.y[: int(limit)], ds.name, 10)
    jobs = [(s, v) for s in suite.series for v in (s.quick_values if quick else s.values)]
    variants = ("constrained", "unconstrained")
    n_batches = len(train) // batch
    total = len(jobs) * len(variants) * epochs * n_batches
    records: list[dict[str, Any]] = []
    bar = tqdm(total=total, desc=f"train {suite.name}", unit="batch", disable=not progress)
    for series, value in jobs:
        name = f"{series.name}-{suite.sweep}{value}"
        config = {
            **series.config,
            suite.sweep: value,
            "dataset": dataset,
            "size": size,
            "train_examples": len(train),
            "test_examples": len(test),
            "epochs": epochs,
            "batch": batch,
            "lr": lr,
            "optimizer": opt_name,
            "seed": seed,
            "dtype": "float32",
        }
        for spec in suite.engines_for(series):
            for variant in variants:
                bar.set_description(f"{suite.name} {name} {variant}")
                torch.manual_seed(seed)
                model = constrained_model(config, variant == "constrained").to(device)
                engine = spec.make()
                opt = _optimizer(opt_name, model.parameters(), lr)
                label = spec.display
                num_params = sum(p.numel() for p in model.parameters())
                seconds = 0.0
                failed = None
                for epoch in range(epochs + 1):
                    if epoch > 0 and failed is None:
                        t0 = time.perf_counter()
                        batches = train.batches(
                            batch, shuffle=True, seed=seed + epoch, drop_last=True
                        )
                        for x, y in batches:
                            model.zero_grad(set_to_none=True)
                            try:
                                res = engine.backward(
                                    model, x, lambda out, y=y: F.cross_entropy(out, y)
                                )
                                if not math.isfinite(float(res.loss)):
                                    raise FloatingPointError(f"batch loss is {float(res.loss)}")
                            except Exception as err:
                                failed = f"epoch {epoch}: {type(err).__name__}: {err}"
                                break
                            opt.step()
                            bar.update(1)
                        seconds += time.perf_counter() - t0
                    rec = _record(
                        suite, name, "epoch", epoch, quick,
                        engine=f"{variant} ({label})", engine_name=spec.name,
                        options=spec.options, model=variant, num_params=num_params,
                        config=config,
                        machine=machine, created=created, failed=failed,
                    )  # fmt: skip
                    if failed is None:
                        train_loss, train_acc = _evaluate(model, train)
                        test_loss, test_acc = _evaluate(model, test)
                        rec.update(
                            train_loss=train_loss,
                            train_acc=train_acc,
                            test_loss=test_loss,
                            test_acc=test_acc,
                            train_seconds=seconds,
                        )
                    records.append(rec)
                    if failed is not None:
                        break
                    bar.set_postfix_str(f"epoch {epoch} test acc {rec['test_acc']:.3f}")
    bar.close()
    return records
