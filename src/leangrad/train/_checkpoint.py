"""Atomic, checksummed training checkpoints that load without executing pickled code.

A checkpoint file is the bytes of ``torch.save(payload)`` followed by a trailer:
8 magic bytes and the SHA-256 of those bytes. Writing goes to a temporary file
in the same directory, which is flushed and ``fsync``-ed, renamed over the final
name with ``os.replace`` (atomic on POSIX) and the directory ``fsync``-ed: a crash
at any moment leaves either the previous file set or the new one, never half a
file. Loading checks the trailer first (a truncated or corrupted file is named
as such) and then reads with ``torch.load(weights_only=True)``, which only
rebuilds tensors and plain containers — it never runs code from the file.

The payload holds the model and optimizer state dicts, every RNG state (torch,
CUDA, numpy, Python ``random``, engines' own generators), the position in the
data order and the step, so a resumed run continues bit-exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .._errors import LeangradError

__all__ = [
    "CheckpointError",
    "check_fingerprint",
    "engine_rng_state",
    "list_checkpoints",
    "load_checkpoint",
    "model_fingerprint",
    "rng_state",
    "save_checkpoint",
    "set_engine_rng_state",
    "set_rng_state",
]

FORMAT = "leangrad-train-checkpoint"
VERSION = 1
MAGIC = b"LGCKSHA2"
_TRAILER = len(MAGIC) + 32
_NAME = re.compile(r"^step-(\d+)\.pt$")

NOT_OURS = (
    "{path}: not a leangrad checkpoint, or truncated ({why}); earlier checkpoints in "
    "{dir} are untouched — resume from one of them with --resume PATH"
)
CORRUPT = (
    "{path}: checkpoint is corrupt (checksum mismatch: the file changed after it was "
    "written); earlier checkpoints in {dir} are untouched — resume from one of them "
    "with --resume PATH"
)
UNREADABLE = "{path}: checksum is valid but torch.load(weights_only=True) refused it: {error}"
WRONG_MODEL = (
    "{path} was written for a different model: {why}. Resume with the model the checkpoint "
    "was written for (its run config: {config}), or start a fresh run without --resume"
)
NO_CHECKPOINT = "no checkpoint step-*.pt in {dir}; nothing to resume"


class CheckpointError(LeangradError, ValueError):
    """A checkpoint that is missing, truncated, corrupt, foreign or for another model."""


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot open directories
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(path: str | Path, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` to ``path`` atomically (temp file, fsync, rename, fsync dir).

    Args:
        path: final file name, e.g. ``out/checkpoints/step-000100.pt``.
        payload: tensors and plain containers (dict, list, str, numbers, None).

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, **payload}, buf)
    blob = buf.getbuffer()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.write(MAGIC + hashlib.sha256(blob).digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


def load_checkpoint(
    path: str | Path, *, map_location: str | torch.device | None = None
) -> dict[str, Any]:
    """Read a checkpoint, verifying its trailer, with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: the file is truncated, corrupt, not a leangrad checkpoint,
            or ``torch.load`` refused it.
    """
    path = Path(path)
    where = {"path": path, "dir": path.parent}
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read checkpoint: {err}") from err
    if len(raw) < _TRAILER or raw[-_TRAILER : -32] != MAGIC:
        raise CheckpointError(NOT_OURS.format(why="no leangrad trailer at its end", **where))
    blob = memoryview(raw)[:-_TRAILER]
    if hashlib.sha256(blob).digest() != raw[-32:]:
        raise CheckpointError(CORRUPT.format(**where))
    try:
        payload = torch.load(io.BytesIO(blob), map_location=map_location, weights_only=True)
    except Exception as err:
        raise CheckpointError(UNREADABLE.format(path=path, error=err)) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(NOT_OURS.format(why=f"no format {FORMAT!r}", **where))
    return payload


def checkpoint_name(step: int) -> str:
    """``step-000123.pt``."""
    return f"step-{step:06d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The ``step-*.pt`` files in ``directory``, oldest step first (temp files skipped)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint file as given, or the newest one in a run dir (or its checkpoints/)."""
    path = Path(path)
    if path.is_file():
        return path
    for d in (path / "checkpoints", path):
        found = list_checkpoints(d)
        if found:
            return found[-1]
    raise CheckpointError(NO_CHECKPOINT.format(dir=path))


def prune(directory: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (never the newest)."""
    for p in list_checkpoints(directory)[: -max(keep, 1)]:
        with contextlib.suppress(OSError):
            p.unlink()


# -- model identity --------------------------------------------------------------------


def model_fingerprint(model: nn.Module) -> list[list[Any]]:
    """``[[key, shape, dtype], ...]`` over the model's state dict."""
    return [[k, list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()]


def check_fingerprint(payload: Mapping[str, Any], model: nn.Module, path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first difference when ``payload`` was
    written for another model."""
    saved = payload.get("fingerprint", [])
    mine = model_fingerprint(model)
    if saved == mine:
        return
    s, m = {e[0]: e[1:] for e in saved}, {e[0]: e[1:] for e in mine}
    if s.keys() != m.keys():
        missing = sorted(m.keys() - s.keys())[:3]
        unexpected = sorted(s.keys() - m.keys())[:3]
        why = f"parameters missing from it {missing}, unexpected in it {unexpected}"
    else:
        key = next(k for k in m if s[k] != m[k])
        why = f"{key!r} is {s[key][0]} {s[key][1]} there but {m[key][0]} {m[key][1]} here"
    config = payload.get("config", {})
    short = {k: config.get(k) for k in ("model", "model_options", "data")}
    raise CheckpointError(WRONG_MODEL.format(path=path, why=why, config=short))


# -- RNG states ------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """torch, CUDA, numpy and Python ``random`` states as tensors and plain values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, pstate, pgauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos),
                  int(has_gauss), float(gauss)],
        "python": [version, torch.tensor(pstate, dtype=torch.int64), pgauss],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, pstate, pgauss = state["python"]
    random.setstate((version, tuple(int(v) for v in pstate.tolist()), pgauss))


def engine_rng_state(engine: object) -> list[list[Any]]:
    """States of the generators an engine keeps as attributes, directly or in a dict
    (e.g. projforward's seeded per-device generators): ``[[attr, key, state], ...]``."""
    found: list[list[Any]] = []
    for name, value in sorted(vars(engine).items()):
        if isinstance(value, torch.Generator):
            found.append([name, None, value.get_state()])
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, torch.Generator):
                    found.append([name, str(k), v.get_state()])
    return found


def set_engine_rng_state(engine: object, state: list[list[Any]]) -> None:
    """Restore :func:`engine_rng_state`. A generator the engine makes lazily in a dict
    keyed by device (absent in a fresh engine) is created first."""
    for name, key, st in state:
        value = getattr(engine, name, None)
        if key is None and isinstance(value, torch.Generator):
            value.set_state(st)
        elif isinstance(value, dict):
            match = [k for k in value if str(k) == key]
            if match:
                gen = value[match[0]]
            else:
                gen = value[torch.device(key)] = torch.Generator(device=key)
            gen.set_state(st)
