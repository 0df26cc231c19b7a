"""Bench layer: workloads, the per-config runner, suites, the report and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from leangrad import UnknownNameError
from leangrad._errors import LeangradError
from leangrad.cli import main
from leangrad_bench import (
    RECORD_FIELDS,
    EngineSpec,
    build,
    list_suites,
    load_suite,
    measure_config,
    render_report,
    run_suite,
    timing_threads,
)

TINY = {"model": "mlp", "in_features": 8, "width": 8, "depth": 2, "batch": 16, "classes": 3}

TINY_SUITE = """
description = "a tiny suite for the tests"
reference = "backprop"
sweep = "depth"
[settings]
repeats = 2
quick_repeats = 1
[[engines]]
name = "backprop"
[[engines]]
name = "checkpoint"
options = { segments = "sqrt" }
[[engines]]
name = "forward"
max_params = 200
[[series]]
name = "mlp"
values = [1, 2, 3]
quick_values = [1, 3]
config = { model = "mlp", in_features = 8, width = 8, batch = 16, classes = 3 }
"""


def test_build_is_deterministic_and_dtype_independent() -> None:
    a, b = build(TINY), build({**TINY, "dtype": "float64"})
    torch.testing.assert_close(a.inputs[0].double(), b.inputs[0])
    assert torch.equal(a.targets, b.targets)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa.double(), pb)


def test_build_rejects_unknown_model_and_dtype() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown model 'nope'; known models: mlp, conv"):
        build({"model": "nope"})
    with pytest.raises(UnknownNameError, match=r"unknown dtype 'float8'"):
        build({**TINY, "dtype": "float8"})


@pytest.mark.slow
def test_measure_config_records_have_the_schema() -> None:
    specs = [
        EngineSpec("backprop"),
        EngineSpec("checkpoint", {"segments": 2}),
        EngineSpec("forward", max_params=10),  # TINY has more: skipped with a reason
    ]
    recs = measure_config(TINY, specs, repeats=2, rss=True)
    assert [r["engine"] for r in recs] == ["backprop", "checkpoint(segments=2)", "forward"]
    for r in recs:
        assert set(RECORD_FIELDS) <= set(r)
    bp, ck, fw = recs
    assert bp["time_ratio"] == 1.0
    for r in (bp, ck):
        assert r["grad_max_rel_err"] < 1e-5  # float32 against the float64 oracle
        assert r["grad_cosine"] > 1 - 1e-9
        assert r["peak_bytes"] > 0 and r["saved_bytes"] > 0
        assert r["seconds_min"] <= r["seconds_median"] <= r["seconds_max"]
        assert r["rss_peak_bytes"] is not None
    # Checkpointing two segments keeps less for the backward pass than backprop.
    assert ck["saved_bytes"] < bp["saved_bytes"]
    assert "max_params 10" in fw["skipped"]
    assert all(fw[k] is None for k in RECORD_FIELDS if k not in ("engine", "config"))


def test_suite_listing_and_unknown_suite() -> None:
    suites = list_suites()
    assert "baselines" in suites
    suite = load_suite("baselines")
    assert {s.name for s in suite.series} >= {"mlp", "conv"}
    assert all(e.display for e in suite.engines)
    with pytest.raises(UnknownNameError, match=r"unknown suite 'nope'; known suites: .*baselines"):
        load_suite("nope")


def test_series_naming_an_unknown_engine_label_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(TINY_SUITE.replace('name = "mlp"\n', 'name = "mlp"\nengines = ["nope"]\n'))
    suite = load_suite(str(path))
    with pytest.raises(ValueError, match=r"unknown engine labels \['nope'\]"):
        suite.engines_for(suite.series[0])


def test_run_suite_then_report(tmp_path: Path) -> None:
    suite_file = tmp_path / "tiny.toml"
    suite_file.write_text(TINY_SUITE)
    out = tmp_path / "results"
    path = run_suite(str(suite_file), out=out, quick=True, rss=False, progress=False)
    assert path == out / "tiny.json"
    records = json.loads(path.read_text())
    assert isinstance(records, list)
    assert {(r["engine"], r["x"]) for r in records} == {
        (e, x) for e in ("backprop", "checkpoint(segments=sqrt)", "forward") for x in (1, 3)
    }
    for r in records:
        assert set(RECORD_FIELDS) <= set(r)
        assert r["suite"] == "tiny" and r["quick"] is True and "torch" in r["machine"]
        assert r["threads"] == 1  # the sweep's timings: time_interleaved's one thread
    # Depth 3 has more than 200 parameters: forward is skipped there, not at depth 1.
    skipped = {r["x"] for r in records if r["engine"] == "forward" and r["skipped"]}
    assert skipped == {3}
    report = render_report(out)
    text = report.read_text()
    assert "## tiny (quick)" in text and "| backprop | 1 |" in text
    assert "skipped:" in text
    assert (out / "plots" / "tiny-mlp.png").stat().st_size > 1000


@pytest.mark.slow  # a sweep over thread counts: make test-slow
def test_a_sweep_times_every_thread_count_side_by_side(tmp_path: Path) -> None:
    """``threads`` times each step at every count in one run: a record's own time fields are
    the first count's, ``by_threads`` has each count's (ratios at that count), and the
    report adds a column per further count and dashed lines to the plot."""
    suite_file = tmp_path / "tiny.toml"
    three = 'quick_repeats = 1\nthreads = [1, "cores", 3]'
    suite_file.write_text(TINY_SUITE.replace("quick_repeats = 1", three))
    counts = timing_threads(load_suite(str(suite_file)), quick=True)
    assert counts == list(dict.fromkeys([1, os.cpu_count() or 1, 3]))  # a repeat is dropped
    assert timing_threads(load_suite(str(suite_file)), threads=[2]) == [2]  # --threads wins
    out = tmp_path / "results"
    path = run_suite(str(suite_file), out=out, quick=True, rss=False, progress=False,
                     threads=[1, 2])  # fmt: skip
    timed = [r for r in json.loads(path.read_text()) if not r["skipped"]]
    assert timed
    for r in timed:
        assert r["threads"] == 1 and [e["threads"] for e in r["by_threads"]] == [1, 2]
        assert r["by_threads"][0]["seconds_median"] == r["seconds_median"]
        assert all(e["seconds_median"] > 0 for e in r["by_threads"])
        if r["engine"] == "backprop":
            assert [e["time_ratio"] for e in r["by_threads"]] == [1.0, 1.0]
    text = render_report(out).read_text()
    assert "| time ratio (1 thr) | time ratio (2 thr) |" in text
    row = next(line for line in text.splitlines() if line.startswith("| backprop | 1 |"))
    header = next(line for line in text.splitlines() if line.startswith("| engine |"))
    assert row.count("|") == header.count("|")  # a cell for every column


def test_a_bad_threads_setting_or_a_one_count_runner_is_refused(tmp_path: Path) -> None:
    suite_file = tmp_path / "tiny.toml"
    suite_file.write_text(TINY_SUITE.replace("quick_repeats = 1", "quick_repeats = 1\nthreads = 2"))
    with pytest.raises(LeangradError, match=r"setting threads = 2 is not a list of thread"):
        timing_threads(load_suite(str(suite_file)))
    assert timing_threads(load_suite("rad-variance")) == [1]
    with pytest.raises(LeangradError, match="'rad-variance' times at one thread count"):
        timing_threads(load_suite("rad-variance"), threads=[1, 2])
    cores = os.cpu_count() or 1
    for name in ("baselines", "moonwalk-v1-revnet", "moonwalk-v2-cnn", "fad", "highway-rnn",
                 "rad-peer"):  # the headline suites time at 1 thread and the core count
        assert timing_threads(load_suite(name)) == list(dict.fromkeys([1, cores])), name


RUNNERS = '''
from leangrad_bench._suites import runner

SEEN = []


@runner(threads=True, only=True)
def declared(suite, settings):
    SEEN.append(settings)
    settings.save([{"series": "saved"}])
    if settings.only == ["stop"]:
        raise RuntimeError("stopped part-way")
    return [{"series": name} for name in settings.only or ["all"]]


def plain(suite, settings):
    SEEN.append(settings)
    return [{"series": "plain"}]
'''


def test_a_runner_gets_one_run_settings_with_what_it_declared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--threads`` and ``--only`` reach a runner declared to take them (its ``save`` writes
    the file); a runner declared with nothing is refused both, and gets neither."""
    (tmp_path / "h8_fake_runners.py").write_text(RUNNERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from h8_fake_runners import SEEN  # type: ignore[import-not-found]

    for fn in ("declared", "plain"):
        (tmp_path / f"{fn}.toml").write_text(f'runner = "h8_fake_runners:{fn}"\n')
    out = tmp_path / "out"
    path = run_suite(str(tmp_path / "declared.toml"), out=out, quick=True, progress=False,
                     threads=[1, 2], only=["a"], device="meta")  # fmt: skip
    (got,) = SEEN
    assert (got.quick, got.device, got.progress, got.threads, got.only) == (
        True, "meta", False, [1, 2], ["a"])  # fmt: skip
    assert [r["series"] for r in json.loads(path.read_text())] == ["a"]
    with pytest.raises(RuntimeError, match="stopped part-way"):  # what it saved stays
        run_suite(str(tmp_path / "declared.toml"), out=out, quick=True, progress=False,
                  only=["stop"])  # fmt: skip
    saved = json.loads(path.read_text())
    assert [r["series"] for r in saved] == ["a", "saved"]
    for r in saved:  # run_suite stamps what a runner returns and what it saves alike
        assert r["suite"] == "declared" and r["quick"] is True and "torch" in r["machine"]
        assert r["created"] and r["threads"] == 1
    assert timing_threads(load_suite(str(tmp_path / "plain.toml"))) == [1]
    with pytest.raises(LeangradError, match="'plain' times at one thread count"):
        run_suite(str(tmp_path / "plain.toml"), out=out, threads=[1, 2], progress=False)
    with pytest.raises(LeangradError, match="'plain' runs all of its series at once"):
        run_suite(str(tmp_path / "plain.toml"), out=out, only=["a"], progress=False)
    assert len(SEEN) == 2
    run_suite(str(tmp_path / "plain.toml"), out=out, quick=True, progress=False)
    assert SEEN[-1].threads is None and SEEN[-1].only is None and SEEN[-1].quick is True


def test_report_of_an_empty_directory_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(LeangradError, match="run `leangrad bench SUITE --out DIR` first"):
        render_report(tmp_path)


def test_cli_list_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    assert "baselines" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2


@pytest.mark.slow
def test_cli_demo_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from leangrad_bench import _demo

    small = {k: {**v, "batch": 16, "channels": 4} for k, v in _demo.DEMO_CONFIGS.items()}
    small["mlp"]["width"] = 8
    monkeypatch.setattr(_demo, "DEMO_CONFIGS", small)
    from leangrad_bench import _demo_headline as H

    monkeypatch.setattr(H, "DEPTH_CONFIG", {**H.DEPTH_CONFIG, "length": 32, "channels": 8})
    monkeypatch.setattr(H, "DEPTH_BUDGET", 200_000)
    monkeypatch.setattr(H, "DEPTH_MAX", 16)
    # fewer, narrower layers; as many tokens, so the logits still dominate the step
    monkeypatch.setattr(H, "PLAN_SIZE", {**H.PLAN_SIZE, "dim": 32, "layers": 2})
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--repeats", "1", "--no-progress"]) == 0
    text = capsys.readouterr().out
    table = [ln for ln in text.splitlines()[1:] if not ln.startswith("wrote ")]  # paths: tmp
    assert all(len(line) <= 100 for line in table), "fits 100 columns"
    assert "Deepest fragmental 1D CNN each engine trains in" in text
    assert "of its memory: backprop needs" in text and "leangrad.plan chose" in text
    header = next(line for line in text.splitlines() if line.startswith("model "))
    for col in ("engine", "peak", "saved", "time ratio", "max rel err", "cosine"):
        assert col in header
    for engine in ("backprop", "checkpoint(per-block)", "forward", "projforward", "moonwalk",
                   "revbackprop"):  # fmt: skip
        assert engine in text
    assert text.index("leangrad.plan chose") < text.index("Deepest fragmental 1D CNN")
    every = json.loads((out / "demo.json").read_text())
    depth = {r["engine"]: r["max_depth"] for r in every if r.get("kind") == "depth_at_budget"}
    assert set(depth) == {"backprop", "checkpoint", "moonwalk", "moonwalk B=4", "moonwalk B=16"}
    assert depth["backprop"] >= 1 and depth["moonwalk B=16"] >= depth["backprop"]
    (planned,) = [r for r in every if r.get("kind") == "plan_lm"]
    assert planned["fraction"] == H.PLAN_FRACTION and planned["size"]["vocab"] == 50257
    assert planned["choice"] is not None and "chunked_ce" in planned["choice"]
    assert planned["plan_total_bytes"] <= planned["budget_bytes"] < planned["backprop_total_bytes"]
    # PyTorch's exact recipes at the same budget: every one measured and exact, every one that
    # fits timed (and the lowest, fitting or not); the figure's PyTorch bar is the fastest
    # that fits, else the lowest
    options = planned["pytorch"]
    assert {"torch per-block", "torch accumulate(8) + per-block"} <= {o["label"] for o in options}
    assert not [o["failed"] for o in options if o.get("failed")]
    assert all(o["grad_max_rel_err"] < 1e-4 for o in options)
    lowest = planned["pytorch_lowest"]
    assert lowest == min(options, key=lambda o: o["total_bytes"])
    assert lowest["time_ratio"] is not None
    for o in options:
        assert o["fits"] == (o["total_bytes"] <= planned["budget_bytes"])
        assert (o["time_ratio"] is not None) == (o["fits"] or o["label"] == lowest["label"])
    fitting = [o for o in options if o["fits"]]
    if fitting:
        assert planned["pytorch_best"] == min(fitting, key=lambda o: o["time_ratio"])
        assert f"PyTorch's best exact: {planned['pytorch_best']['label']}: " in text
    else:
        assert planned["pytorch_best"] is None
        assert f"PyTorch's lowest exact: {lowest['label']}: " in text
    compiled = planned["compile"]
    assert "failed" not in compiled, compiled
    assert compiled["peak_ratio"] > 0 and compiled["time_ratio"] > 0
    assert "torch.compile(activation_memory_budget=0): " in text
    records = [r for r in every if r.get("kind") is None]
    assert {r["series"] for r in records} == set(small)
    ran = {(r["series"], r["engine"]) for r in records if not r["skipped"]}
    # Chain engines run on the Chain models and are marked not applicable elsewhere.
    assert ("subcnn", "moonwalk") in ran and ("revnet", "revbackprop") in ran
    assert ("mlp", "moonwalk") not in ran and "n/a" in text
    for r in records:
        if not r["skipped"] and r["exact"]:
            assert r["grad_max_rel_err"] < 1e-4, (r["series"], r["engine"])
    for png in ("demo-plan.png", "demo-depth.png", "demo-engines.png"):
        assert (out / png).stat().st_size > 1000


def test_best_pytorch_is_the_fastest_timed_option_within_the_budget() -> None:
    """The plan figure's PyTorch bar: a faster option over the budget, or one not timed,
    never wins; with none fitting there is none."""
    from leangrad_bench._demo_headline import best_pytorch

    mib = 2**20
    options = [
        {"label": "torch selective", "total_bytes": 60 * mib, "time_ratio": 0.9},
        {"label": "torch per-block", "total_bytes": 22 * mib, "time_ratio": 1.09},
        {"label": "torch accumulate(4)", "total_bytes": 26 * mib, "time_ratio": 0.87},
        {"label": "torch accumulate(8)", "total_bytes": 19 * mib, "time_ratio": None},
        {"label": "checkpoint_sequential(3)", "total_bytes": 37 * mib, "time_ratio": 1.0},
    ]
    assert best_pytorch(options, 37 * mib)["label"] == "torch accumulate(4)"  # type: ignore[index]
    assert best_pytorch(options, 25 * mib)["label"] == "torch per-block"  # type: ignore[index]
    assert best_pytorch(options, 20 * mib) is None
    assert best_pytorch([], 37 * mib) is None


@pytest.mark.slow
def test_only_reruns_some_series_and_merges_them(tmp_path: Path) -> None:
    """``run_suite(only=...)`` replaces the records of the series it ran and keeps the others;
    a file of the other mode is refused rather than mixed; an unknown series is named."""
    two = TINY_SUITE.replace("quick_values = [1, 3]", "quick_values = [1]") + (
        '[[series]]\nname = "wide"\nvalues = [2]\nquick_values = [2]\n'
        'config = { model = "mlp", in_features = 8, width = 16, batch = 16, classes = 3 }\n'
    )
    suite_file = tmp_path / "two.toml"
    suite_file.write_text(two)
    out = tmp_path / "results"
    path = run_suite(str(suite_file), out=out, quick=True, rss=False, progress=False)
    first = json.loads(path.read_text())
    assert {r["series"] for r in first} == {"mlp", "wide"}
    run_suite(str(suite_file), out=out, quick=True, rss=False, progress=False, only=["wide"])
    merged = json.loads(path.read_text())
    assert len(merged) == len(first)
    old_mlp = [r["created"] for r in first if r["series"] == "mlp"]
    assert [r["created"] for r in merged if r["series"] == "mlp"] == old_mlp
    assert {r["x"] for r in merged if r["series"] == "wide"} == {2}
    with pytest.raises(LeangradError, match=r"holds a --quick run"):
        run_suite(str(suite_file), out=out, quick=False, rss=False, progress=False,
                  only=["wide"])  # fmt: skip
    with pytest.raises(LeangradError, match=r"has no series nope; its series: mlp, wide"):
        run_suite(str(suite_file), out=out, quick=True, rss=False, progress=False,
                  only=["nope"])  # fmt: skip
    with pytest.raises(LeangradError, match=r"runs all of its series at once"):
        run_suite("blocks", out=out, quick=True, progress=False, only=["x"])
