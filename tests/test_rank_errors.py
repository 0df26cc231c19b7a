"""A user error under several processes prints once: rank 0 prints its line, a
rank whose line differs from rank 0's (or rank 0 has none) prints its own, prefixed
``[rank R] ``; every process exits 2; nothing waits past the timeout.

In-process: two threads as ranks 0 and 1 sharing a real in-memory store
(``torch.distributed.HashStore``). Across processes: ``python -m leangrad`` as two ranks
(torchrun's environment variables), with no store, with a store standing for torchrun's
agent store, with a gloo process group, and under torchrun itself."""

from __future__ import annotations

import datetime
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from leangrad._rank_errors import RANK_PREFIX, print_error, print_error_once
from two_processes import SRC, TESTS, _free_port

LINE = "leangrad: error: unknown model 'nope'; known models: mlp"
OTHER = "leangrad: error: heldrun: refused by rank 0 (see its message)"


def _ranks(lines: list[str | None], *, store: Store | None,
           timeout_s: float = 5.0) -> list[str]:  # fmt: skip
    """Run print_error_once as ranks 0..n-1 in threads (``None``: that rank has no error);
    what each printed. Fails if any is still waiting after timeout_s + 5 s."""
    outs = [io.StringIO() for _ in lines]

    def rank_fn(r: int, line: str) -> None:
        print_error_once(line, rank=r, world_size=len(lines), store=store,
                         file=outs[r], timeout_s=timeout_s)  # fmt: skip

    threads = [threading.Thread(target=rank_fn, args=(r, line), daemon=True)
               for r, line in enumerate(lines) if line is not None]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
        assert not t.is_alive(), "print_error_once waited past its timeout"
    return [o.getvalue() for o in outs]


def test_same_line_on_every_rank_prints_once() -> None:
    outs = _ranks([LINE, LINE, LINE], store=dist.HashStore())
    assert outs == [LINE + "\n", "", ""]


def test_rank_with_another_line_prints_it_with_its_rank() -> None:
    outs = _ranks([LINE, OTHER], store=dist.HashStore())
    assert outs == [LINE + "\n", RANK_PREFIX.format(rank=1) + OTHER + "\n"]
    assert outs[1].startswith("[rank 1] leangrad: error: ")


def test_error_on_rank_1_only_is_printed_after_a_bounded_wait() -> None:
    start = time.monotonic()
    outs = _ranks([None, LINE], store=dist.HashStore(), timeout_s=0.3)
    assert outs == ["", f"[rank 1] {LINE}\n"]
    assert time.monotonic() - start < 5  # bounded: never hangs


@pytest.mark.parametrize("timeout_s", [0.0, 0.0005, 0.3005])
def test_a_wait_under_a_millisecond_never_hangs(timeout_s: float) -> None:
    # c10d reads a zero timeout (and one under 1 ms, rounded down) as "no timeout"
    outs = _ranks([None, LINE], store=dist.HashStore(), timeout_s=timeout_s)
    assert outs == ["", f"[rank 1] {LINE}\n"]


class _BrokenStore:
    """A store whose host is gone: every call fails."""

    def __getattr__(self, name: str) -> object:
        def fail(*args: object) -> None:
            raise RuntimeError("Connection reset by peer")

        return fail


def test_a_store_that_fails_leaves_every_rank_printing() -> None:
    outs = _ranks([LINE, LINE], store=_BrokenStore())  # type: ignore[arg-type]
    assert outs == [LINE + "\n", f"[rank 1] {LINE}\n"]


def test_no_store_rank_0_prints_the_others_stay_silent() -> None:
    assert _ranks([LINE, LINE], store=None) == [LINE + "\n", ""]


def test_one_process_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    out = io.StringIO()
    print_error(LINE, file=out)
    assert out.getvalue() == LINE + "\n"


# --- two real processes -------------------------------------------------------------------

PG_WORKER = """
import datetime, sys
import torch.distributed as dist
from leangrad.cli import main
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
code = main([a.format(rank=dist.get_rank()) for a in sys.argv[1:]])
dist.destroy_process_group()
sys.exit(code)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
            "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()), **extra}  # fmt: skip


def _two(cmd: list[str], env: dict[str, str]) -> tuple[list[int], list[str]]:
    """Run ``cmd`` as ranks 0 and 1; exit codes and stderr, by rank."""
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(2)]  # fmt: skip
    errs = [p.communicate(timeout=120)[1] for p in procs]
    return [p.returncode for p in procs], errs


def _error_lines(errs: list[str]) -> list[list[str]]:
    return [[ln for ln in e.splitlines() if "leangrad: error:" in ln] for e in errs]


BAD_OPTION = [sys.executable, "-m", "leangrad", "train", "--batch-size", "0"]
BAD_OPTION_LINE = "leangrad: error: argument --batch-size: must be at least 1, got 0"


@pytest.mark.slow
def test_bad_option_on_two_processes_prints_once() -> None:
    codes, errs = _two(BAD_OPTION, _env())  # no store: rank 0 alone prints
    assert codes == [2, 2], errs
    assert _error_lines(errs) == [[BAD_OPTION_LINE], []], errs


def test_bad_option_compared_through_the_agent_store() -> None:
    port = _free_port()  # stands for the store torchrun's agent hosts for its workers
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))  # fmt: skip
    env = _env(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    codes, errs = _two(BAD_OPTION, env)
    assert codes == [2, 2], errs
    assert _error_lines(errs) == [[BAD_OPTION_LINE], []], errs
    assert host.check(["leangrad/error/0/0", "leangrad/error-done/0/1"])  # compared there


@pytest.mark.slow
def test_process_group_same_error_once_different_errors_both(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(PG_WORKER)
    codes, errs = _two([sys.executable, str(script), "train", "--model", "nope"], _env())
    assert codes == [2, 2], errs
    assert [len(x) for x in _error_lines(errs)] == [1, 0], errs
    assert "unknown model 'nope'" in _error_lines(errs)[0][0]

    codes, errs = _two([sys.executable, str(script), "train", "--model", "nope{rank}"], _env())
    assert codes == [2, 2], errs
    lines = _error_lines(errs)
    assert lines[0][0].startswith("leangrad: error: unknown model 'nope0'"), errs
    assert lines[1][0].startswith("[rank 1] leangrad: error: unknown model 'nope1'"), errs


@pytest.mark.slow
def test_under_torchrun_a_bad_option_prints_once() -> None:
    env = {**_env(), "WORLD_SIZE": "", "RANK": ""}
    env = {k: v for k, v in env.items() if v}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", env.pop("MASTER_PORT"), "-m", "leangrad",
                          "train", "--batch-size", "0"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert _error_lines([run.stderr]) == [[BAD_OPTION_LINE]], run.stderr
    assert "exitcode  : 2" in run.stderr  # the ranks' own exit code, in torchrun's report
