"""Highway-BP suites: speed and memory on RNNs, training curves, convergence in k.

Runners (``runner = "leangrad_bench._highway:FN"``), float32; the paper's models and data
are in :mod:`._highway_paper`, the report in :mod:`._highway_report`:

- :func:`run_rnn` (``highway-rnn``, paper Table 3/6 + Appendix D): a character-level
  GRU/LSTM model (embedding -> layer -> linear head, a loss at every step) at several
  sequence lengths L; one training step (forward + gradients) of autograd BPTT through the
  same layer, ``nn.GRU``/``nn.LSTM`` with the same weights, and highway for each k, timed
  interleaved; the forward alone is timed too, so *backward = step − forward* of each
  method. Peak memory by the allocator-level tracker and the gradient cosine/error against
  autograd's float64 gradient (:func:`~leangrad.measure.profile_step`). Also times the
  two CumSumProd scans (``kind = "scan"``).
- :func:`run_train` (``highway-train``, Figs. 2, 4, 5): a char-level GRU language model
  on the Python standard library's own sources and a pre-activation ResNet on digits,
  trained by backprop, FPI and highway for several k from the same initialisation on the
  same batches, one thread: loss against step and against wall time.
- :func:`run_transformer` (``highway-transformer``, Table 2, Figs. 3, 6c): the same for a
  GPT-2-style character transformer, plus at every evaluation the cosine between each
  method's gradient and backprop's at the same weights, then each method's step time over
  backprop's at every thread count (interleaved medians).
- :func:`run_convergence` (``highway-convergence``, Fig. 6): the models of highway-train
  trained by backprop; at several points of training, cosine/error/norm share per k.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from leangrad import data
from leangrad._step import as_call
from leangrad.engines import engine as make_engine
from leangrad.highway import (
    HighwayNet,
    HighwayStack,
    KSchedule,
    PostLNSublayer,
    PreLNSublayer,
    convergence,
    cumsumprod_parallel,
    cumsumprod_sequential,
)
from leangrad.measure import (
    compare_grads,
    grads_of,
    num_threads,
    profile_step,
    time_across_threads,
    time_interleaved,
)

from ._highway_paper import (
    Batch,
    TorchLM,
    char_corpus,
    char_lm,
    gpt_char_lm,
    lm_loss,
    lm_windows,
    preact_resnet,
)
from ._runner import EngineSpec, by_threads, new_record, timing_fields
from ._side_by_side import Curves, Lane, make_optimizer, same_start, train_side_by_side
from ._suites import RunSettings, Series, Suite, runner

__all__ = ["KIND", "STEP_KIND", "run_convergence", "run_rnn", "run_train", "run_transformer"]

KIND = "highway-transformer"
STEP_KIND = "highway-transformer-step"


def _base(kind: str, **fields: Any) -> dict[str, Any]:
    return new_record(dict(kind=kind), fields)


def _grads(eng: Any, model: nn.Module, inputs: tuple[Any, ...],
           loss_fn: Callable[..., Any]) -> dict[str, torch.Tensor]:  # fmt: skip
    """One ``eng.backward``'s gradients, leaving ``.grad`` cleared (as training does)."""
    as_call(eng, model, inputs, loss_fn)()
    out = grads_of(model)
    model.zero_grad(set_to_none=True)
    return out


# --- highway-rnn -----------------------------------------------------------------------


def _forward_fn(
    model: nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[..., Any], *, traced: bool
) -> Callable[[], None]:
    def fwd() -> None:
        if traced:  # what the highway engine runs before its backward
            assert isinstance(model, HighwayNet)
            assert model.stem is not None and model.head is not None, "char_lm has both"
            with torch.no_grad():
                x = model.stem(*inputs)
            for s in cast("list[HighwayStack]", list(model.stacks)):
                x = s.trace(x).output
            with torch.enable_grad():
                loss_fn(model.head(x.requires_grad_()))
        else:  # autograd forward, recording the graph
            loss_fn(model(*inputs))

    return fwd


def _speedups(times: dict[str, Any], label: str, fwd_key: str) -> dict[str, Any]:
    """A highway-rnn row's forward and backward seconds and its speedups over BPTT."""
    bwd = times[label].median - times[fwd_key].median
    bptt_bwd = times["bptt"].median - times["forward:bptt"].median
    return {"forward_seconds": times[fwd_key].median, "backward_seconds": bwd,
            "step_speedup": times["bptt"].median / times[label].median,
            "backward_speedup": bptt_bwd / bwd if bwd > 0 else None}  # fmt: skip


@runner(threads=True)
def run_rnn(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Time, memory and gradient quality of highway (each k) vs BPTT vs nn.GRU/nn.LSTM.

    Steps are timed at every count of ``settings.threads`` side by side (default one
    thread): the record's time fields are the first count's, ``by_threads`` has every
    count's (with ``step_speedup`` and ``backward_speedup`` at that count)."""
    quick, device, threads = settings.quick, settings.device, settings.threads or [1]
    batch, hidden, vocab, seed = (int(suite.setting(key, quick, default)) for key, default in
                                  (("batch", 32), ("hidden", 128), ("vocab", 64), ("seed", 0)))
    ks = [int(k) for k in suite.setting("ks", quick, [0, 1, 2, 5, 10])]
    records: list[dict[str, Any]] = []
    bar = tqdm(suite.jobs(quick), desc=suite.name, disable=not settings.progress)
    for series, length in bar:
        cell = series.config.get("cell", "gru")
        bar.set_description(f"{suite.name} {cell} L={length}")
        torch.manual_seed(seed)
        net = char_lm(cell, vocab, hidden).to(device)
        tokens = torch.randint(0, vocab, (length, batch), device=device)
        loss_fn = lm_loss(torch.randint(0, vocab, (length, batch), device=device), vocab)
        inputs, torch_lm = (tokens,), TorchLM(net, cell).to(device)
        methods: dict[str, tuple[Any, nn.Module, int | None]] = {
            "bptt": (make_engine("backprop"), net, None),
            f"nn.{cell.upper()}": (make_engine("backprop"), torch_lm, None),
            **{f"highway(k={k})": (make_engine("highway", k=k), net, k) for k in ks},
            "fpi(k=2)": (make_engine("highway", k=2, baseline="fpi"), net, 2),
        }
        fns = {lb: as_call(e, m, inputs, loss_fn) for lb, (e, m, _) in methods.items()}
        fns["forward:bptt"] = _forward_fn(net, inputs, loss_fn, traced=False)
        fns["forward:highway"] = _forward_fn(net, inputs, loss_fn, traced=True)
        fns["forward:nn"] = _forward_fn(torch_lm, inputs, loss_fn, traced=False)
        timings = time_across_threads(fns, threads=threads, repeats=suite.repeats(quick),
                                      warmup=1, reference="bptt")  # fmt: skip
        ref = _grads(make_engine("backprop"), copy.deepcopy(net).double(), inputs, loss_fn)
        for label, (eng, model, k) in methods.items():
            fwd_key = ("forward:nn" if model is torch_lm
                       else "forward:highway" if k is not None else "forward:bptt")  # fmt: skip
            speed = [_speedups(ts, label, fwd_key) for ts in timings.values()]
            with num_threads(threads[0]):
                prof = profile_step(eng, model, inputs, loss_fn, repeats=0, warmup=0, reference=(
                    TorchLM.renamed(ref) if model is torch_lm else ref))  # fmt: skip
            records.append(_base(
                "highway-rnn", series=series.name, engine=label,
                config={"cell": cell, "length": length, "batch": batch, "hidden": hidden,
                        "vocab": vocab, "dtype": "float32", "threads": threads[0]},
                x=length, k=k, peak_bytes=prof.peak_bytes, threads=threads[0],
                **timing_fields(timings[threads[0]][label]), **speed[0],
                by_threads=[{**t, **sp} for t, sp in zip(by_threads(timings, label), speed,
                                                         strict=True)],
                grad_max_rel_err=prof.grad_max_rel_err, grad_cosine=prof.grad_cosine,
            ))  # fmt: skip
        records += _scan_records(quick, length, batch, hidden, device, threads[0])
    return records


def _scan_records(quick: bool, length: int, batch: int, hidden: int,
                  device: str, threads: int) -> list[dict[str, Any]]:  # fmt: skip
    """Both CumSumProd algorithms on a diagonal K, at this L and at a tiny state."""
    out = []
    for state in ((batch, hidden), (2, 8)):
        v = torch.randn(length, *state, device=device)
        k = torch.rand(length, *state, device=device)
        t = time_interleaved(
            {"parallel": functools.partial(cumsumprod_parallel, v, k),
             "sequential": functools.partial(cumsumprod_sequential, v, k)},
            repeats=5 if quick else 11, warmup=1, reference="sequential", threads=threads,
        )  # fmt: skip
        out += [_base("scan", series=f"scan-{state[0]}x{state[1]}", engine=name,
                      config={"length": length, "state": list(state), "threads": threads},
                      x=length, seconds_median=tm.median, time_ratio=tm.ratio)
                for name, tm in t.items()]  # fmt: skip
    return out


# --- the training suites: one task per series, lanes side by side ----------------------


@dataclasses.dataclass
class _Task:
    """One series' model, training batches, held-out evaluation, optimizer, and the fixed
    training batch gradients are compared and steps timed on (``probe``; ``None``: none)."""

    model: HighwayNet
    batches: Iterator[Batch]
    evaluate: Callable[[nn.Module], dict[str, float]]
    opt: str = "adam"
    probe: Batch | None = None


def _char_task(config: dict[str, Any], model: Callable[[int], HighwayNet], length: int,
               seed: int, device: str, *, evals: int, batch_first: bool) -> _Task:  # fmt: skip
    """A char-LM task: ``model(vocab)`` (built after ``torch.manual_seed(seed)``) trained on
    the first 90% of the corpus, its held-out loss on ``evals`` windows of the last 10%."""
    ids, vocab = char_corpus(int(config.get("corpus_chars", 400_000)))
    ids, batch = ids.to(device), int(config.get("batch", 32))
    train, held = ids[: int(0.9 * len(ids))], ids[int(0.9 * len(ids)) :]
    torch.manual_seed(seed)
    net = model(vocab).to(device)

    def windows(ids: torch.Tensor, seed: int) -> Iterator[Batch]:
        return lm_windows(ids, vocab, length, batch, seed, batch_first=batch_first)

    val = list(itertools.islice(windows(held, seed + 1), evals))

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        losses = [float(loss_fn(m(*inputs))) for inputs, loss_fn in val]
        return {"val_loss": sum(losses) / len(losses)}

    return _Task(net, windows(train, seed), evaluate, probe=next(windows(train, seed + 2)))


def _task(config: dict[str, Any], value: int, seed: int, device: str) -> _Task:
    """highway-train's and highway-convergence's series: a char-level GRU/LSTM LM at
    sequence length ``value``, or a pre-activation ResNet of ``value`` blocks on digits."""
    if config["model"] == "char-lm":
        return _char_task(config, lambda vocab: char_lm(
            config.get("cell", "gru"), vocab, int(config.get("hidden", 128)),
            int(config.get("layers", 1))), value, seed, device, evals=4, batch_first=False)
    if config["model"] != "preact-resnet":
        raise ValueError(f"unknown highway training model {config['model']!r}")
    torch.manual_seed(seed)
    train, test = data.digits(device=device).split(0.8, seed=seed)
    model = preact_resnet(int(config.get("channels", 16)), value).to(device)
    batch = int(config.get("batch", 64))

    def batches() -> Iterator[Batch]:
        for epoch in itertools.count():
            for x, y in train.batches(batch, shuffle=True, seed=seed + epoch, drop_last=True):
                yield (x,), functools.partial(F.cross_entropy, target=y)

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        was = m.training
        m.eval()
        out = m(test.x)
        m.train(was)
        return {"val_loss": float(F.cross_entropy(out, test.y)),
                "test_acc": float((out.argmax(1) == test.y).float().mean())}  # fmt: skip

    return _Task(model, batches(), evaluate, opt="sgd")


def _transformer_task(config: dict[str, Any], layers: int, seed: int, device: str) -> _Task:
    """highway-transformer's series: :func:`gpt_char_lm` with ``layers`` layers, batch-first
    windows of ``context`` characters."""
    length = int(config.get("context", 64))
    return _char_task(config, lambda vocab: gpt_char_lm(
        vocab, d_model=int(config.get("d_model", 64)), layers=layers,
        heads=int(config.get("heads", 2)), context=length, norm=str(config.get("norm", "pre")),
        gamma=config.get("gamma"),
    ), length, seed, device, evals=int(config.get("eval_batches", 8)),
        batch_first=True)  # fmt: skip


@dataclasses.dataclass
class _Training(Curves):
    """Round 0 measures the initialisation, round r trains step r - 1; an evaluation every
    ``every`` steps and at the last. With a ``probe`` batch, every evaluation also compares
    the lane's gradient with the ``exact`` method's at the lane's weights (not training
    time). A lane whose loss is not finite stops without a record (the curve just ends)."""

    kind: str
    series: str
    config: dict[str, Any]
    steps: int
    every: int
    task: _Task
    bar: Any
    makers: dict[str, Callable[[int], Any]]
    exact: str | None
    losses: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    failure_records: bool = False

    def record(self, lane: Lane, r: int) -> dict[str, Any]:
        return _base(self.kind, series=self.series, engine=lane.label,
                     config=self.config)  # fmt: skip

    def advance(self, lane: Lane, r: int, batch: Any) -> None:
        if r == 0:
            return
        inputs, loss_fn = batch
        eng = self.makers[lane.label](r - 1)
        t0 = time.perf_counter()
        res = eng.backward(lane.model, inputs, loss_fn)
        lane.opt.step()
        lane.opt.zero_grad(set_to_none=True)
        lane.seconds += time.perf_counter() - t0
        loss = float(res.loss)
        self.losses.setdefault(lane.label, []).append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss not finite at step {r - 1}")

    def measure(self, lane: Lane, r: int, batch: Any, out: Any) -> dict[str, Any] | None:
        if not (r % self.every == 0 or r == self.steps):
            return None
        losses = self.losses.pop(lane.label, [])
        fields = {"x": r, "wall_seconds": lane.seconds,
                  "train_loss": sum(losses) / len(losses) if losses else None,
                  **self.task.evaluate(lane.model)}  # fmt: skip
        if self.exact is None or self.task.probe is None or lane.label == self.exact:
            return fields
        got, ref = (_grads(self.makers[lb](r), lane.model, *self.task.probe)
                    for lb in (lane.label, self.exact))  # fmt: skip
        cmp = compare_grads(got, ref)
        return {**fields, "grad_cosine": cmp.cosine, "grad_max_rel_err": cmp.max_rel_err}

    def end_round(self, lanes: Any, r: int) -> None:
        self.bar.update(1)


def _train_methods(
    suite: Suite, series: Series, schedule: Any, steps: int
) -> dict[str, Callable[[int], Any]]:
    """Each method's engine at a training step: the suite's engines, and the k schedule."""
    def fixed(spec: EngineSpec) -> Callable[[int], Any]:
        return lambda _step: spec.make()

    methods = {spec.display: fixed(spec) for spec in suite.engines_for(series)}
    if schedule is not None:
        sched = KSchedule(start=int(schedule[0]), end=int(schedule[1]), steps=steps)
        methods[f"highway(k={schedule[0]}->{schedule[1]})"] = lambda step: make_engine(
            "highway", k=sched(step)
        )
    return methods


_Trained = tuple[Series, dict[str, Any], _Task, list[dict[str, Any]]]


def _run_training(suite: Suite, settings: RunSettings, kind: str,
                  make_task: Callable[[dict[str, Any], int, int, str], _Task],
                  config: Callable[[Series, int, _Task], dict[str, Any]], *,
                  compare: bool) -> Iterator[_Trained]:  # fmt: skip
    """Train one model per method of each series from the same initialisation on the same
    batches at one torch thread (``compare``: gradient cosines to the suite's reference at
    every evaluation); per series, its config, task and curve records."""
    quick = settings.quick
    steps, every, seed = (int(suite.setting(key, quick, default)) for key, default in
                          (("steps", 200), ("eval_every", 20), ("seed", 0)))  # fmt: skip
    schedule = suite.setting("schedule", quick, None)
    for series, value in suite.jobs(quick):
        task = make_task(series.config, int(value), seed, settings.device)
        lr = float(series.config.get("lr", 1e-3))
        makers = _train_methods(suite, series, schedule, steps)
        lanes = same_start(task.model, makers, task.opt, lr)
        cfg = {**series.config, suite.sweep: value, "steps": steps, "lr": lr, "threads": 1,
               **config(series, value, task)}  # fmt: skip
        bar = tqdm(total=steps + 1, desc=f"{suite.name} {series.name}",
                   disable=not settings.progress)  # fmt: skip
        curves = _Training(kind, series.name, cfg, steps, every, task, bar, makers,
                           suite.reference if compare else None)  # fmt: skip
        with num_threads(1):
            rounds = zip(range(1, steps + 1), task.batches, strict=False)
            recs = train_side_by_side(lanes, itertools.chain([(0, None)], rounds), curves)
        bar.close()
        yield series, cfg, task, recs


def run_train(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train one model per method from the same initialisation on the same batches."""
    runs = _run_training(suite, settings, "highway-train", _task, lambda *_: {}, compare=False)
    return [r for *_, recs in runs for r in recs]


@runner(threads=True)
def run_transformer(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train the transformer once per method from the same initialisation on the same
    batches (one torch thread, float32, Adam), then time each method's step.

    Records: ``kind = "highway-transformer"`` per method and evaluation (``x`` = steps
    trained, ``wall_seconds`` = training time so far, ``val_loss`` = held-out loss,
    ``train_loss`` = mean training loss since the last evaluation, ``grad_cosine`` /
    ``grad_max_rel_err`` against backprop at the same weights, ``None`` for backprop), and
    ``kind = "highway-transformer-step"`` per fixed-k method: one forward + gradient step
    at the initial weights on the probe batch, optimizer excluded, timed interleaved at
    every thread count after warm-up (medians; ``time_ratio`` over backprop's at
    ``threads[0]``, every count in ``by_threads``). The k schedule is not timed: its step
    costs what the k of the moment costs.
    """
    quick, threads = settings.quick, settings.threads or [1]

    def config(series: Series, layers: int, task: _Task) -> dict[str, Any]:
        return {"blocks": 2 * int(layers), "optimizer": "adam",
                "paper_k": suite.setting("paper_k", quick, None),
                "schedule": suite.setting("schedule", quick, None),
                "gamma": next(m.gamma for m in task.model.modules()
                              if isinstance(m, PreLNSublayer | PostLNSublayer))}  # fmt: skip

    records: list[dict[str, Any]] = []
    for series, cfg, task, recs in _run_training(suite, settings, KIND, _transformer_task,
                                                 config, compare=True):  # fmt: skip
        assert task.probe is not None, "a char-LM task has one"
        model = copy.deepcopy(task.model)  # the initial weights: lanes trained copies
        fns = {spec.display: as_call(spec.make(), model, *task.probe)
               for spec in suite.engines_for(series)}  # fmt: skip
        timings = time_across_threads(fns, threads=threads, repeats=suite.repeats(quick),
                                      warmup=int(suite.setting("warmup", quick, 2)),
                                      reference=suite.reference)  # fmt: skip
        records += recs + [_base(
            STEP_KIND, series=series.name, engine=label,
            config={**cfg, "threads": threads[0]}, threads=threads[0],
            **timing_fields(timings[threads[0]][label]), by_threads=by_threads(timings, label),
            timed="one forward + gradient step at the initial weights, optimizer excluded; "
                  "medians of interleaved repeats after warm-up",
        ) for label in fns]  # fmt: skip
    return records


# --- highway-convergence ---------------------------------------------------------------


def run_convergence(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train with backprop; at several fractions of training, gradient quality per k."""
    quick = settings.quick
    steps = int(suite.setting("steps", quick, 200))
    seed = int(suite.setting("seed", quick, 0))
    ks = [int(k) for k in suite.setting("ks", quick, list(range(11)))]
    points = [float(f) for f in suite.setting("points", quick, [0, 0.25, 0.5, 0.75, 1])]
    at = sorted({round(f * steps) for f in points})
    records: list[dict[str, Any]] = []
    with num_threads(1):
        for series, value in suite.jobs(quick):
            task = _task(series.config, int(value), seed, settings.device)
            model, bp = task.model, make_engine("backprop")
            opt = make_optimizer(task.opt, model.parameters(), float(series.config.get("lr", 1e-3)))
            config = {**series.config, suite.sweep: value, "steps": steps}
            bar = tqdm(range(steps + 1), desc=f"{suite.name} {series.name}",
                       disable=not settings.progress)  # fmt: skip
            for step, (inputs, loss_fn) in zip(bar, task.batches, strict=False):
                for baseline in ("highway", "fpi") if step in at else ():
                    probe = copy.deepcopy(model)  # BatchNorm statistics untouched
                    records += [_base(
                        "highway-convergence", series=series.name,
                        engine=baseline, config=config, x=step, k=p.k,
                        grad_cosine=p.cosine, grad_max_rel_err=p.rel_err,
                        step_share=p.step_share, fraction=step / steps,
                    ) for p in convergence(probe, inputs, loss_fn, ks=ks, baseline=baseline)]
                if step == steps:
                    break
                bp.backward(model, inputs, loss_fn)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return records
