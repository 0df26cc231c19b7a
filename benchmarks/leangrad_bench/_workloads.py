"""The paper suites' configurations (plain data) turned into workloads.

A configuration is a flat dict naming a model of the registry
(:mod:`leangrad_bench._models`) and its size, e.g.
``{"model": "mlp", "depth": 4, "width": 256, "batch": 512, "dtype": "float32"}``, so
suites stay data (TOML) and a fresh process can rebuild the exact same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import _models
from ._models import Workload, dtype_of

__all__ = ["Workload", "build", "dtype_of"]


def build(config: Mapping[str, Any], *, device: str | torch.device = "cpu") -> Workload:
    """The registry's model ``config["model"]`` with ``config`` as its size
    (:func:`leangrad_bench._models.build`): for the paper models, ``seed``, ``dtype`` and
    ``data`` (``"synthetic"`` Gaussian inputs, default, or ``"digits"``, the first
    ``batch`` scikit-learn digits) besides the size keys."""
    return _models.build(config.get("model", ""), config, device=device)
