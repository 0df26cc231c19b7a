"""Highway-BP suites (issue 7): speed and memory on RNNs, training curves, convergence in k.

Runners (``runner = "leangrad.bench._highway:FN"``), all on one thread, float32:

- :func:`run_rnn` (``highway-rnn``, paper Table 3/6 + Appendix D): a character-level
  GRU/LSTM model (embedding -> layer -> linear head, a loss at every step) at several
  sequence lengths L; one training step (forward + gradients) of autograd BPTT through the
  same layer, ``nn.GRU``/``nn.LSTM`` with the same weights, and highway for each k, timed
  interleaved; the forward alone is timed too, so *backward = step − forward* of each
  method. Peak memory by the allocator-level tracker; gradient cosine/error against
  autograd's float64 gradient. Also times the two CumSumProd scans (``kind = "scan"``).
- :func:`run_train` (``highway-train``, Figs. 2, 4, 5): a char-level GRU language model
  on the Python standard library's own sources and a pre-activation ResNet on digits,
  trained by backprop, FPI and highway for several k from the same initialisation on the
  same batches: loss against step and against wall time.
- :func:`run_convergence` (``highway-convergence``, Fig. 6): the same models trained by
  backprop; at several points of training, cosine/error/norm share per k.

:func:`leangrad.bench._highway_report.render` writes their section of ``leangrad report``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import itertools
import math
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import data
from ..engines import engine as make_engine
from ..highway import (
    GRULayer,
    HighwayNet,
    HighwayStack,
    KSchedule,
    LSTMLayer,
    PreActBlock,
    ResidualStack,
    convergence,
    cumsumprod_parallel,
    cumsumprod_sequential,
)
from ..measure import (
    MemoryTracker,
    compare_grads,
    grads_of,
    num_threads,
    time_across_threads,
    time_interleaved,
)
from ._runner import EngineSpec, by_threads, machine_info, new_record, timing_fields
from ._side_by_side import Curves, Lane, make_optimizer, same_start, train_side_by_side
from ._suites import RunSettings, Series, Suite, runner

__all__ = ["char_corpus", "run_convergence", "run_rnn", "run_train"]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _base(suite: Suite, kind: str, quick: bool, **fields: Any) -> dict[str, Any]:
    return new_record(
        dict(kind=kind, suite=suite.name, quick=quick, machine=machine_info(), created=_now()),
        fields,
    )


# --- models and data -------------------------------------------------------------------


def char_lm(cell: str, vocab: int, hidden: int, layers: int = 1) -> HighwayNet:
    """Embedding -> ``layers`` GRU/LSTM layers (residuals between them) -> linear head."""
    cls = GRULayer if cell == "gru" else LSTMLayer
    stacks = [cls(hidden, hidden, residual=i > 0) for i in range(layers)]
    return HighwayNet(nn.Embedding(vocab, hidden), stacks, nn.Linear(hidden, vocab))


class _TorchLM(nn.Module):
    """The same model with ``nn.GRU``/``nn.LSTM`` (one layer), weights copied."""

    def __init__(self, net: HighwayNet, cell: str) -> None:
        super().__init__()
        layer = net.stacks[0]
        cls = nn.GRU if cell == "gru" else nn.LSTM
        assert net.stem is not None and net.head is not None, "char_lm has both"
        self.stem: nn.Module = copy.deepcopy(net.stem)
        self.head: nn.Module = copy.deepcopy(net.head)
        self.rnn = cls(layer.input_size, layer.hidden_size)
        with torch.no_grad():
            for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(self.rnn, f"{n}_l0").copy_(getattr(layer, n))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.stem(tokens))[0])


def char_corpus(max_chars: int, *, vocab: int = 96) -> tuple[torch.Tensor, int]:
    """Characters of the Python standard library's ``.py`` files (sorted paths, from
    ``sysconfig.get_paths()["stdlib"]``), the ``vocab − 1`` most common mapped to ids and
    every other character to one "unknown" id. Returns ``(ids, vocab)``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total == 0:
        raise FileNotFoundError(f"no readable .py files under the standard library at {root}")
    text = "".join(parts)[:max_chars]
    common = [c for c, _ in Counter(text).most_common(vocab - 1)]
    table = {c: i for i, c in enumerate(common)}
    ids = torch.tensor([table.get(c, vocab - 1) for c in text], dtype=torch.long)
    return ids, vocab


def _lm_batches(ids: torch.Tensor, length: int, batch: int, seed: int) -> Iterator[Any]:
    """Random windows ``(tokens, targets)``, time-major ``(L, batch)``, forever."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
        win = torch.stack([ids[s : s + length + 1] for s in starts.tolist()], 1)
        yield win[:-1], win[1:]


def _lm_loss(targets: torch.Tensor, vocab: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:  # one loss per step (section 3)
        return F.cross_entropy(out.reshape(-1, vocab), targets.reshape(-1))

    return loss_fn


def preact_resnet(channels: int, blocks: int, classes: int = 10) -> HighwayNet:
    """Pre-activation ResNet for 1x8x8 digits: conv stem -> ``blocks`` PreActBlocks ->
    BN-ReLU-average pool-linear head (K = I in every block, eq. 14)."""
    head = nn.Sequential(
        nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(channels, classes),
    )  # fmt: skip
    stem = nn.Conv2d(1, channels, 3, padding=1, bias=False)
    return HighwayNet(stem, [ResidualStack([PreActBlock(channels) for _ in range(blocks)])], head)


# --- highway-rnn -----------------------------------------------------------------------


def _step_fn(
    eng: Any, model: nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[..., Any]
) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        eng.backward(model, inputs, loss_fn)

    return step


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


@runner(threads=True)
def run_rnn(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Time, memory and gradient quality of highway (each k) vs BPTT vs nn.GRU/nn.LSTM.

    Steps are timed at every count of ``settings.threads`` side by side (default one
    thread): the record's time fields are the first count's, ``by_threads`` has every
    count's (with ``step_speedup`` and ``backward_speedup`` at that count)."""
    quick, device = settings.quick, settings.device
    threads = settings.threads or [1]
    repeats = int(suite.setting("repeats", quick, 5))
    batch = int(suite.setting("batch", quick, 32))
    hidden = int(suite.setting("hidden", quick, 128))
    vocab = int(suite.setting("vocab", quick, 64))
    ks = [int(k) for k in suite.setting("ks", quick, [0, 1, 2, 5, 10])]
    seed = int(suite.setting("seed", quick, 0))
    jobs = suite.jobs(quick)
    records: list[dict[str, Any]] = []
    bar = tqdm(jobs, desc=suite.name, disable=not settings.progress)
    for series, length in bar:
        cell = series.config.get("cell", "gru")
        bar.set_description(f"{suite.name} {cell} L={length}")
        torch.manual_seed(seed)
        net = char_lm(cell, vocab, hidden).to(device)
        tokens = torch.randint(0, vocab, (length, batch), device=device)
        loss_fn = _lm_loss(torch.randint(0, vocab, (length, batch), device=device), vocab)
        inputs = (tokens,)
        torch_lm = _TorchLM(net, cell).to(device)
        methods: dict[str, tuple[Any, nn.Module, int | None]] = {
            "bptt": (make_engine("backprop"), net, None),
            f"nn.{cell.upper()}": (make_engine("backprop"), torch_lm, None),
        }
        for k_iter in ks:
            methods[f"highway(k={k_iter})"] = (make_engine("highway", k=k_iter), net, k_iter)
        methods["fpi(k=2)"] = (make_engine("highway", k=2, baseline="fpi"), net, 2)
        fns = {lb: _step_fn(e, m, inputs, loss_fn) for lb, (e, m, _) in methods.items()}
        fns["forward:bptt"] = _forward_fn(net, inputs, loss_fn, traced=False)
        fns["forward:highway"] = _forward_fn(net, inputs, loss_fn, traced=True)
        fns["forward:nn"] = _forward_fn(torch_lm, inputs, loss_fn, traced=False)
        timings = time_across_threads(fns, threads=threads, repeats=repeats, warmup=1,
                                      reference="bptt")  # fmt: skip
        times = timings[threads[0]]
        ref = grads_of_engine(make_engine("backprop"), copy.deepcopy(net).double(), inputs,
                              loss_fn)  # fmt: skip
        for label, (eng, model, k) in methods.items():
            fwd_key = ("forward:nn" if model is torch_lm
                       else "forward:highway" if k is not None else "forward:bptt")  # fmt: skip
            speed = [_speedups(ts, label, fwd_key) for ts in timings.values()]
            model.zero_grad(set_to_none=True)
            with num_threads(threads[0]), MemoryTracker(baseline=(model, tokens)) as tracker:
                eng.backward(model, inputs, loss_fn)
            got = _torch_lm_grads(torch_lm) if model is torch_lm else grads_of(model)
            cmp = compare_grads(got, ref)
            records.append(_base(
                suite, "highway-rnn", quick, series=series.name, engine=label,
                config={"cell": cell, "length": length, "batch": batch, "hidden": hidden,
                        "vocab": vocab, "dtype": "float32", "threads": threads[0]},
                x=length, k=k, peak_bytes=tracker.report.peak_bytes, threads=threads[0],
                **timing_fields(times[label]), **speed[0],
                by_threads=[{**t, **sp} for t, sp in zip(by_threads(timings, label), speed,
                                                         strict=True)],
                grad_max_rel_err=cmp.max_rel_err, grad_cosine=cmp.cosine,
            ))  # fmt: skip
        records += _scan_records(suite, quick, length, batch, hidden, device, threads[0])
    return records


def _speedups(times: dict[str, Any], label: str, fwd_key: str) -> dict[str, Any]:
    """A highway-rnn row's forward and backward seconds and its speedups over BPTT."""
    bwd = times[label].median - times[fwd_key].median
    bptt_bwd = times["bptt"].median - times["forward:bptt"].median
    return {"forward_seconds": times[fwd_key].median, "backward_seconds": bwd,
            "step_speedup": times["bptt"].median / times[label].median,
            "backward_speedup": bptt_bwd / bwd if bwd > 0 else None}  # fmt: skip


def grads_of_engine(
    eng: Any, model: nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[..., Any]
) -> dict[str, torch.Tensor]:
    """``grads_of(model)`` after one ``eng.backward`` (``.grad`` cleared first)."""
    model.zero_grad(set_to_none=True)
    eng.backward(model, inputs, loss_fn)
    return grads_of(model)


def _torch_lm_grads(m: _TorchLM) -> dict[str, torch.Tensor]:
    """The nn.GRU/nn.LSTM model's gradients under the HighwayNet's parameter names."""
    g = grads_of(m)
    out = {k.replace("rnn.", "stacks.0.").replace("_l0", ""): v for k, v in g.items()}
    return out


def _scan_records(suite: Suite, quick: bool, length: int, batch: int, hidden: int,
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
        for name, tm in t.items():
            out.append(_base(
                suite, "scan", quick, series=f"scan-{state[0]}x{state[1]}", engine=name,
                config={"length": length, "state": list(state), "threads": threads}, x=length,
                seconds_median=tm.median, time_ratio=tm.ratio,
            ))  # fmt: skip
    return out


# --- highway-train ---------------------------------------------------------------------


def _task(config: dict[str, Any], value: int, seed: int, device: str) -> dict[str, Any]:
    """Model, batch stream, loss and evaluation of one training series."""
    torch.manual_seed(seed)
    if config["model"] == "char-lm":
        ids, vocab = char_corpus(int(config.get("corpus_chars", 400_000)))
        ids = ids.to(device)
        cut = int(0.9 * len(ids))
        model = char_lm(config.get("cell", "gru"), vocab, int(config.get("hidden", 128)),
                        int(config.get("layers", 1))).to(device)  # fmt: skip
        batch = int(config.get("batch", 32))
        stream = _lm_batches(ids[:cut], value, batch, seed)
        held = [b for _, b in zip(range(4), _lm_batches(ids[cut:], value, batch, seed + 1),
                                  strict=False)]  # fmt: skip

        def batches() -> Iterator[tuple[tuple[Any, ...], Callable[..., Any]]]:
            for x, y in stream:
                yield (x,), _lm_loss(y, vocab)

        @torch.no_grad()
        def evaluate(m: nn.Module) -> dict[str, float]:
            losses = [float(_lm_loss(y, vocab)(m(x))) for x, y in held]
            return {"val_loss": sum(losses) / len(losses)}

        return {"model": model, "batches": batches(), "evaluate": evaluate, "opt": "adam"}
    if config["model"] == "preact-resnet":
        train, test = data.digits(device=device).split(0.8, seed=seed)
        model = preact_resnet(int(config.get("channels", 16)), value).to(device)
        batch = int(config.get("batch", 64))

        def batches() -> Iterator[tuple[tuple[Any, ...], Callable[..., Any]]]:
            epoch = 0
            while True:
                for x, y in train.batches(batch, shuffle=True, seed=seed + epoch, drop_last=True):
                    yield (x,), (lambda out, y=y: F.cross_entropy(out, y))
                epoch += 1

        @torch.no_grad()
        def evaluate(m: nn.Module) -> dict[str, float]:
            was = m.training
            m.eval()
            out = m(test.x)
            m.train(was)
            return {"val_loss": float(F.cross_entropy(out, test.y)),
                    "test_acc": float((out.argmax(1) == test.y).float().mean())}  # fmt: skip

        return {"model": model, "batches": batches(), "evaluate": evaluate, "opt": "sgd"}
    raise ValueError(f"unknown highway training model {config['model']!r}")


@dataclasses.dataclass
class _HighwayTrain(Curves):
    """highway-train: round 0 measures the initialisation, round r trains step r - 1.

    A lane whose loss is not finite stops without a record (the curve just ends).
    """

    suite: Suite
    quick: bool
    series: str
    config: dict[str, Any]
    steps: int
    every: int
    evaluate: Callable[[nn.Module], dict[str, float]]
    bar: Any
    makers: dict[str, Callable[[int], Any]]
    losses: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    failure_records: bool = False

    def record(self, lane: Lane, r: int) -> dict[str, Any]:
        return _base(self.suite, "highway-train", self.quick, series=self.series,
                     engine=lane.label, config=self.config)  # fmt: skip

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
        return {"x": r, "wall_seconds": lane.seconds,
                "train_loss": sum(losses) / len(losses) if losses else None,
                **self.evaluate(lane.model)}  # fmt: skip

    def end_round(self, lanes: Sequence[Lane], r: int) -> None:
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


def run_train(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train one model per method from the same initialisation on the same batches."""
    quick = settings.quick
    steps = int(suite.setting("steps", quick, 200))
    every = int(suite.setting("eval_every", quick, 20))
    seed = int(suite.setting("seed", quick, 0))
    schedule = suite.setting("schedule", quick, None)
    jobs = suite.jobs(quick)
    records: list[dict[str, Any]] = []
    with num_threads(1):
        for series, value in jobs:
            task = _task(series.config, int(value), seed, settings.device)
            lr = float(series.config.get("lr", 1e-3))
            makers = _train_methods(suite, series, schedule, steps)
            lanes = same_start(task["model"], makers, task["opt"], lr)
            config = {**series.config, suite.sweep: value, "steps": steps, "lr": lr, "threads": 1}
            bar = tqdm(total=steps + 1, desc=f"{suite.name} {series.name}",
                       disable=not settings.progress)  # fmt: skip
            curves = _HighwayTrain(suite, quick, series.name, config, steps, every,
                                   task["evaluate"], bar, makers)  # fmt: skip
            rounds = zip(range(1, steps + 1), task["batches"], strict=False)
            records += train_side_by_side(lanes, itertools.chain([(0, None)], rounds), curves)
            bar.close()
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
    jobs = suite.jobs(quick)
    records: list[dict[str, Any]] = []
    with num_threads(1):
        for series, value in jobs:
            task = _task(series.config, int(value), seed, settings.device)
            model = task["model"]
            opt = make_optimizer(
                task["opt"], model.parameters(), float(series.config.get("lr", 1e-3))
            )
            bp = make_engine("backprop")
            bar = tqdm(range(steps + 1), desc=f"{suite.name} {series.name}",
                       disable=not settings.progress)  # fmt: skip
            for step, (inputs, loss_fn) in zip(bar, task["batches"], strict=False):
                if step in at:
                    for baseline in ("highway", "fpi"):
                        probe = copy.deepcopy(model)  # BatchNorm statistics untouched
                        pts = convergence(probe, inputs, loss_fn, ks=ks, baseline=baseline)
                        records += [_base(
                            suite, "highway-convergence", quick, series=series.name,
                            engine=baseline, config={**series.config, suite.sweep: value,
                                                     "steps": steps},
                            x=step, k=p.k, grad_cosine=p.cosine, grad_max_rel_err=p.rel_err,
                            step_share=p.step_share, fraction=step / steps,
                        ) for p in pts]  # fmt: skip
                if step == steps:
                    break
                bp.backward(model, inputs, loss_fn)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return records
