"""Fragments on the Hugging Face models people train: ``GPT2LMHeadModel`` (its LM
head tied to the token embedding) and ``LlamaForCausalLM``, built tiny from configs offline
(:mod:`leangrad.hf`, float64, four layers so that ``levels=2`` drops boundaries), under
``checkpoint`` with ``fragments=2``, ``fragment_blocks`` (a number, sized on fake tensors,
and a name), ``sequence_fragments=2`` and ``levels=2``, alone and combined.

Each is exact against ``loss.backward()`` on a deep copy — every parameter's gradient
within 1e-10 of autograd's, relative to its largest entry (floored at 1% of the model's
largest gradient), ``.grad`` None where autograd leaves None, the tie and the model's
state kept — and the blocks asked for really ran in pieces (the fragments' autograd
function is recorded). GPT-2 as released (dropout 0.1) is refused fragments block by block,
naming the dropout, and stays exact (the recomputation replays the masks). Found while
writing this: ``sequence_fragments`` crashed on GPT-2 (its ``Conv1D`` calls ``.view`` on a
piece of the sequence, which is not contiguous); pieces are now laid out as the whole.
Nothing here asserts a time.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import leangrad
from leangrad import hf
from leangrad.engines.checkpoint import _fragments

LAYERS = 4
BLOCK = {"gpt2": "transformer.h", "llama": "model.layers"}
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
FLOOR = 1e-2


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """transformers warns about tiny vocabularies and casts; not findings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def pieces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The dimension cut by each call of the fragments' autograd function (0 the batch, 1
    the sequence)."""
    seen: list[int] = []
    apply = _fragments._apply

    def recording(call: Any, tensors: list[torch.Tensor], params: list[nn.Parameter]) -> Any:
        seen.append(call.dim)
        return apply(call, tensors, params)

    monkeypatch.setattr(_fragments, "_apply", recording)
    return seen


LossFn = Callable[[Any], torch.Tensor]


def _model(name: str, dt: torch.dtype = torch.float64, *,
           dropout: float = 0.0) -> tuple[nn.Module, tuple[torch.Tensor, ...], LossFn]:  # fmt: skip
    size = {**hf.TINY[name], "layers": LAYERS}
    extra = {"dropout": dropout} if name == "gpt2" else {}
    model = hf.model(name, **size, dtype=dt, **extra)
    x, loss_fn = hf.batch(name, model, 4, length=6)
    return model, x, loss_fn


def _check(model: nn.Module, x: tuple[torch.Tensor, ...], loss_fn: LossFn,
           **options: Any) -> leangrad.StepResult:  # fmt: skip
    dt = next(model.parameters()).dtype
    ref = copy.deepcopy(model)
    torch.manual_seed(0)  # the same dropout masks as the engine's step
    loss_fn(ref(*x)).backward()
    want = dict(ref.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    res = leangrad.engine("checkpoint", **options).backward(model, x, loss_fn)
    top = max(float(p.grad.abs().max()) for p in want.values() if p.grad is not None)
    for n, p in model.named_parameters():
        g = want[n].grad
        assert (p.grad is None) == (g is None), n
        if g is not None:
            assert p.grad is not None
            err = float((p.grad - g).abs().max()) / max(float(g.abs().max()), FLOOR * top)
            assert err <= TOL[dt], (n, options, err)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items()), "the model was changed"
    return res


OPTIONS: list[dict[str, Any]] = [
    {"fragments": 2},
    {"fragments": 2, "fragment_blocks": 1},
    {"fragments": 2, "fragment_blocks": "second"},  # the second layer, by name
    {"sequence_fragments": 2},
    {"fragments": 2, "levels": 2},
    {"fragments": 2, "fragment_blocks": 1, "sequence_fragments": 2, "levels": 2},
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fragment_kinds_on_hf_models_are_exact(name: str, options: dict[str, Any],
                                               pieces: list[int]) -> None:  # fmt: skip
    model, x, loss_fn = _model(name)
    if options.get("fragment_blocks") == "second":
        options = {**options, "fragment_blocks": [f"{BLOCK[name]}.1"]}
    res = _check(model, x, loss_fn, **options)
    if name == "gpt2":  # GPT2LMHeadModel's LM head is its token embedding, still
        assert model.lm_head.weight is model.transformer.wte.weight
    chosen = options.get("fragment_blocks")
    if "fragments" in options:
        assert 0 in pieces, "no block ran in fragments of the batch"
        if chosen is None:
            assert res.info["whole"] == {}, res.info["whole"]
        else:
            n = chosen if isinstance(chosen, int) else len(chosen)
            assert len(res.info["fragmented"]) == n
            assert len(res.info["whole"]) == LAYERS - n
            assert "fragment_note" not in res.info  # sized on fake tensors, not given up
            if isinstance(chosen, int):
                assert set(res.info["block_bytes"]) == {f"{BLOCK[name]}.{i}"
                                                        for i in range(LAYERS)}  # fmt: skip
    if "sequence_fragments" in options:  # the MLPs ran in pieces of the sequence
        assert 1 in pieces
    if options.get("levels") == 2:
        assert res.info["dropped"] > 0 and res.info["rebuilt"] > 0


def test_gpt2_as_released_runs_in_fragments_of_the_batch_its_dropout_replayed(
        pieces: list[int]) -> None:  # fmt: skip
    """Dropout 0.1 in every block: each fragment of the batch gets its rows of the masks
    one forward of the whole batch draws, and the step is autograd's; along the sequence,
    where draws are not replayed, nothing is cut."""
    model, x, loss_fn = _model("gpt2", dropout=0.1)
    res = _check(model, x, loss_fn, fragments=2, sequence_fragments=2)
    assert pieces and set(pieces) == {0}
    assert res.info["whole"] == {}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_float32(name: str, pieces: list[int]) -> None:
    model, x, loss_fn = _model(name, torch.float32)
    _check(model, x, loss_fn, fragments=2, fragment_blocks=2, sequence_fragments=2, levels=2)
    assert 0 in pieces and 1 in pieces
