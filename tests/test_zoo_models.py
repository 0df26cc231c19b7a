"""The zoo's Llama-style decoder and diffusion U-Net and the GPT at a real
vocabulary: shapes, the blocks leangrad finds, checkpointing (whole blocks and in fragments
of the batch) exact against autograd in float64, the offline batches, and the zoo suite's
PyTorch rows on them. Tiny sizes: seconds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad import zoo
from leangrad.loss import PerExample
from leangrad.measure import compare_grads
from leangrad_bench._models import build
from leangrad_bench._zoo_methods import NOT_A_SEQUENCE, pytorch_methods

LossFn = Callable[[torch.Tensor], torch.Tensor]
Grads = dict[str, torch.Tensor]
Forward = Callable[[Any, torch.Tensor], torch.Tensor]
LLAMA: dict[str, Any] = {"vocab": 50, "dim": 16, "layers": 3, "heads": 2, "context": 8}
UNET: dict[str, Any] = {"image": 8, "widths": (4, 8), "groups": 2, "attention_at": (8,),
                        "head_dim": 4}  # fmt: skip


def _llama(dtype: torch.dtype = torch.float64) -> zoo.Llama:
    torch.manual_seed(0)
    return zoo.llama(**LLAMA).to(dtype)


def _unet(dtype: torch.dtype = torch.float64) -> zoo.UNet:
    torch.manual_seed(0)
    return zoo.unet(**UNET).to(dtype)


def _workload(name: str, batch: int = 4) -> tuple[nn.Module, torch.Tensor, LossFn]:
    """A float64 tiny model of ``name`` with its zoo batch (the U-Net's in float64 too)."""
    model: nn.Module = _llama() if name == "llama" else _unet()
    x, loss_fn = zoo.batch(name, model, batch, length=6, image=8)
    return model, x, loss_fn


def _reference(model: nn.Module, x: torch.Tensor, loss_fn: LossFn) -> Grads:
    """Autograd's gradients (``.grad`` put back to None)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    return _grads(model)


def _grads(model: nn.Module) -> Grads:
    """The ``.grad`` a step left (those that are not None), then cleared."""
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return got


def _exact(got: Grads, ref: Grads) -> None:
    assert set(got) == set(ref), f"grads on {sorted(set(got) ^ set(ref))} differ"
    cmp = compare_grads(got, ref)
    assert cmp.max_rel_err <= 1e-10, (cmp.max_rel_err, cmp.worst_param)


# ---------------------------------------------------------------------------------------
# the models


def test_llama_gives_logits_per_position_with_llamas_layer_sizes() -> None:
    model = _llama(torch.float32)
    idx = torch.randint(0, 50, (3, 8))
    assert model(idx).shape == (3, 8, 50)
    block = model.blocks[0]
    assert isinstance(block, zoo.LlamaBlock)
    assert block.gate.out_features == 48  # 8/3 * 16 = 42.7, up to a multiple of 8
    assert isinstance(block.attn_norm, nn.RMSNorm) and isinstance(model.norm, nn.RMSNorm)
    assert model.lm_head.weight is not model.embed.weight  # untied
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    wide = zoo.llama(dim=32, heads=2, hidden=40).blocks[0]
    assert isinstance(wide, zoo.LlamaBlock) and wide.up.out_features == 40


def test_llama_is_causal_and_rotary_makes_attention_see_relative_positions() -> None:
    """A later token changes no earlier logit; and the rotary attention scores depend on
    positions only through their difference (the same q, k at shifted positions score
    the same)."""
    model = _llama()
    idx = torch.randint(0, 50, (2, 8))
    changed = idx.clone()
    changed[:, 5] = (idx[:, 5] + 1) % 50
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])
    block = model.blocks[0]
    assert isinstance(block, zoo.LlamaBlock)
    q, k = torch.randn(2, 8, dtype=torch.float64).unbind(0)

    def score(i: int, j: int) -> torch.Tensor:
        qi = q * block.cos[i] + zoo._rotate_half(q) * block.sin[i]
        kj = k * block.cos[j] + zoo._rotate_half(k) * block.sin[j]
        return qi @ kj

    torch.testing.assert_close(score(3, 1), score(6, 4), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_unet_predicts_noise_of_the_input_shape_with_attention_where_asked() -> None:
    model = _unet(torch.float32)
    x = torch.randn(2, 3, 8, 8)
    assert model(x).shape == x.shape
    attn = [n for n, m in model.named_modules() if isinstance(m, zoo.AttnBlock)]
    assert attn == ["down.1.blocks.1", "mid.1", "up.0.blocks.1"]  # width 8 and the middle
    assert zoo.unet(image=16, widths=(4, 8, 16), groups=4, attention_at=(), head_dim=4)(
        torch.randn(1, 3, 16, 16)).shape == (1, 3, 16, 16)  # fmt: skip
    with pytest.raises(ValueError, match="divisible by groups"):
        zoo.unet(widths=(4, 6), groups=4)
    with pytest.raises(ValueError, match="image"):
        zoo.unet(image=10, widths=(4, 8, 16), groups=4)


def test_unet_checkpointing_flag_recomputes_every_block_with_the_same_gradients() -> None:
    """``checkpointing = True`` (diffusers' ``enable_gradient_checkpointing``) runs every
    ResBlock and AttnBlock again in the backward pass; the gradients stay autograd's."""
    model = _unet()
    x, loss_fn = zoo.batch("unet", model, 4, image=8)
    ref = _reference(model, x, loss_fn)
    calls = _count_block_calls(model, lambda: loss_fn(model(x)).backward())
    n_blocks = sum(isinstance(m, (zoo.ResBlock, zoo.AttnBlock)) for m in model.modules())
    assert calls == n_blocks
    _grads(model)
    model.checkpointing = True
    calls = _count_block_calls(model, lambda: loss_fn(model(x)).backward())
    assert calls == 2 * n_blocks
    _exact(_grads(model), ref)


def _count_block_calls(model: nn.Module, step: Callable[[], None]) -> int:
    """How many times ``step`` runs a ResBlock or AttnBlock's forward."""
    seen: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(type(mod).__name__))
             for m in model.modules() if isinstance(m, (zoo.ResBlock, zoo.AttnBlock))]  # fmt: skip
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return len(seen)


def test_blocks_finds_llamas_layers_and_the_unets_res_and_attention_blocks() -> None:
    found = leangrad.blocks(_llama())
    assert found.names == ("blocks.0", "blocks.1", "blocks.2")
    model = _unet()
    found = leangrad.blocks(model)
    expected = [n for n, m in model.named_modules() if isinstance(m, (zoo.ResBlock, zoo.AttnBlock))]
    assert list(found.names) == expected
    assert not found.sequential


@pytest.mark.parametrize("name", ["llama", "unet"])
@pytest.mark.parametrize("fragments", [None, 2])
def test_checkpoint_engine_gives_autograds_gradients(
    name: str, fragments: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole blocks, or each block run in 2 fragments of the batch of 4 (every block type
    then sees 2 rows at a time)."""
    model, x, loss_fn = _workload(name)
    ref = _reference(model, x, loss_fn)
    rows: dict[str, set[int]] = {}
    for cls in (zoo.LlamaBlock, zoo.ResBlock, zoo.AttnBlock):
        monkeypatch.setattr(cls, "forward", _recording(cls.forward, rows))
    options: dict[str, Any] = {} if fragments is None else {"fragments": fragments}
    eng = leangrad.engine("checkpoint", **options)
    assert eng.supports(model) is None
    eng.backward(model, x, loss_fn)
    _exact(_grads(model), ref)
    kinds = {"LlamaBlock"} if name == "llama" else {"ResBlock", "AttnBlock"}
    assert set(rows) == kinds
    for kind in kinds:
        assert (2 in rows[kind]) == (fragments == 2), (kind, rows[kind])


def _recording(forward: Forward, rows: dict[str, set[int]]) -> Forward:
    """``forward`` noting the batch rows of every call by block type in ``rows``."""

    def run(self: Any, x: torch.Tensor) -> torch.Tensor:
        rows.setdefault(type(self).__name__, set()).add(x.shape[0])
        return forward(self, x)

    return run


# ---------------------------------------------------------------------------------------
# the batches and the zoo suite


@pytest.mark.parametrize("name", ["llama", "unet"])
def test_zoo_batch_losses_are_per_example(name: str) -> None:
    model, x, loss_fn = _workload(name, batch=3)
    assert isinstance(loss_fn, PerExample) and loss_fn.batch == 3
    (target,) = loss_fn.targets
    with torch.no_grad():
        out = model(x)
        if name == "unet":
            assert x.dtype == target.dtype == torch.float64 and target.shape == x.shape
            before = F.mse_loss(out, target)
        else:
            assert x.shape == target.shape == (3, 6) and int(x.max()) < 50
            before = F.cross_entropy(out.flatten(0, 1), target.flatten())
        assert torch.equal(loss_fn(out), before)
        parts = loss_fn.rows(0, 1)(out[:1]) + loss_fn.rows(1, 3)(out[1:])
    torch.testing.assert_close(parts, before, rtol=1e-12, atol=0)


def test_build_makes_the_gpt_at_gpt2s_vocabulary() -> None:
    wl = build("gpt_50k", {"vocab": 50257, "dim": 8, "layers": 2, "heads": 2, "context": 6,
                           "batch": 2})  # fmt: skip
    assert isinstance(wl.model, zoo.GPT)
    assert wl.model.head.out_features == 50257
    assert isinstance(wl.inputs, torch.Tensor) and wl.inputs.shape == (2, 6)
    assert isinstance(wl.loss_fn, PerExample)
    assert torch.isfinite(wl.loss_fn(wl.model(wl.inputs)))


def test_build_reads_the_new_models_sizes_from_the_suite_file_keys() -> None:
    llama = build("llama", {**LLAMA, "hidden": 24, "batch": 2})
    assert isinstance(llama.model, zoo.Llama)
    block = llama.model.blocks[0]
    assert isinstance(block, zoo.LlamaBlock) and block.up.out_features == 24
    unet = build("unet", {"image": 8, "widths": [4, 8], "groups": 2, "attention_at": [],
                          "head_dim": 4, "batch": 2})  # fmt: skip
    assert isinstance(unet.model, zoo.UNet)
    assert isinstance(unet.inputs, torch.Tensor) and unet.inputs.shape == (2, 3, 8, 8)
    assert not any(isinstance(m, zoo.AttnBlock) for m in unet.model.down.modules())


@pytest.mark.parametrize("name", ["llama", "unet"])
def test_pytorch_rows_give_autograds_gradients(name: str) -> None:
    """The suite's exact PyTorch rows (per-block checkpointing, the sequence recipes where
    the blocks are a sequence, gradient accumulation alone and with per-block inside) on
    each model; the U-Net's flag is off again after each step."""
    model, x, loss_fn = _workload(name)
    ref = _reference(model, x, loss_fn)
    methods, skipped = pytorch_methods(model, segments=[2], chunks=[], micro_batches=[2],
                                       loss_fn=loss_fn)  # fmt: skip
    labels = {m.label for m in methods}
    assert {"torch per-block", "torch accumulate(2)", "torch accumulate(2) + per-block",
            "torch bf16 autocast"} <= labels  # fmt: skip
    sequence = {"torch selective", "checkpoint_sequential(2)"}
    if name == "unet":
        assert not labels & sequence
        why = {s.label: s.reason for s in skipped}
        assert all(why[lb] == NOT_A_SEQUENCE.format(model="UNet") for lb in sequence)
    else:
        assert sequence <= labels
    for m in methods:
        if not m.exact:
            continue
        m.make().backward(model, x, loss_fn)
        got = _grads(model)
        try:
            _exact(got, ref)
        except AssertionError as err:
            raise AssertionError(f"{m.label}: {err}") from err
        assert not getattr(model, "checkpointing", False), m.label


@pytest.mark.parametrize("name", ["llama", "unet"])
def test_bf16_autocast_row_runs_close_to_float32(name: str) -> None:
    """Mixed bfloat16 and float32 tensors meet in the rotary embedding, the attention and
    the residuals; the row runs and points the gradient the same way."""
    model: nn.Module = _llama(torch.float32) if name == "llama" else _unet(torch.float32)
    x, loss_fn = zoo.batch(name, model, 4, length=6, image=8)
    ref = _reference(model, x, loss_fn)
    methods, _ = pytorch_methods(model, segments=[], chunks=[])
    bf16 = next(m for m in methods if m.label == "torch bf16 autocast")
    bf16.make().backward(model, x, loss_fn)
    assert compare_grads(_grads(model), ref).cosine > 0.95
