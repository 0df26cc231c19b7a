"""Highway-BP training a GPT-2-style character transformer (issue 29; paper Table 2,
Fig. 3 "GPT-2" validation loss, Fig. 6c gradient cosine, Appendix C.3 eq. 17-23).

- :func:`gpt_char_lm` — the model as a :class:`~leangrad.highway.HighwayNet`: token +
  learned position embedding -> ``2 · layers`` residual sublayers (attention, MLP, …) ->
  final LayerNorm + linear head. Pre-LN (GPT-2, eq. 17) or post-LN (RoBERTa, eq. 23).
- :func:`run_transformer` (suite ``highway-transformer``) — trains it on the Python
  standard library's own ``.py`` sources (:func:`~leangrad.bench._highway.char_corpus`)
  with backprop, FPI and highway at several k plus a k schedule, from the same
  initialisation on the same batches (:func:`~leangrad.bench._side_by_side.train_side_by_side`);
  validation loss against step and training wall time, and at every evaluation the
  cosine between each method's gradient and backprop's at the same weights; then each
  method's step time over backprop's at every thread count (interleaved medians).
- :func:`render` — its section of ``leangrad report``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._errors import LeangradError, OptionError
from ..highway import HighwayNet, PostLNSublayer, PreLNSublayer, ResidualStack
from ..measure import compare_grads, grads_of, num_threads, time_across_threads
from ._highway import (
    _base,
    _HighwayTrain,
    _lm_batches,
    _lm_loss,
    _step_fn,
    _train_methods,
    char_corpus,
)
from ._report import at_threads, extra_threads, pyplot, save_figure
from ._runner import by_threads, timing_fields
from ._side_by_side import Lane, same_start, train_side_by_side
from ._suites import RunSettings, Series, Suite, runner

__all__ = ["BAD_NORM", "PAPER_GAMMA", "gpt_char_lm", "render", "run_transformer"]

BAD_NORM = (
    "gpt_char_lm: norm must be 'pre' (GPT-2, LayerNorm before each sublayer, eq. 17) or "
    "'post' (RoBERTa, LayerNorm after each residual add, eq. 23), got {value!r}"
)
PAPER_GAMMA = {"pre": 0.2, "post": 0.8}
"""The γ of the residual split the paper used (Appendix C.3): 0.2 for GPT-2 (eq. 17),
0.8 for RoBERTa (eq. 23)."""

KIND = "highway-transformer"
STEP_KIND = "highway-transformer-step"


# --- model -----------------------------------------------------------------------------


class TokenPositionEmbedding(nn.Module):
    """GPT-2's stem: ``wte[tokens] + wpe[positions]`` for batch-first token ids
    ``(batch, tokens)`` -> ``(batch, tokens, d_model)``; both tables ~ N(0, 0.02²)."""

    def __init__(self, vocab: int, d_model: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[-1], device=ids.device)
        return self.tokens(ids) + self.positions(pos)


def gpt_char_lm(
    vocab: int,
    *,
    d_model: int = 64,
    layers: int = 4,
    heads: int = 2,
    context: int = 64,
    norm: str = "pre",
    gamma: float | None = None,
) -> HighwayNet:
    """A GPT-2-style character LM written for the highway engine.

    Each of the ``layers`` transformer layers is split into its two sublayers — causal
    self-attention, then a GELU MLP (4·d_model) — each with its own residual, so the
    :class:`~leangrad.highway.ResidualStack` has ``L = 2 · layers`` blocks (the paper's
    L = 24 for 12 layers, section 5.1.1). Residual decomposition (Appendix C.3):

    - ``norm="pre"`` (GPT-2): :class:`~leangrad.highway.PreLNSublayer`,
      ``f(x) = x + Layer(LN(x))`` split as ``g(x) = Layer(LN(x)) + γx``,
      ``r(x, z) = (1 − γ)x + z`` (eq. 17), so ``K = (1 − γ)I`` (scalar); the head is the
      final LayerNorm + a linear layer.
    - ``norm="post"`` (RoBERTa): :class:`~leangrad.highway.PostLNSublayer`,
      ``f(x) = LN(x + Layer(x)) = x ⊙ a(x) + b(x)`` split as ``g = [(1−γ)a, b + γ x⊙a]``,
      ``r(x, z) = x ⊙ z1 + z2`` (eq. 23), so ``K = diag((1 − γ)a)``; every sublayer ends
      in its own LayerNorm, so the head is the linear layer alone.

    The forward value does not depend on γ (backprop's gradient neither); γ only moves
    part of the identity path into ``g``, which Highway-BP's k iterations then have to
    recover: γ = 0 is the plain split (eq. 16, which the paper found to diverge on
    GPT-2), γ = 1 the fixed-point-iteration baseline. ``gamma=None`` takes the paper's
    (:data:`PAPER_GAMMA`: 0.2 pre-LN, 0.8 post-LN).

    Args:
        vocab: characters; d_model: width; layers: transformer layers (2 blocks each);
        heads: attention heads; context: longest sequence (position table size).
        norm: ``"pre"`` or ``"post"``; gamma: the split's γ in [0, 1].

    Inputs are batch-first token ids ``(batch, tokens)``; the output is the logits
    ``(batch, tokens, vocab)``.

    Raises:
        OptionError: ``norm`` is neither ``"pre"`` nor ``"post"``.
    """
    if norm not in PAPER_GAMMA:
        raise OptionError(BAD_NORM.format(value=norm))
    g = PAPER_GAMMA[norm] if gamma is None else gamma
    cls = PreLNSublayer if norm == "pre" else PostLNSublayer
    blocks = [cls(d_model, heads, kind=kind, gamma=g)
              for _ in range(layers) for kind in ("attention", "mlp")]  # fmt: skip
    head: nn.Module = (
        nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, vocab)) if norm == "pre"
        else nn.Linear(d_model, vocab)
    )  # fmt: skip
    stem = TokenPositionEmbedding(vocab, d_model, context)
    return HighwayNet(stem, [ResidualStack(blocks)], head)


# --- the suite -------------------------------------------------------------------------

Batch = tuple[tuple[torch.Tensor, ...], Callable[[torch.Tensor], torch.Tensor]]


def _windows(ids: torch.Tensor, vocab: int, length: int, batch: int, seed: int
             ) -> Iterator[Batch]:  # fmt: skip
    """Random batch-first windows of ``ids`` and their next-character loss, forever."""
    for x, y in _lm_batches(ids, length, batch, seed):  # time-major (length, batch)
        yield (x.t().contiguous(),), _lm_loss(y.t().contiguous(), vocab)


@dataclasses.dataclass
class _Task:
    """One series' model, training batches, held-out evaluation, the batch gradients are
    compared on (``probe``) and the batch steps are timed on (``inputs``, ``loss_fn``)."""

    model: HighwayNet
    batches: Iterator[Batch]
    evaluate: Callable[[nn.Module], dict[str, float]]
    probe: Batch
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[torch.Tensor], torch.Tensor]


def _task(config: dict[str, Any], layers: int, seed: int, device: str) -> _Task:
    """Model, training stream (first 90% of the corpus), held-out loss (last 10%), and a
    fixed training batch on which gradients are compared."""
    ids, vocab = char_corpus(int(config.get("corpus_chars", 400_000)))
    ids = ids.to(device)
    cut = int(0.9 * len(ids))
    train, held = ids[:cut], ids[cut:]
    length, batch = int(config.get("context", 64)), int(config.get("batch", 16))
    torch.manual_seed(seed)
    model = gpt_char_lm(
        vocab, d_model=int(config.get("d_model", 64)), layers=layers,
        heads=int(config.get("heads", 2)), context=length, norm=str(config.get("norm", "pre")),
        gamma=config.get("gamma"),
    ).to(device)  # fmt: skip
    evals = int(config.get("eval_batches", 8))
    val = list(itertools.islice(_windows(held, vocab, length, batch, seed + 1), evals))

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        losses = [float(loss_fn(m(*inputs))) for inputs, loss_fn in val]
        return {"val_loss": sum(losses) / len(losses)}

    probe = next(_windows(train, vocab, length, batch, seed + 2))
    return _Task(model, _windows(train, vocab, length, batch, seed), evaluate, probe, *probe)


@dataclasses.dataclass
class _Curves(_HighwayTrain):
    """highway-train's rounds (round 0 = the initialisation), plus at every evaluation the
    cosine between the lane's gradient and backprop's at the lane's weights, on a fixed
    training batch (``probe``); evaluation and the cosine are not training time."""

    probe: Batch | None = None
    exact: str = "backprop"

    def record(self, lane: Lane, r: int) -> dict[str, Any]:
        return _base(self.suite, KIND, self.quick, series=self.series, engine=lane.label,
                     config=self.config)  # fmt: skip

    def measure(self, lane: Lane, r: int, batch: Any, out: Any) -> dict[str, Any] | None:
        fields = super().measure(lane, r, batch, out)
        if fields is None or lane.label == self.exact or self.probe is None:
            return fields
        inputs, loss_fn = self.probe
        got = _grads(self.makers[lane.label](r), lane.model, inputs, loss_fn)
        ref = _grads(self.makers[self.exact](r), lane.model, inputs, loss_fn)
        cmp = compare_grads(got, ref)
        return {**fields, "grad_cosine": cmp.cosine, "grad_max_rel_err": cmp.max_rel_err}


def _grads(eng: Any, model: nn.Module, inputs: Any, loss_fn: Any) -> dict[str, torch.Tensor]:
    """One ``eng.backward``'s gradients, leaving ``.grad`` cleared (as training does)."""
    model.zero_grad(set_to_none=True)
    eng.backward(model, inputs, loss_fn)
    out = grads_of(model)
    model.zero_grad(set_to_none=True)
    return out


def _step_records(
    suite: Suite, quick: bool, series: Series, config: dict[str, Any], task: _Task,
    threads: list[int],
) -> list[dict[str, Any]]:  # fmt: skip
    """One gradient step (forward + gradients; optimizer excluded) of every fixed-k method
    at the initial weights on one batch, timed interleaved at every thread count after
    warm-up (medians); ratios divide by the suite reference's median at the same count.
    The k schedule is not timed: its step costs what the k of the moment costs."""
    model = copy.deepcopy(task.model)
    fns = {spec.display: _step_fn(spec.make(), model, task.inputs, task.loss_fn)
           for spec in suite.engines_for(series)}  # fmt: skip
    timings = time_across_threads(
        fns, threads=threads, repeats=int(suite.setting("repeats", quick, 7)),
        warmup=int(suite.setting("warmup", quick, 2)), reference=suite.reference,
    )  # fmt: skip
    first = timings[threads[0]]
    return [_base(suite, STEP_KIND, quick, series=series.name, engine=label,
                  config={**config, "threads": threads[0]}, threads=threads[0],
                  **timing_fields(first[label]), by_threads=by_threads(timings, label),
                  timed="one forward + gradient step at the initial weights, optimizer "
                        "excluded; medians of interleaved repeats after warm-up")
            for label in fns]  # fmt: skip


@runner(threads=True)
def run_transformer(suite: Suite, settings: RunSettings) -> list[dict[str, Any]]:
    """Train the transformer once per method from the same initialisation on the same
    batches (one torch thread, float32, Adam), then time each method's step.

    Records: ``kind = "highway-transformer"`` per method and evaluation (``x`` = steps
    trained, ``wall_seconds`` = training time so far, ``val_loss`` = held-out loss,
    ``train_loss`` = mean training loss since the last evaluation, ``grad_cosine`` /
    ``grad_max_rel_err`` against backprop at the same weights, ``None`` for backprop), and
    ``kind = "highway-transformer-step"`` per fixed-k method (step time ``time_ratio``
    over backprop's at ``threads[0]``, every count in ``by_threads``).
    """
    from tqdm.auto import tqdm

    quick = settings.quick
    threads = settings.threads or [1]
    steps = int(suite.setting("steps", quick, 400))
    every = int(suite.setting("eval_every", quick, 25))
    seed = int(suite.setting("seed", quick, 0))
    schedule = suite.setting("schedule", quick, None)
    paper_k = suite.setting("paper_k", quick, None)
    jobs = suite.jobs(quick)
    records: list[dict[str, Any]] = []
    for series, layers in jobs:
        task = _task(series.config, int(layers), seed, settings.device)
        lr = float(series.config.get("lr", 1e-3))
        makers = _train_methods(suite, series, schedule, steps)
        lanes = same_start(task.model, makers, "adam", lr)
        config = {**series.config, suite.sweep: layers, "blocks": 2 * int(layers),
                  "steps": steps, "lr": lr, "optimizer": "adam", "threads": 1,
                  "paper_k": paper_k, "schedule": schedule,
                  "gamma": next(m.gamma for m in task.model.modules()
                                if isinstance(m, PreLNSublayer | PostLNSublayer))}  # fmt: skip
        bar = tqdm(total=steps + 1, desc=f"{suite.name} {series.name}",
                   disable=not settings.progress)  # fmt: skip
        curves = _Curves(suite, quick, series.name, config, steps, every, task.evaluate, bar,
                         makers, probe=task.probe, exact=suite.reference)  # fmt: skip
        with num_threads(1):
            rounds = zip(range(1, steps + 1), task.batches, strict=False)
            records += train_side_by_side(lanes, itertools.chain([(0, None)], rounds), curves)
        bar.close()
        records += _step_records(suite, quick, series, config, task, threads)
    return records


# --- report ----------------------------------------------------------------------------

TOLERANCE = 0.02
"""The issue's test: highway at the paper's k ends within 2% of backprop's final
validation loss."""


def _f(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _final(rs: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    mine = [r for r in rs if r["engine"] == label and r.get("val_loss") is not None]
    return max(mine, key=lambda r: r["x"]) if mine else None


def _verdict(rs: list[dict[str, Any]], reference: str) -> tuple[str, str | None]:
    """A sentence for the report on highway at the paper's k, and that lane's label."""
    k = rs[0]["config"].get("paper_k")
    label = f"highway(k={k})"
    bp, hw = _final(rs, reference), _final(rs, label)
    if k is None or bp is None or hw is None:
        return f"No run of highway at the paper's k ({label}) to compare with {reference}.", None
    rel = hw["val_loss"] / bp["val_loss"] - 1
    word = "within" if abs(rel) <= TOLERANCE else "NOT within"
    return (
        f"**{label} (the paper's k) is {word} {TOLERANCE:.0%} of {reference}'s final "
        f"validation loss**: {hw['val_loss']:.4f} vs {bp['val_loss']:.4f} after {bp['x']} "
        f"steps ({rel:+.2%})."
    ), label


def _titles(rs: list[dict[str, Any]], label: str | None, reference: str) -> dict[str, str]:
    """One message per plot, read from the records (about the paper's k when it ran)."""
    titles = {"loss": "validation loss against training step",
              "time": "validation loss against training time",
              "cosine": f"gradient cosine to {reference} at the same weights"}  # fmt: skip
    bp, hw = _final(rs, reference), None if label is None else _final(rs, label)
    if label is None or bp is None or hw is None:
        return titles
    rel = hw["val_loss"] / bp["val_loss"] - 1
    titles["loss"] = f"{label} ends {rel:+.1%} from {reference}'s validation loss"
    if bp.get("wall_seconds") and hw.get("wall_seconds") is not None:
        titles["time"] = (f"{label} takes {hw['wall_seconds'] / bp['wall_seconds']:.1f}x "
                          f"{reference}'s training time")  # fmt: skip
    cos = [r["grad_cosine"] for r in rs if r["engine"] == label and r.get("grad_cosine")]
    if cos:
        titles["cosine"] = f"{label}'s gradient keeps cosine >= {min(cos):.3f} to {reference}"
    return titles


def _plot(path: Path, rs: list[dict[str, Any]], x: str, y: str, labels: tuple[str, str],
          title: str) -> bool:  # fmt: skip
    try:
        plt = pyplot()
    except ImportError:
        return False
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, label in enumerate(dict.fromkeys(r["engine"] for r in rs)):  # one colour a method
        pts = [(r[x], r[y]) for r in rs if r["engine"] == label and r.get(y) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=label,
                    color=colors[i % len(colors)])  # fmt: skip
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(textwrap.fill(title, 72), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


def _plots(suite: str, series: str, rs: list[dict[str, Any]], directory: Any,
           titles: dict[str, str]) -> list[str]:  # fmt: skip
    what = f"{series} ({rs[0]['config'].get('blocks')} sublayers)"
    loss = "validation loss (nats/char)"
    panels = [
        ("loss", "x", "val_loss", ("training step", loss)),
        ("time", "wall_seconds", "val_loss",
         ("training wall time (s, 1 thread; evaluation excluded)", loss)),
        ("cosine", "x", "grad_cosine", ("training step", "cosine to backprop's gradient")),
    ]  # fmt: skip
    out = []
    for tag, x, y, axes in panels:
        png = Path("plots") / f"{suite}-{series}-{tag}.png"
        if _plot(Path(directory) / png, rs, x, y, axes, f"{what}: {titles[tag]}"):
            out.append(f"![{series} {tag}]({png.as_posix()})")
    return [*out, ""] if out else []


def _table(rs: list[dict[str, Any]], steps: list[dict[str, Any]],
           reference: str) -> list[str]:  # fmt: skip
    counts = [steps[0]["threads"], *extra_threads(steps)] if steps else []
    bp = _final(rs, reference)
    lines = [
        "| method | steps | final val loss | vs " + reference + " | final grad cosine "
        + "".join(f"| step time ratio ({n} thr) " for n in counts) + "| training s |",
        "|---|---|---|---|---|" + "---|" * len(counts) + "---|",
    ]
    for label in dict.fromkeys(r["engine"] for r in rs):
        last = _final(rs, label)
        if last is None:
            continue
        rel = None if bp is None else 100 * (last["val_loss"] / bp["val_loss"] - 1)
        step = next((s for s in steps if s["engine"] == label), None)
        ratios = [None if step is None else at_threads(step, n, "time_ratio") for n in counts]
        lines.append(
            f"| {label} | {last['x']} "
            f"| {last['val_loss']:.4f} | {_f(rel, '+.2f')}% "
            f"| {_f(last.get('grad_cosine'), '.4f')} "
            + "".join(f"| {_f(v, '.2f')} " for v in ratios)
            + f"| {_f(last.get('wall_seconds'), '.1f')} |"
        )
    return [*lines, ""]


def render(suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool) -> list[str]:
    """Markdown for ``highway-transformer``: per series, the verdict on the paper's k,
    plots of validation loss against step and wall time and of the gradient cosine, and
    the table of final losses and step time ratios."""
    from ._suites import load_suite

    try:
        reference = load_suite(suite).reference
    except LeangradError:  # a renamed or foreign suite file: the shipped default
        reference = "backprop"
    curves = [r for r in records if r.get("kind") == KIND]
    steps = [r for r in records if r.get("kind") == STEP_KIND]
    lines = [
        "Validation loss = mean cross-entropy on held-out windows (last 10% of the corpus). "
        "Training at one torch thread, float32, all methods from the same initialisation "
        "on the same batches; wall time = training steps only. Gradient cosine: each "
        f"method's gradient vs {reference}'s at the method's own weights, on one fixed "
        "training batch, at every evaluation. Step time ratio: one forward + gradient step "
        f"over {reference}'s, medians of interleaved repeats after warm-up, at each thread "
        "count (the k schedule has no fixed step time).",
        "",
    ]
    for series in dict.fromkeys(r["series"] for r in curves):
        rs = [r for r in curves if r["series"] == series]
        ss = [r for r in steps if r["series"] == series]
        cfg = rs[0]["config"]
        sentence, label = _verdict(rs, reference)
        lines += [
            f"### {series}",
            "",
            f"{cfg.get('norm', 'pre')}-LN, {cfg.get('layers')} layers = {cfg.get('blocks')} "
            f"sublayers, d_model {cfg.get('d_model')}, context {cfg.get('context')}, batch "
            f"{cfg.get('batch')}, γ = {cfg.get('gamma')}, lr {cfg.get('lr')}. The paper's k "
            f"= {cfg.get('paper_k')}: its text gives no GPT-2 number (Figs. 2d, 3 are plots), "
            "so the suite's `paper_k` setting takes the one k it names as matching backprop "
            "(ResNet110, k = 4 at L = 54).",
            "",
            sentence,
            "",
        ]
        if plots:
            lines += _plots(suite, series, rs, directory, _titles(rs, label, reference))
        lines += _table(rs, ss, reference)
    return lines
