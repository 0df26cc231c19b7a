"""``leangrad.loss.LazyLogits``, ``chunked_logits`` and ``final_linear``.

A :class:`LazyLogits` answers for the logits' shape, dtype and device; views of its leading
dimensions give another one, and ``F.cross_entropy`` on it equals the loss of the real
logits (value and gradients); every other read raises :class:`LogitsReadError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leangrad._errors import EngineInputError
from leangrad.loss import LazyLogits, LogitsReadError, chunked_logits, final_linear
from leangrad.loss._lazy import MIN_CLASSES, WIDER, Head

N, T, D, V = 2, 5, 4, 10
RTOL, ATOL = 1e-10, 1e-12
HEAD = "lm_head"


def _parts(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=gen, dtype=dtype).requires_grad_(True)
                 for s in ((N, T, D), (V, D), (V,)))  # fmt: skip


def _lazy(dtype: torch.dtype = torch.float64, **kw: Any) -> LazyLogits:
    h, w, b = _parts(dtype)
    return LazyLogits(h, w, b, head=HEAD, **kw)


def test_metadata_is_the_logits() -> None:
    h, w, b = _parts()
    lazy, real = LazyLogits(h, w, b, head=HEAD), F.linear(h, w, b)
    assert isinstance(lazy, LazyLogits) and isinstance(lazy, torch.Tensor)
    assert lazy.shape == real.shape == (N, T, V)
    assert lazy.size() == real.size() and lazy.size(-1) == V and lazy.size(0) == N
    assert lazy.dtype == real.dtype and lazy.device == real.device
    assert lazy.dim() == lazy.ndim == 3 and lazy.numel() == real.numel() and len(lazy) == N
    assert lazy.requires_grad and lazy.is_floating_point() and lazy.grad is None
    assert lazy.hidden is h and lazy.weight is w and lazy.bias is b and lazy.head == HEAD
    assert lazy.chunk_size is None and LazyLogits(h, w, b, chunk_size=3).chunk_size == 3


def test_requires_grad_follows_the_inputs() -> None:
    h, w, b = (x.detach() for x in _parts())
    assert not LazyLogits(h, w, b).requires_grad
    assert not LazyLogits(h, w, None).requires_grad
    assert LazyLogits(h, w, b.requires_grad_(True)).requires_grad
    assert LazyLogits(h, w.requires_grad_(True), None).requires_grad


def test_repr_says_never_computed() -> None:
    lazy = _lazy()
    for text in (repr(lazy), str(lazy), f"{lazy}"):
        assert "never computed" in text and HEAD in text and str((N, T, V)) in text


MASK = torch.tensor([[True, False, True, True, False], [False, True, True, False, True]])
ROWS = torch.tensor([1, 0, 1])
View = Callable[[Any], Any]
VIEWS: dict[str, View] = {
    "reshape": lambda z: z.reshape(-1, V),
    "reshape_tuple": lambda z: z.reshape((N * T, V)),
    "torch.reshape": lambda z: torch.reshape(z, (-1, V)),
    "view": lambda z: z.view(-1, V),
    "view_size": lambda z: z.view(-1, z.size(-1)),
    "flatten01": lambda z: z.flatten(0, 1),
    "flatten0-2": lambda z: z.flatten(0, -2),
    "torch.flatten": lambda z: torch.flatten(z, 0, 1),
    "regroup": lambda z: z.reshape(T, N, V).reshape(-1, V),
    "shift": lambda z: z[:, :-1].flatten(0, 1),
    "shift_whole_last": lambda z: z[:, :-1, :].reshape(-1, V),
    "bool_mask": lambda z: z[MASK],
    "bool_mask_colon": lambda z: z[MASK, :],
    "int_tensor": lambda z: z[ROWS].reshape(-1, V),
    "int": lambda z: z[1],
    "int_slice": lambda z: z[0, 1:4],
    "list": lambda z: z[[1, 0]].flatten(0, 1),
    "contiguous": lambda z: z.contiguous().view(-1, V),
    "to_same_dtype": lambda z: z.to(torch.float64).reshape(-1, V),
    "to_same_device": lambda z: z.to("cpu").reshape(-1, V),
    "type_as": lambda z: z.type_as(torch.zeros((), dtype=torch.float64)).reshape(-1, V),
}


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(VIEWS))
def test_cross_entropy_through_views_is_the_reference(name: str, reduction: str,
                                                      smoothing: float) -> None:  # fmt: skip
    view = VIEWS[name]
    results = []
    for lazy in (False, True):
        h, w, b = _parts()
        logits = LazyLogits(h, w, b, head=HEAD, chunk_size=3) if lazy else F.linear(h, w, b)
        z = view(logits)
        if lazy:
            assert isinstance(z, LazyLogits) and z.head == HEAD and z.chunk_size == 3
            assert z.weight is w and z.bias is b
        assert z.dim() == 2 and z.shape[-1] == V
        t = torch.randint(0, V, z.shape[:1], generator=torch.Generator().manual_seed(1))
        t[::3] = -100
        loss = F.cross_entropy(z, t, reduction=reduction, label_smoothing=smoothing)
        up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(2), dtype=loss.dtype)
        results.append((z.shape, loss.detach(), *torch.autograd.grad(loss, (h, w, b), up)))
    ref, got = results
    assert got[0] == ref[0]
    for g, r in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL)


def test_float_of_float32_logits_is_itself() -> None:
    lazy = _lazy(torch.float32)
    for same in (lazy.float(), lazy.to(torch.float32), lazy.to(dtype=torch.float32),
                 lazy.contiguous()):  # fmt: skip
        assert same is lazy
    t = torch.arange(N * T) % V
    h, w, b = lazy.hidden, lazy.weight, lazy.bias
    got = F.cross_entropy(lazy.float().flatten(0, 1), t)
    torch.testing.assert_close(got, F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def _cat(z: Any) -> Any:
    return torch.cat([z, z])


def _zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.long)


def _ce_weight(z: Any) -> Any:
    return F.cross_entropy(z.flatten(0, 1), _zeros(N * T), weight=torch.ones(V))


READS: dict[str, tuple[View, str]] = {
    "softmax": (lambda z: z.softmax(-1), "softmax"),
    "F.softmax": (lambda z: F.softmax(z, dim=-1), "softmax"),
    "log_softmax": (lambda z: F.log_softmax(z, dim=-1), "log_softmax"),
    "argmax": (lambda z: z.argmax(-1), "argmax"),
    "add": (lambda z: z + 1, "add"),
    "radd": (lambda z: 1 + z, "add"),
    "mul": (lambda z: z * 2, "mul"),
    "eq": (lambda z: z == 0, "__eq__"),
    "cat": (_cat, "cat"),
    "sum": (lambda z: z.sum(), "sum"),
    "max": (lambda z: z.max(), "max"),
    "clone": (lambda z: z.clone(), "clone"),
    "detach": (lambda z: z.detach(), "detach"),
    "tolist": (lambda z: z.tolist(), "tolist"),
    "transpose": (lambda z: z.transpose(1, 2), "transpose"),
    "unsqueeze": (lambda z: z.unsqueeze(0), "unsqueeze"),
    "reshape_split_classes": (lambda z: z.reshape(N, T, 2, V // 2), "class dimension"),
    "reshape_all": (lambda z: z.reshape(-1), "class dimension"),
    "view_classes_first": (lambda z: z.view(V, -1), "class dimension"),
    "flatten": (lambda z: z.flatten(), "flatten over the class dimension"),
    "flatten12": (lambda z: z.flatten(1, 2), "flatten over the class dimension"),
    "double": (lambda z: z.double(), "double"),
    "float_of_float64": (lambda z: z.float(), "a cast to torch.float32"),
    "to_float32": (lambda z: z.to(torch.float32), "a cast to torch.float32"),
    "to_meta": (lambda z: z.to("meta"), "a cast to meta"),
    "ellipsis": (lambda z: z[..., :], "indexing"),
    "ellipsis_lead": (lambda z: z[..., 0, :], "indexing"),
    "none": (lambda z: z[None], "indexing"),
    "class_int": (lambda z: z[:, :, 0], "indexing"),
    "class_slice": (lambda z: z[:, :, :3], "indexing"),
    "class_tensors": (lambda z: z[ROWS, ROWS, ROWS], "indexing"),
    "ce_weight": (_ce_weight, "weight="),
    "ce_3d": (lambda z: F.cross_entropy(z, _zeros(N, T)), "3 dimensions"),
    "ce_3d_classes_in_dim1": (
        lambda z: F.cross_entropy(z.reshape(N, T, V), _zeros(N, V)),
        "3 dimensions",
    ),
    "ce_probabilities": (
        lambda z: F.cross_entropy(z.flatten(0, 1), torch.rand(N * T, V)),
        "class probabilities",
    ),
    "ce_logits_as_target": (
        lambda z: F.cross_entropy(torch.zeros(N * T, V), z.flatten(0, 1)),
        "as its target",
    ),
    "nll_loss": (lambda z: F.nll_loss(z.flatten(0, 1), _zeros(N * T)), "nll_loss"),
}


@pytest.mark.parametrize("name", list(READS))
def test_every_other_read_raises_naming_it(name: str) -> None:
    read, op = READS[name]
    with pytest.raises(LogitsReadError) as info:
        read(_lazy())
    message = str(info.value)
    assert isinstance(info.value, EngineInputError)
    assert op in message, message
    assert "chunked" in message
    if name != "cat":  # torch.cat gets the logits inside a list, where the head's name is not
        assert repr(HEAD) in message or "cross_entropy" in message, message


def test_bool_mask_over_the_classes_raises_read_error() -> None:
    with pytest.raises(LogitsReadError):
        _lazy()[torch.ones(N, T, V, dtype=torch.bool)]


# --- chunked_logits and final_linear on small models ------------------------------------

VOCAB, DIM = MIN_CLASSES, 8


class _LM(nn.Module):
    """An embedding, a hidden layer and a vocabulary-sized head (optionally tied, or called
    through ``F.linear`` with the head's weight rather than the module)."""

    def __init__(self, *, tied: bool = False, functional: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, VOCAB, bias=not tied)
        if tied:
            self.head.weight = self.emb.weight
        self.functional = functional
        self.double()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.body(self.emb(idx))
        if self.functional:
            return F.linear(x, self.head.weight, self.head.bias)
        out: torch.Tensor = self.head(x)
        return out


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randint(0, VOCAB, (3, 7), generator=gen),
            torch.randint(0, VOCAB, (3, 7), generator=gen))  # fmt: skip


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", ["plain", "tied", "functional"])
def test_chunked_logits_equals_autograd(kind: str) -> None:
    model = _LM(tied=kind == "tied", functional=kind == "functional")
    x, y = _data()
    y[0, :3] = -100
    loss_ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss_ref.backward()
    ref = _grads(model)
    with chunked_logits(model, chunk_size=4) as head:
        out = model(x)
        assert isinstance(out, LazyLogits) and out.chunk_size == 4 and out.head == "head"
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        loss.backward()
    assert isinstance(head, Head) and head.name == "head" and head.module is model.head
    got = _grads(model)
    assert set(got) == set(ref)
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=RTOL, atol=ATOL)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=RTOL, atol=ATOL)
    assert not isinstance(model(x), LazyLogits), "the mode outlived its block"


def test_chunked_logits_without_a_vocabulary_head_raises() -> None:
    model = nn.Sequential(nn.Embedding(100, DIM), nn.Linear(DIM, 64))
    with pytest.raises(EngineInputError, match=r"no final nn\.Linear with a vocabulary-sized"):
        chunked_logits(model).__enter__()


def test_chunked_logits_where_the_head_is_not_called_raises() -> None:
    model = _LM()
    with pytest.raises(EngineInputError, match="'head' was not called"), chunked_logits(model):
        model.body(model.emb(_data()[0]))


def test_an_error_inside_the_block_is_the_one_raised() -> None:
    model = _LM()
    with pytest.raises(LogitsReadError, match="softmax"), chunked_logits(model):
        model(_data()[0]).softmax(-1)


def test_final_linear_thresholds() -> None:
    """At least :data:`MIN_CLASSES` outputs and :data:`WIDER` times the inputs, a width no
    later layer takes; the last such layer registered."""
    inputs = MIN_CLASSES // WIDER
    found = final_linear(nn.Sequential(nn.Linear(4, MIN_CLASSES), nn.ReLU(),
                                       nn.Linear(MIN_CLASSES, inputs),
                                       nn.Linear(inputs, MIN_CLASSES)))  # fmt: skip
    assert isinstance(found, Head) and found.name == "3"
    widening = nn.Sequential(nn.Linear(inputs, MIN_CLASSES), nn.GELU(),
                             nn.Linear(MIN_CLASSES, inputs), nn.Linear(inputs, inputs))  # fmt: skip
    why = final_linear(widening)  # "0" feeds "2": an MLP's first layer, not the output layer
    assert isinstance(why, str) and "taken by a later nn.Linear" in why
    for narrow in (nn.Linear(inputs + 1, MIN_CLASSES), nn.Linear(2, MIN_CLASSES - 1)):
        why = final_linear(nn.Sequential(narrow))
        assert isinstance(why, str) and "no final nn.Linear" in why


def test_final_linear_respects_outside() -> None:
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.proj = nn.Linear(DIM, VOCAB)
    model.decoderx = nn.Linear(DIM, DIM)
    found = final_linear(model, outside=("decoderx", "deco", "proj"))
    assert isinstance(found, Head) and found.name == "decoder.proj"
    for outside in (("decoder",), ("decoder.proj",), ("other", "decoder")):
        why = final_linear(model, outside=outside)
        assert isinstance(why, str) and "'decoder.proj'" in why and "inside block" in why
    with pytest.raises(EngineInputError, match="inside block 'decoder'"):
        chunked_logits(model, outside=("decoder",)).__enter__()
