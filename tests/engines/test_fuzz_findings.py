"""Regression tests for the defects the engine fuzz test found (findings F1–F6).

Each test compares an engine with ``loss_fn(model(*inputs)).backward()`` on a copy of the
model: float64 gradients to 1e-10 relative, buffers to 1e-12, RNG states (and the layers'
own generators) exactly; float32 loosely — or checks that the engine refuses with one
leangrad error line naming the layer and the condition.

- F1: ``forward``/``projforward`` drew dropout masks in the vmapped tensor's memory layout,
  not autograd's (a channels-last activation): another network's gradient.
- F2: ``moonwalk+fad`` ran a stem with dropout in batch chunks (fad had turned the dropout
  module into traced code the module check missed): other masks, RNG off.
- F3: the ``rad`` engine re-randomized the user's own rad layers (estimator and stream
  replaced); ``checkpoint`` recomputed a layer that draws from its own generator with the
  next draw.
- F4/F5: leangrad's own autograd-Function layers failed under ``torch.func`` transforms
  (``forward``, ``projforward``, Moonwalk's pure mode) with PyTorch's setup_context error.
- F6: a rad estimating layer under a forward-mode engine failed on ``.item()`` under vmap;
  it is refused (forward mode never runs the layer's estimator).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import bits, layers, models, rad

DT = torch.float64
TOL = 1e-10


def _ce(y: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda out: F.cross_entropy(out.reshape(out.shape[0], -1), y)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _check(
    model: nn.Module,
    xs: tuple[torch.Tensor, ...],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    name: str,
    *,
    tol: float = TOL,
    exact_grads: bool = True,
    torch_seed: int = 7,
    **options: object,
) -> leangrad.StepResult:
    """Run engine ``name`` and autograd on copies; assert loss, grads, buffers, RNG states and
    the layers' own generators agree. Returns the engine's result."""
    ref = copy.deepcopy(model)
    torch.manual_seed(torch_seed)
    loss_ref = loss_fn(ref(*xs))
    loss_ref.backward()
    rng_ref = torch.get_rng_state()
    torch.manual_seed(torch_seed)
    res = leangrad.engine(name, **options).backward(model, xs, loss_fn)
    assert torch.equal(torch.get_rng_state(), rng_ref), f"{name}: global RNG differs"
    loss_ref = loss_ref.detach()
    assert abs(float(res.loss) - float(loss_ref)) <= tol * max(1.0, abs(float(loss_ref)))
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{name}: {n}.grad None-ness differs"
        if exact_grads and q.grad is not None:
            assert p.grad is not None
            assert _rel(p.grad, q.grad) <= tol, f"{name}: {n} grad off by {_rel(p.grad, q.grad)}"
    for (n, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert torch.allclose(b, c, rtol=0, atol=1e-12 if tol <= TOL else 1e-5), f"buffer {n}"
    for m, r in zip(model.modules(), ref.modules(), strict=True):
        g, h = getattr(m, "generator", None), getattr(r, "generator", None)
        if isinstance(g, torch.Generator) and isinstance(h, torch.Generator):
            assert torch.equal(g.get_state(), h.get_state()), f"{name}: a layer's generator"
    return res


# -- F1: dropout masks drawn in autograd's memory layout --------------------------------


class _FunctionalDropout(nn.Module):
    """Dropout written in the forward (no dropout module for a check to see)."""

    def __init__(self, p: float, *, inplace: bool = False) -> None:
        super().__init__()
        self.p, self.inplace = p, inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x.clone(), self.p, self.training, self.inplace)


DROPOUTS: dict[str, Callable[[], nn.Module]] = {
    "Dropout": lambda: nn.Dropout(0.25),
    "Dropout-inplace": lambda: nn.Dropout(0.3, inplace=True),
    "Dropout2d": lambda: nn.Dropout2d(0.3),
    "AlphaDropout": lambda: nn.AlphaDropout(0.2),
    "FeatureAlphaDropout": lambda: nn.FeatureAlphaDropout(0.2),
    "F.dropout": lambda: _FunctionalDropout(0.4),
    "F.dropout-inplace": lambda: _FunctionalDropout(0.4, inplace=True),
    "BitDropout": lambda: bits.BitDropout(0.25),
}


def _conv_net(drop: nn.Module, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 1), drop, nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 3)
    ).to(dtype)


def _channels_last(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 2, 4, 4, dtype=dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("kind", list(DROPOUTS))
def test_forward_draws_autograd_dropout_masks_on_channels_last(kind: str) -> None:
    x, y = _channels_last(DT), torch.tensor([0, 1])
    _check(_conv_net(DROPOUTS[kind](), DT), (x,), _ce(y), "forward", chunk_size=5)


@pytest.mark.parametrize("kind", ["Dropout", "Dropout2d", "AlphaDropout", "F.dropout"])
def test_projforward_draws_autograd_dropout_masks_on_channels_last(kind: str) -> None:
    """The estimate is random, but the forward it differentiates must be autograd's: the
    same loss, BatchNorm statistics and RNG stream (seeded tangents draw nothing global)."""
    x, y = _channels_last(DT), torch.tensor([0, 1])
    model = _conv_net(DROPOUTS[kind](), DT)
    _check(model, (x,), _ce(y), "projforward", exact_grads=False, samples=3, chunk_size=2,
           seed=11, torch_seed=5)  # fmt: skip


def test_forward_dropout_float32() -> None:
    x, y = _channels_last(torch.float32), torch.tensor([0, 1])
    _check(_conv_net(nn.Dropout(0.25), torch.float32), (x,), _ce(y), "forward", tol=1e-4)


def test_forward_dropout_between_other_draws_keeps_the_stream() -> None:
    """A model drawing other random numbers after its dropout: the replay leaves the stream
    where autograd's dropout left it, so the later draw and the final state agree."""

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.drop(self.lin(x))
            return h + torch.randn(h.shape[-1], dtype=h.dtype)  # the same noise per example

    torch.manual_seed(0)
    model = Noisy().to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 1, 2, 3, 0])
    _check(model, (x,), _ce(y), "forward", chunk_size=3)


@pytest.mark.parametrize("kind", [k for k in DROPOUTS if k != "Dropout-inplace"])
def test_pure_moonwalk_draws_autograd_dropout_masks_in_a_channels_last_head(kind: str) -> None:
    torch.manual_seed(0)
    chain = layers.Chain(
        layers.AdditiveCoupling(nn.Sequential(nn.Conv2d(2, 2, 1), nn.Tanh())),
        layers.LeakyReLU(0.2),
        stem=nn.Sequential(nn.Conv2d(2, 4, 1), nn.Dropout(0.3)),
        head=nn.Sequential(DROPOUTS[kind](), nn.Flatten(), nn.Linear(64, 3)),
    ).to(DT)
    x, y = _channels_last(DT), torch.tensor([0, 1])
    _check(chain, (x,), _ce(y), "moonwalk", mode="pure", chunk_size=9)


# -- F2: a random stem is never run in batch chunks --------------------------------------


def _chain(stem: nn.Module) -> layers.Chain:
    torch.manual_seed(0)
    return layers.Chain(layers.SubmersiveLinear(4, 4), stem=stem,
                        head=nn.Linear(4, 3)).to(DT)  # fmt: skip


@pytest.mark.parametrize("name", ["moonwalk", "moonwalk+fad", "moonwalk+bits"])
@pytest.mark.parametrize("drop", ["Dropout", "F.dropout"])
def test_moonwalk_random_parameter_free_stem_runs_whole(name: str, drop: str) -> None:
    stem = nn.Sequential(models.RepeatChannels(4), DROPOUTS[drop]())
    torch.manual_seed(2)
    x, y = torch.randn(6, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2, 1])
    res = _check(_chain(stem), (x,), _ce(y), name)
    assert res.info["stem_chunks"] == 1


def test_moonwalk_explicit_stem_chunks_refuses_a_hidden_random_stem() -> None:
    stem = nn.Sequential(models.RepeatChannels(4), _FunctionalDropout(0.3))
    x, y = torch.randn(6, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2, 1])
    with pytest.raises(leangrad.EngineInputError, match=r"stem_chunks=2.*random draw") as err:
        leangrad.engine("moonwalk", stem_chunks=2).backward(_chain(stem), (x,), _ce(y))
    assert "\n" not in str(err.value)


# -- F3: the user's rad layers stay the user's ------------------------------------------


def _user_rad(seed: int | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), rad.RandLinear(4, 4, fraction=0.5, seed=seed),
                         nn.ReLU(), nn.Linear(4, 3)).to(DT)  # fmt: skip


@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize("name", ["rad", "checkpoint+rad"])
def test_rad_engine_leaves_the_users_rad_layers_alone(name: str, seed: int | None) -> None:
    """fraction=1 makes the engine's own layers exact; the user's RandLinear keeps its
    fraction 0.5 and draws from its own stream, as under autograd: the same estimate."""
    model = _user_rad(seed)
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2])
    engine = leangrad.engine(name, fraction=1.0, seed=0)
    prepared = engine.prepare(model)[0]
    fractions = sorted(m.spec.fraction for m in prepared.modules() if hasattr(m, "spec"))
    assert fractions == [0.5, 1.0, 1.0]
    for step in range(2):  # the user's stream (global or its generator) goes on alike
        model.zero_grad(set_to_none=True)
        _check(model, (x,), _ce(y), name, torch_seed=7 + step, fraction=1.0, seed=0)
    assert isinstance(model[1], rad.RandLinear) and model[1].spec.fraction == 0.5


@pytest.mark.parametrize("options", [{}, {"segments": 2}])
def test_checkpoint_replays_a_layers_own_generator(options: dict[str, object]) -> None:
    """A layer drawing its sample seed from its own generator: the recomputation draws the
    forward's seed again, and the generator ends one draw on (as under autograd)."""
    model = _user_rad(5)
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2])
    for step in range(2):
        model.zero_grad(set_to_none=True)
        _check(model, (x,), _ce(y), "checkpoint", torch_seed=7 + step, **options)


def test_randomize_keep_randomized_keeps_settings_and_generator() -> None:
    model = _user_rad(4)
    gen = model[1].generator
    report = rad.randomize(model, fraction=1.0, keep_randomized=True)
    assert model[1].spec.fraction == 0.5 and model[1].generator is gen
    assert "1" not in report.swapped and report.swapped["0"] == "Linear -> RandLinear"


# -- F4/F5: leangrad's own Function layers under torch.func transforms -------------------

LEAN: dict[str, Callable[[], nn.Module]] = {
    "bits.BitReLU": lambda: bits.BitReLU(),
    "bits.BitLeakyReLU": lambda: bits.BitLeakyReLU(0.1),
    "bits.BitDropout": lambda: bits.BitDropout(0.3),
    "rad.BitReLU": lambda: rad.BitReLU(),
}


@pytest.mark.parametrize("name", ["forward", "projforward"])
@pytest.mark.parametrize("kind", list(LEAN))
def test_forward_mode_engines_run_leangrads_own_layers(name: str, kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), LEAN[kind](), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2])
    opts: dict[str, object] = {"seed": 0, "samples": 2} if name == "projforward" else {}
    _check(model, (x,), _ce(y), name, exact_grads=name == "forward", **opts)


@pytest.mark.parametrize("name", ["forward", "projforward"])
def test_forward_mode_engines_run_lean_pooling(name: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), bits.BitReLU(), bits.LeanAvgPool2d(2),
                          bits.LeanAdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(3, 2)).to(DT)  # fmt: skip
    x, y = torch.randn(2, 2, 8, 8, dtype=DT), torch.tensor([0, 1])
    opts: dict[str, object] = {"seed": 0} if name == "projforward" else {}
    _check(model, (x,), _ce(y), name, exact_grads=name == "forward", **opts)


def test_forward_lean_layers_float32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), bits.BitLeakyReLU(0.2), bits.BitDropout(0.2),
                          nn.Linear(4, 3))  # fmt: skip
    x, y = torch.randn(5, 3), torch.tensor([0, 2, 1, 0, 2])
    _check(model, (x,), _ce(y), "forward", tol=1e-4)


@pytest.mark.parametrize("kind", list(LEAN))
def test_pure_moonwalk_runs_leangrads_own_layers_in_head_and_stem(kind: str) -> None:
    torch.manual_seed(0)
    chain = layers.Chain(
        layers.SubmersiveLinear(4, 4),
        stem=nn.Sequential(models.RepeatChannels(4), LEAN[kind]()),
        head=nn.Sequential(nn.Linear(4, 4), LEAN[kind](), nn.Linear(4, 3)),
    ).to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2])
    _check(chain, (x,), _ce(y), "moonwalk", mode="pure", chunk_size=3)


def test_lean_layers_keep_their_saving_outside_transforms() -> None:
    """Outside torch.func the lean layers still run their own Functions (1-bit masks)."""
    x = torch.randn(4, 5, requires_grad=True)
    assert "BitReLU" in type(bits.BitReLU()(x).grad_fn).__name__
    assert "BitLeakyReLU" in type(bits.BitLeakyReLU()(x).grad_fn).__name__
    assert "BitDropout" in type(bits.BitDropout(0.5)(x).grad_fn).__name__


# -- F6: rad estimating layers under forward-mode engines: refused, named ----------------


@pytest.mark.parametrize("name", ["forward", "projforward"])
@pytest.mark.parametrize("seed", [None, 0])
def test_forward_mode_engines_refuse_rad_estimating_layers(name: str, seed: int | None) -> None:
    model = _user_rad(seed)
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2])
    rng = torch.get_rng_state()
    with pytest.raises(leangrad.LeangradError, match=r"RandLinear: .*autograd's backward") as e:
        leangrad.engine(name).backward(model, (x,), _ce(y))
    assert "\n" not in str(e.value)
    assert all(p.grad is None for p in model.parameters())
    if name == "forward":
        assert torch.equal(torch.get_rng_state(), rng)


def test_pure_moonwalk_refuses_a_rad_layer_in_its_head() -> None:
    torch.manual_seed(0)
    chain = layers.Chain(layers.SubmersiveLinear(3, 3),
                         head=rad.RandLinear(3, 3, fraction=0.5, seed=0)).to(DT)  # fmt: skip
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 2, 1, 0, 2])
    with pytest.raises(leangrad.LeangradError, match="RandLinear") as e:
        leangrad.engine("moonwalk", mode="pure").backward(chain, (x,), _ce(y))
    assert "\n" not in str(e.value)


# -- a head that writes its input in place (found while fixing F1: Moonwalk runs the head
# on a leaf that requires grad, which PyTorch refuses to write in place) ------------------


@pytest.mark.parametrize("mode", ["mixed", "pure"])
@pytest.mark.parametrize("first", ["dropout", "relu"])
def test_moonwalk_head_writing_its_input_in_place(mode: str, first: str) -> None:
    torch.manual_seed(0)
    head_in = nn.Dropout(0.3, inplace=True) if first == "dropout" else nn.ReLU(inplace=True)
    model = layers.Chain(layers.SubmersiveLinear(4, 4), layers.LeakyReLU(0.1),
                         stem=nn.Linear(3, 4), head=nn.Sequential(head_in, nn.Linear(4, 3))
                         ).to(DT)  # fmt: skip
    x, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 3, (5,))
    ref = copy.deepcopy(model)
    torch.manual_seed(3)
    want = F.cross_entropy(ref(x), y)
    want.backward()
    rng = torch.get_rng_state()
    torch.manual_seed(3)
    got = leangrad.engine("moonwalk", mode=mode).backward(model, x, _ce(y))
    assert torch.equal(torch.get_rng_state(), rng)
    assert abs(got.loss.item() - want.item()) <= TOL * abs(want.item())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert (p.grad - q.grad).abs().max() <= TOL * q.grad.abs().max()
