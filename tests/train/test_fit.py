"""leangrad.train.fit: registries, bit-exact resume, checkpoint faults, NaN and SIGINT."""

from __future__ import annotations

import hashlib
import signal
import sys

import pytest
import torch

from leangrad import UnknownNameError, available, train
from leangrad.train import _snapshot as snapshot
from leangrad.train._metrics import NO_MATPLOTLIB
from train_cases import SMALL, Trap, assert_equal, weights

IMAGES = {**SMALL, "data_options": {"n": 160, "shape": [1, 8, 8]}}






RESUME_CASES = [
    ("mlp", "backprop", {}, False, SMALL),
    ("mlp", "projforward", {}, False, SMALL),  # draws from the global torch RNG
    ("mlp", "projforward", {"seed": 3}, False, SMALL),  # from the engine's own generator
    ("submersive_cnn", "moonwalk", {}, True, IMAGES),  # per-layer steps in on_grad
]


@pytest.mark.parametrize(("model", "engine", "opts", "per_layer", "base"), RESUME_CASES)
def test_resume_is_bit_exact(tmp_path, model, engine, opts, per_layer, base) -> None:
    """A run stopped at step 6 (mid-epoch 2) and resumed ends with the same weights, bit for
    bit, as a run of 10 steps that was never stopped (torch.equal, Adam state included)."""
    kw = dict(base, engine=engine, engine_options=opts, step_per_layer=per_layer, epochs=5)
    ref = train.fit(model, **kw, max_steps=10, out=tmp_path / "ref", checkpoint_every=4)
    first = train.fit(model, **kw, max_steps=6, out=tmp_path / "run")
    assert first.stopped == "max_steps" and first.checkpoint.name == "step-000006.pt"
    again = train.fit(model, **kw, max_steps=10, out=tmp_path / "run", resume=tmp_path / "run")
    assert again.steps == ref.steps == 10
    assert_equal(weights(again.model), weights(ref.model))
    steps = [r["step"] for r in train.read_metrics(again.metrics) if r["kind"] == "step"]
    assert steps == list(range(1, 11))  # metrics cut back to the checkpoint, then continued


def test_resume_rejects_other_settings(tmp_path) -> None:
    train.fit("mlp", **SMALL, max_steps=2, out=tmp_path)
    with pytest.raises(train.CheckpointError, match=r"cannot resume .* lr: 0.01 there, 0.1 here"):
        train.fit("mlp", **SMALL, lr=0.1, resume=tmp_path)


def test_checkpoint_from_another_model(tmp_path) -> None:
    train.fit("mlp", **SMALL, max_steps=2, out=tmp_path)
    wrong = r"different model: '0.1.weight' is \[64, 64\] torch.float32 there but \[32, 64\]"
    with pytest.raises(train.CheckpointError, match=wrong):
        train.fit("mlp", **SMALL, model_options={"width": 32}, resume=tmp_path)
    with pytest.raises(train.CheckpointError, match="parameters missing from it"):
        train.fit("resnet", **IMAGES, resume=tmp_path)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_corrupt_truncated_and_foreign_checkpoints(tmp_path) -> None:
    """Each fault is named; the earlier checkpoints stay byte-for-byte untouched."""
    train.fit("mlp", **SMALL, max_steps=4, checkpoint_every=2, out=tmp_path)
    ckpts = snapshot.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002.pt", "step-000004.pt"]
    earlier = _digest(ckpts[0])
    newest = ckpts[1]
    raw = newest.read_bytes()
    newest.write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(train.CheckpointError, match="not a leangrad checkpoint, or truncated"):
        train.fit("mlp", **SMALL, resume=tmp_path)
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 0xFF
    newest.write_bytes(bytes(flipped))  # one flipped bit in the middle
    with pytest.raises(train.CheckpointError, match=r"corrupt \(checksum mismatch"):
        train.load_checkpoint(newest)
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": torch.zeros(3)}, foreign)
    with pytest.raises(train.CheckpointError, match="no leangrad trailer"):
        train.load_checkpoint(foreign)
    assert _digest(ckpts[0]) == earlier
    resumed = train.fit("mlp", **SMALL, max_steps=4, resume=ckpts[0], out=tmp_path / "again")
    assert resumed.steps == 4


class _Payload:
    """Unpickling this would create a marker file: loading must never do it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def test_loading_never_executes_pickled_code(tmp_path) -> None:
    marker = tmp_path / "executed"
    path = tmp_path / "evil.pt"
    snapshot.save_checkpoint(path, {"model": _Payload(str(marker))})  # valid trailer and checksum
    with pytest.raises(train.CheckpointError, match="weights_only=True"):
        train.load_checkpoint(path)
    assert not marker.exists()


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path) -> None:
    path = snapshot.save_checkpoint(tmp_path / "step-000001.pt", {"step": 1, "x": torch.arange(4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001.pt"]
    (tmp_path / ".step-000002.pt.tmp-123").write_bytes(b"half a file")  # a crash mid-write
    assert snapshot.list_checkpoints(tmp_path) == [path]
    assert torch.equal(train.load_checkpoint(path)["x"], torch.arange(4))




def test_nonfinite_loss_stops_with_step_and_keeps_last_good_checkpoint(tmp_path) -> None:
    with pytest.raises(train.NonFiniteLossError, match=r"loss is nan at step 7 \(epoch 1, "
                       r"batch 2\).*step-000006.pt"):  # fmt: skip
        train.fit(Trap(8, "nan"), **SMALL, epochs=3, checkpoint_every=2, out=tmp_path)
    ckpts = snapshot.list_checkpoints(tmp_path / "checkpoints")
    assert ckpts[-1].name == "step-000006.pt"
    state = train.load_checkpoint(ckpts[-1])["model"]
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_finishes_a_checkpoint_and_returns(tmp_path) -> None:
    # the handler fit found, restored after: Python's default_int_handler, or SIG_IGN where
    # the test process was started in the background by a shell without job control
    before = signal.getsignal(signal.SIGINT)
    res = train.fit(Trap(3, "sigint"), **SMALL, epochs=3, checkpoint_every=100, out=tmp_path)
    assert res.stopped == "interrupted" and res.steps == 3
    assert res.checkpoint == tmp_path / "checkpoints" / "step-000003.pt"
    assert_equal(train.load_checkpoint(res.checkpoint)["model"], weights(res.model))
    assert signal.getsignal(signal.SIGINT) is before  # handler restored


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match="unknown model 'nope'; known models: gru_lm, "
                       "mlp, resnet, revnet, submersive_cnn"):  # fmt: skip
        train.fit("nope", **SMALL)
    with pytest.raises(UnknownNameError, match=r"unknown dataset 'nope'; known datasets: .*text"):
        train.fit("mlp", "nope")
    with pytest.raises(UnknownNameError, match=r"unknown engine 'nope'; known engines: "
                       + ", ".join(available())):  # fmt: skip
        train.fit("mlp", **SMALL, engine="nope")
    with pytest.raises(UnknownNameError, match="cannot import"):
        train.fit("leangrad.models:no_such_factory", **SMALL)


def test_engine_that_cannot_run_the_model_says_why() -> None:
    with pytest.raises(Exception, match="engine 'moonwalk' cannot train model 'mlp'"):
        train.fit("mlp", **SMALL, engine="moonwalk")
    with pytest.raises(Exception, match="needs image inputs"):
        train.fit("revnet", **SMALL)


@pytest.mark.parametrize(
    ("model", "engine", "data", "data_options"),
    [
        ("resnet", "checkpoint", "digits", {}),
        ("revnet", "revbackprop", "digits", {}),
        ("revnet", "moonwalk", "digits", {}),
        ("gru_lm", "backprop", "text", {"max_chars": 4000, "length": 16}),
        ("leangrad.models:small_cnn", "backprop", "digits", {}),
    ],
)
def test_registered_models_train(model, engine, data, data_options) -> None:
    res = train.fit(model, data, data_options=data_options, engine=engine, max_steps=3,
                    batch_size=16, progress=False, track_memory_every=1)  # fmt: skip
    assert res.steps == 3 and res.final_loss is not None and res.final_loss > 0
    assert res.peak_bytes is not None and res.peak_bytes > 0  # tracked every step


def test_text_data_is_next_character_windows(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("hello world, hello leangrad\n")
    ds = train.load_data(f"text:{tmp_path}", length=4)
    assert ds.x.dtype == torch.int64 and ds.x.shape == (6, 4)
    assert ds.decode(ds.x[0]) == "hell" and ds.decode(ds.y[0]) == "ello"
    assert ds.decode(ds.x.reshape(-1)) == "hello world, hello leang"


def test_metrics_and_plots(tmp_path, monkeypatch) -> None:
    res = train.fit("mlp", **{**SMALL, "plots": True}, epochs=2, out=tmp_path)
    recs = train.read_metrics(res.metrics)
    assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(1, 9))
    assert [r["epoch"] for r in recs if r["kind"] == "epoch"] == [0, 1]
    assert res.plot is not None and res.plot.stat().st_size > 0
    assert (tmp_path / "run.json").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert train.plot_metrics(res.metrics, tmp_path / "x.png") == NO_MATPLOTLIB


def test_an_unknown_parallel_is_refused_naming_the_choices() -> None:
    from leangrad._errors import OptionError

    with pytest.raises(OptionError, match=r"parallel must be one of ddp, fsdp, got 'zero'"):
        train.fit("mlp", **SMALL, parallel="zero")
