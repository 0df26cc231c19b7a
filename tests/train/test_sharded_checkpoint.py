"""Sharded checkpoints: under ``parallel="fsdp"`` every rank writes its
own shards with torch.distributed.checkpoint into ``step-N.dcp/`` (renamed into place once
complete) beside rank 0's side file. On 2 local processes (gloo, float64): a resume ends
bit-equal to the uninterrupted run; a rank SIGKILLed mid-save leaves only complete
checkpoints, and a resume from the newest ends bit-equal too; a 2-rank checkpoint resumes
on 1 process with a plain model (DCP reshards) within rounding of the 2-rank
continuation. On one process: damaged shards, a foreign pickle in DCP's metadata, and the
run-directory housekeeping (prune, remove_run, run_marks) of these directories."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leangrad import models, train
from leangrad.train import _sharded as sharded
from leangrad.train import _snapshot as snapshot
from two_processes import SRC, TESTS, _free_port, run_two

COMMON = r'''
import json, os, signal, sys
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist
from leangrad import models, train

torch.set_num_threads(1)
out_dir = Path(sys.argv[1])
KW = {"data": "synthetic", "data_options": {"n": 160}, "optimizer": "adam", "lr": 0.01,
      "progress": False, "track_memory_every": 0, "batch_size": 8, "plots": False,
      "parallel": "fsdp", "test_fraction": 0.0, "dtype": "float64", "checkpoint_every": 3}
def build():
    torch.manual_seed(0)
    return models.mlp(64, 32, 3, 10)
def weights(model):
    return {n: p.full_tensor().flatten().tolist() for n, p in model.named_parameters()}
'''

KILL = COMMON + r'''
dist.init_process_group("gloo", timeout=timedelta(seconds=20))  # rank 0 fails fast after
ctx = train.init_distributed(torch.device("cpu"))
import torch.distributed.checkpoint.state_dict_saver as saver
real_save, saves = saver.save, []
def save_then_die(*args, **kwargs):
    result = real_save(*args, **kwargs)
    saves.append(1)
    if len(saves) == 2 and ctx.rank == 1:  # step 6: its shards are written, not renamed
        os.kill(os.getpid(), signal.SIGKILL)
    return result
saver.save = save_then_die
train.fit(build(), max_steps=6, **KW, out=out_dir / "killed")
'''

WORKER = COMMON + r'''
ctx = train.init_distributed(torch.device("cpu"))
whole = train.fit(build(), max_steps=6, **KW, out=out_dir / "whole")
local = sum(p.to_local().numel() for p in whole.model.parameters())
train.fit(build(), max_steps=3, **KW, out=out_dir / "part")
part = train.fit(build(), max_steps=6, **KW, out=out_dir / "part", resume=out_dir / "part")
killed = train.fit(build(), max_steps=6, **KW, out=out_dir / "killed",
                   resume=out_dir / "killed")
single = train.fit(build(), max_steps=6, **KW, out=out_dir / "single",
                   resume=out_dir / "single")  # a one-process step-000003.pt, sharded
json.dump({"whole": weights(whole.model), "part": weights(part.model),
           "killed": weights(killed.model), "single": weights(single.model), "local": local,
           "checkpoint": str(whole.checkpoint)}, open(out_dir / f"rank{ctx.rank}.json", "w"))
dist.barrier()  # no rank tears its connections down while another still uses them
dist.destroy_process_group()
'''


def _launch_killed(tmp_path: Path) -> list[subprocess.CompletedProcess[bytes]]:
    """Run :data:`KILL` on 2 processes, as :func:`run_two` does, but expecting failure."""
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
           "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]  # fmt: skip
    done = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return done


def _names(directory: Path) -> list[str]:
    return [p.name for p in snapshot.list_checkpoints(directory)]


ONE = {"data": "synthetic", "data_options": {"n": 160}, "optimizer": "adam", "lr": 0.01,
       "progress": False, "track_memory_every": 0, "batch_size": 16, "plots": False,
       "max_steps": 6, "test_fraction": 0.0, "dtype": "float64", "checkpoint_every": 3}  # fmt: skip
"""One process, the 2-rank runs' global batch (2 x 8)."""


def _fit_one(resume: Path | None, out: Path | None = None, **kw: int) -> train.FitResult:
    torch.manual_seed(0)
    return train.fit(models.mlp(64, 32, 3, 10), **{**ONE, **kw}, resume=resume, out=out)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The killed run (2 processes, rank 1 SIGKILLed in step 6's save) and a one-process
    run of 3 steps, then the 2-rank worker: whole, part + resume, the killed run resumed
    and the one-process run resumed. What the kill left is checked first, before the
    resume changes it."""
    tmp_path = tmp_path_factory.mktemp("sharded")
    _fit_one(None, tmp_path / "single", max_steps=3)
    killed = _launch_killed(tmp_path)
    assert killed[1].returncode == -9, killed[1].stdout.decode()[-2000:]
    assert killed[0].returncode != 0  # its peer vanished mid-save
    ckpts = tmp_path / "killed" / "checkpoints"
    # step 6's shards were written, but under the temp name: only step 3 counts
    assert sorted(p.name for p in (ckpts / ".step-000006.dcp.tmp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # fmt: skip
    assert _names(ckpts) == ["step-000003.dcp"]
    assert snapshot.resolve_resume(tmp_path / "killed") == ckpts / "step-000003.dcp"
    run_two(WORKER, tmp_path)
    return tmp_path


def _whole(runs: Path) -> dict[str, list[float]]:
    return dict(json.loads((runs / "rank0.json").read_text())["whole"])


@pytest.mark.slow
def test_resume_and_resume_after_sigkill_end_bit_equal(runs: Path) -> None:
    ranks = [json.loads((runs / f"rank{r}.json").read_text()) for r in range(2)]
    whole = ranks[0]["whole"]
    for r in ranks:
        assert r["whole"] == whole and r["part"] == whole and r["killed"] == whole  # bit-equal
        assert r["local"] <= sum(len(v) for v in whole.values()) // 2 + 64  # half each
        assert r["checkpoint"].endswith("step-000006.dcp")
    for run in ("whole", "part", "killed"):
        assert _names(runs / run / "checkpoints") == ["step-000003.dcp", "step-000006.dcp"]
        assert not [p for p in (runs / run / "checkpoints").iterdir() if p.name[0] == "."]
    ckpt = runs / "whole" / "checkpoints" / "step-000003.dcp"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", snapshot.SIDE_FILE]
    side = snapshot.load_checkpoint(ckpt)  # the side file: no weights in it
    assert side["step"] == 3 and "model" not in side and side["config"]["world_size"] == 2
    assert sorted(side["dcp_files"]) == files[:3] and len(side["rng_ranks"]) == 2


@pytest.mark.slow  # its fixture runs two processes, a killed run and resumes: minutes
def test_one_process_checkpoint_resumes_sharded(runs: Path) -> None:
    single = json.loads((runs / "rank0.json").read_text())["single"]
    assert _names(runs / "single" / "checkpoints") == ["step-000003.pt", "step-000006.dcp"]
    for n, want in _whole(runs).items():  # a different split of the same batches
        torch.testing.assert_close(torch.tensor(single[n]), torch.tensor(want), rtol=0,
                                   atol=1e-12)  # fmt: skip


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_process(runs: Path) -> None:
    ckpt = runs / "whole" / "checkpoints" / "step-000003.dcp"
    one = _fit_one(ckpt, runs / "one")
    assert one.steps == 6 and _names(runs / "one" / "checkpoints") == ["step-000006.pt"]
    for n, p in one.model.named_parameters():
        assert type(p.data) is torch.Tensor  # not a DTensor
        got, want = p.detach().flatten(), torch.tensor(_whole(runs)[n], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with pytest.raises(train.CheckpointError, match=r"global batch .*: 8 x 2 there, 8 x 1 here"):
        torch.manual_seed(0)
        train.fit(models.mlp(64, 32, 3, 10), **{**ONE, "batch_size": 8}, resume=ckpt)  # type: ignore[arg-type]


@pytest.mark.slow  # its fixture runs two processes, a killed run and resumes: minutes
def test_damaged_shard_or_foreign_metadata_is_refused_naming_it(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = runs / "whole" / "checkpoints" / "step-000003.dcp"
    bad = runs / "bad" / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, bad)
    blob = bytearray((bad / "__1_0.distcp").read_bytes())
    blob[len(blob) // 2] ^= 1
    (bad / "__1_0.distcp").write_bytes(bytes(blob))
    with pytest.raises(train.CheckpointError, match=r"__1_0.distcp changed after it was"):
        _fit_one(bad)
    (bad / "__1_0.distcp").unlink()
    with pytest.raises(train.CheckpointError, match=r"damaged \(__1_0.distcp is missing\)"):
        _fit_one(bad)

    evil = runs / "evil" / "checkpoints" / ckpt.name  # a pickle that would run code, with
    shutil.copytree(ckpt, evil)  # its checksum recorded: only the allowlist stops it
    (evil / ".metadata").write_bytes(pickle.dumps(_Boom()))
    side = snapshot.load_checkpoint(evil)
    side["dcp_files"][".metadata"] = sharded._digest(evil / ".metadata")
    snapshot.save_checkpoint(evil / snapshot.SIDE_FILE, side)
    with pytest.raises(train.CheckpointError, match=r"refused to unpickle builtins.print"):
        _fit_one(evil)
    assert "ran code" not in capsys.readouterr().out


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("ran code from the checkpoint",))


def test_metadata_unpickler_refuses_anything_but_dcp_types(tmp_path: Path) -> None:
    with pytest.raises(train.CheckpointError, match=r"refused to unpickle builtins.print"):
        (tmp_path / "m").write_bytes(pickle.dumps({"x": _Boom()}))
        with open(tmp_path / "m", "rb") as f:
            sharded._MetadataUnpickler(f, tmp_path).load()
    with open(tmp_path / "m", "wb") as f:
        pickle.dump([torch.Size([2, 3]), torch.float64, Path("a")], f)
    with open(tmp_path / "m", "rb") as f:
        assert sharded._MetadataUnpickler(f, tmp_path).load() == [
            torch.Size([2, 3]), torch.float64, Path("a")]  # fmt: skip


def _fake_dcp(directory: Path, step: int, *, complete: bool = True) -> Path:
    d = directory / snapshot.checkpoint_name(step, sharded=True)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        snapshot.save_checkpoint(d / snapshot.SIDE_FILE, {"step": step})
    return d


def test_listing_prune_and_remove_run_handle_directories_and_stale_temps(
    tmp_path: Path,
) -> None:
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _fake_dcp(ckpts, step)
    snapshot.save_checkpoint(ckpts / "step-000008.pt", {"step": 8})
    _fake_dcp(ckpts, 10, complete=False)  # no side file: not a checkpoint
    stale = snapshot.temp_dir(ckpts / "step-000012.dcp")
    stale.mkdir()
    (ckpts / ".step-000004.dcp.old-77").mkdir()
    (ckpts / ".step-000014.pt.tmp-99").write_bytes(b"half")
    want = ["step-000002.dcp", "step-000004.dcp", "step-000006.dcp", "step-000008.pt"]
    assert _names(ckpts) == want
    assert snapshot.resolve_resume(tmp_path) == ckpts / "step-000008.pt"
    assert snapshot.resolve_resume(ckpts / "step-000004.dcp") == ckpts / "step-000004.dcp"
    assert snapshot.load_checkpoint(ckpts / "step-000004.dcp")["step"] == 4
    assert snapshot.run_marks(tmp_path) == [ckpts / n for n in want]
    assert snapshot.describe_marks(snapshot.run_marks(tmp_path)) == (
        "checkpoints/step-000002.dcp .. step-000008.pt (4)")

    snapshot.prune(ckpts, 2)
    assert _names(ckpts) == ["step-000006.dcp", "step-000008.pt"]
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step-000006.dcp", "step-000008.pt", "step-000010.dcp"]  # fmt: skip

    final = ckpts / "step-000006.dcp"  # written again: replaced whole
    tmp = snapshot.temp_dir(final)
    tmp.mkdir()
    snapshot.save_checkpoint(tmp / snapshot.SIDE_FILE, {"step": 6, "new": True})
    snapshot.publish_dir(tmp, final)
    assert snapshot.load_checkpoint(final)["new"] and not tmp.exists()
    assert not any(p.name.startswith(".") for p in ckpts.iterdir())

    (tmp_path / "metrics.jsonl").write_text("")
    stale.mkdir()
    gone = snapshot.remove_run(tmp_path)
    assert {ckpts / "step-000006.dcp", ckpts / "step-000008.pt", stale} <= set(gone)
    # a step-*.dcp without its side file is not leangrad's: left alone, as other files are
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000010.dcp"]


def test_optimizer_state_rekeys_between_index_and_name_both_ways() -> None:
    torch.manual_seed(0)
    net = models.mlp(8, 4, 1, 3)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(5, 8)).sum().backward()
    opt.step()
    plain = opt.state_dict()
    named = sharded.optimizer_state_keyed(net, opt, plain, by_name=True)
    names = [n for n, _ in net.named_parameters()]
    assert list(named["state"]) == names and named["param_groups"][0]["params"] == names
    assert sharded.optimizer_state_keyed(net, opt, named, by_name=True) == named  # as is
    back = sharded.optimizer_state_keyed(net, opt, named, by_name=False)
    assert back["param_groups"] == plain["param_groups"]
    assert back["state"].keys() == plain["state"].keys()
    assert all(back["state"][i]["exp_avg"] is plain["state"][i]["exp_avg"] for i in plain["state"])
