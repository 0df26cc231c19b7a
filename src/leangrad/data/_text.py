"""Character-level text data from files already on disk (nothing is downloaded).

By default the text is the Python standard library's own sources (every Python
install has them); any file or directory can be given instead, e.g.
``/usr/share/common-licenses``. Examples are non-overlapping windows of
``length`` characters; the targets are the same windows shifted by one
character (next-character prediction). For windows of tokens of a real tokenizer
(a real vocabulary size), see :func:`leangrad.data.text_tokens`.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

from ._real import Dataset, check_device, check_int

__all__ = [
    "TextDataset",
    "default_text_paths",
    "read_text",
    "shown_paths",
    "text_chars",
    "text_files",
]

NO_PATH = "text data: {path} does not exist; give a text file or a directory of text files"
NO_TEXT = "text data: no readable text in {paths}; give a text file or a directory of text files"
TOO_SHORT = (
    "text data: {chars} characters is too short for one window of length {length}; "
    "give more text or a smaller length"
)


@dataclasses.dataclass(frozen=True)
class TextDataset(Dataset):
    """A :class:`Dataset` of character ids: ``x`` and ``y`` are int64 ``(N, length)``,
    ``y`` being ``x`` shifted by one character; ``num_classes`` is the vocabulary size.

    Attributes:
        vocab: the characters, in id order.
    """

    vocab: str = ""

    def decode(self, ids: torch.Tensor) -> str:
        """The text of a 1-D tensor of character ids."""
        return "".join(self.vocab[i] for i in ids.tolist())


def default_text_paths() -> list[Path]:
    """The ``*.py`` files directly in the Python standard library directory, sorted."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _files(paths: Sequence[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            out.append(p)
    return out


def text_files(paths: Sequence[str | Path] | str | Path | None) -> list[Path]:
    """The files ``paths`` names: files as given, directories read recursively (sorted);
    ``None``: :func:`default_text_paths`.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for p in paths or ():
        if not Path(p).exists():
            raise FileNotFoundError(NO_PATH.format(path=p))
    return default_text_paths() if paths is None else _files(paths)


def read_text(files: Sequence[Path], *, max_chars: int) -> list[str]:
    """The text of ``files`` in order (UTF-8, undecodable bytes replaced; unreadable files
    skipped), one string per file, at most ``max_chars`` characters in all."""
    parts: list[str] = []
    total = 0
    for f in files:
        if total >= max_chars:
            break
        try:
            text = f.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        parts.append(text[: max_chars - total])
        total += len(parts[-1])
    return [p for p in parts if p]


def text_chars(
    paths: Sequence[str | Path] | str | Path | None = None,
    *,
    length: int = 64,
    max_chars: int = 200_000,
    device: torch.device | str = "cpu",
) -> TextDataset:
    """Read text files and cut them into next-character prediction windows.

    Args:
        paths: files and/or directories (read recursively, sorted); ``None``: the
            standard library's ``*.py`` sources (:func:`default_text_paths`).
        length: characters per example.
        max_chars: read at most this many characters in total (files in order).
        device: device of ``x`` and ``y``.

    Returns:
        A :class:`TextDataset` named ``"text"``.
    """
    check_int("length", length, least=1)
    check_int("max_chars", max_chars, least=1)
    device = check_device(device)
    files = text_files(paths)
    text = "".join(read_text(files, max_chars=max_chars))
    if not text:
        raise ValueError(NO_TEXT.format(paths=shown_paths(paths, files)))
    n = (len(text) - 1) // length
    if n < 1:
        raise ValueError(TOO_SHORT.format(chars=len(text), length=length))
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text[: n * length + 1]], dtype=torch.int64)
    x = ids[:-1].reshape(n, length)
    y = ids[1:].reshape(n, length)
    return TextDataset(
        x=x.to(device), y=y.to(device), name="text", num_classes=len(vocab), vocab=vocab
    )


def shown_paths(
    paths: Sequence[str | Path] | str | Path | None, files: Sequence[Path]
) -> list[str]:
    """The paths to name in an error: those given, else the files read."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    return [str(p) for p in (paths or files)]
