"""Training suites (moonwalk-v1-stability, moonwalk-v2-constrained): tiny runs of their runners."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from leangrad_bench import RECORD_FIELDS, RunSettings, Suite, load_suite, render_report
from leangrad_bench._run import write_records
from leangrad_bench._training import run_constrained, run_stability

TRAINING_FIELDS = ("kind", "series", "sweep", "x", "train_loss", "train_acc", "test_acc")


def _tiny(suite: Suite, values: list[Any], **settings: Any) -> Suite:
    series = [dataclasses.replace(s, quick_values=values) for s in suite.series]
    return dataclasses.replace(suite, series=series, settings={**suite.settings, **settings})


def _check_schema(records: list[dict[str, Any]], sweep: str) -> None:
    assert records
    for r in records:
        assert set(RECORD_FIELDS) <= set(r)
        assert set(TRAINING_FIELDS) <= set(r)
        assert r["kind"] == "training" and r["sweep"] == sweep
        assert r["failed"] is None
        assert math.isfinite(r["train_loss"]) and 0.0 <= r["train_acc"] <= 1.0
        assert 0.0 <= r["test_acc"] <= 1.0
    json.dumps(records)  # JSON-serialisable as written by the CLI


def test_suites_parse_and_name_their_runners() -> None:
    for name, fn in (
        ("moonwalk-v1-stability", run_stability),
        ("moonwalk-v2-constrained", run_constrained),
    ):
        suite = load_suite(name)
        assert suite.runner is not None and suite.resolve_runner() is fn
        assert suite.series and suite.description


@pytest.fixture(scope="module")
def stability_records() -> list[dict[str, Any]]:
    suite = _tiny(load_suite("moonwalk-v1-stability"), [1], quick_steps=4, quick_eval_every=2)
    return run_stability(suite, RunSettings(quick=True, progress=False))


def test_stability_records_and_gradient_errors(stability_records: list[dict[str, Any]]) -> None:
    recs = stability_records
    _check_schema(recs, "step")
    engines = {r["engine"] for r in recs}
    assert engines == {"backprop", "revbackprop", "moonwalk"}
    assert {r["x"] for r in recs} == {0, 2, 4}
    assert {r["series"] for r in recs} == {"revnet-tanh-depth1", "revnet-tanh-out-depth1"}
    for r in recs:
        assert r["grad_max_rel_err"] is not None and r["grad_cosine"] > 0.999
    for r in recs:
        if r["x"] == 0:  # same weights, same batch: float32 against the float64 oracle
            assert r["param_dist_to_backprop"] == 0.0
            if r["engine"] in ("backprop", "moonwalk"):
                assert r["grad_max_rel_err"] <= 1e-4


def test_constrained_records(tmp_path: Path) -> None:
    suite = _tiny(
        load_suite("moonwalk-v2-constrained"),
        [2],
        quick_epochs=1,
        train_limit=64,
        batch=32,
        dataset="digits",
        size=8,
    )
    recs = run_constrained(suite, RunSettings(quick=True, progress=False))
    _check_schema(recs, "epoch")
    assert {(r["model"], r["x"]) for r in recs} == {
        (m, e) for m in ("constrained", "unconstrained") for e in (0, 1)
    }
    for r in recs:
        # One line per model in the report: the label carries the model and the engine.
        assert r["engine"] == f"{r['model']} (backprop)" and r["grad_max_rel_err"] is None


def test_report_renders_training_records(
    tmp_path: Path, stability_records: list[dict[str, Any]]
) -> None:
    quick = [{**r, "quick": True} for r in stability_records]  # as run_suite stamps them
    write_records(quick, tmp_path / "moonwalk-v1-stability.json")
    text = render_report(tmp_path).read_text()
    assert "## moonwalk-v1-stability (quick)" in text
    assert "### revnet-tanh-depth1" in text and "| moonwalk | 4 |" in text
    png = tmp_path / "plots" / "moonwalk-v1-stability-revnet-tanh-depth1.png"
    assert png.stat().st_size > 1000
