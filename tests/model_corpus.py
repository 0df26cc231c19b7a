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

``python tests/model_corpus.py [--all] [--out results/model-corpus]`` writes the table.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Callable
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

TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
FLOOR = 1e-6
"""A parameter whose gradient is below ``FLOOR`` of the model's largest is compared on
that scale: its own relative error would be rounding noise (a BatchNorm shift followed by
another training-mode BatchNorm has a true gradient of 0, computed as ~1e-16)."""


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


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
          engine: leangrad.Engine | None) -> _Step:  # fmt: skip
    m = copy.deepcopy(model)
    loss_fn = per_example(lambda out, t: F.cross_entropy(out, t), y)
    torch.manual_seed(11)
    if engine is None:
        loss_fn(m(x)).backward()
    else:
        engine.backward(m, x, loss_fn)
    return _Step({n: None if p.grad is None else p.grad.detach()
                  for n, p in m.named_parameters()},
                 {n: b.detach().clone() for n, b in m.named_buffers()},
                 torch.get_rng_state())  # fmt: skip


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
        err = float((g - h).abs().max()) / (float(g.abs().max()) + FLOOR * top + 1e-300)
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
    return out


def defects(table: dict[str, dict[str, str]]) -> list[str]:
    return [f"{m} / {e}: {v}" for m, row in table.items() for e, v in row.items()
            if not (v == "exact" or v.startswith("refused: "))]  # fmt: skip


def _markdown(table: dict[str, dict[str, str]]) -> str:
    names = list(ENGINES)
    lines = ["# Engines on models people download (float64, weights off their init)", "",
             "Each cell: `exact` (gradients, `.grad` None-ness, buffers and the global RNG as",
             "`loss.backward()` leaves them), or `refused` with the reason leangrad gives.",
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


def main(argv: list[str]) -> int:
    every = "--all" in argv
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    only = [a for a in argv if not a.startswith("--") and a != out]
    entries = [e for e in CORPUS if (every or e.fast) and (not only or e.name in only)]
    table: dict[str, dict[str, str]] = {}
    for i, entry in enumerate(entries, 1):
        table[entry.name] = check(entry)
        bad = [v for v in table[entry.name].values()
               if not (v == "exact" or v.startswith("refused"))]  # fmt: skip
        print(f"[{i}/{len(entries)}] {entry.name}: {bad or 'ok'}", flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(f"{out}.json", "w") as f:
            json.dump({"engines": list(ENGINES), "table": table}, f, indent=1)
        with open(f"{out}.md", "w") as f:
            f.write(_markdown(table))
    found = defects(table)
    print("\n".join(found) or "no defects")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
