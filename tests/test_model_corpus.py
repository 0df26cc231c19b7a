"""Every engine on models people download (timm, torchvision), as written, with weights
off their initialisation: exact against ``loss.backward()`` in float64 — gradients, the
``.grad`` left None, buffers, the global RNG — or refused with a leangrad error naming why.
A silent wrong result or a crash fails (:mod:`model_corpus`). ``make test`` runs the fast
slice; ``make fuzz`` (``LEANGRAD_CORPUS=all``) every model."""

from __future__ import annotations

import os

import pytest

import model_corpus as mc

pytestmark = pytest.mark.skipif(not mc.vision_available(),
                                reason="timm and torchvision: pip install -e '.[vision]'")

EVERY = os.environ.get("LEANGRAD_CORPUS") == "all"
ENTRIES = [e for e in mc.CORPUS if EVERY or e.fast]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_engine_is_exact_or_refuses(entry: mc.Entry) -> None:
    row = mc.check(entry)
    assert set(row) == set(mc.ENGINES)
    bad = mc.defects({entry.name: row})
    assert not bad, "\n".join(bad)
    assert row["checkpoint"].startswith("exact")  # the engine every model gets


def test_the_check_catches_a_wrong_gradient_a_moved_rng_and_a_buffer() -> None:
    """The verdict is not vacuous: a gradient off by 1e-6, a buffer advanced twice and a
    global RNG moved are each named."""
    import torch

    grads = {"w": torch.ones(3, dtype=torch.float64), "b": None}
    buffers = {"bn.running_mean": torch.zeros(2, dtype=torch.float64)}
    ref = mc._Step(grads, buffers, torch.get_rng_state())
    off = mc._Step({"w": grads["w"] * (1 + 1e-6), "b": None}, buffers, ref.rng)
    assert mc.verdict(ref, off, torch.float64).startswith("WRONG gradient")
    twice = mc._Step(grads, {"bn.running_mean": torch.full((2,), 0.1,
                                                           dtype=torch.float64)}, ref.rng)
    assert mc.verdict(ref, twice, torch.float64).startswith("WRONG buffer")
    torch.rand(1)
    moved = mc._Step(grads, buffers, torch.get_rng_state())
    assert mc.verdict(ref, moved, torch.float64) == "WRONG global RNG moved"
    none = mc._Step({"w": grads["w"], "b": torch.zeros(1)}, buffers, ref.rng)
    assert mc.verdict(ref, none, torch.float64).startswith("WRONG .grad None-ness")
    assert mc.verdict(ref, ref, torch.float64) == "exact"
