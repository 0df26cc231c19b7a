"""The bench's one fresh-process worker (:mod:`leangrad_bench._worker`): each mode's payload
runs in a fresh process and returns its fields; an unknown mode is refused by name."""

from __future__ import annotations

import pytest

from leangrad.measure._rss import rss_supported, run_json_worker
from leangrad_bench._worker import MODES

WORKER = "leangrad_bench._worker"

pytestmark = pytest.mark.skipif(not rss_supported(), reason="no /proc RSS here")


def test_the_modes_the_callers_name() -> None:
    assert set(MODES) == {"rss", "zoo", "plan-compile", "plan-engine"}


def test_rss_mode_measures_one_step_of_a_workload() -> None:
    out = run_json_worker(WORKER, {"mode": "rss", "engine": "checkpoint", "options": {},
                                   "config": {"model": "mlp", "depth": 3, "width": 64,
                                              "batch": 32}})  # fmt: skip
    assert out["rss_peak"] >= out["rss_before"] > 0


def test_zoo_mode_measures_each_methods_rss() -> None:
    size = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "context": 16, "batch": 4}
    method = {"label": "backprop", "side": "leangrad", "exact": True,
              "spec": {"engine": "backprop", "options": {}}}  # fmt: skip
    out = run_json_worker(WORKER, {"mode": "zoo", "model": "gpt", "size": size,
                                   "methods": [method]})  # fmt: skip
    assert out["compile"] == {} and out["rss"]["backprop"] > 0


@pytest.mark.slow
def test_plan_engine_mode_measures_the_step_and_eager_backprop() -> None:
    size = {"width": 64, "layers": 3, "batch": 32, "features": 16}
    out = run_json_worker(WORKER, {"mode": "plan-engine", "kind": "mlp", "size": size,
                                   "engine": "backprop", "options": {}})  # fmt: skip
    assert out["rss"] > 0 and out["rss_backprop"] > 0


def test_an_unknown_mode_is_refused_naming_the_modes() -> None:
    with pytest.raises(RuntimeError, match=r"unknown worker mode 'nope'.*plan-engine"):
        run_json_worker(WORKER, {"mode": "nope"})
