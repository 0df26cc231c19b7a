"""Workloads: a benchmark configuration (plain data) turned into model, inputs and loss.

A configuration is a flat dict, e.g.
``{"model": "mlp", "depth": 4, "width": 256, "batch": 512, "dtype": "float32"}``,
so suites stay data (TOML) and a fresh process can rebuild the exact same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _errors as errors
from .. import models

__all__ = ["MODELS", "Workload", "build", "dtype_of"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass
class Workload:
    """One training step's ingredients: ``loss_fn(model(*inputs))``."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor
    config: dict[str, Any]

    @property
    def loss_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Cross-entropy over the targets: declared per example
        (:func:`leangrad.loss.per_example`) where the targets hold one row per example of
        the inputs, so ``accumulate`` can split them; a plain function otherwise."""
        from ..loss import per_example

        xs = self.inputs
        if xs and xs[0].dim() and self.targets.dim() and xs[0].shape[0] == self.targets.shape[0]:
            return per_example(F.cross_entropy, self.targets)
        targets = self.targets
        return lambda output: F.cross_entropy(output, targets)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def dtype_of(config: Mapping[str, Any]) -> torch.dtype:
    name = config.get("dtype", "float32")
    try:
        return _DTYPES[name]
    except KeyError:
        raise errors.UnknownNameError(
            errors.UNKNOWN_NAME.format(kind="dtype", name=name, known=", ".join(_DTYPES))
        ) from None


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


def _fragmental(rank: int) -> Callable[[Mapping[str, Any]], tuple[nn.Module, tuple[int, ...]]]:
    """Workload builder of ``models.fragmental_cnn1d`` (``length``) or ``..._cnn2d`` (``size``)."""
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


MODELS: dict[str, Callable[[Mapping[str, Any]], tuple[nn.Module, tuple[int, ...]]]] = {
    "mlp": _mlp,
    "conv": _conv,
    "small_cnn": _small_cnn,
    "rnn": _rnn,
    "revnet": _revnet,
    "subcnn": _subcnn,
    "frag1d": _fragmental(1),
    "frag2d": _fragmental(2),
}


def build(config: Mapping[str, Any], *, device: str | torch.device = "cpu") -> Workload:
    """Build the workload a configuration describes, deterministically from ``seed``.

    Keys: ``model`` (one of :data:`MODELS`), its size keys, ``batch``, ``dtype``,
    ``seed`` and ``data``: ``"synthetic"`` (Gaussian inputs, default) or
    ``"digits"`` (the first ``batch`` real scikit-learn digits; 8x8 images).
    """
    name = config.get("model")
    if name not in MODELS:
        raise errors.UnknownNameError(
            errors.UNKNOWN_NAME.format(kind="model", name=name, known=", ".join(MODELS))
        )
    dtype = dtype_of(config)
    seed = int(config.get("seed", 0))
    torch.manual_seed(seed)
    model, shape = MODELS[name](config)
    model = model.to(device=device, dtype=dtype)
    batch = int(config.get("batch", 32))
    classes = int(config.get("classes", 10))
    gen = torch.Generator().manual_seed(seed + 1)
    if config.get("data", "synthetic") == "digits":
        from ..data import digits

        ds = digits(dtype=dtype, flatten=name == "mlp")
        x, y = ds.x[:batch], ds.y[:batch]
        if shape[1:] != tuple(x.shape[2:]) and len(shape) == 3:  # resize the 8x8 images
            x = torch.nn.functional.interpolate(x, size=shape[1:], mode="bilinear")
    else:
        x = torch.randn(batch, *shape, generator=gen).to(dtype)
        y = torch.randint(0, classes, (batch,), generator=gen)
    return Workload(model, (x.to(device),), y.to(device), dict(config))
