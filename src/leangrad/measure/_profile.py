"""``profile_step``: one call that measures what a training step with an engine costs —
the measurement the planner, the benchmarks and the demo stand on (DESIGN.md,
"Composition and planning").

It leaves no trace: the model's ``.grad``, buffers (BatchNorm statistics) and the RNG
streams are as they were before the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._keywords import positional
from ._grads import compare_grads
from ._memory import MemoryReport, MemoryTracker
from ._timer import time_interleaved

__all__ = ["StepProfile", "profile_step", "untouched"]


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """What one step with an engine costs.

    Attributes:
        engine: the engine's label.
        peak_bytes: tracker peak above the baseline (parameters, buffers, inputs), with
            ``.grad`` starting as ``None`` — the step allocates its gradients, as after
            ``optimizer.zero_grad()``.
        kept_bytes: live bytes above the baseline when the engine's forward phase ended
            (what it keeps for the backward phase); ``None`` if it did not mark it.
        seconds: median step time over ``repeats`` (``None`` when ``repeats=0``).
        grad_max_rel_err, grad_cosine: against ``reference`` (``None`` without one).
        estimate: the peak was measured on fake tensors (nothing allocated).
        baseline_bytes: parameters, buffers and inputs (what exists before the step).
    """

    engine: str
    peak_bytes: int
    kept_bytes: int | None
    seconds: float | None
    grad_max_rel_err: float | None = None
    grad_cosine: float | None = None
    estimate: bool = False
    baseline_bytes: int = 0
    peak_bytes_prealloc: int | None = None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, engine: Any, report: MemoryReport, result: Any, **measured: Any) -> StepProfile:
        """The profile of a step of ``engine`` that ``report`` tracked and that returned
        ``result`` (a ``StepResult``, whose ``info`` is kept), plus what else was measured."""
        return cls(engine=str(getattr(engine, "label", type(engine).__name__)),
                   peak_bytes=report.peak_bytes, kept_bytes=report.forward_live_bytes,
                   seconds=measured.pop("seconds", None), estimate=report.estimate,
                   baseline_bytes=report.baseline_bytes,
                   info=dict(getattr(result, "info", None) or {}), **measured)  # fmt: skip

    @property
    def total_bytes(self) -> int:
        """Baseline plus the step's peak: the memory the step needs in all."""
        return self.baseline_bytes + self.peak_bytes


def _rng_states(inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The CPU generator's state and that of each CUDA device an input is on."""
    states = {"cpu": torch.get_rng_state()}
    for d in {x.device for x in inputs if x.device.type == "cuda"}:
        states[str(d)] = torch.cuda.get_rng_state(d)
    return states


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    for dev, state in states.items():
        if dev == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, torch.device(dev))


@contextlib.contextmanager
def untouched(model: nn.Module, inputs: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Inside the block, steps may write ``.grad``, advance statistics and draw random
    numbers; on exit, gradients (of the model and the inputs), buffers and the RNG are put
    back as they were."""
    params = list(model.parameters())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    in_grads = [None if x.grad is None else x.grad.detach().clone() for x in inputs]
    bufs = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({x.device for x in inputs if x.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                for x, g in zip(inputs, in_grads, strict=True):
                    x.grad = g
                for b, v in bufs:
                    b.copy_(v)


def profile_step(
    engine: Any,
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    repeats: int = 3,
    warmup: int = 1,
    reference: Mapping[str, torch.Tensor] | None = None,
    threads: int | None = 1,
    prealloc: bool = False,
    baseline: Sequence[Any] = (),
) -> StepProfile:
    """Measure one step of ``engine.backward(model, inputs, loss_fn)``.

    Args:
        engine: a leangrad engine (anything with ``backward`` and ``label``).
        model, inputs, loss_fn: as for ``engine.backward``.
        repeats: timed steps (median); 0 measures memory only.
        warmup: untimed steps first (the engine's prepared copies, allocator, caches).
        reference: gradients to compare with (e.g. backprop's, by parameter name). The
            tracked step starts from the RNG state this call found (the warm-up steps'
            draws are undone), so a reference computed from that state sees the same
            dropout masks.
        threads: ``torch.set_num_threads`` while timing (``None`` leaves it).
        prealloc: also measure a step whose ``.grad`` are pre-allocated as zeros
            (``StepProfile.peak_bytes_prealloc``).
        baseline: more tensors or modules that exist before the step and are counted in
            the baseline, not the peak (e.g. the targets ``loss_fn`` closes over).

    Returns:
        A :class:`StepProfile`. The model, its gradients, buffers and the RNG streams are
        left as they were.
    """
    model, flat = positional(model, inputs)
    xs = (flat,) if isinstance(flat, torch.Tensor) else tuple(flat)
    named = dict(model.named_parameters())

    def step() -> None:
        for p in named.values():
            p.grad = None
        engine.backward(model, xs, loss_fn)

    with untouched(model, xs):
        rng = _rng_states(xs)
        for _ in range(warmup):
            step()
        for p in named.values():
            p.grad = None
        gc.collect()
        # the tracked step draws the random numbers the caller's step would (dropout masks
        # as a reference computed from the same state), not the warm-up's successors
        _set_rng_states(rng)
        with MemoryTracker(baseline=(model, *xs, *baseline)) as tracker:
            result = engine.backward(model, xs, loss_fn)
        err = cos = None
        if reference is not None:
            got = {n: p.grad for n, p in named.items() if n in reference and p.grad is not None}
            if set(got) == set(reference):
                cmp = compare_grads(got, reference)
                err, cos = cmp.max_rel_err, cmp.cosine
            else:
                err, cos = float("inf"), float("nan")  # a gradient is missing
        prealloc_peak = None
        if prealloc:
            for p in named.values():
                p.grad = torch.zeros_like(p)
            gc.collect()
            with MemoryTracker(baseline=(model, *xs, *baseline)) as again:
                engine.backward(model, xs, loss_fn)
            prealloc_peak = again.report.peak_bytes
        seconds = None
        if repeats > 0:
            timing = time_interleaved({"step": step}, repeats=repeats, warmup=0, threads=threads)
            seconds = timing["step"].median
    return StepProfile.of(engine, tracker.report, result, seconds=seconds,
                          grad_max_rel_err=err, grad_cosine=cos,
                          peak_bytes_prealloc=prealloc_peak)  # fmt: skip
