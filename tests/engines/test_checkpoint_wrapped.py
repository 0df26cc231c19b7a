"""``checkpoint`` on models wrapped by DistributedDataParallel and FSDP2, on 2
local processes (gloo): under DDP the step runs through DDP's own forward (its reducer
prepared, its hooks averaging in the backward), every option; under FSDP2 each block is
checkpointed inside its own FSDP unit (FSDP's hooks around the checkpoint). The gradients
— ``.grad`` of the DDP model, the DTensor gradients' ``full_tensor()``, what ``on_grad``
receives after the backward — equal one process's backprop on the combined batch in
float64, in a second step too; the blocks are really recomputed (the recomputation's
``addmm`` calls are counted); checkpoint holds less activation memory than backprop on
the same FSDP2 model (MemoryTracker, 6 blocks); ``fit(parallel="fsdp")`` trains with it;
the options FSDP2 cannot take are refused with a message naming the option and the fix."""

from __future__ import annotations

import json

import pytest
from torch import nn

import leangrad
from leangrad import models
from leangrad.engines._wrapped import DDP, FSDP1, FSDP2
from two_processes import run_two

WORKER = r"""
import json, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
import leangrad
from leangrad import models, train, _errors as errors
from leangrad.measure import MemoryTracker

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):  # transformer-ish: attention, an MLP, a gain of its own
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        h = x + torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        return h + self.gain * self.mlp(h)


class Net(nn.Module):  # its own forward: each block checkpointed alone
    def __init__(self, d=8, n=3):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


class Linears(TorchDispatchMode):  # counts linear layers run: forward and recomputation
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.addmm.default  # the backward runs mm, not addmm
        return func(*args, **(kwargs or {}))


def build(kind, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return (models.mlp(32, 16, 2, 10) if kind == "mlp" else Net(**kw)).to(dtype)


def sharded(model):
    for b in leangrad.blocks(model).modules.values():
        if any(True for _ in b.parameters()):
            fully_shard(b)
    fully_shard(model)
    return model


gen = torch.Generator().manual_seed(1)
data = {"mlp": (torch.randn(16, 32, generator=gen, dtype=torch.float64),
                torch.randint(0, 10, (16,), generator=gen)),
        "net": (torch.randn(16, 6, 4, generator=gen, dtype=torch.float64),
                torch.randint(0, 5, (16,), generator=gen))}
half = slice(rank * 8, rank * 8 + 8)
out = {"ref": {}, "cases": {}, "refused": {}}
full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
plain = lambda n: n[len("module."):] if n.startswith("module.") else n

for kind, (x, y) in data.items():
    m = build(kind)  # one process, the combined batch, no wrapper
    with Linears() as count:
        leangrad.engine("backprop").backward(m, x, lambda o: F.cross_entropy(o, y))
    out["ref"][kind] = {"grads": {n: p.grad.flatten().tolist() for n, p in m.named_parameters()},
                        "linears": count.n}  # a half batch makes the same calls
    cases = [("ddp", {}), ("ddp", {"trace": True}), ("ddp", {"levels": 2}),
             ("ddp", {"fragments": 2}), ("ddp", {"fragments": 2, "fragment_blocks": 1}),
             ("fsdp", {}), ("fsdp", {"trace": True}), ("fsdp", {"fragments": 2})]
    if kind == "mlp":
        cases.append(("ddp", {"segments": 2}))
    else:  # a named block on two levels (the largest-n sizing runs in the case above)
        cases.append(("ddp", {"fragments": 2, "fragment_blocks": ["blocks.1"], "levels": 2}))
    for wrapper, opts in cases:
        model = build(kind)
        wrapped = DistributedDataParallel(model) if wrapper == "ddp" else sharded(model)
        eng = leangrad.engine("checkpoint", **opts)
        seen, counts = {}, []
        for step in range(2):  # DDP raises in the second if the first left reduction open
            wrapped.zero_grad(set_to_none=True)
            seen.clear()
            with Linears() as count:
                res = eng.backward(wrapped, x[half], lambda o: F.cross_entropy(o, y[half]),
                                   on_grad=lambda n, p: seen.__setitem__(plain(n),
                                                                         full(p.grad)))
            counts.append(count.n)
        case = {"grads": {plain(n): full(p.grad).flatten().tolist()
                          for n, p in wrapped.named_parameters()},
                "seen": {n: g.flatten().tolist() for n, g in seen.items()},
                "linears": counts, "fragmented": res.info.get("fragmented"),
                "whole": sorted(res.info.get("whole", {}))}
        if wrapper == "fsdp" and opts.get("trace"):  # every block ran as its fx trace
            entries = eng._in_place._cache[model][2]
            case["traced"] = [isinstance(t, torch.fx.GraphModule) for _, f in entries
                              for t in f.traced._by_state.values()]
        out["cases"][f"{wrapper} {kind} {json.dumps(opts, sort_keys=True)}"] = case

x, y = data["mlp"]
for opts in [{"segments": 2}, {"levels": 2}, {"sequence_fragments": 2},
             {"fragments": 2, "fragment_blocks": 1}]:
    try:
        leangrad.engine("checkpoint", **opts).backward(
            sharded(build("mlp")), x[half], lambda o: F.cross_entropy(o, y[half]))
        out["refused"][json.dumps(opts)] = "ran"
    except errors.EngineInputError as err:
        out["refused"][json.dumps(opts)] = str(err)

# blocks that write their input in place (a leaky ReLU first: not idempotent), on FSDP2
class Leaky(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.act, self.lin = nn.LeakyReLU(0.1, inplace=True), nn.Linear(d, d)

    def forward(self, x):
        return self.lin(self.act(x))


class LeakyNet(Net):
    def __init__(self, d=8, n=3):
        super().__init__(d, n)
        self.blocks = nn.ModuleList([Leaky(d) for _ in range(n)])


x, y = data["net"]
torch.manual_seed(0)
m = LeakyNet().double()
F.cross_entropy(m(x), y).backward()
out["inplace_ref"] = {n: p.grad.flatten().tolist() for n, p in m.named_parameters()}
torch.manual_seed(0)
model = sharded(LeakyNet().double())
leangrad.engine("checkpoint").backward(model, x[half], lambda o: F.cross_entropy(o, y[half]))
out["inplace"] = {n: full(p.grad).flatten().tolist() for n, p in model.named_parameters()}

# activation memory on FSDP2: 6 blocks, backprop against checkpoint, after a warm-up step
torch.manual_seed(2)
xm = torch.randn(16, 64, 4)
ym = torch.randint(0, 5, (16,))
out["memory"] = {}
for name in ["backprop", "checkpoint"]:
    model = sharded(build("net", torch.float32, d=32, n=6))
    eng = leangrad.engine(name)
    loss_fn = lambda o: F.cross_entropy(o, ym)
    eng.backward(model, xm, loss_fn)
    model.zero_grad(set_to_none=True)
    with MemoryTracker(baseline=(model, xm)) as tracker:
        eng.backward(model, xm, loss_fn)
    rep = tracker.report
    out["memory"][name] = {"forward_end": rep.forward_live_bytes, "peak": rep.peak_bytes,
                           "baseline": rep.baseline_bytes}

# fit(parallel="fsdp") trains with checkpoint as with backprop
kw = {"data": "synthetic", "data_options": {"n": 64}, "optimizer": "adam", "lr": 0.01,
      "progress": False, "track_memory_every": 0, "batch_size": 8, "plots": False,
      "parallel": "fsdp", "test_fraction": 0.0, "max_steps": 2}
fits = {}
for engine in ["backprop", "checkpoint"]:
    torch.manual_seed(0)
    res = train.fit(models.mlp(64, 32, 3, 10), engine=engine, **kw)
    fits[engine] = {n: p.full_tensor().flatten().tolist() for n, p in res.model.named_parameters()}
out["fit"] = fits
try:
    torch.manual_seed(0)
    train.fit(models.mlp(64, 32, 3, 10), engine="checkpoint",
              engine_options={"segments": 2}, **kw)
    out["fit_refused"] = "trained"
except errors.LeangradError as err:
    out["fit_refused"] = str(err)

json.dump(out, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
print("memory", rank, json.dumps(out["memory"]))
dist.barrier()  # no rank tears its connections down while another still uses them
dist.destroy_process_group()
"""


def _close(got: list[float], want: list[float]) -> bool:
    """Within 1e-12 elementwise (float64: one process's backprop against the average)."""
    if len(got) != len(want):
        return False
    return all(abs(a - b) <= 1e-12 for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ckpt_wrapped")
    logs = run_two(WORKER, tmp)
    print("\n".join(line for log in logs for line in log.splitlines()
                    if line.startswith("memory")))  # fmt: skip
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_gradients_equal_one_process_backprop(ranks: list[dict]) -> None:
    for rank in ranks:
        assert len(rank["cases"]) == 18
        for case, got in rank["cases"].items():
            ref = rank["ref"][case.split()[1]]["grads"]
            assert set(got["grads"]) == set(ref) == set(got["seen"]), case
            for n, want in ref.items():
                assert _close(got["grads"][n], want), (case, n)
                assert _close(got["seen"][n], want), (case, n)  # on_grad: averaged


@pytest.mark.slow  # its fixture runs two processes
def test_fsdp2_blocks_writing_their_input_in_place_run_on_copies(ranks: list[dict]) -> None:
    """Each block begins with ``LeakyReLU(inplace=True)`` on its input: checkpointed inside
    its FSDP2 unit, it runs on a copy of its input, and the gradients are one process's
    backprop on the combined batch."""
    for rank in ranks:
        ref, got = rank["inplace_ref"], rank["inplace"]
        assert set(got) == set(ref)
        for n, want in ref.items():
            assert _close(got[n], want), n


@pytest.mark.slow  # its fixture runs two processes
def test_blocks_are_recomputed(ranks: list[dict]) -> None:
    # linear calls of one step: the forward's, plus those of the recomputed blocks
    recomputed = {"mlp": 2, "net": 9}  # mlp: blocks 0 and 1 (not the last); net: 3 x 3
    for rank in ranks:
        for case, got in rank["cases"].items():
            _, kind, opts = case.split(" ", 2)
            plain = rank["ref"][kind]["linears"]
            # the first step probes each block (fragments; in-place writes of its input)
            first, second = got["linears"]
            assert first >= second > plain, case
            if json.loads(opts) in ({}, {"trace": True}):
                assert second == plain + recomputed[kind], case
        for kind in ("mlp", "net"):  # FSDP2 with trace: every checkpointed block as fx code
            traced = rank["cases"][f'fsdp {kind} {{"trace": true}}']["traced"]
            assert traced == [True] * (2 if kind == "mlp" else 3), traced


@pytest.mark.slow  # its fixture runs two processes
def test_ddp_fragment_blocks_fragments_only_the_blocks_chosen(ranks: list[dict]) -> None:
    """Under DDP ``fragment_blocks`` picks its blocks as on the bare model (the largest, sized
    on fake tensors of ``ddp.module``; or the one named) and the others run whole; the
    gradients are checked with every other case's
    (:func:`test_gradients_equal_one_process_backprop`)."""
    recomputed = {"mlp": ["0", "1"], "net": ["blocks.0", "blocks.1", "blocks.2"]}
    for rank in ranks:
        for kind, names in recomputed.items():
            got = rank["cases"][f'ddp {kind} {{"fragment_blocks": 1, "fragments": 2}}']
            assert len(got["fragmented"]) == 1 and got["fragmented"][0] in names, got
            assert got["whole"] == sorted(set(names) - set(got["fragmented"])), got
        named = rank["cases"]['ddp net {"fragment_blocks": ["blocks.1"], "fragments": 2, '
                              '"levels": 2}']  # fmt: skip
        assert named["fragmented"] == ["blocks.1"]
        assert named["whole"] == ["blocks.0", "blocks.2"]


@pytest.mark.slow  # its fixture runs two processes
def test_fsdp2_refuses_what_it_cannot_take(ranks: list[dict]) -> None:
    for rank in ranks:
        for opts, why in rank["refused"].items():
            given = json.loads(opts)
            option = "fragment_blocks" if "fragment_blocks" in given else next(iter(given))
            assert "FSDP2 (fully_shard)" in why and f"drop {option}=" in why, why
            assert "DistributedDataParallel" in why, why
        # fragments runs inside FSDP2's units; sizing fragment_blocks needs a copy
        sized = rank["refused"][json.dumps({"fragments": 2, "fragment_blocks": 1})]
        assert "drop fragment_blocks=1" in sized and "copied" in sized, sized
        assert "segments=2" in rank["fit_refused"], rank["fit_refused"]


@pytest.mark.slow  # its fixture runs two processes
def test_checkpoint_holds_less_activation_memory_on_fsdp2(ranks: list[dict]) -> None:
    for rank in ranks:
        bp, ck = rank["memory"]["backprop"], rank["memory"]["checkpoint"]
        assert bp["baseline"] == ck["baseline"] > 0
        assert 0 < ck["forward_end"] < bp["forward_end"] / 2, (ck, bp)
        assert ck["peak"] < bp["peak"], (ck, bp)


@pytest.mark.slow  # its fixture runs two processes
def test_fit_fsdp_trains_with_checkpoint(ranks: list[dict]) -> None:
    for rank in ranks:
        bp, ck = rank["fit"]["backprop"], rank["fit"]["checkpoint"]
        assert set(bp) == set(ck)
        for n in bp:
            assert all(abs(a - b) <= 1e-6 for a, b in zip(ck[n], bp[n], strict=True)), n
    assert ranks[0]["fit"] == ranks[1]["fit"]


def test_wrapped_why_names_the_option_and_the_fix() -> None:
    """Without processes: what each wrapper takes, from the engine's options alone."""
    model: nn.Module = models.mlp(8, 8, 2, 3)
    assert leangrad.engine("checkpoint", segments=2, levels=2).wrapped_why(model, DDP) is None
    assert leangrad.engine("checkpoint", trace=True).wrapped_why(model, FSDP2) is None
    why = leangrad.engine("checkpoint", levels=2).wrapped_why(model, FSDP2)
    assert why is not None and "drop levels=2" in why and "gathered" in why
    why = leangrad.engine("checkpoint", time_chunks=2).wrapped_why(model, FSDP2)
    assert why is not None and "drop time_chunks=2" in why and "copied" in why
    why = leangrad.engine("checkpoint").wrapped_why(model, FSDP1)
    assert why is not None and "fully_shard" in why and "DistributedDataParallel" in why
    plain = nn.Sequential(nn.Linear(4, 4))  # one block: nothing repeats, no fx split needed
    assert leangrad.engine("checkpoint").wrapped_why(plain, FSDP2) is None


def test_fsdp2_refuses_blocks_cut_from_the_fx_graph() -> None:
    class Flat(nn.Module):  # nothing repeats: the blocks would be pieces of an fx copy
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Conv1d(1, 1, 3, padding=1)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.b(self.a(x).unsqueeze(1)).sum()

    why = leangrad.engine("checkpoint").wrapped_why(Flat(), FSDP2)
    assert why is not None and "torch.fx copy" in why and "blocks=[...]" in why, why
