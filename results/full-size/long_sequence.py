"""The longest sequence the GPT at GPT-2's vocabulary (50,257) trains at batch 1 within
backprop's memory at the zoo's sequence length ("Targets").

``python results/full-size/long_sequence.py [--check]``: the zoo's full-size ``gpt_50k``
(d 256, 8 layers, 4 heads) at batch 1. The budget is backprop's total at the zoo's length
(256 tokens): parameters, inputs and the step's peak with ``.grad`` allocated by the step.
For each method, the longest length whose total fits is found by bisection on fake-tensor
estimates (:func:`leangrad_bench._zoo_batch.footprint`); ``--check`` re-measures each
method's answer with the tracker on real tensors (the estimate must fit there too).
Micro-batching cannot split one example, so PyTorch's exact options at batch 1 are
per-block checkpointing and ``checkpoint_sequential``. Writes ``/tmp/long-sequence.json``.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path
from typing import Any

from leangrad_bench._zoo_batch import footprint
from leangrad_bench._zoo_methods import Method

SUITE = Path(__file__).resolve().parents[2] / "benchmarks/leangrad_bench/suites/zoo.toml"
LIMIT = 1 << 17  # tokens: the search's ceiling (positional table sized to it)

METHODS = [
    Method("backprop", "reference", True, {"engine": "backprop", "options": {}}),
    Method("torch per-block", "pytorch", True, {"torch": "per-block"}),
    Method("checkpoint_sequential(4)", "pytorch", True, {"torch": "sequential", "arg": 4}),
    Method("checkpoint", "leangrad", True, {"engine": "checkpoint", "options": {}}),
    Method("chunked_ce", "leangrad", True, {"engine": "chunked_ce", "options": {}}),
    Method("checkpoint+chunked_ce", "leangrad", True,
           {"engine": "checkpoint+chunked_ce", "options": {}}),
    *[Method(f"checkpoint+chunked_ce(sequence_fragments={k})", "leangrad", True,
             {"engine": "checkpoint+chunked_ce", "options": {"sequence_fragments": k}})
      for k in (4, 16)],
    *[Method(f"checkpoint+chunked_ce(levels=2,sequence_fragments={k})", "leangrad", True,
             {"engine": "checkpoint+chunked_ce",
              "options": {"levels": 2, "sequence_fragments": k}})
      for k in (4, 16)],
]  # fmt: skip


def total(size: dict[str, Any], m: Method, length: int, *, estimate: bool) -> int:
    return footprint("gpt_50k", {**size, "context": length}, m, 1, estimate=estimate).total


def longest(size: dict[str, Any], m: Method, budget: int) -> tuple[int, int]:
    """The longest length (a multiple of 64) whose estimated total fits ``budget``, and the
    estimates made."""
    lo, hi, probes = 0, LIMIT // 64, 0
    while lo < hi:  # largest n with total(64 n) <= budget
        mid = (lo + hi + 1) // 2
        probes += 1
        if total(size, m, 64 * mid, estimate=True) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return 64 * lo, probes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    size = dict(tomllib.loads(SUITE.read_text())["settings"]["models"]["gpt_50k"])
    base = int(size["context"])
    size.update(batch=1, context=base)
    bp = METHODS[0]
    budget_real = total(size, bp, base, estimate=False)
    budget_est = total(size, bp, base, estimate=True)
    print(f"backprop at batch 1, {base} tokens: {budget_real / 2**20:.1f} MiB (tracker), "
          f"{budget_est / 2**20:.1f} MiB (estimate)", flush=True)  # fmt: skip
    rows = {}
    for m in METHODS:
        start = time.time()
        n, probes = longest(size, m, budget_real)
        row: dict[str, Any] = {"side": m.side, "longest": n, "times_base": n / base,
                               "probes": probes}  # fmt: skip
        if args.check and n:
            row["tracker_total_at_longest"] = total(size, m, n, estimate=False)
            row["fits_by_tracker"] = row["tracker_total_at_longest"] <= budget_real
        rows[m.label] = row
        print(f"{m.label:55s} {n:7d} tokens ({n / base:5.1f}x) {row.get('fits_by_tracker', '')} "
              f"[{time.time() - start:.0f}s]", flush=True)  # fmt: skip
    Path("/tmp/long-sequence.json").write_text(json.dumps(
        {"model": "gpt_50k", "size": size, "base_length": base, "budget_bytes": budget_real,
         "budget_estimate_bytes": budget_est, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
