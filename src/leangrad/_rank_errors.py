"""One error line for all processes of a ``torchrun`` launch.

Under ``torchrun --nproc-per-node N -m leangrad ...`` every process meets the same user
error (a bad option, a run directory that already holds a run) and would print the same
``leangrad: error: ...`` line N times. :func:`print_error` prints it once:

- rank 0 prints its line;
- a rank > 0 prints its line, prefixed ``[rank R] ``, only when it differs from rank 0's
  or rank 0 has none (its error happened on that rank alone), so no error is ever hidden;
- the ranks compare their lines through a key-value store (:class:`torch.distributed.Store`):
  the process group's own (``distributed_c10d._get_default_store()``) once one exists,
  else the store ``torchrun``'s agent hosts for its workers
  (``TORCHELASTIC_USE_AGENT_STORE=True`` at ``MASTER_ADDR:MASTER_PORT``). Each rank sets
  :data:`ERROR_KEY`; a rank > 0 waits at most ``timeout_s`` for rank 0's;
- before returning, each rank marks itself done (:data:`DONE_KEY`) and waits, at most until
  the same deadline, for every rank to be done. ``torchrun`` sends SIGTERM to the other
  processes about 0.1 s after the first one exits, and a rank 0 that hosts the store takes
  it down when it exits: without this wait a line could be lost, e.g. rank 0's line when
  rank 1 stays silent and exits first (measured: 3 of 8 two-process launches lost it);
- with several processes but no store to reach (another launcher, before any process
  group exists), rank 0 prints and the others stay silent: an error raised that early
  (parsing the arguments) is the same on every rank by construction.

Nothing waits longer than ``timeout_s``; a store that fails counts as "rank 0 had no line",
so the rank prints its own.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = ["DEFAULT_TIMEOUT_S", "DONE_KEY", "ERROR_KEY", "RANK_PREFIX", "print_error",
           "print_error_once"]  # fmt: skip

ERROR_KEY = "leangrad/error/{attempt}/{rank}"
"""The store key holding rank ``rank``'s error line (``attempt``: torchrun's
``TORCHELASTIC_RESTART_COUNT``, as its agent keeps one store across restarts)."""
DONE_KEY = "leangrad/error-done/{attempt}/{rank}"
"""Set by rank ``rank`` once it has printed (or decided not to print) its line."""
RANK_PREFIX = "[rank {rank}] "
"""Before the line of a rank > 0 whose line differs from rank 0's."""
DEFAULT_TIMEOUT_S = 5.0
"""The longest :func:`print_error` waits for the other ranks, in seconds."""
_MIN_WAIT_S = 0.01


def print_error(line: str, *, file: TextIO | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:  # fmt: skip
    """Print the error ``line`` (e.g. ``"leangrad: error: ..."``) to ``file`` (stderr) once
    over all processes of this launch, as the module docstring says; on one process, just
    print it.

    Args:
        line: the whole error line, without the trailing newline.
        file: where to print; ``sys.stderr`` when ``None``.
        timeout_s: the longest wait for the other ranks, in seconds.
    """
    rank, world_size, store = _launch()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print_error_once(line, rank=rank, world_size=world_size, store=store, attempt=attempt,
                     file=file, timeout_s=timeout_s)  # fmt: skip


def print_error_once(line: str, *, rank: int, world_size: int, store: Store | None,
                     attempt: str = "0", file: TextIO | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> None:  # fmt: skip
    """:func:`print_error` with the launch given: this process is ``rank`` of
    ``world_size``, comparing lines through ``store`` (``None``: none to reach; rank 0
    prints, the others stay silent).

    Args:
        line: the whole error line, without the trailing newline.
        rank: this process's rank.
        world_size: the number of processes.
        store: the key-value store every rank reaches, or ``None``.
        attempt: distinguishes the keys of successive launches sharing one store.
        file: where to print; ``sys.stderr`` when ``None``.
        timeout_s: the longest wait for the other ranks, in seconds.
    """
    out = sys.stderr if file is None else file
    if world_size <= 1 or store is None:
        if rank == 0:
            _emit(out, line)
        return
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        _emit(out, line)
        _try_set(store, ERROR_KEY.format(attempt=attempt, rank=0), line)
    elif _rank0_line(store, ERROR_KEY.format(attempt=attempt, rank=0), deadline) != line:
        _emit(out, RANK_PREFIX.format(rank=rank) + line)
    if not _try_set(store, DONE_KEY.format(attempt=attempt, rank=rank), "1"):
        return
    others = [DONE_KEY.format(attempt=attempt, rank=r) for r in range(world_size) if r != rank]
    _wait(store, others, deadline)


def _emit(out: TextIO, line: str) -> None:
    print(line, file=out, flush=True)


def _try_set(store: Store, key: str, value: str) -> bool:
    try:
        store.set(key, value)
    except Exception:  # a store gone (its host exited): carry on printing alone
        return False
    return True


def _wait(store: Store, keys: list[str], deadline: float) -> bool:
    """True when every key is set before ``deadline``. A zero timeout means "forever" to
    c10d's stores (and one under a millisecond rounds to zero), so with less than
    :data:`_MIN_WAIT_S` left the keys are only checked."""
    left = deadline - time.monotonic()
    try:
        if left < _MIN_WAIT_S:
            return bool(store.check(keys))
        store.wait(keys, datetime.timedelta(seconds=left))
    except Exception:  # timed out, or the store is gone
        return False
    return True


def _rank0_line(store: Store, key: str, deadline: float) -> str | None:
    if not _wait(store, [key], deadline):
        return None
    try:
        return store.get(key).decode()
    except Exception:
        return None


def _launch() -> tuple[int, int, Store | None]:
    """This process's rank, the number of processes and the store to compare through:
    the process group's, else torchrun's agent store, else ``None``."""
    if "torch.distributed" in sys.modules:  # a process group exists only if it was imported
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            try:
                store: Store | None = _get_default_store()
            except Exception:
                store = None
            return dist.get_rank(), dist.get_world_size(), store
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return rank, world_size, None
    return rank, world_size, _agent_store()


def _agent_store() -> Store | None:
    """A client of the store torchrun's agent hosts for its workers, or ``None`` when this
    is not a torchrun launch that uses one (or it cannot be reached in a second)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ.get("MASTER_ADDR")
    port = _env_int("MASTER_PORT", -1)
    if not host or not 0 < port < 2**16:
        return None
    try:
        from torch._C._distributed_c10d import TCPStore

        return TCPStore(host, port, is_master=False,
                        timeout=datetime.timedelta(seconds=1))  # fmt: skip
    except Exception:
        return None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
