"""``fad.nest(model)``: the static-graph pass (paper section III-B, Fig. 4).

The model is traced with ``torch.fx``. Every node is classified *fad* (a
primitive of :mod:`leangrad.fad._primitives` whose tensor operands all trace
back to one source through fad nodes, section III-A) or *nfad*. Fad nodes
connected through fad edges form sub-graphs with in-degree 1 (the source) and
out-degree M >= 1 (values used outside); each is replaced by one
:class:`~leangrad.fad._program.FusedChain` that computes the values and their
derivatives in the forward pass and saves only the derivative per output.
Everything else is left untouched.

fad's own layers (:class:`~leangrad.fad.Swish` and the other activations, any
:class:`FusedChain`, :class:`~leangrad.fad.Elementwise`) trace as leaf ``call_module``
nodes (:mod:`leangrad.fad._trace`). A one-output :class:`FusedChain` is itself an
element-wise operator of one source: when primitives or other such layers run right
before or after it, its program joins their chain whole (one derivative saved for all,
as the eager mode does); alone, it stays the layer the user wrote. An
:class:`~leangrad.fad.Elementwise` (a Python function) or a many-output chain always
stays as written. Either way each stays one fused unit.

In-place primitives on values inside a chain are rewritten to their functional
form (later readers of the written value read the in-place node), which is
safe because chain values are fresh tensors that alias nothing. A chain that
another node could mutate while it runs is left to autograd.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, cast

from torch import fx, nn

from . import _errors as errors
from ._builtin import builtin_of
from ._elementwise import Elementwise
from ._primitives import PRIMITIVES, Call, is_const, lookup, lookup_method, normalize
from ._program import FusedChain, Program, Ref, Step

__all__ = ["Region", "fused_chains", "nest"]

_MODULE_PRIMS: dict[type[nn.Module], str] = {
    nn.Sigmoid: "sigmoid",
    nn.Tanh: "tanh",
    nn.Softplus: "softplus",
    nn.ReLU: "relu",
}
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ipow, operator.setitem}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Region:
    """One element-wise sub-graph the pass found.

    Attributes:
        name: the inserted submodule (``fad_chain_0`` ...), or ``None`` when left to autograd.
        source: the fx node feeding it (its only input).
        ops: primitive names in execution order.
        outputs: how many values leave it (M).
        skipped: why it was left to autograd, ``None`` when fused.
        builtin: the PyTorch fused activation that runs it instead (``"F.silu"`` ...):
            the chain computes exactly that kernel, which keeps the same one tensor and
            is faster (:mod:`leangrad.fad._builtin`); ``name`` is then ``None``.
    """

    name: str | None
    source: str
    ops: tuple[str, ...]
    outputs: int
    skipped: str | None = None
    builtin: str | None = None


@dataclasses.dataclass
class _Info:
    """A fad-able node: a primitive ``call``, or one of fad's own layers (``program``)."""

    call: Call | None
    operands: tuple[Any, ...]
    params: dict[str, Any]
    program: Program | None = None
    fallback: bool = True  # a layer's: warn and run plain autograd on dtypes without rules

    @property
    def name(self) -> str:
        if self.program is not None:
            return self.program.name
        assert self.call is not None
        return self.call.prim.name

    @property
    def inplace(self) -> bool:
        return self.call is not None and self.call.inplace

    @property
    def size(self) -> int:
        """Primitives it runs."""
        return len(self.program.steps) if self.program is not None else 1


def _layer_program(mod: nn.Module, node: fx.Node) -> Program | None:
    """The program of one of fad's own layers that may join a chain: a one-output
    :class:`FusedChain` of at least one step, called on one fx value."""
    if not isinstance(mod, FusedChain) or node.kwargs or len(node.args) != 1:
        return None
    program = mod.program
    if len(program.outputs) != 1 or not program.steps or program.outputs[0] == 0:
        return None
    return program if isinstance(node.args[0], fx.Node) else None


def _classify(gm: fx.GraphModule, node: fx.Node) -> _Info | None:
    """The primitive call behind a node, when it is one with fx-node or number operands."""
    call: Call | None = None
    args, kwargs = node.args, dict[str, Any](node.kwargs)
    if node.op == "call_function":
        call = lookup(node.target)
    elif node.op == "call_method":
        call = lookup_method(str(node.target))
    elif node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        program = _layer_program(mod, node)
        if program is not None:
            return _Info(None, tuple(node.args), {}, program, cast(FusedChain, mod).fallback)
        name = _MODULE_PRIMS.get(type(mod))
        if name is None or getattr(mod, "inplace", False):
            return None
        call = Call(PRIMITIVES[name])
        if name == "softplus":
            kwargs = {"beta": mod.beta, "threshold": mod.threshold}
    if call is None:
        return None
    norm = normalize(call, tuple(args), kwargs)
    if norm is None:
        return None
    operands, params = norm
    if not all(isinstance(o, fx.Node) or is_const(o) for o in operands):
        return None
    if not any(isinstance(o, fx.Node) for o in operands):
        return None
    if not all(is_const(v) or isinstance(v, bool) for v in params.values()):
        return None
    return _Info(call, tuple(operands), params)


def _mutates(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Could this node write into one of its arguments?"""
    if "out" in node.kwargs or node.kwargs.get("inplace", False):
        return True
    if node.op == "call_module":  # nn.ReLU(inplace=True), nn.Dropout(inplace=True), ...
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _private(node: fx.Node, ok: dict[fx.Node, fx.Node], inside: set[fx.Node]) -> bool:
    """Does ``node`` write into another chain's value (a fresh tensor aliasing nothing here)?"""
    target = node.args[0] if node.args else None
    return isinstance(target, fx.Node) and target in ok and target not in inside


def nest(model: nn.Module, *, min_ops: int = 2, builtins: bool = True) -> fx.GraphModule:
    """Trace ``model`` and fuse each maximal single-source element-wise chain (section III-B).

    Args:
        model: any module ``torch.fx.symbolic_trace`` can trace. fad's own layers in it
            (``fad.Swish()``, any :class:`FusedChain` or :class:`Elementwise`, the model
            itself being one) stay one fused unit each: as written, or, for a one-output
            :class:`FusedChain` next to other element-wise operators, its program whole
            inside their chain (module docstring).
        min_ops: chains with fewer primitives stay with autograd (a lone ``sigmoid``
            saves one tensor either way, and FAD would only add the derivative's cost;
            section IV-B, "NY -> YN").
        builtins: a chain that computes exactly a PyTorch fused activation (``F.silu``,
            ``F.gelu``) calls it instead of a nested chain: the same saved bytes, less
            time (:mod:`leangrad.fad._builtin`). ``False`` nests every chain.

    Returns:
        A ``GraphModule`` sharing ``model``'s parameters, with an attribute
        ``fad_regions`` (a list of :class:`Region`: what was fused and what was not, why).

    Raises:
        FadTraceError: fx cannot trace the model; the message points to :func:`nested`.
    """
    # a model that is itself one of fad's layers is traced as the one layer it is
    root = nn.Sequential(model) if isinstance(model, (FusedChain, Elementwise)) else model
    try:
        gm = fx.symbolic_trace(root)
    except Exception as err:  # fx raises many types for untraceable code
        msg = errors.UNTRACEABLE.format(
            model=type(model).__name__, error=f"{type(err).__name__}: {err}"
        )
        raise errors.FadTraceError(msg) from err
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    infos, ok = _single_source_nodes(gm, nodes, order)
    regions: list[Region] = []
    folded = False
    for members in _chains(ok, infos, order):
        inside = set(members)
        source = ok[members[0]]
        outputs = [m for m in members if any(u not in inside for u in m.users)]
        ops = tuple(infos[m].name for m in members)
        layers = [m for m in members if infos[m].program is not None]
        if layers == members and len(members) == 1:
            continue  # one of fad's own layers alone: already one fused unit, as written
        skipped = _why_left(gm, nodes, order, members, ok, outputs, min_ops, infos)
        if skipped is not None:
            regions.append(Region(None, source.name, ops, len(outputs), skipped))
            continue
        name = f"fad_chain_{sum(r.name is not None for r in regions)}"
        program = _program(name, source, members, outputs, infos)
        kernel = builtin_of(program) if builtins else None
        if kernel is not None:
            _replace(gm, source, members, outputs, ("call_function", kernel.fn),
                     dict(kernel.kwargs))  # fmt: skip
            regions.append(Region(None, source.name, ops, 1, builtin=kernel.label))
            continue
        _replace(gm, source, members, outputs, ("call_module", name))
        # on dtypes without rules a chain falls back to autograd, unless it holds a layer
        # that raised there (the user's own fad.Swish() ...): then it raises, as that did
        fallback = all(infos[m].fallback for m in layers)
        gm.add_submodule(name, FusedChain(program, fallback=fallback))
        regions.append(Region(name, source.name, ops, len(outputs)))
        folded = folded or bool(layers)
    graph.lint()
    if folded:  # the layers whose programs joined a chain are no longer called
        gm.delete_all_unused_submodules()
    gm.recompile()
    gm.fad_regions = regions  # type: ignore[assignment]
    return gm


def _single_source_nodes(
    gm: fx.GraphModule, nodes: list[fx.Node], order: dict[fx.Node, int]
) -> tuple[dict[fx.Node, _Info], dict[fx.Node, fx.Node]]:
    """The primitive nodes (with their call) and, of those, the fad ones: a single source
    (the paper's in-degree 1) -> that source. In-place primitives are fad only when every
    earlier reader of the tensor they write is fad too; later readers are rewired to them."""
    infos: dict[fx.Node, _Info] = {}
    ok: dict[fx.Node, fx.Node] = {}  # fad node -> its single source
    for n in nodes:  # classified in order: in-place rewrites below change later nodes' args
        info = _classify(gm, n)
        if info is None:
            continue
        infos[n] = info
        srcs = {ok.get(o, o) for o in info.operands if isinstance(o, fx.Node)}
        if len(srcs) != 1:
            continue  # two sources: nfad (paper Fig. 3, node 3)
        if info.call is not None and info.call.inplace:
            target = info.operands[-1] if info.call.reverse else info.operands[0]
            earlier = [u for u in target.users if order[u] < order[n] and u is not n]
            if target not in ok or not all(u in ok for u in earlier):
                continue
            for u in list(target.users):  # later readers read the written value
                if order[u] > order[n]:
                    u.replace_input_with(target, n)
        ok[n] = next(iter(srcs))
    return infos, ok


def _chains(
    ok: dict[fx.Node, fx.Node], infos: dict[fx.Node, _Info], order: dict[fx.Node, int]
) -> list[list[fx.Node]]:
    """The connected components over fad -> fad edges, each in graph order, in graph order."""
    parent = {n: n for n in ok}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in ok:
        for o in infos[n].operands:
            if isinstance(o, fx.Node) and o in ok:
                parent[find(n)] = find(o)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in ok:
        groups.setdefault(find(n), []).append(n)
    chains = [sorted(m, key=order.__getitem__) for m in groups.values()]
    return sorted(chains, key=lambda m: order[m[0]])


def _why_left(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    order: dict[fx.Node, int],
    members: list[fx.Node],
    ok: dict[fx.Node, fx.Node],
    outputs: list[fx.Node],
    min_ops: int,
    infos: dict[fx.Node, _Info],
) -> str | None:
    """Why a chain stays with autograd, or ``None`` when it is fused."""
    if not outputs:
        return "no value leaves it (dead code)"
    size = sum(infos[m].size for m in members)
    if size < min_ops:
        return f"{size} primitive(s) < min_ops={min_ops}"
    inside = set(members)
    lo, hi = order[members[0]], order[members[-1]]
    between = [n for n in nodes[lo:hi] if n not in inside]
    if any(_mutates(gm, n) and not _private(n, ok, inside) for n in between):
        return "another node may write in place while the chain runs"
    return None


def _program(
    name: str,
    source: fx.Node,
    members: list[fx.Node],
    outputs: list[fx.Node],
    infos: dict[fx.Node, _Info],
) -> Program:
    """The chain ``members`` (reading ``source``) as a :class:`Program`; a member that is one
    of fad's own layers contributes its program's steps, whole."""
    slot: dict[fx.Node, int] = {source: 0}
    steps: list[Step] = []
    for m in members:
        info = infos[m]
        if info.program is None:
            assert info.call is not None
            operands = tuple(Ref(slot[o]) if isinstance(o, fx.Node) else o for o in info.operands)
            steps.append(Step(info.call.prim, operands, tuple(info.params.items())))
            slot[m] = len(steps)
            continue
        local = {0: slot[info.operands[0]]}  # the layer's slot 0 is its input's slot here
        for k, st in enumerate(info.program.steps):
            operands = tuple(Ref(local[o.index]) if isinstance(o, Ref) else o
                             for o in st.operands)  # fmt: skip
            steps.append(Step(st.prim, operands, st.params))
            local[k + 1] = len(steps)
        slot[m] = local[info.program.outputs[0]]
    return Program(name, tuple(steps), tuple(slot[o] for o in outputs))


def _replace(
    gm: fx.GraphModule,
    source: fx.Node,
    members: list[fx.Node],
    outputs: list[fx.Node],
    call: tuple[str, Any],
    kwargs: dict[str, Any] | None = None,
) -> None:
    """Replace ``members`` by one node ``call = (op, target)`` reading ``source`` (a fused
    chain's submodule, or a built-in function); the chain's readers outside it read that
    node's outputs."""
    graph, inside = gm.graph, set(members)
    with graph.inserting_before(members[0]):
        fused = graph.create_node(call[0], call[1], (source,), kwargs or {})
        gets = [fused]
        if len(outputs) > 1:
            getitem = operator.getitem
            gets = [graph.call_function(getitem, (fused, i)) for i in range(len(outputs))]
    for o, g in zip(outputs, gets, strict=True):
        for u in list(o.users):
            if u not in inside:
                u.replace_input_with(o, g)
    for m in reversed(members):
        graph.erase_node(m)


def fused_chains(model: nn.Module) -> list[FusedChain]:
    """The :class:`FusedChain` submodules of a model (what :func:`nest` inserted)."""
    return [m for m in model.modules() if isinstance(m, FusedChain)]
