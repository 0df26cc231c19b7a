"""The engine x {DDP, FSDP2} x {whole step, per-layer} matrix, for the closing
note. Runs the matrix of tests/train/test_parallel_matrix.py (the same code: 2 local gloo
processes, one CPU thread each, every exact engine that applies trained 3 float64 SGD steps
per setting at batch 16 per process, against one process on the combined batch of 32) and
writes its table: max |delta| of the final weights over both ranks, or the refusal.

Run: .venv/bin/python results/distributed/matrix.py [--out results/distributed/matrix.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "train")]

import test_parallel_matrix as matrix  # noqa: E402  (after the path above)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(Path(__file__).with_name("matrix.md")))
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        rows, skipped = matrix.run_matrix(Path(work))
    failed = [r for r in rows if r.problem is not None]
    ran = sum(r.delta is not None for r in rows)
    refused = sum(r.refused is not None for r in rows)
    head = [
        "# Engines x {DDP, FSDP2} x {whole step, per-layer}",
        "",
        f"2 local processes (gloo, CPU, 1 thread each; torch {torch.__version__}). Each cell: "
        f"`leangrad.train.fit` for {matrix.FIT['max_steps']} steps in float64 "
        f"(SGD, lr {matrix.FIT['lr']}), batch {matrix.BATCH} per process, on digits; "
        f"compared with one process on the combined batch of {2 * matrix.BATCH}. Result: "
        "the largest |difference| of any final weight on either rank (measured, full tensors; "
        f"must be <= {matrix.TOLERANCE:g}), or the refusal, which must name the engine and a fix.",
        "Models: `mlp` = models.mlp(64, 16, 2, 10); `revnet` = models.revnet(1, channels=4, "
        "blocks=2), for the engines that need an invertible Chain. Estimators (rad, highway, "
        "projforward) are left out: each rank draws its own samples, so 2 processes do not "
        "equal one by design.",
        "",
        f"{len(rows)} cells: {ran} trained equal to one process, {refused} refused, "
        f"{len(failed)} failed.",
        "",
        "",
    ]
    text = "\n".join(head) + matrix.table(rows, skipped) + "\n"
    Path(args.out).write_text(text)
    print(text)
    if failed:
        sys.exit(f"{len(failed)} cell(s) failed; see {args.out}")


if __name__ == "__main__":
    main()
