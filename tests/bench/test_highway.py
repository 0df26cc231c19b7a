"""Tests of the highway-* suites on tiny sizes: the records they write, what the report
renders from them, and the stdlib character corpus. (No time is asserted.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from leangrad_bench._highway import run_convergence, run_rnn, run_train
from leangrad_bench._highway_paper import char_corpus
from leangrad_bench._highway_report import render
from leangrad_bench._suites import RunSettings, load_suite


def _tiny(name: str, **settings: object):  # type: ignore[no-untyped-def]
    suite = load_suite(name)
    series = [
        dataclasses.replace(s, quick_values=[s.quick_values[0] if name != "highway-rnn" else 8],
                            config={**s.config, "hidden": 8, "corpus_chars": 5000})
        for s in suite.series
    ]  # fmt: skip
    if name != "highway-rnn":
        series = [dataclasses.replace(s, quick_values=[12 if "char" in s.name else 2])
                  for s in series]  # fmt: skip
    return dataclasses.replace(suite, series=series, settings={**suite.settings, **settings})


def test_char_corpus_reads_the_standard_library() -> None:
    ids, vocab = char_corpus(3000, vocab=40)
    assert len(ids) == 3000 and vocab == 40
    assert int(ids.min()) >= 0 and int(ids.max()) < 40
    assert len(set(ids.tolist())) > 20  # real text, not one repeated symbol


@pytest.mark.slow  # a suite run end to end: make test-slow
def test_rnn_suite_records_and_report(tmp_path: Path) -> None:
    suite = _tiny("highway-rnn", hidden=8, batch=2, vocab=11, ks=[0, 7], quick_repeats=1)
    recs = run_rnn(suite, RunSettings(quick=True, progress=False, threads=[1, 2]))
    steps = [r for r in recs if r["kind"] == "highway-rnn"]
    labels = {r["engine"] for r in steps}
    assert {"bptt", "nn.GRU", "nn.LSTM", "highway(k=0)", "highway(k=7)", "fpi(k=2)"} <= labels
    for r in steps:
        assert r["peak_bytes"] > 0 and r["seconds_median"] > 0
        assert r["forward_seconds"] > 0 and r["config"]["length"] == 8
        assert [e["threads"] for e in r["by_threads"]] == [1, 2]  # side by side in one run
        assert r["by_threads"][0]["step_speedup"] == r["step_speedup"]
        assert all(e["step_speedup"] > 0 for e in r["by_threads"])
    # nn.GRU/nn.LSTM compared under their own parameter names (TorchLM.renamed)
    exact = [r for r in steps if r["engine"] in ("bptt", "highway(k=7)", "nn.GRU", "nn.LSTM")]
    assert len(exact) == 6
    assert all(r["grad_max_rel_err"] < 1e-5 and r["grad_cosine"] > 1 - 1e-9 for r in exact)
    assert {r["engine"] for r in recs if r["kind"] == "scan"} == {"parallel", "sequential"}
    text = "\n".join(render("highway-rnn", recs, tmp_path, plots=False))
    assert "| gru | 8 | highway(k=0) |" in text and "CumSumProd" in text
    assert "| step speedup | step speedup (2 thr) |" in text


@pytest.mark.slow
@pytest.mark.parametrize("runner", [run_train, run_convergence])
def test_training_suites_records_and_report(runner, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    name = "highway-train" if runner is run_train else "highway-convergence"
    suite = _tiny(name, quick_steps=2, quick_eval_every=1, ks=[0, 1], points=[0, 1])
    recs = runner(suite, RunSettings(quick=True, progress=False))
    assert {r["series"] for r in recs} == {"char-gru", "preact-resnet"}
    if runner is run_train:
        labels = {r["engine"] for r in recs}
        assert {"backprop", "fpi(k=2)", "highway(k=0)", "highway(k=0->5)"} <= labels
        assert all(r["val_loss"] > 0 for r in recs)
        assert max(r["x"] for r in recs) == 2
    else:
        assert {(r["engine"], r["k"]) for r in recs} == {
            (b, k) for b in ("highway", "fpi") for k in (0, 1)
        }
        assert all(-1 <= r["grad_cosine"] <= 1 + 1e-9 for r in recs)
    text = "\n".join(render(name, recs, tmp_path, plots=True))
    assert "### char-gru" in text and "### preact-resnet" in text
    if runner is run_train:  # one table per series; test accuracy where measured (digits)
        digits = text.split("### preact-resnet")[1].splitlines()
        header = next(line for line in digits if line.startswith("| method |"))
        assert "| held-out loss | vs backprop | test acc | training s |" in header
        row = next(line for line in digits if line.startswith("| highway(k=0) |"))
        assert row.count("|") == header.count("|")
    assert any(p.suffix == ".png" for p in (tmp_path / "plots").iterdir())
