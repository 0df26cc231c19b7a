"""The highway-transformer suite: the GPT-2-style HighwayNet against a plain
PyTorch forward, Highway-BP's exactness at k = L − 1 and beyond in float64, and the suite
end to end on a tiny config (records and report). No time is asserted."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from leangrad._errors import OptionError
from leangrad.engines import engine
from leangrad.highway import HighwayNet, PostLNSublayer, PreLNSublayer
from leangrad.measure import compare_grads, grads_of
from leangrad_bench._highway import KIND, STEP_KIND, run_transformer
from leangrad_bench._highway_paper import BAD_NORM, gpt_char_lm, lm_loss
from leangrad_bench._highway_report import render
from leangrad_bench._suites import RunSettings, load_suite

VOCAB, D, LAYERS, HEADS, T, B = 11, 8, 2, 2, 6, 3


def _attention(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Causal multi-head self-attention written out from the block's weights."""
    mha = block.layer.attn
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    b, n, d = x.shape
    h = mha.num_heads

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, n, h, d // h).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(d // h)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    att = scores.masked_fill(future, float("-inf")).softmax(-1) @ heads(v)
    return F.linear(att.transpose(1, 2).reshape(b, n, d), mha.out_proj.weight, mha.out_proj.bias)


def _mlp(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    up, down = block.layer.mlp[0], block.layer.mlp[2]
    return F.linear(F.gelu(F.linear(x, up.weight, up.bias)), down.weight, down.bias)


def _plain_forward(net: HighwayNet, ids: torch.Tensor) -> torch.Tensor:
    """The GPT-2 (pre-LN) / RoBERTa (post-LN) forward with functional PyTorch ops only."""
    stem = net.stem
    x = stem.tokens.weight[ids] + stem.positions.weight[torch.arange(ids.shape[1])]
    for block in net.stacks[0].blocks:
        sub = _attention if block.layer.kind == "attention" else _mlp
        ln = block.ln
        if isinstance(block, PreLNSublayer):
            x = x + sub(block, F.layer_norm(x, (D,), ln.weight, ln.bias, ln.eps))
        else:
            assert isinstance(block, PostLNSublayer)
            x = F.layer_norm(x + sub(block, x), (D,), ln.weight, ln.bias, ln.eps)
    head = net.head
    if isinstance(head, torch.nn.Sequential):  # pre-LN: final LayerNorm, then the linear
        x = F.layer_norm(x, (D,), head[0].weight, head[0].bias, head[0].eps)
        head = head[1]
    return F.linear(x, head.weight, head.bias)


def _tiny(norm: str, gamma: float | None = None) -> HighwayNet:
    torch.manual_seed(0)
    net = gpt_char_lm(VOCAB, d_model=D, layers=LAYERS, heads=HEADS, context=T, norm=norm,
                      gamma=gamma).double()  # fmt: skip
    with torch.no_grad():  # LayerNorm affines away from (1, 0): a real test of their use
        for m in net.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return net


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_forward_equals_a_plain_pytorch_forward(norm: str) -> None:
    net = _tiny(norm)
    blocks = net.stacks[0].blocks
    assert len(blocks) == 2 * LAYERS  # one block per sublayer (the paper's L = 2 x layers)
    assert [b.layer.kind for b in blocks] == ["attention", "mlp"] * LAYERS
    assert all(b.gamma == {"pre": 0.2, "post": 0.8}[norm] for b in blocks)  # the paper's γ
    ids = torch.randint(0, VOCAB, (B, T))
    got = net(ids)
    assert got.shape == (B, T, VOCAB)
    torch.testing.assert_close(got, _plain_forward(net, ids), rtol=0, atol=1e-12)
    # causal: changing the last token changes no earlier position's logits
    other = ids.clone()
    other[:, -1] = (other[:, -1] + 1) % VOCAB
    torch.testing.assert_close(net(other)[:, :-1], got[:, :-1], rtol=0, atol=0)


def _highway_error(net: HighwayNet, k: int, baseline: str = "highway") -> float:
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))
    loss_fn = lm_loss(targets, VOCAB)
    net.zero_grad(set_to_none=True)
    F.cross_entropy(_plain_forward(net, ids).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    exact = grads_of(net)  # autograd through the plain forward: an independent oracle
    net.zero_grad(set_to_none=True)
    engine("highway", k=k, baseline=baseline).backward(net, (ids,), loss_fn)
    return compare_grads(grads_of(net), exact).max_rel_err


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("gamma", [None, 0.0])
def test_highway_is_exact_from_k_equal_l_minus_one(norm: str, gamma: float | None) -> None:
    """Theorem 2: w_i^k is exact for k >= L − i, so every state's gradient is exact at
    k = L − 1 (the engine caps k there) and at k = L; not before, on this model."""
    net = _tiny(norm, gamma)
    blocks = 2 * LAYERS
    for k in (blocks, blocks - 1):
        assert _highway_error(net, k) <= 1e-10, k
        assert _highway_error(net, k, "fpi") <= 1e-10, (k, "fpi")
    assert _highway_error(net, blocks - 2) > 1e-3  # one iteration short is approximate


def test_a_bad_norm_names_both_choices() -> None:
    with pytest.raises(OptionError, match="norm must be 'pre'") as info:
        gpt_char_lm(VOCAB, norm="sandwich")
    assert str(info.value) == BAD_NORM.format(value="sandwich")


def _tiny_suite():  # type: ignore[no-untyped-def]
    suite = load_suite("highway-transformer")
    series = [
        dataclasses.replace(s, quick_values=[1], config={
            **s.config, "d_model": 8, "heads": 2, "context": 8, "batch": 2,
            "corpus_chars": 4000, "eval_batches": 2})
        for s in suite.series if s.name in ("pre-ln-small", "post-ln")
    ]  # fmt: skip
    settings = {**suite.settings, "quick_steps": 3, "quick_eval_every": 2, "quick_repeats": 1,
                "warmup": 0}  # fmt: skip
    return dataclasses.replace(suite, series=series, settings=settings)


@pytest.mark.slow
def test_the_suite_runs_end_to_end_and_its_report_reads_its_records(tmp_path: Path) -> None:
    suite = _tiny_suite()
    recs = run_transformer(suite, RunSettings(quick=True, progress=False, threads=[1, 2]))
    curves = [r for r in recs if r["kind"] == KIND]
    steps = [r for r in recs if r["kind"] == STEP_KIND]
    assert {r["series"] for r in curves} == {"pre-ln-small", "post-ln"}
    small = [r for r in curves if r["series"] == "pre-ln-small"]
    labels = {"backprop", "fpi(k=4)", "highway(k=0)", "highway(k=2)", "highway(k=4)",
              "highway(k=0->4)"}  # fmt: skip
    assert {r["engine"] for r in small} == labels
    assert sorted({r["x"] for r in small}) == [0, 2, 3]  # the initialisation, every 2, last
    for r in curves:
        assert r["val_loss"] > 0 and math.isfinite(r["val_loss"])
        assert r["wall_seconds"] >= 0 and r["config"]["blocks"] == 2
        if r["engine"] == "backprop":
            assert r["grad_cosine"] is None
        else:
            assert -1 <= r["grad_cosine"] <= 1 + 1e-9 and r["grad_max_rel_err"] >= 0
    at0 = {r["engine"]: r["val_loss"] for r in small if r["x"] == 0}
    assert len(set(at0.values())) == 1  # one initialisation for every method
    # 2 blocks: k >= 1 is exact (L − 1 = 1), so those methods train exactly as backprop
    exact = [r for r in small if r["engine"] in ("highway(k=2)", "highway(k=4)")]
    assert all(r["grad_cosine"] > 1 - 1e-5 for r in exact)
    assert {r["engine"] for r in steps if r["series"] == "pre-ln-small"} == labels - {
        "highway(k=0->4)"}  # a schedule has no fixed step time
    for r in steps:
        assert [e["threads"] for e in r["by_threads"]] == [1, 2]
        assert all(e["seconds_median"] > 0 and e["time_ratio"] > 0 for e in r["by_threads"])
        if r["engine"] == "backprop":
            assert [e["time_ratio"] for e in r["by_threads"]] == [1.0, 1.0]
    text = "\n".join(render("highway-transformer", recs, tmp_path, plots=True))
    assert "### pre-ln-small" in text and "### post-ln" in text
    verdict = next(line for line in text.splitlines() if "(the paper's k) is" in line)
    assert verdict.startswith("**highway(k=4) (the paper's k) is ")
    assert "2% of backprop's final validation loss**" in verdict
    header = next(line for line in text.splitlines() if line.startswith("| method |"))
    assert "| step time ratio (1 thr) | step time ratio (2 thr) |" in header
    row = next(line for line in text.splitlines() if line.startswith("| highway(k=4) |"))
    assert row.count("|") == header.count("|")
    pngs = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {f"highway-transformer-pre-ln-small-{t}.png" for t in ("loss", "time", "cosine")} <= pngs
