"""The fad bench suite on a tiny configuration: record schema, FAD's measured savings
against eager in the same run (by bytes, through the tracker), and the report section."""

from __future__ import annotations

from pathlib import Path

import pytest

from leangrad_bench._fad import METHODS, render, run_fad
from leangrad_bench._suites import RunSettings, load_suite

TINY = """
runner = "leangrad_bench._fad:run_fad"
report = "leangrad_bench._fad:render"
[settings]
batch = 4
budget_batch = 4
batch_cap = 12
repeats = 1
act_repeats = 1
activations = ["swish"]
compile = []
[settings.models.resnet]
channels = 4
stages = 1
blocks = 1
side = 8
[settings.models.bert]
d = 16
heads = 2
layers = 1
seq = 8
"""


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = tmp_path_factory.mktemp("suite") / "fad.toml"
    path.write_text(TINY)
    return run_fad(load_suite(str(path)), RunSettings(quick=False, progress=False, threads=[1, 2]))


def test_records_cover_every_method_and_activation(records: list[dict]) -> None:
    runs = [r for r in records if r["kind"] == "fad"]
    assert {(r["series"], r["engine"]) for r in runs} == {
        (s, m) for s in ("resnet-swish", "bert-swish") for m in METHODS
    }
    compiled = [r for r in runs if r["engine"] == "torch.compile"]
    assert all(r["skipped"].startswith("not run for this configuration") for r in compiled)
    acts = [r for r in records if r["kind"] == "fad-activation"]
    assert len(acts) == 2
    for r in runs:  # every step timed at 1 and 2 threads side by side, ratios to eager's
        if not r["skipped"]:
            assert r["threads"] == 1 and [e["threads"] for e in r["by_threads"]] == [1, 2]
            assert r["by_threads"][0]["time_ratio"] == r["time_ratio"]
            if r["engine"] == "eager":
                assert [e["time_ratio"] for e in r["by_threads"]] == [1.0, 1.0]


def test_fad_saves_less_with_exact_gradients(records: list[dict]) -> None:
    for r in records:
        if r["kind"] == "fad" and r["engine"] in ("fad.nest", "fad.nested"):
            assert r["saved_bytes"] < next(
                e["saved_bytes"] for e in records
                if e["series"] == r["series"] and e["engine"] == "eager"
            )  # fmt: skip
            assert r["grad_max_rel_err"] < 1e-12
            assert r["max_batch_probes"] >= 2 and r["budget_bytes"] > 0
        if r["kind"] == "fad-activation":
            saved = r["act_saved_bytes"]
            assert saved["fad"] * 2 == saved["eager"]  # Swish: x and sigmoid(x) vs one
            # PyTorch's fused nn.SiLU saves its input alone: FAD saves no fewer bytes
            assert saved["builtin"] == saved["fad"]


def test_swish_from_primitives_runs_by_silu_unless_paper(records: list[dict]) -> None:
    """The shipped pass runs x * sigmoid(x) by F.silu (same saved bytes as the built-in
    model); the paper's variant nests it."""
    runs = {(r["series"], r["engine"]): r for r in records if r["kind"] == "fad"}
    for s in ("resnet-swish", "bert-swish"):
        assert runs[s, "fad.nest"]["builtin_chains"] and not runs[s, "fad.nest"]["fused_chains"]
        assert runs[s, "fad.nest(paper)"]["fused_chains"]
        assert not runs[s, "fad.nest(paper)"]["builtin_chains"]
        assert runs[s, "fad.nest"]["saved_bytes"] == runs[s, "builtin"]["saved_bytes"]


def test_report_section(records: list[dict], tmp_path: Path) -> None:
    lines = render("fad", records, tmp_path, plots=True)
    text = "\n".join(lines)
    assert "| composite activation saved bytes ≤ 0.5× eager | 0.50–0.50 | 2/2 |" in text
    assert "PyTorch's built-in (nn.SiLU) saves" in text
    assert "| fad.nest step time ≤ 1.0× the model with PyTorch's built-in activation |" in text
    assert "### resnet-swish" in text and "### bert-swish" in text
    assert "| time ratio | time ratio (2 thr) |" in text
    assert "| step time ≤ 1.05× eager, 2 threads |" in text
    assert (tmp_path / "plots" / "fad.png").is_file()
