"""A grammar of small models and a contract checker for the engine fuzz test.

A *spec* is plain data (dicts, lists, tuples, ints, floats, strings): Hypothesis draws it
(:func:`specs`), :func:`build` turns it into ``(model, x, loss_fn, features)``
deterministically, and :func:`check_engine` runs one engine on it against plain autograd
under the backward contract (``tests/engines/test_contract.py``):

- parameter gradients (float64: 1e-9 relative, float32: loose), ``.grad`` None-ness,
- the user's Parameters stay the same objects (``functional_call`` must not replace them),
- buffers (running statistics advance once), the global RNG state, input gradients,
- the returned loss, the modules' training flags,
- ``on_grad`` called once per parameter that gets a gradient, with its final value,

or the engine raises a leangrad error (:class:`leangrad.LeangradError`; every error class
leangrad defines derives from it) with a one-line message that is not a wrapped PyTorch
error. Estimating engines (projforward, rad at fraction < 1, highway at small k) and
models holding rad layers at fraction < 1 are checked on everything but gradient values.

:func:`check_isolated` runs a check in a forked child so that a segfault is reported as
a failure instead of killing the test run. ``python tests/fuzz_models.py summarize FILE``
prints the summary of a ``FUZZ_LOG`` file (``make fuzz``).

Spec layout (see :func:`specs`)::

    {"family": "seq" | "chain" | "highway",   # any module / leangrad Chain / HighwayNet
     "input": "vec" | "img" | "tokens" | "time",
     "dtype": "float64" | "float32", "seed": int, "batch": int,
     "channels_last": bool, "input_grad": bool, "on_grad": bool, "prefill": bool,
     "eval": bool,                            # the whole model in eval mode
     "stem": [...], "body": [...], "head": [...]}   # layer specs, per family

A layer spec is a tuple ``(kind, *args)``; ``("ref", k)`` uses the k-th shareable module
built so far a second time (a shared module) and ``("tie", k)`` builds a new layer whose
weight is that module's Parameter (tied weights).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import select
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import LeangradError, bits, fad, highway, layers, models, rad

Spec = dict[str, Any]
LayerSpec = tuple[Any, ...]
Outcome = dict[str, Any]

CLASSES = 3
RNG_SEED = 1234  # the global seed both the reference and the engine start from

# --- engines ----------------------------------------------------------------------------

MOONWALK_VARIANTS: list[dict[str, Any]] = [
    {},
    {"segments": 2},
    {"mode": "pure", "chunk_size": 7},
    {"stem_chunks": 1},
    {"fragment": "full"},
]
"""``moonwalk`` options worth a check of their own (different code paths): the contract
test (tests/engines/test_contract.py) checks each, the fuzz these and one more."""

# Option variants worth a check of their own (different code paths); modelled on
# tests/engines/test_contract.py's VARIANTS and COMBOS, plus estimating variants.
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "checkpoint": [{}, {"segments": 2}, {"trace": True}, {"fragments": 2}],
    "accumulate": [{"micro_batches": 2}],
    "forward": [{"chunk_size": 7}],
    "projforward": [{"samples": 2, "chunk_size": 2, "seed": 0}],
    "moonwalk": [*MOONWALK_VARIANTS, {"fragment": 3}],
    "highway": [{"k": 10}, {"k": 1}],  # k >= L - 1 is exact (Theorem 2); k=1 estimates
    "rad": [{"fraction": 1.0, "seed": 0}, {"fraction": 0.5, "seed": 0}],
    "fad": [{}, {"mode": "eager"}],
}
COMBOS: list[tuple[str, dict[str, Any]]] = [
    ("checkpoint+accumulate", {"micro_batches": 2}),
    ("checkpoint+fad", {"segments": 2}),
    ("checkpoint+rad", {"fraction": 1.0, "seed": 0}),
    ("checkpoint+bits", {"segments": 2}),
    ("moonwalk+fad", {}),
    ("moonwalk+rad", {"fraction": 1.0, "seed": 0}),
    ("moonwalk+bits", {}),
    ("revbackprop+fad", {}),
    ("highway+fad", {"k": 10}),
    ("fad+rad", {"fraction": 1.0, "seed": 0}),
    ("fad+bits", {}),
]


def engine_variants() -> list[tuple[str, dict[str, Any]]]:
    """Every registered engine with its variants, then the compositions."""
    named = [(n, o) for n in leangrad.available() for o in VARIANTS.get(n, [{}])]
    return named + COMBOS


def engine_id(name: str, opts: dict[str, Any]) -> str:
    label = ",".join(f"{k}={v}" for k, v in opts.items())
    return f"{name}({label})" if label else name


def exact_engine(name: str, opts: dict[str, Any], depth: int) -> bool:
    """Whether the engine's gradient equals autograd's up to rounding on this model;
    ``depth``: the number of blocks of the model's deepest highway stack."""
    exact = True
    for part in name.split("+"):
        if part == "highway":
            exact &= int(opts.get("k", 2)) >= max(depth - 1, 0)
        elif part == "rad":
            exact &= opts.get("fraction", 0.1) == 1.0
        elif part not in ("fad", "bits"):
            exact &= leangrad.engines.engine_class(part).exact
    return exact


# --- the grammar's layers ---------------------------------------------------------------


def _sq_tanh(t: torch.Tensor) -> torch.Tensor:
    """An element-wise function for ``fad.elementwise``: x * tanh(x) + 0.5 x."""
    return t * torch.tanh(t) + 0.5 * t


def _act(name: str) -> nn.Module:
    table: dict[str, Callable[[], nn.Module]] = {
        "relu": nn.ReLU,
        "tanh": nn.Tanh,
        "gelu": nn.GELU,
        "silu": nn.SiLU,
        "fad.swish": fad.Swish,
        "fad.gelu": fad.GELU,
        "fad.mish": fad.Mish,
        "fad.elementwise": lambda: fad.elementwise(_sq_tanh),
        "bits.relu": bits.BitReLU,
        "bits.leaky": lambda: bits.BitLeakyReLU(0.1),
        "rad.relu": rad.BitReLU,
    }
    return table[name]()


ACTS = (
    "relu", "tanh", "gelu", "silu", "fad.swish", "fad.gelu", "fad.mish", "fad.elementwise",
    "bits.relu", "bits.leaky", "rad.relu",
)  # fmt: skip


class DropPath(nn.Module):
    """Stochastic depth as timm's ``DropPath`` and torchvision's ``StochasticDepth`` write
    it: one Bernoulli draw per example in ``forward``, no dropout class."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep.div_(1 - self.p)


class Sampled(nn.Module):
    """Draws from its input's values (``bernoulli`` of probabilities after a Linear): no
    shape to replay the whole batch's draw by. ``residual``: adds its input."""

    def __init__(self, dim: int, *, residual: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.lin(x))
        drawn = h * torch.bernoulli(h.detach())
        return x + drawn if self.residual else drawn


class FunctionalDropout(nn.Module):
    """``F.dropout`` called inside a ``forward`` (attention code does), no dropout class."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training)


class NormAct(nn.Module):
    """timm's ``BatchNormAct2d``: BatchNorm, then an activation written in place over its
    output (``F.relu``/``F.silu``/``F.hardswish`` with ``inplace=True``)."""

    def __init__(self, bn: nn.Module, act: str) -> None:
        super().__init__()
        self.bn, self.act = bn, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        fn = {"relu": F.relu, "silu": F.silu, "hardswish": F.hardswish}[self.act]
        return fn(y, inplace=True)


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation (EfficientNet, RegNetY, MobileNetV3): each example's channels
    scaled by a gate computed from its own mean (images) or itself (vectors)."""

    def __init__(self, width: int, img: bool) -> None:
        super().__init__()
        self.img = img
        self.reduce, self.expand = nn.Linear(width, max(1, width // 2)), nn.Linear(
            max(1, width // 2), width)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3)) if self.img else x
        gate = torch.sigmoid(self.expand(F.relu(self.reduce(s))))
        return x * (gate[:, :, None, None] if self.img else gate)


class Residual(nn.Module):
    """``x + body(x)``: a residual wrapper (shape preserving)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class StepHead(nn.Module):
    """Read a recurrent layer at every step: (T, N, H) -> (T * N, classes)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, CLASSES)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).flatten(0, 1)


@dataclass
class _Ctx:
    """What the builder knows while it walks a spec."""

    shape: tuple[int, ...]  # the per-example shape of the current activation
    features: set[str] = field(default_factory=set)
    shareable: list[tuple[tuple[int, ...], nn.Module]] = field(default_factory=list)
    eval_modules: list[nn.Module] = field(default_factory=list)
    estimating: bool = False  # rad layers at fraction < 1: no reference values


def _mode(ctx: _Ctx, m: nn.Module, mode: str, what: str) -> nn.Module:
    ctx.features.add(f"{what}-{mode}")
    if mode == "eval":
        ctx.eval_modules.append(m)
    return m


def _tie_source(ctx: _Ctx, k: int, kind: type[nn.Module]) -> nn.Module | None:
    same = [m for s, m in ctx.shareable if s == ctx.shape and type(m) is kind]
    return same[k % len(same)] if same else None


def _seq_layer(spec: LayerSpec, ctx: _Ctx, depth: int) -> nn.Module:
    """One shape-preserving layer of the generic grammar (vectors or images)."""
    kind, *args = spec
    img = len(ctx.shape) == 3
    width = ctx.shape[0]
    m: nn.Module
    if kind == "lin":  # a Linear (vectors) or a 3x3 / 1x1 Conv2d (images)
        m = nn.Conv2d(width, width, args[0], padding=args[0] // 2) if img else nn.Linear(
            width, width
        )
        ctx.shareable.append((ctx.shape, m))
        return m
    if kind == "act":
        ctx.features.add(f"act-{args[0]}")
        return _act(args[0])
    if kind == "dropout":
        ctx.features.add("dropout")
        if args[1] == "bits":
            ctx.features.add("bits-dropout")
            return bits.BitDropout(args[0])
        return nn.Dropout(args[0])
    if kind == "bn":
        bn = nn.BatchNorm2d(width) if img else nn.BatchNorm1d(width)
        return _mode(ctx, bn, args[0], "bn")
    if kind == "bnact":  # timm's BatchNormAct2d: an activation in place over BatchNorm's output
        ctx.features.add("bn-inplace-act")
        bn = nn.BatchNorm2d(width) if img else nn.BatchNorm1d(width)
        return NormAct(_mode(ctx, bn, args[0], "bn"), args[1])
    if kind == "droppath":
        ctx.features.add("stochastic-depth")
        return DropPath(args[0])
    if kind == "fdrop":
        ctx.features.add("functional-dropout")
        return FunctionalDropout(args[0])
    if kind == "se":
        ctx.features.add("squeeze-excite")
        return SqueezeExcite(width, img)
    if kind == "gn":
        ctx.features.add("groupnorm")
        return _mode(ctx, nn.GroupNorm(args[0] if width % args[0] == 0 else 1, width), "train",
                     "gn")  # fmt: skip
    if kind == "ln":
        ctx.features.add("layernorm")
        return nn.LayerNorm(list(ctx.shape) if img else width)
    if kind == "rad":  # RandLinear / RandConv2d
        fraction, seed = args
        ctx.features.add("rad-layer")
        if fraction < 1.0:
            ctx.estimating = True
        if img:
            m = rad.RandConv2d(width, width, 3, padding=1, fraction=fraction, seed=seed)
        else:
            m = rad.RandLinear(width, width, fraction=fraction, seed=seed)
        return m
    if kind == "pool":  # shape-preserving average pooling
        ctx.features.add("pool")
        if not img:
            return nn.Identity()
        pool = bits.LeanAvgPool2d if args[0] == "bits" else rad.LeanAvgPool2d
        return pool(3, stride=1, padding=1)
    if kind == "seq":
        ctx.features.add("nested")
        return nn.Sequential(*[_seq_layer(s, ctx, depth + 1) for s in args[0]])
    if kind == "res":
        ctx.features.add("residual")
        body = nn.Sequential(*[_seq_layer(s, ctx, depth + 1) for s in args[0]])
        block = Residual(body)
        ctx.shareable.append((ctx.shape, block))
        return block
    if kind == "ref":  # the same module object a second time
        same = [m for s, m in ctx.shareable if s == ctx.shape]
        if not same:
            return nn.Identity()
        ctx.features.add("shared")
        return same[args[0] % len(same)]
    if kind == "tie":  # a new layer holding another layer's weight Parameter
        cls = nn.Conv2d if img else nn.Linear
        src = _tie_source(ctx, args[0], cls)
        if src is None:
            return nn.Identity()
        ctx.features.add("tied")
        if img:
            assert isinstance(src, nn.Conv2d)
            k = src.kernel_size[0]
            m = nn.Conv2d(width, width, k, padding=k // 2)
        else:
            m = nn.Linear(width, width)
        m.weight = src.weight
        return m
    raise ValueError(f"unknown layer spec {spec!r}")


def _chain_layer(spec: LayerSpec, ctx: _Ctx) -> nn.Module:
    """One leangrad chain layer; may change ``ctx.shape`` (SpaceToDepth, strided convs)."""
    kind, *args = spec
    img = len(ctx.shape) == 3
    c = ctx.shape[0]
    m: nn.Module
    if kind == "coupling":
        half = _Ctx(shape=(c // 2, *ctx.shape[1:]), features=ctx.features)
        f = nn.Sequential(*[_seq_layer(s, half, 1) for s in args[0]])
        ctx.eval_modules += half.eval_modules
        ctx.estimating |= half.estimating
        m = layers.AdditiveCoupling(f)
        ctx.shareable.append((ctx.shape, m))
        ctx.features.add("coupling")
        return m
    if kind == "coupling_ref":  # a new coupling around another coupling's F (shared F)
        same = [
            x for s, x in ctx.shareable if s == ctx.shape and isinstance(x, layers.AdditiveCoupling)
        ]
        if not same:
            return layers.Tanh()
        ctx.features.add("shared")
        return layers.AdditiveCoupling(same[args[0] % len(same)].F)
    if kind == "leaky":
        ctx.features.add("leaky")
        return layers.LeakyReLU(args[0])
    if kind == "tanh":
        return layers.Tanh()
    if kind == "swap":
        return layers.SwapHalves()
    if kind == "s2d":
        if not img or ctx.shape[1] % 2 or ctx.shape[1] < 4:
            return layers.Tanh()
        ctx.shape = (c * 4, ctx.shape[1] // 2, ctx.shape[2] // 2)
        ctx.features.add("s2d")
        return layers.SpaceToDepth(2)
    if kind == "subconv":  # submersive conv: 3x3 stride 2 (halves) or 1x1
        ctx.features.add("subconv")
        if not img:
            m = layers.SubmersiveLinear(c, c)
        elif args[0] == "down" and ctx.shape[1] >= 4 and ctx.shape[1] % 2 == 0:
            m = layers.SubmersiveConv2d(c, c, 3, stride=2, padding=1)
            ctx.shape = (c, ctx.shape[1] // 2, ctx.shape[2] // 2)
        else:
            m = layers.SubmersiveConv2d(c, c, 1)
        ctx.shareable.append((ctx.shape, m))
        return m
    if kind == "fragconv":
        ctx.features.add("fragconv")
        m = layers.FragmentalConv2d(c, 3) if img else layers.SubmersiveLinear(c, c)
        return m
    if kind == "ref":
        same = [x for s, x in ctx.shareable if s == ctx.shape]
        if not same:
            return layers.Tanh()
        ctx.features.add("shared")
        return same[args[0] % len(same)]
    raise ValueError(f"unknown chain layer spec {spec!r}")


def _head(spec: list[LayerSpec], ctx: _Ctx) -> nn.Module:
    """Head layers (shape preserving) then flatten/pool and a Linear to CLASSES."""
    if spec:
        ctx.features.add("head-layers")
    pre = [_seq_layer(s, ctx, 1) for s in spec]
    if any(isinstance(m, nn.Dropout | bits.BitDropout) for m in pre):
        ctx.features.add("head-dropout")
    if len(ctx.shape) == 3:
        size = ctx.shape[1]
        if size > 2:
            pool = nn.AdaptiveAvgPool2d(2)
            size = 2
            pre.append(pool)
        return nn.Sequential(*pre, nn.Flatten(), nn.Linear(ctx.shape[0] * size * size, CLASSES))
    if len(ctx.shape) == 2:  # tokens (T, D)
        return nn.Sequential(*pre, nn.Flatten(), nn.Linear(ctx.shape[0] * ctx.shape[1], CLASSES))
    return nn.Sequential(*pre, nn.Linear(ctx.shape[0], CLASSES))


def _stem(spec: LayerSpec, ctx: _Ctx, width: int) -> nn.Module:
    """Map the raw input (vec: 3 features, img: 2 channels) to ``width``."""
    kind, *args = spec
    img = len(ctx.shape) == 3
    first: nn.Module
    if kind == "repeat":
        ctx.features.add("paramfree-stem")
        first = models.RepeatChannels(width)
    elif len(ctx.shape) == 2:  # tokens (T, D): a Linear on the features
        first = nn.Linear(ctx.shape[1], width)
    else:
        first = nn.Conv2d(ctx.shape[0], width, 1) if img else nn.Linear(ctx.shape[0], width)
    ctx.shape = (ctx.shape[0], width) if len(ctx.shape) == 2 else (width, *ctx.shape[1:])
    extra = [_seq_layer(s, ctx, 1) for s in args[0]] if args else []
    if kind == "repeat" and args and any(s[0] == "bn" for s in args[0]):
        # a parameter-free stem keeps BatchNorm affine=False as in test_contract
        extra = [
            nn.BatchNorm2d(width, affine=False) if isinstance(m, nn.BatchNorm2d) else m
            for m in extra
        ]
    return nn.Sequential(first, *extra) if extra else first


# --- building a spec --------------------------------------------------------------------


@dataclass
class Built:
    model: nn.Module
    x: torch.Tensor
    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    features: frozenset[str]
    estimating: bool  # rad layers at fraction < 1 inside the model
    highway_depth: int  # blocks in the deepest highway stack (0 if none)


INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "vec": (3,),
    "img": (2, 4, 4),
    "tokens": (3, 4),  # (T, D)
    "time": (3,),  # time-first (T, N, F); T below
}


def build(spec: Spec) -> Built:
    """The model, input and loss of ``spec`` (deterministic: seeded from ``spec``)."""
    dtype = {"float64": torch.float64, "float32": torch.float32}[spec["dtype"]]
    torch.manual_seed(spec["seed"])
    kind = spec["input"]
    base = INPUT_SHAPES[kind]
    if spec["family"] == "chain" and kind == "img":
        base = (2, spec.get("size", 8), spec.get("size", 8))
    ctx = _Ctx(shape=base)
    depth = 0
    model: nn.Module
    if spec["family"] == "seq":
        width = spec.get("width", 4)
        stem = _stem(spec["stem"], ctx, width)
        body = [_seq_layer(s, ctx, 0) for s in spec["body"]]
        head = _head(spec["head"], ctx)
        model = nn.Sequential(stem, *body, head)
    elif spec["family"] == "chain":
        width = spec.get("width", 4)
        stem = _stem(spec["stem"], ctx, width)
        chain_layers = [_chain_layer(s, ctx) for s in spec["body"]]
        head = _head(spec["head"], ctx)
        model = layers.Chain(*chain_layers, stem=stem, head=head)
        ctx.features.add("chain")
    else:
        model, depth = _highway_net(spec, ctx)
    model = model.to(dtype)
    model.train(not spec.get("eval", False))
    for m in ctx.eval_modules:
        m.eval()
    n = spec["batch"]
    if kind == "time":
        x = torch.randn(spec.get("steps", 3), n, *base, dtype=dtype)
        n_out = x.shape[0] * n
    else:
        x = torch.randn(n, *base, dtype=dtype)
        n_out = n
    if spec["channels_last"] and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
        ctx.features.add("channels-last")
    y = torch.randint(0, CLASSES, (n_out,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    # one output row per example: declared a mean over examples, so micro-batches run
    declared = loss_fn if kind == "time" else leangrad.loss.per_example(
        lambda out, t: F.cross_entropy(out, t), y)  # fmt: skip
    return Built(model, x, declared, frozenset(ctx.features), ctx.estimating, depth)


def _highway_net(spec: Spec, ctx: _Ctx) -> tuple[nn.Module, int]:
    kind = spec["input"]
    width = spec.get("width", 4)
    stem = _stem(spec["stem"], ctx, width)
    blocks: list[nn.Module] = []
    if kind == "time":
        ctx.features.add("rnn")
        cell = highway.GRULayer if spec["body"][0][0] == "gru" else highway.LSTMLayer
        rnn = cell(width, width, residual=bool(spec["body"][0][1]))
        head: nn.Module = StepHead(width)
        return highway.HighwayNet(stem, [rnn], head), spec.get("steps", 3)
    for s in spec["body"]:
        if s[0] == "ref":
            if blocks:
                ctx.features.add("shared")
                blocks.append(blocks[s[1] % len(blocks)])
        elif kind == "img":
            blocks.append(highway.PreActBlock(width) if s[0] == "preact" else
                          highway.PostReLUBlock(width))  # fmt: skip
        else:
            cls = highway.PreLNSublayer if s[0] == "preln" else highway.PostLNSublayer
            blocks.append(cls(width, 2, kind=s[1]))
    if not blocks:
        blocks.append(highway.PreActBlock(width) if kind == "img" else highway.PreLNSublayer(width))
    ctx.features.add("highway")
    # re-derive the spatial/token shape: blocks preserve it
    head = _head(spec["head"], ctx)
    return highway.HighwayNet(stem, [highway.ResidualStack(blocks)], head), len(blocks)


# --- the contract check -----------------------------------------------------------------


def _param_slots(model: nn.Module) -> dict[tuple[str, str], int]:
    """``(module path, attribute) -> id(Parameter)`` for every parameter slot."""
    return {
        (path, attr): id(p)
        for path, m in model.named_modules(remove_duplicate=False)
        for attr, p in m._parameters.items()
        if p is not None
    }


def _bad_slots(model: nn.Module, before: dict[tuple[str, str], int]) -> list[str]:
    out = []
    for path, m in model.named_modules(remove_duplicate=False):
        for attr in m._parameters:
            p = m._parameters[attr]
            key = (path, attr)
            if key not in before:
                continue
            if not isinstance(p, nn.Parameter) or id(p) != before[key]:
                out.append(f"{path}.{attr}: {type(p).__name__} (was the user's Parameter)")
    for path, m in model.named_modules(remove_duplicate=False):
        for attr in ("weight", "bias"):
            if (path, attr) in before and attr not in m._parameters:
                out.append(f"{path}.{attr}: no longer a registered parameter")
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    num = (a.double() - b.double()).norm().item()
    den = b.double().norm().item()
    return num / den if den > 0 else num


GLOBAL_RTOL32 = 1e-5
"""Float32: the absolute tolerance of each parameter's gradient, relative to the norm of
the whole gradient (all parameters)."""


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(relative, absolute) norm-wise tolerance for exact engines."""
    return (1e-9, 1e-12) if dtype == torch.float64 else (2e-3, 1e-5)


def _one_line(err: BaseException) -> bool:
    msg = str(err)
    return bool(msg.strip()) and "\n" not in msg.strip()


def _leangrad_error_problem(err: BaseException) -> tuple[str, str] | None:
    """None when ``err`` is an acceptable refusal, else ``(failure kind, description)``:
    not a leangrad error; a message of several lines; or a leangrad error that only
    wraps an error PyTorch raised inside the engine (it names PyTorch's symptom, not the
    condition: known class 6)."""
    name = type(err).__name__
    if not isinstance(err, LeangradError):
        return "non-leangrad-error", f"non-leangrad exception {name}"
    if not _one_line(err):
        return "multiline-error", f"{name} message is not one line"
    cause = err.__cause__
    if cause is not None and not isinstance(cause, LeangradError):
        return "wrapped-torch-error", f"{name} wraps a {type(cause).__name__} from PyTorch"
    return None


def _fail(label: str, kind: str, detail: str) -> Outcome:
    return {"engine": label, "status": "fail", "kind": kind, "detail": detail[:800]}


def reference(spec: Spec) -> dict[str, Any]:
    """Plain autograd on a fresh build of ``spec``: loss, grads, buffers, RNG, input grad."""
    b = build(spec)
    _prefill(spec, b.model)
    x = b.x.clone().requires_grad_(spec["input_grad"])
    torch.manual_seed(RNG_SEED)
    loss = b.loss_fn(b.model(x))
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in b.model.named_parameters()
        },
        "buffers": {n: t.clone() for n, t in b.model.named_buffers()},
        "rng": torch.get_rng_state(),
        "xgrad": None if x.grad is None else x.grad.clone(),
    }


def _prefill(spec: Spec, model: nn.Module) -> None:
    """One parameter starts with a gradient (accumulation), the rest with None."""
    if spec.get("prefill"):
        first = next(model.parameters())
        first.grad = torch.full_like(first, 0.5)


def check_engine(
    spec: Spec,
    name: str,
    opts: dict[str, Any],
    *,
    make: Callable[[], leangrad.Engine] | None = None,
) -> Outcome:
    """Run one engine on ``spec`` against plain autograd; an :data:`Outcome` dict with
    ``status`` ``ok``, ``refused``, ``unsupported``, ``skip`` or ``fail``. ``make``
    builds the engine instead of ``leangrad.engine(name, **opts)`` (the checker's own
    test uses it for deliberately broken engines)."""
    label = engine_id(name, opts)
    try:
        ref = reference(spec)
    except Exception as err:  # the grammar built something plain PyTorch cannot run
        return {"engine": label, "status": "skip", "detail": f"reference failed: {err!r}"[:300]}
    b = build(spec)
    model, dtype = b.model, b.x.dtype
    try:
        eng = make() if make is not None else leangrad.engine(name, **opts)
        why = eng.supports(model)
    except Exception as err:
        problem = _leangrad_error_problem(err)
        if problem is None:
            return {"engine": label, "status": "unsupported", "detail": str(err)[:200]}
        return _fail(label, "supports-raised", f"{problem[1]}: {err}")
    if why is not None:
        return {"engine": label, "status": "unsupported", "detail": why[:200]}

    _prefill(spec, model)
    slots = _param_slots(model)
    modes = {n: m.training for n, m in model.named_modules()}
    requires = {n: p.requires_grad for n, p in model.named_parameters()}
    calls: dict[str, list[torch.Tensor | None]] = {}
    params_by_name = dict(model.named_parameters())

    def on_grad(pname: str, p: nn.Parameter) -> None:
        calls.setdefault(pname, []).append(None if p.grad is None else p.grad.detach().clone())

    x = b.x.clone().requires_grad_(spec["input_grad"])
    torch.manual_seed(RNG_SEED)
    try:
        result = eng.backward(model, x, b.loss_fn, on_grad=on_grad if spec["on_grad"] else None)
    except Exception as err:
        problem = _leangrad_error_problem(err)
        if problem is None:
            return {"engine": label, "status": "refused", "error": type(err).__name__,
                    "detail": str(err)[:300]}  # fmt: skip
        where = traceback.extract_tb(err.__traceback__)
        frames = [f for f in where if "/leangrad/" in f.filename] or list(where)
        at = f"{frames[-1].filename.rsplit('/src/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
        return _fail(label, problem[0], f"{problem[1]} (at {at}): {str(err)[:400]}")

    problems: list[tuple[str, str]] = []
    exact = eng.exact if make is not None else exact_engine(name, opts, b.highway_depth)
    exact = exact and not b.estimating
    rtol, atol = _tolerance(dtype)
    for bad in _bad_slots(model, slots):
        problems.append(("param-identity", bad))
    for n, m in model.named_modules():
        if n in modes and m.training != modes[n]:
            problems.append(("mode-changed", f"{n or 'model'}.training changed"))
    for n, p in model.named_parameters():
        if requires.get(n, True) != p.requires_grad:
            problems.append(("requires-grad", f"{n}.requires_grad changed"))
    grads_now = {n: p.grad for n, p in model.named_parameters()}
    # float32: a gradient that is zero in exact arithmetic (a bias before a training-mode
    # BatchNorm) is rounding noise of the size of the whole gradient's error, so its own
    # norm is no scale for it: allow that much absolutely
    scale = math.sqrt(sum(r.double().norm().item() ** 2 for r in ref["grads"].values()
                          if r is not None))  # fmt: skip
    atol = atol + (GLOBAL_RTOL32 * scale if dtype == torch.float32 else 0.0)
    for n, r in ref["grads"].items():
        g = grads_now.get(n, "missing")
        if isinstance(g, str):
            problems.append(("param-identity", f"{n}: parameter missing after the step"))
            continue
        if (g is None) != (r is None):
            ours, theirs = ("None" if t is None else "set" for t in (g, r))
            problems.append(("grad-none", f"{n}: .grad is {ours}, autograd's is {theirs}"))
            continue
        if g is None or r is None:
            continue
        if g.shape != r.shape:
            problems.append(("grad-value", f"{n}: shape {tuple(g.shape)} vs {tuple(r.shape)}"))
        elif not torch.isfinite(g).all() and torch.isfinite(r).all():
            problems.append(("grad-value", f"{n}: non-finite gradient"))
        elif exact:
            err = (g.double() - r.double()).norm().item()
            if err > rtol * r.double().norm().item() + atol:
                problems.append(("grad-value", f"{n}: relative error {_rel(g, r):.2e}"))
    loss_err = abs(result.loss.double().item() - ref["loss"].double().item())
    # every engine, estimators too, runs the same forward as autograd: the same loss
    if loss_err > rtol * abs(ref["loss"].double().item()) + atol:
        problems.append(("loss", f"loss {result.loss.item():.6g} vs {ref['loss'].item():.6g}"))
    for n, t in model.named_buffers():
        r = ref["buffers"].get(n)
        if r is None:
            continue
        if type(t) is not torch.Tensor or torch._C._functorch.is_batchedtensor(t):
            problems.append(("buffer", f"{n}: left as a {type(t).__name__} / vmap-batched"))
            continue
        if t.dtype in (torch.long, torch.int32) or not t.is_floating_point():
            if not torch.equal(t, r):
                problems.append(("buffer", f"{n}: {t.tolist()} vs autograd's {r.tolist()}"))
        elif not torch.allclose(t, r, rtol=1e-9 if dtype == torch.float64 else 1e-4,
                                atol=1e-12 if dtype == torch.float64 else 1e-6):  # fmt: skip
            problems.append(("buffer", f"{n}: running value differs (rel {_rel(t, r):.2e})"))
    if not torch.equal(torch.get_rng_state(), ref["rng"]):
        problems.append(("rng", "the global RNG advanced differently from autograd"))
    if spec["input_grad"]:
        if x.grad is None:
            problems.append(("input-grad", "an input with requires_grad=True got no .grad"))
        elif exact and ref["xgrad"] is not None:
            e = (x.grad.double() - ref["xgrad"].double()).norm().item()
            if e > rtol * ref["xgrad"].double().norm().item() + atol:
                problems.append(("input-grad", f"relative error {_rel(x.grad, ref['xgrad']):.2e}"))
    if spec["on_grad"]:
        for n, p in params_by_name.items():
            got = calls.get(n, [])
            final = p.grad
            if final is None:
                if got:
                    problems.append(("on-grad", f"{n}: on_grad called {len(got)}x, .grad None"))
                continue
            if len(got) != 1:
                problems.append(("on-grad", f"{n}: on_grad called {len(got)} times, not once"))
                continue
            seen = got[0]
            if seen is None or seen.shape != final.shape or not torch.equal(seen, final):
                problems.append(("on-grad", f"{n}: on_grad saw a value that is not the final "
                                            ".grad (a partial gradient)"))  # fmt: skip
        for n in calls:
            if n not in params_by_name:
                problems.append(("on-grad", f"on_grad called with unknown name {n!r}"))
    if problems:
        kinds = sorted({k for k, _ in problems})
        detail = "; ".join(d for _, d in problems[:6])
        return {"engine": label, "status": "fail", "kind": ",".join(kinds), "detail": detail[:800]}
    return {"engine": label, "status": "ok"}


# --- isolation --------------------------------------------------------------------------

CHILD_TIMEOUT_S = 120.0  # per engine run


def _checked(spec: Spec, name: str, opts: dict[str, Any]) -> Outcome:
    try:
        return check_engine(spec, name, opts)
    except Exception as err:  # the checker itself failed: report it, do not hang
        tb = traceback.format_exc()[-500:]
        return _fail(engine_id(name, opts), "checker-error", f"{err!r}: {tb}")


def _child(spec: Spec, runs: list[tuple[str, dict[str, Any]]], wfd: int) -> None:
    """In the forked child: check each engine, send each outcome as soon as it exists
    (length-prefixed pickles), then leave without running any exit handler."""
    code = 0
    try:
        with os.fdopen(wfd, "wb", buffering=0) as w:
            for name, opts in runs:
                data = pickle.dumps(_checked(spec, name, opts))
                w.write(len(data).to_bytes(8, "little") + data)
    except BaseException:
        code = 3
    finally:
        os._exit(code)


def _read_outcomes(rfd: int, expected: int) -> tuple[list[Outcome], bool]:
    """Outcomes from a child until EOF; ``(outcomes, timed_out)``."""
    buf = b""
    out: list[Outcome] = []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while len(out) < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            return out, True
        ready, _, _ = select.select([rfd], [], [], left)
        if not ready:
            continue
        chunk = os.read(rfd, 1 << 16)
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 8 and len(buf) >= 8 + int.from_bytes(buf[:8], "little"):
            n = int.from_bytes(buf[:8], "little")
            out.append(pickle.loads(buf[8 : 8 + n]))
            buf = buf[8 + n :]
            deadline = time.monotonic() + CHILD_TIMEOUT_S
    return out, False


def check_isolated(spec: Spec, runs: list[tuple[str, dict[str, Any]]]) -> list[Outcome]:
    """:func:`check_engine` for each ``(name, opts)`` of ``runs``, in a forked child: a
    segfault or a hang of one engine becomes its failure ``crash`` / ``timeout`` (and a
    fresh child goes on with the next engine) instead of killing the test run.
    In-process where there is no ``fork``, or with ``FUZZ_INPROCESS=1``."""
    if not hasattr(os, "fork") or os.environ.get("FUZZ_INPROCESS") == "1":
        return [_checked(spec, n, o) for n, o in runs]
    results: list[Outcome] = []
    while len(results) < len(runs):
        todo = runs[len(results) :]
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(spec, todo, wfd)
        os.close(wfd)
        try:
            got, timed_out = _read_outcomes(rfd, len(todo))
        finally:
            os.close(rfd)
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        results += got
        if len(got) < len(todo):  # the engine after the last outcome died or hung
            label = engine_id(*todo[len(got)])
            if timed_out:
                results.append(_fail(label, "timeout", f"no result in {CHILD_TIMEOUT_S:.0f} s"))
            elif os.WIFSIGNALED(status):
                sig = signal.Signals(os.WTERMSIG(status)).name
                results.append(_fail(label, "crash", f"the process died with {sig}"))
            else:
                results.append(_fail(label, "crash", f"the child exited with status {status}"))
    return results


WARM_SPECS: list[Spec] = [
    {"family": "seq", "input": "img", "stem": ("lin", [("bn", "train")]),
     "body": [("lin", 3), ("act", "fad.swish"), ("act", "bits.relu"), ("dropout", 0.25, "nn")],
     "head": [], "dtype": "float64", "seed": 0, "batch": 2, "channels_last": False,
     "input_grad": False, "on_grad": True, "prefill": False, "eval": False},
    {"family": "chain", "input": "img", "stem": ("lin", []),
     "body": [("coupling", [("lin", 3), ("act", "tanh")]), ("leaky", 0.1), ("fragconv",),
              ("subconv", "down")],
     "head": [], "dtype": "float64", "seed": 0, "batch": 2, "channels_last": False,
     "input_grad": False, "on_grad": True, "prefill": False, "eval": False},
    {"family": "highway", "input": "img", "stem": ("lin", []), "body": [("preact",)],
     "head": [], "dtype": "float32", "seed": 0, "batch": 2, "channels_last": False,
     "input_grad": False, "on_grad": False, "prefill": False, "eval": False},
]  # fmt: skip
_warm = False


def warm_up() -> None:
    """Run every engine once in this process on small, known-good models, so that the
    lazy imports and first-call set-up (fx, functorch, checkpoint) are paid once here
    instead of in every forked child."""
    global _warm
    if _warm:
        return
    _warm = True
    # A forked child deadlocks in libgomp if the parent ever ran an OpenMP team of
    # several threads (tests/conftest.py sets one thread too): one intra-op thread.
    torch.set_num_threads(1)
    for spec in WARM_SPECS:
        for name, opts in engine_variants():
            check_engine(spec, name, opts)


def supported(spec: Spec, name: str, opts: dict[str, Any]) -> str | None:
    """``engine.supports(model)`` on a fresh build (in this process: cheap, no backward);
    None for "supported", and None too when it raises (the child then reports it)."""
    try:
        return leangrad.engine(name, **opts).supports(build(spec).model)
    except Exception:
        return None


def check_spec(spec: Spec) -> list[Outcome]:
    """Every engine variant on ``spec``: the supported ones in a forked child."""
    warm_up()
    out: list[Outcome] = []
    runs = []
    for name, opts in engine_variants():
        why = supported(spec, name, opts)
        if why is not None:
            out.append({"engine": engine_id(name, opts), "status": "unsupported",
                        "detail": why[:200]})  # fmt: skip
        else:
            runs.append((name, opts))
    return check_isolated(spec, runs) + out


# --- known failures ---------------------------------------------------------------------


@dataclass(frozen=True)
class Known:
    """A failure the fuzz test tolerates (xfail) until its fix lands.

    It matches an outcome when the engine label starts with one of ``engines``, the spec
    has all of ``features`` and at least one of ``any_features`` (if given), every failure
    kind of the outcome is in ``kinds``, and ``detail`` (a regex, if given) is found in
    the outcome's description.
    """

    issue_class: str
    engines: tuple[str, ...]
    kinds: frozenset[str]
    features: frozenset[str] = frozenset()
    any_features: frozenset[str] = frozenset()
    detail: str = ""

    def matches(self, features: frozenset[str], outcome: Outcome) -> bool:
        if outcome.get("status") != "fail":
            return False
        kinds = set(str(outcome.get("kind", "")).split(","))
        return (
            any(outcome["engine"].startswith(e) for e in self.engines)
            and self.features <= features
            and (not self.any_features or bool(self.any_features & features))
            and kinds <= self.kinds
            and (not self.detail or re.search(self.detail, str(outcome.get("detail"))) is not None)
        )


def spec_features(spec: Spec) -> frozenset[str]:
    try:
        return build(spec).features
    except Exception:
        return frozenset()


def classify(
    spec: Spec, outcomes: list[Outcome], known: list[Known]
) -> tuple[list[Outcome], list[tuple[Outcome, Known]]]:
    """Split the failures into (unknown, known-with-their-entry)."""
    feats = spec_features(spec)
    unknown, matched = [], []
    for o in outcomes:
        if o["status"] != "fail":
            continue
        entry = next((k for k in known if k.matches(feats, o)), None)
        if entry is None:
            unknown.append(o)
        else:
            matched.append((o, entry))
    return unknown, matched


def repro(spec: Spec, outcome: Outcome) -> str:
    """A script that reproduces one outcome (run from the repository root)."""
    name, _, rest = outcome["engine"].partition("(")
    opts = {}
    for kv in rest.rstrip(")").split(","):
        if kv:
            k, v = kv.split("=", 1)
            opts[k] = _literal(v)
    return (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from fuzz_models import check_engine\n"
        f"spec = {spec!r}\n"
        f"print(check_engine(spec, {name!r}, {opts!r}))\n"
    )


def _literal(v: str) -> Any:
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(v, v)


# --- logging and the `make fuzz` summary ------------------------------------------------


def log(spec: Spec, outcomes: list[Outcome], known: list[Known]) -> None:
    """Append one JSON line per checked spec to ``$FUZZ_LOG`` (if set)."""
    path = os.environ.get("FUZZ_LOG")
    if not path:
        return
    unknown, matched = classify(spec, outcomes, known)
    rec = {
        "spec": repr(spec),
        "outcomes": outcomes,
        "unknown": [o["engine"] for o in unknown],
        "known": [(o["engine"], k.issue_class) for o, k in matched],
    }
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def summarize(path: str) -> str:
    """The summary ``make fuzz`` prints: configurations, engine runs, refusals by error
    class, failures (known and new) by kind and engine."""
    specs: dict[str, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            specs[rec["spec"]] = rec  # shrinking reruns a spec: count it once
    status: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    fails: Counter[str] = Counter()
    known: Counter[str] = Counter()
    engines: Counter[str] = Counter()
    for rec in specs.values():
        for o in rec["outcomes"]:
            status[o["status"]] += 1
            if o["status"] not in ("unsupported", "skip"):
                engines[o["engine"]] += 1
            if o["status"] == "refused":
                refusals[o["error"]] += 1
            if o["status"] == "fail":
                tag = f"{o['engine']}: {o['kind']}"
                if o["engine"] in rec["unknown"]:
                    fails[tag] += 1
                else:
                    known[tag] += 1
    lines = [
        f"configurations checked: {len(specs)}",
        f"engine runs: {sum(engines.values())} over {len(engines)} engine variants "
        f"(ok {status['ok']}, refused {status['refused']}, failed {status['fail']}; "
        f"unsupported {status['unsupported']}, skipped {status['skip']})",
        "refusals by error class: "
        + (", ".join(f"{k} {v}" for k, v in refusals.most_common()) or "none"),
        f"failures (new): {sum(fails.values())}",
        *(f"  {v:5d}  {k}" for k, v in fails.most_common(40)),
        f"failures (known: listed in KNOWN_FAILURES): {sum(known.values())}",
        *(f"  {v:5d}  {k}" for k, v in known.most_common(40)),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "summarize":
        if not os.path.exists(sys.argv[2]):
            sys.exit(f"no fuzz log at {sys.argv[2]}")
        text = summarize(sys.argv[2])
        print(text)
        sys.exit(1 if "failures (new): 0" not in text.splitlines() else 0)
    else:
        sys.exit("usage: python tests/fuzz_models.py summarize FUZZ_LOG")



# --- the Hypothesis grammar -------------------------------------------------------------


def specs() -> Any:
    """A Hypothesis strategy of model specs (imported lazily: only the tests need it)."""
    from hypothesis import strategies as st

    act = st.tuples(st.just("act"), st.sampled_from(ACTS))
    mode = st.sampled_from(["train", "eval"])
    dropout_kind = st.sampled_from(["nn", "bits"])
    leaf = st.one_of(
        st.tuples(st.just("lin"), st.sampled_from([1, 3])),
        act,
        act,
        st.tuples(st.just("dropout"), st.sampled_from([0.25, 0.5]), dropout_kind),
        st.tuples(st.just("bn"), mode),
        st.tuples(st.just("gn"), st.sampled_from([1, 2])),
        st.tuples(st.just("ln")),
        st.tuples(st.just("rad"), st.sampled_from([1.0, 0.5]), st.sampled_from([0, None])),
        st.tuples(st.just("pool"), st.sampled_from(["bits", "rad"])),
        st.tuples(st.just("ref"), st.integers(0, 3)),
        st.tuples(st.just("tie"), st.integers(0, 3)),
        # blocks the libraries people download are made of (timm, torchvision)
        st.tuples(st.just("bnact"), mode, st.sampled_from(["relu", "silu", "hardswish"])),
        st.tuples(st.just("droppath"), st.sampled_from([0.1, 0.5])),
        st.tuples(st.just("fdrop"), st.just(0.25)),
        st.tuples(st.just("se")),
    )
    layer = st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.tuples(st.just("seq"), st.lists(inner, min_size=1, max_size=3)),
            st.tuples(st.just("res"), st.lists(inner, min_size=1, max_size=3)),
        ),
        max_leaves=6,
    )
    stem_extra = st.lists(
        st.one_of(st.tuples(st.just("bn"), mode), st.tuples(st.just("dropout"),
                  st.just(0.25), st.just("nn")), act), max_size=2)  # fmt: skip
    head = st.lists(st.one_of(act, st.tuples(st.just("dropout"), st.just(0.25), dropout_kind),
                              st.tuples(st.just("bn"), mode),
                              st.tuples(st.just("lin"), st.just(1))),
                    max_size=2)  # fmt: skip
    common = {
        "dtype": st.sampled_from(["float64", "float64", "float32"]),
        "seed": st.integers(0, 2**16),
        "batch": st.integers(2, 4),
        "channels_last": st.booleans(),
        "input_grad": st.booleans(),
        "on_grad": st.booleans(),
        "prefill": st.booleans(),
        "eval": st.sampled_from([False, False, False, True]),
    }
    seq = st.fixed_dictionaries({
        "family": st.just("seq"),
        "input": st.sampled_from(["vec", "img"]),
        "stem": st.tuples(st.just("lin"), stem_extra),
        "body": st.lists(layer, min_size=1, max_size=5),
        "head": head,
        **common,
    })  # fmt: skip
    coupling_f = st.lists(
        st.one_of(st.tuples(st.just("lin"), st.sampled_from([1, 3])), act,
                  st.tuples(st.just("bn"), mode), st.tuples(st.just("gn"), st.just(1)),
                  st.tuples(st.just("dropout"), st.just(0.25), st.just("nn")),
                  st.tuples(st.just("ref"), st.integers(0, 3))),
        min_size=1, max_size=3)  # fmt: skip
    chain_layer = st.one_of(
        st.tuples(st.just("coupling"), coupling_f),
        st.tuples(st.just("coupling"), coupling_f),
        st.tuples(st.just("coupling_ref"), st.integers(0, 3)),
        st.tuples(st.just("leaky"), st.sampled_from([0.1, 0.5])),
        st.tuples(st.just("tanh")),
        st.tuples(st.just("swap")),
        st.tuples(st.just("s2d")),
        st.tuples(st.just("subconv"), st.sampled_from(["down", "same"])),
        st.tuples(st.just("fragconv")),
        st.tuples(st.just("ref"), st.integers(0, 3)),
    )
    chain = st.fixed_dictionaries({
        "family": st.just("chain"),
        "input": st.sampled_from(["img", "img", "vec"]),
        "stem": st.one_of(st.tuples(st.just("lin"), stem_extra),
                          st.tuples(st.just("repeat"), stem_extra)),
        "body": st.lists(chain_layer, min_size=1, max_size=5),
        "head": head,
        **common,
    })  # fmt: skip
    block_img = st.one_of(st.tuples(st.sampled_from(["preact", "postrelu"])),
                          st.tuples(st.just("ref"), st.integers(0, 3)))  # fmt: skip
    block_tok = st.one_of(st.tuples(st.sampled_from(["preln", "postln"]),
                                    st.sampled_from(["mlp", "attention"])),
                          st.tuples(st.just("ref"), st.integers(0, 3)))  # fmt: skip
    hw_img = st.fixed_dictionaries({
        "family": st.just("highway"), "input": st.just("img"),
        "stem": st.tuples(st.just("lin"), stem_extra),
        "body": st.lists(block_img, min_size=1, max_size=3), "head": head, **common,
    })  # fmt: skip
    hw_tok = st.fixed_dictionaries({
        "family": st.just("highway"), "input": st.just("tokens"),
        "stem": st.tuples(st.just("lin"), st.lists(act, max_size=1)),
        "body": st.lists(block_tok, min_size=1, max_size=3), "head": st.just([]), **common,
    })  # fmt: skip
    hw_time = st.fixed_dictionaries({
        "family": st.just("highway"), "input": st.just("time"),
        "stem": st.tuples(st.just("lin"), st.lists(act, max_size=1)),
        "body": st.tuples(st.tuples(st.sampled_from(["gru", "lstm"]), st.booleans())),
        "head": st.just([]), **common,
    })  # fmt: skip
    families = {"seq": seq, "chain": chain, "highway": st.one_of(hw_img, hw_tok, hw_time)}
    return st.sampled_from(list(families)).flatmap(families.__getitem__)
