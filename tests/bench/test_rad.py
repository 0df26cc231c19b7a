"""rad-* suites: tiny runs of each runner produce the records the renderer reads."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from leangrad_bench import _rad, _rad_paper
from leangrad_bench._models import rad_network
from leangrad_bench._suites import RunSettings, load_suite


def _tiny(name: str, **settings: object) -> object:
    suite = load_suite(name)
    return dataclasses.replace(suite, settings={**suite.settings, **settings})


def test_suites_load_and_name_their_runner_and_renderer() -> None:
    """The MNIST suites run from _rad, the paper-only ones (PDE, official peer) from
    _rad_paper."""
    for name, module, fn, report in (
        ("rad-variance", _rad, "run_variance", _rad.render),
        ("rad-convergence", _rad, "run_convergence", _rad.render),
        ("rad-fractions", _rad, "run_fractions", _rad.render),
        ("rad-pde", _rad_paper, "run_pde", _rad_paper.render_pde),
        ("rad-peer", _rad_paper, "run_peer", _rad_paper.render_peer),
    ):
        suite = load_suite(name)
        assert suite.runner == f"{module.__name__}:{fn}"
        assert suite.resolve_runner() is getattr(module, fn)
        assert suite.resolve_report() is report


def test_variance_runner_measures_memory_and_mse(tmp_path: Path) -> None:
    suite = _tiny(
        "rad-variance", dataset="digits", models=["mlp", "cnn"], draws=2, pretrain_steps=0,
        estimators=[{"batch": 150}, {"batch": 150, "fraction": 0.1}],
    )  # fmt: skip
    recs = _rad.run_variance(suite, RunSettings(quick=False, progress=False))  # type: ignore[arg-type]
    assert [r["engine"] for r in recs] == ["batch 150", "RAD 0.1 different"] * 2
    assert recs[1]["saved_bytes"] <= 0.15 * recs[0]["saved_bytes"]
    assert recs[3]["saved_bytes"] <= 0.15 * recs[2]["saved_bytes"]
    assert all(r["grad_mse"] > 0 for r in recs)
    lines = _rad.render("rad-variance", recs, tmp_path, plots=False)
    assert any("RAD 0.1 different" in line for line in lines)


def test_convergence_runner_matches_memory(tmp_path: Path) -> None:
    suite = _tiny(
        "rad-convergence", dataset="digits", modes=["different"],
        runs=[{"model": "irnn", "steps": 2, "eval_every": 1, "lr": 1e-3}],
    )  # fmt: skip
    recs = _rad.run_convergence(suite, RunSettings(quick=False, progress=False))  # type: ignore[arg-type]
    labels = list(dict.fromkeys(r["engine"] for r in recs))
    assert labels[:2] == ["baseline", "RAD 0.1 different"]
    assert labels[2].startswith("reduced batch ")
    rad_saved = next(r["saved_bytes"] for r in recs if r["engine"] == labels[1])
    red = next(r for r in recs if r["engine"] == labels[2])
    assert red["saved_bytes"] <= rad_saved  # the largest batch at or under RAD's bytes
    assert red["config"]["equal_memory_target_bytes"] == rad_saved
    lines = _rad.render("rad-convergence", recs, tmp_path, plots=True)
    assert (tmp_path / "plots" / "rad-convergence-irnn.png").exists()
    assert any(labels[2] in line for line in lines)


def test_pde_runner(tmp_path: Path) -> None:
    suite = _tiny("rad-pde", n=5, steps=24, t_end=0.25, iterations=2, fractions=[1.0, 0.1],
                  seeds=3)  # fmt: skip
    recs = _rad_paper.run_pde(suite, RunSettings(quick=False, progress=False))  # type: ignore[arg-type]
    runs = [r for r in recs if r["kind"] == "rad-pde"]
    exact = [r for r in runs if r["engine"] == "exact"]
    randomized = [r for r in runs if r["engine"] == "RAD 0.1"]
    assert len(exact) == 3 and len(randomized) == 3 * 3  # the exact lane once, RAD per seed
    assert sorted({r["seed"] for r in randomized}) == [0, 1, 2]
    assert randomized[0]["saved_bytes"] < 0.3 * exact[0]["saved_bytes"]
    final = {r["seed"]: r["train_loss"] for r in randomized if r["x"] == 2}
    assert len(set(final.values())) == 3, "each replicate draws its own samples"
    band = next(r for r in recs if r["kind"] == "rad-pde-band" and r["engine"] == "RAD 0.1"
                and r["x"] == 2)  # fmt: skip
    assert band["n_seeds"] == 3 and band["seeds"] == [0, 1, 2]
    assert band["train_loss_min"] == min(final.values())
    assert band["train_loss_max"] == max(final.values())
    assert band["train_loss_min"] <= band["train_loss_median"] <= band["train_loss_max"]
    lines = _rad_paper.render_pde("rad-pde", recs, tmp_path, plots=True)
    assert (tmp_path / "plots" / "rad-pde-reaction-diffusion.png").exists()
    assert any("| RAD 0.1 |" in line and "[" in line for line in lines)


@pytest.mark.slow
def test_peer_suite_rows_crossover_and_report(monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Without the official code its row is skipped, saying how to get it; the crossover is
    the first batch where RAD's tracker peak is below backprop's (checked against a scan)."""
    monkeypatch.delenv(_rad_paper.OFFICIAL_ENV, raising=False)
    cfg = {"model": "mlp", "fraction": 0.1, "batch": 40}
    suite = _tiny("rad-peer", dataset="digits", batch=40, draws=2, repeats=1, largest_batch=96,
                  crossover=[cfg])  # fmt: skip
    recs = _rad_paper.run_peer(suite, RunSettings(quick=False, progress=False))  # type: ignore[arg-type]
    peers = [r for r in recs if r["kind"] == "rad-peer" and not r.get("skipped")]
    assert {r["engine"] for r in peers} == {"backprop", "rad", "rad (with replacement)"}
    assert {r["threads"] for r in peers} == {1, os.cpu_count() or 1}
    assert all(r["config"]["threads"] == r["threads"] for r in peers)
    assert all(r["saved_bytes"] > 0 and r["peak_bytes"] > 0 and r["grad_mse"] > 0 for r in peers)
    by = {r["engine"]: r for r in peers if r["threads"] == 1}
    assert by["rad"]["saved_bytes"] < 0.2 * by["backprop"]["saved_bytes"]
    skipped = [r for r in recs if r.get("skipped")]
    assert [r["engine"] for r in skipped] == ["official"]
    assert _rad_paper.OFFICIAL_ENV in skipped[0]["skipped"]
    (cross,) = [r for r in recs if r["kind"] == "rad-crossover"]
    b = cross["crossover_batch"]
    assert b is not None and 1 <= b <= 96 and cross["peak_ratio_at_crossover"] < 1
    if b > 1:  # the batch before does not pay: the bisection found the boundary
        import copy

        import torch

        from leangrad import data, rad

        train = data.load("digits").split(0.8, seed=0)[0]
        torch.manual_seed(0)
        base = rad_network("mlp", side=8)
        model = copy.deepcopy(base)
        rad.randomize(model, fraction=0.1, seed=1)
        x, y = train.x[: b - 1], train.y[: b - 1]
        mine, theirs = (_rad_paper._memory(m, x, y)["peak_bytes"] for m in (model, base))
        assert mine >= theirs
    lines = _rad_paper.render_peer("rad-peer", recs, tmp_path, plots=False)
    assert any("| 1 | rad |" in line for line in lines) and any("| mlp |" in x for x in lines)
