"""The user's model as written: block discovery (``leangrad.blocks``), checkpointing a
class-based model with no rewrite, and every engine that claims to take any module, on a
class-based ResNet and GPT (``leangrad.zoo``). float64, exact engines to 1e-10."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import leangrad
from leangrad import _errors as E
from leangrad import zoo
from leangrad.engines._blocks import NESTED_BLOCKS, NO_BLOCKS, UNKNOWN_BLOCK
from leangrad.engines.checkpoint._engine import SEGMENTS_NEED_SEQUENCE
from leangrad.measure import MemoryTracker

TOL = 1e-10


def _resnet():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = zoo.resnet(18, width=4, in_channels=3, classes=5).double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    y = torch.randint(0, 5, (4,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _gpt():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = zoo.gpt(vocab=11, dim=8, layers=3, heads=2, context=12).double()
    idx = torch.randint(0, 11, (3, 12))
    tgt = torch.randint(0, 11, (3, 12))
    return model, idx, lambda out: zoo.GPT.loss(out, tgt)


MODELS = {"resnet": _resnet, "gpt": _gpt}


def test_blocks_of_a_resnet_are_its_residual_blocks() -> None:
    model, _, _ = _resnet()
    found = leangrad.blocks(model)
    assert found.names == tuple(f"stages.{s}.{b}" for s in range(4) for b in range(2))
    assert not found.sequential
    assert "'stages.0': 2 x BasicBlock" in found.how
    assert "stages.3.1" in str(found) and "BasicBlock" in str(found)


def test_blocks_of_a_gpt_are_its_transformer_layers() -> None:
    model, _, _ = _gpt()
    found = leangrad.blocks(model)
    assert found.names == ("blocks.0", "blocks.1", "blocks.2")
    assert found.how == "repeated children of 'blocks': 3 x GPTBlock"


def test_blocks_of_a_sequential_are_its_children() -> None:
    model = leangrad.models.mlp(3, 4, 3, 2)
    found = leangrad.blocks(model)
    assert found.sequential and found.names == ("0", "1", "2", "3")


def test_blocks_given_by_name() -> None:
    model, _, _ = _gpt()
    found = leangrad.blocks(model, names=["blocks"])  # a ModuleList stands for its children
    assert found.names == ("blocks.0", "blocks.1", "blocks.2")
    assert leangrad.blocks(model, names=["ln_f", "blocks.1"]).names == ("ln_f", "blocks.1")


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["nosuch"], UNKNOWN_BLOCK.format(name="nosuch", model="GPT",
                                          known="tok, blocks, ln_f, head")),
        (["blocks.0", "blocks.0.mlp"], NESTED_BLOCKS.format(inner="blocks.0.mlp",
                                                            outer="blocks.0")),
    ],
)  # fmt: skip
def test_bad_block_names(names: list[str], message: str) -> None:
    model, _, _ = _gpt()
    with pytest.raises(E.EngineInputError, match=re.escape(message)):
        leangrad.blocks(model, names=names)


def test_no_repeated_blocks_names_the_fix() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    with pytest.raises(E.EngineInputError, match=re.escape(NO_BLOCKS.format(model="Two"))):
        leangrad.blocks(Two())


def test_segments_on_a_model_run_as_written_is_refused() -> None:
    model, x, loss_fn = _gpt()
    with pytest.raises(E.EngineInputError, match=re.escape(SEGMENTS_NEED_SEQUENCE.split("{")[0])):
        leangrad.engine("checkpoint", segments=2).backward(model, x, loss_fn)


# Every engine that claims to take any module, on both class-based models.
ANY_MODULE = [
    ("backprop", {}), ("checkpoint", {}), ("checkpoint", {"blocks": ["blocks.1"]}),
    ("forward", {"chunk_size": 64}), ("projforward", {"samples": 2, "seed": 0}),
    ("fad", {}), ("rad", {"fraction": 1.0, "seed": 0}), ("rad", {"fraction": 0.3, "seed": 0}),
    ("checkpoint+fad", {}), ("checkpoint+rad", {"fraction": 1.0, "seed": 0}),
    ("bits", {}), ("checkpoint+bits", {}), ("checkpoint", {"segments": None}),
]  # fmt: skip


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize(("name", "opts"), ANY_MODULE)
def test_engines_take_class_based_models_as_written(
    name: str, opts: dict[str, object], kind: str
) -> None:
    model, x, loss_fn = MODELS[kind]()
    if kind == "resnet" and opts.get("blocks"):
        opts = {"blocks": ["stages.1.0"]}
    if name == "forward" and kind == "resnet":
        pytest.skip("one jvp per parameter: the ResNet's 180k parameters take minutes")
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    eng = leangrad.engine(name, **opts)
    eng.backward(model, x, loss_fn)
    exact = eng.exact or opts.get("fraction") == 1.0
    for (n, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (r.grad is None), n
        if exact and r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, rtol=TOL, atol=TOL, msg=n)
    for (n, b), r in zip(model.named_buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, r, rtol=1e-12, atol=1e-14, msg=n)  # BatchNorm once


class _MaskedBlock(nn.Module):
    """A block called with a keyword argument, as attention blocks often are."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * mask


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MaskedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x > -1).to(x.dtype)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x


def test_checkpointed_blocks_take_keyword_arguments() -> None:
    torch.manual_seed(0)
    model = _Masked().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ref(x).square().mean().backward()
    leangrad.engine("checkpoint").backward(model, x, lambda out: out.square().mean())
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=TOL, atol=TOL)


def _peak(step) -> int:  # type: ignore[no-untyped-def]
    with MemoryTracker() as tracker:
        step()
    return tracker.report.peak_bytes


def test_checkpointing_a_class_based_gpt_keeps_less_than_backprop() -> None:
    """Behaviour, by bytes: per-block checkpointing of the model as written keeps only the
    blocks' inputs, and equals torch.utils.checkpoint applied by hand to every block."""
    torch.manual_seed(0)
    model = zoo.gpt(vocab=50, dim=32, layers=6, heads=4, context=64)
    idx = torch.randint(0, 50, (4, 64))
    tgt = torch.randint(0, 50, (4, 64))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return zoo.GPT.loss(out, tgt)

    def by_hand() -> None:
        x = model.tok(idx) + model.pos[:64]
        for i, block in enumerate(model.blocks):
            last = i == len(model.blocks) - 1
            x = block(x) if last else torch_checkpoint(block, x, use_reentrant=False)
        loss_fn(model.head(model.ln_f(x))).backward()

    plain = _peak(lambda: loss_fn(model(idx)).backward())
    eng = leangrad.engine("checkpoint")
    eng.backward(model, idx, loss_fn)  # the wrapped copy is made once, outside the tracker
    ours = _peak(lambda: eng.backward(model, idx, loss_fn))
    hand = _peak(by_hand)
    assert ours < 0.6 * plain, (ours, plain)
    assert ours <= hand * 1.02, (ours, hand)


def test_blocks_suite_runs_side_by_side_and_renders(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The suite's records (a tiny size): every method, the same gradient, and leangrad's
    peak no higher than torch.utils.checkpoint around each block by hand."""
    import json

    from leangrad_bench import run_suite
    from leangrad_bench._blocks import render

    suite = tmp_path / "tiny-blocks.toml"
    suite.write_text(
        'runner = "leangrad_bench._blocks:run_blocks"\n'
        'report = "leangrad_bench._blocks:render"\n'
        "[settings]\nrepeats = 1\nsegments = [2]\n"
        "[settings.models]\n"
        "resnet = { depth = 10, width = 4, image = 8, batch = 2 }\n"
        "gpt = { vocab = 16, dim = 8, layers = 3, heads = 2, context = 8, batch = 2 }\n"
    )
    path = run_suite(str(suite), out=tmp_path, quick=True, progress=False)
    records = json.loads(path.read_text())
    for model in ("resnet", "gpt"):
        rs = {r["engine"]: r for r in records if r["series"] == model}
        assert set(rs) == {"backprop", "leangrad checkpoint", "torch per-block",
                           "checkpoint_sequential(2)"}  # fmt: skip
        # + the copy of BatchNorm statistics that keeps them advancing once (~1 KiB here)
        assert rs["leangrad checkpoint"]["peak_bytes"] <= rs["torch per-block"]["peak_bytes"] + 2048
        assert all(r["grad_max_rel_err"] <= 1e-5 for r in rs.values())
    text = "\n".join(render("tiny-blocks", records, tmp_path))
    assert "| leangrad checkpoint |" in text and "### gpt (3 blocks)" in text


class _Embed(nn.Module):
    def __init__(self, model: zoo.GPT) -> None:
        super().__init__()
        self.tok, self.pos = model.tok, model.pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


def _sequential_gpt() -> tuple[nn.Sequential, torch.Tensor, object]:
    """The GPT's top-level modules as one nn.Sequential: blocks of very unequal size."""
    torch.manual_seed(0)
    g = zoo.gpt(vocab=40, dim=16, layers=5, heads=2, context=32)
    model = nn.Sequential(_Embed(g), *g.blocks, g.ln_f, g.head)
    idx = torch.randint(0, 40, (4, 32))
    tgt = torch.randint(0, 40, (4, 32))
    return model, idx, lambda out: zoo.GPT.loss(out, tgt)


def test_auto_segments_from_measured_sizes_beat_every_equal_split() -> None:
    """segments='auto' estimates each block's input and saved bytes and places the
    boundaries; its tracked peak is no higher than checkpointing with any equal split
    (checkpoint_sequential's), with the same gradient and BatchNorm-free state unchanged."""
    model, idx, loss_fn = _sequential_gpt()
    ref = copy.deepcopy(model)
    loss_fn(ref(idx)).backward()

    def peak(eng: leangrad.Engine) -> int:
        model.zero_grad(set_to_none=True)
        eng.backward(model, idx, loss_fn)  # warm-up: the measuring forward runs here
        model.zero_grad(set_to_none=True)
        return _peak(lambda: eng.backward(model, idx, loss_fn))

    n = len(model)
    equal = {s: peak(leangrad.engine("checkpoint", segments=s)) for s in range(1, n + 1)}
    auto_eng = leangrad.engine("checkpoint", segments="auto")
    auto = peak(auto_eng)
    assert auto <= 1.02 * min(equal.values()), (auto, equal)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_block_sizes_leave_rng_and_statistics_alone() -> None:
    from leangrad.engines.checkpoint._segments import auto_segments, block_sizes, estimate

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)),
              nn.Linear(8, 8), nn.Tanh()]  # fmt: skip
    x = torch.randn(6, 4)
    rng = torch.get_rng_state()
    stats = blocks[0][1].running_mean.clone()
    a, s = block_sizes(blocks, (x,))
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(blocks[0][1].running_mean, stats)
    assert a[0] == x.numel() * 4 and all(v > 0 for v in s)
    groups = auto_segments(a, s)
    assert [i for g in groups for i in g] == list(range(3))  # a partition, in order
    assert estimate(groups, a, s) <= min(estimate([range(0, 3)], a, s),
                                         estimate([range(i, i + 1) for i in range(3)], a, s))


def test_block_sizes_on_fake_tensors_equal_the_real_ones() -> None:
    """A step estimated on fake tensors sizes blocks as the real step does: fake tensors'
    ``data_ptr()`` is 0 for all of them, and sizing keyed by it counted one tensor and
    called the rest seen; so ``checkpoint(segments='auto')``'s estimate (which places the
    boundaries from these sizes) equals its tracked peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leangrad.engines.checkpoint._segments import block_sizes
    from leangrad.measure import estimate_step, profile_step

    model, idx, loss_fn = _sequential_gpt()
    real = block_sizes(list(model), (idx,))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = {id(t): nn.Parameter(mode.from_tensor(t)) for t in model.parameters()}
    fake_model = copy.deepcopy(model, memo)
    with mode:
        fake = block_sizes(list(fake_model), (mode.from_tensor(idx),))
    assert fake == real and all(v > 0 for v in real[1])
    eng = leangrad.engine("checkpoint", segments="auto")
    est = estimate_step(eng, model, idx, loss_fn)
    got = profile_step(leangrad.engine("checkpoint", segments="auto"), model, idx, loss_fn,
                       repeats=0)  # fmt: skip
    assert est.peak_bytes == got.peak_bytes


ZOO = {
    "resnet": lambda: zoo.resnet(10, width=4),
    "gpt": lambda: zoo.gpt(vocab=16, dim=8, layers=2, heads=2, context=8),
    "bert": lambda: zoo.bert(vocab=16, dim=8, layers=2, heads=2, context=8, classes=3),
    "lstm_lm": lambda: zoo.rnn_lm("lstm", vocab=16, embed=6, hidden=8),
    "gru_lm": lambda: zoo.rnn_lm("gru", vocab=16, embed=6, hidden=8),
    "highway_gru_lm": lambda: zoo.highway_gru_lm(vocab=16, embed=6, hidden=8),
    "vit": lambda: zoo.vit(image=8, patch=4, dim=8, layers=2, heads=2),
    "llama": lambda: zoo.llama(vocab=16, dim=8, layers=2, heads=2, context=8),
    "unet": lambda: zoo.unet(image=8, widths=(4, 8), groups=2, attention_at=(8,), head_dim=4),
    "gpt_50k": lambda: zoo.gpt(vocab=50257, dim=8, layers=2, heads=2, context=8),
}


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_zoo_models_run_offline_and_checkpoint_exactly(name: str) -> None:
    """Every zoo model, with its offline batch: backprop runs, and where blocks repeat,
    checkpointing them as written gives autograd's gradient (float64)."""
    torch.manual_seed(0)
    model = ZOO[name]().double()
    x, loss_fn = zoo.batch(name, model, 3, length=8, image=8)
    x = x.double() if x.is_floating_point() else x
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    eng = leangrad.engine("highway", k=10) if name == "highway_gru_lm" else leangrad.engine(
        "checkpoint")  # fmt: skip
    if eng.supports(model) is not None:
        assert name in ("lstm_lm", "gru_lm")  # one fused nn.LSTM/nn.GRU: no repeated blocks
        eng = leangrad.engine("backprop")
    eng.backward(model, x, loss_fn)
    for (n, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-9, atol=1e-10, msg=n)


def test_highway_gru_lm_is_the_gru_lm_with_leangrads_layers() -> None:
    """Same weights -> same logits as the fused nn.GRU model (what changed is only how)."""
    torch.manual_seed(0)
    plain = zoo.rnn_lm("gru", vocab=16, embed=6, hidden=8, layers=2).double()
    hw = zoo.highway_gru_lm(vocab=16, embed=6, hidden=8, layers=2).double()
    with torch.no_grad():
        hw.stem.embed.weight.copy_(plain.embed.weight)
        for i, layer in enumerate(hw.stacks):
            for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(layer, w).copy_(getattr(plain.rnn, f"{w}_l{i}"))
        hw.head.lin.weight.copy_(plain.head.weight)
        hw.head.lin.bias.copy_(plain.head.bias)
    idx = torch.randint(0, 16, (3, 7))
    torch.testing.assert_close(hw(idx), plain(idx), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("model", "data", "engine"),
    [("factories:resnet", ["--data", "synthetic", "--data-opt", "shape=3,8,8"], "checkpoint"),
     ("factories:resnet", ["--data", "synthetic", "--data-opt", "shape=3,8,8"],
      "checkpoint+bits"),
     ("factories:gpt", ["--data", "text", "--data-opt", "length=16"], "checkpoint+fad"),
     ("factories:gpt", ["--data", "text", "--data-opt", "length=16"], "fad")],
)  # fmt: skip
def test_cli_trains_a_class_based_model_from_a_factory(
    model: str, data: list[str], engine: str, tmp_path, capsys  # type: ignore[no-untyped-def]
) -> None:
    """The custom-model path of docs/training.md: ``--model package.module:factory`` with
    ``input_shape``/``num_classes`` passed by keyword, synthetic images from
    ``--data-opt shape=C,H,W``, text windows — trained as written by engines that take
    any module."""
    from leangrad.cli import main

    code = main(["train", "--model", model, *data, "--engine", engine, "--max-steps", "2",
                 "--batch-size", "4", "--no-plots", "--no-progress", "--out",
                 str(tmp_path / "run")])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "max_steps: 2 steps" in out.out


class _PlainNet(nn.Module):
    """A model whose module tree repeats nothing: six different Linear attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.d, self.e, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) + h  # a skip: no cut inside it
        h = torch.tanh(self.c(h))
        h = torch.tanh(self.d(h)) * 2
        return self.out(F.gelu(self.e(h)))


def test_where_the_tree_repeats_nothing_the_fx_graph_is_cut_at_articulation_points() -> None:
    torch.manual_seed(0)
    model = _PlainNet().double()
    found = leangrad.blocks(model)
    assert found.how.startswith("torch.fx graph cut at") and "articulation point" in found.how
    assert len(found) >= 2 and found.runner is not None
    x, y = torch.randn(512, 16, dtype=torch.float64), torch.randint(0, 3, (512,))
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    leangrad.engine("checkpoint").backward(model, x, loss_fn)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=1e-12)
    plain = leangrad.measure.profile_step(leangrad.engine("backprop"), model, x, loss_fn,
                                          repeats=0)  # fmt: skip
    ours = leangrad.measure.profile_step(leangrad.engine("checkpoint"), model, x, loss_fn,
                                         repeats=0)  # fmt: skip
    assert ours.peak_bytes < 0.8 * plain.peak_bytes
    # the split runs the model's own modules: a hook on any of them is refused
    model.c.register_forward_hook(lambda *_: None)
    with pytest.raises(E.EngineInputError, match="forward hook"):
        leangrad.engine("checkpoint").backward(model, x, loss_fn)


class _Stage(nn.Module):
    """A stage as timm writes ConvNeXt's and Swin's: a downsample and an ``nn.Sequential``
    of blocks, in a class of its own."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim))
        self.blocks = nn.Sequential(*(_Block(dim) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stages = nn.Sequential(_Stage(8, 2), _Stage(8, 3))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def test_blocks_are_found_at_the_finest_repeated_level_through_sequential_stages() -> None:
    """ConvNeXt's and Swin's stages hold their blocks in an ``nn.Sequential``: the blocks
    are the units (5 here), not the stages (2), and a Sequential inside a block (its MLP's
    layers) is no stage."""
    found = leangrad.blocks(_Staged())
    assert found.names == ("stages.0.blocks.0", "stages.0.blocks.1", "stages.1.blocks.0",
                           "stages.1.blocks.1", "stages.1.blocks.2")  # fmt: skip


def test_blocks_given_as_a_sequential_expand_to_its_children() -> None:
    found = leangrad.blocks(_Staged(), names=["stages.0.blocks", "stages.1.blocks"])
    assert len(found) == 5 and found.names[0] == "stages.0.blocks.0"
    torch.manual_seed(0)
    model = _Staged().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ref(x).square().mean().backward()
    leangrad.engine("checkpoint", blocks=["stages.0.blocks", "stages.1.blocks"]).backward(
        model, x, lambda out: out.square().mean())  # fmt: skip
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=0, msg=n)
