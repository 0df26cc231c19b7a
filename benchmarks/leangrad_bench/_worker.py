"""The bench's fresh-process worker: ``python -m leangrad_bench._worker`` (JSON on stdin).

Started by :func:`leangrad.measure._rss.run_json_worker` (or ``run_rss_worker``), so the
resident set follows live memory (``MALLOC_MMAP_THRESHOLD_`` set: large blocks are
``mmap``-ed and returned on free); one thread. The payload's ``"mode"`` picks what it
measures; it prints one JSON line. Nothing but ``torch.compile``'s steps is timed here.

- ``"rss"`` (the runner's cross-check, :mod:`leangrad_bench._runner`): the workload and
  engine named in the payload (:func:`._workloads.build`); one warm-up step, its gradients
  freed, then one step under :func:`~leangrad.measure._rss.measure_rss`:
  ``{"rss_before": ..., "rss_peak": ...}``;
- ``"zoo"`` (:mod:`leangrad_bench._zoo_rows`): the zoo model (:func:`._models.build`,
  seeded: the same model and batch as the suite's process). ``"methods"``: each method's
  step (gradients set to ``None`` first, two warm-up steps), then the peak of the resident
  set during one more above the resident set before it. ``"compile"``: for each
  ``activation_memory_budget`` (``null``: torch.compile's default),
  :func:`~leangrad.measure._compile.compile_costs` in a cold inductor cache (no earlier
  compile reused): the first step's seconds, the gradient against eager backprop's, the
  peak of a compiled step and of an eager one (RSS on the CPU, where inductor's buffers
  are invisible to the tracker; the CUDA allocator's on ``"device"`` CUDA) and both steps'
  medians of interleaved repeats;
- ``"plan-compile"`` (:mod:`leangrad_bench._plan_suite`): the plan suite's workload
  (:func:`._plan_peers.workload`) compiled with ``activation_memory_budget = budget``;
  the compile time, the peak RSS of one training step (backward and SGD step) compiled
  and eager, and both steps' medians of interleaved repeats (``"repeats"``, 0: none);
- ``"plan-engine"``: the leangrad engine's training step (optimizer after backward, or
  per layer in ``on_grad``) and eager backprop's; both peak RSS values.

Each mode imports its model builder when it runs, so a worker loads what its mode needs.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from leangrad import _errors as errors
from leangrad.engines import engine
from leangrad.measure._compile import cold_inductor_cache, compile_costs, stepper, warm_rss
from leangrad.measure._rss import measure_rss

__all__ = ["MODES", "main"]

UNKNOWN_MODE = "unknown worker mode {mode!r}; the payload's 'mode' is one of: {known}"

Payload = dict[str, Any]


def _rss(payload: Payload) -> Payload:
    """One engine's step on a ``_workloads`` config: one warm-up, its gradients freed."""
    from ._workloads import build

    wl = build(payload["config"])
    eng = engine(payload["engine"], **payload.get("options", {}))
    eng.backward(wl.model, wl.inputs, wl.loss_fn)
    wl.model.zero_grad(set_to_none=True)
    rss = measure_rss(lambda: eng.backward(wl.model, wl.inputs, wl.loss_fn))
    return {"rss_before": rss.rss_before, "rss_peak": rss.rss_peak}


def _zoo(payload: Payload) -> Payload:
    """A zoo model: each method's warm RSS, then torch.compile at each budget."""
    from ._models import build
    from ._zoo_methods import Method

    wl = build(payload["model"], payload["size"], device=payload.get("device", "cpu"))
    model, x, loss_fn = wl.model, wl.inputs, wl.loss_fn
    rss: dict[str, int] = {}
    for m in payload.get("methods", []):
        eng = Method(**m).make()
        step = functools.partial(eng.backward, model, x, loss_fn)
        rss[m["label"]] = warm_rss(stepper(model, step))
    compiled: Payload = {}
    for budget in payload.get("compile", []):
        key = "default" if budget is None else str(budget)
        try:
            with cold_inductor_cache("leangrad-zoo-inductor-"):  # no earlier compile reused
                compiled[key] = compile_costs(model, x, loss_fn, budget,
                                              int(payload.get("repeats", 3)))  # fmt: skip
        except Exception as err:  # a compile failure is a finding; the others still run
            compiled[key] = {"failed": f"{type(err).__name__}: {str(err)[:500]}"}
    return {"rss": rss, "compile": compiled}


def _plan_compile(payload: Payload) -> Payload:
    """The plan suite's training step compiled at one budget, beside the eager one."""
    import torch._functorch.config as functorch_config

    from ._plan_peers import make_sgd, workload

    model, x, loss_fn, _ = workload(payload["kind"], payload["size"])
    opt = make_sgd([p for p in model.parameters() if p.requires_grad])
    eager = stepper(model, lambda: loss_fn(model(x)).backward(), optimizer=opt)
    compiled_model = torch.compile(model)
    compiled = stepper(model, lambda: loss_fn(compiled_model(x)).backward(), optimizer=opt)
    start = time.perf_counter()
    with functorch_config.patch(activation_memory_budget=float(payload["budget"])):
        compiled()  # dynamo, AOT autograd's partition (where the budget acts) and inductor
    compile_s = time.perf_counter() - start
    out = {"compile_s": compile_s, "rss_eager": warm_rss(eager),
           "rss_compiled": warm_rss(compiled)}  # fmt: skip
    repeats = int(payload.get("repeats", 0))
    if repeats:
        from leangrad.measure import time_interleaved

        t = time_interleaved({"eager": eager, "compiled": compiled}, repeats=repeats, warmup=1)
        out.update(t_eager=t["eager"].median, t_compiled=t["compiled"].median)
    return out


def _plan_engine(payload: Payload) -> Payload:
    """A leangrad engine's training step (:class:`leangrad._step.Step`) beside backprop's."""
    from leangrad._step import Step

    from ._plan_peers import make_sgd, workload

    model, x, loss_fn, _ = workload(payload["kind"], payload["size"])
    eng = engine(payload["engine"], **payload.get("options", {}))
    ours = Step(eng, make_sgd, per_layer=bool(payload.get("per_layer")))
    rss = warm_rss(lambda: ours.backward(model, x, loss_fn))
    params = [p for p in model.parameters() if p.requires_grad]
    eager = stepper(model, lambda: loss_fn(model(x)).backward(), optimizer=make_sgd(params))
    return {"rss": rss, "rss_backprop": warm_rss(eager)}


MODES: dict[str, Callable[[Payload], Payload]] = {
    "rss": _rss,
    "zoo": _zoo,
    "plan-compile": _plan_compile,
    "plan-engine": _plan_engine,
}


def main() -> None:
    payload = json.loads(sys.stdin.read())
    mode = payload.get("mode")
    if mode not in MODES:
        raise errors.UnknownNameError(UNKNOWN_MODE.format(mode=mode, known=", ".join(MODES)))
    torch.set_num_threads(1)
    print(json.dumps(MODES[mode](payload)))


if __name__ == "__main__":
    main()
