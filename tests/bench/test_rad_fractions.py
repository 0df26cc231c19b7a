"""rad-fractions: fraction 1.0 is backprop bit for bit, fraction 0.2 is unbiased,
and the suite (and rad-convergence) record per-seed curves with median/band summaries."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leangrad import data
from leangrad.measure import estimator_stats
from leangrad_bench import _rad
from leangrad_bench._models import rad_network
from leangrad_bench._suites import RunSettings, Suite, load_suite

# Unbiasedness tolerance, as tests/rad/test_layers.py: for an unbiased estimator each
# coordinate's z = (mean - exact) / (sd / sqrt(N)) is ~ N(0, 1) for large N, so the mean of
# z^2 over coordinates is ~1; accept 0.3 < mean z^2 < 1.6, and |z| below 6.5 (Bonferroni at
# 1e-3 family-wise error over the ~200k coordinates of the MLP is ~5.5; rounded up for the
# t-tails at N = 400). The power check shows a 5% bias is rejected by the same test.
Z2_LOW, Z2_HIGH, Z_MAX = 0.3, 1.6, 6.5
DRAWS = 400


def _tiny(name: str, **settings: object) -> Suite:
    suite = load_suite(name)
    return dataclasses.replace(suite, settings={**suite.settings, **settings})


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_fraction_one_without_replacement_is_backprop_bit_for_bit(kind: str) -> None:
    """The suite's models at MNIST size, float32, batch 150: every gradient torch.equal."""
    torch.manual_seed(0)
    base = rad_network(kind)
    x, y = torch.rand(150, 1, 28, 28), torch.randint(10, (150,))
    ref = _grads(copy.deepcopy(base), x, y)
    got = _grads(_rad.randomized(base, 1.0, "different", 1, replace=False), x, y)
    assert got.keys() == ref.keys() and len(ref) == len(list(base.parameters()))
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    check = _rad.fraction_one_check(base, x, y, mode="different", seed=1)
    assert check["grads_equal"] and check["grad_max_abs_diff"] == 0.0
    below = _grads(_rad.randomized(base, 0.9, "different", 1), x, y)  # the check can fail
    assert not all(torch.equal(below[n], ref[n]) for n in ref)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_fraction_point_two_is_unbiased(kind: str) -> None:
    """RAD 0.2 "different" without replacement (the suite's estimator), float64, at fixed
    weights and batch: the mean over 400 draws matches backprop's gradient (z-test above);
    the same test rejects a reference 5% off."""
    torch.manual_seed(4)
    base = rad_network(kind, side=8).double()
    x, y = torch.rand(16, 1, 8, 8, dtype=torch.float64), torch.randint(10, (16,))
    ref = _grads(copy.deepcopy(base), x, y)
    model = _rad.randomized(base, 0.2, "different", 5)
    st = estimator_stats(lambda: _grads(model, x, y), ref, draws=DRAWS)
    assert Z2_LOW < st.z_mean_square < Z2_HIGH, st
    assert st.max_abs_z < Z_MAX, st
    assert st.mean_cosine < 0.999  # the estimator really is random
    biased = {n: 1.05 * g for n, g in ref.items()}
    st_b = estimator_stats(lambda: _grads(model, x, y), biased, draws=DRAWS)
    assert st_b.z_mean_square > Z2_HIGH, st_b


def test_bootstrap_resamples_with_replacement_per_seed() -> None:
    train = data.load("digits").split(0.8, seed=0)[0]
    a, b = _rad.Replicate(0).bootstrap(train), _rad.Replicate(1).bootstrap(train)
    assert len(a) == len(b) == len(train)
    assert len(torch.unique(a.x.reshape(len(a), -1), dim=0)) < len(train)  # duplicates
    assert not torch.equal(a.y, b.y)
    assert torch.equal(a.y, _rad.Replicate(0).bootstrap(train).y)  # seeded


def _band_fields_ok(bands: list[dict[str, Any]], seeds: int) -> None:
    assert bands and all(r["band"] == _rad.BAND == "min-max" for r in bands)
    for r in bands:
        assert r["n_seeds"] == len(r["seeds"]) == seeds >= 5
        for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
            lo, mid, hi = (r[f"{key}_{s}"] for s in ("min", "median", "max"))
            assert lo <= mid <= hi


@pytest.mark.slow  # a suite run end to end: make test-slow
def test_suite_end_to_end_records_per_seed_curves_and_bands(tmp_path: Path) -> None:
    suite = _tiny(
        "rad-fractions", dataset="digits", fractions=[0.2, 1.0],
        runs=[{"model": "mlp", "steps": 3, "eval_every": 1, "lr": 1e-3},
              {"model": "cnn", "steps": 2, "eval_every": 2, "lr": 1e-3}],
    )  # fmt: skip
    recs = _rad.run_fractions(suite, RunSettings(quick=False, progress=False))
    per_seed = [r for r in recs if r["kind"] == "rad-training"]
    bands = [r for r in recs if r["kind"] == "rad-band"]
    seeds = sorted({r["seed"] for r in per_seed})
    assert seeds == [0, 1, 2, 3, 4]
    labels = ["baseline", "RAD 0.2 different", "RAD 1.0 different"]
    assert list(dict.fromkeys(r["engine"] for r in per_seed)) == labels
    # per-seed curves kept: every lane, seed and evaluated step (mlp 0..3, cnn 0, 2)
    assert len(per_seed) == 3 * 5 * (4 + 2)
    _band_fields_ok(bands, 5)
    assert len(bands) == 3 * (4 + 2)
    finals = _rad.final_bands([b for b in bands if b["series"] == "mlp"])
    assert all(r["step_seconds_min"] <= r["step_seconds_median"] <= r["step_seconds_max"]
               for r in finals.values())  # fmt: skip
    # same initialisation within a seed (RAD's forward is exact), different across seeds
    start = {(r["seed"], r["engine"]): r["train_loss"] for r in per_seed
             if r["series"] == "mlp" and r["x"] == 0}  # fmt: skip
    assert all(start[(s, lb)] == start[(s, "baseline")] for s in seeds for lb in labels)
    assert len({start[(s, "baseline")] for s in seeds}) == 5
    # RAD 0.2 saves memory; 1.0 keeps what backprop keeps
    saved = {b["engine"]: b["saved_bytes"] for b in finals.values()}
    assert saved["RAD 0.2 different"] < 0.5 * saved["baseline"]
    ones = [r for r in recs if r["kind"] == "rad-fraction-one"]
    assert [r["model"] for r in ones] == ["mlp", "cnn"]
    for r in ones:
        assert len(r["per_seed"]) == 5
        assert r["grads_equal"] and r["grads_equal_with_replacement"]
        assert r["curves_identical"] and r["weights_equal_at_end"]
    lines = _rad.render("rad-fractions", recs, tmp_path, plots=True)
    assert (tmp_path / "plots" / "rad-fractions-mlp.png").exists()
    assert (tmp_path / "plots" / "rad-fractions-cnn.png").exists()
    assert any(line.startswith("| RAD 0.2 different |") for line in lines)
    assert any(line.startswith("| mlp | 5 | yes |") for line in lines)


def test_convergence_records_bands_over_five_seeds(tmp_path: Path) -> None:
    suite = _tiny(
        "rad-convergence", dataset="digits", modes=["different"],
        runs=[{"model": "mlp", "steps": 2, "eval_every": 1, "lr": 1e-3}],
    )  # fmt: skip
    recs = _rad.run_convergence(suite, RunSettings(quick=False, progress=False))
    per_seed = [r for r in recs if r["kind"] == "rad-training"]
    bands = [r for r in recs if r["kind"] == "rad-band"]
    assert sorted({r["seed"] for r in per_seed}) == [0, 1, 2, 3, 4]
    assert len(per_seed) == 3 * 5 * 3 and len(bands) == 3 * 3
    _band_fields_ok(bands, 5)
    lines = _rad.render("rad-convergence", recs, tmp_path, plots=True)
    assert (tmp_path / "plots" / "rad-convergence-mlp.png").exists()
    assert any("min–max over the seeds" in line for line in lines)
