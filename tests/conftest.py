"""Shared pytest configuration.

One intra-op thread: the test models are tiny, so extra threads only add
scheduling overhead on small CI machines, and single-threaded kernels make
float results reproducible run to run.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    # torch itself warns here when forward-mode AD first loads its jvp decompositions
    # (torch/_decomp/decompositions_for_jvp.py calls torch.jit.script); not ours to fix.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
    )


# --- Hypothesis profiles of the engine fuzz test (tests/engines/test_fuzz.py) ---
# Not loaded here: the fuzz test applies the one named by $HYPOTHESIS_PROFILE ("ci" by
# default; `make fuzz` runs "fuzz"). Hypothesis loads its own "ci" profile by itself on CI
# machines, and re-registering a loaded profile reloads it, so "ci" is Hypothesis' own
# (derandomized, no deadline, no database) changed in max_examples only, which every other
# Hypothesis test here sets explicitly. The fuzz test's health checks and phases are set
# in the test itself.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile(
    "ci",
    parent=_hyp_settings.get_profile("ci"),
    derandomize=True,  # a fixed sequence of examples: the same models every run
    max_examples=20,  # ~1 s per model on 2 cores: the whole fuzz file in under a minute
    deadline=None,
    database=None,
)
_hyp_settings.register_profile("fuzz", max_examples=2000, deadline=None)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[tuple[str, str]]]:
    """(label, "real" or "fake") -> steps, for every engine the planner makes. Fragments are
    never estimated here (``COSTLY_FROM`` infinite): whether they would be depends on how
    long this machine took for a real and a fake step, and counts must not depend on time
    (a test of that rule sets it itself)."""
    from torch._subclasses.fake_tensor import is_fake

    import leangrad.planner._measure as measuring  # imported here: conftest loads before any test

    steps: collections.Counter[tuple[str, str]] = collections.Counter()
    make = measuring.engine

    def counting(name: str, **opts: Any) -> Any:
        eng = make(name, **opts)
        inner = eng.backward

        def backward(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            xs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
            steps[(eng.label, "fake" if is_fake(xs[0]) else "real")] += 1
            return inner(model, inputs, *args, **kwargs)

        eng.backward = backward  # type: ignore[method-assign]
        return eng

    monkeypatch.setattr(measuring, "engine", counting)
    monkeypatch.setattr(measuring, "COSTLY_FROM", float("inf"))
    yield steps
