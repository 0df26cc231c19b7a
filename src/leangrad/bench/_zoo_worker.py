"""Fresh-process worker of the ``zoo`` suite: ``python -m leangrad.bench._zoo_worker``.

Reads a JSON payload on stdin, builds the zoo model (:func:`_zoo_methods.build`, seeded:
the same model and batch as the suite's process) and prints one JSON line. Started by
:func:`leangrad.measure._rss.run_json_worker` (``MALLOC_MMAP_THRESHOLD_`` set, so the
resident set follows live memory), one thread.

- ``"methods"``: each method's step (gradients set to ``None`` first, two warm-up steps),
  then the peak of the resident set during one more, above the resident set before it;
- ``"compile"``: for each ``activation_memory_budget`` (``null``: torch.compile's
  default), ``torch.compile(model)`` afresh: the first step's seconds (dynamo, AOT
  autograd's partition, where the budget acts, and inductor; cold: each setting gets an
  empty temporary directory as inductor's cache, so no earlier compile is reused), the
  gradient against eager backprop's in this process, the peak RSS of a compiled step and
  of an eager one, and both steps' medians of interleaved repeats. Inductor's buffers are
  invisible to the tracker, so RSS is the only measure of compile's memory on the CPU; on
  CUDA (``"device"``) every buffer comes from the caching allocator, so the peak is its
  ``max_memory_allocated`` during a step above what was allocated when it began.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ..measure import compare_grads, time_interleaved
from ..measure._rss import measure_rss
from ._zoo_methods import Inputs, Method, build, call


def _warm_rss(step: Callable[[], None]) -> int:
    step()  # warm-up: prepared copies, allocator, compiled code
    step()
    return measure_rss(step).peak_above


def _warm_cuda(step: Callable[[], None], device: torch.device) -> int:
    step()  # warm-up, as for RSS
    step()
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)) - start


def _stepper(model: torch.nn.Module, run: Callable[[], None]) -> Callable[[], None]:
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        run()

    return step


def _grads(model: torch.nn.Module, step: Callable[[], None]) -> dict[str, torch.Tensor]:
    step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compile(
    model: torch.nn.Module, x: Inputs, loss_fn: Any, budget: float | None, repeats: int
) -> dict[str, Any]:
    import torch._dynamo
    import torch._functorch.config as functorch_config

    eager = _stepper(model, lambda: loss_fn(call(model, x)).backward())
    torch._dynamo.reset()
    compiled_model: Any = torch.compile(model)
    compiled = _stepper(model, lambda: loss_fn(call(compiled_model, x)).backward())
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
            out.update(cuda_peak_eager=_warm_cuda(eager, dev), cuda_peak=_warm_cuda(compiled, dev))
        else:
            out.update(rss_eager=_warm_rss(eager), rss=_warm_rss(compiled))
        t = time_interleaved({"eager": eager, "compiled": compiled}, repeats=repeats, warmup=1)
    out.update(t_eager=t["eager"].median, t=t["compiled"].median)
    return out


def main() -> None:
    payload = json.loads(sys.stdin.read())
    torch.set_num_threads(1)
    wl = build(payload["model"], payload["size"], device=payload.get("device", "cpu"))
    model, x, loss_fn = wl.model, wl.inputs, wl.loss_fn
    rss: dict[str, int] = {}
    for m in payload.get("methods", []):
        eng = Method(**m).make()
        step = functools.partial(eng.backward, model, x, loss_fn)
        rss[m["label"]] = _warm_rss(_stepper(model, step))
    compiled: dict[str, Any] = {}
    for budget in payload.get("compile", []):
        key = "default" if budget is None else str(budget)
        cache = tempfile.mkdtemp(prefix="leangrad-zoo-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: no compile of an earlier run
        try:
            compiled[key] = _compile(model, x, loss_fn, budget, int(payload.get("repeats", 3)))
        except Exception as err:  # a compile failure is a finding; the others still run
            compiled[key] = {"failed": f"{type(err).__name__}: {str(err)[:500]}"}
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"rss": rss, "compile": compiled}))


if __name__ == "__main__":
    main()
