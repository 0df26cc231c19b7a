"""Shared modules and tied weights under every engine (classes 2–4 and 8).

- ``on_grad`` fires exactly once per trainable parameter per step, with its final
  gradient, under every engine (and compositions) that accepts the model: a chain layer
  listed twice, weights tied across a chain's parts, a module listed twice in a
  ``Sequential`` (and so in two checkpoint segments), a GPT-style tied embedding, a
  HighwayNet whose stem and head share a weight. A per-parameter optimizer step inside
  ``on_grad`` equals one optimizer step on the full gradient.
- pure Moonwalk on a Chain holding one coupling twice fills its weights' ``.grad`` and
  keeps the user's Parameters;
- pure Moonwalk with training-mode dropout in the head draws autograd's masks in every
  vmap chunk and in the head's backward, and leaves the RNG stream where autograd does;
- a parameter-only ``autograd.grad`` through GroupNorm on a channels-last input kills
  the process in PyTorch: leangrad's chain engines must not take that path (run in a
  subprocess, so that a regression fails the test instead of killing pytest).

Tolerances: exact engines 1e-10 relative in float64 (summation order only); 1e-4 in
float32 where noted.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import Chain, models
from leangrad.engines._base import GradAnnouncer
from leangrad.highway import GRULayer, HighwayNet
from leangrad.layers import AdditiveCoupling, LeakyReLU, SubmersiveConv2d
from leangrad.layers._base import param_grad_input

DT = torch.float64
TOL = 1e-10
Loss = Callable[[Any], torch.Tensor]
Case = tuple[nn.Module, tuple[torch.Tensor, ...], Loss]

# Every registered engine, with the option variants that take different paths, and the
# compositions of a chain engine or checkpoint with a transform.
ENGINES: list[tuple[str, dict[str, Any]]] = [
    ("backprop", {}),
    ("bits", {}),
    ("checkpoint", {}),
    ("checkpoint", {"segments": 2}),
    ("checkpoint", {"trace": True}),
    ("forward", {"chunk_size": 7}),
    ("projforward", {"samples": 3, "chunk_size": 2, "seed": 0}),
    ("moonwalk", {}),
    ("moonwalk", {"segments": 2}),
    ("moonwalk", {"stem_chunks": 1}),
    ("moonwalk", {"stem_chunks": 2}),
    ("moonwalk", {"fragment": "full"}),
    ("moonwalk", {"mode": "pure", "chunk_size": 7}),
    ("moonwalk", {"mode": "pure", "per_example": True}),
    ("revbackprop", {}),
    ("highway", {"k": 10}),
    ("rad", {"fraction": 0.5, "seed": 0}),
    ("fad", {}),
    ("checkpoint+fad", {}),
    ("moonwalk+fad", {}),
    ("revbackprop+fad", {}),
    ("chunked_ce", {}),
    ("accumulate", {}),  # refused here: these cases' losses are not declared per example
]


def _coupling() -> AdditiveCoupling:
    return AdditiveCoupling(nn.Sequential(nn.Linear(2, 2), nn.Tanh()))


def _squares(out: torch.Tensor) -> torch.Tensor:
    return (out**2).sum()


def _coupling_twice() -> Case:
    """A Chain listing one coupling twice (its weights get two pieces of gradient)."""
    torch.manual_seed(0)
    cp = _coupling()
    model = Chain(cp, LeakyReLU(0.2), cp, stem=nn.Linear(3, 4), head=nn.Linear(4, 2))
    return model.to(DT), (torch.randn(5, 3, dtype=DT),), _squares


def _tied_across_parts() -> Case:
    """A weight tied between stem and head, and a coupling's F reused in the head."""
    torch.manual_seed(1)
    cp = _coupling()
    stem = nn.Linear(4, 4)
    head = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2), cp.F)
    head[0].weight = stem.weight
    model = Chain(cp, LeakyReLU(0.3), _coupling(), stem=stem, head=head)
    return model.to(DT), (torch.randn(5, 4, dtype=DT),), _squares


def _conv_twice() -> Case:
    """A submersive conv listed first and again later, after a parameter-free stem: the
    moonwalk h1 seed (stem chunks) forms the first use's gradient apart from the rest."""
    torch.manual_seed(6)
    conv = SubmersiveConv2d(4, 4, 3, stride=2, padding=1)
    model = Chain(
        conv, LeakyReLU(0.2), conv, LeakyReLU(0.3),
        stem=models.RepeatChannels(4),
        head=nn.Sequential(nn.Flatten(), nn.Linear(4 * 2 * 2, 3)),
    ).to(DT)  # fmt: skip
    return model, (torch.randn(4, 1, 8, 8, dtype=DT),), _squares


def _sequential_twice() -> Case:
    """A Linear listed twice in a Sequential: two checkpoint blocks, two segments."""
    torch.manual_seed(2)
    lin = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), lin, nn.Tanh(), lin, nn.Tanh(),
                          nn.Linear(3, 2))  # fmt: skip
    return model.to(DT), (torch.randn(5, 4, dtype=DT),), _squares


class _TinyLM(nn.Module):
    """GPT-style: the output layer's weight is the token embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.LayerNorm(6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.tok(ids)))


def _tied_embedding() -> Case:
    torch.manual_seed(3)
    ids = torch.randint(0, 11, (3, 5))
    target = torch.randint(0, 11, (3, 5))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    return _TinyLM().to(DT), (ids,), loss_fn


def _highway_tied() -> Case:
    """A HighwayNet whose stem and head share a weight."""
    torch.manual_seed(4)
    stem = nn.Linear(5, 5)
    head = nn.Sequential(nn.Linear(5, 5), nn.Flatten(0, 1))
    head[0].weight = stem.weight
    model = HighwayNet(stem, [GRULayer(5, 5)], head)
    return model.to(DT), (torch.randn(6, 2, 5, dtype=DT),), _squares


MODELS: dict[str, Callable[[], Case]] = {
    "coupling_twice": _coupling_twice,
    "conv_twice": _conv_twice,
    "tied_across_parts": _tied_across_parts,
    "sequential_twice": _sequential_twice,
    "tied_embedding": _tied_embedding,
    "highway_tied": _highway_tied,
}


def _engine(name: str, options: dict[str, Any]) -> leangrad.Engine:
    return leangrad.engine(name, **options)


def _autograd(case: Case) -> dict[str, torch.Tensor | None]:
    model, xs, loss_fn = case
    ref = copy.deepcopy(model)
    loss_fn(ref(*xs)).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _accepts(eng: leangrad.Engine, model: nn.Module) -> bool:
    return eng.supports(model) is None


def test_on_grad_engine_list_covers_every_registered_engine() -> None:
    assert set(leangrad.available()) <= {n for n, _ in ENGINES}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize(("name", "options"), ENGINES, ids=lambda v: str(v) if v else "")
def test_on_grad_once_per_parameter_with_its_final_gradient(
    name: str, options: dict[str, Any], kind: str
) -> None:
    """``on_grad`` is called once per parameter that gets a gradient, with the user's
    Parameter, whose ``.grad`` is already final (equal to autograd's for exact engines);
    tied weights stay tied and stay the user's Parameters."""
    case = MODELS[kind]()
    model, xs, loss_fn = case
    eng = _engine(name, options)
    if not _accepts(eng, model):
        pytest.skip(f"{eng.label} refuses {kind}")
    want = _autograd(case)
    before = {n: p for n, p in model.named_parameters()}
    calls: list[tuple[str, torch.Tensor]] = []

    def on_grad(n: str, p: nn.Parameter) -> None:
        assert p is before[n], f"on_grad({n!r}) was not handed the user's Parameter"
        assert p.grad is not None
        calls.append((n, p.grad.clone()))

    try:
        eng.backward(model, xs, loss_fn, on_grad=on_grad)
    except leangrad.LeangradError:
        return  # a refusal that names its condition is within the contract
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is p and isinstance(p, nn.Parameter) for n, p in before.items())
    names = [n for n, _ in calls]
    assert len(names) == len(set(names)), f"on_grad called more than once: {names}"
    with_grad = {n for n, p in after.items() if p.grad is not None}
    assert set(names) == with_grad
    for n, handed in calls:
        final = after[n].grad
        assert final is not None and torch.equal(handed, final), f"{n}: on_grad saw a partial"
    assert with_grad == {n for n, g in want.items() if g is not None}
    if eng.exact:
        for n in with_grad:
            got, w = after[n].grad, want[n]
            assert got is not None and w is not None
            assert _rel(got, w) <= TOL, (n, _rel(got, w))


def _sgd(lr: float) -> Callable[[str, nn.Parameter], None]:
    def on_grad(_: str, p: nn.Parameter) -> None:
        assert p.grad is not None
        with torch.no_grad():
            p.sub_(lr * p.grad)
        p.grad = None

    return on_grad


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize(
    ("name", "options"),
    [(n, o) for n, o in ENGINES if leangrad.engine(n, **o).exact],
    ids=lambda v: str(v) if v else "",
)
def test_on_grad_sgd_step_inside_equals_one_optimizer_step(
    name: str, options: dict[str, Any], kind: str
) -> None:
    """A per-parameter SGD step inside ``on_grad`` moves no parameter the step has yet to
    use and steps each once with its whole gradient: the weights equal one
    ``optimizer.step()`` after autograd's backward."""
    lr = 0.3
    model, xs, loss_fn = MODELS[kind]()
    eng = _engine(name, options)
    if not _accepts(eng, model):
        pytest.skip(f"{eng.label} refuses {kind}")
    ref = copy.deepcopy(model)
    loss_fn(ref(*xs)).backward()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    try:
        eng.backward(model, xs, loss_fn, on_grad=_sgd(lr))
    except leangrad.LeangradError:
        return
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is None, n
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12, msg=n)


def test_on_grad_announcer_holds_revisited_parameters_until_the_end() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    seen: list[str] = []
    ann = GradAnnouncer("test", {"a": a, "b": b}, lambda n, _p: seen.append(n), held={id(a)})
    ann("a", a)
    ann("alias_of_b", b)  # named as in params
    ann("a", a)
    assert seen == ["b"]
    ann.finish()
    assert seen == ["b", "a"]
    with pytest.raises(RuntimeError, match="second time"):
        ann("b", b)


# --- pure Moonwalk --------------------------------------------------------------------------


@pytest.mark.parametrize("per_example", [False, True])
def test_pure_moonwalk_coupling_twice_fills_every_grad(per_example: bool) -> None:
    model, xs, loss_fn = _coupling_twice()
    want = _autograd((model, xs, loss_fn))
    params = dict(model.named_parameters())
    leangrad.engine("moonwalk", mode="pure", chunk_size=5, per_example=per_example).backward(
        model, xs, loss_fn
    )
    for n, p in model.named_parameters():
        assert p is params[n] and isinstance(p, nn.Parameter), n
        w = want[n]
        assert p.grad is not None and w is not None, n
        assert _rel(p.grad, w) <= TOL, (n, _rel(p.grad, w))


def _dropout_chain(dtype: torch.dtype) -> Case:
    torch.manual_seed(5)
    model = Chain(
        _coupling(), LeakyReLU(0.2), _coupling(),
        stem=nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3)),
        head=nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 3), nn.Dropout(0.2)),
    ).to(dtype)  # fmt: skip
    return model, (torch.randn(6, 3, dtype=dtype),), _squares


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, TOL), (torch.float32, 1e-4)])
@pytest.mark.parametrize("per_example", [False, True])
def test_pure_moonwalk_head_dropout_replays_autograds_masks(
    dtype: torch.dtype, tol: float, per_example: bool
) -> None:
    """Several vmap chunks (24 input coordinates, 5 per chunk) and the head's backward all
    draw the masks of one autograd forward; the RNG ends where autograd leaves it."""
    model, xs, loss_fn = _dropout_chain(dtype)
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    want_loss = loss_fn(ref(*xs))
    want_loss.backward()
    want_rng = torch.get_rng_state()
    torch.manual_seed(7)
    res = leangrad.engine("moonwalk", mode="pure", chunk_size=5, per_example=per_example
                          ).backward(model, xs, loss_fn)  # fmt: skip
    assert torch.equal(torch.get_rng_state(), want_rng)
    assert _rel(res.loss, want_loss.detach()) <= tol
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, n
        assert _rel(p.grad, q.grad) <= tol, (n, _rel(p.grad, q.grad))


# --- GroupNorm on a channels-last input -------------------------------------------------------

_GROUPNORM_SCRIPT = textwrap.dedent(
    """
    import copy, torch
    from torch import nn
    import leangrad
    from leangrad import Chain, models
    from leangrad.layers import AdditiveCoupling
    for dt in (torch.float64, torch.float32):
        torch.manual_seed(0)
        model = Chain(
            AdditiveCoupling(nn.Sequential(nn.GroupNorm(1, 3), nn.Conv2d(3, 3, 3, padding=1))),
            stem=nn.Conv2d(2, 6, 3, padding=1), head=nn.Flatten()).to(dt)
        x = torch.randn(2, 2, 5, 5, dtype=dt).contiguous(memory_format=torch.channels_last)
        loss_fn = lambda out: (out ** 2).sum()
        ref = copy.deepcopy(model)
        loss_fn(ref(x)).backward()
        for name, opts in [("moonwalk", {}), ("moonwalk", {"stem_chunks": 1}),
                           ("moonwalk", {"mode": "pure", "chunk_size": 16}),
                           ("moonwalk", {"segments": 1}), ("revbackprop", {})]:
            m = copy.deepcopy(model)
            leangrad.engine(name, **opts).backward(m, x, loss_fn)
            err = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                      for p, q in zip(m.parameters(), ref.parameters()))
            print(dt, name, opts, err)
            assert err <= (1e-10 if dt == torch.float64 else 1e-4), (dt, name, opts, err)
    print("ALL OK")
    """
)


@pytest.mark.slow
def test_groupnorm_channels_last_moonwalk_does_not_crash() -> None:
    """The issue's reproduction, in a subprocess: it segfaulted in Phase III."""
    run = subprocess.run(
        [sys.executable, "-c", _GROUPNORM_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "ALL OK" in run.stdout


def test_groupnorm_channels_last_param_grad_input_layouts() -> None:
    """Channels innermost (channels-last, or a channel slice of it) → the standard layout;
    any other input is used as it is, without a copy."""
    x = torch.randn(2, 6, 5, 5, dtype=DT)
    cl = x.contiguous(memory_format=torch.channels_last)
    for t in (cl, cl[:, :3], cl.unsqueeze(2).contiguous(memory_format=torch.channels_last_3d)):
        out = param_grad_input(t.requires_grad_(False))
        assert out.is_contiguous() and torch.equal(out, t)
    for t in (x, x[:, :3], x.transpose(2, 3), torch.randn(3, 4)):
        assert param_grad_input(t).data_ptr() == t.data_ptr()
    assert not param_grad_input(x.requires_grad_()).requires_grad
