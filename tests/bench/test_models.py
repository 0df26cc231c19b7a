"""The bench's one model registry: one name = one model, one Workload
type, one ``build``; the suites' old entry points delegate to it. Tiny sizes, CPU."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from leangrad import hf
from leangrad._errors import UnknownNameError
from leangrad.loss import PerExample
from leangrad_bench import _models, _plan_peers, _workloads
from leangrad_bench._models import (
    HF_MODELS,
    MODELS,
    TIMM_MODELS,
    Workload,
    build,
    fad_batch,
    rad_network,
)

SUITES = Path(_models.__file__).parent / "suites"
RESNET = {"depth": 10, "width": 4, "image": 8, "batch": 3}
GPT = {"vocab": 16, "dim": 8, "layers": 2, "heads": 2, "context": 8, "batch": 3}
UNET = {"image": 8, "widths": [4, 8], "groups": 2, "attention_at": [], "head_dim": 4, "batch": 2}
RNN = {"vocab": 16, "embed": 4, "hidden": 8, "layers": 1, "length": 6, "batch": 3}
TINY: dict[str, dict[str, Any]] = {
    "mlp": {"depth": 2, "width": 8, "batch": 4},
    "conv": {"depth": 2, "size": 8, "batch": 4},
    "small_cnn": {"batch": 4},
    "rnn": {"length": 4, "batch": 4},
    "revnet": {"size": 8, "blocks": 2, "batch": 4},
    "subcnn": {"depth": 2, "size": 8, "channels": 4, "batch": 2},
    "frag1d": {"depth": 2, "length": 16, "channels": 4, "batch": 2},
    "frag2d": {"depth": 2, "size": 8, "channels": 4, "batch": 2},
    "resnet": RESNET,
    "gpt": GPT,
    "bert": GPT,
    "lstm_lm": RNN,
    "gru_lm": RNN,
    "highway_gru_lm": RNN,
    "vit": {"image": 8, "patch": 4, "dim": 8, "layers": 1, "heads": 2, "batch": 2},
    "llama": {**GPT, "hidden": 16},
    "gpt_50k": GPT,
    "unet": UNET,
    **{name: {**hf.TINY[base], "batch": 2} for name, (base, _) in HF_MODELS.items()},
    **{name: {"image": 32, "classes": 10, "batch": 2} for name in TIMM_MODELS},
    "blocks_resnet": RESNET,
    "blocks_gpt": GPT,
    "dropout_mlp": {"features": 6, "width": 8, "layers": 3, "batch": 4},
    "rad_mlp": {"side": 8, "batch": 4},
    "rad_cnn": {"side": 8, "batch": 4},
    "rad_irnn": {"side": 8, "batch": 4},
    "fad_resnet": {"channels": 4, "stages": 2, "blocks": 1, "side": 8, "activation": "mish",
                   "batch": 2},
    "fad_bert": {"d": 16, "heads": 2, "layers": 1, "seq": 8, "activation": "gelu", "batch": 2},
}
HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "diffusers"))
HAS_TIMM = importlib.util.find_spec("timm") is not None


def _tensors(wl: Workload) -> list[torch.Tensor]:
    xs = wl.inputs if isinstance(wl.inputs, tuple) else (wl.inputs,)
    return [*wl.model.state_dict().values(), *xs]


def _same(a: Workload, b: Workload) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def test_every_name_has_a_tiny_size_here() -> None:
    assert set(TINY) == set(MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_builds_the_same_step_twice(name: str) -> None:
    if name in HF_MODELS and not HAS_HF:
        pytest.skip("the [hf] extra is not installed")
    if name in TIMM_MODELS and not HAS_TIMM:
        pytest.skip("the [vision] extra is not installed")
    first, again = build(name, TINY[name]), build(name, TINY[name])
    assert _same(first, again)
    xs = first.inputs if isinstance(first.inputs, tuple) else (first.inputs,)
    assert xs[0].shape[0] == TINY[name]["batch"]
    assert first.config == {"model": name, **TINY[name]}
    out = first.model(*xs)
    loss = first.loss_fn(out)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert first.num_params == sum(p.numel() for p in first.model.parameters())


def test_batch_overrides_the_size_and_is_recorded() -> None:
    wl = build("gpt", GPT, batch=2)
    assert isinstance(wl.inputs, torch.Tensor) and wl.inputs.shape == (2, GPT["context"])
    assert wl.config["batch"] == 2
    assert isinstance(wl.loss_fn, PerExample) and wl.loss_fn.batch == 2


def test_unknown_name_lists_the_registry() -> None:
    with pytest.raises(UnknownNameError, match="unknown model 'nope'; known models: mlp, "):
        build("nope", {})
    with pytest.raises(UnknownNameError, match="blocks_resnet, blocks_gpt, dropout_mlp"):
        _workloads.build({"model": "nope"})


def test_the_old_entry_points_are_the_registry() -> None:
    assert _workloads.Workload is Workload
    config = {"model": "revnet", "size": 8, "blocks": 2, "batch": 4, "dtype": "float64"}
    assert _same(_workloads.build(config), build("revnet", config))
    wl = build("blocks_gpt", GPT)
    model, x, _, parts = _plan_peers.workload("gpt", GPT)
    assert _same(wl, Workload(model, x, wl.loss_fn))
    assert len(parts[1]) == GPT["layers"]


def test_blocks_models_are_the_zoos_on_another_batch_with_a_plain_loss() -> None:
    """Same name, different models no more: ``blocks_resnet`` has ``resnet``'s weights, its
    own batch (generator seed 1) and a loss not declared per example."""
    for name in ("resnet", "gpt"):
        zoo_wl, suite_wl = build(name, TINY[name]), build(f"blocks_{name}", TINY[name])
        assert all(torch.equal(a, b) for a, b in zip(zoo_wl.model.state_dict().values(),
                                                     suite_wl.model.state_dict().values(),
                                                     strict=True))  # fmt: skip
        assert isinstance(zoo_wl.inputs, torch.Tensor)
        assert isinstance(suite_wl.inputs, torch.Tensor)
        assert not torch.equal(zoo_wl.inputs, suite_wl.inputs)
        assert isinstance(zoo_wl.loss_fn, PerExample)
        assert not isinstance(suite_wl.loss_fn, PerExample)


@pytest.mark.parametrize("name", ["blocks_resnet", "blocks_gpt", "dropout_mlp"])
def test_parts_run_the_model(name: str) -> None:
    wl = build(name, TINY[name])
    assert wl.parts is not None
    wl.model.eval()  # dropout off: the two forwards compare
    stem, blocks, head = wl.parts
    h = stem()
    for block in blocks:
        h = block(h)
    torch.testing.assert_close(head(h), wl.model(wl.inputs), rtol=0, atol=0)


def test_suite_files_keep_their_model_keys() -> None:
    """The blocks and plan suites' files (and records) name their models as before; each
    key names one registry model."""
    for suite in ("blocks", "plan"):
        settings = tomllib.loads((SUITES / f"{suite}.toml").read_text())["settings"]
        for table in ("models", "quick_models"):
            assert set(settings[table]) <= set(_plan_peers.SUITE_MODELS)
    assert set(_plan_peers.SUITE_MODELS.values()) <= set(MODELS)
    zoo = tomllib.loads((SUITES / "zoo.toml").read_text())["settings"]
    assert set(zoo["quick_models"]) | set(zoo["quick_hf_models"]) <= set(MODELS)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "irnn"])
def test_rad_networks_are_the_old_rad_model_seeded(kind: str) -> None:
    """``rad_<kind>`` at ``seed`` is the RAD suites' old ``torch.manual_seed(seed)`` then
    ``rad_network(kind)``: the same parameter names (the ``layer_mse`` keys) and values, and
    the global generator left where that left it."""
    wl = build(f"rad_{kind}", {"side": 8, "seed": 3}, batch=2)
    after = torch.rand(3)
    torch.manual_seed(3)
    old = rad_network(kind, side=8)
    assert torch.equal(torch.rand(3), after)
    mine, theirs = wl.model.state_dict(), old.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    if kind == "irnn":  # Appendix A's initialisation
        assert list(old.state_dict()) == ["cell.weight_ih", "cell.weight_hh", "cell.bias_ih",
                                          "cell.bias_hh", "head.weight", "head.bias"]  # fmt: skip
        assert torch.equal(old.cell.weight_hh, torch.eye(100))


@pytest.mark.parametrize("name", ["fad_resnet", "fad_bert"])
def test_fad_models_batch_is_the_first_of_their_stream(name: str) -> None:
    """The fad suite draws its batches of every size from one stream (generator seed 1);
    the registry's batch is that stream's first, and its model carries the activation
    written out of primitives."""
    size = TINY[name]
    wl = build(name, size)
    gen = torch.Generator().manual_seed(1)
    x, y = fad_batch(name, size, size["batch"], gen)
    assert torch.equal(wl.inputs[0], x) and wl.targets is not None and torch.equal(wl.targets, y)
    assert not torch.equal(fad_batch(name, size, size["batch"], gen)[0], x)  # the next one
    acts = [m for m in wl.model.modules() if isinstance(m, _models.Act)]
    assert acts and {m.name for m in acts} == {size["activation"]}
