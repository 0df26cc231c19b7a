"""Fresh-process peak-RSS worker: ``python -m leangrad.bench._rss_worker`` (JSON on stdin).

Builds the workload and engine named in the payload, runs one warm-up step,
frees what it left, trims the heap, resets the high-water mark, runs one step
and prints ``{"rss_before": ..., "rss_peak": ...}``. Nothing is timed here.
"""

from __future__ import annotations

import json
import sys

import torch

from ..engines import engine
from ..measure._rss import measure_rss
from ._workloads import build


def main() -> None:
    payload = json.loads(sys.stdin.read())
    torch.set_num_threads(1)
    wl = build(payload["config"])
    eng = engine(payload["engine"], **payload.get("options", {}))
    eng.backward(wl.model, wl.inputs, wl.loss_fn)
    wl.model.zero_grad(set_to_none=True)
    rss = measure_rss(lambda: eng.backward(wl.model, wl.inputs, wl.loss_fn))
    print(json.dumps({"rss_before": rss.rss_before, "rss_peak": rss.rss_peak}))


if __name__ == "__main__":
    main()
