"""Token-level text data (``--data text --tokenizer bpe:N|tokenizer.json``): the
model's vocabulary is a real tokenizer's, windows shift by one token, ``bpe:N`` is cached."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from leangrad import _errors as E
from leangrad import data, train, zoo
from leangrad.cli import main
from leangrad.data import _tokens
from leangrad.train import _cli

pytest.importorskip("tokenizers")

WORDS = (
    "the", "of", "and", "memory", "gradient", "layer", "model", "tensor", "engine", "step",
    "batch", "token", "vocabulary", "checkpoint", "forward", "backward", "activation", "logits",
    "attention", "embedding", "loss", "optimizer", "train", "test", "data", "window", "shift",
    "merge", "byte", "pair", "encoding", "language", "recompute", "peak",
)  # fmt: skip


def _write_corpus(folder: Path, *, files: int = 3, words: int = 1500) -> list[str]:
    """Seeded English-like ASCII text in ``files`` files; their texts, in file order."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(files):
        lines = [" ".join(rng.choices(WORDS, k=12)) + "." for _ in range(words // 12)]
        texts.append("\n".join(lines) + "\n")
        (folder / f"part{i}.txt").write_text(texts[-1])
    return texts


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """A small text folder, and the tokenizer cache under ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "text"
    return folder, _write_corpus(folder)


def small_gpt(*, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """``module:factory`` target of the CLI tests: a one-layer GPT of the data's vocabulary."""
    return zoo.gpt(vocab=num_classes, dim=16, layers=1, heads=2, context=input_shape[0])


# --- bpe:N ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [300, 3000])
def test_bpe_vocabulary_is_n_even_with_fewer_merges(corpus, n: int) -> None:
    folder, _ = corpus
    ds = train.load_data(f"text:{folder}", tokenizer=f"bpe:{n}", length=16)
    assert isinstance(ds, data.TokenTextDataset)
    assert ds.num_classes == n
    assert ds.x.dtype == ds.y.dtype == torch.int64 and ds.x.shape[1] == 16
    assert int(ds.x.max()) < n and int(ds.y.max()) < n
    learned = ds.tokenizer.get_vocab_size()
    if n == 300:  # the text has more than 44 merges to learn: exactly N
        assert learned == n
    else:  # ~40 distinct words cannot give 2,744 merges: the model is still sized N
        assert 256 < learned < n


def test_windows_are_next_token_shifted_and_decode(corpus) -> None:
    folder, texts = corpus
    ds = train.load_data(f"text:{folder}", tokenizer="bpe:400", length=16)
    # y is x shifted by one token, across window boundaries too (non-overlapping windows)
    assert torch.equal(ds.y[:, :-1], ds.x[:, 1:])
    assert torch.equal(ds.y[:-1, -1], ds.x[1:, 0])
    # the ids are the files' tokens, file by file, in order
    want = [i for t in texts for i in ds.tokenizer.encode(t, add_special_tokens=False).ids]
    assert ds.x.reshape(-1).tolist() == want[: ds.x.numel()]
    # decoding round-trips: one window, and the windows in order are the text's beginning
    first = ds.decode(ds.x[0])
    assert texts[0].startswith(first) and len(first) > 16
    assert ds.decode(ds.y[0]) == first[len(ds.decode(ds.x[0, :1])) :] + ds.decode(ds.y[0, -1:])
    whole = ds.decode(ds.x[:5].reshape(-1))
    assert whole == "".join(ds.decode(w) for w in ds.x[:5])
    assert "".join(texts).startswith(whole)


def test_bpe_is_cached_and_retrained_when_the_text_changes(corpus, monkeypatch) -> None:
    folder, _ = corpus
    first = data.text_tokens(folder, tokenizer="bpe:300", length=8)
    cached = first.tokenizer_file
    assert cached is not None and cached.is_file()
    assert cached.parent == _tokens.tokenizer_cache_dir() == Path(
        str(folder.parent / "cache" / "leangrad" / "tokenizers"))  # fmt: skip
    assert cached.name.startswith("bpe-300-") and cached.suffix == ".json"

    trained: list[int] = []
    real = _tokens._train_bpe

    def counting(tk, texts, n):
        trained.append(n)
        return real(tk, texts, n)

    monkeypatch.setattr(_tokens, "_train_bpe", counting)
    again = data.text_tokens(folder, tokenizer="bpe:300", length=8)
    assert trained == []  # read from the cache file, not trained
    assert again.tokenizer_file == cached and torch.equal(again.x, first.x)
    assert again.tokenizer.get_vocab() == first.tokenizer.get_vocab()

    data.text_tokens(folder, tokenizer="bpe:310", length=8)  # another N: another file
    (folder / "part1.txt").write_text("changed text, changed merges " * 50)
    changed = data.text_tokens(folder, tokenizer="bpe:300", length=8)
    assert trained == [310, 300] and changed.tokenizer_file != cached


def test_cache_dir_follows_xdg_cache_home(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _tokens.tokenizer_cache_dir() == tmp_path / "leangrad" / "tokenizers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _tokens.tokenizer_cache_dir() == Path.home() / ".cache" / "leangrad" / "tokenizers"


# --- tokenizer.json ------------------------------------------------------------------


def _word_tokenizer(path: Path) -> object:
    """A word-level fast tokenizer with special tokens, a post-processor that adds them,
    padding and truncation, saved as ``path`` (none of which must reach the data)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3,
             **{w: i + 4 for i, w in enumerate(sorted(set(WORDS)))}}  # fmt: skip
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[CLS]", "[SEP]", "[PAD]", "<extra>"])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tok.enable_truncation(max_length=5)
    tok.enable_padding(pad_id=3, pad_token="[PAD]", length=5)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


@pytest.mark.parametrize("given", ["file", "folder"])
def test_tokenizer_json_gives_its_vocabulary(tmp_path, given: str) -> None:
    folder, texts = tmp_path / "text", _write_corpus(tmp_path / "text", files=1, words=300)
    path = tmp_path / "saved" / "tokenizer.json"
    tok = _word_tokenizer(path)
    spec = str(path if given == "file" else path.parent)
    ds = train.load_data(f"text:{folder}", tokenizer=spec, length=8)
    assert ds.num_classes == tok.get_vocab_size() == len(set(WORDS)) + 5  # + 4 special, <extra>
    assert ds.tokenizer_file == path
    words = texts[0].replace(".", "").split()  # "gradient." is [UNK]: compare word by word
    assert ds.x.shape[0] == (len(words) - 1) // 8  # no truncation, no [CLS]/[SEP], no padding
    window = ds.decode(ds.x[1]).split()
    assert len(window) == 8
    assert [w if w in WORDS else "[UNK]" for w in texts[0].split()][8:16] == window


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("bpe:abc", _tokens.BAD_TOKENIZER.format(spec="bpe:abc")),
        ("bpe:100", _tokens.SMALL_BPE.format(spec="bpe:100", n=100)),
        (7, _tokens.BAD_TOKENIZER.format(spec=7)),
        ("missing/tokenizer.json", "tokenizer 'missing/tokenizer.json': missing/tokenizer.json "
         "does not exist; give an existing tokenizer.json"),
    ],
)  # fmt: skip
def test_bad_tokenizer_specs_name_the_fix(corpus, spec: object, message: str) -> None:
    folder, _ = corpus
    with pytest.raises(E.OptionError) as err:
        train.load_data(f"text:{folder}", tokenizer=spec)
    assert str(err.value).startswith(message)


def test_a_file_that_is_not_a_tokenizer(corpus, tmp_path) -> None:
    folder, _ = corpus
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(E.OptionError, match=r"is not a Hugging Face fast tokenizer file \("):
        train.load_data(f"text:{folder}", tokenizer=str(bad))


def test_without_tokenizers_the_extra_is_named(corpus, monkeypatch, tmp_path, capsys) -> None:
    folder, _ = corpus
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    want = ("a text tokenizer (bpe:N or tokenizer.json) needs the package 'tokenizers'; "
            "install it with: pip install 'leangrad[hf]'")  # fmt: skip
    with pytest.raises(E.OptionalDependencyError) as err:
        data.load("text", paths=folder, tokenizer="bpe:300")
    assert str(err.value) == want
    code = main(["train", "--model", "gru_lm", "--data", f"text:{folder}", "--tokenizer",
                 "bpe:300", "--out", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip() == f"leangrad: error: {want}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "digits", "--tokenizer", "bpe:300"],
         _cli.TOKENIZER_NEEDS_TEXT.format(tokenizer="bpe:300", data="digits")),
        (["--data", "text", "--tokenizer", "bpe:12"],
         _tokens.SMALL_BPE.format(spec="bpe:12", n=12)),
        (["--data", "text", "--tokenizer", "bpe:"], _tokens.BAD_TOKENIZER.format(spec="bpe:")),
        (["--data", "text", "--data-opt", "tokenizer=bpe:x"],
         _tokens.BAD_TOKENIZER.format(spec="bpe:x")),
    ],
)  # fmt: skip
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, args, message: str) -> None:
    code = main(["train", "--model", "gru_lm", *args, "--out", str(tmp_path / "run"),
                 "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"leangrad: error: {message}\n"
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- the CLI -------------------------------------------------------------------------


def test_cli_trains_a_gpt_with_the_bpe_vocabulary(corpus, tmp_path, capsys) -> None:
    folder, _ = corpus
    out = tmp_path / "run"
    code = main(["train", "--model", f"{__name__}:small_gpt", "--data", f"text:{folder}",
                 "--tokenizer", "bpe:500", "--data-opt", "length=16", "--max-steps", "1",
                 "--batch-size", "4", "--track-memory-every", "0", "--out", str(out),
                 "--no-progress", "--no-plots"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert "data_options={'length': 16, 'tokenizer': 'bpe:500'}" in text
    assert "max_steps: 1 steps" in text
    ckpt = train.load_checkpoint(train.list_checkpoints(out / "checkpoints")[-1])
    assert ckpt["config"]["data_options"]["tokenizer"] == "bpe:500"  # a resume keeps it
    assert ckpt["model"]["tok.weight"].shape == (500, 16)
    assert ckpt["model"]["head.weight"].shape == (500, 16)  # logits over the 500 tokens


def test_plan_takes_the_tokenizer_too(corpus, capsys) -> None:
    folder, _ = corpus
    code = main(["plan", "--model", f"{__name__}:small_gpt", "--data", f"text:{folder}",
                 "--tokenizer", "bpe:500", "--data-opt", "length=16", "--batch-size", "2",
                 "--engines", "backprop", "--repeats", "1", "--no-progress"])  # fmt: skip
    assert code == 0
    assert "chosen: backprop" in capsys.readouterr().out
