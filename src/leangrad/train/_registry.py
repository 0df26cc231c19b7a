"""Named models and data sets for :func:`leangrad.train.fit` and ``leangrad train``.

A model or data name is either registered here or an importable
``"module:factory"`` spec. Model factories get the data's example shape and
class count, so ``--model mlp --data mnist5k`` needs no sizes; ``--model-opt``
keywords override the defaults. Unknown names list the known ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .. import _errors as errors
from .. import data as _data
from .. import models as _models
from ..data._tokens import text_data

__all__ = [
    "DataInfo",
    "build_model",
    "data_info",
    "data_names",
    "example_batch",
    "load_data",
    "model_names",
    "parse_options",
]

NEEDS_IMAGES = (
    "model {model!r} needs image inputs (N, C, H, W); data {data!r} has examples of shape "
    "{shape}. Use image data (digits, mnist5k) or a model for any shape (mlp)"
)
NEEDS_TOKENS = (
    "model {model!r} needs int64 token ids (N, T) and sequence targets; data {data!r} has "
    "{dtype} examples of shape {shape}. Use --data text or text:PATH"
)
NEEDS_FLOATS = (
    "model {model!r} needs float inputs; data {data!r} holds integer token ids. "
    "Use a token model (gru_lm) or float data"
)
BAD_SPEC = "{kind} spec {spec!r}: cannot import {target!r} ({error}); use 'package.module:factory'"
NOT_A = "{kind} factory {spec!r} returned {type}, not a {want}"
NOT_CALLABLE = (
    "{kind} spec {spec!r} names a {type}, not a factory; name a function or class, "
    "'package.module:factory'"
)
BAD_FACTORY_CALL = (
    "{kind} factory {spec!r} cannot be called with {given} ({error}); give its arguments "
    "with {option} KEY=VALUE"
)
BAD_OPTION = "option {item!r} is not key=value"
BAD_MODEL_OPTION = (
    "--model-opt: model {spec!r} does not take that option ({error}); see its factory's "
    "keyword arguments"
)
BAD_MODEL_VALUE = (
    "--model-opt: model {spec!r} cannot be built with {opts} ({error}); check the values"
)
BAD_DATA = "--data {spec!r}: {error}"
BAD_DATA_VALUE = "--data-opt (data {spec!r}): {error}"
BAD_DATA_OPTION = (
    "--data-opt: data {spec!r} does not take that option ({error}); see its loader's keyword "
    "arguments (e.g. synthetic: shape=3,32,32, num_classes=10)"
)


class DataMismatchError(errors.EngineInputError):
    """A registered model that cannot take the data's examples (whatever its options)."""


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """What a model factory needs to know about the data.

    Attributes:
        name: data spec, e.g. ``"digits"``.
        input_shape: shape of one example (without the batch dimension).
        num_classes: classes (or vocabulary size for text).
        tokens: inputs are integer ids (text), not floats.
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    tokens: bool


def parse_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``["segments=4", "mode=pure"]`` -> ``{"segments": 4, "mode": "pure"}``.

    Values are read as int, float, ``true``/``false``, ``none``, a comma-separated list of
    numbers as a tuple (``shape=3,32,32`` -> ``(3, 32, 32)``), else kept as strings.
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise errors.EngineInputError(BAD_OPTION.format(item=item))
        out[key.strip()] = _value(raw.strip())
    return out


def _value(raw: str) -> Any:
    if "," in raw:
        parts = [_value(p.strip()) for p in raw.split(",") if p.strip()]
        if parts and all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts):
            return tuple(parts)
        return raw
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def _import_module(module: str) -> ModuleType:
    """Import ``module``, from the current directory too (as ``python -m`` would: the
    ``leangrad`` console script does not put it on ``sys.path``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        cwd = os.getcwd()
        top = module.partition(".")[0]
        if err.name != top or cwd in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, cwd)
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as again:
            if again.name == top:  # not here either: leave sys.path as it was
                sys.path.remove(cwd)
                raise ModuleNotFoundError(
                    f"No module named {top!r} on sys.path or in the current directory "
                    f"{cwd}; run from the folder that holds {top}.py, or add its folder to "
                    "PYTHONPATH",
                    name=top,
                ) from None
            raise


def _import(spec: str, kind: str) -> Callable[..., Any]:
    module, _, attr = spec.partition(":")
    try:
        factory = getattr(_import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise errors.UnknownNameError(
            BAD_SPEC.format(kind=kind, spec=spec, target=spec, error=err)
        ) from err
    if not callable(factory):
        raise errors.OptionError(NOT_CALLABLE.format(kind=kind, spec=spec,
                                                type=type(factory).__name__))  # fmt: skip
    return factory


def _signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    """The factory's signature, or None where Python cannot tell (some builtins)."""
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


def _check_call(spec: str, kind: str, option: str, factory: Callable[..., Any],
                kwargs: dict[str, Any]) -> None:  # fmt: skip
    """Refuse, before calling it, a call the factory's signature does not take (a missing
    required argument, an unknown keyword), naming the option that gives its arguments."""
    sig = _signature(factory)
    if sig is None:
        return
    try:
        sig.bind(**kwargs)
    except TypeError as err:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments"
        raise errors.OptionError(BAD_FACTORY_CALL.format(kind=kind, spec=spec, given=given,
                                                    error=err, option=option)) from None


# -- data ------------------------------------------------------------------------------


def data_names() -> list[str]:
    """Registered data names: those of :func:`leangrad.data.available` and ``text``."""
    return sorted({*_data.available(), "text"})


def load_data(spec: str, **options: Any) -> _data.Dataset:
    """Load a data set by name, ``text:PATH`` (files or a directory on disk) or
    ``module:factory`` (a callable returning a :class:`leangrad.data.Dataset`).

    Args:
        spec: the data spec.
        **options: keyword arguments of the loader (e.g. ``length=32`` for text, or
            ``tokenizer="bpe:50257"`` for token windows: :func:`leangrad.data.text_tokens`).

    Raises:
        UnknownNameError: an unknown name, or a spec that does not import.
        OptionError: an option the loader does not take or whose value it refuses, or a
            path that does not exist, with the option named.
    """
    try:
        return _load(spec, **options)
    except TypeError as err:
        if "unexpected keyword argument" not in str(err):
            raise
        raise errors.OptionError(BAD_DATA_OPTION.format(spec=spec, error=err)) from None
    except (ValueError, FileNotFoundError) as err:  # a value or a path the loader refuses
        if isinstance(err, errors.LeangradError):
            raise
        bad = BAD_DATA_VALUE if options and not isinstance(err, FileNotFoundError) else BAD_DATA
        raise errors.OptionError(bad.format(spec=spec, error=err)) from None


def _load(spec: str, **options: Any) -> _data.Dataset:
    if spec == "text" or spec.startswith("text:"):
        path = spec.partition(":")[2] or None
        return text_data(path, **options)
    if ":" in spec:
        factory = _import(spec, "data")
        _check_call(spec, "data", "--data-opt", factory, options)
        ds = factory(**options)
        if not isinstance(ds, _data.Dataset):
            raise errors.EngineInputError(
                NOT_A.format(kind="data", spec=spec, type=type(ds).__name__, want="Dataset")
            )
        return ds
    if spec not in _data.available():
        raise errors.UnknownNameError(
            errors.UNKNOWN_NAME.format(kind="dataset", name=spec, known=", ".join(data_names()))
        )
    return _data.load(spec, **options)


def data_info(name: str, ds: _data.Dataset) -> DataInfo:
    """The :class:`DataInfo` of a loaded data set."""
    return DataInfo(
        name=name,
        input_shape=tuple(ds.x.shape[1:]),
        num_classes=ds.num_classes,
        tokens=not ds.x.is_floating_point(),
    )


# -- models ----------------------------------------------------------------------------


def _image(model: str, info: DataInfo) -> tuple[int, int, int]:
    if len(info.input_shape) != 3 or info.tokens:
        raise DataMismatchError(
            NEEDS_IMAGES.format(model=model, data=info.name, shape=info.input_shape)
        )
    c, h, w = info.input_shape
    return c, h, w


def _halvings(h: int, w: int, most: int) -> int:
    """How many times both sides halve exactly, at most ``most``."""
    d = 0
    while d < most and h % 2 ** (d + 1) == 0 and w % 2 ** (d + 1) == 0:
        d += 1
    return d


def _mlp(info: DataInfo, **kw: Any) -> nn.Module:
    if info.tokens:
        raise DataMismatchError(NEEDS_FLOATS.format(model="mlp", data=info.name))
    kw = {"width": 64, "depth": 2, **kw}
    return _models.mlp(math.prod(info.input_shape), kw.pop("width"), kw.pop("depth"),
                       info.num_classes, **kw)  # fmt: skip


def _revnet(info: DataInfo, **kw: Any) -> nn.Module:
    c, h, w = _image("revnet", info)
    kw = {"channels": 8, "blocks": 1 + _halvings(h, w, 1), **kw}
    return _models.revnet(c, classes=info.num_classes, **kw)


def _submersive_cnn(info: DataInfo, **kw: Any) -> nn.Module:
    c, h, w = _image("submersive_cnn", info)
    kw = {"channels": 16, "depth": max(1, _halvings(h, w, 3)), **kw}
    return _models.submersive_cnn(c, classes=info.num_classes, **kw)


def _resnet(info: DataInfo, **kw: Any) -> nn.Module:
    c, _, _ = _image("resnet", info)
    return _models.small_resnet(c, classes=info.num_classes, **kw)


def _gru_lm(info: DataInfo, **kw: Any) -> nn.Module:
    if not info.tokens or len(info.input_shape) != 1:
        raise DataMismatchError(
            NEEDS_TOKENS.format(model="gru_lm", data=info.name, dtype="float",
                                shape=info.input_shape)
        )
    return _models.char_gru_lm(info.num_classes, **kw)


_MODELS: dict[str, Callable[..., nn.Module]] = {
    "gru_lm": _gru_lm,
    "mlp": _mlp,
    "resnet": _resnet,
    "revnet": _revnet,
    "submersive_cnn": _submersive_cnn,
}


def model_names() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_MODELS)


def build_model(spec: str, info: DataInfo, **options: Any) -> nn.Module:
    """Build a model by name or ``module:factory`` for data described by ``info``.

    An importable factory gets ``options`` as keywords, plus ``input_shape`` and
    ``num_classes`` when its signature names them.
    """
    if ":" in spec:
        factory = _import(spec, "model")
        sig = _signature(factory)
        params = sig.parameters if sig is not None else {}
        extra: Mapping[str, Any] = {
            k: v
            for k, v in (("input_shape", info.input_shape), ("num_classes", info.num_classes))
            if k in params and k not in options
        }
        _check_call(spec, "model", "--model-opt", factory, {**extra, **options})
        model = _call(spec, factory, {**extra, **options}, list(options))
        if not isinstance(model, nn.Module):
            raise errors.EngineInputError(
                NOT_A.format(kind="model", spec=spec, type=type(model).__name__, want="nn.Module")
            )
        return model
    if spec not in _MODELS:
        raise errors.UnknownNameError(
            errors.UNKNOWN_NAME.format(kind="model", name=spec, known=", ".join(model_names()))
        )
    return _call(spec, lambda **kw: _MODELS[spec](info, **kw), options, list(options))


def _call(spec: str, factory: Callable[..., nn.Module], kwargs: dict[str, Any],
          given: list[str]) -> nn.Module:  # fmt: skip
    """``factory(**kwargs)``; a keyword it does not take is the user's --model-opt."""
    try:
        return factory(**kwargs)
    except (TypeError, ValueError, errors.LeangradError) as err:
        if not given or isinstance(err, DataMismatchError):
            raise
        if "unexpected keyword argument" in str(err):
            raise errors.OptionError(BAD_MODEL_OPTION.format(spec=spec, error=err)) from None
        opts = ", ".join(f"{k}={kwargs[k]!r}" for k in given)
        raise errors.OptionError(BAD_MODEL_VALUE.format(spec=spec, opts=opts, error=err)) from None


def example_batch(info: DataInfo, batch_size: int, *, device: torch.device | str,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A random batch shaped like the data (for measuring, not training)."""
    if info.tokens:
        x = torch.randint(0, info.num_classes, (batch_size, *info.input_shape), device=device)
        return x, torch.randint(0, info.num_classes, x.shape, device=device)
    x = torch.randn(batch_size, *info.input_shape, device=device, dtype=dtype)
    return x, torch.randint(0, info.num_classes, (batch_size,), device=device)
