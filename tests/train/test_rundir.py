"""One run per directory, and only finite checkpoints ( no mixed-up or lost runs).

A fresh run into a directory that holds another run is refused and leaves it untouched;
``overwrite`` deletes exactly that run's files and starts over; ``resume`` continues it
bit-exactly. An update that makes the weights (or the optimizer state) NaN/Inf stops the
run at that step, is never saved, and the checkpoint ``--resume`` then picks is finite.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from leangrad import LeangradError, train
from leangrad.cli import main
from leangrad.train import _snapshot as snapshot
from train_cases import SMALL, Trap, assert_equal, weights

RUN = ["--data", "synthetic", "--data-opt", "n=160", "--batch-size", "32", "--epochs", "5",
       "--track-memory-every", "0", "--no-progress", "--no-plots"]  # fmt: skip
"""The CLI spelling of ``SMALL`` with 5 epochs (4 steps each)."""


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and mtime."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def _steps(metrics: Path) -> list[int]:
    return [r["step"] for r in train.read_metrics(metrics) if r["kind"] == "step"]


def _all_finite(path: Path) -> bool:
    payload = train.load_checkpoint(path)
    named = snapshot._tensors(payload["model"], "model") + snapshot._tensors(
        payload["optimizer"], "opt"
    )
    return not snapshot.non_finite(named)


# -- one run per directory ---------------------------------------------------------------


def test_fresh_run_into_an_old_runs_directory_is_refused_and_touches_nothing(tmp_path) -> None:
    train.fit("mlp", **SMALL, max_steps=4, checkpoint_every=2, out=tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(snapshot.RunDirectoryError) as info:
        train.fit("mlp", **SMALL, seed=1, max_steps=2, out=tmp_path)
    msg = str(info.value)
    assert isinstance(info.value, LeangradError)
    assert msg.startswith(f"{tmp_path} already holds a training run (checkpoints/"
                          "step-000002.pt .. step-000004.pt (2), metrics.jsonl)")  # fmt: skip
    assert f"Continue that run with --resume {tmp_path}" in msg
    assert "start over with --overwrite" in msg and "(no other file)" in msg
    assert _snapshot(tmp_path) == before  # bytes and mtimes


def test_metrics_alone_mark_a_run_and_unrelated_files_do_not(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    train.fit("mlp", **SMALL, max_steps=1, out=tmp_path)  # a directory with other files: fine
    for p in snapshot.list_checkpoints(tmp_path / "checkpoints"):
        p.unlink()  # a run killed before its first checkpoint leaves only metrics
    with pytest.raises(snapshot.RunDirectoryError, match=r"holds a training run \(metrics.jsonl\)"):
        train.fit("mlp", **SMALL, max_steps=1, out=tmp_path)


def test_overwrite_deletes_only_the_old_runs_files(tmp_path) -> None:
    train.fit("mlp", **{**SMALL, "plots": True}, epochs=2, max_steps=6, checkpoint_every=2,
              out=tmp_path)
    ckpt_dir = tmp_path / "checkpoints"
    assert (tmp_path / "training.png").exists() and len(snapshot.list_checkpoints(ckpt_dir)) == 3
    (ckpt_dir / ".step-000008.pt.tmp-4242").write_bytes(b"half a file")  # a killed write
    (tmp_path / "notes.txt").write_text("mine")
    (ckpt_dir / "README").write_text("mine too")
    res = train.fit("mlp", **SMALL, seed=1, max_steps=2, out=tmp_path, overwrite=True)
    assert [p.name for p in snapshot.list_checkpoints(ckpt_dir)] == ["step-000002.pt"]
    assert train.load_checkpoint(res.checkpoint)["config"]["seed"] == 1  # the new run's
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["README", "step-000002.pt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "training.png").exists()  # the old run's plot, not redrawn
    recs = train.read_metrics(res.metrics)
    assert _steps(res.metrics) == [1, 2]
    assert [r["event"] for r in recs if r["kind"] == "event"] == ["start", "max_steps"]
    assert all(r["config"]["seed"] == 1 for r in recs if r.get("event") == "start")


def test_resume_continues_the_old_run_bit_exactly(tmp_path) -> None:
    kw = dict(SMALL, epochs=5)
    ref = train.fit("mlp", **kw, max_steps=10, out=tmp_path / "ref")
    run = tmp_path / "run"
    train.fit("mlp", **kw, max_steps=6, checkpoint_every=4, out=run)
    with pytest.raises(snapshot.RunDirectoryError):
        train.fit("mlp", **kw, max_steps=10, out=run)  # a run directory reused by mistake
    again = train.fit("mlp", **kw, max_steps=10, checkpoint_every=4, out=run, resume=run)
    assert again.steps == 10
    assert_equal(weights(again.model), weights(ref.model))
    assert _steps(again.metrics) == list(range(1, 11))


def test_resume_and_overwrite_together_are_refused(tmp_path) -> None:
    train.fit("mlp", **SMALL, max_steps=2, out=tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(snapshot.RunDirectoryError, match="--resume and --overwrite contradict"):
        train.fit("mlp", **SMALL, max_steps=4, out=tmp_path, resume=tmp_path, overwrite=True)
    assert _snapshot(tmp_path) == before


def test_resume_into_another_runs_directory_is_refused(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    train.fit("mlp", **SMALL, max_steps=2, out=a)
    train.fit("mlp", **SMALL, max_steps=3, out=b)
    before = _snapshot(b)
    with pytest.raises(snapshot.RunDirectoryError, match=rf"{b} already holds another training run"
                       r" .*step-000002.pt, is not from it"):  # fmt: skip
        train.fit("mlp", **SMALL, max_steps=4, out=b, resume=a)
    assert _snapshot(b) == before
    res = train.fit("mlp", **SMALL, max_steps=4, out=tmp_path / "c", resume=a)  # empty: fine
    assert res.steps == 4


def test_cli_refuses_in_one_line_exit_2_then_overwrite_and_resume(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    first = ["train", *RUN, "--max-steps", "6", "--checkpoint-every", "2", "--out", str(out)]
    assert main(first) == 0
    capsys.readouterr()
    before = _snapshot(out)
    assert main(["train", *RUN, "--max-steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"leangrad: error: {out} already holds a training run")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"--resume {out}" in err and "--overwrite" in err
    assert main(["train", "--resume", str(out), "--overwrite", "--no-progress"]) == 2
    assert "--resume and --overwrite contradict" in capsys.readouterr().err
    assert _snapshot(out) == before
    # --resume continues the old run: its checkpoint's settings, bit-exactly
    assert main(["train", "--resume", str(out), "--max-steps", "9", "--no-progress",
                 "--no-plots"]) == 0  # fmt: skip
    ref = train.fit("mlp", **SMALL, epochs=5, max_steps=9)
    final = train.load_checkpoint(snapshot.list_checkpoints(out / "checkpoints")[-1])
    assert final["step"] == 9
    assert_equal(final["model"], weights(ref.model))
    # --overwrite starts over
    assert main(["train", *RUN, "--max-steps", "2", "--seed", "1", "--out", str(out),
                 "--overwrite"]) == 0  # fmt: skip
    assert [p.name for p in snapshot.list_checkpoints(out / "checkpoints")] == ["step-000002.pt"]
    assert _steps(out / "metrics.jsonl") == [1, 2]


# -- only finite checkpoints -------------------------------------------------------------


@contextlib.contextmanager
def _poison(at: int, what: str = "weight") -> Iterator[None]:
    """After the ``at``-th optimizer step in this process, write NaN into the optimizer's
    first parameter (``"weight"``) or inf into its Adam ``exp_avg_sq`` (``"state"``)."""
    calls = 0

    def hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        nonlocal calls
        calls += 1
        if calls == at:
            p = opt.param_groups[0]["params"][0]
            with torch.no_grad():
                if what == "weight":
                    p.view(-1)[0] = float("nan")
                else:
                    opt.state[p]["exp_avg_sq"].view(-1)[0] = float("inf")

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_nan_update_on_a_checkpoint_step_stops_there_and_is_not_saved(tmp_path) -> None:
    """The loss of step 4 is finite, its update writes NaN: the run stops at step 4, the
    last checkpoint stays step 2, and resuming from it ends as a clean run does."""
    kw = dict(SMALL, epochs=3, checkpoint_every=2)
    with _poison(at=4), pytest.raises(
        train.NonFiniteLossError,
        match=r"not finite after the update of step 4: NaN/Inf in 0\.1\.weight \(the loss "
        r"before that update was \d.*Last good checkpoint \(kept\): .*step-000002\.pt\. "
        r"Lower the learning rate \(--lr / lr=, now 0\.01\)",
    ):
        train.fit("mlp", **kw, out=tmp_path)
    ckpts = snapshot.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002.pt"]
    assert snapshot.resolve_resume(tmp_path) == ckpts[0] and _all_finite(ckpts[0])
    recs = train.read_metrics(tmp_path / "metrics.jsonl")
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3]  # step 4 never logged as done
    assert recs[-1]["event"] == "non-finite weights" and recs[-1]["step"] == 4
    again = train.fit("mlp", **kw, resume=tmp_path, out=tmp_path)
    clean = train.fit("mlp", **kw)
    assert_equal(weights(again.model), weights(clean.model))


def test_nan_update_between_checkpoints_stops_at_the_next_loss(tmp_path) -> None:
    nan_loss = r"loss is nan at step 4 .*step-000002\.pt"
    with _poison(at=3), pytest.raises(train.NonFiniteLossError, match=nan_loss):
        train.fit("mlp", **SMALL, epochs=3, checkpoint_every=2, out=tmp_path)
    ckpts = snapshot.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002.pt"] and _all_finite(ckpts[0])


@pytest.mark.parametrize(("per_layer", "at"), [(False, 4), (True, 3 * 6 + 1)])
def test_non_finite_optimizer_state_is_not_saved(tmp_path, per_layer, at) -> None:
    """Adam's exp_avg_sq overflowing to inf leaves the weights finite (its update is 0)
    but the state broken: not saved either. Per-layer steps: 6 optimizers, 6 calls a step."""
    with _poison(at=at, what="state"), pytest.raises(
        train.NonFiniteLossError, match=r"step 4: NaN/Inf in optimizer state exp_avg_sq of "
        r"\d[\w.]*(weight|bias) \("):  # fmt: skip
        train.fit("mlp", **SMALL, epochs=3, checkpoint_every=2, out=tmp_path,
                  step_per_layer=per_layer, measure_saving=False)  # fmt: skip
    assert [p.name for p in snapshot.list_checkpoints(tmp_path / "checkpoints")] == [
        "step-000002.pt"
    ]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_after_a_nan_update_saves_nothing(tmp_path) -> None:
    with _poison(at=3), pytest.raises(train.NonFiniteLossError,
                                      match=r"update of step 3: .*none written"):  # fmt: skip
        train.fit(Trap(3, "sigint"), **SMALL, epochs=3, checkpoint_every=100, out=tmp_path)
    assert snapshot.list_checkpoints(tmp_path / "checkpoints") == []


@pytest.mark.parametrize(
    ("lr", "says", "saved"),
    [
        # (--lr inf is refused as a user error before the run: exit 2, tests/test_cli_errors)
        # 1e30: finite weights of ~1e29 after step 1 (saved), whose forward then overflows
        ("1e30", "loss is nan at step 2", ["step-000001.pt"]),
    ],
)  # fmt: skip
def test_huge_learning_rate_exits_3_naming_the_step(tmp_path, capsys, lr, says, saved) -> None:
    out = tmp_path / "run"
    code = main(["train", *RUN, "--optimizer", "sgd", "--lr", lr, "--max-steps", "3",
                 "--checkpoint-every", "1", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"leangrad: error: {says}")
    assert [p.name for p in snapshot.list_checkpoints(out / "checkpoints")] == saved
    assert all(_all_finite(p) for p in snapshot.list_checkpoints(out / "checkpoints"))


def test_cli_nan_update_exits_3_and_resume_picks_a_finite_checkpoint(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    cmd = ["train", *RUN, "--max-steps", "8", "--checkpoint-every", "2", "--out", str(out)]
    with _poison(at=6):
        assert main(cmd) == 3
    err = capsys.readouterr().err
    assert "update of step 6" in err and "step-000004.pt" in err and err.count("\n") == 1
    picked = snapshot.resolve_resume(out)
    assert picked.name == "step-000004.pt" and _all_finite(picked)
    assert main(["train", "--resume", str(out), "--no-progress", "--no-plots"]) == 0
    final = snapshot.list_checkpoints(out / "checkpoints")[-1]
    assert final.name == "step-000008.pt" and _all_finite(final)


def test_resume_refuses_a_checkpoint_with_non_finite_weights(tmp_path) -> None:
    """One written by a leangrad that saved NaN weights: refused, earlier ones named."""
    train.fit("mlp", **SMALL, max_steps=4, checkpoint_every=2, out=tmp_path)
    newest = snapshot.list_checkpoints(tmp_path / "checkpoints")[-1]
    payload = train.load_checkpoint(newest)
    payload["model"]["2.bias"][0] = float("nan")
    snapshot.save_checkpoint(newest, payload)
    with pytest.raises(train.CheckpointError, match=r"step-000004.pt holds non-finite values "
                       r"\(NaN/Inf\) in model.2.bias: .*step-000002.pt"):  # fmt: skip
        train.fit("mlp", **SMALL, max_steps=6, resume=tmp_path, out=tmp_path)
