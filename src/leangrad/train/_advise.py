"""``advise``: measure every engine that can run a model and recommend the fastest
one whose peak memory fits a budget (DESIGN.md, "Measuring").

Each engine is first estimated on fake tensors (:func:`leangrad.measure.estimate_memory`:
shapes only, nothing allocated). Engines whose estimate fits in the memory this
machine has free are then run for real: one warm-up step, one step under the
allocator-level :class:`~leangrad.measure.MemoryTracker`, and interleaved timed
repeats (:func:`~leangrad.measure.time_interleaved`, medians). Engines too big to
allocate keep their estimate, labelled as such, and no time. The peak compared
with the budget is parameters + inputs (the tracker's baseline) + the step's own
peak (activations, saved tensors, gradients, scratch); optimizer state is not
included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..engines import available
from ..engines import engine as make_engine
from ..measure import MemoryTracker, estimate_memory, time_interleaved
from ._registry import DataInfo, build_model, data_info, example_batch, load_data

__all__ = ["Advice", "EngineRow", "advise", "parse_bytes"]

BAD_BYTES = "budget {value!r} is not a size; write e.g. 512MiB, 2GiB, 1.5GB or 1e9"
NOTHING_FITS = (
    "no engine fits the budget of {budget}: the smallest peak found is {peak} ({engine}). "
    "Lower --batch-size, use a smaller model, or raise the budget"
)
TOO_SLOW = "slower than {seconds:g} s per step: stopped (raise max_step_seconds to measure)"
BAD_ADVISE = "advise: {name} must be {want}, got {value!r}"
NOTHING_RAN = "no engine could run model {model!r}: see the reasons in the table"
RECOMMEND = "recommended: {engine} — fastest of the {n} engine(s) whose peak fits {budget}"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_bytes(value: str | int | float) -> int:
    """``"2GiB"`` -> 2147483648; ``"1.5GB"``, ``"512MiB"``, ``"1e9"`` and numbers work too."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float):
        number, unit = value, ""
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(BAD_BYTES.format(value=value))
        try:
            number, unit = float(m.group(1)), m.group(2).lower()
        except ValueError:
            raise ValueError(BAD_BYTES.format(value=value)) from None
    if not math.isfinite(number * _UNITS[unit]):  # "1e400": no int can hold it
        raise ValueError(BAD_BYTES.format(value=value))
    return int(number * _UNITS[unit])


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class EngineRow:
    """One engine's measurement.

    Attributes:
        engine: the engine's label; exact: whether its gradient is exact.
        peak_bytes: parameters + inputs + the step's peak (None if it did not run).
        estimate: ``peak_bytes`` comes from fake tensors, not an allocation.
        seconds: median step time (None when not run for real).
        fits: ``peak_bytes <= budget``.
        reason: why the engine did not run (unsupported model, error), else None.
    """

    engine: str
    exact: bool
    peak_bytes: int | None
    estimate: bool
    seconds: float | None
    fits: bool
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Advice:
    """The table :func:`advise` decided from, and its decision.

    Attributes:
        model, batch_size, budget_bytes: what was asked.
        rows: one :class:`EngineRow` per engine tried.
        recommended: the label of the recommended engine, or None when nothing fits.
        message: the recommendation, or why there is none.
    """

    model: str
    batch_size: int
    budget_bytes: int
    rows: list[EngineRow]
    recommended: str | None
    message: str

    def table(self) -> str:
        """A Markdown table: engine, exact, peak, time, fits."""
        lines = ["| engine | exact | peak | time/step | fits |", "|---|---|---|---|---|"]
        for r in sorted(self.rows, key=_order):
            peak = _size(r.peak_bytes) + (" (estimate)" if r.estimate else "")
            secs = "-" if r.seconds is None else f"{1e3 * r.seconds:.1f} ms"
            fits = ("yes" if r.fits else "no") if r.reason is None else f"n/a: {r.reason}"
            star = " ← recommended" if r.engine == self.recommended else ""
            lines.append(f"| {r.engine}{star} | {r.exact} | {peak} | {secs} | {fits} |")
        return "\n".join(lines)


def _order(r: EngineRow) -> tuple[int, float, int]:
    return (r.reason is not None, r.seconds if r.seconds is not None else float("inf"),
            r.peak_bytes or 0)  # fmt: skip


def _free_bytes(device: torch.device) -> int:
    """Memory an allocation may use here: free CUDA memory, or half of MemAvailable."""
    if device.type == "cuda":
        return int(0.9 * torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 2**31


def advise(
    model: str | Callable[[DataInfo], nn.Module],
    batch_size: int,
    budget: int | str,
    *,
    data: str | DataInfo = "digits",
    model_options: dict[str, Any] | None = None,
    engines: Sequence[str] | None = None,
    repeats: int = 3,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    exact_only: bool = True,
    allocate_limit: int | None = None,
    slow_seconds: float = 2.0,
    max_step_seconds: float = 20.0,
    progress: bool = True,
) -> Advice:
    """Measure candidate engines on ``model`` and recommend the fastest that fits ``budget``.

    Args:
        model: a model name / ``module:factory`` spec, or a callable ``DataInfo -> module``.
        batch_size: examples per step.
        budget: bytes, or a size string such as ``"2GiB"``.
        data: the data set whose example shape and classes the model is built for (a
            name, or a :class:`DataInfo` to skip loading it).
        engines: engine names to try (default: every registered engine).
        repeats: timed repeats per engine (interleaved; the median is reported).
        exact_only: recommend only exact engines (estimating ones still appear).
        allocate_limit: run for real only when the estimate is below this many bytes
            (default: the free memory of the device).
        slow_seconds: an engine whose warm-up step takes longer is not repeated; its
            time is that one (post-warm-up-free) step, an upper bound.
        max_step_seconds: an engine whose estimate or step takes longer is stopped
            (SIGALRM; main thread on POSIX only) and listed as too slow, not recommended.

    Timing uses one thread (``time_interleaved``'s default), like every leangrad
    benchmark, so the ranking is stable on a busy machine.

    Returns:
        An :class:`Advice`; its ``table()`` shows what the decision was made from.
    """
    budget_bytes = parse_bytes(budget)
    for key, value, least in (("batch_size", batch_size, 1), ("repeats", repeats, 1),
                              ("budget", budget_bytes, 1)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(BAD_ADVISE.format(name=key, want=f"an int >= {least}", value=value))
    for key, value in (("max_step_seconds", max_step_seconds), ("slow_seconds", slow_seconds)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(BAD_ADVISE.format(name=key, want="a finite number > 0", value=value))
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    tdtype = getattr(torch, dtype)
    name = model if isinstance(model, str) else getattr(model, "__name__", "model")
    info = data_info(data, load_data(data)) if isinstance(data, str) else data
    limit = allocate_limit if allocate_limit is not None else _free_bytes(dev)

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = (build_model(model, info, **(model_options or {})) if isinstance(model, str)
             else model(info))  # fmt: skip
        return m.to(device=dev, dtype=tdtype)

    names = list(engines) if engines is not None else available()
    rows: list[EngineRow] = []
    steps: dict[str, Callable[[], object]] = {}
    slow: dict[str, float] = {}
    real: dict[str, tuple[int, bool, bool]] = {}
    bar = tqdm(names, desc="advise", disable=not progress, leave=False)
    for ename in bar:
        try:
            eng = make_engine(ename)
            net = build()
            reason = eng.supports(net)
        except Exception as err:  # an engine that needs options, a model that fails
            rows.append(EngineRow(ename, False, None, False, None, False, f"{err}"))
            continue
        if reason is not None:
            rows.append(EngineRow(eng.label, eng.exact, None, False, None, False, reason))
            continue
        try:
            with _deadline(max_step_seconds):
                est = _estimate(eng, build, info, batch_size, dev, tdtype)
        except _TooSlow:
            est = None
        if est is not None and est > limit:
            real[eng.label] = (est, True, eng.exact)
            continue
        try:
            x, y = example_batch(info, batch_size, device=dev, dtype=tdtype)
            step = _step(eng, net, x, y)
            t0 = time.perf_counter()
            with _deadline(max_step_seconds):
                step()  # warm-up: lazy init, allocator caches
            warm = time.perf_counter() - t0
            for p in net.parameters():  # the warm-up's gradients are not the step's baseline
                p.grad = None
            with _deadline(max_step_seconds), MemoryTracker(baseline=(net, x, y)) as tracker:
                step()
        except _TooSlow:
            rows.append(EngineRow(eng.label, eng.exact, est, est is not None, None, False,
                                  TOO_SLOW.format(seconds=max_step_seconds)))  # fmt: skip
            continue
        except Exception as err:
            rows.append(EngineRow(eng.label, eng.exact, est, est is not None, None,
                                  False, f"failed: {err}"))  # fmt: skip
            continue
        rep = tracker.report
        real[eng.label] = (rep.baseline_bytes + rep.peak_bytes, False, eng.exact)
        if warm > slow_seconds:  # e.g. full forward mode on many parameters
            slow[eng.label] = warm
        else:
            steps[eng.label] = step
    bar.close()
    timed = time_interleaved(steps, repeats=repeats, warmup=0) if steps else {}
    times = {k: t.median for k, t in timed.items()} | slow
    for label, (peak, is_est, exact) in real.items():
        rows.append(EngineRow(label, exact, peak, is_est,
                              times.get(label),
                              peak <= budget_bytes))  # fmt: skip
    return _decide(name, batch_size, budget_bytes, rows, exact_only)


def _decide(name: str, batch: int, budget: int, rows: list[EngineRow], exact_only: bool
            ) -> Advice:  # fmt: skip
    ran = [r for r in rows if r.reason is None and r.peak_bytes is not None]
    fitting = [r for r in ran if r.fits and (r.exact or not exact_only)]
    if fitting:
        best = min(fitting, key=_order)
        msg = RECOMMEND.format(engine=best.engine, n=len(fitting), budget=_size(budget))
        if best.seconds is None:
            msg += " (not timed: too big to allocate on this machine; peak is an estimate)"
        return Advice(name, batch, budget, rows, best.engine, msg)
    if not ran:
        return Advice(name, batch, budget, rows, None, NOTHING_RAN.format(model=name))
    small = min(ran, key=lambda r: r.peak_bytes or 0)
    msg = NOTHING_FITS.format(budget=_size(budget), peak=_size(small.peak_bytes),
                              engine=small.engine)  # fmt: skip
    return Advice(name, batch, budget, rows, None, msg)


class _TooSlow(Exception):
    """Raised by SIGALRM inside :func:`_deadline`."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_TooSlow` in the block after ``seconds`` (POSIX main thread only;
    elsewhere the block runs without a limit)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def alarm(signum: int, frame: object) -> None:
        raise _TooSlow

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _step(eng: Any, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def step() -> None:
        for p in net.parameters():
            p.grad = None
        eng.backward(net, x, loss_fn)

    return step


def _estimate(eng: Any, build: Callable[[], nn.Module], info: DataInfo, batch: int,
              dev: torch.device, tdtype: torch.dtype) -> int | None:  # fmt: skip
    """Parameters + inputs + step peak on fake tensors, or None if it cannot be estimated."""

    def make() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        return build(), example_batch(info, batch, device=dev, dtype=tdtype)

    def run(m: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> None:
        _step(eng, m, *xy)()

    try:
        rep = estimate_memory(make, run)
    except Exception:  # an engine whose ops fake tensors cannot run: measure for real
        return None
    return rep.baseline_bytes + rep.peak_bytes
