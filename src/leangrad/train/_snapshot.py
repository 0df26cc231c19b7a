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

A sharded run (``parallel="fsdp"``) writes a directory ``step-000008.dcp/`` instead:
each rank's shards through ``torch.distributed.checkpoint`` and :data:`SIDE_FILE`, rank
0's checkpoint file (as above) with the rest. It is written under a temporary name and
renamed when complete (:func:`publish_dir`), so listings only ever see complete ones;
:mod:`._sharded` writes and reads it.

Only finite states are written: :func:`non_finite` names the NaN/Inf tensors
``fit`` refuses to save, and a checkpoint written with them (by an older
leangrad) is refused on resume. A run directory holds one run:
:func:`run_marks` says whether a directory already holds one (a fresh run
there is refused) and :func:`remove_run` deletes exactly that run's files
(``--overwrite``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .._errors import LeangradError
from ..engines import Engine

__all__ = [
    "CheckpointError",
    "RunDirectoryError",
    "check_fingerprint",
    "check_finite",
    "checkpoint_name",
    "describe_marks",
    "is_sharded_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_engine_state",
    "model_fingerprint",
    "named_tensors",
    "non_finite",
    "non_finite_refusal",
    "prune",
    "publish_dir",
    "remove_run",
    "resolve_resume",
    "rng_state",
    "run_marks",
    "save_checkpoint",
    "set_rng_state",
    "temp_dir",
]

FORMAT = "leangrad-train-checkpoint"
VERSION = 1
MAGIC = b"LGCKSHA2"
_TRAILER = len(MAGIC) + 32
_NAME = re.compile(r"^step-(\d+)\.(pt|dcp)$")
SIDE_FILE = "leangrad.pt"
"""In a sharded checkpoint ``step-N.dcp/``: rank 0's checkpoint file (step, position,
config, fingerprint, every rank's RNG states, engine state, the optimizer's param groups,
the shard files' SHA-256), written and read as a single-file checkpoint is."""

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
NO_CHECKPOINT = "no checkpoint step-*.pt or step-*.dcp/ in {dir}; nothing to resume"
NON_FINITE_CHECKPOINT = (
    "{path} holds non-finite values (NaN/Inf) in {names}: resuming would train on them. "
    "Resume from an earlier checkpoint (--resume FILE; in {dir}: {others}), or start over "
    "with a lower learning rate"
)
RUN_EXISTS = (
    "{dir} already holds a training run ({found}); a fresh run there would mix the two "
    "runs' checkpoints and metrics. Continue that run with --resume {dir} (fit(resume=...)), "
    "or start over with --overwrite (fit(overwrite=True)), which first deletes that run's "
    "checkpoints, metrics, run.json and plot (no other file), or pick another --out"
)
RESUME_AND_OVERWRITE = (
    "--resume and --overwrite contradict each other: --resume continues the run in its "
    "directory, --overwrite deletes it. Leave out --overwrite to continue the run, or "
    "--resume to start over"
)
RESUME_INTO_OTHER_RUN = (
    "{dir} already holds another training run ({found}), and the checkpoint to resume, "
    "{path}, is not from it: the two runs' checkpoints and metrics would mix. Resume into "
    "the checkpoint's own run directory (leave out --out) or into an empty --out"
)

RUN_FILES = ("metrics.jsonl", "metrics.jsonl.tmp", "run.json", "training.png")
"""The files ``fit`` writes at the top of a run directory (besides ``checkpoints/``)."""
_TEMP = re.compile(r"^\.step-(\d+)\.(pt\.tmp-\d+|dcp\.tmp|dcp\.old-\d+)$")
"""Interrupted writes: ``.step-N.pt.tmp-PID`` files, ``.step-N.dcp.tmp`` directories (a
sharded checkpoint being written) and ``.step-N.dcp.old-PID`` (one being replaced)."""


class CheckpointError(LeangradError, ValueError):
    """A checkpoint that is missing, truncated, corrupt, foreign or for another model."""


class RunDirectoryError(LeangradError, ValueError):
    """A run directory that holds another run, or options that would mix two runs in one."""


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

    For a sharded checkpoint ``step-N.dcp/`` this reads its :data:`SIDE_FILE` (everything
    but the weights and the optimizer's tensors, which :func:`._sharded.load_sharded` reads).

    Raises:
        CheckpointError: the file is truncated, corrupt, not a leangrad checkpoint,
            or ``torch.load`` refused it.
    """
    path = Path(path)
    where = {"path": path, "dir": path.parent}
    file = path / SIDE_FILE if is_sharded_checkpoint(path) else path
    try:
        raw = file.read_bytes()
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


def checkpoint_name(step: int, *, sharded: bool = False) -> str:
    """``step-000123.pt``, or the directory ``step-000123.dcp`` of a sharded checkpoint."""
    return f"step-{step:06d}.{'dcp' if sharded else 'pt'}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint: a ``step-N.dcp`` directory
    holding its :data:`SIDE_FILE` (written last, so only complete ones hold it)."""
    path = Path(path)
    m = _NAME.match(path.name)
    return m is not None and m.group(2) == "dcp" and (path / SIDE_FILE).is_file()


def _complete(path: Path, kind: str) -> bool:
    return path.is_file() if kind == "pt" else is_sharded_checkpoint(path)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The ``step-*.pt`` files and complete ``step-*.dcp`` directories in ``directory``,
    oldest step first (temp files and directories of interrupted writes skipped)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _NAME.match(p.name)) and _complete(p, m.group(2))]  # fmt: skip
    return [p for _, p in sorted(found)]


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint (file or ``.dcp`` directory) as given, or the newest one in a run dir
    (or its checkpoints/)."""
    path = Path(path)
    if path.is_file() or is_sharded_checkpoint(path):
        return path
    for d in (path / "checkpoints", path):
        found = list_checkpoints(d)
        if found:
            return found[-1]
    raise CheckpointError(NO_CHECKPOINT.format(dir=path))


def _temps(directory: Path) -> list[Path]:
    """What interrupted writes left in ``directory`` (:data:`_TEMP`)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _TEMP.match(p.name))


def _delete(path: Path) -> None:
    """Unlink a file, or delete a (sharded checkpoint's) directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def prune(directory: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (never the newest), and the temp
    files and directories interrupted writes left (call it when no write is under way)."""
    directory = Path(directory)
    for p in list_checkpoints(directory)[: -max(keep, 1)] + _temps(directory):
        with contextlib.suppress(OSError):
            _delete(p)


def temp_dir(final: str | Path) -> Path:
    """Where the sharded checkpoint ``final`` (``step-N.dcp``) is written before
    :func:`publish_dir`: ``.step-N.dcp.tmp`` beside it, the same name on every rank."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp")


def publish_dir(tmp: str | Path, final: str | Path) -> Path:
    """Rename the complete directory ``tmp`` to ``final`` (one rename: a crash leaves
    either no ``final`` or all of it) and ``fsync`` the parent directory.

    A ``final`` already there (the same step written again by a resumed run) is renamed
    aside first and deleted after: a crash between the two renames leaves that step
    missing (earlier checkpoints stay), never half of it."""
    tmp, final = Path(tmp), Path(final)
    _fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


# -- run directories -------------------------------------------------------------------


def run_marks(out: str | Path) -> list[Path]:
    """What shows that ``out`` holds a run: its checkpoints (``checkpoints/step-*.pt``
    and ``step-*.dcp/``) and its ``metrics.jsonl`` (empty when ``out`` is new or holds
    neither)."""
    out = Path(out)
    metrics = out / "metrics.jsonl"
    return list_checkpoints(out / "checkpoints") + ([metrics] if metrics.is_file() else [])


def describe_marks(marks: list[Path]) -> str:
    """``checkpoints/step-000002.pt .. step-000006.pt (3), metrics.jsonl`` for messages."""
    ckpts = [p for p in marks if _NAME.match(p.name)]
    parts = []
    if ckpts:
        span = ckpts[0].name if len(ckpts) == 1 else f"{ckpts[0].name} .. {ckpts[-1].name}"
        parts.append(f"checkpoints/{span} ({len(ckpts)})")
    parts += [p.name for p in marks if not _NAME.match(p.name)]
    return ", ".join(parts)


def remove_run(out: str | Path) -> list[Path]:
    """Delete the run in ``out`` that ``fit`` wrote: ``checkpoints/step-*.pt``, the
    ``step-*.dcp/`` directories of sharded checkpoints and the temp files and directories
    of interrupted writes, then ``checkpoints/`` itself if that left it empty, and
    :data:`RUN_FILES` (metrics, run.json, the plot). Nothing else is touched.

    Returns:
        The paths deleted.
    """
    out = Path(out)
    ckpt_dir = out / "checkpoints"
    gone: list[Path] = []
    targets = [out / name for name in RUN_FILES if (out / name).is_file()]
    if ckpt_dir.is_dir():
        targets = list_checkpoints(ckpt_dir) + _temps(ckpt_dir) + targets  # checkpoints first
    for p in targets:
        _delete(p)
        gone.append(p)
    if ckpt_dir.is_dir() and not any(ckpt_dir.iterdir()):
        ckpt_dir.rmdir()
    _fsync_dir(out)
    return gone


# -- finiteness ------------------------------------------------------------------------


def non_finite(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors in ``named`` holding a NaN or an infinity.

    One ``isfinite(t).all()`` reduction per tensor and one host sync per device (plus a
    transient bool tensor of each tensor's size): cheap next to writing a checkpoint.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        if t.is_floating_point() or t.is_complex():
            by_device.setdefault(t.device, []).append(i)
    bad: set[int] = set()
    for idx in by_device.values():
        flags = torch.stack([torch.isfinite(named[i][1]).all() for i in idx]).tolist()
        bad.update(i for i, ok in zip(idx, flags, strict=True) if not ok)
    return [named[i][0] for i in sorted(bad)]


def named_tensors(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts/lists, named by its path (``optimizer.state.0.exp_avg``)."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, Mapping):
        return [e for k, v in obj.items() for e in named_tensors(v, f"{prefix}.{k}")]
    if isinstance(obj, (list, tuple)):
        return [e for i, v in enumerate(obj) for e in named_tensors(v, f"{prefix}.{i}")]
    return []


_tensors = named_tensors  # its earlier name


def check_finite(payload: Mapping[str, Any], path: str | Path) -> None:
    """Raise :class:`CheckpointError` when the weights or optimizer state in ``payload``
    hold NaN/Inf, naming them and the other checkpoints beside ``path``."""
    named = named_tensors(payload.get("model", {}), "model") + named_tensors(
        payload.get("optimizer", {}), "optimizer"
    )
    bad = non_finite(named)
    if bad:
        raise non_finite_refusal(bad, path)


def non_finite_refusal(bad: list[str], path: str | Path) -> CheckpointError:
    """The error refusing the checkpoint ``path`` whose tensors ``bad`` hold NaN/Inf,
    naming the other checkpoints beside it."""
    path = Path(path)
    others = [p.name for p in list_checkpoints(path.parent) if p.name != path.name]
    names = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    return CheckpointError(NON_FINITE_CHECKPOINT.format(
        path=path, names=names, dir=path.parent, others=", ".join(others) or "none"))  # fmt: skip


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


def load_engine_state(engine: Engine, payload: Mapping[str, Any]) -> None:
    """Restore the engine's own state (:meth:`Engine.state_dict`) from a checkpoint.

    Checkpoints written before engines had ``state_dict`` hold ``engine_rng``, a list of
    ``[attribute, key, generator state]``; those are read as they were written."""
    if "engine_state" in payload:
        engine.load_state_dict(payload["engine_state"])
        return
    for name, key, st in payload.get("engine_rng", []):
        value = getattr(engine, name, None)
        if isinstance(value, torch.Generator):
            value.set_state(st)
        elif isinstance(value, dict):  # generators by transform name, or by device (lazy)
            known = {str(k): k for k in value}
            if key not in known:
                known[key] = torch.device(key)
                value[known[key]] = torch.Generator(device=key)
            value[known[key]].set_state(st)
