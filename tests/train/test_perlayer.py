"""``--step-per-layer``: optimizer steps inside ``on_grad``; gradients never all live at once,
and the saving is measured with the allocator-level tracker."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import models, train

CASES = [
    ("backprop", lambda: models.mlp(64, 32, 3, 10), (64,)),
    ("checkpoint", lambda: models.mlp(64, 32, 3, 10), (64,)),
    ("moonwalk", lambda: models.submersive_cnn(1, 8, 3, 10), (1, 8, 8)),
    ("revbackprop", lambda: models.revnet(1, 8, 10, blocks=2), (1, 8, 8)),
]


@pytest.mark.parametrize(("engine", "build", "shape"), CASES, ids=[c[0] for c in CASES])
def test_gradients_never_all_live_at_once(engine, build, shape) -> None:
    """Counted at every hand-over: at most two layers' weights and biases hold a gradient
    (Moonwalk keeps the stem's until the stem's replay is done), out of 8-10 parameters,
    and every parameter is stepped exactly once."""
    torch.manual_seed(0)
    model = build()
    params = dict(model.named_parameters())
    plo = train.PerLayerOptimizer(params, lambda ps: torch.optim.SGD(ps, lr=0.1))
    live, stepped = [], []

    def on_grad(name: str, p: torch.nn.Parameter) -> None:
        live.append(sum(q.grad is not None for q in params.values()))
        stepped.append(name)
        plo.on_grad(name, p)

    x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
    leangrad.engine(engine).backward(model, x, lambda o: F.cross_entropy(o, y), on_grad=on_grad)
    assert sorted(stepped) == sorted(params) and len(params) >= 8
    assert max(live) <= 4
    assert all(p.grad is None for p in params.values())


def test_step_per_layer_trains_like_a_whole_model_step() -> None:
    """SGD per parameter inside backprop's hooks gives the same weights, bit for bit, as SGD
    after backward; Moonwalk's per-layer steps agree to rounding."""
    kw = {"data": "synthetic", "data_options": {"n": 160, "shape": [1, 8, 8]}, "max_steps": 5,
          "batch_size": 32, "optimizer": "sgd", "lr": 0.1, "progress": False,
          "track_memory_every": 0}  # fmt: skip
    a = train.fit("mlp", **kw, step_per_layer=True)
    b = train.fit("mlp", **kw)
    for (k, u), v in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(u, v), k
    a = train.fit("submersive_cnn", **kw, engine="moonwalk", step_per_layer=True)
    b = train.fit("submersive_cnn", **kw, engine="moonwalk")
    for u, v in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    assert a.grad_memory is not None and a.grad_memory.engine == "moonwalk"


def test_measured_saving_when_gradients_dominate() -> None:
    """A wide MLP on one example: activations are tiny, so with the optimizer step after
    backward all 0.83 MiB of gradients are live together, and per-layer steps keep only one
    at a time. Measured (tracker, allocator level): the peak drops by more than half of
    the gradient bytes."""
    torch.manual_seed(0)
    model = models.mlp(64, 256, 4, 10)
    x, y = torch.randn(1, 64), torch.randint(0, 10, (1,))
    mem = train.measure_grad_memory(model, leangrad.engine("backprop"), x,
                                    lambda o: F.cross_entropy(o, y),
                                    lambda ps: torch.optim.SGD(ps, lr=0.1))  # fmt: skip
    assert mem.grad_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert mem.full_peak_bytes >= mem.grad_bytes
    assert mem.saving_bytes >= mem.grad_bytes // 2
    assert 0 < mem.saving_fraction < 1
    assert all(p.grad is None for p in model.parameters())  # measured on copies
