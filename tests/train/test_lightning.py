"""Lightning with a leangrad engine (``docs/examples/lightning_module.py``, shown on the
docs page "With Lightning"): ``training_step`` returns :func:`leangrad.surrogate_loss`,
Lightning's automatic optimisation and ``accumulate_grad_batches`` run unchanged, and the
weights after every batch equal the plain module's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from two_processes import SRC

pytest.importorskip("lightning")

EXAMPLE = SRC.parent / "docs" / "examples" / "lightning_module.py"
PAGE = SRC.parent / "docs" / "lightning.md"


def _worst(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    assert len(a) == len(b) > 0
    return max(float((x - y).abs().max()) for s, t in zip(a, b, strict=True)
               for x, y in zip(s, t, strict=True))  # fmt: skip


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_module", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_module_equals_the_plain_one_step_by_step() -> None:
    example = _example()
    plain = example.train("backprop")
    assert len(plain) == 8  # every batch of the epoch, 4 optimizer steps
    assert _worst(plain[:1], plain[-1:]) > 1e-3  # it trains
    for engine in ("checkpoint", "checkpoint+accumulate"):
        assert _worst(plain, example.train(engine)) <= 1e-12, engine


@pytest.mark.slow
def test_the_example_runs_as_a_script(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path), "--engine", "checkpoint"],
                   check=True, capture_output=True)  # fmt: skip
    assert len(torch.load(tmp_path / "weights-checkpoint.pt")) == 8


def test_the_docs_page_shows_the_example_as_it_runs() -> None:
    body = EXAMPLE.read_text().split('"""', 2)[2].strip()
    assert body in PAGE.read_text()


@pytest.mark.slow
def test_under_lightnings_ddp_on_two_processes(tmp_path: Path) -> None:
    for engine in ("backprop", "checkpoint+accumulate"):
        subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path), "--engine", engine,
                        "--devices", "2"], check=True, capture_output=True,
                       timeout=600)  # fmt: skip
    plain = torch.load(tmp_path / "weights-backprop.pt")
    got = torch.load(tmp_path / "weights-checkpoint+accumulate.pt")
    assert len(plain) == 4  # each rank: half the epoch's batches
    assert _worst(plain, got) <= 1e-12
    assert _worst(plain[:1], plain[-1:]) > 1e-3

