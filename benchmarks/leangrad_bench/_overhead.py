"""The ``overhead`` suite: host time and aten ops per step, each exact engine beside its
PyTorch twin — the same arithmetic written as a PyTorch user writes it.

On a model whose kernels cost almost nothing, the host time of a step *is* its overhead,
and the aten ops dispatched per step are the kernels a GPU would launch. Pairs:

- ``backprop`` ↔ ``loss_fn(model(x)).backward()``;
- ``checkpoint`` ↔ ``torch.utils.checkpoint`` (non-reentrant) around each block that
  leangrad's checkpointing recomputes (the same blocks: the same recomputation);
- ``accumulate(k)`` ↔ the hand loop: ``k`` micro-batches, each ``loss.backward()`` of its
  share of the batch's loss (:meth:`leangrad.loss.PerExample.rows`, the same weights);
- ``chunked_ce`` ↔ plain cross-entropy (no twin computes a chunked loss for free in
  PyTorch; torchtune's and Cut Cross-Entropy's, where they install, are the zoo's rows).

Time: medians of interleaved repeats after warm-up (:func:`leangrad.measure.
time_interleaved`), at 1 thread. Ops: counted with a ``TorchDispatchMode`` over one
steady-state step, split at the end of the forward phase (the twin's ``backward()`` call;
the engine's ``FORWARD_END`` mark).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import leangrad
from leangrad import _errors as errors
from leangrad.engines._wrapped import forward_replaced
from leangrad.loss import PerExample
from leangrad.measure import _memory, time_interleaved

from ._models import build
from ._suites import RunSettings, Suite

__all__ = ["count_ops", "render", "run_overhead", "twins"]

Step = Callable[[], None]
PAIRS = ("backprop", "checkpoint", "accumulate", "chunked_ce")


class _Counter(TorchDispatchMode):
    """Counts aten ops; :meth:`split` (the forward's end) starts the backward's count."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = [0, 0]
        self.phase = 0
        self.marks: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))

    def current_bytes(self) -> int:  # the engines' FORWARD_END mark lands here
        self.phase = 1
        return 0


def count_ops(step: Callable[[_Counter], None]) -> tuple[int, int]:
    """``(forward ops, backward ops)`` of one call of ``step(counter)``."""
    counter = _Counter()
    _memory._ACTIVE.append(counter)  # type: ignore[arg-type]
    try:
        with counter:
            step(counter)
    finally:
        _memory._ACTIVE.remove(counter)  # type: ignore[arg-type]
    return counter.counts[0], counter.counts[1]


@contextlib.contextmanager
def _per_block(model: nn.Module, names: list[str]) -> Iterator[None]:
    """Each named block's forward under ``torch.utils.checkpoint``, as a user wraps it."""
    with contextlib.ExitStack() as stack:
        for name in names:
            block = model.get_submodule(name)
            own = block.forward

            def run(*a: Any, _own: Callable[..., Any] = own, **kw: Any) -> Any:
                return checkpoint(_own, *a, use_reentrant=False, **kw)

            stack.enter_context(forward_replaced(block, run))
        yield


def twins(model: nn.Module, xs: tuple[torch.Tensor, ...], loss_fn: Any, *,
          micro_batches: int) -> dict[str, Callable[[Any], None]]:  # fmt: skip
    """The PyTorch twin of each pair, as ``step(counter)`` (``counter`` may be ``None``)."""
    ck: Any = leangrad.engine("checkpoint")
    found = ck.blocks(model)
    names = list(ck.recomputed(found))

    def split(counter: Any) -> None:
        if counter is not None:
            counter.phase = 1

    def plain(counter: Any) -> None:
        loss = loss_fn(model(*xs))
        split(counter)
        loss.backward()

    def per_block(counter: Any) -> None:
        with _per_block(model, names):
            loss = loss_fn(model(*xs))
        split(counter)
        loss.backward()

    def hand_loop(counter: Any) -> None:
        assert isinstance(loss_fn, PerExample)
        n = loss_fn.batch
        edges = [n * i // micro_batches for i in range(micro_batches + 1)]
        for i in range(micro_batches):
            a, b = edges[i], edges[i + 1]
            loss = loss_fn.rows(a, b)(model(*(x[a:b] for x in xs)))
            if i == 0:
                split(counter)
            loss.backward()

    out: dict[str, Callable[[Any], None]] = {
        "backprop": plain, "checkpoint": per_block, "accumulate": hand_loop, "chunked_ce": plain,
    }  # fmt: skip
    if found.runner is not None:  # pieces of an fx split: no module to wrap by hand
        del out["checkpoint"]
    return out


def _engine(pair: str, micro_batches: int) -> leangrad.Engine:
    if pair == "accumulate":
        return leangrad.engine("accumulate", micro_batches=micro_batches)
    return leangrad.engine(pair)


def run_overhead(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """One record per (model, pair): the engine's and its twin's host time and ops."""
    quick = settings.quick
    models: dict[str, dict[str, Any]] = dict(suite.setting("models", quick, {}))
    repeats = suite.repeats(quick)
    k = int(suite.setting("micro_batches", quick, 4))
    records: list[dict[str, Any]] = []
    for label, size in models.items():
        size = dict(size)
        name, batch = size.pop("model"), int(size.pop("batch"))
        wl = build(name, size, batch=batch, device=settings.device)
        model, loss_fn = wl.model, wl.loss_fn
        xs = wl.inputs if isinstance(wl.inputs, tuple) else (wl.inputs,)
        hands = twins(model, xs, loss_fn, micro_batches=k)
        for pair in PAIRS:
            if pair not in hands or (pair == "accumulate"
                                     and not isinstance(loss_fn, PerExample)):  # fmt: skip
                continue
            eng = _engine(pair, k)
            try:  # the first step also probes what the engine watches once
                _zeroed(model, functools.partial(_engine_step, eng, model, xs, loss_fn))
            except errors.LeangradError:  # refused, named (accumulate on BatchNorm)
                continue

            ours = functools.partial(_engine_step, eng, model, xs, loss_fn)

            steps: dict[str, Step] = {"leangrad": functools.partial(_zeroed, model, ours),
                                      "pytorch": functools.partial(_zeroed, model, hands[pair])}
            timing = time_interleaved(steps, repeats=repeats, warmup=2, reference="pytorch")
            ops = {side: count_ops(functools.partial(_zeroed, model, fn))
                   for side, fn in (("leangrad", ours), ("pytorch", hands[pair]))}  # fmt: skip
            records.append({
                "suite": suite.name, "model": label, "pair": pair, "engine": eng.label,
                "seconds": timing["leangrad"].median, "twin_seconds": timing["pytorch"].median,
                "ratio": timing["leangrad"].ratio, "ops_forward": ops["leangrad"][0],
                "ops_backward": ops["leangrad"][1], "twin_ops_forward": ops["pytorch"][0],
                "twin_ops_backward": ops["pytorch"][1], "repeats": repeats, "threads": 1,
                "params": wl.num_params, "batch": batch,
            })  # fmt: skip
        if settings.save is not None:
            settings.save(records)
    return records


def _engine_step(eng: leangrad.Engine, model: nn.Module, xs: tuple[torch.Tensor, ...],
                 loss_fn: Any, counter: Any) -> None:  # fmt: skip
    del counter  # the engine marks its forward's end itself
    eng.backward(model, xs, loss_fn)


def _zeroed(model: nn.Module, fn: Callable[[Any], None], counter: Any = None) -> None:
    """``.grad`` set to ``None``, then one step (``counter``: the op counter, when counting)."""
    model.zero_grad(set_to_none=True)
    fn(counter)


def render(suite: str, records: list[dict[str, Any]], directory: Any, *,
           plots: bool = True) -> list[str]:  # fmt: skip
    """Markdown: per model, each engine's host time beside its twin's, and the ops."""
    del suite, directory, plots
    lines = [
        "Host time per step (median of interleaved repeats, 1 thread) and aten ops per step "
        "(forward + backward), each exact engine beside its PyTorch twin on models whose "
        "kernels cost almost nothing.",
        "",
        "| model | engine | time | × twin | ops (fwd + bwd) | twin's ops | extra ops |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ours = r["ops_forward"] + r["ops_backward"]
        theirs = r["twin_ops_forward"] + r["twin_ops_backward"]
        lines.append(
            f"| {r['model']} | {r['engine']} | {r['seconds'] * 1e3:.2f} ms | {r['ratio']:.2f}× | "
            f"{r['ops_forward']} + {r['ops_backward']} | {r['twin_ops_forward']} + "
            f"{r['twin_ops_backward']} | {ours - theirs:+d} |")
    return lines
