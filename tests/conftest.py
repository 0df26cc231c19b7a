"""Shared pytest configuration.

One intra-op thread: the test models are tiny, so extra threads only add
scheduling overhead on small CI machines, and single-threaded kernels make
float results reproducible run to run.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    # torch itself warns here when forward-mode AD first loads its jvp decompositions
    # (torch/_decomp/decompositions_for_jvp.py calls torch.jit.script); not ours to fix.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
    )
