"""Tests of leangrad.measure: the memory tracker (and what engines keep, through it), the
fake-tensor estimate, the interleaved timer, gradient comparison and the RSS helpers.

The CPU tracker counts tensor storages, so every byte count here is exact and
deterministic; no tolerance is needed except for RSS, which the OS rounds to pages.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import models
from leangrad.measure import (
    FORWARD_END,
    MemoryTracker,
    Timing,
    baseline_bytes,
    compare_grads,
    estimate_memory,
    malloc_trim,
    mark,
    proc_status_bytes,
    reset_peak_rss,
    saved_tensor_bytes,
    time_across_threads,
    time_interleaved,
)
from leangrad.measure._memory import _RESIZE


def _mlp_step(depth: int = 3, batch: int = 16, width: int = 32, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = models.mlp(width, width, depth, 10)
    x = torch.randn(batch, width)
    y = torch.randint(0, 10, (batch,))
    return model, x, y


def _track(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw):  # type: ignore[no-untyped-def]
    """One engine step inside a tracker whose baseline holds the model, inputs and targets."""
    options = {k: v for k, v in kw.items() if k != "on_grad"}
    eng = leangrad.engine(name, **options)
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        eng.backward(model, x, lambda out: F.cross_entropy(out, y), on_grad=kw.get("on_grad"))
    return tracker.report


# --- 1. MemoryTracker on CPU ------------------------------------------------------------


def test_tracker_repeatable() -> None:
    """Two identical steps give identical reports (peak, end, marks, baseline)."""
    model, x, y = _mlp_step()
    first = _track("backprop", model, x, y)
    model.zero_grad(set_to_none=True)
    second = _track("backprop", model, x, y)
    assert first == second
    assert first.peak_bytes > 0 and first.forward_live_bytes is not None


def test_backprop_forward_end_is_saved_tensors_plus_loss() -> None:
    """At the end of the forward pass the only live storages above the baseline are what
    autograd saved (``saved_tensor_bytes``, parameters/inputs/targets excluded) and the
    loss itself: the model output is not referenced once the loss is computed."""
    model, x, y = _mlp_step(depth=4)
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        with saved_tensor_bytes(*model.parameters(), x, y) as saved:
            loss = F.cross_entropy(model(x), y)
        mark(FORWARD_END)
        loss.backward()
    report = tracker.report
    assert saved.bytes > 0
    assert report.forward_live_bytes == saved.bytes + loss.untyped_storage().nbytes()
    assert report.peak_bytes >= report.forward_live_bytes


def test_views_count_once() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(100, 10)
        views = [a[3:], a.t(), a.view(-1), a.t()[:, 2], a.reshape(10, 100), a.detach(), a[::2]]
        assert tracker.current_bytes() == a.nbytes
    assert tracker.report.peak_bytes == a.nbytes
    assert tracker.report.end_bytes == a.nbytes
    del views


def test_inplace_ops_count_nothing_new() -> None:
    with MemoryTracker() as tracker:
        a = torch.zeros(1000, dtype=torch.float64)
        a.add_(1).mul_(3).clamp_(max=2)
        a[10:20].fill_(5)
        torch.add(a, 1, out=a)
    assert tracker.report.peak_bytes == a.nbytes


def test_frees_are_seen() -> None:
    """allocate, free, allocate: the peak is one allocation, and nothing is live at the end."""
    with MemoryTracker() as tracker:
        a = torch.ones(4096)
        nbytes = a.nbytes
        del a
        assert tracker.current_bytes() == 0
        b = torch.ones(4096)
        del b
    assert tracker.report.peak_bytes == nbytes
    assert tracker.report.end_bytes == 0


def test_view_keeps_storage_alive() -> None:
    """Deleting the base tensor frees nothing while a view still holds the storage."""
    with MemoryTracker() as tracker:
        a = torch.ones(1000)
        nbytes = a.nbytes
        v = a[1:]
        del a
        assert tracker.current_bytes() == nbytes
        del v
        assert tracker.current_bytes() == 0
    assert tracker.report.peak_bytes == nbytes


def test_resized_storage_counts_its_growth() -> None:
    """An ``out=`` op that grows a storage allocated inside the region counts the growth."""
    with MemoryTracker() as tracker:
        a = torch.empty(10)
        torch.randn(1000, out=a)
    assert tracker.report.peak_bytes == tracker.report.end_bytes == 1000 * 4


@pytest.mark.parametrize("how", ["untyped_storage", "storage"])
def test_a_storage_resized_from_python_is_seen(how: str) -> None:
    """memcnn frees a block's activations with ``x.storage().resize_(0)``: outside the
    dispatcher, so the tracker is told by the storage itself. Freed: the next allocation
    reuses the room (peak one block, not two); grown: the growth counts."""
    block = 4096 * 4
    with MemoryTracker() as tracker, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        a = torch.ones(4096)
        getattr(a, how)().resize_(0)
        assert tracker.current_bytes() == 0
        b = torch.ones(4096)
        getattr(b, how)().resize_(3 * block if how == "untyped_storage" else 3 * 4096)
        assert tracker.current_bytes() == 3 * block
    assert tracker.report.peak_bytes == 3 * block
    assert torch.UntypedStorage.resize_ is _RESIZE  # put back once no tracker is active
    assert "resize_" not in vars(torch.UntypedStorage)  # the class as torch left it


def test_baseline_reported_separately() -> None:
    """Parameters, existing gradients and inputs are the baseline: counted once (shared
    storages once) and never as allocations, even when viewed or read inside."""
    model, x, y = _mlp_step()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    expected = sum(2 * p.nbytes for p in model.parameters()) + x.nbytes + y.nbytes
    assert baseline_bytes(model, x, y, x[1:], x.t()) == expected
    with MemoryTracker(baseline=(model, x, y)) as tracker:
        w = model.get_parameter("0.1.weight")
        views = [w.t(), w.detach(), w[0], x.view(-1), x[:3], y[1:]]
        w.grad.add_(1)
        out = x.sum()
    report = tracker.report
    assert report.baseline_bytes == expected
    assert report.peak_bytes == out.nbytes  # the one new tensor
    del views


def test_growth_of_baseline_storage_is_counted() -> None:
    """The class docstring: an external storage is not counted, "its later growth is"."""
    old = torch.empty(10)
    with MemoryTracker(baseline=old) as tracker:
        torch.randn(1000, out=old)
    assert tracker.report.peak_bytes == 1000 * 4 - 10 * 4


def test_torch_tensor_from_data_is_counted() -> None:
    """``torch.tensor(data)`` allocates outside dispatch and reaches the tracker only as
    ``aten.lift_fresh(t) -> t``; it is still a new allocation of the region."""
    with MemoryTracker() as tracker:
        a = torch.tensor([1.0] * 1000)
    assert tracker.report.peak_bytes == a.nbytes


def test_tensors_made_before_tracking_are_not_counted() -> None:
    """Without being listed as baseline, older tensors viewed or changed in place inside
    are not allocations of the region."""
    old = torch.ones(1000)
    with MemoryTracker() as tracker:
        views = [old[10:], old.view(10, 100).t(), old.detach()]
        old.mul_(2)
    assert tracker.report.peak_bytes == 0
    assert tracker.report.baseline_bytes == 0
    del views


def test_report_before_exit_raises() -> None:
    with MemoryTracker() as tracker, pytest.raises(RuntimeError, match="after the `with` block"):
        _ = tracker.report


def test_marks() -> None:
    """``mark`` outside a tracker does nothing; inside, the first call of a name wins."""
    mark(FORWARD_END)  # no tracker: no error, nothing recorded anywhere
    with MemoryTracker() as tracker:
        mark("start")
        a = torch.empty(256)
        mark(FORWARD_END)
        b = torch.empty(256)
        mark(FORWARD_END)
    assert tracker.report.marks == {"start": 0, FORWARD_END: a.nbytes}
    assert tracker.report.forward_live_bytes == a.nbytes
    assert tracker.report.end_bytes == a.nbytes + b.nbytes


# --- 2. what engines keep, through the tracker --------------------------------------------

DEEP = {"depth": 16, "batch": 256, "width": 64}


def test_backprop_forward_bytes_linear_in_depth() -> None:
    """Backprop keeps one activation per hidden block (the ReLU output, which is also the
    next Linear's saved input): each extra block adds batch·width·4 bytes."""
    live = {}
    for depth in (4, 8, 16):
        model, x, y = _mlp_step(depth=depth, batch=DEEP["batch"], width=DEEP["width"])
        live[depth] = _track("backprop", model, x, y).forward_live_bytes
    per_block = DEEP["batch"] * DEEP["width"] * 4
    assert live[8] - live[4] == 4 * per_block
    assert live[16] - live[8] == 8 * per_block


def test_checkpoint_sqrt_keeps_less_than_backprop() -> None:
    """⌈√17⌉ = 5 segments of 17 blocks: at the forward end checkpoint keeps 4 segment
    inputs plus the last segment's activations instead of 16 activations."""
    model, x, y = _mlp_step(**DEEP)
    back = _track("backprop", model, x, y)
    model.zero_grad(set_to_none=True)
    ckpt = _track("checkpoint", model, x, y, segments="sqrt")
    assert back.forward_live_bytes is not None and ckpt.forward_live_bytes is not None
    per_block = DEEP["batch"] * DEEP["width"] * 4
    assert back.forward_live_bytes >= 16 * per_block
    assert ckpt.forward_live_bytes < back.forward_live_bytes / 2
    assert ckpt.peak_bytes < back.peak_bytes


@pytest.mark.parametrize(("name", "options"), [("forward", {}), ("projforward", {"samples": 4})])
def test_forward_mode_engines_keep_nothing_for_backward(name: str, options: dict) -> None:
    """Nothing is live above the baseline when the forward-mode engines mark the end of
    their forward phase. (A narrow MLP: forward costs one jvp per parameter.)"""
    model, x, y = _mlp_step(depth=8, batch=8, width=6)
    assert _track(name, model, x, y, **options).forward_live_bytes == 0


def test_forward_engine_working_memory_independent_of_depth() -> None:
    """Forward's peak above the gradients it returns (end_bytes) does not grow with depth:
    besides the gradients it only ever holds one parameter's tangents and one layer's
    activations (all hidden layers have the same shape here)."""
    working = []
    for depth in (2, 6):
        model, x, y = _mlp_step(depth=depth, batch=8, width=6)
        report = _track("forward", model, x, y)
        assert report.end_bytes == sum(p.grad.nbytes for p in model.parameters())
        working.append(report.peak_bytes - report.end_bytes)
    assert working[0] == working[1] > 0


# --- 3. estimate on fake tensors ------------------------------------------------------------


def test_estimate_matches_tracker() -> None:
    """FakeTensorMode allocates nothing but produces the same storages, so the estimate
    equals the real tracker byte for byte (baseline, peak, end, marks)."""

    def build() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        return models.mlp(10, 32, 3, 5), torch.randn(16, 10)

    eng = leangrad.engine("backprop")

    def step(model: nn.Module, x: torch.Tensor) -> object:
        y = torch.zeros(16, dtype=torch.long)
        return eng.backward(model, x, lambda out: F.cross_entropy(out, y))

    est = estimate_memory(build, step)
    model, x = build()
    with MemoryTracker(baseline=(model, x)) as tracker:
        step(model, x)
    real = tracker.report
    assert est.estimate is True and real.estimate is False
    assert est.peak_bytes == real.peak_bytes > 0
    assert dataclasses.replace(est, estimate=False) == real


# --- 4. timer --------------------------------------------------------------------------------


def test_time_interleaved() -> None:
    """Sleeps of 2 ms and 8 ms (sleep never undershoots, so the slow one's minimum is
    ≥ 8 ms; the fast median would need two 6 ms overshoots out of three to reorder)."""
    calls: list[str] = []
    threads_seen: list[int] = []

    def fn(name: str, seconds: float):  # type: ignore[no-untyped-def]
        def run() -> None:
            calls.append(name)
            threads_seen.append(torch.get_num_threads())
            time.sleep(seconds)

        return run

    before = torch.get_num_threads()
    ticks: list[int] = []
    res = time_interleaved(
        {"fast": fn("fast", 0.002), "slow": fn("slow", 0.008)},
        repeats=3,
        warmup=1,
        reference="fast",
        threads=2,
        progress=lambda: ticks.append(1),
    )
    assert torch.get_num_threads() == before
    assert set(threads_seen) == {2}
    assert set(res) == {"fast", "slow"}
    assert all(isinstance(t, Timing) for t in res.values())
    assert calls.count("fast") == calls.count("slow") == 1 + 3
    assert len(ticks) == 2 * 3
    assert calls[2:4] != calls[4:6]  # the order rotates between timed rounds
    fast, slow = res["fast"], res["slow"]
    assert fast.ratio == 1.0
    assert slow.ratio == pytest.approx(slow.median / fast.median)
    assert fast.median < slow.median
    assert slow.minimum >= 0.008
    for t in res.values():
        assert t.repeats == 3
        assert t.minimum <= t.median <= t.maximum

    no_ref = time_interleaved({"a": lambda: None}, repeats=2, warmup=0, threads=None)
    assert no_ref["a"].ratio is None and no_ref["a"].repeats == 2


def test_time_across_threads_interleaves_thread_counts_and_divides_within_each() -> None:
    """Every (thread count, function) cell runs in every round, at its own thread count,
    both rotated; a ratio divides by the reference *at the same count*: here the fast
    function sleeps longer at 2 threads, so its 2-thread ratio to itself stays 1 while the
    slow one's falls."""
    seen: list[tuple[int, str]] = []

    def fn(name: str):  # type: ignore[no-untyped-def]
        def run() -> None:
            n = torch.get_num_threads()
            seen.append((n, name))
            time.sleep({"fast": 0.001 * n * n, "slow": 0.008}[name])

        return run

    before = torch.get_num_threads()
    ticks: list[int] = []
    res = time_across_threads({"fast": fn("fast"), "slow": fn("slow")}, threads=[1, 2],
                              repeats=3, warmup=1, reference="fast",
                              progress=lambda: ticks.append(1))  # fmt: skip
    assert torch.get_num_threads() == before
    assert list(res) == [1, 2]
    assert len(ticks) == 2 * 2 * 3
    assert seen[:4] == [(1, "fast"), (1, "slow"), (2, "fast"), (2, "slow")]  # warm-up
    rounds = [seen[4 + 4 * r : 8 + 4 * r] for r in range(3)]
    assert rounds[0][0][0] == 1 and rounds[1][0][0] == 2  # thread counts rotate per round
    assert all(sorted(r) == sorted(seen[:4]) for r in rounds)  # every cell in every round
    for ts in res.values():
        assert ts["fast"].ratio == 1.0 and ts["fast"].repeats == 3
        assert ts["slow"].ratio == pytest.approx(ts["slow"].median / ts["fast"].median)
    assert res[1]["fast"].median < res[2]["fast"].median
    assert res[2]["slow"].ratio < res[1]["slow"].ratio
    one = time_interleaved({"a": lambda: None}, repeats=2, warmup=0, threads=2)
    assert set(one) == {"a"} and one["a"].repeats == 2
    with pytest.raises(ValueError, match="at least one thread count"):
        time_across_threads({"a": lambda: None}, threads=[])
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        time_across_threads({"a": lambda: None}, threads=[1, 0])
    with pytest.raises(ValueError, match=r"lists a count twice: \[2, 2\]"):
        time_across_threads({"a": lambda: None}, threads=[2, 2])
    with pytest.raises(KeyError, match="missing"):
        time_across_threads({"a": lambda: None}, threads=[1], reference="missing")


def test_time_interleaved_bad_arguments() -> None:
    with pytest.raises(KeyError, match="missing"):
        time_interleaved({"a": lambda: None}, reference="missing")
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved({"a": lambda: None}, repeats=0)


# --- 5. compare_grads -------------------------------------------------------------------------


def _grads() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.float64)}


def test_compare_identical() -> None:
    g = _grads()
    cmp = compare_grads(g, {n: t.clone() for n, t in g.items()})
    assert cmp.max_rel_err == 0.0
    assert cmp.cosine == pytest.approx(1.0, abs=1e-15)
    assert set(cmp.per_param) == {"w", "b"}


def test_compare_scaled() -> None:
    """2g vs g: same direction (cosine 1), max-norm relative error |2g − g|/|g| = 1."""
    g = _grads()
    cmp = compare_grads({n: 2 * t for n, t in g.items()}, g)
    assert cmp.cosine == pytest.approx(1.0, abs=1e-15)
    assert cmp.max_rel_err == pytest.approx(1.0, abs=1e-15)
    for rel, cos in cmp.per_param.values():
        assert rel == pytest.approx(1.0, abs=1e-15) and cos == pytest.approx(1.0, abs=1e-15)


def test_compare_worst_param() -> None:
    g = _grads()
    off = {"w": g["w"].clone(), "b": g["b"] + 0.5 * g["b"].abs().max()}
    assert compare_grads(off, g).worst_param == "b"


def test_compare_name_mismatch() -> None:
    g = _grads()
    with pytest.raises(KeyError, match=r"missing \['b'\], unexpected \['c'\]"):
        compare_grads({"w": g["w"], "c": g["b"]}, g)
    with pytest.raises(ValueError, match=r"'w' has shape \(6,\) but its reference has shape"):
        compare_grads({"w": torch.zeros(6), "b": g["b"]}, g)


def test_compare_zero_reference() -> None:
    """An all-zero reference gives an absolute error; zero vs zero is a perfect match."""
    zero = {"w": torch.zeros(5)}
    cmp = compare_grads({"w": torch.zeros(5)}, zero)
    assert cmp.max_rel_err == 0.0 and cmp.cosine == 1.0
    cmp = compare_grads({"w": torch.full((5,), -0.25)}, zero)
    assert cmp.max_rel_err == 0.25 and cmp.cosine == 0.0


# --- 6. RSS helpers -------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_proc_status_bytes() -> None:
    rss = proc_status_bytes("VmRSS")
    assert rss > 0 and rss % 1024 == 0
    assert proc_status_bytes("VmHWM") >= rss
    with pytest.raises(KeyError):
        proc_status_bytes("NoSuchField")


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs"
)
def test_reset_peak_rss() -> None:
    """After a 128 MiB temporary (mmapped: above glibc's mmap threshold, so returned to the
    OS on free), VmHWM stays high until reset; after reset it is about VmRSS. Slack of
    32 MiB covers other threads and allocator activity between the two reads."""
    size = 128 * 2**20
    big = torch.ones(size // 4)  # ones touches every page
    del big
    malloc_trim()
    assert proc_status_bytes("VmHWM") >= proc_status_bytes("VmRSS") + size // 2
    reset_peak_rss()
    assert proc_status_bytes("VmHWM") - proc_status_bytes("VmRSS") < 32 * 2**20


def test_tracking_a_compiled_function_never_breaks_it_for_the_rest_of_the_process() -> None:
    """A dispatch mode that torch.compile does not know makes it mark the frame skipped for
    good: a ``fullgraph=True`` function then raised inside the tracker and for the rest of
    the process, any other ran eagerly from then on. Inside the tracker compiled functions
    now run eagerly (measured as such); after it, they compile as before."""
    compiled: list[int] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        compiled.append(1)
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu().sum()

    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    with MemoryTracker() as tracker:
        loss(x, w).backward()
    assert tracker.report.peak_bytes > 0 and not compiled
    loss(x, w).backward()  # raised "found no compiled frames" before
    assert compiled
    with MemoryTracker(), MemoryTracker():  # nested: the outer's exit restores the stance
        loss(x, w)
    n = len(compiled)
    loss(x * 2, w)
    assert len(compiled) >= n  # compiles (or reuses) outside, never raises
