"""The reproduction table: rows are data, *ours* is read from the suites' JSON when
rendered, a suite without results renders "not run", and the docs page
(``docs/reproduction.md``) embeds the rendered table verbatim."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from leangrad._errors import LeangradError
from leangrad.cli import main
from leangrad_bench import list_suites, render_report
from leangrad_bench._report import load_records
from leangrad_bench._reproduction import (
    _EXTRACTORS,
    NOT_IN_RECORDS,
    NOT_RUN,
    TABLE_HEAD,
    extractor,
    load_rows,
    ours,
    reproduction_markdown,
    reproduction_section,
    reproduction_table,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
# Suites being written beside this table; their rows render "not run" until then.
PENDING = {"moonwalk-v1-depth", "rad-fractions", "highway-transformer"}
# Rows a quick run does not measure (the full run's models only).
FULL_RUN_ONLY = {"rad-fig6-cnn"}
PAPERS = {"Moonwalk v1", "Moonwalk v2", "RAD", "Nested forward AD", "Highway-BP"}


def _ours_cells(table: str) -> dict[str, str]:
    """Row id -> its *ours* cell, by the order of the rows."""
    body = table.splitlines()[len(TABLE_HEAD) :]
    return {row.id: line.split(" | ")[4] for row, line in zip(load_rows(), body, strict=True)}


def test_every_row_names_a_suite_and_has_an_extractor() -> None:
    rows = load_rows()
    assert {r.paper for r in rows} == PAPERS
    assert len({r.id for r in rows}) == len(rows)
    known = set(list_suites())
    for row in rows:
        assert row.suite in known or row.suite in PENDING, row
        assert callable(extractor(row.id))
        assert row.claim and row.paper_number and row.figure
    assert set(_EXTRACTORS) == {r.id for r in rows}  # no extractor without its row
    assert {r.suite for r in rows} >= PENDING  # the new suites have their rows already


def test_every_extractor_reads_the_committed_results() -> None:
    suites = load_records(RESULTS)
    for row in load_rows():
        if row.suite not in suites:
            continue
        value = extractor(row.id)(suites[row.suite])
        if row.suite in PENDING or row.id in FULL_RUN_ONLY:
            continue  # not wired yet / not in a quick run: None is allowed
        assert value is not None, row.id
        assert re.search(r"\d", value), (row.id, value)  # a number, read from the records
        assert ours(row, suites) == value


def test_a_suite_without_results_renders_not_run() -> None:
    cells = _ours_cells(reproduction_table({}))
    for row in load_rows():
        assert (
            cells[row.id]
            == NOT_RUN.format(suite=row.suite)
            == f"not run (leangrad bench {row.suite})"
        )


def test_records_lacking_what_a_row_reads_render_a_dash() -> None:
    """An extractor given records without its fields (here: another suite's) returns None,
    and the cell says so instead of failing."""
    other = json.loads((RESULTS / "rad-pde.json").read_text())
    suites = {row.suite: other for row in load_rows() if row.suite != "rad-pde"}
    cells = _ours_cells(reproduction_table(suites))
    assert cells["moonwalk-v1-fig1-memory"] == NOT_IN_RECORDS
    assert cells["highway-table3-gru256"] == NOT_IN_RECORDS
    assert cells["rad-fig7-pde"] == NOT_RUN.format(suite="rad-pde")


def test_ours_is_read_from_the_json_at_render_time(tmp_path: Path) -> None:
    """Changing a number in a copy of a suite's JSON changes the rendered cell."""
    budget = json.loads((RESULTS / "depth-at-budget.json").read_text())
    before = _ours_cells(reproduction_markdown(_with(tmp_path / "a", "depth-at-budget", budget)))
    backprop = next(r for r in budget if r["engine"] == "backprop")
    assert f"backprop {backprop['max_depth']}," in before["moonwalk-v2-depth-budget"]
    backprop["max_depth"] = 777
    after = _ours_cells(reproduction_markdown(_with(tmp_path / "b", "depth-at-budget", budget)))
    assert "backprop 777," in after["moonwalk-v2-depth-budget"]

    rnn = json.loads((RESULTS / "highway-rnn.json").read_text())
    for r in rnn:
        if r["series"] == "gru" and r["x"] == 256 and r.get("k") == 0:
            r["step_speedup"] = 9.87
    cells = _ours_cells(reproduction_markdown(_with(tmp_path / "c", "highway-rnn", rnn)))
    assert cells["highway-table3-gru256"].startswith("9.87× / ")
    assert cells["moonwalk-v2-depth-budget"] == NOT_RUN.format(suite="depth-at-budget")


def _with(directory: Path, suite: str, records: list[dict[str, object]]) -> Path:
    directory.mkdir(parents=True)
    (directory / f"{suite}.json").write_text(json.dumps(records))
    return directory


def test_report_opens_with_the_reproduction_section(tmp_path: Path) -> None:
    for suite in ("depth-at-budget", "moonwalk-v2-constrained"):
        shutil.copy(RESULTS / f"{suite}.json", tmp_path)
    text = render_report(tmp_path, plots=False).read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Reproduction"
    assert text.index("Machine:") < text.index("## Reproduction")
    table = reproduction_markdown(tmp_path)
    assert table in text
    cells = _ours_cells(table)
    assert cells["highway-fig4-fpi"] == NOT_RUN.format(suite="highway-train")
    assert cells["moonwalk-v2-fig4-constrained"].startswith("test acc constrained ")


def test_no_section_for_a_directory_of_unrelated_suites() -> None:
    assert reproduction_section({"tiny": [{"engine": "backprop", "x": 1}]}) == []
    assert reproduction_section({"fad": load_records(RESULTS)["fad"]})[0] == "## Reproduction"


def test_cli_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(RESULTS / "rad-pde.json", tmp_path)
    assert main(["report", str(tmp_path), "--reproduction"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == reproduction_markdown(tmp_path)
    assert printed.splitlines()[:2] == TABLE_HEAD
    assert not (tmp_path / "report.md").exists()  # printed only


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[[rows]]\nid = "a"\npaper = "p"\n', "missing"),
        (
            '[[rows]]\nid = "a"\npaper = "p"\nfigure = "f"\nclaim = "c | d"\npaper_number = "n"\n'
            'suite = "s"\nwhy = ""\n',
            "without '|'",
        ),
        (
            '[[rows]]\nid = "a"\npaper = "p"\nfigure = "f"\nclaim = "c"\npaper_number = "n"\n'
            'suite = "s"\nwhy = ""\nours = "1.5x"\n',
            "unknown ['ours']",
        ),
    ],
)
def test_bad_rows_are_refused(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "rows.toml"
    path.write_text(text)
    with pytest.raises(LeangradError, match=re.escape(problem)):
        load_rows(path)


def test_docs_page_embeds_the_rendered_table() -> None:
    """The reproduction page's table (``docs/reproduction.md``) is ``leangrad report
    results --reproduction`` verbatim, between the markers naming that command:
    regenerated, never edited by hand."""
    page = (ROOT / "docs" / "reproduction.md").read_text()
    table = reproduction_markdown(RESULTS)
    assert table in page
    command = "leangrad report results --reproduction"
    assert f"<!-- generated by: {command} -->\n{table.strip()}\n<!-- end generated -->" in page
