"""FSDP2 inside ``fit`` (``parallel="fsdp"``, ``leangrad train --parallel fsdp`` under
torchrun): each block :func:`leangrad.blocks` finds, then the root, is
``fully_shard``-ed, so a rank holds 1/N of the parameters, gradients and optimizer state.

Only engines whose backward is the wrapper's own (``wrapped_models``: backprop, and
``checkpoint`` recomputing each block inside its FSDP unit; whole steps) train this way;
the others refuse, naming the ones that do.

Checkpoints are sharded too (:func:`save_sharded`): a directory ``step-000008.dcp/``
where every rank writes its own shards of the weights and optimizer state with
``torch.distributed.checkpoint`` (DCP; nothing is gathered), beside
:data:`._snapshot.SIDE_FILE`, rank 0's file with the rest (step, position, config,
fingerprint, every rank's RNG states, engine state, the optimizer's param groups and the
SHA-256 of every DCP file). The directory is written as ``.step-000008.dcp.tmp`` and
renamed once every rank has finished, so a crash (SIGKILL) mid-save leaves no directory
that :func:`._snapshot.list_checkpoints` or ``resume`` would take. :func:`load_sharded`
reads one onto any number of processes, sharded or not (DCP reshards: a checkpoint of 2
ranks resumes on 1 process with a plain model), and an older single-file checkpoint still
resumes under FSDP through :func:`load_full_state`. Every rank writes into the same
directory, so a run over several machines needs a shared file system for ``--out``.

What is read how (``weights_only`` safety): the side file is checksummed and read with
``torch.load(weights_only=True)``, as every leangrad checkpoint is. DCP's own files are
only read once their SHA-256 matches the side file's record. Its shard files hold only
tensors (every non-tensor value — the param groups — is in the side file, because DCP
reads non-tensor values with ``torch.load(weights_only=False)``), each read by DCP with
``torch.load(weights_only=True)``. Its ``.metadata`` is a pickle, which DCP reads with
plain ``pickle.load``; here it is read by an unpickler that only rebuilds DCP's metadata
classes, ``torch.Size``, dtypes, layouts and paths (:data:`_METADATA_GLOBALS`) and
refuses anything else, so no code from a checkpoint ever runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import shutil
import warnings
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from .. import _errors as errors
from ..engines import Engine
from ..planner._parallel import FSDP_ENGINE
from . import _distributed as distributed
from . import _snapshot as snapshot

__all__ = ["load_full_state", "load_sharded", "local", "optimizer_state_keyed",
           "save_sharded", "shard"]  # fmt: skip

FSDP_PER_LAYER = (
    "--parallel fsdp with --step-per-layer ({engine}): FSDP2 reduce-scatters gradients in "
    "its own hooks and leangrad's per-layer steps are not checked against them; drop "
    "--step-per-layer, or use --parallel ddp"
)
FSDP_ALIASED = (
    "--parallel fsdp: {blocks}: a block whose parameters are also reached outside it is not "
    "an FSDP unit of its own (FSDP2 would shard them twice); the root unit shards them "
    "instead, gathered for the whole step (exact, more memory) — to shard such a block "
    "alone, drop the second name (call the block's submodule through the block)"
)
SHARDS_BAD = (
    "{path}: sharded checkpoint is damaged ({why}); earlier checkpoints in {dir} are "
    "untouched — resume from one of them with --resume PATH"
)
METADATA_GLOBAL = (
    "{path}: refused to unpickle {name} from DCP's .metadata: not one of the types DCP "
    "metadata is made of (it is read with an allowlist, as torch.load(weights_only=True) "
    "reads; a torch that writes new ones needs them in leangrad.train._sharded."
    "_METADATA_GLOBALS); resume from another checkpoint"
)
DCP_FAILED = (
    "{path}: torch.distributed.checkpoint could not read it ({error}); earlier checkpoints "
    "in {dir} are untouched — resume from one of them with --resume PATH"
)
PER_LAYER_SHARDED = (
    "{path} is a sharded checkpoint (from --parallel fsdp), which resumes into one "
    "optimizer, not --step-per-layer's per-parameter ones: resume without --step-per-layer"
)


def shard(model: nn.Module, engine: Engine, *, per_layer: bool) -> None:
    """``fully_shard`` each block of ``model`` the engine works on, then the model itself:
    :meth:`engine.blocks <leangrad.engines.Engine.blocks>` — the blocks ``checkpoint``
    checkpoints (its ``blocks=``), each inside its own FSDP unit; :func:`leangrad.blocks`'s
    for backprop. A block whose parameters are also reached outside it (a submodule under a
    second name) is left to the root's unit, with a warning (:data:`FSDP_ALIASED`): FSDP2
    cannot shard a parameter in two units. An engine that does not run FSDP2's
    own backward, or whose options cannot (:meth:`~leangrad.engines.Engine.wrapped_why`),
    is refused before anything is sharded."""
    from torch.distributed.fsdp import fully_shard

    from ..engines._wrapped import FSDP2

    if not engine.wrapped_models:
        raise errors.OptionError(FSDP_ENGINE.format(engine=engine.label))
    if per_layer:
        raise errors.OptionError(FSDP_PER_LAYER.format(engine=engine.label))
    if (why := engine.wrapped_why(model, FSDP2)) is not None:
        raise errors.OptionError(why)
    found = engine.blocks(model)
    units, aliased = _units(model, [found.modules[n] for n in found.names])
    if aliased:
        warnings.warn(FSDP_ALIASED.format(blocks="; ".join(aliased)), stacklevel=2)
    for module in units:
        fully_shard(module)
    fully_shard(model)


def _units(model: nn.Module, blocks: list[nn.Module]) -> tuple[list[nn.Module], list[str]]:
    """The blocks to ``fully_shard`` one by one (each once, however many names it has; none
    without parameters), and what keeps each other block out: a parameter of it reached by
    a path outside every name of the block (a submodule or parameter registered again
    elsewhere, e.g. ``self.alias = self.layers[1].fc``, or a submodule two blocks share).
    FSDP2 would shard such a parameter twice (the block's unit, then the root's or another
    block's reaching it again) and fail inside ``fully_shard``; left to the root, it is
    sharded once and the gradients are the plain model's."""
    paths: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(n)
    names: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(n)
    units: list[nn.Module] = []
    aliased: list[str] = []
    for module in dict.fromkeys(blocks):  # a block registered under two names: once
        if module is model or not any(True for _ in module.parameters()):
            continue
        own = tuple(f"{n}." for n in names[id(module)])
        outside = [n for p in module.parameters() for n in paths[id(p)] if not n.startswith(own)]
        if outside:
            aliased.append(f"{names[id(module)][0]} (also as {', '.join(outside[:3])}"
                           f"{', ...' if len(outside) > 3 else ''})")  # fmt: skip
        else:
            units.append(module)
    return units, aliased


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a ``DTensor``), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


State = dict[str, Any]


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: Mapping[str, Any], optim_state: Mapping[str, Any]) -> None:  # fmt: skip
    """Shard a whole state (a single-file checkpoint's ``model`` and ``optimizer``) onto
    this process's model and optimizer (every rank reads the same checkpoint). The
    optimizer state may be keyed by parameter index (written by a run without FSDP)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, dict(state), options=opts)
    optim_state = optimizer_state_keyed(model, optimizer, optim_state, by_name=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state, options=opts)


def optimizer_state_keyed(model: nn.Module, optimizer: torch.optim.Optimizer,
                          optim_state: Mapping[str, Any], *, by_name: bool) -> State:  # fmt: skip
    """``optim_state`` keyed by the parameters' names (``by_name``: the form of
    ``torch.distributed.checkpoint.state_dict``, which FSDP runs' single-file checkpoints
    hold) or by their index in ``optimizer`` (``Optimizer.state_dict()``'s form); as is
    when it already is."""
    name = {id(p): n for n, p in model.named_parameters()}
    names = [name[id(p)] for g in optimizer.param_groups for p in g["params"]]
    to: dict[Any, Any] = dict(enumerate(names)) if by_name else {n: i for i, n in enumerate(names)}
    return {**optim_state,
            "state": {to.get(k, k): v for k, v in optim_state.get("state", {}).items()},
            "param_groups": [{**g, "params": [to.get(p, p) for p in g["params"]]}
                             for g in optim_state.get("param_groups", [])]}  # fmt: skip


# -- sharded checkpoints ---------------------------------------------------------------


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 payload: Mapping[str, Any] | None,
                 ctx: distributed.DistContext) -> Path:  # fmt: skip
    """Write the sharded checkpoint ``path`` (``step-N.dcp``): a collective, every rank
    calls it; rank 0 gives ``payload`` (the side file's entries), the others ``None``.

    Every rank writes its shards of ``get_state_dict(model, optimizer)`` (DTensors under
    FSDP2: nothing is gathered) into :func:`._snapshot.temp_dir` with ``dcp.save`` (which
    ``fsync``-s its files and returns on every rank once all have written), then hashes
    its share of the files (named by the metadata ``dcp.save`` returns, not by listing
    the directory); rank 0 writes the side file and renames the directory. ``path`` must be
    on a file system every rank sees (shared across machines).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    tmp = snapshot.temp_dir(path)
    if ctx.rank == 0:
        if tmp.exists():  # what a killed save of this step left
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    distributed.barrier(ctx)
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors, rest = _split({"model": model_state, "optimizer": optim_state})
    with _unwrapped(path, reading=False):  # returns on every rank once all have written
        metadata = save(tensors, storage_writer=FileSystemWriter(tmp))
    stored = (metadata.storage_data or {}).values()
    names = sorted({".metadata", *(info.relative_path for info in stored)})
    mine = {n: _digest(tmp / n) for n in names[ctx.rank :: ctx.world_size]}
    files = {n: d for part in distributed.gather_object(mine, ctx) for n, d in part.items()}
    if ctx.rank == 0:
        side = {**(payload or {}), "dcp_rest": rest, "dcp_files": files}
        snapshot.save_checkpoint(tmp / snapshot.SIDE_FILE, side)
        snapshot.publish_dir(tmp, path)
    return path


def load_sharded(path: Path, model: nn.Module, optimizer: Any, side: Mapping[str, Any],
                 ctx: distributed.DistContext) -> None:  # fmt: skip
    """Load the sharded checkpoint ``path`` onto ``model`` and ``optimizer`` (a collective
    where a process group exists; also on one process without one), given its side file
    (:func:`._snapshot.load_checkpoint` of ``path``).

    The DCP files' checksums are checked first (each rank hashes its share), then
    ``dcp.load`` fills the state dicts of ``get_state_dict`` (the optimizer's state is
    created first: DCP loads in place) with this process's part, resharding as needed;
    NaN/Inf anywhere is refused on every rank before ``set_state_dict`` applies them.

    Raises:
        CheckpointError: a DCP file is missing or changed, or the state holds NaN/Inf.
        OptionError: ``optimizer`` is not one ``torch.optim.Optimizer``.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise errors.OptionError(PER_LAYER_SHARDED.format(path=path))
    _verify(path, side.get("dcp_files") or {}, ctx)
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors, _ = _split({"model": model_state, "optimizer": optim_state})
    with warnings.catch_warnings(), _unwrapped(path, reading=True):
        # one process without a process group, as meant: no warning
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load(tensors, storage_reader=_safe_reader(path))
    named = [(n, local(t)) for k, v in tensors.items() for n, t in snapshot.named_tensors(v, k)]
    bad = snapshot.non_finite(named)
    everywhere = sorted({n for part in distributed.gather_object(bad, ctx) for n in part})
    if everywhere:
        raise snapshot.non_finite_refusal(everywhere, path)
    state = _merge(tensors, side["dcp_rest"])
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])  # fmt: skip


@contextlib.contextmanager
def _unwrapped(path: Path, *, reading: bool) -> Iterator[None]:
    """Raise what fails inside ``dcp.save``/``dcp.load`` as an ``Exception``: DCP wraps
    every rank's failure in its ``CheckpointException``, a ``BaseException`` (which
    ``except Exception`` and the CLI's error report would miss). Reading, a failure is a
    :class:`._snapshot.CheckpointError` (ours as raised, e.g. the metadata's refusal);
    writing, the first failure itself (e.g. an ``OSError``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        failures = [exc for exc, _ in err.failures.values()]
        ours = [e for e in failures if isinstance(e, snapshot.CheckpointError)]
        if ours:
            raise ours[0] from None
        first = failures[0] if failures else err
        if not reading and isinstance(first, Exception):
            raise first from None
        error = f"{type(first).__name__}: {first}"
        raise snapshot.CheckpointError(DCP_FAILED.format(path=path, error=error,
                                                         dir=path.parent)) from None  # fmt: skip


def _split(tree: Mapping[str, Any]) -> tuple[State, State]:
    """(the tensors, everything else) of nested dicts, each keeping the nesting (empty
    dicts go with everything else)."""
    tensors: State = {}
    rest: State = {}
    for k, v in tree.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        elif isinstance(v, Mapping):
            t, r = _split(v)
            if t:
                tensors[k] = t
            if r or not t:
                rest[k] = r
        else:
            rest[k] = v
    return tensors, rest


def _merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> State:
    """Undo :func:`_split`: ``a`` with ``b``'s entries put back in."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if k in out and isinstance(v, Mapping) else v
    return out


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, files: Mapping[str, str], ctx: distributed.DistContext) -> None:
    """Refuse (on every rank) when a DCP file the side file lists is missing or changed;
    rank r hashes every world_size-th file from the r-th."""
    names = sorted(files)
    bad = [] if names else ["the side file lists no DCP files"]
    for n in names[ctx.rank :: ctx.world_size]:
        if not (path / n).is_file():
            bad.append(f"{n} is missing")
        elif _digest(path / n) != files[n]:
            bad.append(f"{n} changed after it was written: checksum mismatch")
    everywhere = [w for part in distributed.gather_object(bad, ctx) for w in part]
    if everywhere:
        why = "; ".join(dict.fromkeys(everywhere))
        raise snapshot.CheckpointError(SHARDS_BAD.format(path=path, why=why, dir=path.parent))


_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")]
    + [(module, name) for module in ("pathlib", "pathlib._local")
       for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")]
)  # fmt: skip
"""What DCP's ``.metadata`` pickle may name (torch 2.13 writes these): dataclasses and an
enum of plain values, ``torch.Size``, a layout by its name, paths; dtypes are allowed by
type (``torch.float64``). Calling any of them runs no code from the file."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`_METADATA_GLOBALS` and dtypes."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise snapshot.CheckpointError(METADATA_GLOBAL.format(path=self.path,
                                                              name=f"{module}.{name}"))  # fmt: skip


def _safe_reader(path: Path) -> Any:
    """DCP's ``FileSystemReader`` for ``path`` that reads ``.metadata`` with
    :class:`_MetadataUnpickler` instead of ``pickle.load``."""
    return _reader_class()(path)


@cache
def _reader_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def __init__(self, path: Path) -> None:
            super().__init__(path)
            self.dir = Path(path)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            with open(self.dir / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f, self.dir).load()
            if not isinstance(metadata, Metadata):
                raise snapshot.CheckpointError(METADATA_GLOBAL.format(
                    path=self.dir, name=type(metadata).__name__))  # fmt: skip
            meta = metadata.storage_meta
            if meta is None:
                meta = metadata.storage_meta = StorageMeta()
            meta.load_id = self.load_id
            return metadata

    return SafeReader
