"""What ``torch.compile`` costs, measured in the process that calls it (a fresh one: the
bench's worker, :mod:`leangrad_bench._worker`, and ``plan(compile=True)``'s,
:mod:`leangrad.planner._compile`).

:func:`compile_costs` compiles a model afresh — the first step's seconds (dynamo, AOT
autograd's partition, where ``activation_memory_budget`` acts, and inductor) — and checks
its gradient against eager backprop's, then measures a warm compiled step and a warm eager
one: peak RSS on the CPU (inductor's buffers are invisible to the tracker), the CUDA
caching allocator's peak on a GPU, and both steps' medians of interleaved repeats. Run it
inside :func:`cold_inductor_cache` so no earlier compile is reused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._grads import compare_grads
from ._rss import measure_rss
from ._timer import time_interleaved

__all__ = ["cold_inductor_cache", "compile_costs", "stepper", "warm_rss"]


@contextlib.contextmanager
def cold_inductor_cache(prefix: str = "leangrad-inductor-") -> Iterator[str]:
    """An empty temporary directory as inductor's cache for the block (removed after)."""
    cache = tempfile.mkdtemp(prefix=prefix)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        yield cache
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def warm_rss(step: Callable[[], None]) -> int:
    """The peak resident set of ``step`` above the one before it, after two warm-up steps
    (prepared copies, the allocator, compiled code)."""
    step()
    step()
    return measure_rss(step).peak_above


def _warm_cuda(step: Callable[[], None], model: torch.nn.Module, device: torch.device) -> int:
    """The CUDA allocator's peak of ``step`` above the memory before it, after two warm-up
    steps; the warm-up's ``.grad`` are freed first, so the step's own gradients count."""
    step()  # warm-up, as for RSS
    step()
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)) - start


def stepper(
    model: torch.nn.Module,
    run: Callable[[], None],
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> Callable[[], None]:
    """``run`` with the model's ``.grad`` set to None first (as after ``zero_grad``); with
    ``optimizer``, a training step: then ``optimizer.step()`` and
    ``optimizer.zero_grad(set_to_none=True)``, so the next step starts with no ``.grad``."""

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        run()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def _grads(model: torch.nn.Module, step: Callable[[], None]) -> dict[str, torch.Tensor]:
    step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _call(model: Callable[..., Any], inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def compile_costs(model: torch.nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor],
                  budget: float | None, repeats: int, *,
                  step: Callable[[], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """``torch.compile(model)`` (``budget``: ``activation_memory_budget``, ``None`` for the
    default) beside eager backprop: ``compile_s``, ``grad_max_rel_err``, ``grad_cosine``,
    ``rss``/``rss_eager`` (CPU) or ``cuda_peak``/``cuda_peak_eager`` (CUDA), ``t``/``t_eager``.
    ``inputs``: one tensor, or a tuple for ``model(*inputs)``. ``step``: another compiled
    step to measure in its place (forward and backward of ``model``'s loss, compiling on its
    first call: regional compilation, :mod:`leangrad.planner._regional`); each run starts
    with the model's ``.grad`` set to None."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    eager = stepper(model, lambda: loss_fn(_call(model, inputs)).backward())
    torch._dynamo.reset()
    if step is None:
        compiled_model: Any = torch.compile(model)
        compiled = stepper(model, lambda: loss_fn(_call(compiled_model, inputs)).backward())
    else:
        compiled = stepper(model, step)
    patch = (
        contextlib.nullcontext()
        if budget is None
        else functorch_config.patch(activation_memory_budget=float(budget))
    )
    with patch:
        start = time.perf_counter()
        got = _grads(model, compiled)
        out: dict[str, Any] = {"compile_s": time.perf_counter() - start}
        cmp = compare_grads(got, _grads(model, eager))
        out.update(grad_max_rel_err=cmp.max_rel_err, grad_cosine=cmp.cosine)
        dev = next(model.parameters()).device
        if dev.type == "cuda":
            out.update(
                cuda_peak_eager=_warm_cuda(eager, model, dev),
                cuda_peak=_warm_cuda(compiled, model, dev),
            )
        else:
            out.update(rss_eager=warm_rss(eager), rss=warm_rss(compiled))
        t = time_interleaved({"eager": eager, "compiled": compiled}, repeats=repeats, warmup=1)
    out.update(t_eager=t["eager"].median, t=t["compiled"].median)
    return out
