"""``checkpoint(time_chunks=k)``: fused ``nn.LSTM``/``nn.GRU``/``nn.RNN`` modules checkpointed
along time equal autograd (float64 tight, float32 close), keep less, refuse what they cannot
chunk with the reason; compositions and ``plan`` on a model whose blocks are an fx split."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import _errors as E
from leangrad import zoo
from leangrad.engines.checkpoint._engine import CHUNKS_AND_SEGMENTS, NO_RECURRENT
from leangrad.engines.checkpoint._time_chunks import BAD_TIME_CHUNKS

TOL64 = 1e-12


class _Seq(nn.Module):
    """A float-input sequence model: dropout, a fused recurrent module, a linear head."""

    def __init__(self, rnn: nn.RNNBase, *, head_in: int, p: float = 0.0, hx: bool = False):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.rnn = rnn
        self.head = nn.Linear(head_in, 3)
        self.hx = hx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = None
        if self.hx:  # an explicit initial state, computed from the input
            n = self.rnn.num_layers
            batch = x.shape[0] if self.rnn.batch_first else x.shape[1]
            size = self.rnn.proj_size or self.rnn.hidden_size
            z = torch.tanh(x.mean()).expand(n, batch, size).contiguous()
            h0 = (z, torch.zeros(n, batch, self.rnn.hidden_size)) if isinstance(
                self.rnn, nn.LSTM) else z  # fmt: skip
        out, _ = self.rnn(self.drop(x), h0)
        return self.head(out)


def _problem(rnn: nn.RNNBase, *, steps: int = 11, dtype: torch.dtype = torch.float64,
             p: float = 0.0, hx: bool = False):  # type: ignore[no-untyped-def]  # fmt: skip
    torch.manual_seed(0)
    head_in = rnn.proj_size if isinstance(rnn, nn.LSTM) and rnn.proj_size else rnn.hidden_size
    model = _Seq(rnn, head_in=head_in, p=p, hx=hx).to(dtype)
    shape = (4, steps, rnn.input_size) if rnn.batch_first else (steps, 4, rnn.input_size)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    target = torch.randn(*shape[:2], 3, dtype=dtype)
    return model, x, lambda out: F.mse_loss(out, target)


def _grads(model: nn.Module, x: torch.Tensor, loss_fn, run) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    x.grad = None
    run(model, x, loss_fn)
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _autograd(model: nn.Module, x: torch.Tensor, loss_fn) -> None:  # type: ignore[no-untyped-def]
    loss_fn(model(x)).backward()


RNNS = {
    "lstm": lambda: nn.LSTM(5, 7, num_layers=2),
    "lstm-batch-first": lambda: nn.LSTM(5, 7, num_layers=2, batch_first=True),
    "lstm-proj": lambda: nn.LSTM(5, 7, proj_size=4, batch_first=True),
    "gru": lambda: nn.GRU(5, 7, num_layers=3, batch_first=True),
    "rnn-relu": lambda: nn.RNN(5, 7, nonlinearity="relu"),
}


@pytest.mark.parametrize("kind", list(RNNS))
@pytest.mark.parametrize("chunks", [2, 3, 11, 40])
@pytest.mark.parametrize("hx", [False, True])
def test_time_chunks_equal_autograd_in_float64(kind: str, chunks: int, hx: bool) -> None:
    model, x, loss_fn = _problem(RNNS[kind](), hx=hx)
    ref = _grads(model, x, loss_fn, _autograd)
    eng = leangrad.engine("checkpoint", time_chunks=chunks)
    got = _grads(model, x, loss_fn, lambda m, xs, lf: eng.backward(m, xs, lf))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=TOL64, atol=TOL64)


@pytest.mark.parametrize("kind", ["lstm-batch-first", "gru"])
def test_time_chunks_match_autograd_in_float32(kind: str) -> None:
    model, x, loss_fn = _problem(RNNS[kind](), dtype=torch.float32, steps=32)
    ref = _grads(model, x, loss_fn, _autograd)
    eng = leangrad.engine("checkpoint", time_chunks=4)
    got = _grads(model, x, loss_fn, lambda m, xs, lf: eng.backward(m, xs, lf))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_dropout_outside_the_recurrence_draws_as_autograd_does() -> None:
    model, x, loss_fn = _problem(nn.GRU(5, 7), p=0.3)
    torch.manual_seed(5)
    ref = _grads(model, x, loss_fn, _autograd)
    ref_state = torch.get_rng_state()
    torch.manual_seed(5)
    eng = leangrad.engine("checkpoint", time_chunks=3)
    got = _grads(model, x, loss_fn, lambda m, xs, lf: eng.backward(m, xs, lf))
    assert torch.equal(torch.get_rng_state(), ref_state)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=TOL64, atol=TOL64)


def test_time_chunks_keep_less_than_backprop_and_the_users_module_is_unchanged() -> None:
    torch.manual_seed(0)
    model = zoo.rnn_lm("lstm", vocab=32, embed=16, hidden=64)
    idx, tgt = torch.randint(0, 32, (8, 64)), torch.randint(0, 32, (8, 64))
    loss_fn = lambda out: F.cross_entropy(out.reshape(-1, 32), tgt.reshape(-1))  # noqa: E731
    before = [type(m) for m in model.modules()]

    def peak(name: str, **opts: object) -> int:
        eng = leangrad.engine(name, **opts)
        return leangrad.measure.profile_step(eng, model, idx, loss_fn, repeats=0).peak_bytes

    plain, two, eight = peak("backprop"), peak("checkpoint", time_chunks=2), peak(
        "checkpoint", time_chunks=8)  # fmt: skip
    assert eight < two < plain
    assert eight < 0.4 * plain
    assert [type(m) for m in model.modules()] == before
    assert isinstance(model.rnn, nn.LSTM)


def test_a_model_that_is_its_recurrent_module() -> None:
    torch.manual_seed(0)
    rnn = nn.GRU(3, 5, batch_first=True).double()
    x = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    loss_fn = lambda out: out[0].pow(2).sum() + out[1].sum()  # noqa: E731
    ref = _grads(rnn, x, loss_fn, _autograd)
    eng = leangrad.engine("checkpoint", time_chunks=3)
    got = _grads(rnn, x, loss_fn, lambda m, xs, lf: eng.backward(m, xs, lf))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=TOL64, atol=TOL64)


def test_what_cannot_be_chunked_is_refused_with_the_reason() -> None:
    eng = leangrad.engine("checkpoint", time_chunks=4)
    model, x, loss_fn = _problem(nn.LSTM(5, 7, bidirectional=True))
    model.head = nn.Linear(14, 3).double()
    assert "bidirectional" in (eng.supports(model) or "")
    with pytest.raises(E.EngineInputError, match="reverse direction"):
        eng.backward(model, x, loss_fn)
    model, x, loss_fn = _problem(nn.GRU(5, 7, num_layers=2, dropout=0.5))
    with pytest.raises(E.EngineInputError, match=r"dropout=0\.5.*RNG stream"):
        eng.backward(model, x, loss_fn)
    model.eval()  # no dropout in eval mode: it can be chunked
    assert eng.supports(model) is None
    mlp = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    assert eng.supports(mlp) == NO_RECURRENT.format(value=4, model="Sequential")


@pytest.mark.parametrize("value", [0, 1, True, 2.5, "4"])
def test_bad_time_chunks_values(value: object) -> None:
    with pytest.raises(ValueError, match=re.escape(BAD_TIME_CHUNKS.format(value=value))):
        leangrad.engine("checkpoint", time_chunks=value)


def test_time_chunks_and_segments_do_not_combine() -> None:
    with pytest.raises(ValueError, match=re.escape(CHUNKS_AND_SEGMENTS)):
        leangrad.engine("checkpoint", time_chunks=2, segments=2)


def test_a_hook_on_a_chunked_module_is_refused() -> None:
    model, x, loss_fn = _problem(nn.GRU(5, 7))
    model.rnn.register_forward_hook(lambda *_: None)
    with pytest.raises(E.EngineInputError, match="forward hook"):
        leangrad.engine("checkpoint", time_chunks=2).backward(model, x, loss_fn)


def _lm():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = zoo.rnn_lm("gru", vocab=17, embed=6, hidden=9).double()
    idx, tgt = torch.randint(0, 17, (3, 10)), torch.randint(0, 17, (3, 10))
    return model, idx, lambda out: F.cross_entropy(out.reshape(-1, 17), tgt.reshape(-1))


@pytest.mark.parametrize(
    ("name", "opts"),
    [
        ("checkpoint+fad", {}),
        ("checkpoint+bits", {}),
        ("checkpoint+rad", {"fraction": 1.0}),
        ("checkpoint+fad", {"time_chunks": 3}),
        ("checkpoint+bits", {"time_chunks": 3}),
        ("checkpoint+rad", {"fraction": 1.0, "time_chunks": 3}),
    ],
)
def test_compositions_on_a_model_split_by_fx_equal_autograd(
    name: str, opts: dict[str, object]
) -> None:
    """The RNN LM's module tree repeats nothing, so its blocks are an fx split; the
    compositions transformed the split's blocks on the model itself (AttributeError
    'RNNLM has no attribute submod_0')."""
    model, idx, loss_fn = _lm()
    assert leangrad.blocks(model).runner is not None
    ref = copy.deepcopy(model)
    loss_fn(ref(idx)).backward()
    eng = leangrad.engine(name, **opts)
    assert eng.supports(model) is None
    eng.backward(model, idx, loss_fn)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=TOL64, atol=TOL64)


@pytest.mark.slow
def test_plan_checkpoints_a_fused_lstm_along_time() -> None:
    torch.manual_seed(0)
    model = zoo.rnn_lm("lstm", vocab=32, embed=16, hidden=64)
    idx, tgt = torch.randint(0, 32, (8, 64)), torch.randint(0, 32, (8, 64))
    loss_fn = lambda out: F.cross_entropy(out.reshape(-1, 32), tgt.reshape(-1))  # noqa: E731
    bp = leangrad.measure.profile_step(leangrad.engine("backprop"), model, idx, loss_fn,
                                       repeats=0)  # fmt: skip
    p = leangrad.plan(model, idx, loss_fn, budget=bp.baseline_bytes + bp.peak_bytes // 2,
                      repeats=1)  # fmt: skip
    chosen = next(c for c in p.table if c.verdict == "chosen")
    # fragments of the batch fit too (and may be faster): which wins is a timing
    chosen_how = chosen.options.get("time_chunks") or chosen.options.get("fragments")
    assert chosen.name == "checkpoint" and chosen_how is not None
    chunked = [c for c in p.table if c.options.get("time_chunks") in (2, 4, 8, 16)]
    assert chunked and any(c.verdict in ("fits", "chosen") for c in chunked)
    # the fx split's block names are not the model's: no candidate names them
    assert not any("submod_" in c.label for c in p.table)
