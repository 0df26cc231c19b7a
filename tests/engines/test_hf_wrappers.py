"""Engines on models written as Hugging Face writes them, with plain torch
modules that do what ``transformers`` and ``diffusers`` do — blocks called with keyword
arguments, a parent reading its blocks' attributes, ``ModelOutput``-like outputs, UNet
blocks that hold one resnet, attention by ``F.scaled_dot_product_attention`` — and, where
the libraries are installed, on their tiny real models."""

from __future__ import annotations

import collections
import copy
import re
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.measure import profile_step


class Output(collections.OrderedDict[str, Any]):
    """Like ``transformers.ModelOutput``: a dict whose items read as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Pair(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)  # fmt: skip
        return h + self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A transformer layer as HF writes one: optional and keyword-only arguments, a tuple
    out, an attribute the model reads."""

    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.attn = Attention(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.act, self.drop = nn.ReLU(), nn.Dropout(p)
        self.attention_type = "causal"

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                scale: float = 1.0) -> tuple[torch.Tensor]:  # fmt: skip
        h = self.attn(h)
        x = self.fc1(h)
        x = x * torch.sigmoid(x) + self.act(x)  # an element-wise chain for fad
        if attention_mask is not None:
            x = x * attention_mask[..., None]
        return (h + scale * self.drop(self.fc2(x)),)


class LM(nn.Module):
    """An HF-style causal LM: keyword arguments to its layers, reads their attributes,
    returns an ``Output`` (or a named tuple)."""

    def __init__(self, d: int = 8, n: int = 3, vocab: int = 11, p: float = 0.1,
                 named_tuple: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, p) for _ in range(n))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.named_tuple = named_tuple

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        h = self.emb(idx)
        for layer in self.layers:
            assert layer.attention_type == "causal"  # a parent reading a block's attribute
            h = layer(h, attention_mask=attention_mask, scale=0.5)[0]
        logits = self.head(self.norm(h))
        return Pair(logits, h) if self.named_tuple else Output(logits=logits, hidden=h)


def _lm_case(**kw: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], Any]]:
    torch.manual_seed(0)
    model = LM(**kw).double()
    idx = torch.randint(0, 11, (2, 5))

    def loss_fn(out: Any) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), idx.flatten())

    return model, (idx,), loss_fn


def _assert_exact(engine: Any, model: nn.Module, inputs: tuple[torch.Tensor, ...],
                  loss_fn: Callable[[Any], Any], tol: float = 1e-12) -> None:  # fmt: skip
    ref, got = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(1)
    loss_fn(ref(*inputs)).backward()
    torch.manual_seed(1)
    eng = leangrad.engine(engine) if isinstance(engine, str) else engine
    eng.backward(got, inputs, loss_fn)
    scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    for (name, p), q in zip(got.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None
        # against the largest gradient: some are zero up to rounding (an attention's key
        # bias cancels in the softmax), where a relative error means nothing
        torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol * scale, msg=name)


EXACT = ["checkpoint", "checkpoint+fad", "checkpoint+bits", "checkpoint+fad+bits", "fad",
         "bits", "checkpoint(trace=True)"]  # fmt: skip


def _engine(spec: str) -> Any:
    if spec == "checkpoint(trace=True)":
        return leangrad.engine("checkpoint", trace=True)
    return leangrad.engine(spec)


# 1. keyword arguments and output types pass through every wrapper


@pytest.mark.parametrize("spec", EXACT)
@pytest.mark.parametrize("named_tuple", [False, True], ids=["ModelOutput", "namedtuple"])
def test_keyword_arguments_and_outputs_pass_through(spec: str, named_tuple: bool) -> None:
    model, inputs, loss_fn = _lm_case(named_tuple=named_tuple)
    _assert_exact(_engine(spec), model, inputs, loss_fn)


@pytest.mark.parametrize("spec", ["checkpoint+rad", "rad"])
def test_rad_takes_keyword_arguments(spec: str) -> None:
    model, inputs, loss_fn = _lm_case(p=0.0)
    # fraction=1 keeps every column: rad is exact then
    eng = leangrad.engine(spec, fraction=1.0)
    got, ref = copy.deepcopy(model), copy.deepcopy(model)
    eng.backward(got, inputs, loss_fn)
    loss_fn(ref(*inputs)).backward()
    for p, q in zip(got.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_fad_eager_hands_the_loss_the_models_output_type() -> None:
    model, inputs, _ = _lm_case()
    seen: list[type] = []

    def loss_fn(out: Any) -> torch.Tensor:
        seen.append(type(out))
        return out.logits.square().mean()  # an attribute read: a plain dict would fail

    leangrad.engine("fad", mode="eager").backward(model, inputs, loss_fn)
    assert seen == [Output]


class TwoInputs(nn.Module):
    """A whole model taking two positionals (diffusers' UNet: sample, timestep)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.pool = nn.Linear(4, 4), nn.ReLU(), nn.AvgPool2d(2)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> Output:
        y = self.pool(self.act(self.lin(x)) + t[:, None, None, None])
        return Output(sample=y)


@pytest.mark.parametrize("spec", ["bits", "rad", "fad"])
def test_whole_model_transforms_take_several_positional_arguments(spec: str) -> None:
    torch.manual_seed(0)
    model = TwoInputs().double()
    x, t = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    eng = leangrad.engine(spec, fraction=1.0) if spec == "rad" else leangrad.engine(spec)
    ref = copy.deepcopy(model)
    ref(x, t).sample.sum().backward()
    eng.backward(model, (x, t), lambda o: o.sample.sum())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_transformed_block_keeps_its_type_and_attributes() -> None:
    from leangrad.engines._transforms import BitsTransform, RadTransform

    block = Block(4, 0.1)
    for t in (BitsTransform(), RadTransform(fraction=0.5)):
        out, _ = t.apply(block)
        assert type(out) is Block and out.attention_type == "causal"
        assert out.fc2.weight is block.fc2.weight  # the user's tensors, shared
    root, what = BitsTransform().apply(nn.ReLU())  # a root that is itself swapped
    assert type(root).__name__ == "BitReLU" and what["swapped"]


# 2. wrappers keep the wrapped module's attributes


class DownBlock(nn.Module):
    def __init__(self, c: int, skip: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([Res(c)])
        if skip:
            self.skip_conv = nn.Conv2d(c, c, 1)

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = []
        for r in self.resnets:
            h = r(h, temb)
            outs.append(h)
        return h, *outs


class Res(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(2, c), nn.Conv2d(c, c, 3, padding=1)
        self.act = nn.SiLU()

    def forward(self, h: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        y = self.conv(self.act(self.norm(h)))
        return h + y + (0 if temb is None else temb[:, None, None, None])


class AttnRes(nn.Module):
    """diffusers' spatial attention: (B, C, H, W) through attention over H*W."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.attn = Attention(c)

    def forward(self, h: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        b, c, hh, ww = h.shape
        y = self.attn(h.flatten(2).transpose(1, 2))
        return y.transpose(1, 2).reshape(b, c, hh, ww)


class MidBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([Res(c), Res(c)])
        self.attentions = nn.ModuleList([AttnRes(c)])

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.resnets[0](h, temb)
        return self.resnets[1](self.attentions[0](h, temb=temb), temb)


class UpBlock(nn.Module):
    def __init__(self, c: int, attn: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([Res(c), Res(c)])
        if attn:
            self.attentions = nn.ModuleList([AttnRes(c), AttnRes(c)])

    def forward(self, h: torch.Tensor, skips: tuple[torch.Tensor, ...],
                temb: torch.Tensor) -> torch.Tensor:  # fmt: skip
        for i, r in enumerate(self.resnets):
            h = r(h + skips[i % len(skips)], temb)
            if hasattr(self, "attentions"):
                h = self.attentions[i](h, temb=temb)
        return h


class UNet(nn.Module):
    """diffusers' UNet2DModel in miniature: its forward reads ``block.resnets`` and
    ``hasattr(block, "skip_conv")``; down blocks hold one resnet each."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.down_blocks = nn.ModuleList([DownBlock(c, False), DownBlock(c, True)])
        self.mid_block = MidBlock(c)
        self.up_blocks = nn.ModuleList([UpBlock(c, True), UpBlock(c, False)])

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> Output:
        h, skips = sample, []
        for down in self.down_blocks:
            h, *res = down(h, temb=timestep)
            if hasattr(down, "skip_conv"):
                h = cast(nn.Module, down.skip_conv)(h)
            skips += res
        h = self.mid_block(h, timestep)
        for up in self.up_blocks:
            n = len(cast(nn.ModuleList, up.resnets))
            h = up(h, tuple(skips[-n:]), temb=timestep)
        return Output(sample=h)


def _unet_case() -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], Any]]:
    torch.manual_seed(0)
    model = UNet().double()
    x, t = torch.randn(2, 4, 4, 4, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    return model, (x, t), lambda o: o.sample.square().mean()


@pytest.mark.parametrize("blocks", [None, ["down_blocks", "up_blocks", "mid_block"]],
                         ids=["found", "coarse"])  # fmt: skip
@pytest.mark.parametrize("spec", ["checkpoint", "checkpoint+fad", "checkpoint+bits"])
def test_a_parent_reads_its_wrapped_blocks_attributes(spec: str, blocks: Any) -> None:
    model, inputs, loss_fn = _unet_case()
    eng = leangrad.engine(spec, **({} if blocks is None else {"blocks": blocks}))
    _assert_exact(eng, model, inputs, loss_fn)


def test_a_wrapper_reads_through_and_keeps_its_own() -> None:
    from leangrad.engines.checkpoint._engine import _Checkpointed

    block = DownBlock(4, True)
    w = _Checkpointed(block, trace=False)
    assert w.resnets is block.resnets and hasattr(w, "skip_conv")
    assert not hasattr(w, "nosuch") and w.inner is block
    assert next(n for n, _ in w.named_parameters()).startswith("inner.")
    copy.deepcopy(w)  # attribute delegation must not break copying


# 3. the default checkpoint checkpoints every block of a model run as written


def test_default_checkpoint_checkpoints_the_last_block_too() -> None:
    model, inputs, loss_fn = _lm_case()
    eng = leangrad.engine("checkpoint")
    res = eng.backward(model, inputs, loss_fn)
    assert res.info["checkpointed"] == res.info["blocks"] == 3
    text = str(leangrad.explain(eng, model))
    assert text.count("  checkpointed") == 3 and "left plain" not in text


def test_explain_marks_the_plain_last_segment_of_a_sequence() -> None:
    model = leangrad.models.mlp(3, 4, 3, 2)
    lines = leangrad.explain("checkpoint", model).lines
    rows = [ln for ln in lines if ln.startswith("  ")]
    assert [("left plain" in r) for r in rows] == [False, False, False, True]


def test_default_checkpoint_peak_is_not_above_checkpointing_every_block() -> None:
    torch.manual_seed(0)
    model = leangrad.zoo.gpt(vocab=512, dim=32, layers=3, heads=2, context=32)
    idx = torch.randint(0, 512, (4, 32))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), idx.flatten())

    names = list(leangrad.blocks(model).names)
    options: dict[str, dict[str, Any]] = {
        "default": {}, "all": {"blocks": names}, "but_last": {"blocks": names[:-1]}
    }  # fmt: skip
    peak = {}
    for k, kw in options.items():
        eng = leangrad.engine("checkpoint", **kw)
        peak[k] = profile_step(eng, model, (idx,), loss_fn, repeats=0).peak_bytes
    assert peak["default"] == peak["all"] < peak["but_last"]


# 4. UNet blocks at the level diffusers checkpoints them, counted right


def test_unet_blocks_are_its_resnets_and_attentions() -> None:
    model, _, _ = _unet_case()
    found = leangrad.blocks(model)
    assert found.names == (
        "down_blocks.0.resnets.0", "down_blocks.1.resnets.0",
        "mid_block.resnets.0", "mid_block.resnets.1", "mid_block.attentions.0",
        "up_blocks.0.resnets.0", "up_blocks.0.resnets.1",
        "up_blocks.0.attentions.0", "up_blocks.0.attentions.1",
        "up_blocks.1.resnets.0", "up_blocks.1.resnets.1",
    )  # fmt: skip
    counts = sum(int(n) for n in re.findall(r"(\d+) x ", found.how))
    assert counts == len(found) == len(str(found).splitlines()) - 1


def test_block_counts_match_rows_in_a_mixed_container() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Res(4), Res(4), Res(4), AttnRes(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    found = leangrad.blocks(M())
    assert len(found) == 4
    assert found.how == "repeated children of 'blocks': 3 x Res + 1 x AttnRes"


# 5. forward-mode engines through scaled_dot_product_attention


@pytest.mark.parametrize("spec", ["forward", "projforward"])
def test_forward_mode_through_sdpa(spec: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Attention(4), nn.Linear(4, 2)).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    eng = leangrad.engine(spec, **({"samples": 4} if spec == "projforward" else {}))
    eng.backward(model, (x,), lambda y: y.square().sum())
    if spec == "forward":
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    else:
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in model.parameters())  # fmt: skip


def test_forward_mode_gives_the_padding_row_autograds_gradient() -> None:
    """autograd's embedding backward gives the ``padding_idx`` row nothing from the lookup
    (BERT's ``pad_token_id``); forward mode must agree, tied to an output layer too."""
    torch.manual_seed(0)
    emb = nn.Embedding(6, 4, padding_idx=0)
    head = nn.Linear(4, 6, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head).double()
    idx = torch.tensor([[0, 1, 2, 0], [3, 0, 5, 4]])
    _assert_exact("forward", model, (idx,), lambda y: y.square().mean())


# 6. fx fails per block; explain says which blocks ran traced and why not


class Plain(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class DataDependent(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # fx cannot trace this
            return x + torch.tanh(self.lin(x))
        return x - torch.tanh(self.lin(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Plain(4), DataDependent(4), Plain(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_trace_falls_back_per_block_and_explain_says_why() -> None:
    torch.manual_seed(0)
    model = Stack().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    eng = leangrad.engine("checkpoint", trace=True)
    _assert_exact(eng, model, (x,), lambda y: y.square().sum())
    text = str(leangrad.explain(eng, model))
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("  blocks.")}
    assert "as torch.fx code" in rows["blocks.0"] and "as torch.fx code" in rows["blocks.2"]
    assert "as written: torch.fx cannot trace it" in rows["blocks.1"]
    assert "recomputed as torch.fx code (intermediates freed at last use): blocks.0, blocks.2" \
        in text


def test_fad_does_not_trace_a_forward_with_optional_arguments() -> None:
    """fx takes an optional argument as given (``if mask is not None`` is baked in): fad's
    fx pass would be silently wrong, so it runs the eager mode and says why."""
    model, inputs, loss_fn = _lm_case()
    _assert_exact(leangrad.engine("fad"), model, inputs, loss_fn)
    text = str(leangrad.explain("fad", model))
    assert "optional or variadic arguments (attention_mask)" in text
    from leangrad import fad

    with pytest.raises(fad.FadTraceError, match="attention_mask"):
        leangrad.engine("fad", mode="fx").backward(model, inputs, loss_fn)


def test_fx_pass_block_keeps_attributes_and_submodules() -> None:
    from leangrad.engines._transforms import FadTransform

    class Act(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.kind = nn.Linear(4, 4), "act"
            self.resnets = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.unused = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.resnets[0](self.lin(x))
            return y * torch.sigmoid(y) * 2

    block = Act()
    out, what = FadTransform().apply(block)
    assert what["used"] == "fx"
    for m in (out, copy.deepcopy(out)):
        assert m.kind == "act" and len(cast(Any, m).resnets) == 2 and hasattr(m, "unused")
    x = torch.randn(2, 4)
    torch.testing.assert_close(out(x), block(x))


# the real models, where transformers / diffusers are installed


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=2,
                                  n_head=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).double()


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).double()


def _tiny_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  max_position_embeddings=16, pad_token_id=0)  # fmt: skip
    return transformers.BertForMaskedLM(cfg).double()


HF_LMS = {"gpt2": _tiny_gpt2, "llama": _tiny_llama, "bert": _tiny_bert}


@pytest.mark.parametrize("spec", [*EXACT, "forward"])
@pytest.mark.parametrize("name", list(HF_LMS))
def test_real_transformers(name: str, spec: str) -> None:
    torch.manual_seed(0)
    model = HF_LMS[name]()
    idx = torch.randint(0, 16, (2, 6))

    def loss_fn(out: Any) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), idx.flatten())

    # Llama computes its rotary tables in float32 whatever the model's dtype, which the
    # forward engine's batched (vmap) matmul rounds differently
    tol = 1e-6 if (name, spec) == ("llama", "forward") else 1e-10
    _assert_exact(_engine(spec), model, (idx,), loss_fn, tol=tol)


def test_real_default_checkpoint_checkpoints_every_gpt2_layer() -> None:
    model = _tiny_gpt2()
    idx = torch.randint(0, 16, (2, 6))
    res = leangrad.engine("checkpoint").backward(model, (idx,), lambda o: o.logits.sum())
    assert res.info["checkpointed"] == res.info["blocks"] == 2


@pytest.mark.parametrize("blocks", [None, ["down_blocks", "up_blocks"]], ids=["found", "coarse"])
@pytest.mark.parametrize("spec", ["checkpoint", "checkpoint+fad", "checkpoint+bits", "bits"])
def test_real_unet(spec: str, blocks: Any) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4,
    ).double()  # fmt: skip
    x, t = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.tensor([3, 7])
    if blocks is not None and spec == "bits":
        pytest.skip("bits takes no blocks=")
    eng = leangrad.engine(spec, **({} if blocks is None else {"blocks": blocks}))
    _assert_exact(eng, model, (x, t), lambda o: o.sample.square().mean(), tol=1e-10)
    if blocks is None and spec == "checkpoint":
        found = leangrad.blocks(model)
        kinds = collections.Counter(type(found.modules[n]).__name__ for n in found.names)
        assert kinds == {"ResnetBlock2D": 8, "Attention": 4}  # mid-block attention found
        assert sum(int(n) for n in re.findall(r"(\d+) x ", found.how)) == len(found)
