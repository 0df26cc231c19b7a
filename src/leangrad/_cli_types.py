"""Argument types of the ``leangrad`` command: each checks one option's value and says,
in one line, what is wrong and what to write instead (argparse reports it as
``leangrad: error: argument --OPTION: MESSAGE`` with exit code 2); and
:func:`check_out_dir`, the check of an output directory every subcommand runs before any
work (here, below :mod:`leangrad.cli` and :mod:`leangrad.train._cli`, which both use it)."""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

import torch

from ._errors import OptionError

__all__ = ["check_out_dir", "device", "fraction", "name_list", "out_dir", "positive_float",
           "positive_int", "size", "thread_list", "whole"]  # fmt: skip


def _int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None


def _at_least(low: int, what: str) -> Callable[[str], int]:
    def check(raw: str) -> int:
        value = _int(raw)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return check


positive_int = _at_least(1, "at least 1")
"""A whole number ≥ 1."""
whole = _at_least(0, "0 or more")
"""A whole number ≥ 0."""


def positive_float(raw: str) -> float:
    """A finite number > 0 (a learning rate, seconds)."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {raw}")
    return value


def fraction(raw: str) -> float:
    """A share in [0, 1) (the held-out test fraction)."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {raw}")
    return value


def size(raw: str) -> int:
    """A memory size above 0: ``512MiB``, ``2GiB``, ``1.5GB``, ``1e9``."""
    from ._sizes import parse_bytes

    try:
        value = parse_bytes(raw)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 bytes, got {raw!r}")
    return value


def device(raw: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` — and CUDA only where it is available."""
    try:
        dev = torch.device(raw)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a device; use cpu or cuda") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{raw!r}: CUDA is not available on this machine; use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{raw!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{raw!r}: leangrad runs on cpu or cuda")
    return raw


def name_list(raw: str) -> list[str]:
    """Comma-separated names, e.g. ``gpt,lstm_lm``."""
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{raw!r} names nothing; write NAME[,NAME...]")
    return names


def thread_list(raw: str) -> list[int | str]:
    """Torch thread counts to time at, comma-separated: ``1,2``, ``1,cores`` (``cores``:
    this machine's CPU count)."""
    out: list[int | str] = []
    for part in (p.strip() for p in raw.split(",")):
        if part == "cores":
            out.append(part)
            continue
        try:
            n = int(part)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(
                f"{part!r} in {raw!r} is not a thread count; write N[,N...] with N >= 1 "
                "or 'cores', e.g. 1,cores")  # fmt: skip
        out.append(n)
    return out


def _not_a_dir(path: str | Path) -> bool:
    """``path`` exists and is no directory, read in one ``stat``: under torchrun the other
    ranks probe the same directory at once (each makes and removes it, below), so two
    separate checks ("exists", then "is a directory") could see it appear or vanish
    between them and call a directory a file."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:  # absent, or under a file (ENOTDIR): nothing there to be a file
        return False


def out_dir(raw: str) -> str:
    """A directory to write into: it may exist, but not as a file."""
    if _not_a_dir(raw):
        raise argparse.ArgumentTypeError(f"{raw!r} is a file; name a directory")
    return raw


OUT_UNDER_FILE = (
    "{option} {path}: {file} is a file, so no directory can be made there; name a directory"
)
OUT_CANNOT_MAKE = "{option} {path}: cannot create it ({error}); name a directory you can write to"
OUT_NOT_WRITABLE = "{option} {path}: not writable; name a directory you can write to"


def _make_probe(p: Path, *, tries: int = 5) -> None:
    """Make ``p`` (and its parents) as the probe. Under torchrun the other ranks make and
    remove the same directory at once: ``mkdir`` can fail with "File exists" and the
    directory be gone again before ``exist_ok`` looks (CI saw rank 1 refuse a good
    ``--out`` this way). Unless a file stands there, try again: ``exist_ok`` takes a
    directory another rank made, and one it removed is made anew."""
    for _ in range(tries - 1):
        try:
            p.mkdir(parents=True, exist_ok=True)
            return
        except FileExistsError:
            if _not_a_dir(p):
                raise
    p.mkdir(parents=True, exist_ok=True)  # still racing after ``tries``: its own error


def check_out_dir(path: str | Path, option: str = "--out") -> None:
    """Refuse, before any work, an output directory that cannot be written: one under a
    file, one that cannot be created, one not writable. Leaves nothing behind: levels it
    had to create to find out are removed again (the run creates them when it writes).

    Raises:
        OptionError: naming ``option``, the path and the fix.
    """
    p = Path(path)
    if p.is_dir():
        if os.access(p, os.W_OK | os.X_OK):
            return
        if p.is_dir():  # gone: another rank made it to probe and removed it again
            raise OptionError(OUT_NOT_WRITABLE.format(option=option, path=p))
    if _not_a_dir(p):  # a file: argparse's type check names it; a library caller gets this
        raise OptionError(OUT_UNDER_FILE.format(option=option, path=p, file=p))
    made: list[Path] = []
    q = p
    while not q.exists() and q != q.parent:
        made.append(q)
        q = q.parent
    if _not_a_dir(q):
        raise OptionError(OUT_UNDER_FILE.format(option=option, path=p, file=q))
    try:
        _make_probe(p)
    except OSError as err:
        raise OptionError(OUT_CANNOT_MAKE.format(option=option, path=p,
                                                 error=err.strerror or err)) from None  # fmt: skip
    finally:
        for level in made:  # deepest first
            try:
                level.rmdir()
            except OSError:
                break
