"""What one process holds when a step is spread over ``nproc`` processes:
``leangrad plan --nproc N --parallel fsdp|ddp`` and ``fit(budget=..., parallel="fsdp")``.

:func:`leangrad.plan` measures a step on one process holding the whole model. Under
``leangrad train --parallel fsdp`` (:mod:`leangrad.train._sharded`) each block
:func:`leangrad.blocks` finds, then the root, is ``fully_shard``-ed, and a rank holds
instead (the model of FSDP2 memory this module counts by; PyTorch, "torch.distributed.fsdp.
fully_shard", https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html, and
the FSDP notes' "FSDP Prefetch Nuances", https://docs.pytorch.org/docs/stable/notes/fsdp.html):

- its dim-0 shard of every parameter — ``ceil(dim0 / N)`` rows, the padded shard FSDP2
  allocates (``chunks[0]``, "0th always padded") — and as much of every gradient (the
  reduce-scatter's output) and of Adam's ``exp_avg`` and ``exp_avg_sq`` (made like the
  sharded parameter; the ``step`` counters are one scalar per parameter, not sharded);
- while a block computes, its parameters all-gathered (unsharded) and, with the implicit
  prefetch of the next block's all-gather, the next block's too: the two largest blocks'
  unsharded parameters are counted; in backward, a block's unsharded gradient lives until
  its reduce-scatter: the largest block's is counted;
- the root's own parameters (those in no block) unsharded from its forward to the end of
  the backward (``reshard_after_forward`` is ``False`` for the root), and their unsharded
  gradients until the root's reduce-scatter at the end of the backward;
- buffers unsharded, and the step's activations for its own (per-rank) batch.

Under ``--parallel ddp`` every rank holds everything one process does, plus the gradient
buckets its all-reduce runs on: PyTorch DDP's reducer keeps a flat copy of every gradient
(``gradient_as_bucket_view=False``, its default; :mod:`leangrad.train._buckets` flattens
each bucket likewise, all of them in flight at the end of the backward). On one process
(``nproc=1``) ``parallel`` is ignored, as :func:`leangrad.train.fit` ignores it.

Parameters, gradients, optimizer state, buffers and inputs are *counted* from shapes and
dtypes (so a model built on the ``meta`` device or under ``FakeTensorMode`` is counted
without allocating it); the activations are *measured*: the step's peak above parameters
and inputs with every gradient dropped the moment it is final (``on_grad``), by
:class:`leangrad.measure.MemoryTracker` on real tensors, or on fake tensors (an estimate:
no allocator rounding or kernel scratch) where the model is on ``meta`` or fake. The total
adds each part's peak — an upper bound, as the parts do not all peak at once: on 2 CPU
processes (``models.mlp(64, 1024, 8, 10)``, batch 8 per rank, Adam) a
:class:`~leangrad.measure.MemoryTracker` around an FSDP2 step saw 12.9 MB above the state
held between steps, where gathered plus activations count 17.1 MB (the gradient in flight
inside the activations' peak is also the block's unsharded gradient counted in gathered);
the parameters, gradients and Adam moments each rank held were the count to the byte
(``results/distributed/fsdp_memory.py``; the count adds Adam's 4-byte ``step`` scalars).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _errors as errors
from ..engines import Engine
from ..engines import engine as engine_named
from ._parallel import check_parallel, fsdp_refusal

__all__ = ["FSDP_CANDIDATES", "FSDP_NO_ENGINE", "FSDP_OVER_BUDGET", "OPTIMIZERS", "RankEstimate",
           "estimate_per_rank", "fsdp_budget_check"]  # fmt: skip

OPTIMIZERS = ("sgd", "adam")
"""Optimizers whose state is counted (``leangrad train --optimizer``; SGD as it makes it,
without momentum, keeps none)."""
BAD_NPROC = "nproc must be a whole number of processes >= 1, got {value!r}; e.g. nproc=2"
BAD_OPTIMIZER = "optimizer must be None, 'none', 'sgd' or 'adam', got {value!r}"
FSDP_CANDIDATES = ("backprop", "checkpoint")
"""Engines :func:`fsdp_budget_check` tries by default, in this order (least recomputation
first), each where FSDP2 can train it."""
FSDP_OVER_BUDGET = (
    "--parallel fsdp on {nproc} processes needs about {total} per rank with {engine}, the "
    "least of {tried}, over the budget of {budget} ({parts}); raise the budget, lower the "
    "batch size or train on more processes"
)
FSDP_NO_ENGINE = (
    "--parallel fsdp trains through FSDP2's own backward, which none of {engines} runs here "
    "({why}); name backprop with --engines, drop --engines, or use --parallel ddp"
)
NOTE = (
    "note: parameters, gradients, optimizer state, buffers, inputs, buckets and gathered are "
    "counted from parameter shapes and dtypes; activations are {how}; the total adds each "
    "part's peak (an upper bound: they do not all peak at once)"
)
FSDP_DOC = "https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html"


@dataclasses.dataclass(frozen=True)
class RankEstimate:
    """Bytes one of ``nproc`` processes holds for a step (see the module's docstring for
    what each part is and how it is counted).

    Attributes:
        nproc, parallel, optimizer, engine: what was estimated (``parallel`` is
            ``"single"`` on one process; ``optimizer`` ``None`` for none).
        parameters, gradients, optimizer_state: this rank's (shards under fsdp).
        buffers, inputs: not sharded; the inputs are the per-rank batch.
        buckets: ddp's gradient buckets (a flat copy of every gradient); 0 otherwise.
        gathered: fsdp's unsharded parameters and gradients at once (the root's own, the
            two largest blocks' parameters, the largest block's gradient); 0 otherwise.
        activations: the step's measured peak above parameters and inputs, gradients
            dropped as they arrive (``activations_how`` says how it was measured).
        total: the sum of all the parts above.
    """

    nproc: int
    parallel: str
    optimizer: str | None
    engine: str
    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int
    inputs: int
    buckets: int
    gathered: int
    activations: int
    activations_how: str
    total: int = dataclasses.field(init=False)

    PARTS = ("parameters", "gradients", "optimizer_state", "buffers", "inputs", "buckets",
             "gathered", "activations")  # fmt: skip

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", sum(self.parts().values()))

    def parts(self) -> dict[str, int]:
        """Each part's bytes, by field name (their sum is :attr:`total`)."""
        return {name: int(getattr(self, name)) for name in self.PARTS}

    def fits(self, budget: int) -> bool:
        """The total is within ``budget`` bytes."""
        return self.total <= budget

    def summary(self, budget: int) -> str:
        """One line: the total per rank against ``budget``, and whether it fits."""
        from .._sizes import fmt_bytes

        verdict = "fits" if self.fits(budget) else "over budget"
        return (f"per rank ({self.parallel}, {self.nproc} processes, {self.engine}): about "
                f"{fmt_bytes(self.total)} of {fmt_bytes(budget)}: {verdict}")  # fmt: skip

    @property
    def title(self) -> str:
        how = {"fsdp": f"FSDP2-sharded over {self.nproc} processes",
               "ddp": f"DDP over {self.nproc} processes (every rank holds everything)",
               "single": "one process"}[self.parallel]  # fmt: skip
        return (f"per-rank memory, {how}; optimizer {self.optimizer or 'none'}, "
                f"activations of {self.engine}")  # fmt: skip

    def table(self) -> str:
        """The parts, one a line, the total, and a note on what was measured and what
        counted (the lines ``leangrad plan --nproc N`` prints)."""
        from .._sizes import fmt_bytes

        rows = [(name.replace("_", " "), fmt_bytes(b)) for name, b in self.parts().items()]
        rows.append(("total per rank", fmt_bytes(self.total)))
        width = max(len(r[0]) for r in rows)
        lines = [self.title]
        lines += [f"  {name:{width}s}  {value:>10s}" for name, value in rows]
        lines.append(NOTE.format(how=self.activations_how))
        if self.parallel == "fsdp":
            lines.append(f"FSDP2 memory model: {FSDP_DOC}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclasses.dataclass(frozen=True)
class _Group:
    """One ``fully_shard`` group's bytes: unsharded, and one rank's padded shard."""

    full: int
    full_grad: int
    shard: int
    shard_grad: int


def estimate_per_rank(model: nn.Module, inputs: torch.Tensor | Sequence[torch.Tensor],
                      loss_fn: Callable[[Any], torch.Tensor], *, nproc: int, parallel: str,
                      optimizer: str | None, engine: Engine | str | None = None,
                      activations: int | None = None) -> RankEstimate:  # fmt: skip
    """The bytes one of ``nproc`` processes holds for a step of ``engine`` (backprop by
    default) on ``model`` with its per-rank batch ``inputs``, under ``parallel``
    (``"ddp"`` or ``"fsdp"``) with ``optimizer`` (``None``/``"none"``, ``"sgd"``,
    ``"adam"``).

    The model may be real, on the ``meta`` device or made under ``FakeTensorMode``:
    everything but the activations is counted from parameter shapes and dtypes, and the
    activations are measured on real tensors or, for a meta/fake model, on fake ones.
    ``activations`` gives them instead (bytes measured elsewhere), and nothing is run.

    Raises:
        OptionError: ``nproc`` below 1, an unknown ``parallel`` or ``optimizer``, or an
            engine fsdp cannot train (:func:`leangrad.planner._parallel.fsdp_refusal`).
        EngineInputError: fsdp finds no blocks in the model (as training would).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise errors.OptionError(BAD_NPROC.format(value=nproc))
    check_parallel(parallel)
    opt = _check_optimizer(optimizer)
    eng = engine_named(engine or "backprop") if not isinstance(engine, Engine) else engine
    mode = parallel if nproc > 1 else "single"
    if mode == "fsdp" and (why := fsdp_refusal(eng, model)) is not None:
        raise errors.OptionError(why)
    xs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    groups = _groups(model, eng, nproc if mode == "fsdp" else 1)
    params = sum(g.shard for g in groups)
    grads = sum(g.shard_grad for g in groups)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    state = 0 if opt != "adam" else 2 * grads + trainable * _scalar_bytes()
    gathered = 0
    if mode == "fsdp":
        root, blocks = groups[-1], groups[:-1]
        biggest = sorted((g.full for g in blocks), reverse=True)[:2]
        gathered = root.full + root.full_grad + sum(biggest) + max(
            (g.full_grad for g in blocks), default=0)
    how = "given"
    if activations is None:
        activations, how = _activation_peak(eng, model, xs, loss_fn)
    return RankEstimate(
        nproc=nproc, parallel=mode, optimizer=opt, engine=eng.label, parameters=params,
        gradients=grads, optimizer_state=state,
        buffers=sum(_nbytes(b) for b in model.buffers()), inputs=sum(_nbytes(x) for x in xs),
        buckets=grads if mode == "ddp" else 0, gathered=gathered, activations=activations,
        activations_how=how,
    )  # fmt: skip


def fsdp_budget_check(model: nn.Module, inputs: torch.Tensor | Sequence[torch.Tensor],
                      loss_fn: Callable[[Any], torch.Tensor], *, budget: int, nproc: int,
                      optimizer: str | None, engines: Sequence[str] | None = None,
                      ) -> tuple[str, RankEstimate]:  # fmt: skip
    """``fit(budget=..., parallel="fsdp")`` under ``nproc`` processes: a plan measures one
    process holding the whole model, so instead the budget is compared with each engine's
    per-rank estimate (:func:`estimate_per_rank`), in the order of ``engines`` (default
    :data:`FSDP_CANDIDATES`: backprop, then checkpoint), skipping those FSDP2 cannot train
    (:func:`~leangrad.planner._parallel.fsdp_refusal`). Returns the first that fits, by name, and
    its estimate (not timed: the order puts the least recomputation first).

    Raises:
        OptionError: FSDP2 can train none of ``engines``.
        EngineInputError: none fits ``budget`` (the message names the least total, its
            engine and its parts).
    """
    from .._sizes import fmt_bytes

    names = list(engines) if engines is not None else list(FSDP_CANDIDATES)
    tried: list[tuple[str, RankEstimate]] = []
    refused: list[str] = []
    for name in names:
        eng = engine_named(name)
        if (why := fsdp_refusal(eng, model)) is not None:
            refused.append(f"{name}: {why}")
            continue
        try:
            est = estimate_per_rank(model, inputs, loss_fn, nproc=nproc, parallel="fsdp",
                                    optimizer=optimizer, engine=eng)  # fmt: skip
        except errors.LeangradError as err:  # this engine cannot run the step: the next
            refused.append(f"{name}: {err}")
            continue
        if est.fits(budget):
            return name, est
        tried.append((name, est))
    if not tried:
        raise errors.OptionError(FSDP_NO_ENGINE.format(engines=", ".join(names),
                                                       why="; ".join(refused)))  # fmt: skip
    name, least = min(tried, key=lambda t: t[1].total)
    parts = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}"
                      for k, v in least.parts().items() if v)  # fmt: skip
    raise errors.EngineInputError(FSDP_OVER_BUDGET.format(
        nproc=nproc, total=fmt_bytes(least.total), engine=name,
        tried=", ".join(n for n, _ in tried), budget=fmt_bytes(budget), parts=parts))


def _check_optimizer(optimizer: str | None) -> str | None:
    if optimizer is None or optimizer == "none":
        return None
    if optimizer not in OPTIMIZERS:
        raise errors.OptionError(BAD_OPTIMIZER.format(value=optimizer))
    return optimizer


def _scalar_bytes() -> int:
    """Bytes of one of Adam's ``step`` counters: a 0-dim tensor of float32, or float64
    where that is the default dtype (``torch.optim.optimizer._get_scalar_dtype``)."""
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.dtype.itemsize


def _shard_bytes(p: torch.Tensor, nproc: int) -> int:
    """One rank's padded dim-0 shard of ``p`` (FSDP2 pads every shard to the first's
    ``ceil(dim0 / nproc)`` rows); a 0-dim tensor is held whole."""
    if p.dim() == 0 or nproc == 1:
        return _nbytes(p)
    rows = p.shape[0]
    per_row = p.numel() // rows if rows else 0
    return math.ceil(rows / nproc) * per_row * p.dtype.itemsize


def _groups(model: nn.Module, eng: Engine, nproc: int) -> list[_Group]:
    """The ``fully_shard`` groups :func:`leangrad.train._sharded.shard` makes — each block
    of the engine's with parameters (in :meth:`eng.blocks <leangrad.engines.Engine.blocks>`'s
    order, a block's parameters being those no earlier group took), then the root with the
    rest — or the whole model as one group when nothing is sharded (``nproc == 1``). The
    root is last."""
    taken: set[int] = set()
    members: list[list[nn.Parameter]] = []
    if nproc > 1:
        found = eng.blocks(model)
        for name in found.names:
            module = found.modules[name]
            if module is model:
                continue
            mine = [p for p in module.parameters() if id(p) not in taken]
            if mine:
                taken.update(id(p) for p in mine)
                members.append(mine)
    members.append([p for p in model.parameters() if id(p) not in taken])

    def group(ps: list[nn.Parameter]) -> _Group:
        grads = [p for p in ps if p.requires_grad]
        return _Group(full=sum(map(_nbytes, ps)), full_grad=sum(map(_nbytes, grads)),
                      shard=sum(_shard_bytes(p, nproc) for p in ps),
                      shard_grad=sum(_shard_bytes(p, nproc) for p in grads))  # fmt: skip

    return [group(ps) for ps in members]


class _GradsDropped:
    """Engine-like for :func:`leangrad.measure.profile_step`: ``inner``'s step with each
    gradient dropped the moment it is final (``on_grad``), so its peak holds the
    activations and only the gradients in flight — the gradients are counted apart."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.label = f"{inner.label} (gradients dropped)"
        self.exact = inner.exact

    def backward(self, model: nn.Module, xs: Any, loss_fn: Callable[[Any], torch.Tensor]) -> Any:
        return self.inner.backward(model, xs, loss_fn, on_grad=_drop)


def _drop(name: str, p: nn.Parameter) -> None:
    del name
    p.grad = None


def _is_real(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor) and not t.is_meta


def _activation_peak(eng: Engine, model: nn.Module, xs: tuple[torch.Tensor, ...],
                     loss_fn: Callable[[Any], torch.Tensor]) -> tuple[int, str]:  # fmt: skip
    """The step's peak above parameters and inputs, gradients dropped as they arrive, and
    how it was measured: on real tensors where the model and inputs are, else on fake ones."""
    from ..measure import profile_step

    tensors = list(itertools.chain(model.parameters(), model.buffers(), xs))
    step = _GradsDropped(eng)
    if all(_is_real(t) for t in tensors):
        peak = profile_step(step, model, xs, loss_fn, repeats=0).peak_bytes
        return peak, f"measured ({eng.label}'s step, MemoryTracker on real tensors)"
    return _fake_peak(step, model, xs, loss_fn), (
        f"estimated ({eng.label}'s step, MemoryTracker on fake tensors: the model is not real)")


def _fake_peak(step: _GradsDropped, model: nn.Module, xs: tuple[torch.Tensor, ...],
               loss_fn: Callable[[Any], torch.Tensor]) -> int:  # fmt: skip
    """:func:`leangrad.measure.estimate_step`'s peak for a model whose tensors may be on
    ``meta`` or fake already: every parameter, buffer and input is made afresh as a fake
    tensor of its shape and dtype on the inputs' device (the CPU if none is real)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensor,
        FakeTensorMode,
    )

    from ..measure import MemoryTracker
    from ..measure._estimate import READS_VALUES, _with_fake_tensors

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    real = [x for x in xs if _is_real(x)]
    device = real[0].device if real else torch.device("cpu")

    def fake(t: torch.Tensor) -> torch.Tensor:
        if _is_real(t):
            return mode.from_tensor(t)
        with mode:
            made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        assert isinstance(made, FakeTensor)
        return made

    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        f = fake(t)
        memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else f  # fmt: skip
    fake_model = copy.deepcopy(model, memo)
    fake_xs = tuple(fake(x) for x in xs)
    fake_loss_fn = _with_fake_tensors(loss_fn, mode)
    with mode:
        try:
            with MemoryTracker(baseline=(fake_model, *fake_xs), estimate=True) as tracker:
                step.backward(fake_model, fake_xs, fake_loss_fn)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise errors.EngineInputError(READS_VALUES.format(op=e)) from e
    return tracker.report.peak_bytes
