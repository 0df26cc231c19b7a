"""The ``chunked_ce`` engine and transform.

On ``zoo.gpt`` and the Hugging Face language models (GPT-2, Llama, BERT, float64, with
their loss written as users write it), ``chunked_ce`` under ``backprop`` and
``checkpoint`` (alone and with ``fad``/``bits``) gives autograd's ``.grad``; on a model
without a vocabulary-sized head it is idle and still exact; bases that run the output
layer themselves refuse it; and its step's peak memory is below backprop's because the
logits never exist. Nothing here asserts a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import leangrad
from helpers import seeded_autograd
from leangrad import zoo
from leangrad._errors import EngineInputError
from leangrad.engines import Composed
from leangrad.loss import LazyLogits, LogitsReadError
from leangrad.measure import compare_grads, profile_step

ENGINES = ("chunked_ce", "checkpoint+chunked_ce", "checkpoint+fad+chunked_ce",
           "checkpoint+bits+chunked_ce")  # fmt: skip
VOCAB = 2048
Problem = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]


# transformers warns about tiny configurations; not findings
pytestmark = pytest.mark.filterwarnings("ignore")


def _gpt(vocab: int = VOCAB, dtype: torch.dtype = torch.float64) -> Problem:
    torch.manual_seed(0)
    model = zoo.gpt(vocab=vocab, dim=16, layers=2, heads=2, context=16).to(dtype)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (2, 8), generator=gen)
    y = torch.randint(0, vocab, (2, 8), generator=gen)
    y[0, :2] = -100
    return model, (idx,), lambda out: zoo.GPT.loss(out, y)


def _composed(name: str, **options: Any) -> Composed:
    eng = leangrad.engine(name, **options)
    assert isinstance(eng, Composed)
    return eng


def _check(eng: Any, model: nn.Module, x: tuple[torch.Tensor, ...], loss_fn: Any,
           tol: float = 1e-10) -> None:  # fmt: skip
    """``eng``'s ``.grad`` are autograd's (no more, no fewer), the model is left as found
    and its head returns real logits again after the step."""
    ref = seeded_autograd(model, x, loss_fn)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    try:
        res = eng.backward(model, x, loss_fn)
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    finally:
        model.zero_grad(set_to_none=True)
    assert set(got) == set(ref), f"grads differ on {sorted(set(got) ^ set(ref))}"
    cmp = compare_grads(got, ref)
    assert cmp.max_rel_err <= tol, f"{eng.label}: max relative error {cmp.max_rel_err}"
    assert torch.isfinite(res.loss).all()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items()), "the model was changed"
    with torch.no_grad():
        out = model(*x)
    assert not isinstance(getattr(out, "logits", out), LazyLogits), "the mode outlived the step"


@pytest.mark.parametrize("options", [{}, {"chunk_size": 3}], ids=["default", "chunk3"])
@pytest.mark.parametrize("name", ENGINES)
def test_zoo_gpt_is_exact(name: str, options: dict[str, Any]) -> None:
    model, x, loss_fn = _gpt()
    eng = _composed(name, **options)
    assert eng.exact
    assert "chunked_ce" not in eng.idle_transforms(model)
    if name in ("chunked_ce", "checkpoint+chunked_ce"):
        assert eng.idle_transforms(model) == [] and eng.idle_reason(model) is None
    if options:
        assert "chunk_size=3" in eng.label
    _check(eng, model, x, loss_fn)


@pytest.mark.parametrize("name", ["chunked_ce", "checkpoint+chunked_ce"])
def test_frozen_parameters_keep_none_grads(name: str) -> None:
    """The head's weight and the final norm frozen: their ``.grad`` stay ``None`` (the loss
    computes no weight gradient), the rest are autograd's."""
    model, x, loss_fn = _gpt()
    assert isinstance(model, zoo.GPT)
    frozen = [model.head.weight, model.ln_f.weight, model.ln_f.bias]
    for p in frozen:
        p.requires_grad_(False)
    _check(leangrad.engine(name), model, x, loss_fn)
    leangrad.engine(name).backward(model, x, loss_fn)
    assert all(p.grad is None for p in frozen)
    assert model.tok.weight.grad is not None
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["chunked_ce", "checkpoint+chunked_ce"])
def test_small_vocabulary_is_idle_and_exact(name: str) -> None:
    model, x, loss_fn = _gpt(vocab=64)
    eng = _composed(name)
    assert eng.idle_transforms(model) == ["chunked_ce"]
    reason = eng.idle_reason(model)
    assert reason is not None and "chunked_ce" in reason
    assert "chunked_ce on model: nothing to swap" in str(leangrad.explain(eng, model))
    _check(eng, model, x, loss_fn)


def test_explain_says_why_chunked_ce_is_idle() -> None:
    model, _, _ = _gpt(vocab=64)
    assert "no final nn.Linear" in str(leangrad.explain(leangrad.engine("chunked_ce"), model))


def test_a_widening_mlp_is_not_taken_for_the_output_layer() -> None:
    """The zoo's GPT at vocabulary = width (256): each MLP's first layer (256 -> 1024) is
    vocabulary-sized but feeds the second; its head (256 -> 256) is not. chunked_ce used to
    take the last MLP layer for the head and refuse the step (LogitsReadError: GELU read
    it); it is idle and exact."""
    torch.manual_seed(0)
    model = zoo.gpt(vocab=256, dim=256, layers=1, heads=2, context=8).double()
    gen = torch.Generator().manual_seed(1)
    idx, y = torch.randint(0, 256, (2, 2, 8), generator=gen)
    assert isinstance(leangrad.loss.final_linear(model), str)
    eng = _composed("checkpoint+chunked_ce")
    assert eng.idle_transforms(model) == ["chunked_ce"]
    _check(eng, model, (idx,), lambda out: zoo.GPT.loss(out, y))


@pytest.mark.parametrize("name", ["moonwalk", "forward", "projforward", "highway",
                                  "revbackprop"])  # fmt: skip
def test_bases_that_run_the_output_layer_refuse(name: str) -> None:
    with pytest.raises(EngineInputError, match=f"'{name}\\+chunked_ce' cannot work"):
        leangrad.engine(f"{name}+chunked_ce")


@pytest.mark.parametrize("name", ["chunked_ce", "checkpoint+chunked_ce"])
def test_bad_chunk_size_is_refused(name: str) -> None:
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            leangrad.engine(name, chunk_size=bad)


@pytest.mark.parametrize("name", ["chunked_ce", "checkpoint+chunked_ce"])
def test_a_loss_that_reads_the_logits_raises(name: str) -> None:
    model, x, _ = _gpt()
    y = torch.zeros(2, 8, dtype=torch.long)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return -(out.softmax(-1).flatten(0, 1)[torch.arange(16), y.flatten()]).log().mean()

    with pytest.raises(LogitsReadError, match="softmax read the logits of 'head'"):
        leangrad.engine(name).backward(model, x, loss_fn)
    model.zero_grad(set_to_none=True)
    assert not isinstance(model(*x), LazyLogits)


def test_explain_names_the_head() -> None:
    model, _, _ = _gpt()
    text = str(leangrad.explain(leangrad.engine("checkpoint+chunked_ce", chunk_size=5), model))
    assert "head: logits never computed" in text and "5 rows" in text, text
    assert "blocks.0" in text


def test_peak_memory_is_below_backprop() -> None:
    """zoo.gpt at a vocabulary of 8,192 and batch (4, 32), float32: backprop holds the 4 MiB
    logits and more of their size (log-softmax, gradient); chunked_ce holds one chunk of
    them (an eighth), so its step needs less than the logits above the model itself."""
    vocab, batch = 8192, (4, 32)
    torch.manual_seed(0)
    model = zoo.gpt(vocab=vocab, dim=32, layers=2, heads=2, context=32)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, batch, generator=gen)
    y = torch.randint(0, vocab, batch, generator=gen)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return zoo.GPT.loss(out, y)

    logits_bytes = batch[0] * batch[1] * vocab * 4
    bp = profile_step(leangrad.engine("backprop"), model, (x,), loss_fn, repeats=0)
    ce = profile_step(leangrad.engine("chunked_ce"), model, (x,), loss_fn, repeats=0)
    assert ce.peak_bytes < bp.peak_bytes
    assert ce.peak_bytes - ce.baseline_bytes < logits_bytes, (ce.peak_bytes, ce.baseline_bytes)
    assert bp.peak_bytes - bp.baseline_bytes > 2 * logits_bytes, (bp.peak_bytes, logits_bytes)


# --- the Hugging Face models (leangrad.hf), as tests/hf/test_hf_models.py builds them ---

HF_MODELS = ("gpt2", "llama", "bert")
HF_TOL: dict[str, float] = {"gpt2": 1e-9, "llama": 1e-6, "bert": 1e-9}
"""As tests/hf/test_hf_models.py's EXACT_TOL: Llama's RMSNorm and rotary embedding compute
in float32 whatever the model's dtype."""
HEADS = {"gpt2": "lm_head", "llama": "lm_head", "bert": "cls.predictions.decoder"}
_BUILT: dict[str, Problem] = {}


def _hf(name: str) -> Problem:
    """The tiny model in float64 at a 2,048-token vocabulary, in training mode (dropout:
    :func:`helpers.seeded_autograd` and :func:`_check` seed both steps alike); built once."""
    pytest.importorskip("transformers")
    from leangrad import hf

    if name not in _BUILT:
        model = hf.model(name, **{**hf.TINY[name], "vocab": VOCAB}, dtype=torch.float64)
        x, loss_fn = hf.batch(name, model, 2, length=8)
        _BUILT[name] = (model, x, loss_fn)
    return _BUILT[name]


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("model_name", HF_MODELS)
def test_hf_models_are_exact(model_name: str, name: str) -> None:
    model, x, loss_fn = _hf(model_name)
    assert model.training
    eng = _composed(name)
    assert "chunked_ce" not in eng.idle_transforms(model)
    if name in ("chunked_ce", "checkpoint+chunked_ce"):
        assert eng.idle_transforms(model) == []
    _check(eng, model, x, loss_fn, HF_TOL[model_name])


@pytest.mark.parametrize("model_name", HF_MODELS)
def test_hf_chunk_size_and_explain(model_name: str) -> None:
    model, x, loss_fn = _hf(model_name)
    eng = leangrad.engine("checkpoint+chunked_ce", chunk_size=3)
    text = str(leangrad.explain(eng, model))
    assert f"{HEADS[model_name]}: logits never computed" in text, text
    _check(eng, model, x, loss_fn, HF_TOL[model_name])


# --- a tied input embedding adds into the loss's weight gradient ------------------------

V_TIED, D_TIED = 4096, 8


class _Tied(nn.Module):
    """An embedding and an output layer sharing one matrix (GPT-2, BERT), the embedding
    used ``uses`` times, with a padding row."""

    def __init__(self, *, uses: int = 1, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V_TIED, D_TIED, padding_idx=3)
        self.mix = nn.Linear(D_TIED, D_TIED)
        self.head = nn.Linear(D_TIED, V_TIED, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.uses = uses

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = sum(self.emb(idx.roll(k, 1)) for k in range(self.uses))
        return self.head(torch.tanh(self.mix(h)))


def _tied_problem(uses: int, tied: bool = True,
                  dtype: torch.dtype = torch.float64) -> Problem:  # fmt: skip
    torch.manual_seed(0)
    model = _Tied(uses=uses, tied=tied).to(dtype)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V_TIED, (4, 16), generator=gen)
    idx[0, :3] = 3  # the padding row: its gradient stays zero under autograd
    y = torch.randint(0, V_TIED, (4, 16), generator=gen)
    return model, (idx,), lambda out: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("uses", [1, 2])
@pytest.mark.parametrize("name", ["chunked_ce", "checkpoint+chunked_ce"])
def test_tied_embedding_is_exact(name: str, uses: int) -> None:
    model, x, loss_fn = _tied_problem(uses)
    _check(leangrad.engine(name), model, x, loss_fn)


def test_tied_embedding_adds_to_an_existing_grad() -> None:
    """Gradient accumulation: a second step adds to the ``.grad`` of the first, as
    autograd does."""
    model, x, loss_fn = _tied_problem(1)
    eng = leangrad.engine("chunked_ce")
    model.zero_grad(set_to_none=True)
    loss_fn(model(*x)).backward()
    loss_fn(model(*x)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    eng.backward(model, x, loss_fn)
    eng.backward(model, x, loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert compare_grads(got, ref).max_rel_err <= 1e-10


def test_tied_embedding_frozen_weight_keeps_none() -> None:
    model, x, loss_fn = _tied_problem(1)
    model.emb.weight.requires_grad_(False)
    _check(leangrad.engine("chunked_ce"), model, x, loss_fn)
    leangrad.engine("chunked_ce").backward(model, x, loss_fn)
    assert model.emb.weight.grad is None and model.mix.weight.grad is not None


def test_tied_embedding_holds_one_weight_gradient() -> None:
    """Autograd holds three ``(V, D)`` tensors to sum a tied weight's two gradients; the
    chunked loss and its tied embedding hold no more than an untied model's two."""
    peaks = {}
    for tied in (False, True):
        model, x, loss_fn = _tied_problem(1, tied=tied, dtype=torch.float32)
        peaks[tied] = profile_step(leangrad.engine("chunked_ce"), model, x, loss_fn,
                                   repeats=0).peak_bytes  # fmt: skip
    per_matrix = V_TIED * D_TIED * 4
    assert peaks[True] <= peaks[False] + per_matrix // 4, peaks
