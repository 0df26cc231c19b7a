"""The compile rows' CUDA peak (``leangrad.measure._compile._warm_cuda``) counts the step's
own gradients: the allocator's starting point is read after the warm-up's ``.grad`` are freed.

No GPU here, so the CUDA allocator is modelled: its "allocated" bytes are the bytes of the
model's live ``.grad`` tensors, its peak the most seen during the measured step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leangrad.measure import _compile


class _FakeAllocator:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.peak = 0

    def allocated(self, device: object = None) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters()
                   if p.grad is not None)  # fmt: skip

    def note(self) -> None:
        self.peak = max(self.peak, self.allocated())


def test_the_step_gradients_count_in_the_cuda_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(64, 32)
    fake = _FakeAllocator(model)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", fake.allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: setattr(fake, "peak", fake.allocated()))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak)
    x = torch.randn(4, 64)

    def run() -> None:
        model(x).sum().backward()
        fake.note()

    step = _compile.stepper(model, run)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = _compile._warm_cuda(step, model, torch.device("cuda"))
    assert peak == grad_bytes, (peak, grad_bytes)
