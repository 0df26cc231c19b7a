"""A plan as a value, kept and shown: :class:`Plan` and its rows (:class:`Candidate`),
:meth:`leangrad.Plan.save` / :meth:`leangrad.Plan.load` as JSON, the fingerprint of the
model and batch a plan was made for, and the progress bar of :func:`leangrad.plan`. The
planner (:mod:`leangrad.planner._plan`) builds on this module; nothing here imports it.

A plan is measured on one model and one batch shape; its verdicts hold for them only. The
file records what it was made for — the model's class, its parameters' names, shapes and
dtypes (a hash and counts), the inputs' shapes and dtypes, the device type, and the torch
and leangrad versions — and :meth:`Plan.load` given a model and inputs refuses others
(another version only warns: the measurements may have moved, the engine still works).
The chosen engine is stored as what :func:`leangrad.engine` makes it from (name and
options), and rebuilt on load; a compiled row's (``plan(..., compile=True)``) is rebuilt as
:class:`leangrad.planner._compile.Compiled` with its setting, which compiles afresh on its
first backward. A row's ``compile_seconds`` and ``tie_break`` are written only where it
has one, so plans without compiled rows or ties are the same files as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import _errors as errors
from .._sizes import fmt_bytes
from .._version import __version__
from ..engines import Engine
from ..engines import engine as engine_named
from ._choice import Choice
from ._compile import COMPILE_NAME, Compiled
from ._measure import Tried

__all__ = [
    "CHOSEN",
    "FORMAT",
    "VERSION",
    "Candidate",
    "Measured",
    "Plan",
    "Progress",
    "check_made_for",
    "chosen_row",
    "fingerprint",
    "load_plan",
    "save_plan",
]

FORMAT = "leangrad.plan"
"""The ``format`` entry of every plan file."""
VERSION = 1
"""The plan file format's version; a file of a newer one is refused."""

NOT_A_PLAN = (
    "{path}: not a leangrad plan file ({why}); give a file that Plan.save or "
    "`leangrad plan --save` wrote"
)
CANNOT_READ = (
    "{path}: cannot read it ({why}); give the file Plan.save or `leangrad plan --save` wrote"
)
NEWER_FORMAT = (
    "{path}: plan file format version {found}, this leangrad reads up to {known}; "
    "upgrade leangrad or plan again"
)
CANNOT_SAVE_OPTION = (
    "cannot save option {key}={value!r} of engine {engine!r}: a plan file holds numbers, "
    "strings, booleans, None, lists, tuples and dicts of them; plan with options of those types"
)
NO_CHOSEN_ROW = (
    "this plan has an engine but no table row whose verdict is 'chosen', so the file could "
    "not rebuild it; save a plan that leangrad.plan returned"
)
WRONG_MODEL = "{path} was made for {saved}; this model is {given}: plan again for this model"
WRONG_INPUTS = (
    "{path} was made for {model} with batch shape {saved}; this model's inputs are {given}: "
    "plan again for this batch"
)
WRONG_DEVICE = (
    "{path} was measured on {saved}; this model runs on {given}: plan again on this device"
)
OTHER_VERSION = (
    "{path} was made with {what} {saved}, this is {given}: its peaks and times may have moved "
    "(plan again to be sure)"
)
RELABELLED = (
    "{path}: the chosen engine was saved as {saved!r} and rebuilds as {given!r} in this "
    "leangrad; plan again to be sure it is the same step"
)
CHOSEN_NOT_ENGINE = (
    "a Plan's chosen row must carry the plan's engine, got {row!r} and {engine!r}; give "
    "chosen=dataclasses.replace(row, engine=engine)"
)
CHOSEN = "chosen"
"""How the chosen row's verdict begins (``"chosen"``, ``"chosen (estimate)"``, ...)."""
_TUPLE = "__tuple__"
"""JSON key of an encoded tuple (JSON has lists only)."""


# -- the plan ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One row of a plan's table.

    Attributes:
        label: the engine's label (``leangrad.engine`` spelling and options).
        name, options: what :func:`leangrad.engine` makes it from.
        exact: the engine's gradient equals autograd's.
        peak_bytes: the memory one step needs in all: parameters, buffers and inputs plus
            the tracker's peak of the step (``None`` when it could not run).
        seconds: median step time (only for candidates that fit).
        verdict: ``"chosen"``, ``"fits"``, or why it was rejected (for reading: the chosen
            row is :attr:`Plan.chosen`).
        per_layer: measured with the optimizer stepped per parameter inside ``on_grad``
            (only when the plan was given an ``optimizer``).
        estimate: ``peak_bytes`` was measured on fake tensors (too big to allocate here).
        compile_seconds: a compiled row's cold compile (dynamo, AOT autograd, inductor), in
            a fresh process; never part of ``seconds``. A compiled row's peak is backprop's
            with its step part scaled by the fresh process's compiled/eager peak ratio (RSS
            on the CPU, the caching allocator's on CUDA), its ``seconds`` backprop's median
            here scaled by that process's compiled/eager time ratio; its verdict says so
            (``"fits (RSS-scaled)"``).
        tie_break: on the chosen row only, where the fastest candidates were within timing
            noise of each other even when timed again: which ones, and the rule that chose
            (``"within noise of chunked_ce (0.98×): chose by lower peak"``,
            :mod:`leangrad.planner._choice`); ``None`` where the timing decided.
        engine: the chosen row's engine object, the one the plan measured (with the
            prepared copies it built; ``None`` on every other row). Not compared, not
            written to a plan file (a loaded plan's is rebuilt from ``name`` and
            ``options``).
    """

    label: str
    exact: bool
    peak_bytes: int | None
    seconds: float | None
    verdict: str
    name: str = ""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    per_layer: bool = False
    estimate: bool = False
    compile_seconds: float | None = None
    tie_break: str | None = None
    engine: Engine | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a plan measured, kept with it so that a plan of the same step at another budget
    (``plan(reuse=)``) takes each candidate's peak and warm engine instead of stepping it
    again: a peak does not depend on the budget, only a verdict does
    (:func:`leangrad.planner._measure.revisit`)."""

    model: nn.Module
    """The model stepped: the user's, or the plan's copy where an optimizer steps it."""
    xs: tuple[torch.Tensor, ...]
    setting: tuple[Any, ...]
    """What else decides the rows: exactness, optimizer, autocast, candidates, compile."""
    rows: dict[str, list[Tried]]
    """Each candidate's rows (one, or two with an optimizer), by
    :func:`leangrad.planner._measure.key`."""
    of: nn.Module
    """The user's model the plan was asked for."""
    budget: int = 0
    choice: Choice | None = None
    """What the plan's timing decided (a :class:`leangrad.planner._choice.Choice`): at a
    lower budget every row that fits fitted this plan's budget too, so where its fastest
    still fits, it is the fastest there."""
    checked: dict[str, str | None] = dataclasses.field(default_factory=dict)
    """Rows re-checked against ``loss.backward()`` on this model (:mod:`leangrad.
    _plan_verify`): ``None`` where the step was autograd's, else what differed."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The fastest way found to compute a step within the budget.

    Attributes:
        engine: the chosen engine, usable like any engine (``None`` if nothing fits); a
            compiled row's is a :class:`leangrad.planner._compile.Compiled`, which compiles
            the model on its first backward (once per model) under the row's setting.
        peak_bytes, seconds, exact: the chosen engine's measured peak, time, exactness.
        budget: the budget in bytes.
        table: every candidate tried, and why each was rejected.
        message: one line saying what was chosen, or that nothing fits.
        remeasured_peak_bytes: the chosen engine's peak measured again after the search.
        per_layer: the chosen step runs the optimizer per parameter inside ``on_grad``:
            ``opt = leangrad.train.PerLayerOptimizer(dict(model.named_parameters()), make)``,
            then ``plan.engine.backward(model, x, loss_fn, on_grad=opt.on_grad)`` and
            ``opt.finish()``, with no ``optimizer.step()`` after it.
        estimate: the chosen peak is a fake-tensor estimate and it was not timed.
        wall_seconds: how long planning took, all measurements included.
        made_for: what the plan was measured on (the model's class and parameters, the
            inputs' shapes and dtypes, the device type, the torch and leangrad versions):
            :meth:`load` refuses another model or batch shape.
        chosen: the chosen row of ``table``, its ``engine`` this plan's ``engine``
            (``None`` when nothing fits). Left out, it is the row whose verdict reads
            ``"chosen"`` (a plan file's record, or a plan built by hand).
        measured: what the plan measured (its candidates' peaks and warm engines), for
            ``plan(..., reuse=this_plan)`` at another budget; ``None`` in a plan file's.
    """

    engine: Engine | None
    peak_bytes: int | None
    seconds: float | None
    exact: bool | None
    budget: int
    table: tuple[Candidate, ...]
    message: str
    remeasured_peak_bytes: int | None = None
    per_layer: bool = False
    estimate: bool = False
    wall_seconds: float | None = None
    made_for: dict[str, Any] | None = None
    chosen: Candidate | None = None
    measured: Measured | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chosen is not None:
            if self.chosen.engine is not self.engine:
                raise ValueError(CHOSEN_NOT_ENGINE.format(row=self.chosen.engine,
                                                          engine=self.engine))  # fmt: skip
            return
        if self.engine is None:
            return
        at = next((i for i, c in enumerate(self.table) if c.verdict.startswith(CHOSEN)), None)
        if at is None:
            return
        row = dataclasses.replace(self.table[at], engine=self.engine)
        object.__setattr__(self, "table", (*self.table[:at], row, *self.table[at + 1 :]))
        object.__setattr__(self, "chosen", row)

    @property
    def tie_break(self) -> str | None:
        """How the chosen row was picked among candidates within timing noise of each
        other (its :attr:`Candidate.tie_break`); ``None`` where the timing decided."""
        return None if self.chosen is None else self.chosen.tie_break

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan to ``path`` as JSON: the chosen engine (as
        ``leangrad.engine(name, **options)`` makes it), the table, budget, message and
        measurements, and what it was made for. Returns the path.

        Raises:
            OptionError: an engine option that JSON cannot hold (plan files hold numbers,
                strings, booleans, None, lists, tuples and dicts).
        """
        return save_plan(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, model: nn.Module | None = None,
             inputs: torch.Tensor | Sequence[torch.Tensor] | None = None) -> Plan:  # fmt: skip
        """Read a plan :meth:`save` wrote and rebuild its engine (``None`` where nothing
        fitted). Given ``model`` and/or ``inputs``, check the plan was made for them.

        Raises:
            EngineInputError: another model (class or parameters), another batch shape or
                input dtype, or another device type than the plan was made for: one line
                naming what differs. Another torch or leangrad version only warns.
            OptionError: the file is not a plan file, or of a newer format.
        """
        return load_plan(path, model=model, inputs=inputs)

    def __str__(self) -> str:
        width = max([len(c.label) for c in self.table] + [6])
        compiled = any(c.name == "compile" for c in self.table)  # a column of their own
        head = f"{'compile s':>9s}  " if compiled else ""
        lines = [f"{'engine':{width}s}  {'exact':5s}  {'peak':>10s}  {'s/step':>8s}  "
                 f"{head}verdict"]  # fmt: skip
        for c in self.table:
            secs = "" if c.seconds is None else f"{c.seconds:.4f}"
            peak = ("~" if c.estimate else "") + fmt_bytes(c.peak_bytes)
            comp = "" if c.compile_seconds is None else f"{c.compile_seconds:.1f}"
            tie = "" if c.tie_break is None else f" — {c.tie_break}"
            lines.append(f"{c.label:{width}s}  {'yes' if c.exact else 'no':5s}  "
                         f"{peak:>10s}  {secs:>8s}  {f'{comp:>9s}  ' if compiled else ''}"
                         f"{c.verdict}{tie}")  # fmt: skip
        lines.append(self.message)
        if self.wall_seconds is not None:
            lines.append(f"planned in {self.wall_seconds:.1f} s ({len(self.table)} candidates)")
        return "\n".join(lines)


# -- fingerprint ---------------------------------------------------------------------


def fingerprint(model: nn.Module, inputs: torch.Tensor | Sequence[torch.Tensor]
                ) -> dict[str, Any]:  # fmt: skip
    """What a plan was made for: the model's class, its parameters (names, shapes and
    dtypes as a SHA-256 prefix, plus counts and dtypes to read), the inputs' shapes and
    dtypes, the device type, and the torch and leangrad versions."""

    xs = _tensors(inputs)
    named = [(n, list(p.shape), _dtype(p.dtype)) for n, p in model.named_parameters()]
    digest = hashlib.sha256(json.dumps(named).encode()).hexdigest()[:16]
    first = next(model.parameters(), None)
    device = xs[0].device if xs else first.device if first is not None else torch.device("cpu")
    return {
        "model": type(model).__name__,
        "parameters": {
            "tensors": len(named),
            "values": sum(p.numel() for p in model.parameters()),
            "dtypes": sorted({d for _, _, d in named}),
            "sha256": digest,
        },
        "inputs": [{"shape": list(x.shape), "dtype": _dtype(x.dtype)} for x in xs],
        "device": device.type,
        "torch": torch.__version__,
        "leangrad": __version__,
    }


def check_made_for(made_for: dict[str, Any] | None, *, model: nn.Module | None = None,
                   inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
                   source: str = "the plan") -> None:  # fmt: skip
    """Raise :class:`~leangrad.EngineInputError` (one line, naming what differs) when
    ``model`` or ``inputs`` are not what the plan was made for; warn when only the torch
    or leangrad version differs. A plan without a fingerprint is not checked."""
    if made_for is None:
        return
    if model is not None:
        here = fingerprint(model, inputs if inputs is not None else ())
    elif inputs is not None:
        here = fingerprint(nn.Module(), inputs)
    else:
        here = fingerprint(nn.Module(), ())
    saved_model = _describe_model(made_for)
    if model is not None and (made_for.get("model") != here["model"]
                              or made_for.get("parameters") != here["parameters"]):  # fmt: skip
        given = _describe_model(here)
        if given == saved_model:  # same class and counts: names or shapes moved
            given += " with other parameter names or shapes"
        raise errors.EngineInputError(WRONG_MODEL.format(path=source, saved=saved_model,
                                                         given=given))  # fmt: skip
    if inputs is not None and made_for.get("inputs") != here["inputs"]:
        saved_in, given_in = made_for.get("inputs") or [], here["inputs"]
        dtypes = [i.get("dtype") for i in saved_in] != [i["dtype"] for i in given_in]
        raise errors.EngineInputError(WRONG_INPUTS.format(
            path=source, model=made_for.get("model", "?"),
            saved=_describe_inputs(saved_in, dtypes=dtypes),
            given=_describe_inputs(given_in, dtypes=dtypes)))  # fmt: skip
    if (model is not None or inputs is not None) and made_for.get("device") != here["device"]:
        raise errors.EngineInputError(WRONG_DEVICE.format(
            path=source, saved=made_for.get("device"), given=here["device"]))  # fmt: skip
    for what in ("torch", "leangrad"):
        if made_for.get(what) != here[what]:
            warnings.warn(OTHER_VERSION.format(path=source, what=what, saved=made_for.get(what),
                                               given=here[what]), stacklevel=3)  # fmt: skip


def _tensors(inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_model(made_for: dict[str, Any]) -> str:
    p = made_for.get("parameters") or {}
    return (f"{made_for.get('model', '?')} ({p.get('tensors', '?')} parameter tensors, "
            f"{p.get('values', 0):,} values, {'/'.join(p.get('dtypes') or ['?'])})")  # fmt: skip


def _describe_inputs(inputs: list[dict[str, Any]], *, dtypes: bool) -> str:
    shapes = [str(tuple(i.get("shape", ()))) + (f" {i.get('dtype')}" if dtypes else "")
              for i in inputs]  # fmt: skip
    return ", ".join(shapes) if shapes else "none"


# -- the file ------------------------------------------------------------------------


def chosen_row(plan: Plan) -> Candidate | None:
    """The table row of the chosen engine (``None`` when nothing fits): :attr:`Plan.chosen`."""
    return plan.chosen


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``plan`` to ``path`` as JSON (see :meth:`leangrad.Plan.save`); returns the path."""
    row = chosen_row(plan)
    if plan.engine is not None and row is None:
        raise errors.EngineInputError(NO_CHOSEN_ROW)
    chosen = None if plan.engine is None or row is None else {
        "name": row.name, "options": _encode_options(row.name, row.options),
        "label": plan.engine.label, "per_layer": plan.per_layer,
    }  # fmt: skip
    doc = {
        "format": FORMAT, "version": VERSION, "chosen": chosen, "budget": plan.budget,
        "peak_bytes": plan.peak_bytes, "seconds": plan.seconds, "exact": plan.exact,
        "remeasured_peak_bytes": plan.remeasured_peak_bytes, "per_layer": plan.per_layer,
        "estimate": plan.estimate, "message": plan.message, "wall_seconds": plan.wall_seconds,
        "made_for": plan.made_for,
        "table": [_encode_row(c) for c in plan.table],
    }  # fmt: skip
    out = Path(path)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return out


def load_plan(path: str | os.PathLike[str], *, model: nn.Module | None = None,
              inputs: torch.Tensor | Sequence[torch.Tensor] | None = None) -> Plan:  # fmt: skip
    """Read a plan :func:`save_plan` wrote, rebuild its engine, and check it was made for
    ``model`` and ``inputs`` when they are given (see :meth:`leangrad.Plan.load`)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as err:
        raise errors.OptionError(CANNOT_READ.format(path=p, why=err.strerror or err)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise errors.OptionError(NOT_A_PLAN.format(path=p, why=err)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise errors.OptionError(NOT_A_PLAN.format(path=p, why=f"no format {FORMAT!r}"))
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise errors.OptionError(NEWER_FORMAT.format(path=p, found=doc.get("version"),
                                                     known=VERSION))  # fmt: skip
    made_for = doc.get("made_for")
    check_made_for(made_for, model=model, inputs=inputs, source=str(p))
    try:
        table = tuple(Candidate(**{**row, "options": _decode(row.get("options", {}))})
                      for row in doc["table"])  # fmt: skip
        chosen = doc["chosen"]
        eng = None if chosen is None else _rebuild(chosen["name"], _decode(chosen["options"]))
        plan = Plan(eng, doc["peak_bytes"], doc["seconds"], doc["exact"], doc["budget"], table,
                    doc["message"], doc.get("remeasured_peak_bytes"), bool(doc["per_layer"]),
                    bool(doc.get("estimate", False)), wall_seconds=doc.get("wall_seconds"),
                    made_for=made_for)  # fmt: skip
    except (KeyError, TypeError, AttributeError) as err:
        why = f"{type(err).__name__}: {err}"
        raise errors.OptionError(NOT_A_PLAN.format(path=p, why=why)) from None
    if eng is not None and chosen is not None and eng.label != chosen.get("label", eng.label):
        warnings.warn(RELABELLED.format(path=p, saved=chosen.get("label"), given=eng.label),
                      stacklevel=3)  # fmt: skip
    return plan


def _encode_row(c: Candidate) -> dict[str, Any]:
    row = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "engine"}
    row["options"] = _encode_options(c.name, c.options)
    for key in ("compile_seconds", "tie_break"):  # fields only some rows have
        if row[key] is None:
            del row[key]
    return row


def _rebuild(name: str, options: dict[str, Any]) -> Engine:
    """The engine a plan file names: ``leangrad.engine(name, **options)``, or a compiled
    row's :class:`~leangrad.planner._compile.Compiled`."""
    return Compiled(**options) if name == COMPILE_NAME else engine_named(name, **options)


def _encode_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    return {key: _encode(value, name, key) for key, value in options.items()}


def _encode(value: Any, name: str, key: str) -> Any:
    """JSON for an option value: tuples tagged (JSON has lists only), anything else that
    JSON does not hold refused naming the option."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, name, key) for v in value]}
    if isinstance(value, list):
        return [_encode(v, name, key) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and _TUPLE not in value:
        return {k: _encode(v, name, key) for k, v in value.items()}
    raise errors.OptionError(CANNOT_SAVE_OPTION.format(key=key, value=value, engine=name))


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        return {k: _decode(v) for k, v in value.items()}
    return value


# -- progress ------------------------------------------------------------------------


class Progress:
    """What :func:`leangrad.plan` reports while it measures: the caller's callback gets
    each message; ``progress=True`` shows a bar on stderr that advances per candidate
    (its peak measured) and then through the timing phase. Callable as the callback."""

    def __init__(self, progress: Callable[[str], None] | bool | None, *, total: int) -> None:
        self.callback = progress if callable(progress) else None
        self.bar = tqdm(total=total, desc="plan", unit="candidate", file=sys.stderr,
                        disable=progress is not True, leave=False)  # fmt: skip

    def __call__(self, message: str) -> None:
        if self.callback is not None:
            self.callback(message)
        self.bar.set_postfix_str(message)

    def advance(self) -> None:
        """One more candidate (or phase) done."""
        self.bar.update()

    def grow(self, more: int) -> None:
        """``more`` candidates joined the list (the last resorts)."""
        if self.bar.total is not None and more:
            self.bar.total += more
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
