"""Lets PyPI's torchvision import beside PyTorch's CPU wheel (installed by the Makefile).

PyPI's torchvision wheels are CUDA builds: beside torch's CPU wheel their compiled ops
cannot load (``libtorch_cuda.so`` is missing), torchvision then still registers fake
kernels for two of those ops, ``torchvision::nms`` and ``torchvision::qnms``, and
``import torchvision`` fails with "operator torchvision::nms does not exist" — and with
it timm and transformers, which import torchvision when it is installed. torchvision's
models are plain Python and need none of its compiled ops.

This module, imported at start-up by a ``.pth`` file, watches for the import of
``torchvision._meta_registrations``; just before it runs, where torchvision found no
compiled ops, it declares the two ops' schemas so the fake kernels have something to
attach to. Calling them still fails, as it would without this module. Where torchvision's
ops load (a matching CUDA or CPU build), it does nothing. It never imports torch itself.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_kept: list[Any] = []


def _declare() -> None:
    import torch

    ext = sys.modules.get("torchvision.extension")
    if ext is None or ext._has_ops():
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}") and not hasattr(
                torch.ops.torchvision, name):  # fmt: skip
            lib.define(schema)
    _kept.append(lib)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == _TARGET:
            with contextlib.suppress(Exception):  # never break an import that would run
                _declare()
        return None  # the ordinary finders load the module


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
