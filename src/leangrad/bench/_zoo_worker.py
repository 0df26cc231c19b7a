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

import functools
import json
import sys
from typing import Any

import torch

from ..measure._compile import cold_inductor_cache, compile_costs, stepper, warm_rss
from ._zoo_methods import Method, build


def main() -> None:
    payload = json.loads(sys.stdin.read())
    torch.set_num_threads(1)
    wl = build(payload["model"], payload["size"], device=payload.get("device", "cpu"))
    model, x, loss_fn = wl.model, wl.inputs, wl.loss_fn
    rss: dict[str, int] = {}
    for m in payload.get("methods", []):
        eng = Method(**m).make()
        step = functools.partial(eng.backward, model, x, loss_fn)
        rss[m["label"]] = warm_rss(stepper(model, step))
    compiled: dict[str, Any] = {}
    for budget in payload.get("compile", []):
        key = "default" if budget is None else str(budget)
        try:
            with cold_inductor_cache("leangrad-zoo-inductor-"):  # no earlier compile reused
                compiled[key] = compile_costs(model, x, loss_fn, budget,
                                              int(payload.get("repeats", 3)))  # fmt: skip
        except Exception as err:  # a compile failure is a finding; the others still run
            compiled[key] = {"failed": f"{type(err).__name__}: {str(err)[:500]}"}
    print(json.dumps({"rss": rss, "compile": compiled}))


if __name__ == "__main__":
    main()
