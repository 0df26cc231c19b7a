"""``leangrad train`` / ``leangrad advise`` from the command line, and a run killed with
SIGKILL then resumed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from leangrad import models, train
from leangrad.cli import main
from leangrad.train import _snapshot as snapshot


def test_train_mlp_digits_backprop(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    code = main(["train", "--model", "mlp", "--data", "digits", "--engine", "backprop",
                 "--epochs", "1", "--out", str(out), "--no-progress", "--no-plots"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0
    # every setting is printed, defaults included
    for shown in ("model=mlp", "data=digits", "engine=backprop", "epochs=1", "batch_size=64",
                  "lr=0.01", "optimizer=adam", "seed=0", "step_per_layer=False"):  # fmt: skip
        assert shown in text
    assert "completed: 22 steps" in text  # 1437 training digits // 64
    assert snapshot.list_checkpoints(out / "checkpoints")[-1].name == "step-000022.pt"


def test_train_moonwalk_on_a_moonwalk_model_with_step_per_layer(tmp_path, capsys) -> None:
    code = main(["train", "--model", "submersive_cnn", "--data", "digits", "--engine",
                 "moonwalk", "--epochs", "1", "--batch-size", "128", "--step-per-layer",
                 "--out", str(tmp_path), "--no-progress", "--no-plots"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "completed: 11 steps" in text
    assert "step-per-layer gradient memory (moonwalk, tracker" in text


def test_unknown_names_exit_2_listing_known(tmp_path, capsys) -> None:
    assert main(["train", "--model", "nope", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "known models: gru_lm, mlp, resnet, revnet, submersive_cnn" in capsys.readouterr().err
    assert main(["train", "--engine", "nope", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "unknown engine 'nope'; known engines: accumulate, backprop" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "advise"])  # advise: the same command
def test_plan_recommends_or_says_nothing_fits(capsys, command: str) -> None:
    base = [command, "--model", "mlp", "--batch-size", "8", "--engines",
            "backprop,checkpoint,moonwalk", "--repeats", "1", "--no-progress"]  # fmt: skip
    assert main([*base, "--budget", "2GiB"]) == 0
    text = capsys.readouterr().out
    assert "engine" in text and "verdict" in text
    assert "chosen: " in text and "n/a: engine 'moonwalk' needs a leangrad.Chain" in text
    assert main([*base, "--budget", "1KiB"]) == 1
    text = capsys.readouterr().out
    assert "nothing fits 1 KiB: the smallest peak found is" in text


def test_plan_with_an_optimizer_tries_per_layer_steps(capsys) -> None:
    args = ["plan", "--model", "mlp", "--batch-size", "8", "--engines", "backprop,checkpoint",
            "--repeats", "1", "--no-progress", "--optimizer", "sgd", "--budget", "2GiB"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "optimizer=sgd" in text
    assert "backprop, step per layer" in text and "checkpoint, step per layer" in text


def _env() -> dict[str, str]:
    src = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "src")
    return {**os.environ, "PYTHONPATH": os.path.abspath(src), "OMP_NUM_THREADS": "1"}


RUN = ["--model", "mlp", "--data", "synthetic", "--batch-size", "16", "--epochs", "1000",
       "--checkpoint-every", "5", "--threads", "1", "--track-memory-every", "0",
       "--no-progress", "--no-plots"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigkill_mid_run_then_resume_is_bit_exact(tmp_path) -> None:
    """SIGKILL a training process mid-run: every checkpoint on disk loads, at most one
    checkpoint interval (5 steps) is lost, and resuming ends bit-exactly where an
    uninterrupted run of the same length ends."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "leangrad.cli", "train", *RUN, "--out", str(out)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        found = snapshot.list_checkpoints(out / "checkpoints")
        if found and int(found[-1].stem.split("-")[1]) >= 10:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpts = snapshot.list_checkpoints(out / "checkpoints")
    for p in ckpts:  # nothing corrupt, temp files are never listed
        train.load_checkpoint(p)
    last = train.load_checkpoint(ckpts[-1])["step"]
    logged = max(r["step"] for r in train.read_metrics(out / "metrics.jsonl"))
    assert logged - last <= 5
    target = last + 7
    resumed = subprocess.run(
        [sys.executable, "-m", "leangrad.cli", "train", "--resume", str(out), "--max-steps",
         str(target), "--threads", "1", "--no-progress", "--no-plots"],
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resume={out}" in resumed.stdout and "model=mlp" in resumed.stdout
    final = train.load_checkpoint(snapshot.list_checkpoints(out / "checkpoints")[-1])
    assert final["step"] == target
    ref = train.fit("mlp", "synthetic", batch_size=16, epochs=1000, max_steps=target,
                    progress=False, track_memory_every=0)  # fmt: skip
    for k, v in ref.model.state_dict().items():
        assert torch.equal(final["model"][k], v), k


class _SigintAt3(torch.nn.Module):
    """An MLP that sends its own process SIGINT during its third forward call."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.net = models.mlp(input_shape[0], 16, 1, 10)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return self.net(x)


def sigint_model(input_shape: tuple[int, ...]) -> torch.nn.Module:
    """``module:factory`` target for the test below (gets the data's example shape)."""
    return _SigintAt3(input_shape)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_writes_a_checkpoint_and_exits_130(tmp_path, capsys) -> None:
    code = main(["train", "--model", f"{__name__}:sigint_model", "--data", "synthetic",
                 "--out", str(tmp_path), "--no-progress", "--no-plots"])  # fmt: skip
    assert code == 130
    assert "interrupted: 3 steps" in capsys.readouterr().out
    assert train.load_checkpoint(tmp_path / "checkpoints" / "step-000003.pt")["step"] == 3


def test_engine_options_are_parsed_and_checked(tmp_path, capsys) -> None:
    base = ["train", "--engine", "checkpoint", "--max-steps", "2", "--out", str(tmp_path),
            "--no-progress", "--no-plots"]  # fmt: skip
    assert main([*base, "--engine-opt", "segments=2"]) == 0
    assert "engine_options={'segments': 2}" in capsys.readouterr().out
    assert main([*base, "--engine-opt", "bogus=1", "--out", str(tmp_path / "b")]) == 2
    assert "engine 'checkpoint' has no option 'bogus'" in capsys.readouterr().err
    assert train.parse_options(["a=1", "b=0.5", "c=true", "d=none", "e=sqrt"]) == {
        "a": 1, "b": 0.5, "c": True, "d": None, "e": "sqrt"}  # fmt: skip


_FACTORIES = '''
import dataclasses
import torch
from torch import nn


@dataclasses.dataclass
class Output:  # what Hugging Face's ModelOutput looks like to a loss: .logits
    logits: torch.Tensor


class WithOutput(nn.Module):
    def __init__(self, features: int, classes: int, wrap: bool) -> None:
        super().__init__()
        self.lin, self.wrap = nn.Linear(features, classes), wrap

    def forward(self, x):
        y = self.lin(x.flatten(1))
        return Output(y) if self.wrap else {"scores": y}


def logits_model(input_shape, num_classes):
    return WithOutput(input_shape[-1] * input_shape[-2], num_classes, True)


def opaque_model(input_shape, num_classes):
    return WithOutput(input_shape[-1] * input_shape[-2], num_classes, False)
'''


def _console(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``leangrad`` console script as a user runs it, from ``tmp_path``."""
    exe = os.path.join(os.path.dirname(sys.executable), "leangrad")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([exe, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


@pytest.mark.slow
def test_a_factory_in_the_current_directory_returning_a_model_output(tmp_path) -> None:
    (tmp_path / "mymodels.py").write_text(_FACTORIES)
    base = ["train", "--data", "digits", "--max-steps", "2", "--batch-size", "8",
            "--no-progress", "--no-plots"]  # fmt: skip
    done = _console(tmp_path, *base, "--model", "mymodels:logits_model", "--out", "a")
    assert done.returncode == 0, done.stderr
    assert "max_steps: 2 steps" in done.stdout
    done = _console(tmp_path, *base, "--model", "mymodels:opaque_model", "--out", "b")
    assert done.returncode == 2
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "returned dict" in err[0] and ".logits" in err[0], done.stderr
    done = _console(tmp_path, *base, "--model", "nomodule:factory", "--out", "c")
    assert done.returncode == 2
    assert "or in the current directory" in done.stderr and "PYTHONPATH" in done.stderr


def test_train_budget_plans_among_the_engines_named(tmp_path, capsys) -> None:
    base = ["train", "--model", "mlp", "--data", "digits", "--max-steps", "1",
            "--batch-size", "16", "--no-progress", "--no-plots"]  # fmt: skip
    code = main([*base, "--budget", "2GiB", "--engines", "checkpoint",
                 "--out", str(tmp_path / "a")])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert "plan_engines=checkpoint " in text
    # Every checkpoint candidate fits 2 GiB; the fastest wins, and which one that is
    # depends on the machine's load: any of checkpoint's options is right.
    assert re.search(r"\nchosen: checkpoint(\([^)]*\))?(, step per layer)? — ", text), text
    assert main([*base, "--engines", "checkpoint", "--out", str(tmp_path / "b")]) == 2
    assert "--engines lists the engines a plan may choose from and needs --budget" in (
        capsys.readouterr().err)
    assert main([*base, "--budget", "2GiB", "--engines", "nope",
                 "--out", str(tmp_path / "c")]) == 2  # fmt: skip
    assert "unknown engine 'nope'" in capsys.readouterr().err
