"""The ``rad-peer`` suite's section of ``leangrad report`` (:mod:`._rad_peer`)."""

from __future__ import annotations

from typing import Any

from .._sizes import fmt_bytes

__all__ = ["render_peer"]


def _x(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}×"


def _b(v: int | None) -> str:
    return "—" if v is None else fmt_bytes(v)


def render_peer(records: list[dict[str, Any]]) -> list[str]:
    """The peer table (one block of rows per thread count), then the crossover table."""
    peers = [r for r in records if r.get("kind") == "rad-peer" and not r.get("skipped")]
    skipped = [r for r in records if r.get("kind") == "rad-peer" and r.get("skipped")]
    lines = [
        "MNIST MLP 784-300-300-300-10 on MNIST-5k, one step (forward and backward). *time × "
        "official*: median step time / the official code's, interleaved repeats in one run; "
        "*peak*: tracker; *RSS*: fresh-process peak above its start; *grad MSE*: against "
        "the full-training-set gradient over random batches.",
        "",
        "| threads | method | time × backprop | time × official | peak | × backprop | saved "
        "| RSS | grad MSE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in peers:
        lines.append(
            f"| {r['threads']} | {r['engine']} | {_x(r['time_ratio'])} "
            f"| {_x(r.get('vs_official'))} "
            f"| {_b(r['peak_bytes'])} | {_x(r['peak_ratio'])} | {_b(r['saved_bytes'])} "
            f"| {_b(r.get('rss_peak_bytes'))} | {r['grad_mse']:.4g} |"
        )
    lines += [f"*{r['engine']}: skipped — {r['skipped']}*" for r in skipped]
    cross = [r for r in records if r.get("kind") == "rad-crossover"]
    if cross:
        lines += [
            "",
            "Where RAD's peak (tracker) falls below backprop's: the smallest such batch, "
            "bisected on real MNIST batches; RSS of both at that batch (fresh processes).",
            "",
            "| model | method | peak × backprop at batch | crossover batch | peak × there "
            "| RSS rad / backprop there |",
            "|---|---|---|---|---|---|",
        ]
        for r in cross:
            c = r["crossover_batch"]
            rss = (
                "—"
                if not (r.get("rss_rad_bytes") and r.get("rss_backprop_bytes"))
                else _x(r["rss_rad_bytes"] / r["rss_backprop_bytes"])
            )
            where = f"{c}" if c is not None else f"none ≤ {r['largest_batch']}"
            lines.append(
                f"| {r['config']['model']} | {r['engine']} | {_x(r['peak_ratio_at_batch'])} at "
                f"{r['batch']} | {where} | {_x(r.get('peak_ratio_at_crossover'))} | {rss} |"
            )
    return [*lines, ""]
