"""Memory sizes as people write them (``"2GiB"``) and as reports print them, and how much
memory a step may take here — shared by ``leangrad plan``, ``train --budget``, the CLI's
option types and every benchmark report."""

from __future__ import annotations

import math
import re

import torch

__all__ = ["BAD_BYTES", "MiB", "fmt_bytes", "free_bytes", "parse_bytes"]

MiB = 2**20

BAD_BYTES = "budget {value!r} is not a size; write e.g. 512MiB, 2GiB, 1.5GB or 1e9"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def fmt_bytes(
    n: float | None, *, spec: str | None = None, missing: str = "—", unit: str = " MiB"
) -> str:
    """Bytes as a report prints them; ``missing`` for ``None``.

    Args:
        n: A size in bytes, or ``None``.
        spec: ``None``: MiB with three significant digits, KiB below 0.01 MiB
            (``"1.5 MiB"``, ``"3 KiB"``). A format spec (``".2f"``): always MiB, in
            that format, followed by ``unit`` — for tables whose column is fixed-point.
        missing: What ``None`` prints as.
        unit: The unit's text after a ``spec``-formatted number.
    """
    if n is None:
        return missing
    if spec is not None:
        return f"{n / MiB:{spec}}{unit}"
    v = n / MiB
    return f"{v:.3g} MiB" if v >= 0.01 else f"{n / 1024:.3g} KiB"


def parse_bytes(value: str | int | float) -> int:
    """``"2GiB"`` -> 2147483648; ``"1.5GB"``, ``"512MiB"``, ``"1e9"`` and numbers work too."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float):
        number, unit = value, ""
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(BAD_BYTES.format(value=value))
        try:
            number, unit = float(m.group(1)), m.group(2).lower()
        except ValueError:
            raise ValueError(BAD_BYTES.format(value=value)) from None
    if not math.isfinite(number * _UNITS[unit]):  # "1e400": no int can hold it
        raise ValueError(BAD_BYTES.format(value=value))
    return int(number * _UNITS[unit])


def free_bytes(device: torch.device) -> int:
    """Memory one step may allocate here: 90% of free CUDA memory, or half of the
    machine's ``MemAvailable`` (2 GiB where that cannot be read)."""
    if device.type == "cuda":
        return int(0.9 * torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 2**31
