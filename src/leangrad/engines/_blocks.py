"""Block discovery: the repeated units of a model as written (issue: "take the user's
model as written").

Checkpointing and the transforms work on *blocks*. A model built as ``nn.Sequential``
(or a :class:`~leangrad.Chain`, or any module with ``checkpoint_blocks()``) names its
blocks and runs them one after another. A model written the ordinary way — a class with
its own ``forward``, a stem, ``self.blocks``, a head — says so in its module tree: the
repeated units are the children of an ``nn.ModuleList`` / ``nn.Sequential`` that repeat
a type (ResNet stages' residual blocks, a transformer's layers). :func:`blocks` finds
them and says how; ``blocks=`` (a list of submodule names) overrides the search.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from torch import nn

from .. import _errors as E

__all__ = ["NO_BLOCKS", "Blocks", "blocks"]

NO_BLOCKS = (
    "found no repeated blocks in {model}: no nn.ModuleList or nn.Sequential in its module "
    "tree has two or more children of one type; name the submodules to checkpoint with "
    "blocks=[...] (e.g. blocks=['encoder', 'decoder']), or build the model as nn.Sequential"
)
UNKNOWN_BLOCK = (
    "blocks= names {name!r}, which is not a submodule of {model}; its submodules: {known}"
)
NESTED_BLOCKS = "blocks= names {inner!r} inside {outer!r}; a block cannot contain another block"


@dataclasses.dataclass(frozen=True)
class Blocks:
    """What :func:`blocks` found.

    Attributes:
        names: the blocks' submodule names (``""`` is never one), in registration order.
        sequential: ``True`` when the model is exactly these blocks run one after another
            (``nn.Sequential``, ``checkpoint_blocks()``): segments of several blocks can
            then be checkpointed as one. Otherwise every block is checkpointed alone.
        how: how they were found, e.g. ``"repeated children of 'blocks' (6 x Block)"``.
        modules: the block modules, by name.
    """

    names: tuple[str, ...]
    sequential: bool
    how: str
    modules: dict[str, nn.Module] = dataclasses.field(repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.names)

    def __str__(self) -> str:
        lines = [f"{len(self.names)} blocks ({self.how}):"]
        for name in self.names:
            m = self.modules[name]
            n = sum(p.numel() for p in m.parameters())
            lines.append(f"  {name or '<root>':32s} {type(m).__name__:24s} {n:>12,d} params")
        return "\n".join(lines)


def _repeats(module: nn.Module) -> tuple[str, int] | None:
    """``(type name, count)`` of the most repeated child type of a container, if ≥ 2."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return None
    counts = collections.Counter(type(c).__name__ for c in module.children())
    if not counts:
        return None
    name, count = counts.most_common(1)[0]
    return (name, count) if count >= 2 else None


def blocks(model: nn.Module, *, names: Sequence[str] | None = None) -> Blocks:
    """The blocks of ``model``: given, declared, or found in its module tree.

    Args:
        model: any module.
        names: submodule names to use as the blocks (a name of an ``nn.ModuleList`` or
            ``nn.Sequential`` stands for its children). Overrides the search.

    Returns:
        A :class:`Blocks` (printable).

    Raises:
        EngineInputError: a given name is not a submodule, or nothing repeats.
    """
    subs = dict(model.named_modules())
    if names is not None:
        out: list[str] = []
        for name in names:
            if name not in subs or name == "":
                known = ", ".join(n for n, _ in model.named_children())
                raise E.EngineInputError(
                    UNKNOWN_BLOCK.format(name=name, model=type(model).__name__, known=known)
                )
            m = subs[name]
            if isinstance(m, nn.ModuleList):
                out += [f"{name}.{c}" for c, _ in m.named_children()]
            else:
                out.append(name)
        for a in out:
            for b in out:
                if a != b and b.startswith(f"{a}."):
                    raise E.EngineInputError(NESTED_BLOCKS.format(inner=b, outer=a))
        return Blocks(tuple(out), False, "given by blocks=", {n: subs[n] for n in out})
    blocks_fn = getattr(model, "checkpoint_blocks", None)
    if callable(blocks_fn):
        ids = {id(m): n for n, m in model.named_modules()}
        listed = list(blocks_fn())
        found = tuple(ids[id(m)] for m in listed)
        return Blocks(found, True, "checkpoint_blocks()", dict(zip(found, listed, strict=True)))
    if isinstance(model, nn.Sequential):
        found = tuple(n for n, _ in model.named_children())
        return Blocks(found, True, "nn.Sequential children", {n: subs[n] for n in found})
    found_list: list[str] = []
    hows: list[str] = []

    def units(container: nn.Module, prefix: str) -> list[str]:
        """The finest repeated units: a child that is itself a repeating container (a
        ResNet stage of residual blocks) stands for its own children."""
        out: list[str] = []
        for c, child in container.named_children():
            rep = _repeats(child)
            if rep is not None:
                hows.append(f"'{prefix}{c}': {rep[1]} x {rep[0]}")
                out += units(child, f"{prefix}{c}.")
            else:
                out.append(f"{prefix}{c}")
        return out

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            rep = _repeats(child)
            if rep is not None:
                start = len(hows)
                found_list.extend(units(child, f"{full}."))
                if len(hows) == start:
                    hows.append(f"{full!r}: {rep[1]} x {rep[0]}")
            else:
                visit(child, f"{full}.")

    visit(model, "")
    if not found_list:
        raise E.EngineInputError(NO_BLOCKS.format(model=type(model).__name__))
    how = "repeated children of " + ", ".join(hows)
    return Blocks(tuple(found_list), False, how, {n: subs[n] for n in found_list})
