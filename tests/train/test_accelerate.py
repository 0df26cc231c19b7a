"""Hugging Face accelerate's loop with a leangrad engine (``docs/examples/accelerate_loop.py``,
shown on the docs page "With accelerate"): ``accelerator.prepare``, its gradient
accumulation, ``accelerator.backward`` of :func:`leangrad.surrogate_loss` — every step's
weights equal to the plain loop's, on one process and under accelerate's DDP on two."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from two_processes import SRC, run_two

pytest.importorskip("accelerate")

EXAMPLE = SRC.parent / "docs" / "examples" / "accelerate_loop.py"
PAGE = SRC.parent / "docs" / "accelerate.md"


def _weights(out: Path, engine: str) -> list[list[torch.Tensor]]:
    got: list[list[torch.Tensor]] = torch.load(out / f"weights-{engine}.pt")
    return got


def _worst(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    assert len(a) == len(b) > 0
    return max(float((x - y).abs().max()) for s, t in zip(a, b, strict=True)
               for x, y in zip(s, t, strict=True))  # fmt: skip


def test_the_example_equals_the_plain_loop_on_one_process(tmp_path: Path) -> None:
    for engine in ("backprop", "checkpoint+accumulate"):
        subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path), "--engine", engine],
                       check=True, capture_output=True)  # fmt: skip
    plain, got = _weights(tmp_path, "backprop"), _weights(tmp_path, "checkpoint+accumulate")
    assert _worst(plain, got) <= 1e-12
    assert _worst(plain[:1], plain[-1:]) > 1e-3  # it trains


@pytest.mark.slow  # two processes: CI runs it in make test-slow
def test_the_example_equals_the_plain_loop_under_accelerates_ddp(tmp_path: Path) -> None:
    source = EXAMPLE.read_text()
    logs = run_two(source, tmp_path, "--engine", "backprop")
    assert "MULTI_CPU on 2 process(es)" in logs[0]
    run_two(source, tmp_path, "--engine", "checkpoint+accumulate")
    assert _worst(_weights(tmp_path, "backprop"),
                  _weights(tmp_path, "checkpoint+accumulate")) <= 1e-12  # fmt: skip


def test_the_docs_page_shows_the_example_as_it_runs() -> None:
    body = EXAMPLE.read_text().split('"""', 2)[2].strip()
    assert body in PAGE.read_text()
