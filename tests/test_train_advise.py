"""``advise``: measured table of engines, recommendation of the fastest whose peak fits."""

from __future__ import annotations

import signal

import pytest

from leangrad.train import DataInfo
from leangrad.train._advise import BAD_BYTES, TOO_SLOW, _size, advise, parse_bytes

SUB = {"data": DataInfo("digits-shaped", (1, 8, 8), 10, tokens=False), "repeats": 1,
       "progress": False}  # fmt: skip


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match=BAD_BYTES.format(value="two gigs").replace("(", r"\(")
                       .replace(")", r"\)")):  # fmt: skip
        parse_bytes("two gigs")


def test_recommends_the_fastest_exact_engine_that_fits() -> None:
    adv = advise("submersive_cnn", 16, "2GiB", engines=["backprop", "moonwalk", "projforward",
                                                         "revbackprop"], **SUB)  # fmt: skip
    rows = {r.engine: r for r in adv.rows}
    assert rows["revbackprop"].reason is not None and "not invertible" in rows["revbackprop"].reason
    ran = [r for r in adv.rows if r.reason is None]
    assert {r.engine for r in ran} == {"backprop", "moonwalk", "projforward"}
    assert all(r.peak_bytes and r.seconds and r.fits and not r.estimate for r in ran)
    exact = [r for r in ran if r.exact]
    assert adv.recommended == min(exact, key=lambda r: r.seconds).engine  # the table's fastest
    assert adv.recommended != "projforward"  # an estimator is shown but not recommended
    assert f"| {adv.recommended} ← recommended |" in adv.table()


def test_budget_decides_by_measured_peak() -> None:
    """Moonwalk keeps minimal residuals, so its measured peak is below backprop's; a budget
    between the two leaves Moonwalk as the only choice, however fast backprop is."""
    base = advise("submersive_cnn", 64, "2GiB", engines=["backprop", "moonwalk"], **SUB)
    peaks = {r.engine: r.peak_bytes for r in base.rows}
    assert peaks["moonwalk"] < peaks["backprop"]
    budget = (peaks["moonwalk"] + peaks["backprop"]) // 2
    adv = advise("submersive_cnn", 64, budget, engines=["backprop", "moonwalk"], **SUB)
    assert adv.recommended == "moonwalk"
    assert {r.engine: r.fits for r in adv.rows} == {"backprop": False, "moonwalk": True}


def test_no_engine_fits_names_the_smallest_peak() -> None:
    adv = advise("mlp", 8, 1024, engines=["backprop", "checkpoint"], **SUB)
    smallest = min(adv.rows, key=lambda r: r.peak_bytes)
    assert adv.recommended is None
    assert adv.message.startswith(
        f"no engine fits the budget of 1.00 KiB: the smallest peak found is "
        f"{_size(smallest.peak_bytes)} ({smallest.engine})"
    )


def test_fake_tensor_estimate_where_allocation_would_not_fit() -> None:
    """With nothing allowed to be allocated, peaks come from FakeTensorMode estimates
    (labelled, untimed) and agree with the real measurement within 10%."""
    real = advise("mlp", 32, "2GiB", engines=["backprop"], **SUB)
    est = advise("mlp", 32, "2GiB", engines=["backprop"], allocate_limit=0, **SUB)
    (r,), (e,) = real.rows, est.rows
    assert e.estimate and e.seconds is None and not r.estimate
    assert abs(e.peak_bytes - r.peak_bytes) <= 0.1 * r.peak_bytes
    assert "(estimate)" in est.table() and "not timed" in est.message


def test_an_engine_slower_than_the_limit_is_stopped_and_listed() -> None:
    """Full forward mode pushes one tangent per parameter (about 9000 here): far slower
    than 0.05 s per step, so it is stopped by the alarm and never recommended."""
    adv = advise("mlp", 8, "2GiB", engines=["forward"], max_step_seconds=0.05, **SUB)
    (row,) = adv.rows
    assert row.reason == TOO_SLOW.format(seconds=0.05)
    assert row.reason.startswith("slower than 0.05 s per step: stopped")
    assert adv.recommended is None
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL  # handler restored
