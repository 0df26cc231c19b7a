"""Run a worker script on 2 local processes (gloo, torchrun's environment variables), as
the distributed tests do: each process gets ``RANK``/``LOCAL_RANK``, one thread, the
package's ``src`` and ``tests`` on its path and a free port; both must exit 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two(worker: str, tmp_path: Path, *args: str, timeout: float = 300) -> list[str]:
    """Write ``worker`` to ``tmp_path/worker.py`` and run it as ranks 0 and 1 with
    ``tmp_path`` and ``args`` as its arguments; the processes' output, by rank."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    path = os.pathsep.join([str(SRC), str(TESTS)])
    base = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path), *args],
                         env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    logs = [p.communicate(timeout=timeout)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    return logs


def finish(result: Any) -> None:
    """The end of a worker run by :func:`run_two`: write ``result`` as JSON to
    ``rank<r>.json`` in its first argument (``tmp_path``), then leave the process group
    once every rank is done (no rank tears its connections down while another still uses
    them)."""
    import torch.distributed as dist

    with open(Path(sys.argv[1]) / f"rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_two_json(worker: str, tmp_path: Path) -> list[Any]:
    """:func:`run_two`, then what each rank's worker handed to :func:`finish`, by rank."""
    run_two(worker, tmp_path)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
