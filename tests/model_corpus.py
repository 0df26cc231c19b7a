"""Models people download, built offline from the libraries' own registries with random
weights moved off their initialisation, and every engine held to autograd on them.

Why off the initialisation: timm zero-initialises the last BatchNorm's γ of a residual
block and starts ConvNeXt's layer scale at 1e-6, which makes block-internal gradients 0 and
*hides* a wrong one. :func:`perturb` puts norm weights in U(0.5, 1.5), biases and norm
shifts in N(0, 0.1), layer scales in U(0.1, 1) and running variances in U(0.5, 1.5) — the
state of a model after some training.

:func:`check` runs one engine on one model beside ``loss.backward()`` from the same RNG
state and says, per engine, ``exact`` (gradients within tolerance, the same ``.grad`` left
None, buffers such as BatchNorm's running statistics equal, the global RNG where autograd's
step leaves it), ``refused: <reason>`` (a :class:`~leangrad.LeangradError`), or what went
wrong (``WRONG ...``, ``CRASH ...``): the last two are defects.

``python tests/model_corpus.py [--all] [--out results/model-corpus]`` writes the table;
``--plans`` plans a few of the models at 1/2 and 1/4 of backprop's peak instead (with
``--all``: every model, at its corpus image size; ``--resume`` keeps the rows already in
the output and plans the rest); ``--zoo-rows`` measures the zoo suite's
timm models at full size beside timm's own checkpointing (:func:`zoo_rows`).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad._errors import LeangradError
from leangrad.loss import per_example

Build = Callable[[], nn.Module]

ENGINES: dict[str, Callable[[], leangrad.Engine]] = {
    "checkpoint": lambda: leangrad.engine("checkpoint"),
    "checkpoint(fragments=2)": lambda: leangrad.engine("checkpoint", fragments=2),
    "accumulate(2)": lambda: leangrad.engine("accumulate", micro_batches=2),
    "checkpoint+accumulate(2)": lambda: leangrad.engine(
        "checkpoint+accumulate", micro_batches=2),
    "rad(fraction=1)": lambda: leangrad.engine("rad", fraction=1.0),
}
"""The engines each model is held to (``rad`` at fraction 1 keeps everything: exact)."""

TOL = {torch.float64: 1e-9, torch.float32: 2e-3}
FLOOR = {torch.float64: 1e-6, torch.float32: 1e-4}
"""A parameter whose gradient is below ``FLOOR`` of the model's largest is compared on
that scale: its own relative error would be rounding noise (a BatchNorm shift followed by
another training-mode BatchNorm has a true gradient of 0, computed as ~1e-18 in float64
and ~1e-9 in float32). The plan's own re-check uses the same (``leangrad.planner._verify``)."""


def vision_available() -> bool:
    return (importlib.util.find_spec("timm") is not None
            and importlib.util.find_spec("torchvision") is not None)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Entry:
    """One corpus model: how to build it, its image size, and whether the fast slice that
    ``make test`` runs holds it."""

    name: str
    build: Build
    image: int = 32
    fast: bool = False


def _timm(name: str, **kw: Any) -> Build:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=5, **kw)

    return build


def _tv(name: str, **kw: Any) -> Build:
    def build() -> nn.Module:
        import torchvision.models as tvm

        return getattr(tvm, name)(weights=None, num_classes=5, **kw)

    return build


DP = {"drop_path_rate": 0.1}
CORPUS: tuple[Entry, ...] = (
    # timm: convolutional
    Entry("timm/resnet18", _timm("resnet18"), fast=True),
    Entry("timm/resnet26d", _timm("resnet26d", drop_path_rate=0.1)),
    Entry("timm/resnetv2_50", _timm("resnetv2_50")),
    Entry("timm/efficientnet_b0", _timm("efficientnet_b0", **DP), fast=True),
    Entry("timm/mobilenetv3_small_050", _timm("mobilenetv3_small_050")),
    Entry("timm/regnety_002", _timm("regnety_002")),
    Entry("timm/convnext_atto", _timm("convnext_atto", **DP), fast=True),
    Entry("timm/ese_vovnet19b_slim", _timm("ese_vovnet19b_slim")),
    Entry("timm/ghostnet_050", _timm("ghostnet_050")),
    Entry("timm/cspresnet50", _timm("cspresnet50")),
    Entry("timm/dla46_c", _timm("dla46_c")),
    Entry("timm/repvgg_a0", _timm("repvgg_a0")),
    Entry("timm/rexnet_100", _timm("rexnet_100")),
    Entry("timm/lcnet_050", _timm("lcnet_050")),
    Entry("timm/nf_resnet26", _timm("nf_resnet26")),
    # timm: attention, MLP and hybrid
    Entry("timm/vit_tiny", _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, **DP),
          fast=True),
    Entry("timm/deit_tiny", _timm("deit_tiny_patch16_224", img_size=32, patch_size=8, **DP)),
    Entry("timm/swin_tiny", _timm(
        "swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=24,
        depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), **DP), image=64, fast=True),
    Entry("timm/maxvit_pico", _timm("maxvit_pico_rw_256", img_size=64, **DP), image=64),
    Entry("timm/coatnet_nano", _timm("coatnet_nano_rw_224", img_size=64, **DP), image=64),
    Entry("timm/mixer_s16", _timm("mixer_s16_224", img_size=32, **DP)),
    Entry("timm/poolformer_s12", _timm("poolformer_s12", **DP)),
    Entry("timm/edgenext_xx_small", _timm("edgenext_xx_small", **DP), image=64),
    Entry("timm/mobilevit_xxs", _timm("mobilevit_xxs"), image=64),
    Entry("timm/pvt_v2_b0", _timm("pvt_v2_b0", **DP), image=64),
    # torchvision
    Entry("tv/resnet18", _tv("resnet18"), fast=True),
    Entry("tv/efficientnet_b0", _tv("efficientnet_b0", stochastic_depth_prob=0.1)),
    Entry("tv/mobilenet_v3_small", _tv("mobilenet_v3_small")),
    Entry("tv/convnext_tiny", _tv("convnext_tiny", stochastic_depth_prob=0.1)),
    Entry("tv/regnet_y_400mf", _tv("regnet_y_400mf")),
    Entry("tv/shufflenet_v2_x0_5", _tv("shufflenet_v2_x0_5")),
    Entry("tv/squeezenet1_1", _tv("squeezenet1_1"), image=64),
    Entry("tv/swin_t", _tv("swin_t"), image=64),
)


def perturb(model: nn.Module, seed: int = 1) -> nn.Module:
    """Weights off their initial symmetries (module docstring), in place; returns it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "gamma" in leaf or leaf in ("ls", "scale", "layer_scale"):
                p.copy_(torch.rand(p.shape, generator=gen) * 0.9 + 0.1)
            elif p.dim() == 1 and leaf == "weight":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def model_and_batch(entry: Entry, dtype: torch.dtype = torch.float64,
                    batch: int = 4) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:  # fmt: skip
    torch.manual_seed(0)
    model = perturb(entry.build()).to(dtype).train()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, 3, entry.image, entry.image, generator=gen).to(dtype)
    y = torch.randint(0, 5, (batch,), generator=gen)
    return model, x, y


@dataclasses.dataclass
class _Step:
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    rng: torch.Tensor
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
          engine: leangrad.Engine | None) -> _Step:  # fmt: skip
    return engine_step(model, x, per_example(lambda out, t: F.cross_entropy(out, t), y), engine)


def engine_step(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor],
                engine: leangrad.Engine | None, *,
                autograd: Callable[[nn.Module], torch.Tensor] | None = None) -> _Step:  # fmt: skip
    """One step on a deep copy of ``model`` from RNG seed 11: ``engine``'s, or (``engine``
    None) autograd's ``backward()`` of ``autograd(copy)``, by default
    ``loss_fn(copy(inputs))``. What :func:`verdict` compares: the copy's ``.grad`` (None
    kept), its buffers and the global RNG state after; and the step's ``info``."""
    m = copy.deepcopy(model)
    torch.manual_seed(11)
    info: dict[str, Any] = {}
    if engine is None:
        (loss_fn(m(inputs)) if autograd is None else autograd(m)).backward()
    else:
        info = engine.backward(m, inputs, loss_fn).info
    return _Step({n: None if p.grad is None else p.grad.detach()
                  for n, p in m.named_parameters()},
                 {n: b.detach().clone() for n, b in m.named_buffers()},
                 torch.get_rng_state(), info)  # fmt: skip


def verdict(ref: _Step, got: _Step, dtype: torch.dtype) -> str:
    """``exact`` or ``WRONG ...`` naming what differs (module docstring)."""
    none = [n for n in ref.grads if (ref.grads[n] is None) != (got.grads[n] is None)]
    if none:
        return f"WRONG .grad None-ness on {none[0]}"
    top = max((float(g.abs().max()) for g in ref.grads.values() if g is not None), default=0.0)
    worst, where = 0.0, ""
    for n, g in ref.grads.items():
        h = got.grads[n]
        if g is None or h is None:
            continue
        scale = float(g.abs().max()) + FLOOR[dtype] * top + 1e-300
        err = float((g - h).abs().max()) / scale
        if not err <= worst:
            worst, where = err, n
    if not worst <= TOL[dtype]:
        return f"WRONG gradient {worst:.2g} on {where}"
    for n, b in ref.buffers.items():
        if b.is_floating_point():
            diff = float((b - got.buffers[n]).abs().max()) if b.numel() else 0.0
            if not diff <= TOL[dtype] * (float(b.abs().max()) + 1.0):
                return f"WRONG buffer {n} ({diff:.2g})"
        elif not torch.equal(b, got.buffers[n]):
            return f"WRONG buffer {n} ({b.tolist()} vs {got.buffers[n].tolist()})"
    if not torch.equal(ref.rng, got.rng):
        return "WRONG global RNG moved"
    return "exact"


def check(entry: Entry, engines: dict[str, Callable[[], leangrad.Engine]] | None = None,
          dtype: torch.dtype = torch.float64) -> dict[str, str]:  # fmt: skip
    """Per engine: ``exact``, ``refused: <reason>``, ``WRONG ...`` or ``CRASH ...``."""
    model, x, y = model_and_batch(entry, dtype)
    ref = _step(model, x, y, None)
    out: dict[str, str] = {}
    for label, make in (engines or ENGINES).items():
        try:
            got = _step(model, x, y, make())
        except LeangradError as err:
            out[label] = f"refused: {str(err).splitlines()[0]}"
            continue
        except Exception as err:
            out[label] = f"CRASH {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            continue
        out[label] = verdict(ref, got, dtype)
        whole = got.info.get("whole")
        if out[label] == "exact" and whole is not None and "blocks" in got.info:
            out[label] += f" ({len(whole)} of {got.info['blocks']} blocks whole)"
    return out


def defects(table: dict[str, dict[str, str]]) -> list[str]:
    return [f"{m} / {e}: {v}" for m, row in table.items() for e, v in row.items()
            if not (v.startswith("exact") or v.startswith("refused: "))]  # fmt: skip


def _markdown(table: dict[str, dict[str, str]]) -> str:
    names = list(ENGINES)
    lines = ["# Engines on models people download (float64, weights off their init)", "",
             "Each cell: `exact` (gradients, `.grad` None-ness, buffers and the global RNG as",
             "`loss.backward()` leaves them), or `refused` with the reason leangrad gives.",
             "Fragments: how many checkpointed blocks ran whole (a block that draws random",
             "numbers or mixes its examples is recomputed whole; the step stays exact).",
             "Regenerate: `python tests/model_corpus.py --all --out results/model-corpus`.",
             "", "| model | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]  # fmt: skip
    reasons: dict[str, int] = {}
    for model, row in table.items():
        cells = []
        for e in names:
            v = row.get(e, "")
            if v.startswith("refused: "):
                k = reasons.setdefault(v.removeprefix("refused: "), len(reasons) + 1)
                cells.append(f"refused [{k}]")
            else:
                cells.append(v)
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += ["", "Refusals:", ""] + [f"{k}. {r}" for r, k in reasons.items()]
    return "\n".join(lines) + "\n"


PEER_MODELS = ("resnet50", "efficientnet_b0")
"""timm models whose BatchNorm statistics the peers' checkpointing advances (one step)."""


def _peers_markdown(peers: dict[str, dict[str, str]]) -> str:
    lines = ["", "## BatchNorm statistics after one step with checkpointing", "",
             "timm models, float64, batch 4 at 64x64: `num_batches_tracked` of the first",
             "block's first BatchNorm, and whether every running mean equals autograd's.", "",
             "| model | " + " | ".join(next(iter(peers.values()))) + " |",
             "|---|" + "---|" * len(next(iter(peers.values())))]  # fmt: skip
    for name, row in peers.items():
        lines.append(f"| timm {name} | " + " | ".join(row.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    every = "--all" in argv
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    if "--zoo-rows" in argv:
        rows = zoo_rows()
        if out:
            with open(f"{out}-zoo.json", "w") as f:
                json.dump(rows, f, indent=1)
            with open(f"{out}-zoo.md", "w") as f:
                f.write(zoo_rows_markdown(rows))
        return 0
    if "--plans" in argv:
        picked = (tuple((e.name, e.image, 64 if e.image == 32 else 16) for e in CORPUS)
                  if every else PLANNED)  # fmt: skip
        done: list[dict[str, Any]] = []
        if out and "--resume" in argv and os.path.exists(f"{out}-plans.json"):
            with open(f"{out}-plans.json") as f:
                done = json.load(f)

        def save(rows: list[dict[str, Any]]) -> None:
            if out:  # after every model: an hours-long run keeps what it measured
                with open(f"{out}-plans.json", "w") as f:
                    json.dump(rows, f, indent=1)
                with open(f"{out}-plans.md", "w") as f:
                    f.write(plans_markdown(rows))

        rows = plans(picked, done=done, saved=save)
        return 0 if all(r["re-checked from outside"].startswith(("exact", "nothing"))
                        for r in rows) else 1  # fmt: skip
    only = [a for a in argv if not a.startswith("--") and a != out]
    entries = [e for e in CORPUS if (every or e.fast) and (not only or e.name in only)]
    table: dict[str, dict[str, str]] = {}
    for i, entry in enumerate(entries, 1):
        table[entry.name] = check(entry)
        bad = defects({entry.name: table[entry.name]})
        print(f"[{i}/{len(entries)}] {entry.name}: {bad or 'ok'}", flush=True)
    if out:
        peers = {n: batchnorm_updates(n) for n in PEER_MODELS}
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(f"{out}.json", "w") as f:
            json.dump({"engines": list(ENGINES), "table": table,
                       "batchnorm_updates": peers}, f, indent=1)  # fmt: skip
        with open(f"{out}.md", "w") as f:
            f.write(_markdown(table) + _peers_markdown(peers))
    found = defects(table)
    print("\n".join(found) or "no defects")
    return 1 if found else 0



def batchnorm_updates(name: str, image: int = 64) -> dict[str, str]:
    """How often one training step advances a timm model's BatchNorm statistics: autograd,
    timm's own ``set_grad_checkpointing()``, hand-written ``torch.utils.checkpoint`` per
    block, and leangrad's ``checkpoint`` (``num_batches_tracked`` of the first block's first
    BatchNorm, and whether the running means equal autograd's)."""
    import timm
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    torch.manual_seed(0)
    base = perturb(timm.create_model(name, pretrained=False, num_classes=5)).double().train()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, image, image, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (4,), generator=gen)
    found = leangrad.blocks(base)

    def stats(m: nn.Module) -> tuple[int, list[torch.Tensor]]:
        first = next(mod for n, mod in m.named_modules()
                     if n.startswith(found.names[0]) and isinstance(mod, nn.BatchNorm2d))
        means = [b for n, b in m.named_buffers() if n.endswith("running_mean")]
        return int(first.num_batches_tracked), means

    def autograd(m: nn.Module) -> None:
        F.cross_entropy(m(x), y).backward()

    def timm_own(m: nn.Module) -> None:
        m.set_grad_checkpointing(True)
        F.cross_entropy(m(x), y).backward()

    def per_block(m: nn.Module) -> None:
        for n in found.names:
            parent, _, attr = n.rpartition(".")
            holder = m.get_submodule(parent) if parent else m
            block = holder.get_submodule(attr)
            holder.register_module(attr, _Checkpointed(block, torch_checkpoint))
        F.cross_entropy(m(x), y).backward()

    def lean(m: nn.Module) -> None:
        leangrad.engine("checkpoint").backward(m, x, lambda out: F.cross_entropy(out, y))

    ref = copy.deepcopy(base)
    autograd(ref)
    _, want = stats(ref)
    out: dict[str, str] = {}
    for label, run in (("loss.backward()", autograd), ("timm set_grad_checkpointing()", timm_own),
                       ("torch.utils.checkpoint per block", per_block),
                       ("leangrad checkpoint", lean)):  # fmt: skip
        m = copy.deepcopy(base)
        run(m)
        count, means = stats(m)
        same = all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(means, want,
                                                                             strict=True))
        out[label] = f"{count} update(s); running means {'equal' if same else 'differ'}"
    return out


class _Checkpointed(nn.Module):
    """A block run through ``torch.utils.checkpoint`` (non-reentrant), as a user writes it."""

    def __init__(self, block: nn.Module, ckpt: Callable[..., Any]) -> None:
        super().__init__()
        self.block, self.ckpt = block, ckpt

    def forward(self, *args: Any) -> Any:
        return self.ckpt(self.block, *args, use_reentrant=False)


PLANNED = (("timm/resnet18", 128, 16), ("timm/efficientnet_b0", 128, 16),
           ("timm/convnext_atto", 128, 16), ("timm/vit_tiny", 32, 64),
           ("tv/mobilenet_v3_small", 128, 16), ("timm/deit_tiny", 32, 64),
           ("timm/swin_tiny", 64, 32), ("timm/pvt_v2_b0", 64, 32),
           ("tv/convnext_tiny", 64, 16))
"""Corpus models :func:`plans` plans at a fraction of backprop's step peak: (name, image
size, batch), where the activations outweigh the parameters and their gradients."""


def plans(names: tuple[tuple[str, int, int], ...] = PLANNED,
          fractions: tuple[float, ...] = (0.5, 0.25), *, done: Sequence[dict[str, Any]] = (),
          saved: Callable[[list[dict[str, Any]]], None] | None = None,
          ) -> list[dict[str, Any]]:  # fmt: skip
    """``leangrad.plan`` on corpus models (float32, weights off their init) at ``fractions``
    of backprop's step peak (the bytes the step adds to the parameters and the batch), and
    the chosen engine re-checked from outside against
    ``loss.backward()`` (:func:`check`'s verdict on that engine alone). Rows in ``done``
    (an earlier run's) are kept and their models skipped; ``saved`` gets the rows after
    every model."""
    from leangrad.measure import profile_step

    rows: list[dict[str, Any]] = list(done)
    for name, image, batch in names:
        if any(r["model"] == f"{name} ({batch} x {image}²)" for r in done):
            continue
        entry = dataclasses.replace(next(e for e in CORPUS if e.name == name), image=image)
        model, x, y = model_and_batch(entry, torch.float32, batch=batch)
        loss_fn = per_example(lambda out, t: F.cross_entropy(out, t), y)
        prof = profile_step(leangrad.engine("backprop"), model, x, loss_fn, repeats=0)
        for frac in fractions:  # of the step's own peak, above the parameters and batch
            budget = prof.total_bytes - int((1 - frac) * prof.peak_bytes)
            plan = leangrad.plan(model, x, loss_fn, budget=budget, repeats=1)
            inexact = [f"{c.label}: {c.verdict}" for c in plan.table
                       if c.verdict.startswith("inexact")]  # fmt: skip
            if plan.engine is None:
                outside = "nothing chosen"
            else:
                chosen = plan.engine
                ref = _step(model, x, y, None)
                got = _step(model, x, y, chosen)
                outside = verdict(ref, got, torch.float32)
            rows.append({"model": f"{name} ({batch} x {image}²)", "fraction": frac,
                         "chosen": plan.message,
                         "re-checked from outside": outside, "inexact rows": inexact})
            print(f"{name} at {frac}: {outside}; {plan.message[:160]}", flush=True)
        if saved is not None:
            saved(rows)
    return rows


def plans_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["# leangrad.plan on models people download", "",
             "float32, weights off their init; the budget: the parameters and batch",
             "plus a fraction of backprop's step peak (tracker). The chosen engine re-checked",
             "from outside: one step of it",
             "beside `loss.backward()` (gradients, `.grad` None-ness, buffers, RNG).",
             "Regenerate: `python tests/model_corpus.py --plans --out results/model-corpus`",
             "(with `--all`: every corpus model, hours here).",
             "", "| model | budget | chosen | re-checked from outside | rows found inexact |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        chosen = r["chosen"].split(" — ")[0].removeprefix("chosen: ")
        lines.append(f"| {r['model']} | {r['fraction']}x | `{chosen[:90]}` | "
                     f"{r['re-checked from outside']} | {len(r['inexact rows'])} |")
    return "\n".join(lines) + "\n"


ZOO_ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "backprop": ("backprop", {}),
    "leangrad checkpoint": ("checkpoint", {}),
    "leangrad checkpoint(fragments=4)": ("checkpoint", {"fragments": 4}),
    "leangrad accumulate(4)": ("accumulate", {"micro_batches": 4}),
    "leangrad checkpoint+accumulate(4)": ("checkpoint+accumulate", {"micro_batches": 4}),
}
"""The key rows of the zoo suite for its timm models, beside timm's own checkpointing."""


def zoo_rows(names: tuple[str, ...] = ("timm_resnet50", "timm_convnext_tiny",
                                       "timm_vit_small"),
             repeats: int = 3) -> list[dict[str, Any]]:  # fmt: skip
    """The zoo suite's timm models at their full sizes (>= 1 GiB of backprop's step):
    tracker peak above parameters and batch, and the median of interleaved 1-thread steps
    (after a warm-up round), per row of :data:`ZOO_ROWS` and timm's
    ``set_grad_checkpointing()``, each row's float32 gradient against backprop's from the
    same RNG state (a refused row: the reason). ``leangrad bench zoo --only <name>`` runs
    every method on the same models (hours here)."""
    from leangrad._step import as_call
    from leangrad.measure import compare_grads, profile_step, time_interleaved
    from leangrad_bench import load_suite
    from leangrad_bench._models import build
    from leangrad_bench._zoo_methods import TIMM_CHECKPOINTING, TorchStep

    sizes = load_suite("zoo").setting("timm_models", False)
    rows: list[dict[str, Any]] = []
    for name in names:
        wl = build(name, sizes[name])
        model, x, loss_fn = wl.model, wl.inputs, wl.loss_fn
        engines: dict[str, Any] = {label: leangrad.engine(e, **o)
                                   for label, (e, o) in ZOO_ROWS.items()}  # fmt: skip
        engines[TIMM_CHECKPOINTING] = TorchStep(TIMM_CHECKPOINTING, "library_checkpointing")
        grads: dict[str, dict[str, torch.Tensor]] = {}
        peaks: dict[str, int] = {}
        refused: dict[str, str] = {}
        for label, eng in engines.items():
            model.zero_grad(set_to_none=True)
            try:
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    eng.backward(model, x, loss_fn)
                grads[label] = {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None}  # fmt: skip
                model.zero_grad(set_to_none=True)
                with torch.random.fork_rng():
                    peaks[label] = profile_step(eng, model, x, loss_fn, repeats=0).peak_bytes
            except LeangradError as e:
                refused[label] = str(e).splitlines()[0]
            print(f"{name} {label}: {peaks.get(label, refused.get(label))}", flush=True)
        steps = {label: as_call(eng, model, x, loss_fn)
                 for label, eng in engines.items() if label in peaks}  # fmt: skip
        with torch.random.fork_rng():
            times = time_interleaved(steps, repeats=repeats, warmup=1, reference="backprop")
        for label in engines:
            row: dict[str, Any] = {"model": name, "size": sizes[name], "row": label}
            if label in refused:
                row["refused"] = refused[label]
            else:
                row["peak_mib"] = round(peaks[label] / 2**20, 1)
                row["peak_vs_backprop"] = round(peaks[label] / peaks["backprop"], 3)
                row["seconds"] = round(times[label].median, 2)
                row["time_vs_backprop"] = round(float(times[label].ratio or 0), 2)
                row["grad_max_rel_err"] = float(f"{compare_grads(grads[label], grads['backprop']).max_rel_err:.2g}")  # noqa: E501
            rows.append(row)
    return rows


def zoo_rows_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["# timm models beside timm's own checkpointing", "",
             "The zoo suite's opt-in timm models at their full sizes (>= 1 GiB of backprop's",
             "step here; random weights, stochastic depth 0.1 on ConvNeXt-T and ViT-S), float32,",
             "CPU. Peak: tracker, above the parameters and the batch. Time: median of 3",
             "interleaved steps after a warm-up round, 1 thread, one effective step (the whole",
             "batch). Gradient error: float32 against backprop's from the same RNG state.",
             "Regenerate (alone on the machine): `python tests/model_corpus.py --zoo-rows --out "
             "results/model-corpus`.", ""]  # fmt: skip
    for name in dict.fromkeys(r["model"] for r in rows):
        size = next(r["size"] for r in rows if r["model"] == name)
        lines += [f"## {name} ({', '.join(f'{k} {v}' for k, v in size.items())})", "",
                  "| row | peak MiB | peak / backprop | s / step | time / backprop | grad err |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            if r["model"] != name:
                continue
            if "refused" in r:
                lines.append(f"| {r['row']} | refused: {r['refused'][:110]} | | | | |")
            else:
                lines.append(f"| {r['row']} | {r['peak_mib']} | {r['peak_vs_backprop']:.3f} | "
                             f"{r['seconds']} | {r['time_vs_backprop']:.2f} | "
                             f"{r['grad_max_rel_err']:.1e} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
