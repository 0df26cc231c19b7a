"""Seeded synthetic data sets whose labels a model can learn.

Inputs are standard Gaussian; labels come from a random linear "teacher" drawn from the
same seed, so the same seed always gives the same inputs, teacher and labels. Everything
is drawn in float32 on the CPU and then moved, so labels do not depend on dtype or device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._real import Dataset, check_device, check_dtype, check_int

__all__ = ["synthetic_classification", "synthetic_sequences"]

BAD_SHAPE = (
    "every input dimension must be a positive integer, got {shape!r}; "
    "write e.g. shape=(3, 32, 32) (on the command line: --data-opt shape=3,32,32)"
)


def _check(n: int, num_classes: int, sizes: Sequence[int], dtype: torch.dtype | str,
           device: torch.device | str, seed: int) -> tuple[torch.dtype, torch.device]:  # fmt: skip
    """Reject sizes, seeds, dtypes and devices that cannot make a data set (a value of the
    wrong type included: options may come from ``--data-opt``); the dtype and device."""
    check_int("n", n, least=1)
    check_int("num_classes", num_classes, least=2)
    check_int("seed", seed, least=0)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(BAD_SHAPE.format(shape=tuple(sizes)))
    return check_dtype(dtype), check_device(device)


def _shape(shape: Sequence[int] | int) -> tuple[int, ...]:
    """``(3, 32, 32)``; a single int is a one-dimensional shape."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        return (shape,)
    if isinstance(shape, str) or not isinstance(shape, Sequence):
        raise ValueError(BAD_SHAPE.format(shape=shape))
    return tuple(shape)


def _teacher(features: int, num_classes: int, gen: torch.Generator) -> torch.Tensor:
    """A random projection from ``features`` inputs to ``num_classes`` scores.

    Its columns have unit norm, so no class wins merely by a longer teacher vector.
    """
    weight = torch.randn(features, num_classes, generator=gen)
    return weight / weight.norm(dim=0, keepdim=True)


def _teacher_labelled(name: str, n: int, sizes: tuple[int, ...], features: int,
                      summary: Callable[[torch.Tensor], torch.Tensor], num_classes: int,
                      seed: int, dtype: torch.dtype, device: torch.device) -> Dataset:  # fmt: skip
    """``n`` Gaussian inputs of shape ``sizes`` (checked by :func:`_check`), each labelled
    by the argmax of a random teacher (drawn first, from the same ``seed``) applied to
    ``summary(x)``, its ``(n, features)`` rows; drawn in float32 on the CPU, then moved."""
    gen = torch.Generator().manual_seed(seed)
    teacher = _teacher(features, num_classes, gen)
    x = torch.randn(n, *sizes, generator=gen)
    y = (summary(x) @ teacher).argmax(dim=1)
    return Dataset(
        x=x.to(device=device, dtype=dtype),
        y=y.to(device=device),
        name=name,
        num_classes=num_classes,
    )


def synthetic_classification(
    n: int,
    *,
    shape: Sequence[int] = (64,),
    num_classes: int = 10,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Dataset:
    """Gaussian inputs labelled by the argmax of a fixed random linear teacher.

    Args:
        n: Number of examples.
        shape: Shape of one input, e.g. ``(64,)`` or ``(1, 8, 8)`` (an int: ``(shape,)``).
        num_classes: Number of classes.
        seed: Seed of inputs and teacher; the same seed gives the same data set.
        dtype: Floating-point dtype of the inputs.
        device: Device of inputs and targets.

    Returns:
        A ``Dataset`` named ``"synthetic"`` with x of shape ``(n, *shape)``.
    """
    shape = _shape(shape)
    dtype, device = _check(n, num_classes, shape, dtype, device, seed)
    return _teacher_labelled(
        "synthetic", n, shape, math.prod(shape), lambda x: x.reshape(n, -1),
        num_classes, seed, dtype, device,
    )  # fmt: skip


def synthetic_sequences(
    n: int,
    *,
    length: int = 16,
    features: int = 8,
    num_classes: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Dataset:
    """Gaussian sequences labelled by a random linear teacher applied to their time mean.

    Args:
        n: Number of sequences.
        length: Time steps per sequence.
        features: Features per time step.
        num_classes, seed, dtype, device: as for :func:`synthetic_classification`.

    Returns:
        A ``Dataset`` named ``"synthetic-seq"`` with x of shape ``(n, length, features)``
        (batch first), for recurrent models.
    """
    dtype, device = _check(n, num_classes, (length, features), dtype, device, seed)
    return _teacher_labelled(
        "synthetic-seq", n, (length, features), features, lambda x: x.mean(dim=1),
        num_classes, seed, dtype, device,
    )  # fmt: skip
