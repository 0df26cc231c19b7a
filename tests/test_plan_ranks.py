"""Per-rank memory of a step spread over processes:
:func:`leangrad.planner._ranks.estimate_per_rank` and ``leangrad plan --nproc N --parallel``.

The parts add up to the total; FSDP2 holds 1/N of each parameter (up to one padded row),
as much of each gradient and twice that in Adam's state; a model built on ``meta`` or
under ``FakeTensorMode`` gets the estimate the real one gets; and on 2 real processes the
bytes FSDP2 leaves each rank holding after a step (parameters, gradients, Adam's state)
are within 10% of the estimate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from leangrad import _errors as errors
from leangrad import models
from leangrad.cli import main
from leangrad.planner._ranks import RankEstimate, estimate_per_rank, fsdp_budget_check
from two_processes import run_two

WIDTH = 97  # odd: the shards of 2 processes are padded


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _estimate(model: torch.nn.Module, **kw: object) -> RankEstimate:
    x, y = _batch()
    opts: dict[str, object] = {"nproc": 2, "parallel": "fsdp", "optimizer": "adam", **kw}
    return estimate_per_rank(model, x, lambda o: F.cross_entropy(o, y), **opts)  # type: ignore[arg-type]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.mlp(64, WIDTH, 3, 10)


def test_parts_add_up_and_fsdp_holds_one_shard_of_each() -> None:
    model = _mlp()
    params = list(model.parameters())
    whole = sum(p.numel() * 4 for p in params)
    row = sum(p.numel() // p.shape[0] * 4 for p in params)  # one dim-0 row of each
    fsdp, ddp = _estimate(model), _estimate(model, parallel="ddp")
    for est in (fsdp, ddp):
        assert est.total == sum(est.parts().values())
        assert est.total == (est.parameters + est.gradients + est.optimizer_state + est.buffers
                             + est.inputs + est.buckets + est.gathered + est.activations)
        assert est.optimizer_state == 2 * est.gradients + 4 * len(params)  # + step scalars
        assert est.activations > 0 and est.inputs == 8 * 64 * 4
    assert ddp.parameters == ddp.gradients == ddp.buckets == whole and ddp.gathered == 0
    assert whole / 2 <= fsdp.parameters <= whole / 2 + row
    assert fsdp.parameters > whole / 2  # the padding is counted: 97 rows split 49 + 48
    assert fsdp.gradients == fsdp.parameters and fsdp.buckets == 0
    # mlp is a Sequential of blocks, no root parameters: the two largest blocks' weights
    # gathered at once, and the largest block's unsharded gradient
    blocks = sorted((sum(p.numel() * 4 for p in m.parameters()) for m in model), reverse=True)
    assert fsdp.gathered == blocks[0] + blocks[1] + blocks[0]
    assert fsdp.activations == ddp.activations  # the same per-rank batch and engine
    sgd, none = _estimate(model, optimizer="sgd"), _estimate(model, optimizer=None)
    assert sgd.optimizer_state == none.optimizer_state == 0 and none.optimizer is None
    one = _estimate(model, nproc=1)  # parallel is ignored on one process
    assert one.parallel == "single" and one.parameters == whole
    assert one.buckets == one.gathered == 0


def test_frozen_parameters_have_no_gradient_or_state() -> None:
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    est, full = _estimate(model, parallel="ddp"), _estimate(_mlp(), parallel="ddp")
    frozen = sum(p.numel() * 4 for p in model[0].parameters())
    assert est.parameters == full.parameters
    assert est.gradients == full.gradients - frozen
    assert est.optimizer_state == 2 * est.gradients + 4 * (len(list(model.parameters())) - 2)


def test_meta_and_fake_models_get_the_real_models_estimate() -> None:
    real = _estimate(_mlp())
    with torch.device("meta"):
        meta = models.mlp(64, WIDTH, 3, 10)
    with FakeTensorMode():
        fake = models.mlp(64, WIDTH, 3, 10)
    for other in (meta, fake):
        est = _estimate(other)
        assert "fake tensors" in est.activations_how and "real tensors" in real.activations_how
        assert dataclasses.replace(est, activations_how="") == \
            dataclasses.replace(real, activations_how="")  # fmt: skip
        given = _estimate(other, activations=real.activations)
        assert given == _estimate(_mlp(), activations=real.activations)


def test_table_says_what_was_measured_and_what_counted() -> None:
    text = str(_estimate(_mlp()))
    assert text.startswith("per-rank memory, FSDP2-sharded over 2 processes; optimizer adam")
    for part in ("parameters", "gradients", "optimizer state", "gathered", "activations",
                 "total per rank", "note: ", "counted from parameter shapes", "measured",
                 "distributed.fsdp.fully_shard"):  # fmt: skip
        assert part in text, part


def test_bad_settings_are_refused() -> None:
    model = _mlp()
    with pytest.raises(errors.OptionError, match="nproc must be a whole number"):
        _estimate(model, nproc=0)
    with pytest.raises(errors.OptionError, match="parallel must be one of ddp, fsdp"):
        _estimate(model, parallel="zero")
    with pytest.raises(errors.OptionError, match="optimizer must be None"):
        _estimate(model, optimizer="lbfgs")
    with pytest.raises(errors.OptionError, match="--parallel fsdp trains through FSDP2"):
        _estimate(model, engine="fad")
    assert _estimate(model, engine="fad", parallel="ddp").engine == "fad"  # ddp runs it


def test_fsdp_budget_check() -> None:
    x, y = _batch()
    model = _mlp()
    loss = lambda o: F.cross_entropy(o, y)  # noqa: E731
    name, est = fsdp_budget_check(model, x, loss, budget=2**30, nproc=2, optimizer="adam")
    assert name == "backprop" and est.parallel == "fsdp" and est.fits(2**30)
    assert est.summary(2**30).endswith("of 1.02e+03 MiB: fits")
    given = _estimate(model, activations=est.activations)
    assert dataclasses.replace(est, activations_how="given") == given
    with pytest.raises(errors.EngineInputError, match=r"per rank with backprop, the least of "
                       r"backprop, over the budget of 1 KiB \(parameters "):  # fmt: skip
        fsdp_budget_check(model, x, loss, budget=1024, nproc=2, optimizer="adam",
                          engines=["fad", "backprop"])  # fmt: skip
    with pytest.raises(errors.OptionError, match="none of fad runs here"):
        fsdp_budget_check(model, x, loss, budget=2**30, nproc=2, optimizer="adam",
                          engines=["fad"])  # fmt: skip


WORKER = r'''
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
import torch.nn.functional as F
import leangrad
from leangrad import models, train
from leangrad.train._sharded import local, shard

torch.set_num_threads(1)
out = Path(sys.argv[1])
ctx = train.init_distributed(torch.device("cpu"))
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
torch.manual_seed(0)
model = models.mlp(64, int(sys.argv[2]), 3, 10)
shard(model, leangrad.engine("backprop"), per_layer=False)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
mine = slice(ctx.rank * 8, ctx.rank * 8 + 8)
leangrad.engine("backprop").backward(model, x[mine], lambda o: F.cross_entropy(o, y[mine]))
opt.step()  # gradients kept: parameters, gradients and Adam's state all alive

def nbytes(t):
    t = local(t)
    return t.numel() * t.element_size()

params = list(model.parameters())
held = {"parameters": sum(nbytes(p) for p in params),
        "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(nbytes(v) for st in opt.state.values() for v in st.values()
                               if isinstance(v, torch.Tensor))}
(out / f"rank{ctx.rank}.json").write_text(json.dumps(held))
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_two_fsdp_ranks_hold_what_the_estimate_counts(tmp_path: Path) -> None:
    run_two(WORKER, tmp_path, str(WIDTH))
    est = _estimate(_mlp())
    counted = est.parameters + est.gradients + est.optimizer_state
    for r in range(2):
        held = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert abs(sum(held.values()) - counted) <= 0.1 * counted, (held, est.parts())
        for part, value in held.items():
            assert abs(value - getattr(est, part)) <= 0.1 * value, (part, held, est.parts())


PLAN = ["plan", "--model", "mlp", "--data", "synthetic", "--batch-size", "8", "--no-progress"]


def test_cli_prints_the_per_rank_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--nproc", "2", "--parallel", "fsdp", "--optimizer", "adam"]) == 0
    out = capsys.readouterr().out
    assert "nproc=2 parallel=fsdp" in out
    assert "per-rank memory, FSDP2-sharded over 2 processes; optimizer adam" in out
    assert "optimizer state" in out and "gathered" in out and "total per rank" in out
    assert "verdict" not in out  # fsdp trains backprop only: no plan is searched
    assert main([*PLAN, "--nproc", "2", "--parallel", "fsdp", "--budget", "1KiB",
                 "--engines", "fad,backprop"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "per rank (fsdp, 2 processes, backprop): about " in out
    assert "of 1 KiB: over budget" in out and "activations of backprop" in out
    assert "fad: not under --parallel fsdp: --parallel fsdp trains through FSDP2" in out
    assert main([*PLAN, "--nproc", "2", "--engines", "backprop", "--repeats", "1"]) == 0
    out = capsys.readouterr().out  # --nproc alone: ddp, after the usual plan
    assert "chosen: backprop" in out
    assert "per-rank memory, DDP over 2 processes (every rank holds everything)" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "0"], "argument --nproc: must be at least 1, got 0"),
    (["--nproc", "two"], "argument --nproc: 'two' is not a whole number"),
    (["--nproc", "2", "--parallel", "zero"], "argument --parallel: invalid choice: 'zero'"),
    (["--parallel", "fsdp"], "--parallel fsdp estimates each of several processes' memory "
                             "and needs their number: add --nproc N"),
    (["--nproc", "2", "--parallel", "fsdp", "--save", "p.json"],
     "--parallel fsdp prints per-rank estimates instead of searching a plan (a plan measures "
     "one process holding the whole model), so --save has no effect; drop --save"),
])  # fmt: skip
def test_cli_bad_values_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*PLAN, *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith("leangrad: error: "), err
    assert message in err
    assert captured.out == ""  # refused before any work
