"""Block discovery: the repeated units of a model as written (issue: "take the user's
model as written").

Checkpointing and the transforms work on *blocks*. A model built as ``nn.Sequential``
(or a :class:`~leangrad.Chain`, or any module with ``checkpoint_blocks()``) names its
blocks and runs them one after another. A model written the ordinary way — a class with
its own ``forward``, a stem, ``self.blocks``, a head — says so in its module tree: the
repeated units are the children of an ``nn.ModuleList`` / ``nn.Sequential`` that repeat
a type (ResNet stages' residual blocks, a transformer's layers). :func:`blocks` finds
them and says how; ``blocks=`` (a list of submodule names) overrides the search. Where the
module tree repeats nothing, the ``torch.fx`` graph is cut at its articulation points. No
block sits inside another, even where one module is reached under a second name
(:func:`outermost`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from torch import nn

from .. import _errors as errors

__all__ = ["ALIASED_BLOCKS", "NO_BLOCKS", "Blocks", "blocks", "children", "outermost", "submodules"]

NO_BLOCKS = (
    "found no repeated blocks in {model}: no nn.ModuleList or nn.Sequential in its module "
    "tree has two or more children of one type; name the submodules to checkpoint with "
    "blocks=[...] (e.g. blocks=['encoder', 'decoder']), or build the model as nn.Sequential"
)
NOT_SUBMODULE = (
    "{model}.checkpoint_blocks() lists a {block} that is not a submodule of {model}; "
    "list only the model's own submodules (register the block as an attribute)"
)
UNKNOWN_BLOCK = (
    "blocks= names {name!r}, which is not a submodule of {model}; its submodules: {known}"
)
NESTED_BLOCKS = "blocks= names {inner!r} inside {outer!r}; a block cannot contain another block"
ALIASED_BLOCKS = (
    "blocks= names {inner!r}, whose parent module is also inside block {outer!r} (one module "
    "reached by two names): checkpointing {inner!r} in place would checkpoint it inside "
    "{outer!r} too, and a block cannot contain another block; name only one of them"
)


def children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``(name, child)`` of ``module``, a child registered under two names listed at
    each: ``nn.Sequential(lin, nn.Tanh(), lin)`` runs ``lin`` twice, and both uses are
    blocks. (``named_children()`` lists a module once, at its first name, so a block built
    from it would silently skip the second use.)"""
    return [(n, c) for n, c in module._modules.items() if c is not None]


def submodules(model: nn.Module) -> dict[str, nn.Module]:
    """Every submodule by every name it is registered under (``named_modules()`` keeps only
    the first name of a module registered twice, so a later name would be unknown)."""
    return dict(model.named_modules(remove_duplicate=False))


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
        runner: see below; ``None`` when the blocks are the model's own submodules.
    """

    names: tuple[str, ...]
    sequential: bool
    how: str
    modules: dict[str, nn.Module] = dataclasses.field(repr=False, compare=False)
    runner: nn.Module | None = dataclasses.field(default=None, repr=False, compare=False)
    """A module to run instead of the model, whose submodules the blocks are (the fx split
    of a model whose module tree repeats nothing); it shares the model's tensors."""

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
    counts = collections.Counter(type(c).__name__ for _, c in children(module))
    if not counts:
        return None
    name, count = counts.most_common(1)[0]
    return (name, count) if count >= 2 else None


def blocks(model: nn.Module, *, names: Sequence[str] | None = None, graph: bool = True) -> Blocks:
    """The blocks of ``model``: given, declared, or found in its module tree.

    Args:
        model: any module.
        names: submodule names to use as the blocks (a name of an ``nn.ModuleList``, or of
            an ``nn.Sequential`` of repeated blocks such as timm's ``stages.0.blocks``,
            stands for its children; a Sequential of layers, a stem, is one block).
            Overrides the search.
        graph: cut the ``torch.fx`` graph where the module tree repeats nothing; with
            ``False`` that case raises instead.

    Returns:
        A :class:`Blocks` (printable). A found unit inside another found block (a module
        of that block reached under a second name) is left to that block; ``how`` names
        it (:func:`outermost`).

    Raises:
        EngineInputError: a given name is not a submodule or sits inside another given
            block (by its name, or by a second name of a module of that block), or nothing
            repeats.
    """
    subs = submodules(model)
    if names is not None:
        return outermost(model, _given(model, subs, names), given=True)
    blocks_fn = getattr(model, "checkpoint_blocks", None)
    if callable(blocks_fn):
        listed = list(blocks_fn())
        found = _names_of(model, listed)
        return Blocks(found, True, "checkpoint_blocks()", dict(zip(found, listed, strict=True)))
    if isinstance(model, nn.Sequential):
        found = tuple(n for n, _ in children(model))
        return Blocks(found, True, "nn.Sequential children", {n: subs[n] for n in found})
    found_list, hows = _repeated_units(model)
    if not found_list:
        split = _graph_blocks(model) if graph else None
        if split is None:
            raise errors.EngineInputError(NO_BLOCKS.format(model=type(model).__name__))
        return split
    how = "repeated children of " + "; ".join(hows)
    found_list = _one_name_per_slot(subs, found_list)
    units = Blocks(tuple(found_list), False, how, {n: subs[n] for n in found_list})
    return outermost(model, units, given=False)


def outermost(model: nn.Module, found: Blocks, *, given: bool) -> Blocks:
    """``found`` without the blocks that sit inside another block under a second name.

    A block is used (checkpointed, compiled, sharded) in place, in the slot of its parent
    module. Where that parent is also inside another block (``self.extra = self.blocks[0]
    .mlp`` makes ``extra.0``, the first Linear of ``blocks.0``'s MLP, a repeated unit of
    ``extra``), wrapping it would wrap it inside that block too, and the two wrappers would
    run one inside the other: ``checkpoint(levels=2)`` chained the nested calls as links
    of its chain (a wrong gradient), ``trace=True`` met the inner wrapper. Found blocks:
    the inner ones are left to the block that holds them (recomputed with it; their other
    uses run as written), and ``how`` says so. Blocks given by ``blocks=``: refused
    (:data:`ALIASED_BLOCKS`); a name whose own slot is outside every block (``extra``
    itself) is no nesting and is kept. A sequence of blocks (called one after another by
    the model or its runner, never one inside another) and the pieces of an fx split are
    returned as they are.

    Raises:
        EngineInputError: ``given`` and a named block sits inside another.
    """
    if found.sequential or found.runner is not None or len(found) < 2:
        return found
    subs = submodules(model)
    inside: dict[int, str] = {}  # id of every module inside a block -> that block
    for name in found.names:
        for m in found.modules[name].modules():
            inside.setdefault(id(m), name)
    dropped: dict[str, str] = {}  # inner block -> the block holding it
    for name in found.names:
        outer = inside.get(id(subs[name.rpartition(".")[0]]))
        if outer is None or outer == name:
            continue
        if given:
            raise errors.EngineInputError(ALIASED_BLOCKS.format(inner=name, outer=outer))
        dropped[name] = outer
    if not dropped:
        return found
    keep = tuple(n for n in found.names if n not in dropped)
    left = ", ".join(f"{n} (in {outer})" for n, outer in dropped.items())
    how = f"{found.how}; left to the blocks holding them: {left}"
    return Blocks(keep, False, how, {n: found.modules[n] for n in keep})


def _names_of(model: nn.Module, listed: list[nn.Module]) -> tuple[str, ...]:
    """The submodule name of each module ``checkpoint_blocks()`` listed: a module listed
    again takes its next registered name (a layer held twice by a chain is two blocks), or
    its first one when it has no other."""
    paths: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        if n and n not in paths.setdefault(id(m), []):
            paths[id(m)].append(n)
    used: dict[int, int] = {}
    out: list[str] = []
    for m in listed:
        names = paths.get(id(m))
        if not names:
            raise errors.EngineInputError(NOT_SUBMODULE.format(
                model=type(model).__name__, block=type(m).__name__))  # fmt: skip
        k = used.get(id(m), 0)
        used[id(m)] = k + 1
        out.append(names[k] if k < len(names) else names[0])
    return tuple(out)


def _given(model: nn.Module, subs: dict[str, nn.Module], names: Sequence[str]) -> Blocks:
    """The blocks named by ``blocks=``: submodules, a container standing for its children;
    unknown and nested names refused."""
    out: list[str] = []
    for name in names:
        if name not in subs or name == "":
            known = ", ".join(n for n, _ in children(model))
            raise errors.EngineInputError(
                UNKNOWN_BLOCK.format(name=name, model=type(model).__name__, known=known)
            )
        m = subs[name]
        if isinstance(m, nn.ModuleList) or (isinstance(m, nn.Sequential)
                                            and _composite_repeats(m)):  # fmt: skip
            out += [f"{name}.{c}" for c, _ in children(m)]
        else:
            out.append(name)
    for a in out:
        for b in out:
            if a != b and b.startswith(f"{a}."):
                raise errors.EngineInputError(NESTED_BLOCKS.format(inner=b, outer=a))
    out = _one_name_per_slot(subs, out)
    return Blocks(tuple(out), False, "given by blocks=", {n: subs[n] for n in out})


def _one_name_per_slot(subs: dict[str, nn.Module], names: list[str]) -> list[str]:
    """``names`` without those that reach an attribute slot an earlier name reaches: a
    container registered under two names (``self.b = self.a``) holds each block once, and
    a block is wrapped (checkpointed, transformed) once however many names reach it."""
    seen: set[tuple[int, str]] = set()
    out: list[str] = []
    for name in names:
        parent, _, attr = name.rpartition(".")
        slot = (id(subs[parent]), attr)
        if slot not in seen:
            seen.add(slot)
            out.append(name)
    return out


def _count(mods: Sequence[nn.Module]) -> str:
    """``"2 x ResnetBlock2D + 1 x Attention"``: the types of ``mods``, each with its count."""
    counts = collections.Counter(type(m).__name__ for m in mods)
    return " + ".join(f"{n} x {t}" for t, n in counts.items())


def _repeated_units(model: nn.Module) -> tuple[list[str], list[str]]:
    """The children of every repeating container in the module tree (the finest repeated
    units; a repeated child that mostly groups ``nn.ModuleList`` s stands for their
    children: :func:`_grouping`), then every other child of a container that has a type
    those containers repeat (diffusers' UNet: a down block with one ``ResnetBlock2D``, a
    mid block with one ``Attention``), and how each container was read
    (``"'layers': 4 x Block"``: the count of each type among its listed units)."""
    found: list[str] = []
    rows: dict[str, list[nn.Module]] = {}  # container name -> its units
    repeated: set[type] = set()

    def units(container: nn.Module, prefix: str) -> None:
        """The finest repeated units: a child that is itself a repeating container (a
        ResNet stage of residual blocks) stands for its own children."""
        for c, child in children(container):
            rep = _repeats(child)
            if rep is not None:
                repeated.add(_most_common_type(child))
                units(child, f"{prefix}{c}.")
            elif (lists := _grouping(child)) is not None:
                for n, lst in lists:
                    if _repeats(lst) is not None:
                        repeated.add(_most_common_type(lst))
                    units(lst, f"{prefix}{c}.{n}.")
            else:
                found.append(f"{prefix}{c}")
                rows.setdefault(prefix[:-1], []).append(child)

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in children(module):
            full = f"{prefix}{name}"
            if _repeats(child) is not None:
                repeated.add(_most_common_type(child))
                units(child, f"{full}.")
            else:
                visit(child, f"{full}.")

    visit(model, "")
    more = _same_types_elsewhere(model, found, repeated)
    elsewhere: dict[str, list[nn.Module]] = {}
    for name, m in more:
        elsewhere.setdefault(name.rpartition(".")[0], []).append(m)
    order = {n: i for i, n in enumerate(submodules(model))}
    found = sorted([*found, *(n for n, _ in more)], key=lambda n: order[n])

    def listed(by: dict[str, list[nn.Module]]) -> str:
        return ", ".join(f"{c!r}: {_count(by[c])}" for c in sorted(by, key=lambda c: order[c]))

    hows = [listed(rows)] if rows else []
    if elsewhere:
        hows.append(f"and of the types they repeat, in {listed(elsewhere)}")
    return found, hows


def _grouping(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The ``nn.ModuleList`` children, and the ``nn.Sequential`` children that repeat a
    type, of a module that mostly groups them — at least half its parameters are theirs
    (diffusers' down, mid and up blocks: ``resnets``, ``attentions``, ``downsamplers``;
    timm's ConvNeXt and Swin stages: a ``downsample`` and a Sequential of ``blocks``) —
    whose children are then the units; ``None`` for a module that computes itself (a
    transformer layer, whose experts live deeper)."""
    lists: list[tuple[str, nn.Module]] = [
        (n, c) for n, c in children(module)
        if (isinstance(c, nn.ModuleList) and len(c))
        or (isinstance(c, nn.Sequential) and _composite_repeats(c))
    ]
    if not lists:
        return None
    total = sum(p.numel() for p in module.parameters())
    inside = sum(p.numel() for _, c in lists for p in c.parameters())
    return lists if total and 2 * inside >= total else None


def _composite_repeats(container: nn.Module) -> bool:
    """Whether ``container`` repeats a type whose modules are blocks with a ``forward`` of
    their own made of modules (ConvNeXt's ``blocks``), not layers or chains of layers
    (torchvision's ``Sequential(Conv2dNormActivation, ...)`` inside one block)."""
    if _repeats(container) is None:
        return False
    kind = _most_common_type(container)
    if issubclass(kind, nn.Sequential | nn.ModuleList):
        return False
    return any(next(c.children(), None) is not None
               for _, c in children(container) if type(c) is kind)  # fmt: skip


def _most_common_type(container: nn.Module) -> type:
    counts = collections.Counter(type(c) for _, c in children(container))
    return counts.most_common(1)[0][0]


def _same_types_elsewhere(
    model: nn.Module, found: list[str], types: set[type]
) -> list[tuple[str, nn.Module]]:
    """Children of ``nn.ModuleList`` / ``nn.Sequential`` containers, outside and around no
    found unit, whose type is one a repeating container repeats."""
    if not types:
        return []
    taken = set(found)
    out: list[tuple[str, nn.Module]] = []

    def overlaps(name: str) -> bool:
        return any(name.startswith(f"{t}.") or t.startswith(f"{name}.") for t in taken)

    def visit(module: nn.Module, prefix: str) -> None:
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        for name, child in children(module):
            full = f"{prefix}{name}"
            if full in taken:
                continue
            if container and type(child) in types and not overlaps(full):
                out.append((full, child))
                taken.add(full)
            else:
                visit(child, f"{full}.")

    visit(model, "")
    return out


def _graph_blocks(model: nn.Module) -> Blocks | None:
    """Where the module tree says nothing: the model's ``torch.fx`` graph cut at its
    articulation points — nodes every path from the inputs to the output passes through,
    so that exactly one value crosses each cut — into about √n segments of similar op
    counts (n: the ops). ``None`` when fx cannot trace the model or there are no cuts."""
    import math

    from torch import fx
    from torch.fx.passes.split_module import split_module

    try:
        gm = fx.symbolic_trace(model)
    except Exception:
        return None
    nodes = [n for n in gm.graph.nodes if n.op not in ("get_attr", "output")]
    pos = {n: i for i, n in enumerate(nodes)}
    ops = [i for i, n in enumerate(nodes) if n.op in ("call_module", "call_function",
                                                       "call_method")]  # fmt: skip
    if len(ops) < 4:
        return None
    cuts: list[int] = []
    reach = -1  # the furthest position a node before i is used at
    for i, n in enumerate(nodes):
        if reach <= i and n.op != "placeholder" and i < len(nodes) - 1:
            cuts.append(i)  # only n's own value leaves the prefix ending at n
        uses = [pos[u] for u in n.users if u in pos]
        reach = max(reach, *uses) if uses else reach
    if not cuts:
        return None
    k = max(2, round(math.sqrt(len(ops))))
    bounds: list[int] = []
    for j in range(1, k):  # the cut nearest to each j/k of the ops
        target = ops[min(len(ops) - 1, round(j * len(ops) / k))]
        best = min(cuts, key=lambda c: abs(c - target))
        if not bounds or best > bounds[-1]:
            bounds.append(best)
    part = {n: sum(pos[n] > b for b in bounds) for n in nodes}

    def which(n: fx.Node) -> int:
        if n in part:
            return part[n]
        return min(part[u] for u in n.users if u in part)  # get_attr: with its first user

    runner = split_module(gm, model, which)
    names = tuple(n for n, _ in runner.named_children() if n.startswith("submod_"))
    if len(names) < 2:
        return None
    how = f"torch.fx graph cut at {len(bounds)} articulation point(s) ({len(ops)} ops)"
    return Blocks(names, False, how, {n: runner.get_submodule(n) for n in names}, runner)
