"""The models people download, built from configs with random weights, offline.

Factories for four Hugging Face models as their libraries write them (``transformers``,
``diffusers``; the optional extra ``pip install 'leangrad[hf]'``), sized by keyword
arguments, never downloading anything:

- :func:`gpt2`: ``GPT2LMHeadModel`` (GPT-2's vocabulary, 50,257, by default; the
  embedding and the LM head share one matrix);
- :func:`llama`: ``LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU MLP, grouped
  key/value heads);
- :func:`bert`: ``BertForMaskedLM`` (post-LN encoder, a masked-LM head tied to the word
  embedding);
- :func:`unet`: diffusers' ``UNet2DModel`` (ResNet blocks with GroupNorm and a timestep
  embedding, self-attention at the lowest resolution and in the mid block, skip
  connections from each down level to its up level).

Each keeps its library's training defaults: dropout as the config sets it (GPT-2 and
BERT 0.1, Llama and the UNet 0.0), the module in training mode, ``use_cache=False`` (a
training step keeps no key/value cache). :data:`TINY` holds sizes for tests (seconds on
a CPU).

Attention: ``attn="sdpa"`` (the libraries' default, what a user gets) runs
``torch.nn.functional.scaled_dot_product_attention``. On CPU (torch 2.13), without
attention dropout it dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which
has no forward-mode AD rule; leangrad's forward-mode engines (``forward``,
``projforward``) therefore run the model under ``sdpa_kernel(SDPBackend.MATH)``, whose
ops have one, and are exact on all four models.

:func:`batch` gives an offline batch and a loss for each, reading the model's output as a
user's training loop does: ``out.logits`` for the language models, ``out.sample`` for the
UNet.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _errors as errors
from ._hf_trainer import Attached, attach

__all__ = [
    "MODELS",
    "TINY",
    "Attached",
    "attach",
    "batch",
    "bert",
    "gpt2",
    "llama",
    "model",
    "unet",
]

LossFn = Callable[[Any], torch.Tensor]
ATTN = ("sdpa", "eager")
BAD_ATTN = "attn must be one of {known}, got {attn!r}"
UNKNOWN_MODEL = "unknown Hugging Face model {name!r}; known: {known}"
BAD_SIZE = "{name}: {what}"
MASK_FRACTION = 0.15
"""BERT's masked-LM fraction of positions (Devlin et al. 2019)."""
TIMESTEPS = 1000
"""Diffusion timesteps the UNet batch draws from (DDPM's 1,000)."""


def _require(package: str, feature: str) -> Any:
    """Import ``package`` or raise :class:`OptionalDependencyError` naming the extra."""
    return errors.require(package, feature=feature, extra="hf")


@contextlib.contextmanager
def _built(seed: int | None, dtype: torch.dtype | None) -> Iterator[None]:
    """Initialise under ``torch.manual_seed(seed)`` without touching the caller's stream,
    and with ``dtype`` as the default (the parameters are made in it, not cast after: a
    cast makes diffusers warn)."""
    old = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        if seed is not None:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.manual_seed(seed)
        if dtype is not None and dtype.is_floating_point:
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, old)
        yield


def _finish(model: nn.Module, dtype: torch.dtype | None) -> Any:
    if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)  # _built made it in dtype where dtype is a floating type
    return model.train()


def _check_attn(attn: str) -> None:
    if attn not in ATTN:
        raise errors.OptionError(BAD_ATTN.format(known=", ".join(ATTN), attn=attn))


def _check_heads(name: str, dim: int, heads: int) -> None:
    if dim % heads:
        raise errors.OptionError(
            BAD_SIZE.format(name=name, what=f"dim ({dim}) must be divisible by heads ({heads})")
        )


def _transformers(name: str, attn: str, dim: int, heads: int) -> Any:
    """The ``transformers`` module for factory ``name``, once ``attn`` is known and ``dim``
    divisible by ``heads``."""
    tf = _require("transformers", f"leangrad.hf.{name}")
    _check_attn(attn)
    _check_heads(name, dim, heads)
    return tf


def _make(cls: Callable[..., nn.Module], seed: int | None, dtype: torch.dtype | None, /,
          *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    """``cls(*args, **kwargs)``, built under :func:`_built` and passed through :func:`_finish`."""
    with _built(seed, dtype):
        return _finish(cls(*args, **kwargs), dtype)


def gpt2(
    *,
    vocab: int = 50257,
    dim: int = 768,
    layers: int = 12,
    heads: int = 12,
    context: int = 1024,
    attn: str = "sdpa",
    dropout: float = 0.1,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> Any:
    """``transformers.GPT2LMHeadModel`` with random weights (defaults: GPT-2 small, 124M).

    Args:
        vocab, dim, layers, heads, context: ``vocab_size``, ``n_embd``, ``n_layer``,
            ``n_head``, ``n_positions``.
        attn: ``"sdpa"`` or ``"eager"`` (module docstring).
        dropout: GPT-2's three dropout probabilities (embeddings, residuals, attention;
            0.1 as released). With dropout in training, attention cannot take SDPA's fused
            kernels that keep no ``(T, T)`` scores, and fragments of the batch are refused
            (each would draw other masks); many fine-tuning recipes set it to 0.
        dtype: cast the parameters (``None``: torch's default dtype).
        seed: initialise under this seed (``None``: the global stream).
    """
    tf = _transformers("gpt2", attn, dim, heads)
    special = min(50256, vocab - 1)  # GPT-2's <|endoftext|>, inside a smaller vocabulary
    config = tf.GPT2Config(
        vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=heads, n_positions=context,
        bos_token_id=special, eos_token_id=special, use_cache=False, attn_implementation=attn,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return _make(tf.GPT2LMHeadModel, seed, dtype, config)


def llama(
    *,
    vocab: int = 32000,
    dim: int = 512,
    layers: int = 8,
    heads: int = 8,
    kv_heads: int | None = None,
    ffn: int | None = None,
    context: int = 1024,
    attn: str = "sdpa",
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> Any:
    """``transformers.LlamaForCausalLM`` with random weights (Llama's 32,000-token vocabulary;
    a small width and depth by default).

    Args:
        vocab, dim, layers, heads, context: ``vocab_size``, ``hidden_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``max_position_embeddings``.
        kv_heads: ``num_key_value_heads`` (``None``: ``heads``, no grouping).
        ffn: the SwiGLU MLP's width (``None``: Llama's 8/3 x ``dim``, rounded up to 8).
        attn, dtype, seed: as for :func:`gpt2`.
    """
    tf = _transformers("llama", attn, dim, heads)
    kv = heads if kv_heads is None else kv_heads
    if heads % kv:
        what = f"heads ({heads}) must be divisible by kv_heads ({kv})"
        raise errors.OptionError(BAD_SIZE.format(name="llama", what=what))
    width = ffn if ffn is not None else 8 * math.ceil(8 * dim / 3 / 8)
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=context,
        bos_token_id=min(1, vocab - 1), eos_token_id=min(2, vocab - 1), use_cache=False,
        attn_implementation=attn,
    )  # fmt: skip
    return _make(tf.LlamaForCausalLM, seed, dtype, config)


def bert(
    *,
    vocab: int = 30522,
    dim: int = 768,
    layers: int = 12,
    heads: int = 12,
    context: int = 512,
    attn: str = "sdpa",
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> Any:
    """``transformers.BertForMaskedLM`` with random weights (defaults: BERT-base, 110M).

    Args:
        vocab, dim, layers, heads, context: ``vocab_size``, ``hidden_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``max_position_embeddings``
            (the MLP is 4 x ``dim`` wide, as BERT's).
        attn, dtype, seed: as for :func:`gpt2`.
    """
    tf = _transformers("bert", attn, dim, heads)
    config = tf.BertConfig(
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * dim, max_position_embeddings=context,
        pad_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    return _make(tf.BertForMaskedLM, seed, dtype, config)


def unet(
    *,
    image: int = 64,
    channels: int = 3,
    widths: tuple[int, ...] = (64, 128, 256),
    layers_per_block: int = 2,
    groups: int = 32,
    head_dim: int = 32,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> Any:
    """diffusers' ``UNet2DModel`` with random weights: one level per entry of ``widths``
    (halving the resolution between levels), self-attention only at the lowest resolution
    (``AttnDownBlock2D``/``AttnUpBlock2D``) and in the mid block, GroupNorm of ``groups``
    groups, a positional timestep embedding; a DDPM-style denoiser.

    Args:
        image: the input's height and width (``sample_size``).
        channels: input and output channels.
        widths: ``block_out_channels``, each divisible by ``groups``.
        layers_per_block: ResNet blocks per down level (up levels have one more).
        groups: ``norm_num_groups``.
        head_dim: ``attention_head_dim``.
        dtype, seed: as for :func:`gpt2`.
    """
    df = _require("diffusers", "leangrad.hf.unet")
    if not widths or any(w % groups for w in widths):
        raise errors.OptionError(BAD_SIZE.format(
            name="unet", what=f"widths {widths} must be non-empty and divisible by groups "
            f"({groups})"))  # fmt: skip
    if image % 2 ** (len(widths) - 1):
        raise errors.OptionError(BAD_SIZE.format(
            name="unet", what=f"image ({image}) must be divisible by 2**(levels - 1) = "
            f"{2 ** (len(widths) - 1)}"))  # fmt: skip
    down = ("DownBlock2D",) * (len(widths) - 1) + ("AttnDownBlock2D",)
    up = ("AttnUpBlock2D",) + ("UpBlock2D",) * (len(widths) - 1)
    return _make(
        df.UNet2DModel, seed, dtype,
        sample_size=image, in_channels=channels, out_channels=channels,
        down_block_types=down, up_block_types=up, block_out_channels=tuple(widths),
        layers_per_block=layers_per_block, norm_num_groups=groups, attention_head_dim=head_dim,
    )  # fmt: skip


MODELS: dict[str, Callable[..., Any]] = {"gpt2": gpt2, "llama": llama, "bert": bert, "unet": unet}
"""Name -> factory."""

TINY: dict[str, dict[str, Any]] = {
    "gpt2": {"vocab": 32, "dim": 8, "layers": 2, "heads": 2, "context": 8},
    "llama": {"vocab": 32, "dim": 8, "layers": 2, "heads": 2, "kv_heads": 1, "context": 8},
    "bert": {"vocab": 32, "dim": 8, "layers": 2, "heads": 2, "context": 8},
    "unet": {"image": 4, "widths": (2, 4), "layers_per_block": 1, "groups": 2, "head_dim": 2},
}
"""Sizes for tests: each model's step takes milliseconds on a CPU."""


def model(name: str, **options: Any) -> Any:
    """``MODELS[name](**options)``; unknown names list the known ones."""
    if name not in MODELS:
        raise errors.UnknownNameError(UNKNOWN_MODEL.format(name=name, known=", ".join(MODELS)))
    return MODELS[name](**options)


def _param(model: nn.Module) -> torch.Tensor:
    return next(model.parameters())


def batch(
    name: str, model: nn.Module, size: int, *, length: int = 16, seed: int = 0
) -> tuple[tuple[torch.Tensor, ...], LossFn]:
    """An offline batch for Hugging Face model ``name`` (a key of :data:`MODELS`) built by
    this module: ``(inputs, loss_fn)``, ``model(*inputs)`` being the forward.

    - ``"gpt2"``, ``"llama"``: ``(input_ids,)`` of shape ``(size, length)``; the loss is
      next-token cross-entropy on ``out.logits``.
    - ``"bert"``: ``(input_ids,)`` with 15% of the positions (at least one per row)
      replaced by a mask token; the loss is cross-entropy of ``out.logits`` at those
      positions against the original tokens.
    - ``"unet"``: ``(sample, timestep)``, images of the model's size and integer timesteps
      below 1,000; the loss is the mean squared error of ``out.sample`` against a random
      target (the noise a denoiser predicts).

    The language models' and the UNet's losses are means over examples of equal weight
    (``length - 1`` predicted tokens, or one image's elements, each), declared with
    :func:`leangrad.loss.per_example` so gradient accumulation may split them into
    micro-batches; BERT's is not (see the comment in the code).
    """
    from .loss import per_example

    if name not in MODELS:
        raise errors.UnknownNameError(UNKNOWN_MODEL.format(name=name, known=", ".join(MODELS)))
    gen = torch.Generator().manual_seed(seed)
    p = _param(model)
    config: Any = getattr(model, "config", None)
    if name == "unet":
        res = int(config.sample_size)
        ch = int(config.in_channels)
        sample = torch.randn(size, ch, res, res, generator=gen).to(p.device, p.dtype)
        steps = torch.randint(0, TIMESTEPS, (size,), generator=gen).to(p.device)
        out_ch = int(config.out_channels)
        target = torch.randn(size, out_ch, res, res, generator=gen).to(p.device, p.dtype)
        return (sample, steps), per_example(_sample_mse, target)
    vocab = int(config.vocab_size)
    idx = torch.randint(0, vocab, (size, length), generator=gen)
    if name == "bert":
        mask = torch.rand(size, length, generator=gen) < MASK_FRACTION
        mask[torch.arange(size), torch.randint(0, length, (size,), generator=gen)] = True
        labels = idx[mask].to(p.device)
        masked = idx.masked_fill(mask, min(103, vocab - 1)).to(p.device)  # BERT's [MASK] id
        mask = mask.to(p.device)
        # Not per_example: the mean runs over the masked positions of the whole batch, and
        # rows hold different numbers of them, so rows weigh unequally (a micro-batch's
        # share is its count of masked positions, not its count of rows).
        return (masked,), lambda out: F.cross_entropy(out.logits[mask], labels)
    idx = idx.to(p.device)
    return (idx,), per_example(_next_token_ce, idx[:, 1:])


def _next_token_ce(out: Any, tgt: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``out.logits`` ``(N, T, V)`` against ``tgt``, the
    inputs shifted by one, ``(N, T - 1)``."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tgt.reshape(-1))


def _sample_mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``out.sample`` against ``target``, over every element."""
    return F.mse_loss(out.sample, target)
