"""The without-replacement sampler of ``"different"`` mode: each row a uniform k-subset, and
every first and second moment of the keep pattern that of independent per-row samples."""

from __future__ import annotations

import math

import torch

from leangrad.rad import SampleSpec


def _keep_patterns(d: int, k: int, rows: int, draws: int) -> torch.Tensor:
    spec = SampleSpec(k / d, "different")
    assert spec.kept(d) == k
    out = torch.zeros(draws, rows, d)
    for s in range(draws):
        idx = spec._indices(rows, d, k, seed=s, device=torch.device("cpu"))
        assert idx.shape == (rows, k)
        assert all(len(set(r.tolist())) == k for r in idx)  # k distinct per row
        out[s].scatter_(1, idx, 1.0)
    return out


def test_keep_pattern_moments_equal_independent_rows() -> None:
    d, k, rows, draws = 6, 2, 3, 6000
    keep = _keep_patterns(d, k, rows, draws)
    p1 = k / d
    p_same_row = k * (k - 1) / (d * (d - 1))

    def close(got: float, want: float) -> bool:  # 5 standard errors of a proportion
        return abs(got - want) <= 5 * math.sqrt(want * (1 - want) / draws)

    means = keep.mean(0)
    assert all(close(float(m), p1) for m in means.flatten())
    for b in range(rows):
        for c in range(rows):
            joint = torch.einsum("si,sj->ij", keep[:, b], keep[:, c]) / draws
            for i in range(d):
                for j in range(d):
                    # different rows: kept independently, even the same feature
                    want = (p1 if i == j else p_same_row) if b == c else p1 * p1
                    assert close(float(joint[i, j]), want), (b, c, i, j, float(joint[i, j]))


def test_weight_grad_matches_the_dense_rebuild() -> None:
    """The blocked scatter-and-GEMM weight gradient equals gᵀ x̂ with x̂ rebuilt densely
    (float64, several block boundaries: rows beyond one block)."""
    torch.manual_seed(0)
    rows, d, out = 70, 700, 5  # _BLOCK // d = 23 rows per block: 4 blocks, the last partial
    for replace in (False, True):
        spec = SampleSpec(0.1, "different", replace)
        x = torch.randn(rows, 1, d, dtype=torch.float64)
        g = torch.randn(rows, out, dtype=torch.float64)
        kept = spec.compress(x, seed=11)
        x_hat = spec.expand(kept, d, seed=11).reshape(rows, d)
        got = spec.weight_grad(g, kept, d, seed=11)
        torch.testing.assert_close(got, g.T @ x_hat, rtol=1e-12, atol=1e-12)
