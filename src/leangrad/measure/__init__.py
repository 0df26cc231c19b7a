"""leangrad.measure: memory, time and gradient-quality measurements (DESIGN.md, "Measuring").

- :class:`MemoryTracker` — allocator-level peak/live bytes over forward *and* backward;
- :func:`estimate_memory` — the same on fake tensors, for configurations too big to allocate;
- :func:`run_rss_worker` — the fresh-process peak-RSS cross-check;
- :func:`time_interleaved` — medians of interleaved repeats, ratios within one run;
  :func:`time_across_threads` — the same at several thread counts, side by side;
- :func:`compare_grads`, :func:`estimator_stats` — errors, cosine, bias and variance;
- :func:`profile_step` — all of it for one engine step (peak, kept bytes, time, error);
  :func:`estimate_step` — its memory figures on a fake copy, for a step too big to run.
"""

from ._estimate import estimate_memory, estimate_step
from ._grads import EstimatorStats, GradComparison, compare_grads, estimator_stats, grads_of
from ._memory import (
    FORWARD_END,
    MemoryBudgetExceeded,
    MemoryReport,
    MemoryTracker,
    baseline_bytes,
    mark,
)
from ._profile import StepProfile, profile_step
from ._rss import RssReport, malloc_trim, proc_status_bytes, reset_peak_rss, run_rss_worker
from ._saved import saved_tensor_bytes
from ._timer import Timing, num_threads, time_across_threads, time_interleaved

__all__ = [
    "FORWARD_END",
    "EstimatorStats",
    "GradComparison",
    "MemoryBudgetExceeded",
    "MemoryReport",
    "MemoryTracker",
    "RssReport",
    "StepProfile",
    "Timing",
    "baseline_bytes",
    "compare_grads",
    "estimate_memory",
    "estimate_step",
    "estimator_stats",
    "grads_of",
    "malloc_trim",
    "mark",
    "num_threads",
    "proc_status_bytes",
    "profile_step",
    "reset_peak_rss",
    "run_rss_worker",
    "saved_tensor_bytes",
    "time_across_threads",
    "time_interleaved",
]
