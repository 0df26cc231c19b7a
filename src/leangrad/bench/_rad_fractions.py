"""``rad-fractions``: RAD "different sample" at a sweep of fractions, with bands over seeds.

Randomized AD (Oktay et al., ICLR 2021), appendix "Sweep of fractions sampled for MNIST and
CIFAR-10" (Figs. 9-10): train and test loss/accuracy curves and time per iteration of the
"different sample" estimator at several fractions beside the backprop baseline, each
trained on 5 bootstrapped resamplings of the training set. Here: the MNIST-5k MLP and the
small CIFAR-style CNN of ``rad-convergence`` (:func:`~leangrad.bench._rad.rad_model`), every
lane of a seed side by side on the same batches from the same initialisation, step times
interleaved at one torch thread.

The paper notes (Fig. 10) that its 0.8 does not quite reach the baseline "because we sample
with replacement ... [without replacement] at fraction 1.0 would be equivalent to baseline".
:func:`run_fractions` checks that for leangrad: at every seed, whether fraction 1.0 without
replacement gives gradients ``torch.equal`` to backprop's at the initial weights and first
batch, and whether the whole training curve (and the final weights) is identical.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .._sizes import fmt_bytes
from ..measure import num_threads
from ._rad import (
    BAND,
    TrainingSetup,
    _forever,
    _record,
    bands,
    final_bands,
    fmt_band,
    memory_of,
    plot_band,
    randomized,
    series_sections,
    train_lanes,
)
from ._rad import BAND_NOTE as _BAND_NOTE
from ._report import pyplot, save_figure, series_png
from ._runner import machine_info
from ._side_by_side import Lane, make_optimizer
from ._suites import RunSettings, Suite
from ._training import _now

__all__ = ["BASELINE", "fraction_one_check", "render", "run_fractions"]

BASELINE = "baseline"
"""Label of the backprop lane (no RAD) at the same batch."""

CURVE_KEYS = ("train_loss", "train_acc", "test_loss", "test_acc")
"""What two lanes must agree on, bit for bit, at every evaluated step to count as identical."""


def _label(fraction: float, mode: str) -> str:
    return f"RAD {fraction} {mode}"


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    out = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


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
    machine, created = machine_info(), _now()
    mode = str(suite.setting("mode", quick, "different"))
    replace = bool(suite.setting("replace", quick, False))
    fractions = [float(f) for f in suite.setting("fractions", quick, [0.05, 0.1, 0.2, 0.5, 1.0])]
    setup = TrainingSetup.of(suite, quick, settings.device)
    batch, threads, examples, train = setup.batch, setup.threads, setup.examples, setup.train
    configs: list[tuple[str, float | None]] = [(BASELINE, None)]
    configs += [(_label(f, mode), f) for f in fractions]
    records: list[dict[str, Any]] = []
    total = sum(r.steps * len(configs) * len(setup.seeds) for r in setup.runs)
    bar = tqdm(total=total, desc=suite.name, disable=not settings.progress)
    head = {"suite": suite, "kind": "rad-training", "quick": quick}
    with num_threads(threads):
        for run in setup.runs:
            kind, steps, lr, optimizer = run.kind, run.steps, run.lr, run.optimizer
            mine: list[dict[str, Any]] = []
            checks: list[dict[str, Any]] = []
            for start in setup.starts(kind, bar):
                rep, base = start.rep, start.base
                x0, y0 = next(_forever(start.boot, batch, rep.batch_seed))  # the first batch
                check = {"seed": rep.seed, **fraction_one_check(base, x0, y0, mode=mode,
                                                                seed=rep.rad_seed)}  # fmt: skip
                lanes: dict[str, Lane] = {}
                for label, frac in configs:
                    model = randomized(base, frac, mode, rep.rad_seed, replace=replace)
                    mem = memory_of(model, train.x[:batch], train.y[:batch])
                    config = {"model": kind, "batch": batch, "fraction": frac,
                              "mode": mode if frac is not None else "-", "replace": replace,
                              "lr": lr, "optimizer": optimizer, "steps": steps,
                              "seed": rep.seed, "dataset": train.name, "bootstrap": True,
                              "train_examples": len(train), "eval_examples": examples,
                              "threads": threads}  # fmt: skip
                    opt = make_optimizer(optimizer, model.parameters(), lr, momentum=0.0)
                    lanes[label] = Lane(label, model, opt, fields={
                        "model": kind, "series": kind, "sweep": "step", "fraction": frac,
                        "config": config, "seed": rep.seed, "threads": threads,
                        "machine": machine, "created": created, **mem,
                    })  # fmt: skip
                recs = train_lanes(
                    list(lanes.values()), head=head, train=start.seen, test=start.held_out,
                    steps=steps, every=run.every, batch=batch, batch_seed=rep.batch_seed,
                    tick=lambda: bar.update(1),
                )  # fmt: skip
                mine += recs
                checks.append({**check, **_same_training(lanes, recs, _label(1.0, mode))})
            records += mine + bands(mine)
            records.append(_fraction_one_record(suite, quick, kind, mode, replace, checks,
                                                machine=machine, created=created))  # fmt: skip
    bar.close()
    return records


def _fraction_one_record(
    suite: Suite, quick: bool, kind: str, mode: str, replace: bool,
    checks: list[dict[str, Any]], **fields: Any,
) -> dict[str, Any]:  # fmt: skip
    def every(key: str) -> bool | None:
        vals = [c[key] for c in checks]
        return None if any(v is None for v in vals) else all(vals)

    return _record(
        suite, "rad-fraction-one", quick, engine=_label(1.0, mode), model=kind, series=kind,
        fraction=1.0, replace=False, trained_with_replacement=replace,
        config={"model": kind, "fraction": 1.0, "mode": mode, "replace": False,
                "seeds": [c["seed"] for c in checks]},
        per_seed=checks, grads_equal=every("grads_equal"),
        grads_equal_with_replacement=every("grads_equal_with_replacement"),
        grad_max_abs_diff=max(c["grad_max_abs_diff"] for c in checks),
        curves_identical=every("curves_identical"),
        weights_equal_at_end=every("weights_equal_at_end"), **fields,
    )  # fmt: skip


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "**no**")


def _render_fraction_one(recs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "Fraction 1.0 against backprop (the paper, Fig. 10: without replacement, fraction 1.0 "
        "“would be equivalent to baseline”). *grads*: every parameter's gradient "
        "`torch.equal` to backprop's at the same initial weights and first batch, at every "
        "seed; *curves*: every evaluated train/test loss and accuracy equal bit for bit; "
        "*weights*: the final weights `torch.equal`.",
        "",
        "| model | seeds | grads equal (without replacement) | max abs diff "
        "| grads equal (with replacement) | curves identical | weights equal at end |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        lines.append(
            f"| {r['model']} | {len(r['per_seed'])} | {_yes(r['grads_equal'])} "
            f"| {r['grad_max_abs_diff']:.3g} | {_yes(r['grads_equal_with_replacement'])} "
            f"| {_yes(r['curves_identical'])} | {_yes(r['weights_equal_at_end'])} |"
        )
    return [*lines, ""]


def _by_fraction(ax: Any, finals: dict[str, dict[str, Any]], key: str, *, scale: float,
                 ylabel: str, log: bool = False) -> None:  # fmt: skip
    """``key`` (median, min–max over seeds) against the fraction; the baseline as a line."""
    pts = sorted((r["fraction"], r) for r in finals.values() if r.get("fraction") is not None)
    if pts:
        f = [p[0] for p in pts]
        mid = [scale * p[1][f"{key}_median"] for p in pts]
        lo = [m - scale * p[1][f"{key}_min"] for m, p in zip(mid, pts, strict=True)]
        hi = [scale * p[1][f"{key}_max"] - m for m, p in zip(mid, pts, strict=True)]
        ax.errorbar(f, mid, yerr=[lo, hi], marker="o", capsize=3, label="RAD")
    base = finals.get(BASELINE)
    if base is not None and f"{key}_median" in base:
        ax.axhline(scale * base[f"{key}_median"], color="k", ls="--", lw=1, label=BASELINE)
    ax.set_xscale("log")
    ax.set_xlabel("fraction of activations kept")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _message(finals: dict[str, dict[str, Any]], identical: bool | None) -> str:
    """The figure's one message, read off the results."""
    rad = sorted((r["fraction"], r["train_loss_median"]) for r in finals.values()
                 if r.get("fraction") is not None and "train_loss_median" in r)  # fmt: skip
    losses = [loss for _, loss in rad]
    if len(losses) > 1 and all(a >= b for a, b in itertools.pairwise(losses)):
        msg = "the larger the fraction, the lower the final train loss"
    else:
        msg = "final train loss is not monotone in the fraction"
    if identical:
        msg += "; fraction 1.0 trains bit-identically to backprop"
    return msg


def _figure(suite: str, model: str, rs: list[dict[str, Any]], path: Any,
            identical: bool | None) -> None:  # fmt: skip
    finals = final_bands(rs)
    fig, axes = pyplot().subplots(2, 3, figsize=(15, 8))
    plot_band(axes[0, 0], rs, "train_loss", ylabel="train loss (cross-entropy, nats)", log=True)
    plot_band(axes[0, 1], rs, "test_loss", ylabel="test loss (cross-entropy, nats)")
    plot_band(axes[1, 0], rs, "train_acc", ylabel="train accuracy")
    plot_band(axes[1, 1], rs, "test_acc", ylabel="test accuracy")
    axes[0, 0].legend(fontsize=8)
    _by_fraction(axes[0, 2], finals, "step_seconds", scale=1e3,
                 ylabel="time per iteration (ms, median step)")  # fmt: skip
    _by_fraction(axes[1, 2], finals, "train_loss", scale=1.0,
                 ylabel="final train loss (nats)", log=True)  # fmt: skip
    seeds = max(len(r["seeds"]) for r in rs)
    fig.suptitle(f"{suite} — {model}: {_message(finals, identical)}\n"
                 f"(median, min–max band over {seeds} seeds)")  # fmt: skip
    save_figure(fig, path)


def render(suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool) -> list[str]:
    """Markdown for ``rad-fractions``: per model, the curves (median and band over the seeds),
    a table at the last step, then the fraction-1.0 check."""
    band = [r for r in records if r.get("kind") == "rad-band"]
    ones = [r for r in records if r.get("kind") == "rad-fraction-one"]
    identical = {r["model"]: r.get("curves_identical") for r in ones}
    note = (
        _BAND_NOTE + f" Band: {BAND}.",
        "*saved* = bytes autograd keeps for backward at batch 150 (measured; parameters and "
        "targets excluded).",
    )

    def figure(model: str, rs: list[dict[str, Any]]) -> list[str]:
        path, shown = series_png(suite, model, directory)
        _figure(suite, model, rs, path, identical.get(model))
        return shown

    def table(model: str, rs: list[dict[str, Any]]) -> list[str]:
        finals = final_bands(rs)
        base = finals.get(BASELINE, {})
        lines = [
            "| run | saved | saved / baseline | final step | seeds | train loss | test loss "
            "| test acc | ms/step | time / baseline |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, r in finals.items():
            saved = r.get("saved_bytes")
            rel = f"{saved / base['saved_bytes']:.3f}" if saved and base.get("saved_bytes") else ""
            t, t0 = r.get("step_seconds_median"), base.get("step_seconds_median")
            lines.append(
                f"| {label} | {fmt_bytes(saved)} | {rel} | {r['x']} | {r['n_seeds']} "
                f"| {fmt_band(r, 'train_loss', '.3f')} | {fmt_band(r, 'test_loss', '.3f')} "
                f"| {fmt_band(r, 'test_acc', '.3f')} "
                f"| {fmt_band(r, 'step_seconds', '.1f', scale=1e3)} "
                f"| {f'{t / t0:.2f}' if t and t0 else ''} |"
            )
        return lines

    lines = series_sections(band, note=note, figure=figure if plots else None, table=table)
    if ones:
        lines += _render_fraction_one(ones)
    return lines
