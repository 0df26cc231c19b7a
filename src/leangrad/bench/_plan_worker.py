"""Fresh-process worker of the ``plan`` suite: ``python -m leangrad.bench._plan_worker``.

Reads a JSON payload on stdin, builds the suite's workload (:func:`_plan_peers.workload`)
and prints one JSON line. Started by :func:`leangrad.measure._rss.run_json_worker`, so the
resident set follows live memory (large blocks are ``mmap``-ed and returned on free).

- ``{"mode": "compile", "budget": b, ...}``: ``torch.compile`` of the model with
  ``torch._functorch.config.activation_memory_budget = b``; prints the compile time,
  the peak RSS of one training step (backward and SGD step) compiled and eager, and both
  steps' medians of interleaved repeats;
- ``{"mode": "engine", "engine": name, "options": {...}, "per_layer": bool, ...}``: the
  leangrad engine's training step (optimizer after backward, or per layer in
  ``on_grad``) and eager backprop's; prints both peak RSS values.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .._step import Step
from ..engines import engine
from ..measure import time_interleaved
from ..measure._rss import measure_rss
from ._plan_peers import make_sgd, workload


def _train(forward_loss: Callable[[], torch.Tensor],
           opt: torch.optim.Optimizer) -> Callable[[], None]:  # fmt: skip
    def step() -> None:
        forward_loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _warm_rss(step: Callable[[], None]) -> int:
    step()  # warm-up: optimizer state, allocator, compiled code
    step()
    return measure_rss(step).peak_above


def _compile(payload: dict[str, Any]) -> dict[str, Any]:
    import torch._functorch.config as functorch_config

    model, x, loss_fn, _ = workload(payload["kind"], payload["size"])
    opt = make_sgd([p for p in model.parameters() if p.requires_grad])
    eager = _train(lambda: loss_fn(model(x)), opt)
    compiled_model = torch.compile(model)
    compiled = _train(lambda: loss_fn(compiled_model(x)), opt)
    start = time.perf_counter()
    with functorch_config.patch(activation_memory_budget=float(payload["budget"])):
        compiled()  # dynamo, AOT autograd's partition (where the budget acts) and inductor
    compile_s = time.perf_counter() - start
    out = {"compile_s": compile_s, "rss_eager": _warm_rss(eager),
           "rss_compiled": _warm_rss(compiled)}  # fmt: skip
    repeats = int(payload.get("repeats", 0))
    if repeats:
        t = time_interleaved({"eager": eager, "compiled": compiled}, repeats=repeats, warmup=1)
        out.update(t_eager=t["eager"].median, t_compiled=t["compiled"].median)
    return out


def _engine(payload: dict[str, Any]) -> dict[str, Any]:
    model, x, loss_fn, _ = workload(payload["kind"], payload["size"])
    eng = engine(payload["engine"], **payload.get("options", {}))
    ours = Step(eng, make_sgd, per_layer=bool(payload.get("per_layer")))
    rss = _warm_rss(lambda: ours.backward(model, x, loss_fn))
    params = [p for p in model.parameters() if p.requires_grad]
    ref = _warm_rss(_train(lambda: loss_fn(model(x)), make_sgd(params)))
    return {"rss": rss, "rss_backprop": ref}


def main() -> None:
    payload = json.loads(sys.stdin.read())
    torch.set_num_threads(1)
    run = {"compile": _compile, "engine": _engine}[payload["mode"]]
    print(json.dumps(run(payload)))


if __name__ == "__main__":
    main()
