"""Data sets for examples and benchmarks, all offline: real ones shipped inside packages
(the ``data`` extra) and seeded synthetic ones.

Quick use::

    from leangrad import data
    train, test = data.load("digits").split(0.8, seed=0)
    for x, y in train.batches(64, shuffle=True, seed=0):
        ...

``available()`` lists the names ``load`` accepts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .. import _errors as errors
from ._real import Dataset, digits, mnist5k
from ._synthetic import synthetic_classification, synthetic_sequences
from ._text import TextDataset, default_text_paths, text_chars
from ._tokens import TokenTextDataset, text_data, text_tokens

__all__ = [
    "Dataset",
    "TextDataset",
    "TokenTextDataset",
    "available",
    "default_text_paths",
    "digits",
    "load",
    "mnist5k",
    "synthetic_classification",
    "synthetic_sequences",
    "text_chars",
    "text_tokens",
]

_REGISTRY: dict[str, Callable[..., Dataset]] = {
    "digits": digits,
    "mnist5k": mnist5k,
    "synthetic": functools.partial(synthetic_classification, n=2048),
    "synthetic-seq": functools.partial(synthetic_sequences, n=2048),
    "text": text_data,
}


def available() -> list[str]:
    """Names of the data sets ``load`` knows, sorted.

    Returns:
        The registered names.
    """
    return sorted(_REGISTRY)


def load(name: str, **kwargs: Any) -> Dataset:
    """Load the data set registered as ``name``.

    Args:
        name: One of ``available()``: ``"digits"``, ``"mnist5k"``, ``"synthetic"``
            (``synthetic_classification``), ``"synthetic-seq"`` (``synthetic_sequences``)
            or ``"text"`` (windows of text files on disk: of characters, ``text_chars``, or
            with ``tokenizer="bpe:N"`` or a ``tokenizer.json`` path of tokens,
            ``text_tokens``);
            the synthetic ones have ``n=2048`` examples unless ``n=`` is given.
        **kwargs: Keyword arguments of the loader, e.g. ``flatten=True`` or ``seed=1``.

    Returns:
        The ``Dataset``.

    Raises:
        UnknownNameError: ``name`` is not registered.
    """
    try:
        loader = _REGISTRY[name]
    except KeyError:
        raise errors.UnknownNameError(
            errors.UNKNOWN_NAME.format(kind="dataset", name=name, known=", ".join(available()))
        ) from None
    return loader(**kwargs)
