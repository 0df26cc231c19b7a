"""Shared pytest configuration.

One intra-op thread: the test models are tiny, so extra threads only add
scheduling overhead on small CI machines, and single-threaded kernels make
float results reproducible run to run.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
