"""``leangrad.loss.linear_cross_entropy`` against ``F.cross_entropy(F.linear(...))``.

Values and the gradients of the hidden states, the weight and the bias, in float64 (to
rounding: 1e-10) and float32 (1e-5), over every reduction, label smoothing, ignored rows,
chunk sizes, leading shapes, and which inputs want a gradient; then its refusals.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from leangrad._errors import EngineInputError
from leangrad.loss import CHUNK_BYTES, CHUNKS, chunk_rows, linear_cross_entropy

IGNORE = -100
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),  # (rtol, atol)
    torch.float32: (1e-5, 1e-6),
}
Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]


def _inputs(lead: tuple[int, ...], dim: int, classes: int, *, dtype: torch.dtype,
            bias: bool = True, ignored: float = 0.3, seed: int = 0) -> Tensors:  # fmt: skip
    """Hidden states ``(*lead, dim)``, weight, bias and targets with about ``ignored`` of
    the rows set to :data:`IGNORE` (at least one kept when ``ignored < 1``)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, dim, generator=gen, dtype=dtype)
    w = torch.randn(classes, dim, generator=gen, dtype=dtype)
    b = torch.randn(classes, generator=gen, dtype=dtype) if bias else None
    t = torch.randint(0, classes, lead, generator=gen)
    drop = torch.rand(lead, generator=gen) < ignored
    if ignored < 1:
        drop.view(-1)[0] = False
    return h, w, b, t.masked_fill(drop, IGNORE)


def _reference(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor,
               **kw: Any) -> torch.Tensor:  # fmt: skip
    """Plain autograd: the logits flattened to ``(rows, classes)``, as a user writes it; a
    ``z_loss`` weight adds ``w * logsumexp(z)**2`` to every counted row, reduced alike."""
    z_loss = kw.pop("z_loss", 0.0)
    z = F.linear(h, w, b).reshape(-1, w.shape[0])
    out = F.cross_entropy(z, t.reshape(-1), ignore_index=IGNORE, **kw)
    if z_loss:
        valid = t.reshape(-1) != IGNORE
        per = z_loss * torch.logsumexp(z, dim=1).square() * valid
        reduction = kw.get("reduction", "mean")
        out = out + (per if reduction == "none" else per.sum() / (
            valid.sum() if reduction == "mean" else 1))  # fmt: skip
    return out.reshape(t.shape) if kw.get("reduction") == "none" else out


def _both(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor, *,
          wants: tuple[bool, bool, bool] = (True, True, True), chunk_size: int | None = None,
          seed: int = 1, **kw: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """``[loss, grads...]`` of the reference and of ``linear_cross_entropy``, the inputs in
    ``wants`` requiring a gradient and a random upstream gradient (a tensor for ``none``)."""
    results = []
    for chunked in (False, True):
        leaves = [x.detach().clone().requires_grad_(want) if x is not None else None
                  for x, want in zip((h, w, b), wants, strict=True)]  # fmt: skip
        hh, ww, bb = leaves
        assert hh is not None and ww is not None
        if chunked:
            out = linear_cross_entropy(hh, ww, t, bias=bb, ignore_index=IGNORE,
                                       chunk_size=chunk_size, **kw)  # fmt: skip
        else:
            out = _reference(hh, ww, bb, t, **kw)
        wrt = [x for x in leaves if x is not None and x.requires_grad]
        grads: list[torch.Tensor] = []
        if wrt:
            up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                             dtype=out.dtype)  # fmt: skip
            grads = list(torch.autograd.grad(out, wrt, grad_outputs=up))
        else:
            assert not out.requires_grad
        results.append([out.detach(), *grads])
    return results[0], results[1]


def _close(got: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(g, r, equal_nan=True, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("chunk_size", [1, 3, 100, None], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("lead", [(2, 5), (7,)], ids=["NT", "M"])
def test_matches_cross_entropy_of_the_logits(
    dtype: torch.dtype, reduction: str, smoothing: float, bias: bool,
    chunk_size: int | None, lead: tuple[int, ...],
) -> None:  # fmt: skip
    h, w, b, t = _inputs(lead, 6, 11, dtype=dtype, bias=bias)
    assert (t == IGNORE).any() and (t != IGNORE).any()
    ref, got = _both(h, w, b, t, chunk_size=chunk_size, reduction=reduction,
                     label_smoothing=smoothing)  # fmt: skip
    assert len(got) == (4 if bias else 3)
    _close(got, ref, dtype)
    if reduction == "none":
        assert got[0].shape == lead
        assert (got[0][t == IGNORE] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 3, None], ids=lambda c: f"chunk{c}")
def test_z_loss_matches_autograd_of_the_logits(dtype: torch.dtype, reduction: str,
                                               smoothing: float, chunk_size: int | None,
                                               ) -> None:  # fmt: skip
    """The z-loss ``w * logsumexp(z)**2`` per counted row, in the value and in every
    gradient, against autograd through the whole logits (and it does change the loss)."""
    h, w, b, t = _inputs((2, 5), 6, 11, dtype=dtype)
    ref, got = _both(h, w, b, t, chunk_size=chunk_size, reduction=reduction,
                     label_smoothing=smoothing, z_loss=1e-2)  # fmt: skip
    _close(got, ref, dtype)
    plain, _ = _both(h, w, b, t, chunk_size=chunk_size, reduction=reduction,
                     label_smoothing=smoothing)  # fmt: skip
    assert not torch.allclose(plain[0], ref[0])
    if reduction == "none":
        assert (got[0][t == IGNORE] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_every_row_ignored(reduction: str, smoothing: float) -> None:
    """sum and none: zeros; mean: nan (0 / 0), as torch. The gradients are zeros in all
    three, as torch's (the mean's scale 1/0 must not reach the ignored rows as inf * 0)."""
    h, w, b, t = _inputs((2, 3), 4, 9, dtype=torch.float64, ignored=1.0)
    assert (t == IGNORE).all()
    ref, got = _both(h, w, b, t, chunk_size=2, reduction=reduction, label_smoothing=smoothing)
    _close(got, ref, torch.float64)
    if reduction == "mean":
        assert got[0].isnan()
    else:
        assert (got[0] == 0).all()
    assert all((g == 0).all() for g in got[1:])


WANTS = [(True, False, False), (False, True, False), (False, False, True),
         (True, True, False), (False, True, True), (False, False, False)]  # fmt: skip


@pytest.mark.parametrize("wants", WANTS, ids=lambda w: "".join("hwb"[i] for i in range(3) if w[i])
                         or "nothing")  # fmt: skip
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradient_of_some_inputs_only(wants: tuple[bool, bool, bool], reduction: str) -> None:
    h, w, b, t = _inputs((3, 4), 5, 7, dtype=torch.float64)
    ref, got = _both(h, w, b, t, wants=wants, chunk_size=5, reduction=reduction,
                     label_smoothing=0.1)  # fmt: skip
    assert len(got) == 1 + sum(wants)
    _close(got, ref, torch.float64)


def test_no_grad_mode_computes_the_value_only() -> None:
    h, w, b, t = _inputs((4, 3), 5, 8, dtype=torch.float64)
    h.requires_grad_(True)
    with torch.no_grad():
        out = linear_cross_entropy(h, w, t, bias=b, chunk_size=2)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, _reference(h.detach(), w, b, t), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_second_backward_of_a_mean_or_sum_raises(reduction: str) -> None:
    """The gradients were computed in the forward pass and handed to autograd: a second
    backward pass (``retain_graph=True``) has none left and says so."""
    h, w, b, t = _inputs((6,), 4, 9, dtype=torch.float64)
    w.requires_grad_(True)
    out = linear_cross_entropy(h, w, t, bias=b, reduction=reduction)
    out.backward(retain_graph=True)
    assert w.grad is not None
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()


def test_second_backward_of_reduction_none_recomputes() -> None:
    h, w, b, t = _inputs((6,), 4, 9, dtype=torch.float64)
    w.requires_grad_(True)
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", chunk_size=4)
    out.sum().backward(retain_graph=True)
    assert w.grad is not None
    once = w.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(w.grad, 2 * once, rtol=1e-14, atol=0)


def test_gradients_accumulate_into_existing_grad_and_shared_weight() -> None:
    """The gradients handed to autograd without a copy add to a ``.grad`` already there and
    to the weight's other uses (a tied embedding), as autograd's do."""
    h, w, b, t = _inputs((2, 4), 5, 12, dtype=torch.float64)
    grads = []
    for chunked in (False, True):
        ww = w.clone().requires_grad_(True)
        ww.grad = torch.ones_like(ww)
        hh = F.embedding(t.clamp(min=0), ww) + h  # the weight is the embedding too
        loss = (linear_cross_entropy(hh, ww, t, bias=b, chunk_size=3) if chunked
                else _reference(hh, ww, b, t))  # fmt: skip
        loss.backward()
        grads.append(ww.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)


def test_low_precision_loss_is_accumulated_in_float32() -> None:
    h, w, _, t = _inputs((4, 8), 16, 64, dtype=torch.float32)
    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16()
    out = linear_cross_entropy(hb, wb, t, chunk_size=5)
    assert out.dtype == torch.bfloat16
    ref = _reference(hb.detach().float(), wb.float(), None, t)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    out.backward()
    assert hb.grad is not None and hb.grad.dtype == torch.bfloat16 and hb.grad.isfinite().all()


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    lead = draw(st.sampled_from([(draw(st.integers(1, 9)),),
                                 (draw(st.integers(1, 3)), draw(st.integers(1, 4)))]))  # fmt: skip
    return {
        "lead": lead, "dim": draw(st.integers(1, 5)), "classes": draw(st.integers(2, 9)),
        "bias": draw(st.booleans()), "ignored": draw(st.sampled_from([0.0, 0.3, 0.9])),
        "seed": draw(st.integers(0, 2**16)),
        "chunk_size": draw(st.one_of(st.none(), st.integers(1, 12))),
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "label_smoothing": draw(st.sampled_from([0.0, 0.1, 1.0])),
        "z_loss": draw(st.sampled_from([0.0, 0.0, 1e-3, 0.5])),
    }  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(case=_cases())
def test_property_matches_cross_entropy(case: dict[str, Any]) -> None:
    h, w, b, t = _inputs(case["lead"], case["dim"], case["classes"], dtype=torch.float64,
                         bias=case["bias"], ignored=case["ignored"], seed=case["seed"])  # fmt: skip
    ref, got = _both(h, w, b, t, chunk_size=case["chunk_size"], reduction=case["reduction"],
                     label_smoothing=case["label_smoothing"], z_loss=case["z_loss"],
                     seed=case["seed"])  # fmt: skip
    _close(got, ref, torch.float64)


def test_default_chunk_rows() -> None:
    """At most :data:`CHUNK_BYTES` of float32 logits per chunk and at least :data:`CHUNKS`
    chunks; an explicit ``chunk_size`` wins."""
    vocab = 50257
    most = CHUNK_BYTES // (4 * vocab)
    assert chunk_rows(vocab) == most
    assert chunk_rows(vocab, rows=10**6) == most
    assert chunk_rows(vocab, rows=16) == 16 // CHUNKS
    assert chunk_rows(vocab, rows=17) == -(-17 // CHUNKS)
    assert chunk_rows(vocab, rows=1) == 1
    assert chunk_rows(10**9, rows=100) == 1  # a chunk holds at least one row
    assert chunk_rows(vocab, rows=16, chunk_size=5) == 5


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"reduction": "avg"}, "reduction must be"),
        ({"reduction": None}, "reduction must be"),
        ({"label_smoothing": -0.1}, "label_smoothing must be in"),
        ({"label_smoothing": 1.5}, "label_smoothing must be in"),
        ({"z_loss": -1e-4}, "z_loss must be a float >= 0"),
        ({"z_loss": float("nan")}, "z_loss must be a float >= 0"),
        ({"z_loss": True}, "z_loss must be a float >= 0"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"chunk_size": -2}, "chunk_size must be a positive int"),
        ({"chunk_size": 2.0}, "chunk_size must be a positive int"),
        ({"chunk_size": True}, "chunk_size must be a positive int"),
    ],
)
def test_bad_options_raise_value_error(option: dict[str, Any], match: str) -> None:
    h, w, b, t = _inputs((3,), 4, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=match) as info:
        linear_cross_entropy(h, w, t, bias=b, **option)
    assert not isinstance(info.value, EngineInputError)


@pytest.mark.parametrize(
    ("h_shape", "w_shape", "t_shape"),
    [
        ((3, 4), (5, 3), (3,)),  # hidden's features are not the weight's inputs
        ((3, 4), (20,), (3,)),  # a weight that is not a matrix
        ((3, 4), (5, 4), (2,)),  # fewer targets than rows
        ((3, 4), (5, 4), (3, 1)),  # targets of another shape
        ((2, 3, 4), (5, 4), (6,)),  # targets not of hidden's leading shape
    ],
)
def test_mismatched_shapes_raise_engine_input_error(
    h_shape: tuple[int, ...], w_shape: tuple[int, ...], t_shape: tuple[int, ...]
) -> None:
    h, w = torch.randn(h_shape), torch.randn(w_shape)
    t = torch.zeros(t_shape, dtype=torch.long)
    with pytest.raises(EngineInputError, match="do not match") as info:
        linear_cross_entropy(h, w, t)
    assert str(h_shape) in str(info.value) and str(w_shape) in str(info.value)
