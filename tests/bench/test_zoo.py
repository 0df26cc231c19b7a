"""The ``zoo`` suite's machinery on tiny sizes (seconds): its records, the exactness of the
exact methods, the max-batch search, the estimate rows, the headline table and the report.
Nothing here asserts a time."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from leangrad import LeangradError, zoo
from leangrad.cli import main
from leangrad_bench import RECORD_FIELDS, RunSettings, load_suite
from leangrad_bench._models import build
from leangrad_bench._zoo import run_zoo
from leangrad_bench._zoo_batch import NOT_ESTIMABLE, estimable, footprint, max_batch
from leangrad_bench._zoo_methods import Method, leangrad_methods, pytorch_methods
from leangrad_bench._zoo_report import best_within, headline_table, largest_batch, render

GPT = {"vocab": 32, "dim": 24, "layers": 4, "heads": 2, "context": 32, "batch": 8}
LSTM = {"vocab": 1024, "embed": 8, "hidden": 16, "layers": 2, "length": 12, "batch": 4}
EST_GPT = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "context": 32, "batch": 8}
SAVED: list[list[str]] = []  # the series of each ``save`` call of the fixture's run
SHARED = ("series", "sweep", "x", "side", "config")


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    """The suite's runner on a tiny GPT and LSTM LM and one tiny estimate configuration: one
    repeat, no torch.compile (a cold compile takes tens of seconds), fresh-process RSS of the
    key rows (one worker per model). Widths and vocabularies put both models above the
    planner's 20k parameters, so where nothing fits it does not try ``forward`` (one jvp per
    parameter: minutes)."""
    suite = load_suite("zoo")
    settings = {
        **suite.settings,
        "quick_models": {"gpt": GPT, "lstm_lm": LSTM},
        "quick_estimate_models": {"gpt": EST_GPT},
        "quick_compile_models": [],
        "quick_rss_rows": "key",
        "quick_repeats": 1,
        "quick_chunks": [3],
        "quick_estimate_max_batch": True,
        "quick_forward_max_params": 0,
    }
    return run_zoo(
        dataclasses.replace(suite, settings=settings),
        RunSettings(
            quick=True,
            progress=False,
            save=lambda recs: SAVED.append([_series(r) for r in recs]),
        ),
    )


def _series(r: dict[str, Any]) -> str:
    return r["series"] + (" ~" if r.get("estimate") else "")


def _row(records: list[dict[str, Any]], series: str, engine: str) -> dict[str, Any]:
    return next(r for r in records if r["series"] == series and r["engine"] == engine)


def test_suite_file_names_every_zoo_model_and_its_hooks() -> None:
    suite = load_suite("zoo")
    suite.check()
    for quick in (False, True):
        assert set(suite.setting("models", quick)) == set(zoo.MODELS)
    assert suite.resolve_runner() is run_zoo


@pytest.mark.slow
def test_records_are_saved_after_each_model(records: list[dict[str, Any]]) -> None:
    """A stopped run of hours keeps the models it finished: ``save`` gets the records so far
    after each model, each call a prefix of the next, the last one all of them."""
    assert len(SAVED) == 3  # gpt, lstm_lm, the gpt estimate
    assert set(SAVED[0]) == {"gpt"}
    assert set(SAVED[1]) == {"gpt", "lstm_lm"}
    for before, after in itertools.pairwise(SAVED):
        assert after[: len(before)] == before
    assert len(SAVED[-1]) == len(records)


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_records_have_the_shared_fields(records: list[dict[str, Any]]) -> None:
    for r in records:
        assert set(RECORD_FIELDS) <= set(r) and set(SHARED) <= set(r), r["engine"]
        assert r["sweep"] == "method" and r["x"] == r["engine"]
    measured = [r for r in records if r.get("peak_ratio") is not None]
    sides = {r["side"] for r in measured if not r["estimate"]}
    assert {"reference", "leangrad", "plan", "pytorch"} <= sides
    for r in (r for r in measured if r["peak_source"] == "tracker"):
        assert r["peak_bytes"] > 0 and r["max_batch"] >= 0 and r["time_ratio"] > 0
        assert r["max_batch_method"] in ("estimate", "tracker")
    bp = _row(records, "gpt", "backprop")
    assert bp["time_ratio"] == 1.0 and bp["peak_ratio"] == 1.0
    assert bp["rss_peak_bytes"] > 0 and bp["kept_bytes"] > 0


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_skipped_and_failed_rows_say_why(records: list[dict[str, Any]]) -> None:
    assert "leangrad.Chain" in _row(records, "gpt", "moonwalk")["skipped"]
    assert "forward_max_params" in _row(records, "gpt", "forward")["skipped"]
    assert "no blocks to wrap" in _row(records, "lstm_lm", "torch per-block")["skipped"]
    # a composition whose transform changes nothing is not measured under its name
    assert "fad change(s) nothing" in _row(records, "gpt", "fad")["skipped"]
    for r in records:
        if r.get("skipped") or r.get("failed"):
            assert r["peak_bytes"] is None and r["seconds_median"] is None


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_exact_methods_match_backprop(records: list[dict[str, Any]]) -> None:
    """Checkpointing (leangrad's time chunks included), the plans and PyTorch's recipes
    (time chunks included) recompute the same float32 values, up to kernel reassociation."""
    exact = [r for r in records if r.get("exact") and r.get("grad_max_rel_err") is not None]
    assert {"checkpoint", "checkpoint(time_chunks=3)", "torch per-block",
            "torch time chunks(3)", "torch accumulate(2) + time chunks(3)"} <= {
        r["engine"] for r in exact}  # fmt: skip
    for r in exact:
        assert r["grad_max_rel_err"] < 1e-4 and r["grad_cosine"] > 1 - 1e-6, r["engine"]
    bf16 = _row(records, "gpt", "torch bf16 autocast")
    assert bf16["exact"] is False and 0.99 < bf16["grad_cosine"] < 1


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_plan_rows_fit_their_budget(records: list[dict[str, Any]]) -> None:
    for r in (r for r in records if r["side"] == "plan" and r.get("peak_bytes")):
        assert r["baseline_bytes"] + r["peak_bytes"] <= r["budget_bytes"]
        assert r["choice"] and r["peak_ratio"] <= r["fraction"] + 0.01


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_each_row_says_where_its_wall_time_went(records: list[dict[str, Any]]) -> None:
    """Backprop's record carries the row's seconds per phase, each plan row its planning's
    (a plan after the first takes its peaks: under 0.05 s where nothing fits it)."""
    for series in ("gpt", "lstm_lm"):
        phases = _row(records, series, "backprop")["row_seconds"]
        fractions = {r["fraction"] for r in records if r["series"] == series
                     and r["side"] == "plan"}  # fmt: skip
        want = {"profiles", "timing", "max batch", "fresh processes",
                *(f"plan at {f}" for f in fractions)}  # fmt: skip
        assert set(phases) == want and all(s >= 0 for s in phases.values())
        assert phases["profiles"] > 0 and phases["timing"] > 0
    planned = [r for r in records if r["side"] == "plan" and not r.get("failed")]
    assert planned and all(r["plan_seconds"] >= 0 for r in planned)
    first = [r for r in planned if r["fraction"] == max(p["fraction"] for p in planned)]
    assert first and all(r["plan_seconds"] > 0 for r in first)


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_max_batch_of_backprop_is_its_base_batch(records: list[dict[str, Any]]) -> None:
    """The budget is backprop's total at the base batch, so backprop fits exactly that."""
    for series in ("gpt", "lstm_lm", "gpt (estimate)"):
        bp = _row(records, series, "backprop")
        assert bp["max_batch"] == bp["base_batch"]
    # fake tensors miss the fused LSTM kernel's workspace: the tracker searched instead
    lstm = _row(records, "lstm_lm", "backprop")
    assert lstm["max_batch_method"] == "tracker" and lstm["estimate_vs_tracker"] < 0.99


def test_max_batch_search_is_exact_and_monotone_in_budget() -> None:
    """Against a brute-force scan, over every budget, for totals with a jump and a plateau."""

    def total(b: int) -> int:
        return 1000 + 37 * b + (b // 5) * 11 + (500 if b > 40 else 0)

    last = -1
    for budget in range(900, 3400, 7):
        got = max_batch(total, budget, start=6, limit=64)
        want = max([b for b in range(1, 65) if total(b) <= budget], default=0)
        assert got.batch == want and got.batch >= last
        assert all(total(b) == t for b, t in got.probes.items())
        last = got.batch
    assert max_batch(total, 10**9, start=6, limit=64).capped


def test_relative_max_batch_brackets_the_boundary_with_fewer_probes() -> None:
    """Within 1/relative: the answer fits, ``fails`` does not, the true boundary lies
    between them, and the search probes less than the exact one."""

    def total(b: int) -> int:
        return 5000 + 40 * b

    for budget in range(20_000, 45_000, 997):
        exact = max_batch(total, budget, start=16, limit=2000)
        got = max_batch(total, budget, start=16, limit=2000, fixed=5000 - 400, relative=20)
        assert total(got.batch) <= budget and got.fails is not None
        assert total(got.fails) > budget and got.batch <= exact.batch < got.fails
        assert got.fails - got.batch <= max(1, got.batch // 20) + 1
        assert len(got.probes) <= len(exact.probes)


@pytest.mark.slow
def test_max_batch_on_real_estimates_is_monotone_in_budget() -> None:
    ck = Method("checkpoint", "leangrad", True, {"engine": "checkpoint", "options": {}})
    totals = {b: footprint("gpt", GPT, ck, b, estimate=True).total for b in range(1, 13)}
    assert all(totals[b] < totals[b + 1] for b in range(1, 12))
    budgets = [totals[1] - 1, *range(totals[1], totals[12], 1_000), totals[12], totals[12] + 1]
    found = [max_batch(totals.__getitem__, b, start=4, limit=12).batch for b in budgets]
    assert found == sorted(found) and found[0] == 0 and found[-2:] == [12, 12]
    for budget, got in zip(budgets, found, strict=True):
        assert got == max([b for b, t in totals.items() if t <= budget], default=0)


def test_estimate_equals_tracker_for_checkpointing_a_gpt() -> None:
    ck = Method("checkpoint", "leangrad", True, {"engine": "checkpoint", "options": {}})
    est, real = (footprint("gpt", GPT, ck, 4, estimate=e) for e in (True, False))
    assert est.estimate and not real.estimate
    assert (est.baseline, est.peak, est.kept) == (real.baseline, real.peak, real.kept)


def test_forward_mode_engines_are_not_estimated() -> None:
    fwd = Method("projforward", "leangrad", False, {"engine": "projforward", "options": {}})
    assert estimable(fwd) == NOT_ESTIMABLE.format(engine="projforward")
    with pytest.raises(ValueError, match="not estimated on fake tensors"):
        footprint("gpt", GPT, fwd, 4, estimate=True)


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_estimate_rows_are_labelled(records: list[dict[str, Any]]) -> None:
    rows = [r for r in records if r["series"] == "gpt (estimate)"]
    assert rows and all(r["estimate"] is True for r in rows)
    assert all(r["estimate"] is False for r in records if r["series"] in ("gpt", "lstm_lm"))
    for r in (r for r in rows if not r.get("skipped")):
        assert r["peak_source"] == "estimate" and r["max_batch_method"] == "estimate"
        assert r["seconds_median"] is None and r["grad_max_rel_err"] is None
        assert r.get("rss_peak_bytes") is None
    assert "fake tensors" in _row(records, "gpt (estimate)", "projforward")["skipped"]


def test_methods_cover_every_engine_and_composition() -> None:
    wl = build("gpt", GPT)
    methods, skipped = leangrad_methods(wl.model, options={}, skip={}, forward_max_params=0)
    labels = {m.label for m in methods} | {s.label for s in skipped}
    assert {"backprop", "checkpoint+fad+bits", "moonwalk+rad", "highway+fad"} <= labels
    assert len(labels) == len(methods) + len(skipped)
    torch_methods, _ = pytorch_methods(wl.model, segments=[2, 9], chunks=[4])
    assert [m.label for m in torch_methods] == [
        "torch bf16 autocast",
        "torch per-block",
        "torch selective",
        "checkpoint_sequential(2)",
    ]


def _rec(
    series: str, engine: str, side: str, peak: float, time: float, **kw: Any
) -> dict[str, Any]:
    return {
        "series": series,
        "engine": engine,
        "side": side,
        "peak_ratio": peak,
        "time_ratio": time,
        "exact": True,
        "estimate": False,
        "peak_bytes": 2**20,
        **kw,
    }


def test_headline_shows_a_plans_named_blocks_by_their_count() -> None:
    choice = "checkpoint(blocks=['blocks.0', 'blocks.1', 'blocks.2'],trace=True)"
    rs = [
        _rec("m", "backprop", "reference", 1.0, 1.0),
        _rec("m", "plan(≤0.5×)", "plan", 0.3, 1.1, choice=choice),
    ]
    row = headline_table(rs).splitlines()[2]
    assert "plan(≤0.5×) → checkpoint(blocks=[3 named],trace=True) (0.30×) | 1.10×" in row


def test_headline_table_picks_the_fastest_exact_row_within_each_bound() -> None:
    rs = [
        _rec("m", "backprop", "reference", 1.0, 1.0),
        _rec("m", "checkpoint", "leangrad", 0.45, 1.3),
        _rec("m", "checkpoint+fad", "leangrad", 0.2, 1.6),
        _rec("m", "rad", "leangrad", 0.1, 0.9, exact=False),  # not exact: never a candidate
        _rec("m", "plan(≤0.5×)", "plan", 0.48, 1.2, choice="checkpoint(segments=2)"),
        _rec("m", "torch per-block", "pytorch", 0.45, 1.25),
        _rec("m", "torch.compile", "compile", 0.3, 0.7),
        _rec("m", "torch bf16 autocast", "pytorch", 0.2, 0.8, exact=False),
        _rec("m", "gone", "leangrad", 0.01, 0.5, skipped="n/a"),
        _rec("m", "est", "leangrad", 0.01, 0.5, estimate=True),
    ]
    assert best_within(rs, "m", ("leangrad", "plan"), 0.5)["engine"] == "plan(≤0.5×)"  # type: ignore[index]
    assert best_within(rs, "m", ("leangrad", "plan"), 0.25)["engine"] == "checkpoint+fad"  # type: ignore[index]
    assert best_within(rs, "m", ("pytorch", "compile"), 0.5)["engine"] == "torch.compile"  # type: ignore[index]
    assert best_within(rs, "m", ("pytorch", "compile"), 0.25) is None
    table = headline_table(rs).splitlines()
    assert len(table) == 3 and table[2].startswith("| m | 1 MiB |")
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells[2:] == [
        "plan(≤0.5×) → checkpoint(segments=2) (0.48×)",
        "1.20×",
        "torch.compile (0.30×)",
        "0.70×",
        "checkpoint+fad (0.20×)",
        "1.60×",
        "nothing fits",
        "—",
        "—",  # no max-batch fields: backprop's batch, then neither side's largest
        "—",
        "—",
    ]


def test_headline_shows_the_largest_batch_each_side_reaches_in_backprops_memory() -> None:
    """Beside backprop's batch, the largest ``max_batch`` of an exact measured row on each
    side, with its option: estimates, inexact and skipped rows never count; a capped
    search shows ``≥N`` and wins a tie; among equal batches the faster row is named;
    torch.compile (no max batch searched) is passed over."""

    def rec(engine: str, side: str, batch: int | None, time: float, **kw: Any) -> dict[str, Any]:
        return _rec("m", engine, side, 0.5, time, base_batch=8, max_batch=batch, **kw)

    rs = [
        rec("backprop", "reference", 8, 1.0),
        rec("checkpoint", "leangrad", 40, 1.3),
        rec("checkpoint+accumulate(micro_batches=4)", "leangrad", 96, 1.9),
        rec("plan(≤0.125×)", "plan", 96, 1.7, choice="checkpoint+accumulate(micro_batches=4)"),
        rec("rad", "leangrad", 500, 0.9, exact=False),
        rec("gone", "leangrad", 500, 0.9, skipped="n/a"),
        rec("est", "leangrad", 500, 0.9, estimate=True),
        rec("torch per-block", "pytorch", 40, 1.2),
        rec("torch accumulate(4) + per-block", "pytorch", 88, 2.2),
        rec("torch accumulate(8)", "pytorch", 88, 1.4, max_batch_capped=True),
        rec("torch.compile", "compile", None, 0.7, max_batch_method="not measured: compile"),
    ]
    assert largest_batch(rs, "m", ("leangrad", "plan"))["engine"] == "plan(≤0.125×)"  # type: ignore[index]
    assert largest_batch(rs, "m", ("pytorch", "compile"))["engine"] == "torch accumulate(8)"  # type: ignore[index]
    assert largest_batch(rs, "m", ("compile",)) is None
    table = headline_table(rs, fractions=(0.5,)).splitlines()
    assert table[0].endswith(
        "| backprop batch | max batch in backprop's memory: leangrad (option) | PyTorch (option) |"
    )
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert len(cells) == len(table[0].split("|")) - 2
    assert cells[-3:] == [
        "8",
        "96 (plan(≤0.125×) → checkpoint+accumulate(micro_batches=4))",
        "≥88 (torch accumulate(8))",
    ]
    # a tracker search to within 1/relative shows its bracket [max_batch, fails)
    rs[7].update(max_batch=120, max_batch_relative=16, max_batch_fails=128)
    assert headline_table(rs, fractions=(0.5,)).splitlines()[2].endswith(
        "| 120–127 (torch per-block) |"
    )


@pytest.mark.slow  # the records fixture runs the zoo suite: minutes
def test_report_renders_every_model_and_the_headline(records: list[dict[str, Any]]) -> None:
    text = "\n".join(render("zoo", records, None))
    for heading in ("### gpt", "### lstm_lm", "### gpt (estimate)", "| model | backprop peak |"):
        assert heading in text
    assert "Skipped:" in text and "Fake-tensor estimates only" in text


@pytest.mark.parametrize(("kind", "arg"), [("rnn", None), ("chunks", 1), ("chunks", 5)])
def test_time_chunks_give_autograds_gradient_in_float64(kind: str, arg: int | None) -> None:
    """Checkpointing the recurrent module, whole or in time chunks with the state carried,
    is the same computation: float64 gradients agree to 1e-12."""
    for cell in ("lstm_lm", "gru_lm"):
        wl = build(cell, LSTM)
        model = wl.model.double()
        model.zero_grad(set_to_none=True)
        wl.loss_fn(model(wl.inputs)).backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        Method("m", "pytorch", True, {"torch": kind, "arg": arg}).make().backward(
            model, wl.inputs, wl.loss_fn
        )
        for g, w in zip([p.grad for p in model.parameters()], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("where", "models"), [("results", 7), ("results/full", 7)])
def test_docs_page_opens_with_the_committed_zoo_headline(
    where: str, models: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The results page's tables (``docs/results.md``) are ``leangrad report DIR
    --headline`` of the committed ``results/zoo.json`` (quick sizes) and
    ``results/full/zoo.json`` (full sizes, every model), verbatim, between the markers
    naming that command: regenerated, never edited by hand."""
    root = Path(__file__).resolve().parents[2]
    assert main(["report", str(root / where), "--headline"]) == 0
    table = capsys.readouterr().out.strip()
    assert table.count("\n| ") >= models  # a row per measured model
    command = f"leangrad report {where} --headline"
    block = f"<!-- generated by: {command} -->\n{table}\n<!-- end generated -->"
    assert block in (root / "docs" / "results.md").read_text()


def test_headline_without_zoo_results_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text("[]")
    proc = subprocess.run(
        [sys.executable, "-m", "leangrad", "report", str(tmp_path), "--headline"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"leangrad: error: {tmp_path} has no zoo suite results (zoo.json); "
        f"run `leangrad bench zoo --out {tmp_path}`"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_zoo_on_cuda_without_a_gpu_is_refused_in_one_line() -> None:
    from leangrad import _errors as errors

    with pytest.raises(errors.OptionError, match=r"torch\.cuda\.is_available"):
        run_zoo(load_suite("zoo"),
                RunSettings(quick=True, device="cuda", progress=False, only=["gpt"]))  # fmt: skip
    with pytest.raises(errors.OptionError, match="cpu or cuda"):
        run_zoo(load_suite("zoo"), RunSettings(quick=True, device="mps:x", progress=False))


def test_zoo_workloads_follow_the_device_asked_for() -> None:
    size = {"vocab": 32, "dim": 16, "layers": 1, "heads": 2, "context": 8, "batch": 2}
    a, b = build("gpt", size), build("gpt", size, device="cpu")
    assert a.inputs.device.type == b.inputs.device.type == "cpu"
    assert torch.equal(a.inputs, b.inputs)  # drawn on the CPU from the same seed either way
    targets = a.loss_fn.targets  # type: ignore[attr-defined]
    assert all(t.device == a.inputs.device for t in targets)


def test_wins_table_is_each_sides_lowest_exact_peak(tmp_path: Path) -> None:
    """``leangrad report DIR --wins``: per model, the lowest exact peak of each side with
    its time; leangrad's cell is bold where it is lower; a missing file leaves its rows
    out, no file at all is one error."""
    from leangrad_bench._zoo_report import wins_table

    root = Path(__file__).resolve().parents[2] / "results"
    table = wins_table(root)
    rows = table.splitlines()[2:]
    assert len(rows) == 5
    assert all(row.count("**") == 2 for row in rows)  # leangrad lower on every row
    zoo = json.loads((root / "zoo.json").read_text())
    exact = [r for r in zoo if r["series"] == "gpt_50k" and r.get("exact") and not r.get("estimate")
             and r.get("side") in ("pytorch", "compile") and r.get("peak_ratio") is not None
             and r.get("time_ratio") is not None and not r.get("skipped")]  # fmt: skip
    lowest = min(exact, key=lambda r: (r["peak_ratio"], r["time_ratio"]))
    assert f"| {lowest['engine']} | {lowest['peak_ratio']:.2f}× |" in rows[0]
    (tmp_path / "zoo.json").write_text((root / "zoo.json").read_text())
    assert len(wins_table(tmp_path).splitlines()) == 2 + 3  # the quick rows only
    with pytest.raises(LeangradError, match="none of the files behind the README's wins table"):
        wins_table(tmp_path / "nothing")
