"""Token-level text data: the files of :func:`text_chars` cut into windows of tokens of a
real tokenizer, so a language model gets a real vocabulary size (GPT-2's 50,257, Llama's
32,000) instead of the ~100 characters of the text. That size sets the embedding and the
logits ``(N, T, vocab)``, which dominate a language model's memory.

Two tokenizers, both offline, with the ``tokenizers`` package (the ``hf`` extra):

- ``"bpe:N"``: a byte-level BPE (GPT-2's scheme: Radford et al. 2019, "Language Models
  are Unsupervised Multitask Learners", section 2.2; Sennrich et al. 2016, "Neural Machine
  Translation of Rare Words with Subword Units") trained here on the same files, at most
  ``train_chars`` characters of them, to a vocabulary of ``N``. It is cached under
  ``$XDG_CACHE_HOME/leangrad/tokenizers`` (``~/.cache/leangrad/tokenizers``), keyed by the
  files' paths, sizes and modification times, ``N`` and ``train_chars``, so only the
  first run trains (1-2 s for ``bpe:50257`` on the default text, 4.7 MB, on 2 CPU
  cores; it learns ~39,000 tokens there, and the model is still sized 50,257).
- a Hugging Face fast tokenizer's ``tokenizer.json`` (or a folder holding one), e.g. one
  saved with ``AutoTokenizer.from_pretrained(...).save_pretrained(folder)``.

Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import _errors as errors
from ._real import Dataset, check_device, check_int
from ._text import NO_TEXT, read_text, shown_paths, text_chars, text_files

__all__ = [
    "TokenTextDataset",
    "load_tokenizer",
    "text_data",
    "text_tokens",
    "tokenizer_cache_dir",
]

BPE_PREFIX = "bpe:"
MIN_BPE = 256
"""The smallest ``bpe:N``: a byte-level BPE starts from the 256 byte tokens."""
CACHE_FORMAT = 1
"""Part of the cache key: bump it when the trained tokenizer changes."""
FEATURE = "a text tokenizer (bpe:N or tokenizer.json)"
BAD_TOKENIZER = (
    "tokenizer {spec!r}: not a tokenizer; give bpe:N (a byte-level BPE with a vocabulary "
    "of N, trained here on the text, e.g. bpe:50257 as GPT-2, bpe:32000 as Llama) or the "
    "path of a Hugging Face tokenizer.json"
)
SMALL_BPE = (
    "tokenizer {spec!r}: a byte-level BPE needs a vocabulary of at least 256 (its byte "
    "tokens), got {n}; give e.g. bpe:50257 (GPT-2) or bpe:32000 (Llama)"
)
NO_TOKENIZER_FILE = (
    "tokenizer {spec!r}: {path} does not exist; give an existing tokenizer.json (or a "
    "folder holding one), or bpe:N to train a byte-level BPE on the text"
)
BAD_TOKENIZER_FILE = (
    "tokenizer {spec!r}: {path} is not a Hugging Face fast tokenizer file ({error}); save "
    "one with AutoTokenizer.from_pretrained(...).save_pretrained(folder) and give "
    "folder/tokenizer.json"
)
TOO_FEW_TOKENS = (
    "text data: {tokens} tokens is too short for one window of length {length}; "
    "give more text, a larger max_chars or a smaller length"
)


@dataclasses.dataclass(frozen=True)
class TokenTextDataset(Dataset):
    """A :class:`Dataset` of token ids: ``x`` and ``y`` are int64 ``(N, length)``, ``y``
    being ``x`` shifted by one token; ``num_classes`` is the tokenizer's vocabulary size
    (``N`` for ``bpe:N``, even when the text yields fewer merges: the model's embedding
    and logits, hence its memory, are sized by it).

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer``.
        tokenizer_file: the JSON file it was read from (the cache file for ``bpe:N``).
    """

    tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)
    tokenizer_file: Path | None = None

    def decode(self, ids: torch.Tensor) -> str:
        """The text of a 1-D tensor of token ids (ids the tokenizer lacks, which a model
        of ``bpe:N`` may predict beyond the trained merges, are dropped)."""
        return str(self.tokenizer.decode(ids.tolist(), skip_special_tokens=False))


def _tokenizers() -> Any:
    """The ``tokenizers`` package, or :class:`OptionalDependencyError` naming the extra."""
    try:
        return importlib.import_module("tokenizers")
    except ImportError as err:
        raise errors.OptionalDependencyError(
            errors.MISSING_EXTRA.format(feature=FEATURE, package="tokenizers", extra="hf")
        ) from err


def _parse(spec: object) -> int | Path:
    """``"bpe:N"`` -> ``N``; a path -> the ``tokenizer.json`` it names."""
    if isinstance(spec, str) and spec.startswith(BPE_PREFIX):
        try:
            n = int(spec[len(BPE_PREFIX) :])
        except ValueError:
            raise errors.OptionError(BAD_TOKENIZER.format(spec=spec)) from None
        if n < MIN_BPE:
            raise errors.OptionError(SMALL_BPE.format(spec=spec, n=n))
        return n
    if not isinstance(spec, (str, Path)) or not str(spec):
        raise errors.OptionError(BAD_TOKENIZER.format(spec=spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise errors.OptionError(NO_TOKENIZER_FILE.format(spec=spec, path=path))
    return path


def tokenizer_cache_dir() -> Path:
    """Where trained ``bpe:N`` tokenizers are kept: ``$XDG_CACHE_HOME/leangrad/tokenizers``,
    ``~/.cache/leangrad/tokenizers`` when ``XDG_CACHE_HOME`` is unset or relative."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "leangrad" / "tokenizers"


def _cache_file(files: Sequence[Path], n: int, train_chars: int) -> Path:
    """The cache file of ``bpe:n`` trained on ``files``: named by a hash of their paths,
    sizes and modification times, ``n`` and ``train_chars``."""
    stats = []
    for f in files:
        with contextlib.suppress(OSError):
            st = f.stat()
            stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    key = json.dumps({"format": CACHE_FORMAT, "n": n, "train_chars": train_chars,
                      "files": stats})  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return tokenizer_cache_dir() / f"bpe-{n}-{digest}.json"


def _train_bpe(tk: Any, texts: Sequence[str], n: int) -> Any:
    """A byte-level BPE of vocabulary (at most) ``n`` trained on ``texts``, as GPT-2's:
    byte-level pre-tokenizer without a prefix space and the 256 bytes as its alphabet."""
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=n, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _bpe(tk: Any, files: Sequence[Path], n: int, train_chars: int) -> tuple[Any, Path]:
    """``bpe:n`` from the cache, else trained on ``files`` and cached (atomically; a cache
    that cannot be written is skipped: the tokenizer is still returned)."""
    path = _cache_file(files, n, train_chars)
    if path.is_file():
        try:
            return tk.Tokenizer.from_file(str(path)), path
        except Exception:  # a damaged cache file: train again and replace it
            pass
    texts = read_text(files, max_chars=train_chars)
    if not texts:
        raise ValueError(NO_TEXT.format(paths=[str(f) for f in files]))
    tok = _train_bpe(tk, texts, n)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
    return tok, path


def load_tokenizer(
    spec: str | Path,
    paths: Sequence[str | Path] | str | Path | None = None,
    *,
    train_chars: int = 8_000_000,
) -> tuple[Any, int, Path]:
    """The tokenizer ``spec`` names and the vocabulary size a model needs for it.

    Args:
        spec: ``"bpe:N"`` (a byte-level BPE of vocabulary ``N``, trained on ``paths`` or
            read from the cache) or the path of a ``tokenizer.json`` (or of its folder).
        paths: the text a ``bpe:N`` is trained on, as in :func:`text_chars`.
        train_chars: train a ``bpe:N`` on at most this many characters (files in order).

    Returns:
        ``(tokenizer, vocab_size, file)``: a ``tokenizers.Tokenizer``; ``N`` for ``bpe:N``,
        else the tokenizer's ``get_vocab_size()`` (added tokens included); its JSON file.

    Raises:
        OptionError: ``spec`` is neither ``bpe:N`` with ``N >= 256`` nor a tokenizer file.
        OptionalDependencyError: ``tokenizers`` is not installed.
    """
    check_int("train_chars", train_chars, least=1)
    parsed = _parse(spec)
    tk = _tokenizers()
    if isinstance(parsed, int):
        tok, path = _bpe(tk, text_files(paths), parsed, train_chars)
        return tok, parsed, path
    try:
        tok = tk.Tokenizer.from_file(str(parsed))
    except Exception as err:  # tokenizers raises plain Exception on a bad file
        raise errors.OptionError(
            BAD_TOKENIZER_FILE.format(spec=spec, path=parsed, error=str(err).splitlines()[0])
        ) from None
    tok.no_truncation()
    tok.no_padding()
    return tok, int(tok.get_vocab_size(with_added_tokens=True)), parsed


def text_tokens(
    paths: Sequence[str | Path] | str | Path | None = None,
    *,
    tokenizer: str | Path,
    length: int = 64,
    max_chars: int = 1_000_000,
    train_chars: int = 8_000_000,
    device: torch.device | str = "cpu",
) -> TokenTextDataset:
    """Read text files and cut them into next-token prediction windows.

    Each file is tokenized on its own (no special tokens added) and the ids are joined
    in file order; examples are non-overlapping windows of ``length`` tokens and the
    targets the same windows shifted by one token.

    Args:
        paths: files and/or directories (read recursively, sorted); ``None``: the
            standard library's ``*.py`` sources (:func:`default_text_paths`).
        tokenizer: ``"bpe:N"`` or a ``tokenizer.json`` path (:func:`load_tokenizer`).
        length: tokens per example.
        max_chars: tokenize at most this many characters in total (files in order; at
            ~4 characters a token, the default gives ~250,000 tokens).
        train_chars: train a ``bpe:N`` on at most this many characters.
        device: device of ``x`` and ``y``.

    Returns:
        A :class:`TokenTextDataset` named ``"text"`` whose ``num_classes`` is the
        vocabulary size: ``N`` for ``bpe:N`` even if the text yields fewer merges.
    """
    check_int("length", length, least=1)
    check_int("max_chars", max_chars, least=1)
    device = check_device(device)
    _parse(tokenizer)  # a bad spec or a missing package fails before any reading
    _tokenizers()
    files = text_files(paths)
    texts = read_text(files, max_chars=max_chars)
    if not texts:
        raise ValueError(NO_TEXT.format(paths=shown_paths(paths, files)))
    tok, vocab, file = load_tokenizer(tokenizer, files, train_chars=train_chars)
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    ids = torch.tensor(list(itertools.chain.from_iterable(e.ids for e in encoded)),
                       dtype=torch.int64)  # fmt: skip
    n = (ids.numel() - 1) // length
    if n < 1:
        raise ValueError(TOO_FEW_TOKENS.format(tokens=ids.numel(), length=length))
    ids = ids[: n * length + 1]
    return TokenTextDataset(
        x=ids[:-1].reshape(n, length).to(device), y=ids[1:].reshape(n, length).to(device),
        name="text", num_classes=vocab, tokenizer=tok, tokenizer_file=file,
    )  # fmt: skip


def text_data(
    paths: Sequence[str | Path] | str | Path | None = None,
    *,
    tokenizer: str | Path | None = None,
    **options: Any,
) -> Dataset:
    """Text windows: of characters (:func:`text_chars`) without a tokenizer, of tokens
    (:func:`text_tokens`) with one; ``options`` are theirs."""
    if tokenizer is None:
        return text_chars(paths, **options)
    return text_tokens(paths, tokenizer=tokenizer, **options)
