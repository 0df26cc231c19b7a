"""``leangrad.surrogate_loss``: the engine's gradients handed over by the loss's backward,
scaled as the loss was, added to ``.grad`` as autograd adds (``None`` stays ``None`` for a
frozen parameter), once; a model it cannot take is refused, named."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad._errors import EngineInputError
from leangrad.engines import _surrogate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = leangrad.models.mlp(6, 8, 2, 3).double()
    next(model.parameters()).requires_grad_(False)  # frozen: no .grad
    return model


@pytest.mark.parametrize("engine", ["backprop", "checkpoint", "chunked_ce"])
def test_backward_of_the_scaled_surrogate_equals_autograds(engine: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    ref, got = _model(), _model()
    for m in (ref, got):  # gradients already there: added to, as autograd adds
        for p in m.parameters():
            if p.requires_grad:
                p.grad = torch.ones_like(p)
    (F.cross_entropy(ref(x), y) * 0.25).backward()
    loss = leangrad.surrogate_loss(leangrad.engine(engine), got, x,
                                   lambda o: F.cross_entropy(o, y))  # fmt: skip
    assert all(p.grad is None or torch.equal(p.grad, torch.ones_like(p))
               for p in got.parameters())  # nothing handed over before the backward
    (loss * 0.25).backward()
    for p, q in zip(ref.parameters(), got.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14)
    with pytest.raises(EngineInputError, match="handed its gradients over already"):
        loss.backward()


def test_a_model_sharded_otherwise_than_by_ddp_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_surrogate, "wrapped_by", lambda m: ("FSDP2 (fully_shard)", "..."))
    model = copy.deepcopy(_model())
    with pytest.raises(EngineInputError, match=r"runs under DDP or on one process"):
        _surrogate.surrogate_loss(leangrad.engine("backprop"), model, torch.randn(2, 6).double(),
                                  lambda o: o.sum())  # fmt: skip
