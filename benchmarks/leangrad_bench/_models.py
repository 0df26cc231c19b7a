"""The bench's model registry: every model a suite runs, one name each.

:func:`build` ``(name, size, *, batch=None, device="cpu")`` gives a :class:`Workload`: the
model, its offline batch and its loss, the same weights and batch for the same name and
size (seeded; built on the CPU from the seed, then moved), so a fresh process rebuilds
the exact step. :data:`MODELS` holds the names:

- the paper suites' small models from :mod:`leangrad.models`: ``mlp``, ``conv``,
  ``small_cnn``, ``rnn``, ``revnet``, ``subcnn``, ``frag1d``, ``frag2d``, sized by a flat
  configuration (their size keys, ``classes``, ``dtype``, ``seed``, and ``data``:
  ``"synthetic"`` Gaussian inputs or ``"digits"``, scikit-learn's 8x8 digits); the suite
  files name them in configuration dicts (:func:`leangrad_bench._workloads.build`);
- the ``zoo`` suite's architectures as written (:mod:`leangrad.zoo`, batches by
  :func:`leangrad.zoo.batch`): ``resnet``, ``gpt``, ``bert``, ``lstm_lm``, ``gru_lm``,
  ``highway_gru_lm``, ``vit``, ``llama``, ``gpt_50k`` (the zoo's GPT at GPT-2's vocabulary),
  ``unet``; opt-in, Hugging Face models (:data:`HF_MODELS`, the ``[hf]`` extra) and timm
  ones (:data:`TIMM_MODELS`, the ``[vision]`` extra);
- the ``blocks`` and ``plan`` suites' models (those suites' files call them ``resnet``,
  ``gpt`` and ``mlp``): ``blocks_resnet`` and ``blocks_gpt``, the zoo's ResNet and GPT on
  another batch (generator seed 1) with a plain loss, not declared per example (the
  planner would otherwise offer gradient accumulation, which those suites' records
  predate), and ``dropout_mlp``, an MLP with dropout as an ``nn.Sequential``; each with
  its stem, blocks and head (:attr:`Workload.parts`) for the hand-written PyTorch peers;
- the RAD suites' networks (Oktay et al., ICLR 2021; :func:`rad_network`): ``rad_mlp``,
  ``rad_cnn``, ``rad_irnn``, sized by the images' ``side`` (28 for MNIST), built like the
  paper models above (``seed``, ``dtype``, ``data``);
- the ``fad`` suite's models (paper section V-A, scaled to CPU), whose activation
  (``activation``: ``swish``, ``gelu`` or ``mish``) is written out of primitives (Table I)
  so autograd saves its intermediates unless FAD nests them: ``fad_resnet``
  (:class:`ActResNet`) and ``fad_bert`` (:class:`ActEncoder`); their batches of any size
  come from one generator by :func:`fad_batch`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from leangrad import _errors as errors
from leangrad import hf, models, zoo
from leangrad.loss import PerExample, per_example

__all__ = [
    "ACTIVATIONS",
    "HF_MODELS",
    "MODELS",
    "TIMM_MODELS",
    "Act",
    "ActEncoder",
    "ActResNet",
    "Inputs",
    "LossFn",
    "Parts",
    "RowRNN",
    "Workload",
    "build",
    "dtype_of",
    "fad_batch",
    "gpt_parts",
    "rad_network",
    "resnet_parts",
]

LossFn = Callable[[Any], torch.Tensor]
Inputs = torch.Tensor | tuple[torch.Tensor, ...]
Parts = tuple[Callable[[], torch.Tensor], list[nn.Module], Callable[[torch.Tensor], torch.Tensor]]
"""A model cut for the hand-written peers: its stem (a thunk), its blocks, its head."""
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training step's ingredients: ``loss_fn(model(inputs))``.

    Attributes:
        model: the model, in training mode.
        inputs: one tensor, or a tuple (``model(*inputs)``: the paper models' one input,
            the U-Nets' sample and timestep).
        loss_fn: the loss of the model's output; declared a mean over examples
            (:func:`leangrad.loss.per_example`) where it is one, so ``accumulate`` may
            split it.
        targets: the labels, for models whose loss holds one tensor of them (the paper
            models; a tracker's baseline), else ``None``.
        config: the name and size it was built from (``batch`` as built).
        parts: the stem, blocks and head of the ``blocks`` and ``plan`` suites' models
            (``None`` elsewhere; the zoo's PyTorch recipes find theirs by model type).
    """

    model: nn.Module
    inputs: Inputs
    loss_fn: LossFn
    targets: torch.Tensor | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    parts: Parts | None = None

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


Builder = Callable[[Mapping[str, Any], int, str | torch.device], Workload]
"""``(size, batch, device) -> Workload`` of one registry name."""


def dtype_of(config: Mapping[str, Any]) -> torch.dtype:
    name = config.get("dtype", "float32")
    try:
        return _DTYPES[name]
    except KeyError:
        raise errors.UnknownNameError(
            errors.UNKNOWN_NAME.format(kind="dtype", name=name, known=", ".join(_DTYPES))
        ) from None


# --- the paper suites' models: (model, one example's input shape) from a configuration ---

Shaped = Callable[[Mapping[str, Any]], tuple[nn.Module, tuple[int, ...]]]


def _mlp(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
    shape = (c.get("in_features", 64),)
    return models.mlp(shape[0], c.get("width", 64), c["depth"], c.get("classes", 10)), shape


def _conv(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
    size, cin = c.get("size", 16), c.get("in_channels", 1)
    model = models.conv_stack(cin, c.get("channels", 8), c["depth"], c.get("classes", 10))
    return model, (cin, size, size)


def _small_cnn(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
    return models.small_cnn(c.get("classes", 10), channels=c.get("channels", 8)), (1, 8, 8)


def _rnn(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
    feats = c.get("features", 8)
    model = models.rnn_classifier(feats, c.get("hidden", 32), c.get("classes", 10))
    return model, (c.get("length", 16), feats)


def _revnet(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
    size, cin = c.get("size", 8), c.get("in_channels", 1)
    model = models.revnet(
        cin, c.get("channels", 8), c.get("classes", 10),
        blocks=c.get("blocks", 3), layers_per_block=c.get("depth", 1),
        activation=c.get("activation", "relu"), batchnorm=c.get("batchnorm", False),
    )  # fmt: skip
    return model, (cin, size, size)


def _subcnn(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
    size, cin = c.get("size", 32), c.get("in_channels", 3)
    model = models.submersive_cnn(
        cin, c.get("channels", 16), c["depth"], c.get("classes", 10), stem=c.get("stem", "conv")
    )
    return model, (cin, size, size)


def _fragmental(rank: int) -> Shaped:
    """``models.fragmental_cnn1d`` (``length``) or ``..._cnn2d`` (``size``)."""
    factory = models.fragmental_cnn1d if rank == 1 else models.fragmental_cnn2d

    def fragmental_model(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
        cin = c.get("in_channels", 3)
        spatial = (c.get("length", 512),) if rank == 1 else (c.get("size", 64),) * 2
        model = factory(
            cin,
            c.get("channels", 64 if rank == 1 else 16),
            c["depth"],
            c.get("classes", 10),
            kernel_size=c.get("kernel_size", 3),
            negative_slope=c.get("negative_slope", 0.5),
            stem=c.get("stem", "conv"),
        )
        return model, (cin, *spatial)

    return fragmental_model


def _cross_entropy(x: torch.Tensor, y: torch.Tensor) -> LossFn:
    """Cross-entropy over the labels: declared per example where they hold one row per
    example of ``x`` (so ``accumulate`` can split them), a plain function otherwise."""
    if x.dim() and y.dim() and x.shape[0] == y.shape[0]:
        return per_example(F.cross_entropy, y)
    return lambda output: F.cross_entropy(output, y)


def _paper(name: str, shaped: Shaped) -> Builder:
    """A paper model: weights from ``seed``, inputs and labels from ``seed + 1`` (or the
    first ``batch`` digits, resized to the model's image size), in ``dtype``."""

    def build_paper(c: Mapping[str, Any], n: int, device: str | torch.device) -> Workload:
        dtype = dtype_of(c)
        seed = int(c.get("seed", 0))
        torch.manual_seed(seed)
        model, shape = shaped(c)
        model = model.to(device=device, dtype=dtype)
        gen = torch.Generator().manual_seed(seed + 1)
        if c.get("data", "synthetic") == "digits":
            from leangrad.data import digits

            ds = digits(dtype=dtype, flatten=name == "mlp")
            x, y = ds.x[:n], ds.y[:n]
            if shape[1:] != tuple(x.shape[2:]) and len(shape) == 3:  # resize the 8x8 images
                x = F.interpolate(x, size=shape[1:], mode="bilinear")
        else:
            x = torch.randn(n, *shape, generator=gen).to(dtype)
            y = torch.randint(0, int(c.get("classes", 10)), (n,), generator=gen)
        x, y = x.to(device), y.to(device)
        return Workload(model, (x,), _cross_entropy(x, y), targets=y)

    return build_paper


# --- the zoo's architectures and the Hugging Face models ---

_TOKENS = ("vocab", "dim", "layers", "heads", "context")
_RNN = ("vocab", "embed", "hidden", "layers")
_ZOO: dict[str, tuple[Callable[..., nn.Module], tuple[str, ...]]] = {
    "resnet": (zoo.resnet, ("depth", "width")),
    "gpt": (zoo.gpt, _TOKENS),
    "bert": (zoo.bert, _TOKENS),
    "lstm_lm": (functools.partial(zoo.rnn_lm, "lstm"), _RNN),
    "gru_lm": (functools.partial(zoo.rnn_lm, "gru"), _RNN),
    "highway_gru_lm": (zoo.highway_gru_lm, _RNN),
    "vit": (zoo.vit, ("image", "patch", "dim", "layers", "heads")),
    "llama": (zoo.llama, (*_TOKENS, "hidden")),
    "gpt_50k": (zoo.gpt, _TOKENS),
    "unet": (zoo.unet, ("image", "in_channels", "widths", "groups", "attention_at", "head_dim")),
}
"""Zoo name -> (constructor, its size keys); ``gpt_50k`` is the zoo's GPT at a real
vocabulary, sized by the suite."""
HF_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hf_gpt2": ("gpt2", _TOKENS),
    "hf_llama": ("llama", ("vocab", "dim", "layers", "heads", "kv_heads", "ffn", "context")),
    "hf_bert": ("bert", _TOKENS),
    "hf_unet": ("unet", ("image", "widths", "layers_per_block", "groups", "head_dim")),
}
"""Opt-in zoo model name -> (:data:`leangrad.hf.MODELS` name, its size keys); needs the
``[hf]`` extra. Float32, the libraries' defaults (SDPA attention, dropout as configured)."""
TIMM_MODELS: dict[str, str] = {
    "timm_resnet50": "resnet50",
    "timm_convnext_tiny": "convnext_tiny",
    "timm_vit_small": "vit_small_patch16_224",
}
"""Opt-in zoo model name -> timm architecture (the ``[vision]`` extra), random weights, as
``timm.create_model`` builds it; size keys ``image``, ``drop_path`` (timm's
``drop_path_rate``: stochastic depth), ``classes`` (default 1000) and ``batch``."""


def _length(size: Mapping[str, Any]) -> int:
    """A token model's sequence length: ``length``, else ``context``, else 64."""
    return int(size.get("length", size.get("context", 64)))


def _zoo_model(name: str, size: Mapping[str, Any], device: str | torch.device) -> nn.Module:
    ctor, keys = _ZOO[name]
    torch.manual_seed(0)
    model = ctor(**{k: size[k] for k in keys if k in size})
    if torch.device(device).type != "cpu":  # (fake tensors, built under a mode, stay put)
        model.to(device)
    return model


def _zoo(name: str) -> Builder:
    def build_zoo(size: Mapping[str, Any], n: int, device: str | torch.device) -> Workload:
        model = _zoo_model(name, size, device)
        image = int(size.get("image", 32))
        x, loss_fn = zoo.batch(name, model, n, length=_length(size), image=image)
        return Workload(model, x, loss_fn)

    return build_zoo


def _hf(name: str) -> Builder:
    base, keys = HF_MODELS[name]

    def build_hf(size: Mapping[str, Any], n: int, device: str | torch.device) -> Workload:
        opts = {k: tuple(size[k]) if k == "widths" else size[k] for k in keys if k in size}
        model: nn.Module = hf.model(base, **opts, seed=0)
        if torch.device(device).type != "cpu":
            model.to(device)
        xs, loss_fn = hf.batch(base, model, n, length=_length(size))
        return Workload(model, xs, loss_fn)

    return build_hf


def _timm(name: str) -> Builder:
    arch = TIMM_MODELS[name]

    def build_timm(size: Mapping[str, Any], n: int, device: str | torch.device) -> Workload:
        try:
            import timm
        except ImportError as err:
            raise errors.OptionalDependencyError(errors.MISSING_EXTRA.format(
                feature=f"the zoo's {name}", package="timm", extra="vision")) from err
        image, classes = int(size.get("image", 224)), int(size.get("classes", 1000))
        extra: dict[str, Any] = {"img_size": image} if arch.startswith("vit") else {}
        torch.manual_seed(0)
        model = timm.create_model(arch, pretrained=False, num_classes=classes,
                                  drop_path_rate=float(size.get("drop_path", 0.0)), **extra)
        model.to(device)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(n, 3, image, image, generator=gen).to(device)
        y = torch.randint(0, classes, (n,), generator=gen).to(device)
        return Workload(model, x, per_example(F.cross_entropy, y))

    return build_timm


# --- the blocks and plan suites' models, cut into stem, blocks and head ---


def gpt_parts(model: zoo.GPT, idx: torch.Tensor) -> Parts:
    """The zoo's GPT as stem (embeddings), blocks and head (final norm and LM head)."""
    t = idx.shape[1]
    return (lambda: model.tok(idx) + model.pos[:t], list(model.blocks),
            lambda x: model.head(model.ln_f(x)))  # fmt: skip


def resnet_parts(model: zoo.ResNet, x: torch.Tensor) -> Parts:
    """The zoo's ResNet as stem, basic blocks (every stage's) and head (pool, linear)."""
    blocks = [b for stage in model.stages for b in stage.children()]
    return (lambda: model.stem(x), blocks,
            lambda h: model.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)))  # fmt: skip


def _peer(name: str, parts: Callable[[Any, torch.Tensor], Parts]) -> Builder:
    """Zoo model ``name`` on a batch drawn from generator seed 1, its loss plain."""

    def build_peer(size: Mapping[str, Any], n: int, device: str | torch.device) -> Workload:
        model = _zoo_model(name, size, device)
        image = int(size.get("image", 32))
        x, declared = zoo.batch(name, model, n, length=_length(size), image=image, seed=1)
        assert isinstance(declared, PerExample) and isinstance(x, torch.Tensor)
        fn, targets = declared.fn, declared.targets
        return Workload(model, x, lambda out: fn(out, *targets), parts=parts(model, x))

    return build_peer


def _dropout_mlp(size: Mapping[str, Any], n: int, device: str | torch.device) -> Workload:
    """``features`` -> ``layers`` x (linear ``width``, ReLU, dropout 0.1) -> 10 classes."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    w, features = size["width"], size["features"]
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(features, w), nn.ReLU(), nn.Dropout(0.1))]
    blocks += [nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Dropout(0.1))
               for _ in range(size["layers"] - 1)]  # fmt: skip
    model = nn.Sequential(*blocks, nn.Linear(w, 10)).to(device)
    x = torch.randn(n, features, generator=gen).to(device)
    y = torch.randint(0, 10, (n,), generator=gen).to(device)
    parts: Parts = (lambda: x, list(model)[:-1], model[-1])
    return Workload(model, x, lambda out: F.cross_entropy(out, y), parts=parts)


# --- the RAD suites' networks ---


class RowRNN(nn.Module):
    """An IRNN reading a 28x28 image row by row (28 steps of 28 pixels), then a linear head."""

    def __init__(self, hidden: int, *, rows: int = 28) -> None:
        super().__init__()
        self.cell = nn.RNNCell(rows, hidden, nonlinearity="relu")
        self.head = nn.Linear(hidden, 10)
        with torch.no_grad():  # Appendix A: identity W_hh, N(0, 0.001) W_ih, zero biases
            self.cell.weight_hh.copy_(torch.eye(hidden))
            self.cell.weight_ih.normal_(0.0, 0.001)
            self.cell.bias_ih.zero_()
            self.cell.bias_hh.zero_()

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        h = None
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


def rad_network(kind: str, *, side: int = 28) -> nn.Module:
    """``mlp``: Appendix A's 784-300-300-300-10 ReLU net; ``cnn``: a small ReLU/avg-pool
    convnet (a CPU-sized stand-in for the paper's CIFAR-10 net); ``irnn``: :class:`RowRNN`
    with 100 hidden units. ``side``: the images' side (28 for MNIST, 8 for digits).
    Weights from the global generator as the caller left it (the registry's ``rad_<kind>``
    seeds it)."""
    if kind == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(side * side, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(),
            nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 10),
        )  # fmt: skip
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
            nn.Flatten(), nn.Linear(16 * (side // 4) ** 2, 10),
        )  # fmt: skip
    if kind == "irnn":
        return RowRNN(100, rows=side)
    raise ValueError(f"model must be 'mlp', 'cnn' or 'irnn', got {kind!r}")


def _rad(kind: str) -> Shaped:
    """:func:`rad_network` ``kind`` on one-channel images of side ``side`` (default 28)."""

    def rad_model(c: Mapping[str, Any]) -> tuple[nn.Module, tuple[int, ...]]:
        side = int(c.get("side", 28))
        return rad_network(kind, side=side), (1, side, side)

    return rad_model


# --- the fad suite's models: activations written out of primitives (Table I) ---

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def swish(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` (Table I)."""
    return x * torch.sigmoid(x)


def gelu_tanh(x: Tensor) -> Tensor:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (Table I)."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def mish(x: Tensor) -> Tensor:
    """``x * tanh(softplus(x))`` (Table I)."""
    return x * torch.tanh(F.softplus(x))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "swish": swish,
    "gelu": gelu_tanh,
    "mish": mish,
}


class Act(nn.Module):
    """A composite activation; ``recompute=True`` wraps it in ``torch.utils.checkpoint``
    (the paper's recomputation baseline: keep the input, rebuild intermediates in backward)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = ACTIVATIONS[name]
        self.recompute = False

    def forward(self, x: Tensor) -> Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self.fn, x, use_reentrant=False)
        return self.fn(x)


class _ActBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, act: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.act1 = Act(act)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.act2 = Act(act)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        return self.act2(self.bn2(self.conv2(out)) + self.short(x))


class ActResNet(nn.Module):
    """Stem conv, ``stages`` stages of ``blocks`` basic blocks (widths c, 2c, ...), head."""

    def __init__(self, *, act: str, channels: int = 16, stages: int = 2, blocks: int = 1,
                 in_channels: int = 3, classes: int = 10) -> None:  # fmt: skip
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(channels), Act(act))  # fmt: skip
        layers: list[nn.Module] = []
        c = channels
        for s in range(stages):
            cout = channels * 2**s
            for b in range(blocks):
                layers.append(_ActBlock(c, cout, 2 if (s > 0 and b == 0) else 1, act))
                c = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


class _ActLayer(nn.Module):
    """Post-LN transformer layer as in BERT: attention, add & norm, FFN with activation."""

    def __init__(self, d: int, heads: int, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.act = Act(act)
        self.ff2 = nn.Linear(4 * d, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, dh).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dh), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.proj(y))
        return self.ln2(x + self.ff2(self.act(self.ff1(x))))


class ActEncoder(nn.Module):
    """Token + position embeddings, ``layers`` post-LN layers, mean-pool, linear head."""

    def __init__(self, *, act: str, d: int = 64, heads: int = 4, layers: int = 2,
                 vocab: int = 128, seq: int = 32, classes: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.layers = nn.Sequential(*[_ActLayer(d, heads, act) for _ in range(layers)])
        self.head = nn.Linear(d, classes)

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.layers(self.tok(ids) + self.pos(pos))
        return self.head(h.mean(dim=1))


_FAD: dict[str, tuple[Callable[..., nn.Module], tuple[str, ...]]] = {
    "fad_resnet": (ActResNet, ("channels", "stages", "blocks")),
    "fad_bert": (ActEncoder, ("d", "heads", "layers", "seq")),
}
"""fad model name -> (constructor, its size keys besides ``activation``)."""


def fad_batch(name: str, size: Mapping[str, Any], n: int,
              gen: torch.Generator) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``n`` examples of fad model ``name`` drawn from ``gen``: Gaussian ``side``-pixel RGB
    images (default 16) and 10 classes, or ``seq`` token ids below 128 (default 32) and 2
    classes. The suite draws the batches of all its sizes from one such stream."""
    if name == "fad_resnet":
        side = size.get("side", 16)
        x = torch.randn(n, 3, side, side, generator=gen)
        return x, torch.randint(0, 10, (n,), generator=gen)
    ids = torch.randint(0, 128, (n, size.get("seq", 32)), generator=gen)
    return ids, torch.randint(0, 2, (n,), generator=gen)


def _fad(name: str) -> Builder:
    """A fad model with ``activation`` (default ``swish``): weights from ``seed`` (default
    0), the batch the first of :func:`fad_batch`'s stream from ``seed + 1``."""
    ctor, keys = _FAD[name]

    def build_fad(size: Mapping[str, Any], n: int, device: str | torch.device) -> Workload:
        seed = int(size.get("seed", 0))
        torch.manual_seed(seed)
        model = ctor(act=size.get("activation", "swish"), **{k: size[k] for k in keys if k in size})
        x, y = fad_batch(name, size, n, torch.Generator().manual_seed(seed + 1))
        x, y = x.to(device), y.to(device)
        return Workload(model.to(device), (x,), _cross_entropy(x, y), targets=y)

    return build_fad


_PAPER: dict[str, Shaped] = {
    "mlp": _mlp,
    "conv": _conv,
    "small_cnn": _small_cnn,
    "rnn": _rnn,
    "revnet": _revnet,
    "subcnn": _subcnn,
    "frag1d": _fragmental(1),
    "frag2d": _fragmental(2),
    **{f"rad_{kind}": _rad(kind) for kind in ("mlp", "cnn", "irnn")},
}
MODELS: dict[str, Builder] = {
    **{name: _paper(name, shaped) for name, shaped in _PAPER.items()},
    **{name: _zoo(name) for name in _ZOO},
    **{name: _hf(name) for name in HF_MODELS},
    **{name: _timm(name) for name in TIMM_MODELS},
    "blocks_resnet": _peer("resnet", resnet_parts),
    "blocks_gpt": _peer("gpt", gpt_parts),
    "dropout_mlp": _dropout_mlp,
    **{name: _fad(name) for name in _FAD},
}
"""Every bench model: name -> builder (module docstring)."""


def build(
    name: str,
    size: Mapping[str, Any],
    *,
    batch: int | None = None,
    device: str | torch.device = "cpu",
) -> Workload:
    """Model ``name`` (:data:`MODELS`) at ``size`` (its size keys and ``batch``, default 32;
    token models: ``length`` or ``context``), ``batch`` overriding the size's, on
    ``device`` (built on the CPU from the same seed, then moved: the same weights and
    batch on every device)."""
    if name not in MODELS:
        known = ", ".join(MODELS)
        raise errors.UnknownNameError(errors.UNKNOWN_NAME.format(kind="model", name=name,
                                                                 known=known))  # fmt: skip
    n = int(size.get("batch", 32) if batch is None else batch)
    config = {"model": name, **size, **({} if batch is None else {"batch": n})}
    return dataclasses.replace(MODELS[name](size, n, device), config=config)
