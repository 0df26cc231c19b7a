"""Fresh-process cross-check of the tracker: peak resident set size of a subprocess.

The tracker sees tensor storages only. Kernel scratch memory (e.g. a convolution's
im2col buffer inside oneDNN) is invisible to it but shows up in the process's
resident set. So a step is rerun in a fresh Python process with
``MALLOC_MMAP_THRESHOLD_=65536`` (large blocks go straight to ``mmap`` and back
to the OS on free, so RSS follows live memory), after one warm-up step,
``malloc_trim(0)`` and a reset of the kernel's high-water mark (writing ``5`` to
``/proc/self/clear_refs``). Peak RSS is read from ``VmHWM`` (``ru_maxrss`` cannot
be reset). Nothing is timed in that process.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "RssReport",
    "malloc_trim",
    "measure_rss",
    "proc_status_bytes",
    "reset_peak_rss",
    "rss_supported",
    "run_json_worker",
    "run_rss_worker",
]


@dataclasses.dataclass(frozen=True)
class RssReport:
    """Peak resident memory of one step in a fresh process, above the RSS before it."""

    rss_before: int
    rss_peak: int

    @property
    def peak_above(self) -> int:
        return max(0, self.rss_peak - self.rss_before)


def rss_supported() -> bool:
    """Linux with ``/proc/self/status`` and a writable ``clear_refs``."""
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux ≥ 4.0)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def malloc_trim() -> None:
    """Return free heap memory to the OS (glibc); a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_rss(step: Callable[[], object]) -> RssReport:
    """The resident set before ``step()`` and its high-water mark during it, after a garbage
    collection and a heap trim. Faithful only in a process started with
    ``MALLOC_MMAP_THRESHOLD_`` set (see :func:`run_json_worker`)."""
    gc.collect()
    malloc_trim()
    reset_peak_rss()
    before = proc_status_bytes("VmRSS")
    step()
    return RssReport(rss_before=before, rss_peak=proc_status_bytes("VmHWM"))


def run_json_worker(module: str, payload: dict[str, Any], *, timeout: float = 600) -> Any:
    """Run ``python -m module`` in a fresh process with ``payload`` as JSON on stdin and
    ``MALLOC_MMAP_THRESHOLD_=65536`` (so its RSS follows live memory); return the JSON
    its last line of output holds."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"RSS worker {module} failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_rss_worker(module: str, payload: dict[str, Any], *, timeout: float = 600) -> RssReport:
    """Run ``python -m module`` with ``payload`` as JSON on stdin; it prints an RssReport as JSON.

    The worker must: build its step, run it once (warm-up), free what the
    warm-up left, call :func:`malloc_trim` and :func:`reset_peak_rss`, read
    ``VmRSS``, run the step, read ``VmHWM``, and print
    ``{"rss_before": ..., "rss_peak": ...}`` as its last line.
    """
    data = run_json_worker(module, payload, timeout=timeout)
    return RssReport(rss_before=int(data["rss_before"]), rss_peak=int(data["rss_peak"]))
