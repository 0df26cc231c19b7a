"""Allocator-level memory tracking of one training step.

On CPU the tracker is a ``TorchDispatchMode``: every tensor an operator returns
is looked up by its *storage* (``Tensor.untyped_storage()``, whose Python object
PyTorch keeps alive exactly as long as the storage), so views and in-place
results count once, and a weak-reference callback on the storage sees the
moment it is freed. On CUDA it reads ``torch.cuda`` allocator statistics.

Parameters, buffers, gradients and inputs are the *baseline*: counted
explicitly when the tracker starts and reported apart, so ``peak_bytes`` is what
the step itself allocates (activations, saved tensors, new gradients, scratch).

Engines call :func:`mark` at phase boundaries (``"forward_end"``: what is kept
for the backward phase); marks are free when no tracker is active.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._errors import LeangradError, OptionError

__all__ = [
    "BAD_BUDGET",
    "BAD_DEVICE",
    "BUDGET_EXCEEDED",
    "ENTERED_TWICE",
    "EXITED_OUT_OF_ORDER",
    "FORWARD_END",
    "NOT_ENTERED",
    "MemoryBudgetExceeded",
    "MemoryReport",
    "MemoryTracker",
    "baseline_bytes",
    "mark",
]

BAD_BUDGET = "budget_bytes must be None or an int >= 1 (bytes), got {value!r}"
BAD_DEVICE = (
    "device {device!r} cannot be tracked: {why}; pass device='cpu', a CUDA device that "
    "torch.cuda.is_available() confirms, or None to infer it from the baseline"
)
ENTERED_TWICE = (
    "this MemoryTracker is already active; a nested region needs a tracker of its own "
    "(with MemoryTracker() as inner: ...)"
)
NOT_ENTERED = (
    "this MemoryTracker was exited without being entered (or exited twice); "
    "use it as `with MemoryTracker() as tracker: ...`"
)
EXITED_OUT_OF_ORDER = (
    "a MemoryTracker was exited while {count} tracker(s) entered inside it were still "
    "active; they were exited first (their reports end here), but nested trackers must be "
    "exited innermost first: use nested `with` blocks"
)
FORWARD_END = "forward_end"
"""Mark name engines record once the forward phase is done (what is kept for backward)."""

_ACTIVE: list[MemoryTracker] = []


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What one tracked region allocated, in bytes.

    Attributes:
        device: ``"cpu"`` or a CUDA device string.
        baseline_bytes: parameters, buffers, existing gradients and inputs, counted
            once by storage when the tracker started.
        peak_bytes: peak of live bytes *above* the baseline inside the region.
        end_bytes: live bytes above the baseline when the region ended.
        marks: live bytes above the baseline at each :func:`mark` (first call wins).
        estimate: ``True`` when measured on fake tensors (shapes only, nothing allocated).
    """

    device: str
    baseline_bytes: int
    peak_bytes: int
    end_bytes: int
    marks: dict[str, int]
    estimate: bool = False

    @property
    def forward_live_bytes(self) -> int | None:
        """Live bytes above baseline at the end of the forward phase, if an engine marked it."""
        return self.marks.get(FORWARD_END)


def _storages(objs: Iterable[Any]) -> Iterator[torch.UntypedStorage]:
    for obj in objs:
        if isinstance(obj, nn.Module):
            tensors: list[torch.Tensor] = []
            for p in obj.parameters():
                tensors.append(p)
                if p.grad is not None:
                    tensors.append(p.grad)
            tensors.extend(obj.buffers())
        else:
            tensors = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
        for t in tensors:
            st = _storage_of(t)
            if st is not None:
                yield st


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, some subclasses
        return None


def baseline_bytes(*objs: Any) -> int:
    """Bytes of the distinct storages behind modules (params, grads, buffers) and tensors."""
    seen: dict[int, int] = {}
    for st in _storages(objs):
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


def _tensors(obj: Any, into: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs (tensors, and lists, tuples and
    dicts of them: all an ATen schema holds), appended to ``into``. Written out because
    ``torch.utils._pytree`` took 40% of a tracked step of the quick GRU LM (11,847 ops)."""
    if isinstance(obj, torch.Tensor):
        into.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                into.append(o)
            elif isinstance(o, (tuple, list, dict)):
                _tensors(o, into)
    elif isinstance(obj, dict):
        _tensors(list(obj.values()), into)
    return into


class _StorageMode(TorchDispatchMode):
    """Sees every operator output and records storages it has not seen before; a real
    step's fake tensors (an engine sizing its blocks on them at its first step) allocate
    nothing and are not counted, as on CUDA, where the allocator never sees them."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        leaves = [t for t in _tensors(out, []) if tracker.estimate or not isinstance(t, FakeTensor)]
        if func in _FRESH:  # torch.tensor(data): allocated outside dispatch, handed in here
            for t in leaves:
                if (st := _storage_of(t)) is not None:
                    tracker._see(st, external=False)
            return out
        inputs: set[int] | None = None  # the inputs' storages, found once a new one needs them
        for t in leaves:
            st = _storage_of(t)
            if st is None:
                continue
            if inputs is None and id(st) not in tracker._entries:  # external only matters new
                inputs = {id(s) for x in _tensors(kwargs, _tensors(args, []))
                          if (s := _storage_of(x)) is not None}  # fmt: skip
            tracker._see(st, external=inputs is not None and id(st) in inputs)
        return out


_RESIZE = torch.UntypedStorage.resize_
_RESIZE_OWN = "resize_" in vars(torch.UntypedStorage)
_resize_users = 0  # CPU trackers active (any thread) that need storage resizes reported


def _reported_resize(self: Any, size: int) -> Any:
    """``UntypedStorage.resize_``, then told to this thread's trackers: a storage resized
    from Python (``x.untyped_storage().resize_(0)``, memcnn's way of freeing a block's
    activations, or ``x.storage().resize_``) changes size outside the dispatcher, so the
    dispatch mode would otherwise keep counting its old size."""
    out = _RESIZE(self, size)
    me = threading.get_ident()
    for t in list(_ACTIVE):
        if t._thread == me and t._mode is not None and id(self) in t._entries:
            t._see(self, external=False)
    return out


def _report_resizes(on: bool) -> None:
    """Install :func:`_reported_resize` while any CPU tracker is active, and only then."""
    global _resize_users
    _resize_users += 1 if on else -1
    installed = torch.UntypedStorage.resize_ is not _RESIZE
    if _resize_users > 0 and not installed:
        torch.UntypedStorage.resize_ = _reported_resize  # type: ignore[method-assign]
    elif _resize_users == 0 and installed:
        if _RESIZE_OWN:  # put back exactly what was there: the class's own, or nothing
            torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_  # inherited from the C base again


BUDGET_EXCEEDED = (
    "memory budget exceeded: {total} bytes live ({baseline} baseline + {live} allocated in "
    "the step) > budget_bytes={budget}"
)


class MemoryBudgetExceeded(LeangradError, MemoryError):
    """A step tracked with ``budget_bytes`` needed more memory than the budget."""


class MemoryTracker:
    """Track live tensor storage bytes over a region: forward *and* backward inside it.

    Use it as a context manager around the whole step; read :attr:`report` after::

        with MemoryTracker(baseline=(model, x)) as tracker:
            engine.backward(model, x, loss_fn)
        print(tracker.report.peak_bytes)

    Args:
        baseline: modules and tensors that exist before the step (parameters,
            buffers, gradients, inputs). Their storages are counted once in
            ``baseline_bytes`` and never as allocations of the step.
        device: ``"cpu"`` (dispatch-mode tracking) or a CUDA device (allocator
            statistics). ``None`` infers it from the first baseline tensor.
        estimate: label the report as an estimate (set by
            :func:`leangrad.measure.estimate_memory`, which runs on fake tensors).
        budget_bytes: a memory budget for baseline + live bytes, to run a step as if
            on a smaller device: on CPU the allocation that crosses it raises
            :class:`MemoryBudgetExceeded` at once (the step is aborted, like an
            out-of-memory error); on CUDA the peak is checked when the region ends.

    On CPU, a storage first seen as the output of an operator that also took it
    as input (a view or in-place op on a tensor made before tracking started)
    is external and not counted; its later growth is.
    """

    def __init__(
        self,
        *,
        baseline: Iterable[Any] | Any = (),
        device: str | torch.device | None = None,
        estimate: bool = False,
        budget_bytes: int | None = None,
    ) -> None:
        budget_bytes = _check_budget_arg(budget_bytes)
        objs = list(baseline) if isinstance(baseline, (list, tuple)) else [baseline]
        self._baseline_objs = objs
        self.device = _check_device(device, estimate) if device is not None else _infer_device(objs)
        self.estimate = estimate
        self.live = 0
        self.peak = 0
        self.marks: dict[str, int] = {}
        self._baseline = 0
        # id(storage) -> (weakref, bytes not ours (baseline/external), bytes counted)
        self._entries: dict[int, tuple[weakref.ref[torch.UntypedStorage], int, int]] = {}
        self._mode: _StorageMode | None = None
        self._stance: Any = None  # torch.compiler.set_stance("force_eager") while tracking
        self._cuda_start = 0
        self._use_cuda = self.device.type == "cuda" and not estimate
        self._report: MemoryReport | None = None
        self._thread: int | None = None  # dispatch modes are per thread
        self.budget_bytes = budget_bytes

    # -- bookkeeping (CPU) -------------------------------------------------
    def _see(self, st: torch.UntypedStorage, *, external: bool) -> None:
        """Record a storage: new ones count in full, external ones only by their growth."""
        key = id(st)
        nbytes = st.nbytes()
        entry = self._entries.get(key)
        if entry is None:
            base = nbytes if external else 0
            self._entries[key] = (weakref.ref(st, self._freed_callback(key)), base, 0)
            entry = self._entries[key]
        ref, base, counted = entry
        now = max(0, nbytes - base)
        if now != counted:  # new, or resized in place (e.g. an out= op)
            self.live += now - counted
            self.peak = max(self.peak, self.live)
            self._entries[key] = (ref, base, now)
            self._check_budget(self.live)

    def _check_budget(self, live: int) -> None:
        if self.budget_bytes is not None and self._baseline + live > self.budget_bytes:
            raise MemoryBudgetExceeded(
                BUDGET_EXCEEDED.format(
                    total=self._baseline + live,
                    budget=self.budget_bytes,
                    baseline=self._baseline,
                    live=live,
                )
            )

    def _freed_callback(self, key: int) -> Callable[[weakref.ref[torch.UntypedStorage]], None]:
        def freed(_ref: weakref.ref[torch.UntypedStorage]) -> None:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.live -= entry[2]

        return freed

    # -- context protocol --------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        """Start tracking. Transactional: everything that can fail (the budget check on the
        baseline) runs before the dispatch mode is pushed, so a failed enter leaves nothing
        behind and torch works as before."""
        if any(t is self for t in _ACTIVE):
            raise LeangradError(ENTERED_TWICE)
        storages = list(_storages(self._baseline_objs))
        unique = {id(st): st for st in storages}
        self._baseline = sum(st.nbytes() for st in unique.values())
        self._entries.clear()
        self.live = self.peak = 0
        self.marks = {}
        self._report = None
        self._check_budget(0)  # before anything is pushed: a failed enter leaves no mode
        if self._use_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        else:
            for st in unique.values():
                self._see(st, external=True)
            # torch.compile refuses a dispatch mode it does not know: the frame would be
            # marked skipped for good (a fullgraph function then fails, any other runs
            # eagerly, for the rest of the process). Inside the tracker compiled functions
            # run eagerly without being looked at, and compile as before after it.
            self._stance = torch.compiler.set_stance("force_eager")
            mode = _StorageMode(self)
            mode.__enter__()
            self._mode = mode
            _report_resizes(True)
        self._thread = threading.get_ident()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop tracking and build the report; the dispatch mode is popped on every path.

        Trackers entered inside this one and still active (a manual ``__enter__`` whose
        ``__exit__`` never ran) are exited first, innermost first, so the mode popped is
        always this tracker's own; without an exception in flight that misuse then raises
        ``EXITED_OUT_OF_ORDER``.
        """
        index = next((i for i, t in enumerate(_ACTIVE) if t is self), None)
        if index is None:
            raise LeangradError(NOT_ENTERED)
        exc = exc or (None, None, None)
        inner = [t for t in _ACTIVE[index + 1 :] if t._thread == self._thread]
        try:
            for t in reversed(inner):
                t.__exit__(*exc)
        finally:
            _ACTIVE.remove(self)  # trackers define no __eq__: this removes this very one
            self._finish(exc)
        if inner and exc[0] is None:
            raise LeangradError(EXITED_OUT_OF_ORDER.format(count=len(inner)))

    def _finish(self, exc: tuple[object, ...]) -> None:
        if self._use_cuda:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
            self.live = torch.cuda.memory_allocated(self.device) - self._cuda_start
        elif self._mode is not None:
            mode, self._mode = self._mode, None
            _report_resizes(False)
            try:
                mode.__exit__(*exc)
            finally:
                if self._stance is not None:
                    self._stance.__exit__(None, None, None)
                    self._stance = None
        self._report = MemoryReport(
            device=str(self.device),
            baseline_bytes=self._baseline,
            peak_bytes=max(self.peak, 0),
            end_bytes=self.live,
            marks=dict(self.marks),
            estimate=self.estimate,
        )
        self._entries.clear()  # drops the weakrefs, so their callbacks never fire
        if self._use_cuda and exc[0] is None:
            self._check_budget(self.peak)

    def current_bytes(self) -> int:
        """Live bytes above the baseline right now."""
        if self._use_cuda:
            return torch.cuda.memory_allocated(self.device) - self._cuda_start
        return self.live

    @property
    def report(self) -> MemoryReport:
        """The named result; available once the ``with`` block has ended."""
        if self._report is None:
            raise RuntimeError("MemoryTracker.report is available after the `with` block exits")
        return self._report


def _check_budget_arg(budget_bytes: object) -> int | None:
    """``budget_bytes`` as an int (any integral type: numpy too), or ``None``."""
    if budget_bytes is None:
        return None
    try:
        value = None if isinstance(budget_bytes, bool) else operator.index(budget_bytes)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or value < 1:
        raise OptionError(BAD_BUDGET.format(value=budget_bytes))
    return value


def _check_device(device: str | torch.device, estimate: bool) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise OptionError(BAD_DEVICE.format(device=device, why="not a torch device")) from e
    if dev.type == "cuda" and not estimate and not torch.cuda.is_available():
        raise OptionError(BAD_DEVICE.format(device=device, why="CUDA is not available"))
    return dev


def _infer_device(objs: list[Any]) -> torch.device:
    for st in _storages(objs):
        if st.device.type == "cuda":
            return st.device
    return torch.device("cpu")


def mark(name: str) -> None:
    """Record the live bytes of every active tracker under ``name`` (first call wins).

    Engines call ``mark(FORWARD_END)`` when their forward phase is done; without
    an active tracker this does nothing and costs nothing.
    """
    for tracker in _ACTIVE:
        tracker.marks.setdefault(name, tracker.current_bytes())
