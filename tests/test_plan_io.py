"""A plan kept and reused: ``Plan.save``/``Plan.load`` (the engine rebuilt, the table as
it was, another model or batch shape refused), ``leangrad plan --save`` then
``leangrad train --plan``, and the planner's progress bar and wall time."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leangrad
from leangrad import train
from leangrad._errors import OptionError
from leangrad.cli import main
from leangrad.train import _snapshot as snapshot

ENGINES = [("backprop", {}), ("checkpoint", {"blocks": ("0", "2")}),
           ("checkpoint", {"segments": 2})]  # fmt: skip


def _step(width: int = 8, batch: int = 5):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 3)).double()  # fmt: skip
    x, y = torch.randn(batch, 6, dtype=torch.float64), torch.randint(0, 3, (batch,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _one_line(err: BaseException | str) -> str:
    text = str(err)
    assert "\n" not in text.strip(), text
    return text


def test_round_trip_rebuilds_the_engine_and_keeps_the_table(tmp_path: Path) -> None:
    model, x, loss_fn = _step()
    p = leangrad.plan(model, x, loss_fn, budget=2**30, engines=ENGINES[1:], repeats=1)
    assert p.engine is not None and p.engine.label.startswith("checkpoint(")  # has options
    assert p.wall_seconds is not None and p.wall_seconds > 0
    assert f"planned in {p.wall_seconds:.1f} s (2 candidates)" in str(p)
    path = p.save(tmp_path / "plan.json")
    doc = json.loads(path.read_text())
    assert doc["made_for"]["model"] == "Sequential"
    assert doc["made_for"]["inputs"] == [{"shape": [5, 6], "dtype": "float64"}]
    q = leangrad.Plan.load(path, model=model, inputs=x)
    assert q.table == p.table  # every row, options included: the tuple stays a tuple
    assert q.table[0].options == {"blocks": ("0", "2")}
    assert q.engine is not None and q.engine.label == p.engine.label
    assert (q.budget, q.message, q.peak_bytes, q.seconds, q.exact, q.per_layer) == (
        p.budget, p.message, p.peak_bytes, p.seconds, p.exact, p.per_layer)
    assert q.remeasured_peak_bytes == p.remeasured_peak_bytes and str(q) == str(p)
    # the rebuilt engine is usable: autograd's gradients, in float64
    mine, theirs = copy.deepcopy(model), copy.deepcopy(model)
    q.engine.backward(mine, x, loss_fn)
    loss_fn(theirs(x)).backward()
    for (name, a), b in zip(mine.named_parameters(), theirs.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_another_batch_shape_model_or_device_is_refused_in_one_line(tmp_path: Path) -> None:
    model, x, loss_fn = _step()
    path = leangrad.plan(model, x, loss_fn, budget=2**30, engines=ENGINES[:1],
                         repeats=1).save(tmp_path / "plan.json")  # fmt: skip
    with pytest.raises(leangrad.EngineInputError) as err:
        leangrad.Plan.load(path, model=model, inputs=x[:3])
    assert _one_line(err.value) == (
        f"{path} was made for Sequential with batch shape (5, 6); this model's inputs are "
        "(3, 6): plan again for this batch")  # fmt: skip
    with pytest.raises(leangrad.EngineInputError, match="float64; this model's inputs are"):
        leangrad.Plan.load(path, inputs=x.float())  # same shape, another dtype
    wider, _, _ = _step(width=16)
    with pytest.raises(leangrad.EngineInputError) as err:
        leangrad.Plan.load(path, model=wider, inputs=x)
    assert _one_line(err.value) == (
        f"{path} was made for Sequential (4 parameter tensors, 83 values, float64); this "
        "model is Sequential (4 parameter tensors, 163 values, float64): plan again for this "
        "model")  # fmt: skip
    with pytest.raises(leangrad.EngineInputError, match=r"this model is Sequential .* float32"):
        leangrad.Plan.load(path, model=copy.deepcopy(model).float(), inputs=x)
    doc = json.loads(path.read_text())
    doc["made_for"]["device"] = "cuda"  # as if measured on a GPU
    path.write_text(json.dumps(doc))
    with pytest.raises(leangrad.EngineInputError, match="was measured on cuda; this model runs "
                                                        "on cpu: plan again on this device"):
        leangrad.Plan.load(path, model=model, inputs=x)
    assert leangrad.Plan.load(path).engine is not None  # nothing to check against


def test_another_torch_or_leangrad_version_only_warns(tmp_path: Path) -> None:
    model, x, loss_fn = _step()
    path = leangrad.plan(model, x, loss_fn, budget=2**30, engines=ENGINES[:1],
                         repeats=1).save(tmp_path / "plan.json")  # fmt: skip
    doc = json.loads(path.read_text())
    doc["made_for"]["torch"], doc["made_for"]["leangrad"] = "1.0.0", "0.0.1"
    path.write_text(json.dumps(doc))
    with pytest.warns(UserWarning) as caught:
        q = leangrad.Plan.load(path, model=model, inputs=x)
    said = [str(w.message) for w in caught]
    assert any(f"made with torch 1.0.0, this is {torch.__version__}" in s for s in said)
    assert any(f"made with leangrad 0.0.1, this is {leangrad.__version__}" in s for s in said)
    assert q.engine is not None and q.engine.label == "backprop"


def test_a_plan_where_nothing_fits_round_trips(tmp_path: Path) -> None:
    model, x, loss_fn = _step()
    p = leangrad.plan(model, x, loss_fn, budget=1, engines=ENGINES[:2], repeats=1)
    assert p.engine is None
    q = leangrad.Plan.load(p.save(tmp_path / "none.json"), model=model, inputs=x)
    assert q.engine is None and q.table == p.table and q.message == p.message
    assert "nothing fits" in q.message and str(q) == str(p)


def test_bad_files_and_unsaveable_options_are_refused(tmp_path: Path) -> None:
    model, x, loss_fn = _step()
    p = leangrad.plan(model, x, loss_fn, budget=2**30, engines=ENGINES[:1], repeats=1)
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    newer = {**json.loads(p.save(tmp_path / "p.json").read_text()), "version": 99}
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    for name, says in (("text.json", "not a leangrad plan file"),
                       ("other.json", "not a leangrad plan file (no format 'leangrad.plan')"),
                       ("newer.json", "format version 99, this leangrad reads up to 1"),
                       ("missing.json", "cannot read it")):  # fmt: skip
        with pytest.raises(OptionError) as err:
            leangrad.Plan.load(tmp_path / name)
        assert says in _one_line(err.value)
    row = p.table[0]
    odd = type(row)(row.label, row.exact, row.peak_bytes, row.seconds, row.verdict, row.name,
                    {"dtype": torch.float32})  # fmt: skip
    unsaveable = type(p)(p.engine, p.peak_bytes, p.seconds, p.exact, p.budget, (odd,), p.message)
    with pytest.raises(OptionError, match=r"cannot save option dtype=torch\.float32 of engine"):
        unsaveable.save(tmp_path / "odd.json")


@pytest.mark.slow
def test_progress_true_shows_a_bar_and_a_callback_still_hears_every_step(capsys) -> None:
    model, x, loss_fn = _step()
    heard: list[str] = []
    quiet = leangrad.plan(model, x, loss_fn, budget=2**30, engines=ENGINES, repeats=1,
                          progress=heard.append)  # fmt: skip
    assert capsys.readouterr().err == ""  # a callback: no bar
    assert [m for m in heard if m.startswith("peak of")] == [
        "peak of backprop", "peak of checkpoint(blocks=('0', '2'))",
        "peak of checkpoint(segments=2)"]  # fmt: skip
    assert any(m.startswith("timing 3 candidates") for m in heard)
    shown = leangrad.plan(model, x, loss_fn, budget=2**30, engines=ENGINES, repeats=1,
                          progress=True)  # fmt: skip
    err = capsys.readouterr().err
    assert "plan: " in err and "3/4" in err and "4/4" in err and "timing 3 candidates" in err
    assert [c.label for c in shown.table] == [c.label for c in quiet.table]  # same candidates


def test_fit_takes_a_plan_object_made_for_its_model_and_batch(tmp_path: Path) -> None:
    ds = train.load_data("digits")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 10))  # fmt: skip
    x, y = ds.x[:8].float(), ds.y[:8]
    p = leangrad.plan(model, x, lambda out: F.cross_entropy(out, y), budget=2**30,
                      engines=ENGINES[2:], repeats=1)  # fmt: skip
    res = train.fit(model, ds, plan=p, batch_size=8, max_steps=1, progress=False, plots=False,
                    track_memory_every=0)  # fmt: skip
    assert res.steps == 1 and res.config.plan == "<Plan>"
    assert (res.config.engine, res.config.engine_options) == ("checkpoint", {"segments": 2})
    with pytest.raises(leangrad.EngineInputError, match=re.escape(
            "batch shape (8, 1, 8, 8); this model's inputs are (4, 1, 8, 8)")):
        train.fit(model, ds, plan=p, batch_size=4, max_steps=1, progress=False)
    with pytest.raises(OptionError, match="plan= trains with a saved plan's engine and budget="):
        train.fit(model, ds, plan=p, budget="1GiB", progress=False)


def test_cli_plan_save_then_train_with_it_and_resume(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plans" / "mlp.json"
    base = ["--model", "mlp", "--data", "digits", "--batch-size", "8"]
    assert main(["plan", *base, "--engines", "checkpoint", "--repeats", "1", "--budget",
                 "2GiB", "--save", str(path), "--no-progress"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert f"wrote {path} (train with it: leangrad train --plan {path}" in text
    assert "\nplanned in " in text and "(1 candidates)" in text
    out = tmp_path / "run"
    run = ["train", *base, "--max-steps", "2", "--no-progress", "--no-plots", "--out", str(out)]
    assert main([*run, "--plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert "engine=from the plan" in text and f"plan={path}" in text
    assert f"plan {path}: chosen: checkpoint — " in text and "max_steps: 2 steps" in text
    saved = train.load_checkpoint(out / "checkpoints" / "step-000002.pt")["config"]
    assert saved["engine"] == "checkpoint" and saved["plan"] == str(path)
    assert json.loads((out / "run.json").read_text())["plan"] == str(path)
    path.unlink()  # a resumed run keeps the engine from its checkpoint: the plan is not read
    assert main(["train", "--resume", str(out), "--max-steps", "3", "--no-progress",
                 "--no-plots"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "engine=checkpoint" in text and "max_steps: 3 steps" in text
    assert snapshot.list_checkpoints(out / "checkpoints")[-1].name == "step-000003.pt"


def test_cli_plan_errors_are_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mlp.json"
    base = ["--model", "mlp", "--data", "digits", "--batch-size", "8"]
    assert main(["plan", *base, "--engines", "backprop", "--repeats", "1", "--save", str(path),
                 "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    run = ["train", "--data", "digits", "--max-steps", "1", "--no-progress", "--no-plots"]
    for extra, says in (
        (["--model", "mlp", "--batch-size", "16"], "made for Sequential with batch shape "
         "(8, 1, 8, 8); this model's inputs are (16, 1, 8, 8): plan again for this batch"),
        (["--model", "resnet", "--batch-size", "8"], "this model is Sequential (12 parameter"),
        (["--budget", "1GiB"], "--plan trains with a saved plan's engine and --budget"),
        (["--engine", "backprop"], "--plan chooses the engine ('backprop' given with --engine)"),
        (["--resume", str(tmp_path)], "--resume keeps the checkpoint's engine"),
        (["--engine-opt", "segments=2"], "plan= chooses the engine and its options"),
    ):
        out = tmp_path / f"run{len(extra)}{extra[-1][-2:]}"
        assert main([*run, *extra, "--plan", str(path), "--out", str(out)]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("leangrad: error: "), err
        assert says in err, err
    assert main([*run, "--plan", str(tmp_path / "nope.json")]) == 2
    assert "--plan" in capsys.readouterr().err
    assert main(["plan", *base, "--save", str(tmp_path), "--no-progress"]) == 2  # a directory
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory; name the JSON file" in err
