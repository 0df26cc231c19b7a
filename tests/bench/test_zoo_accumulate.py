"""Gradient accumulation in the ``zoo`` suite: the per-example losses of
``zoo.batch`` and ``hf.batch``, PyTorch's hand-written accumulation rows and leangrad's
``accumulate`` rows, exact where offered, skipped with the reason elsewhere, and in the
report. Tiny sizes; nothing here asserts a time."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from leangrad import zoo
from leangrad.loss import PerExample
from leangrad_bench import RunSettings, load_suite
from leangrad_bench._models import build
from leangrad_bench._zoo import _ModelRun, run_zoo
from leangrad_bench._zoo_batch import footprint, micro_batches
from leangrad_bench._zoo_methods import (
    NOT_PER_EXAMPLE,
    TOO_FEW_EXAMPLES,
    Method,
    call,
    leangrad_methods,
    pytorch_methods,
)
from leangrad_bench._zoo_report import PYTORCH_SIDES, best_within, headline_table, render
from leangrad_bench._zoo_rows import Context

GPT = {"vocab": 32, "dim": 16, "layers": 3, "heads": 2, "context": 8, "batch": 6}
SIZES: dict[str, dict[str, Any]] = {
    "resnet": {"depth": 10, "width": 4, "image": 8, "batch": 5},
    "gpt": GPT,
    "bert": {"vocab": 32, "dim": 16, "layers": 2, "heads": 2, "context": 8, "batch": 5},
    "lstm_lm": {"vocab": 32, "embed": 8, "hidden": 8, "layers": 2, "length": 6, "batch": 5},
    "gru_lm": {"vocab": 32, "embed": 8, "hidden": 8, "layers": 2, "length": 6, "batch": 5},
    "highway_gru_lm": {"vocab": 32, "embed": 8, "hidden": 8, "layers": 2, "length": 6, "batch": 5},
    "vit": {"image": 8, "patch": 4, "dim": 16, "layers": 2, "heads": 2, "batch": 5},
}
KS = [2, 4]
ACCUMULATE_LABELS = {
    "torch accumulate(2)", "torch accumulate(4)", "torch accumulate(2) + per-block",
    "torch accumulate(4) + per-block", "accumulate(micro_batches=2)",
    "accumulate(micro_batches=4)", "checkpoint+accumulate(micro_batches=2)",
    "checkpoint+accumulate(micro_batches=4)",
}  # fmt: skip


def _ctx(**settings: Any) -> Context:
    base = {"micro_batches": KS, "segments": [2], "chunks": [2], "forward_max_params": 0,
            "max_transforms": 1}  # fmt: skip
    return Context(True, {}, {**base, **settings}, 1)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_zoo_batch_losses_are_per_example_with_the_same_values(name: str) -> None:
    """Each zoo loss is declared per example, computes what the closure it replaced did, and
    its rows' weighted losses add up to it (as micro-batches must)."""
    wl = build(name, SIZES[name])
    loss_fn = wl.loss_fn
    assert isinstance(loss_fn, PerExample) and loss_fn.reduction == "mean"
    n = int(SIZES[name]["batch"])
    assert loss_fn.batch == n
    with torch.no_grad():
        out = call(wl.model, wl.inputs)
        (y,) = loss_fn.targets
        if zoo.MODELS[name] == "images" or name == "bert":
            before = F.cross_entropy(out, y)
        else:
            before = F.cross_entropy(out.flatten(0, 1), y.flatten())
        assert torch.equal(loss_fn(out), before)
        parts = sum(loss_fn.rows(a, b)(out[a:b]) for a, b in ((0, 2), (2, n)))
    torch.testing.assert_close(parts, before, rtol=1e-6, atol=0)


def test_hf_batch_losses_are_per_example_where_claimed() -> None:
    """GPT-2, Llama (next-token cross-entropy, ``length - 1`` tokens per row) and the UNet
    (mean squared error over equal images) are per example, with the values the closures
    gave; BERT's masked-LM mean over masked positions, unequal per row, is not."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    from leangrad import hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("gpt2", "llama", "unet", "bert"):
            model = hf.model(name, **hf.TINY[name], seed=0).eval()
            xs, loss_fn = hf.batch(name, model, 3, length=8)
            if name == "bert":
                assert not isinstance(loss_fn, PerExample)
                continue
            assert isinstance(loss_fn, PerExample) and loss_fn.batch == 3
            with torch.no_grad():
                out = model(*xs)
                if name == "unet":
                    before = F.mse_loss(out.sample, loss_fn.targets[0])
                else:
                    tgt = xs[0][:, 1:].reshape(-1)
                    before = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tgt)
                assert torch.equal(loss_fn(out), before), name
                parts = model(*(x[:1] for x in xs)), model(*(x[1:] for x in xs))
                total = loss_fn.rows(0, 1)(parts[0]) + loss_fn.rows(1, 3)(parts[1])
            torch.testing.assert_close(total, before, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "vit", "lstm_lm", "highway_gru_lm"])
def test_accumulate_rows_give_backprops_gradient(name: str) -> None:
    """PyTorch's hand-written accumulation (alone and with per-block checkpointing inside each
    micro-batch) and leangrad's accumulate rows: the zoo's own gradient error against
    backprop is float32 rounding, and kept bytes are about a micro-batch's."""
    run = _ModelRun(name, SIZES[name], _ctx(), lambda msg: None)
    acc = [m for m in run.methods if "accumulate" in m.label]
    labels = {m.label for m in acc}
    assert {"torch accumulate(2)", "torch accumulate(4)", "accumulate(micro_batches=4)",
            "checkpoint+accumulate(micro_batches=2)"} <= labels  # fmt: skip
    if name in ("gpt", "vit"):
        assert {"torch accumulate(2) + per-block", "torch accumulate(4) + per-block"} <= labels
    elif name == "lstm_lm":  # the fused LSTM in the suite's most time chunks instead
        chunks = max(_ctx().get("chunks", []))
        assert {f"torch accumulate({k}) + time chunks({chunks})" for k in (2, 4)} <= labels
    else:  # no blocks written out: the plain loop is PyTorch's accumulation row
        why = next(s.reason for s in run.skipped if s.label == "torch accumulate(2) + per-block")
        assert "no per-block torch.utils.checkpoint" in why
    for m in [next(m for m in run.methods if m.label == "backprop"), *acc]:
        run.profile(m)
    assert not run.failed
    bp = run.prof["backprop"]
    for m in acc:
        prof = run.prof[m.label]
        assert m.exact and prof.grad_max_rel_err is not None, m.label
        assert prof.grad_max_rel_err < 1e-5 and prof.grad_cosine > 1 - 1e-6, m.label
    # marked after the first micro-batch's loss: less the more micro-batches (at these tiny
    # sizes batch-independent workspaces keep it above 1/k of backprop's)
    kept = [run.prof[f"torch accumulate({k})"].kept_bytes for k in (4, 2)]
    assert all(isinstance(v, int) for v in kept) and bp.kept_bytes is not None
    assert kept[0] < kept[1] < bp.kept_bytes  # type: ignore[operator]


def test_resnets_batchnorm_skips_accumulation_with_the_reason() -> None:
    """Training-mode BatchNorm couples a batch's examples: no accumulation row on either side,
    each skipped saying so."""
    wl = build("resnet", SIZES["resnet"])
    pt, pt_skip = pytorch_methods(wl.model, segments=[2], chunks=[2], micro_batches=KS,
                                  loss_fn=wl.loss_fn)  # fmt: skip
    lg, lg_skip = leangrad_methods(wl.model, options={}, skip={}, forward_max_params=0,
                                   max_transforms=0, micro_batches=KS,
                                   loss_fn=wl.loss_fn)  # fmt: skip
    assert not [m for m in pt + lg if "accumulate" in m.label]
    why = {s.label: s.reason for s in pt_skip + lg_skip if "accumulate" in s.label}
    assert set(why) == ACCUMULATE_LABELS
    assert all("BatchNorm2d" in r and "couples the examples" in r for r in why.values())
    assert {"torch per-block", "torch selective"} <= {m.label for m in pt}  # the others stay


def test_accumulation_needs_a_per_example_loss_and_enough_examples() -> None:
    wl = build("gpt", GPT)
    y = wl.loss_fn.targets[0]  # type: ignore[attr-defined]

    def plain(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    pt, pt_skip = pytorch_methods(wl.model, segments=[], chunks=[], micro_batches=[2, 8],
                                  loss_fn=plain)  # fmt: skip
    assert not [m for m in pt if "accumulate" in m.label]
    assert {s.reason for s in pt_skip if "accumulate" in s.label} == {NOT_PER_EXAMPLE}
    lg, lg_skip = leangrad_methods(wl.model, options={}, skip={}, forward_max_params=0,
                                   max_transforms=0, micro_batches=[2, 8],
                                   loss_fn=wl.loss_fn)  # fmt: skip
    assert {m.label for m in lg if "accumulate" in m.label} == {
        "accumulate(micro_batches=2)", "checkpoint+accumulate(micro_batches=2)"}  # fmt: skip
    too_many = TOO_FEW_EXAMPLES.format(k=8, batch=GPT["batch"])
    assert {s.reason for s in lg_skip if "accumulate" in s.label} == {too_many}
    # without micro_batches, no PyTorch accumulation rows (the suite file names the k)
    assert not [m for m in pytorch_methods(wl.model, segments=[], chunks=[])[0]
                if "accumulate" in m.label]  # fmt: skip


def test_max_batch_below_the_micro_batch_count_is_measured_at_it() -> None:
    """Accumulation has no step with fewer examples than micro-batches: a max-batch probe
    there is measured at k, so the search's total stays non-decreasing."""
    m = Method("torch accumulate(4)", "pytorch", True, {"torch": "accumulate", "arg": 4})
    assert micro_batches(m) == 4
    assert micro_batches(Method("c", "leangrad", True, {"engine": "checkpoint"})) == 1
    at = {b: footprint("gpt", GPT, m, b, estimate=True) for b in (1, 4, 5)}
    assert at[1] == at[4] and at[4].total < at[5].total


def test_headline_picks_an_accumulate_row_as_pytorchs_best() -> None:
    """Accumulation rows are exact PyTorch-side rows: the headline's PyTorch column may pick
    one, and the per-model table shows them."""

    def rec(engine: str, side: str, peak: float, time: float, **kw: Any) -> dict[str, Any]:
        return {"series": "m", "engine": engine, "side": side, "peak_ratio": peak,
                "time_ratio": time, "exact": True, "estimate": False, "peak_bytes": 2**20,
                "config": {"model": "m"}, **kw}  # fmt: skip

    rs = [
        rec("backprop", "reference", 1.0, 1.0),
        rec("torch per-block", "pytorch", 0.45, 1.3),
        rec("torch accumulate(4)", "pytorch", 0.3, 1.05),
        rec("torch accumulate(4) + per-block", "pytorch", 0.1, 1.4),
    ]
    assert best_within(rs, "m", PYTORCH_SIDES, 0.5)["engine"] == "torch accumulate(4)"  # type: ignore[index]
    assert best_within(rs, "m", PYTORCH_SIDES, 0.25)["engine"] == (  # type: ignore[index]
        "torch accumulate(4) + per-block"
    )
    assert "torch accumulate(4) (0.30×) | 1.05×" in headline_table(rs)
    assert "| torch accumulate(4) + per-block | pytorch | yes |" in "\n".join(
        render("zoo", rs, None)
    )


@pytest.mark.slow
def test_suite_run_records_and_renders_accumulation_rows() -> None:
    """The runner on a tiny GPT with only backprop and the accumulation rows (no plans, no
    compile): each is measured, exact, timed for the whole batch and in the report."""
    suite = load_suite("zoo")
    assert suite.setting("micro_batches", True) and suite.setting("micro_batches", False)
    keep = {"backprop", "accumulate", "checkpoint+accumulate"}
    from leangrad_bench._zoo_methods import engine_names

    settings = {
        **suite.settings,
        "quick_models": {"gpt": GPT},
        "quick_estimate_models": {},
        "quick_compile_models": [],
        "quick_repeats": 1,
        "quick_fractions": [],
        "quick_segments": [],
        "quick_micro_batches": [2, 3],
        "quick_forward_max_params": 0,
        "quick_skip": {n: "not in this test" for n in engine_names() if n not in keep},
    }
    quiet = RunSettings(quick=True, progress=False)
    records = run_zoo(dataclasses.replace(suite, settings=settings), quiet)
    got = {r["engine"]: r for r in records if "accumulate" in r["engine"]}
    assert set(got) == {
        "torch accumulate(2)", "torch accumulate(3)", "torch accumulate(2) + per-block",
        "torch accumulate(3) + per-block", "accumulate(micro_batches=2)",
        "accumulate(micro_batches=3)", "checkpoint+accumulate(micro_batches=2)",
        "checkpoint+accumulate(micro_batches=3)",
    }  # fmt: skip
    for label, r in got.items():
        assert not r.get("skipped") and not r.get("failed"), label
        assert r["exact"] and r["grad_max_rel_err"] < 1e-5, label
        assert r["peak_ratio"] < 1 and r["time_ratio"] > 0 and r["max_batch"] >= GPT["batch"]
        assert r["side"] == ("pytorch" if label.startswith("torch") else "leangrad")
    text = "\n".join(render("zoo", records, None))
    assert all(f"| {label} |" in text for label in got)
