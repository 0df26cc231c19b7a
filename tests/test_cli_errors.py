"""Every user error of the ``leangrad`` command: one line ``leangrad: error: ...`` naming
the option and the fix, exit code 2, no traceback — and refused before any work."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import leangrad_bench as bench
from leangrad import _cli_types, cli
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
    (["train", "--seed", str(2**64)], "argument --seed: must be at most 2**63 - 1"),
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
    (["train", "--out", "{file}/run"],
     "--out {file}/run: {file} is a file, so no directory can be made there; name a directory"),
    (["train", "--model", "nope"], "unknown model 'nope'; known models: gru_lm, mlp"),
    (["train", "--data", "nope"], "unknown dataset 'nope'; known datasets: digits"),
    (["train", "--engine", "nope"], "unknown engine 'nope'; known engines: accumulate, backprop"),
    (["train", "--engine", "rad+checkpoint"], "write the base engine first"),
    (["train", "--engine", "forward+fad"], "engine 'forward+fad' cannot work"),
    (["train", "--model", "no.such.mod:factory"], "cannot import 'no.such.mod:factory'"),
    (["train", "--model", "os:getcwd"], "model factory 'os:getcwd' returned str, not a nn.Module"),
    (["train", "--model", "os:path"], "model spec 'os:path' names a module, not a factory"),
    (["train", "--model", "torch.nn:Linear"],
     "model factory 'torch.nn:Linear' cannot be called with no arguments (missing a required "
     "argument: 'in_features'); give its arguments with --model-opt KEY=VALUE"),
    (["train", "--engine", "checkpoint", "--engine-opt", "segments=abc"],
     "--engine-opt (engine 'checkpoint'): segments must be a positive int"),
    (["train", "--engine-opt", "nosuch=1"], "engine 'backprop' has no option 'nosuch'"),
    (["train", "--engine-opt", "foo"], "option 'foo' is not key=value"),
    (["train", "--engine", "rad", "--engine-opt", "fraction=2"],
     "--engine-opt (engine 'rad'): fraction must be a number in (0, 1], got 2"),
    (["train", "--engine", "rad", "--engine-opt", "mode=x"],
     "--engine-opt (engine 'rad'): unknown mode 'x'; known modes: "),
    (["train", "--engine", "nosuch", "--engine-opt", "mode=x"], "unknown engine 'nosuch'"),
    (["train", "--model", "submersive_cnn", "--model-opt", "channels=0"],
     "--model-opt: model 'submersive_cnn' cannot be built with channels=0 (SubmersiveConv2d: "),
    (["train", "--model-opt", "nosuch=1"], "--model-opt: model 'mlp' does not take that option"),
    (["train", "--data-opt", "nosuch=1"], "--data-opt: data 'digits' does not take that option"),
    (["train", "--data", "text:/no/such/dir", "--model", "gru_lm"],
     "--data 'text:/no/such/dir': text data: /no/such/dir does not exist"),
    (["train", "--data", "text:{file}", "--model", "gru_lm"],
     "--data 'text:{file}': text data: 16 characters is too short for one window of length 64"),
    (["train", "--data", "text:{file}", "--model", "gru_lm", "--data-opt", "length=0"],
     "--data-opt (data 'text:{file}'): length must be an integer >= 1, got 0"),
    (["train", "--data", "synthetic", "--data-opt", "n=abc"],
     "--data-opt (data 'synthetic'): n must be an integer >= 1, got 'abc'"),
    (["train", "--data", "synthetic", "--data-opt", "shape=abc"],
     "every input dimension must be a positive integer, got 'abc'; write e.g. shape=(3, 32, 32)"),
    (["train", "--data", "synthetic", "--data-opt", "shape=3,0,2"],
     "every input dimension must be a positive integer, got (3, 0, 2)"),
    (["train", "--data", "synthetic", "--data-opt", "dtype=int8"],
     "--data-opt (data 'synthetic'): dtype must be a floating-point torch dtype"),
    (["train", "--data", "synthetic", "--data-opt", "seed=x"], "seed must be an integer >= 0"),
    (["train", "--data-opt", "flatten=3"], "--data-opt (data 'digits'): flatten must be true or"),
    (["train", "--data-opt", "device=foo"], "device 'foo' is not a torch device"),
    (["train", "--model", "submersive_cnn", "--data", "synthetic"], "needs image inputs"),
    (["train", "--resume", "/no/such/run"], "nothing to resume"),
    (["train", "--resume", "{dir}", "--overwrite"], "--resume"),
    (["plan", "--model-opt", "depth=0"], "--model-opt: model 'mlp' cannot be built with depth=0"),
    (["train", "--budget", "1KiB"], "nothing fits 1 KiB"),
    (["train", "--budget", "-1GiB"], "argument --budget: budget '-1GiB' is not a size"),
    (["train", "--budget", "1e400"], "argument --budget: budget '1e400' is not a size"),
    (["train", "--budget", "64MiB", "--engine-opt", "segments=2"], "budget= chooses the engine"),
    (["train", "--nope"], "unrecognized arguments: --nope"),
    # plan (and its old name, advise)
    (["plan", "--budget", "abc"], "argument --budget: budget 'abc' is not a size"),
    (["plan", "--budget", "-1GiB"], "argument --budget: budget '-1GiB' is not a size"),
    (["plan", "--budget", "0"], "argument --budget: must be above 0 bytes, got '0'"),
    (["plan", "--budget", "1e400"], "argument --budget: budget '1e400' is not a size"),
    (["plan", "--max-step-seconds", "0"],
     "argument --max-step-seconds: `leangrad plan` (formerly advise) has no per-step time "
     "limit; drop --max-step-seconds"),
    (["advise", "--max-step-seconds", "20"], "drop --max-step-seconds"),
    (["plan", "--engines", ","], "--engines ',' names no engine; give comma-separated names"),
    (["plan", "--model", "os:path"], "names a module, not a factory"),
    (["plan", "--data", "synthetic", "--data-opt", "n=0"], "n must be an integer >= 1, got 0"),
    (["plan", "--device", "foo"], "argument --device: 'foo' is not a device"),
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
    (["bench", "{file}.toml"], "suite file {file}.toml does not exist; name a .toml file"),
    (["bench", "{suites}/nokey.toml"],
     "suite 'nokey' ({suites}/nokey.toml): an entry lacks the key 'config'"),
    (["bench", "{suites}/badtoml.toml"], "suite 'badtoml' is not valid TOML"),
    (["bench", "{suites}/runner.toml"], "suite 'runner': its runner 'no.such:run' cannot be"),
    (["bench", "{suites}/label.toml"], "suite 'label', series 'a': unknown engine labels ['zzz']"),
    (["bench", "{suites}/engine.toml"],
     "unknown engine 'nosuch'; known engines: accumulate, backprop"),
    (["bench", "baselines", "--out", "{file}/sub"], "--out {file}/sub: {file} is a file"),
    (["bench", "baselines", "--threads", "0"],
     "argument --threads: '0' in '0' is not a thread count; write N[,N...] with N >= 1"),
    (["bench", "baselines", "--threads", "1,two"], "'two' in '1,two' is not a thread count"),
    (["bench", "rad-variance", "--threads", "1,2"],
     "suite 'rad-variance' times at one thread count (1); drop --threads (suites that time "
     "at several: baselines"),
    # demo
    (["demo", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["demo", "--out", "{file}"], "argument --out: '{file}' is a file; name a directory"),
    (["demo", "--out", "{file}/sub"], "--out {file}/sub: {file} is a file"),
    # report
    (["report", "{tmp}/nothere"], "is not there: name the directory"),
    (["report", "{file}"], "is a file: name the directory"),
    (["report", "{dir}"], "no suite results (*.json lists of records)"),
    (["report", "{bad}"], "x.json is not valid JSON"),
    (["report", "{empty}"], "x.json is not valid JSON (Expecting value"),
    (["report", "{notlist}"], "no suite results (*.json lists of records) in {notlist} (x.json "
     "holds an object, not a list of records)"),
    (["report", "{emptylist}"], "(x.json is an empty list)"),
    (["report", "{values}"], "(x.json is a list of values, not of records (objects))"),
    (["report", "{nofield}"], "x.json: a record has no field 'config', which the report of suite"),
    (["report", "{nosuite}"], "(x.json holds records of no suite (no 'suite' field))"),
    (["report", "{dir}", "--wins"], "none of the files behind the README's wins table"),
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
    for name, text in (("bad", "{"), ("empty", ""), ("notlist", '{"a": 1}'), ("emptylist", "[]"),
                       ("values", "[1, 2]"),
                       ("nofield", '[{"suite": "x", "engine": "backprop", "x": 1}]'),
                       ("nosuite", '[{"model": "resnet18", "fraction": 0.5}]')):
        d = tmp_path / name
        d.mkdir()
        (d / "x.json").write_text(text)
        out[name] = str(d)
    suites = tmp_path / "suites"
    suites.mkdir()
    engine = '[[engines]]\nname = "backprop"\n'
    series = '[[series]]\nname = "a"\nconfig = {model = "mlp"}\nvalues = [1]\n'
    for name, text in (("nokey", '[[series]]\nname = "a"\n'), ("badtoml", 'description = "x\n'),
                       ("runner", 'runner = "no.such:run"\n'),
                       ("label", engine + series + 'engines = ["zzz"]\n'),
                       ("engine", '[[engines]]\nname = "nosuch"\n')):  # fmt: skip
        (suites / f"{name}.toml").write_text(text)
    out["suites"] = str(suites)
    return out


def _fill(items: list[str], places: dict[str, str]) -> list[str]:
    return [s.format(**places) for s in items]


@pytest.mark.parametrize(("args", "fragment"), [
    pytest.param(a, f, id=" ".join(a) or "<none>",
                 marks=[pytest.mark.slow] if "--budget" in a else [])  # a whole plan: ~40 s
    for a, f in CASES])  # fmt: skip
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


def _must_not_run(*_a: object, **_k: object) -> None:
    raise AssertionError("the work ran before the output was checked")


@pytest.mark.parametrize("out", ["{file}", "{file}/sub"])
@pytest.mark.parametrize("command", ["bench", "demo"])
def test_out_that_cannot_be_written_runs_nothing(
    command: str, out: str, places: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """``--out`` naming a file, or a path under one, is refused before the suite or demo
    runs (it used to run the whole suite and then lose its results)."""
    monkeypatch.setattr(bench, "run_suite", _must_not_run)
    monkeypatch.setattr(bench, "run_demo", _must_not_run)
    args = ["bench", "baselines", "--quick"] if command == "bench" else ["demo"]
    assert main([*args, "--out", out.format(**places)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and places["file"] in err and "is a file" in err


def test_out_not_writable_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(bench, "run_demo", _must_not_run)
    monkeypatch.setattr(_cli_types.os, "access", lambda *_a, **_k: False)
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"leangrad: error: --out {tmp_path}: not writable; name a directory you can write to\n"
    )


def test_out_check_leaves_nothing_behind(tmp_path: Path) -> None:
    """The writability probe removes the directories it made: a run refused for another
    reason does not leave an empty run directory."""
    out = tmp_path / "new" / "run"
    assert main(["train", "--model", "nope", *QUICK, "--out", str(out)]) == 2
    assert not (tmp_path / "new").exists()
    cli.check_out_dir(out)
    assert not (tmp_path / "new").exists()


def test_out_check_does_not_call_a_directory_another_rank_made_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun every rank probes the same run directory at once: one that another
    rank makes just after this rank looked is a directory, not "a file" (seen in CI: rank 0
    refused ``--out leangrad-run`` as a file while rank 1 probed it)."""
    out = tmp_path / "run"
    real = Path.is_dir

    def is_dir(self: Path) -> bool:
        found = real(self)
        if self == out and not found and not out.exists():
            out.mkdir()  # the other rank's probe, between this rank's two looks
        return found

    monkeypatch.setattr(Path, "is_dir", is_dir)
    cli.check_out_dir(out)  # no error
    assert out.is_dir()


def test_out_check_passes_when_another_ranks_probe_comes_and_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another rank makes the directory just before this rank's ``mkdir`` and removes it
    before ``exist_ok`` looks: "File exists" for a directory no longer there (seen in CI:
    rank 1 refused ``--out leangrad-run``, "cannot create it (File exists)")."""
    out = tmp_path / "run"
    real = Path.mkdir
    raced: list[Path] = []

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:
        if self == out and not raced:
            raced.append(self)  # the other rank made it and removed it again
            raise FileExistsError(17, "File exists", str(self))
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", mkdir)
    cli.check_out_dir(out)  # no error
    assert raced == [out]
    assert not out.exists()  # the probe still leaves nothing behind


def test_out_dir_removed_by_another_rank_between_its_checks_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Another rank made the directory to probe it and removes it again between this
    rank's ``is_dir()`` and its ``os.access``: the access check fails on a directory no
    longer there (seen in CI: rank 0 refused ``--out leangrad-run``, "not writable")."""
    out = tmp_path / "run"
    out.mkdir()
    real = os.access
    raced: list[str] = []

    def access(path: object, mode: int) -> bool:
        if Path(str(path)) == out and not raced:
            raced.append(str(path))
            out.rmdir()  # the other rank's probe leaving nothing behind
        return real(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(_cli_types.os, "access", access)
    cli.check_out_dir(out)  # no error
    assert raced == [str(out)]
    assert not out.exists()  # the probe still leaves nothing behind


def test_train_into_a_file_writes_nothing(places: dict[str, str]) -> None:
    before = Path(places["file"]).read_text()
    assert main(["train", *QUICK, "--out", places["file"]]) == 2
    assert Path(places["file"]).read_text() == before


def test_ctrl_c_outside_training_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_suite", interrupted)
    assert main(["bench", "baselines", "--quick", "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "leangrad: interrupted\n"


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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["train", "--batch-size", "0"], "argument --batch-size"),
     (["plan", "--budget", "-1GiB"], "argument --budget"),
     (["report", "/no/such/dir"], "is not there"),
     (["plan", "--max-step-seconds", "0"], "drop --max-step-seconds"),
     (["bench", "baselines", "--quick", "--out", "{file}/sub"], "is a file")],
)  # fmt: skip
def test_python_dash_m_leangrad_reports_one_line(args: list[str], fragment: str,
                                                 places: dict[str, str]) -> None:  # fmt: skip
    """A real process: ``python -m leangrad`` (so ``torchrun -m leangrad`` works too)."""
    args = _fill(args, places)
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


@pytest.mark.parametrize("argv", [["demo"], ["bench", "--list"], ["report", "results"]])
def test_benchmark_commands_without_the_benchmark_package_are_one_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pip install leangrad`` alone does not carry the benchmarks (``benchmarks/``): the
    commands that run them say how to install them, in one line, exit code 2."""
    real = importlib.metadata.entry_points

    def entry_points(**kw: Any) -> Any:  # no package registered in the group, as if absent
        return [] if kw.get("group") == cli.BENCHMARKS_GROUP else real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == "leangrad: error: " + cli.NO_BENCHMARKS.format(command=argv[0]) + "\n"
    assert "pip install -e benchmarks" in err
