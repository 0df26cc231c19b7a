"""Property-based test of the engine contract on drawn models ("What to build").

Hypothesis draws a model from the grammar in ``tests/fuzz_models.py`` — PyTorch layers
(Linear, Conv2d, activations, Dropout, BatchNorm / GroupNorm / LayerNorm in train and eval
mode, nested Sequentials, residual wrappers) mixed with every layer leangrad exports
(chain layers, fad / bits / rad layers, highway blocks and recurrent layers), shared
modules, tied weights, channels-last inputs, float32 and float64 — and runs every engine
variant that accepts it against plain autograd. Each engine must keep the contract
(gradients, ``.grad`` None-ness, the user's Parameters, buffers, RNG, input gradients,
``on_grad`` once per parameter with its final value) or raise a one-line leangrad error.
A model's engines run in a forked child (a fresh one goes on after a crash), so a
segfault is that engine's reported failure, not a dead test run.

Profiles (registered in ``tests/conftest.py``): ``HYPOTHESIS_PROFILE=ci`` (default; fixed
examples, part of ``make test``) and ``fuzz`` (2,000 models; ``make fuzz``, which also
sets ``FUZZ_LOG`` and ``FUZZ_COLLECT=1``: failures are logged and summarised instead of
stopping at the first). ``FUZZ_MAX_EXAMPLES=N`` overrides the profile's count.

Failures still being fixed (the known classes, and the NEW ones the fuzzer found, written
up in the findings the coordinator holds) are listed in :data:`KNOWN_FAILURES`: tolerated
in the drawn test, xfail in the regression test; entries go as fixes land. Every failure
the fuzzer found stays in :data:`REGRESSIONS`.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

import fuzz_models as fm
from leangrad.engines import Backprop

# --- failures tolerated until their fix lands (the coordinator removes entries) ----------

KNOWN_FAILURES: list[fm.Known] = [
    # Empty: F1-F6, the defects this test found beyond the nine known classes (dropout
    # masks in another layout under forward mode, a random stem under moonwalk+fad, the rad
    # transform re-randomizing the user's rad layers, leangrad's own autograd.Functions
    # and rad layers under functorch), are fixed; tests/engines/test_fuzz_findings.py holds
    # their regression tests and REGRESSIONS below the examples that found them.
]

# --- every failure the fuzzer found, kept as a regression example -----------------------



def _spec(family: str, input_kind: str, stem: Any, body: Any, head: Any = (), **kw: Any) -> fm.Spec:
    """A spec with the quiet defaults (float64, seed 0, batch 2, nothing optional)."""
    base = {"family": family, "input": input_kind, "stem": stem, "body": list(body),
            "head": list(head), "dtype": "float64", "seed": 0, "batch": 2,
            "channels_last": False, "input_grad": False, "on_grad": False, "prefill": False,
            "eval": False}  # fmt: skip
    return base | kw


REGRESSIONS: list[tuple[str, fm.Spec]] = [
    # fad's eager block once passed its output through a flattening copy (for 0-d model
    # losses): channels-last activations came out contiguous, and the dropout after them
    # filled its mask in another order than autograd's step (loss 0.334 vs 0.430).
    ("seq-fad-channels-last-dropout", {
        "body": [("seq", [("res", [("rad", 0.5, 0), ("bnact", "train", "silu")]),
                          ("droppath", 0.1), ("res", [("dropout", 0.5, "bits")])])],
        "seed": 71, "stem": ("lin", []), "channels_last": True, "input": "img",
        "prefill": False, "eval": False, "on_grad": True, "dtype": "float32", "batch": 2,
        "family": "seq", "head": [("act", "rad.relu")], "input_grad": False}),
    # Shared modules and tied weights in each family, on_grad and input gradients on
    # (known classes 1-3; GPT-2-style tying): pass today, must stay so.
    ("seq-shared-and-tied", _spec("seq", "vec", ("lin", []),
        [("lin", 1), ("act", "tanh"), ("ref", 0), ("tie", 0), ("dropout", 0.25, "nn")],
        on_grad=True, input_grad=True, prefill=True)),
    ("seq-img-shared-residual", _spec("seq", "img", ("lin", [("bn", "train")]),
        [("res", [("lin", 3), ("act", "fad.swish")]), ("ref", 0), ("gn", 2), ("ref", 1)],
        on_grad=True, channels_last=True)),
    ("chain-shared-coupling", _spec("chain", "img", ("lin", []),
        [("coupling", [("lin", 3), ("act", "tanh")]), ("leaky", 0.1), ("ref", 0),
         ("coupling_ref", 0), ("subconv", "down")], on_grad=True, prefill=True)),
    ("highway-shared-block", _spec("highway", "img", ("lin", []),
        [("preact",), ("ref", 0)], on_grad=True)),
    # Known class 8: GroupNorm in a coupling on a channels-last input (was a segfault).
    ("chain-groupnorm-channels-last", _spec("chain", "img", ("lin", []),
        [("coupling", [("gn", 1), ("lin", 3)])], channels_last=True)),
    # Known class 4: training-mode dropout in the head under pure Moonwalk.
    ("chain-head-dropout", _spec("chain", "img", ("lin", []),
        [("coupling", [("lin", 1), ("act", "tanh")]), ("leaky", 0.5)],
        [("dropout", 0.5, "nn")])),
    # Found by the fuzzer (/tmp/fuzz_findings.md, shrunk):
    ("F1-forward-dropout-channels-last", _spec("highway", "img", ("lin", [("dropout", 0.25, "nn")]),
        [], channels_last=True)),
    ("F2-moonwalk-fad-stem-dropout", _spec("chain", "vec", ("repeat", [("dropout", 0.25, "nn")]),
        [("fragconv",)])),
    ("F3-rad-over-user-rad-layer", _spec("seq", "vec", ("lin", []), [("rad", 0.5, None)])),
    ("F4-forward-bits-relu", _spec("seq", "vec", ("lin", []), [("act", "bits.relu")])),
    ("F5-pure-moonwalk-bits-head", _spec("chain", "vec", ("repeat", []), [],
        [("dropout", 0.25, "bits")])),
    ("F6-projforward-rad-layer", _spec("seq", "vec", ("lin", []), [("rad", 0.5, 0)])),
    # blocks of the libraries people download: an activation in place over a training-mode
    # BatchNorm's output (timm's BatchNormAct2d), squeeze-excitation, stochastic depth and
    # F.dropout in a forward, which no class names (found by watching the draws)
    ("lib-blocks-img", _spec("seq", "img", ("lin", []), [
        ("res", [("lin", 3), ("bnact", "train", "relu"), ("se",), ("droppath", 0.5)]),
        ("res", [("lin", 1), ("bnact", "train", "hardswish"), ("fdrop", 0.25)])], batch=4)),
    # fragments' output was contiguous where the whole block's is channels-last, so the
    # next block (recomputed whole: it draws) drew its dropout masks in another order
    ("fragments-channels-last-dropout", _spec("seq", "img", ("lin", []), [
        ("res", [("lin", 3), ("dropout", 0.25, "nn"), ("bn", "train")])],
        batch=4, channels_last=True)),
    ("lib-blocks-vec", _spec("seq", "vec", ("lin", []), [
        ("res", [("lin", 1), ("bnact", "train", "silu"), ("se",)]),
        ("res", [("lin", 1), ("act", "gelu"), ("droppath", 0.1)])], batch=4)),

    ("F7-forward-attention", _spec("highway", "tokens", ("lin", []), [("preln", "attention")])),
]  # fmt: skip


def _profile() -> settings:
    """The profile named by $HYPOTHESIS_PROFILE (tests/conftest.py), with a model's second
    of work allowed; "ci" does not shrink (the report prints the spec and a reproduction
    script; `FUZZ_COLLECT=0 make fuzz` shrinks)."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    s = settings(
        settings.get_profile(name),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much],
    )  # fmt: skip
    if name == "ci":
        s = settings(s, phases=(Phase.explicit, Phase.reuse, Phase.generate))
    if n := os.environ.get("FUZZ_MAX_EXAMPLES"):
        s = settings(s, max_examples=int(n))
    return s


def _report(spec: fm.Spec, failures: list[fm.Outcome]) -> str:
    lines = [f"{len(failures)} engine(s) broke the contract on spec {spec!r}:"]
    for o in failures:
        lines.append(f"- {o['engine']}: [{o['kind']}] {o['detail']}")
    lines.append("reproduce with:\n" + fm.repro(spec, failures[0]))
    return "\n".join(lines)


def _check(spec: fm.Spec) -> list[tuple[fm.Outcome, fm.Known]]:
    """Check every engine on ``spec``; raise on a failure not in KNOWN_FAILURES, return
    the known ones."""
    outcomes = fm.check_spec(spec)
    fm.log(spec, outcomes, KNOWN_FAILURES)
    unknown, known = fm.classify(spec, outcomes, KNOWN_FAILURES)
    if unknown and os.environ.get("FUZZ_COLLECT") != "1":
        raise AssertionError(_report(spec, unknown))
    assert any(o["status"] != "unsupported" for o in outcomes), "no engine took the model"
    return known


@pytest.mark.slow
@_profile()
@given(spec=fm.specs())
def test_every_engine_keeps_the_contract_on_drawn_models(spec: dict[str, Any]) -> None:
    _check(spec)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [s for _, s in REGRESSIONS], ids=[n for n, _ in REGRESSIONS])
def test_regression_examples(spec: fm.Spec) -> None:
    known = _check(spec)
    if known:
        classes = sorted({k.issue_class for _, k in known})
        pytest.xfail(f"known failures ({', '.join(classes)}): "
                     + "; ".join(f"{o['engine']} [{o['kind']}]" for o, _ in known))  # fmt: skip


def test_the_grammar_builds_what_it_names() -> None:
    """A shared module is one object at two places; a tied weight one Parameter in two
    modules; the warm-up models run under plain autograd."""
    spec = dict(fm.WARM_SPECS[0])
    spec["body"] = [("lin", 1), ("act", "tanh"), ("ref", 0), ("tie", 0)]
    b = fm.build(spec)
    assert {"shared", "tied"} <= b.features
    convs = [m for m in b.model.modules() if type(m).__name__ == "Conv2d"]
    weights = {id(m.weight) for m in convs}
    assert len(weights) < len(convs)  # the tied conv holds another conv's Parameter
    for s in fm.WARM_SPECS:
        fm.reference(s)


class _Broken(Backprop):
    """Backprop with one contract violation, to show that the checker sees each."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def backward(self, model, inputs, loss_fn, *, on_grad=None):  # type: ignore[no-untyped-def]
        result = super().backward(model, inputs, loss_fn)  # the base's on_grad guard bypassed
        params = dict(model.named_parameters())
        name, p = next(iter(params.items()))
        if self.how == "grad":
            p.grad.mul_(1 + 1e-6)
        elif self.how == "none":
            p.grad = None
        elif self.how == "identity":  # what functional_call did (known class 2)
            owner = model.get_submodule(name.rpartition(".")[0])
            leaf = name.rpartition(".")[2]
            del owner._parameters[leaf]
            setattr(owner, leaf, p.detach().clone())
        elif self.how == "rng":
            torch.rand(1)
        elif self.how == "buffer":
            next(b for b in model.buffers() if b.is_floating_point()).add_(1.0)
        elif self.how == "crash":
            raise KeyError("1")
        if on_grad is not None:
            for n, q in params.items():
                on_grad(n, q)
                if self.how == "on_grad":  # twice, the first time with a partial value
                    on_grad(n, q)
        return result


@pytest.mark.parametrize(
    ("how", "kind"),
    [("grad", "grad-value"), ("none", "grad-none"), ("identity", "param-identity"),
     ("rng", "rng"), ("buffer", "buffer"), ("on_grad", "on-grad"),
     ("crash", "non-leangrad-error")],
)  # fmt: skip
def test_the_checker_sees_each_contract_violation(how: str, kind: str) -> None:
    spec = fm.WARM_SPECS[0] | {"prefill": True}
    out = fm.check_engine(spec, f"broken-{how}", {}, make=lambda: _Broken(how))
    assert out["status"] == "fail", out
    assert kind in out["kind"].split(","), out
    assert fm.check_engine(spec, "backprop", {})["status"] == "ok"
