"""Every user error of the ``leangrad`` command: one line ``leangrad: error: ...`` naming
the option and the fix, exit code 2, no traceback — and refused before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leangrad import bench
from leangrad.cli import main

QUICK = ["--max-steps", "1", "--no-plots", "--no-progress"]

# (arguments, a fragment of the one error line). {file} is an existing file,
# {dir} an empty directory, {tmp} a fresh path.
CASES: list[tuple[list[str], str]] = [
    # train: values that make no sense are refused, not run
    (["train", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["train", "--batch-size", "-3"], "argument --batch-size: must be at least 1, got -3"),
    (["train", "--batch-size", "x"], "argument --batch-size: 'x' is not a whole number"),
    (["train", "--batch-size", "100000"],
     "is more than the 1438 training examples; lower --batch-size"),
    (["train", "--lr", "nan"], "argument --lr: must be a finite number above 0, got nan"),
    (["train", "--lr", "inf"], "argument --lr: must be a finite number above 0, got inf"),
    (["train", "--lr", "-1"], "argument --lr: must be a finite number above 0, got -1"),
    (["train", "--lr", "0"], "argument --lr: must be a finite number above 0, got 0"),
    (["train", "--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
    (["train", "--epochs", "-1"], "argument --epochs: must be at least 1, got -1"),
    (["train", "--max-steps", "0"], "argument --max-steps: must be at least 1, got 0"),
    (["train", "--checkpoint-every", "0"], "argument --checkpoint-every: must be at least 1"),
    (["train", "--keep", "0"], "argument --keep: must be at least 1, got 0"),
    (["train", "--track-memory-every", "-1"], "argument --track-memory-every: must be 0 or more"),
    (["train", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["train", "--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
    (["train", "--test-fraction", "1.5"],
     "argument --test-fraction: must be at least 0 and below 1, got 1.5"),
    (["train", "--test-fraction", "-0.1"], "must be at least 0 and below 1, got -0.1"),
    (["train", "--test-fraction", "1"], "must be at least 0 and below 1, got 1"),
    (["train", "--optimizer", "adamw"], "argument --optimizer: invalid choice: 'adamw'"),
    (["train", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["train", "--device", "cuda"] if not __import__("torch").cuda.is_available()
     else ["train", "--device", "cuda:99"], "argument --device: 'cuda"),
    (["train", "--device", "foo"], "argument --device: 'foo' is not a device; use cpu or cuda"),
    (["train", "--device", "mps"], "argument --device: 'mps': leangrad runs on cpu or cuda"),
    (["train", "--out", "{file}"], "argument --out: '{file}' is a file; name a directory"),
    (["train", "--model", "nope"], "unknown model 'nope'; known models: gru_lm, mlp"),
    (["train", "--data", "nope"], "unknown dataset 'nope'; known datasets: digits"),
    (["train", "--engine", "nope"], "unknown engine 'nope'; known engines: backprop"),
    (["train", "--engine", "rad+checkpoint"], "write the base engine first"),
    (["train", "--engine", "forward+fad"], "engine 'forward+fad' cannot work"),
    (["train", "--model", "no.such.mod:factory"], "cannot import 'no.such.mod:factory'"),
    (["train", "--model", "os:getcwd"], "model factory 'os:getcwd' returned str, not a nn.Module"),
    (["train", "--engine", "checkpoint", "--engine-opt", "segments=abc"],
     "--engine-opt (engine 'checkpoint'): segments must be a positive int"),
    (["train", "--engine-opt", "nosuch=1"], "engine 'backprop' has no option 'nosuch'"),
    (["train", "--engine-opt", "foo"], "option 'foo' is not key=value"),
    (["train", "--engine", "rad", "--engine-opt", "fraction=2"], "fraction"),
    (["train", "--model-opt", "nosuch=1"], "--model-opt: model 'mlp' does not take that option"),
    (["train", "--data-opt", "nosuch=1"], "--data-opt: data 'digits' does not take that option"),
    (["train", "--data", "text:/no/such/dir", "--model", "gru_lm"],
     "data 'text:/no/such/dir': text data: no readable text"),
    (["train", "--model", "submersive_cnn", "--data", "synthetic"], "needs image inputs"),
    (["train", "--resume", "/no/such/run"], "nothing to resume"),
    (["train", "--resume", "{dir}", "--overwrite"], "--resume"),
    (["plan", "--model-opt", "depth=0"], "--model-opt: model 'mlp' cannot be built with depth=0"),
    (["train", "--budget", "1KiB"], "nothing fits 1 KiB"),
    (["train", "--budget", "-1GiB"], "argument --budget: budget '-1GiB' is not a size"),
    (["train", "--budget", "64MiB", "--engine-opt", "segments=2"], "budget= chooses the engine"),
    (["train", "--nope"], "unrecognized arguments: --nope"),
    # plan (and its old name, advise)
    (["plan", "--budget", "abc"], "argument --budget: budget 'abc' is not a size"),
    (["plan", "--budget", "-1GiB"], "argument --budget: budget '-1GiB' is not a size"),
    (["plan", "--budget", "0"], "argument --budget: must be above 0 bytes, got '0'"),
    (["advise", "--budget", "0"], "argument --budget: must be above 0 bytes, got '0'"),
    (["plan", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["plan", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["plan", "--engines", "nosuch"], "unknown engine 'nosuch'"),
    (["plan", "--model", "nope"], "unknown model 'nope'"),
    (["plan", "--model-opt", "depth=x"], "cannot be built with depth='x'"),
    (["plan", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    # bench
    (["bench", "nosuch"], "unknown suite 'nosuch'; known suites: baselines"),
    (["bench", "baselines", "--out", "{file}"], "argument --out: '{file}' is a file"),
    (["bench", "baselines", "--device", "foo"], "argument --device: 'foo' is not a device"),
    (["bench", "{file}.toml"], "unknown suite"),
    # demo
    (["demo", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["demo", "--out", "{file}"], "argument --out: '{file}' is a file; name a directory"),
    # report
    (["report", "{tmp}/nothere"], "is not there: name the directory"),
    (["report", "{file}"], "is a file: name the directory"),
    (["report", "{dir}"], "no suite results (*.json lists of records)"),
    (["report", "{bad}"], "x.json is not valid JSON"),
    (["report", "{empty}"], "x.json is not valid JSON (Expecting value"),
    (["report", "{notlist}"], "no suite results"),
    # no command
    ([], "the following arguments are required: command"),
    (["nope"], "argument command: invalid choice: 'nope'"),
]


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    file = tmp_path / "a-file"
    file.write_text("not a directory\n")
    (tmp_path / "empty-dir").mkdir()
    out = {"file": str(file), "dir": str(tmp_path / "empty-dir"), "tmp": str(tmp_path)}
    for name, text in (("bad", "{"), ("empty", ""), ("notlist", '{"a": 1}')):
        d = tmp_path / name
        d.mkdir()
        (d / "x.json").write_text(text)
        out[name] = str(d)
    return out


def _fill(items: list[str], places: dict[str, str]) -> list[str]:
    return [s.format(**places) for s in items]


@pytest.mark.parametrize(
    ("args", "fragment"), CASES, ids=[" ".join(a) or "<none>" for a, _ in CASES]
)
def test_user_error_is_one_line_exit_2(
    args: list[str], fragment: str, places: dict[str, str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    argv = _fill(args, places)
    if argv and argv[0] == "train":
        argv += [*QUICK, "--out", str(tmp_path / "run")] if "--out" not in argv else QUICK
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("leangrad: error: "), err
    assert fragment.format(**places) in lines[0], lines[0]
    assert "Traceback" not in err


def test_enough_cases() -> None:
    assert len(CASES) >= 45


def test_bench_out_naming_a_file_runs_nothing(places: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("the suite ran")

    monkeypatch.setattr(bench, "run_suite", fail)
    assert main(["bench", "baselines", "--quick", "--out", places["file"]]) == 2


def test_train_into_a_file_writes_nothing(places: dict[str, str]) -> None:
    before = Path(places["file"]).read_text()
    assert main(["train", *QUICK, "--out", places["file"]]) == 2
    assert Path(places["file"]).read_text() == before


def test_data_opt_shape_gives_synthetic_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--data-opt shape=3,32,32`` (a raw TypeError before) makes image-shaped synthetic
    data, so an image model trains on it."""
    code = main(["train", "--model", "submersive_cnn", "--data", "synthetic", "--data-opt",
                 "shape=3,16,16", *QUICK, "--out", str(tmp_path / "run")])  # fmt: skip
    assert code == 0, capsys.readouterr().err


def _env() -> dict[str, str]:
    src = os.path.join(os.path.dirname(__file__), os.pardir, "src")
    return {**os.environ, "PYTHONPATH": os.path.abspath(src)}


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["train", "--batch-size", "0"], "argument --batch-size"),
     (["plan", "--budget", "-1GiB"], "argument --budget"),
     (["report", "/no/such/dir"], "is not there")],
)  # fmt: skip
def test_python_dash_m_leangrad_reports_one_line(args: list[str], fragment: str) -> None:
    """A real process: ``python -m leangrad`` (so ``torchrun -m leangrad`` works too)."""
    proc = subprocess.run([sys.executable, "-m", "leangrad", *args], capture_output=True,
                          text=True, env=_env(), timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("leangrad: error: ")
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_python_dash_m_leangrad_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "leangrad", "--help"], capture_output=True,
                          text=True, env=_env(), timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0 and "usage: leangrad" in proc.stdout
    assert json.dumps(proc.stderr) == '""'
