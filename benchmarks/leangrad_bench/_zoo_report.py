"""The ``zoo`` suite's section of ``leangrad report``, and the results page's opening
table (``docs/results.md``, :func:`headline_table`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leangrad import _errors as errors

from ._report import fmt, load_records

__all__ = [
    "LEANGRAD_SIDES",
    "NO_WINS",
    "NO_ZOO",
    "PYTORCH_SIDES",
    "best_within",
    "headline_table",
    "largest_batch",
    "render",
    "wins_table",
    "zoo_headline",
]

NO_ZOO = (
    "{directory} has no zoo suite results (zoo.json); run `leangrad bench zoo --out {directory}`"
)

LEANGRAD_SIDES = ("leangrad", "plan")
PYTORCH_SIDES = ("pytorch", "compile")
_ORDER = {"reference": 0, "leangrad": 1, "plan": 2, "pytorch": 3, "compile": 4}


def _measured(r: dict[str, Any]) -> bool:
    return not r.get("skipped") and not r.get("failed") and r.get("peak_ratio") is not None


def _exact_rows(records: list[dict[str, Any]], series: str,
                sides: Sequence[str]) -> list[dict[str, Any]]:  # fmt: skip
    """The exact, measured (not estimated) records of ``series`` from ``sides``."""
    return [r for r in records
            if r["series"] == series and r.get("side") in sides and not r.get("estimate")
            and _measured(r) and r.get("exact")]  # fmt: skip


def best_within(
    records: list[dict[str, Any]], series: str, sides: Sequence[str], fraction: float
) -> dict[str, Any] | None:
    """The fastest exact, measured (not estimated) record of ``series`` from ``sides`` whose
    peak is at most ``fraction`` × backprop's (tracker peaks; RSS for torch.compile, whose
    ratio is to eager backprop's RSS in the same process); ``None`` if none is."""
    fit = [r for r in _exact_rows(records, series, sides)
           if r.get("time_ratio") is not None and r["peak_ratio"] <= fraction]  # fmt: skip
    return min(fit, key=lambda r: r["time_ratio"]) if fit else None


def largest_batch(
    records: list[dict[str, Any]], series: str, sides: Sequence[str]
) -> dict[str, Any] | None:
    """The exact, measured (not estimated) record of ``series`` from ``sides`` that reaches
    the largest ``max_batch`` — the largest batch whose step fits backprop's total
    (parameters, inputs and peak) at the base batch — a capped search before an uncapped
    one of the same batch, then the fastest; ``None`` if no such record has a max batch
    (torch.compile's is not searched: each batch size compiles again)."""
    fit = [r for r in _exact_rows(records, series, sides) if isinstance(r.get("max_batch"), int)]
    if not fit:
        return None
    return max(
        fit,
        key=lambda r: (
            r["max_batch"],
            bool(r.get("max_batch_capped")),
            -(r.get("time_ratio") or math.inf),
        ),
    )


def _how(r: dict[str, Any]) -> str:
    """The method, with a plan's choice; a list of named blocks is shown by its length
    (``checkpoint(blocks=[9 named])``): the names are in the JSON and the per-model table."""
    if not r.get("choice"):
        return str(r["engine"])
    choice = re.sub(
        r"blocks=\[([^\]]*)\]", lambda m: f"blocks=[{m.group(1).count(',') + 1} named]", r["choice"]
    )
    return f"{r['engine']} → {choice}"


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "nothing fits | —"
    return f"{_how(r)} ({r['peak_ratio']:.2f}×) | {r['time_ratio']:.2f}×"


def _batch_cell(r: dict[str, Any] | None) -> str:
    """``96 (method)``; ``≥128`` where the search stopped at its cap, ``40–47`` where it
    bracketed the boundary; ``—`` for none."""
    return "—" if r is None else f"{_batch_range(r)} ({_how(r)})"


def _batch_range(r: dict[str, Any]) -> str:
    """A record's max batch: ``≥128`` where the search stopped at its cap, ``40–47`` where
    a search to within 1/relative bracketed the boundary, else the batch."""
    b, fails = r["max_batch"], r.get("max_batch_fails")
    if r.get("max_batch_capped"):
        return f"≥{b}"
    if r.get("max_batch_relative") and fails is not None and fails - 1 > b:
        return f"{b}–{fails - 1}"
    return str(b)


def headline_table(
    records: list[dict[str, Any]], *, fractions: Sequence[float] = (0.5, 0.25)
) -> str:
    """Per model, the fastest exact leangrad option whose peak is at most 0.5×, 0.25× and 0.125×
    backprop's, beside the fastest exact PyTorch-only option at the same bound (per-block,
    selective or sequential checkpointing, time chunks, gradient accumulation alone or with
    checkpointing, torch.compile), each with its peak and time as ratios to backprop's
    (accumulation's time: all its micro-batches, one step of the whole batch). bf16
    autocast and estimators (rad, projforward, highway below k = L − 1) are not exact and
    not candidates; estimate rows are left out.

    Then backprop's batch and the largest batch any exact leangrad option reaches within
    backprop's memory at that batch, beside the largest any exact PyTorch-only option
    reaches (:func:`largest_batch`), each with the option (``≥N``: the search stopped at
    its cap, so the option reaches at least ``N``).

    The results page's opening table (``docs/results.md``) is ``leangrad report results
    --headline`` (:func:`zoo_headline`).

    Args:
        records: the ``zoo`` suite's records (``results/zoo.json``).
        fractions: the bounds, as fractions of backprop's peak.

    Returns:
        A Markdown table, one row per measured model.
    """
    head = "| model | backprop peak |"
    rule = "|---|---|"
    for f in fractions:
        head += f" ≤ {f}×: leangrad (peak) | time | PyTorch (peak) | time |"
        rule += "---|---|---|---|"
    head += (
        " backprop batch | max batch in backprop's memory: leangrad (option) | PyTorch (option) |"
    )
    rule += "---|---|---|"
    lines = [head, rule]
    for series in dict.fromkeys(r["series"] for r in records if not r.get("estimate")):
        bp = next(
            (
                r
                for r in records
                if r["series"] == series and r["engine"] == "backprop" and _measured(r)
            ),
            None,
        )
        row = f"| {series} | {fmt(bp['peak_bytes'], 'gib') if bp else '—'} |"
        for f in fractions:
            row += (
                f" {_cell(best_within(records, series, LEANGRAD_SIDES, f))} |"
                f" {_cell(best_within(records, series, PYTORCH_SIDES, f))} |"
            )
        base = bp.get("base_batch", bp.get("max_batch")) if bp else None
        row += (
            f" {'—' if base is None else base} |"
            f" {_batch_cell(largest_batch(records, series, LEANGRAD_SIDES))} |"
            f" {_batch_cell(largest_batch(records, series, PYTORCH_SIDES))} |"
        )
        lines.append(row)
    return "\n".join(lines)


def zoo_headline(directory: str | Path) -> str:
    """:func:`headline_table` of ``directory/zoo.json``, headed by what was run (quick or
    full sizes, machine, date) — the tables of the results page, ``docs/results.md``.

    Raises:
        LeangradError: the directory has no zoo records.
    """
    records = load_records(Path(directory)).get("zoo")
    if not records:
        raise errors.LeangradError(NO_ZOO.format(directory=directory))
    measured = [r for r in records if not r.get("estimate")]
    sizes = "--quick sizes" if all(r.get("quick") for r in measured) else "full sizes"
    machine = measured[0].get("machine") or {}
    cpu = f"{machine.get('cpu_count', '?')}-core {machine.get('processor', 'CPU')}"
    dates = sorted({str(r.get("created", ""))[:10] for r in measured})
    return (
        f"`leangrad bench zoo` ({sizes}; {cpu}, {machine.get('torch', 'torch')}, "
        f"1 thread; {', '.join(dates)})\n\n"
        f"{headline_table(records, fractions=planned_fractions(records))}"
    )


def planned_fractions(records: list[dict[str, Any]]) -> tuple[float, ...]:
    """The bounds the run planned at (its ``plan(≤f×)`` rows), largest first; 0.5 and 0.25
    where it planned at none."""
    found = {float(m.group(1)) for r in records
             if (m := re.fullmatch(r"plan\(≤([0-9.]+)×\)", str(r.get("engine", ""))))}  # fmt: skip
    return tuple(sorted(found, reverse=True)) or (0.5, 0.25)


def render(
    suite: str, records: list[dict[str, Any]], directory: Any, *, plots: bool = True
) -> list[str]:
    """Markdown section of ``leangrad report`` for the ``zoo`` suite: the headline table, a
    table per model, what was skipped or failed and why, and the fake-tensor estimates."""
    del suite, directory, plots
    lines = [
        "Every way to compute one step's gradients (no optimizer) on zoo models written the "
        "ordinary way. Peak: tracker, above parameters and inputs, `.grad` allocated by the "
        "step (torch.compile: fresh-process RSS, × eager backprop's RSS in its process). "
        "Kept: live when the forward phase ended. RSS: fresh-process peak above the RSS "
        "before the step. Time: medians of interleaved repeats, 1 thread, × backprop, for one "
        "step of the whole batch (accumulate rows: all k micro-batches; their kept bytes: "
        "at the end of the first micro-batch's forward). Error "
        "and cosine: float32 gradient vs backprop's. Max batch: the largest batch whose step "
        "fits backprop's total (parameters, inputs and peak) at the base batch.",
        "",
        "Fastest exact option within a fraction of backprop's peak:",
        "",
        headline_table(records, fractions=planned_fractions(records)),
        "",
    ]
    for series in dict.fromkeys(r["series"] for r in records):
        rs = [r for r in records if r["series"] == series]
        lines += _model_table(series, rs)
    return lines


def _short(why: str, most: int = 240) -> str:
    """A reason on one line, cut at ``most`` characters (the JSON keeps it whole)."""
    why = " ".join(why.split())
    return why if len(why) <= most else why[: most - 1] + "…"


def _batch(r: dict[str, Any]) -> str:
    if r.get("max_batch") is None:
        return "—"
    how = {"estimate": "est.", "tracker": "tracker"}.get(r.get("max_batch_method") or "", "")
    return f"{_batch_range(r)} ({how})"


def _model_table(series: str, rs: list[dict[str, Any]]) -> list[str]:
    est = bool(rs[0].get("estimate"))
    cfg = {k: v for k, v in rs[0]["config"].items() if k not in ("dtype", "threads", "step")}
    changed = cfg.pop("changed", None)
    lines = [f"### {series}", "", f"`{cfg}`" + (f" — {changed}" if changed else ""), ""]
    if est:
        lines += [
            "Fake-tensor estimates only (nothing allocated, nothing timed). Last column: "
            "estimate / tracker for the same method at the measured size.",
            "",
        ]
    lines += [
        "| method | side | exact | peak | × backprop | kept | RSS | time × | grad err "
        "| cosine | max batch | est./tracker |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = sorted(
        (r for r in rs if _measured(r)), key=lambda r: (_ORDER.get(r["side"], 9), r["peak_ratio"])
    )
    for r in ok:
        how = f"{r['engine']} → {r['choice']}" if r.get("choice") else r["engine"]
        check = r.get("estimate_vs_tracker_at_measured_size", r.get("estimate_vs_tracker"))
        lines.append(
            f"| {how} | {r['side']} | {'yes' if r.get('exact') else 'no'} "
            f"| {fmt(r.get('peak_bytes'), 'gib')} | {r['peak_ratio']:.3f} "
            f"| {fmt(r.get('kept_bytes'), 'gib')} | {fmt(r.get('rss_peak_bytes'), 'gib')} "
            f"| {fmt(r.get('time_ratio'), '.2f')} | {fmt(r.get('grad_max_rel_err'), '.1e')} "
            f"| {fmt(r.get('grad_cosine'), '.6f')} | {_batch(r)} | {fmt(check, '.3f')} |"
        )
    lines.append("")
    for key, title in (("failed", "Failed"), ("skipped", "Skipped")):
        bad = [r for r in rs if r.get(key)]
        if bad:
            lines += [f"{title}:", ""]
            by_reason: dict[str, list[str]] = {}
            for r in bad:
                by_reason.setdefault(str(r[key]), []).append(r["engine"])
            lines += [f"- {', '.join(names)}: {_short(why)}" for why, names in by_reason.items()]
            lines.append("")
    compiled = [r for r in rs if r.get("compile_seconds") is not None]
    if compiled:
        lines += [
            "torch.compile's first step (compile) took "
            + ", ".join(f"{r['compile_seconds']:.1f} s ({r['engine']})" for r in compiled)
            + ".",
            "",
        ]
    return lines


WIN_MODELS: tuple[tuple[str, str, str], ...] = (
    ("zoo.json", "gpt_50k", "GPT at GPT-2's vocabulary, 50,257 (`gpt_50k`, quick)"),
    ("zoo.json", "llama", "Llama, vocabulary 32,000 (`llama`, quick)"),
    ("zoo.json", "resnet", "ResNet-18 with BatchNorm (`resnet`, quick)"),
    ("full/zoo.json", "resnet", "ResNet-18 with BatchNorm (`resnet`, full size)"),
    ("model-corpus-zoo.json", "timm_convnext_tiny",
     "timm ConvNeXt-T (`timm_convnext_tiny`, 224², batch 10)"),
)  # fmt: skip
"""The README's "where it wins" rows: (file under the results directory, model, label)."""
NO_WINS = "{directory}: none of the files behind the README's wins table ({files}) is there"


def _lowest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row with the lowest peak (the faster of equal peaks); ``None`` for none."""
    return min(rows, key=lambda r: (r["peak_ratio"], r["time_ratio"])) if rows else None


def _zoo_sides(records: list[dict[str, Any]], model: str) -> tuple[Any, Any, Any]:
    """backprop's record and each side's lowest exact, measured, timed record."""
    bp = next((r for r in records if r["series"] == model and r["engine"] == "backprop"
               and _measured(r)), None)  # fmt: skip

    def side(sides: Sequence[str]) -> dict[str, Any] | None:
        rows = [r for r in _exact_rows(records, model, sides) if r.get("time_ratio") is not None]
        return _lowest(rows)

    return bp, side(LEANGRAD_SIDES), side(PYTORCH_SIDES)


def _corpus_sides(rows: list[dict[str, Any]], model: str) -> tuple[Any, Any, Any]:
    """The corpus zoo rows (``tests/model_corpus.py --zoo-rows``) in the zoo's terms:
    ``leangrad ...`` rows on leangrad's side, the library's own recipe on PyTorch's."""
    mine = [r for r in rows if r["model"] == model and r.get("peak_vs_backprop") is not None]
    as_zoo = [{"engine": r["row"].removeprefix("leangrad "), "peak_ratio": r["peak_vs_backprop"],
               "time_ratio": r["time_vs_backprop"], "peak_mib": r["peak_mib"],
               "leangrad": r["row"].startswith("leangrad ")} for r in mine]  # fmt: skip
    bp = next((r for r in as_zoo if r["engine"] == "backprop"), None)
    others = [r for r in as_zoo if r["engine"] != "backprop"]
    return (bp, _lowest([r for r in others if r["leangrad"]]),
            _lowest([r for r in others if not r["leangrad"]]))  # fmt: skip


def wins_table(directory: str | Path) -> str:
    """The README's "where it wins" table: per row of :data:`WIN_MODELS`, the lowest peak
    each side reaches with an exact gradient — leangrad (an engine or a plan) beside
    PyTorch alone (its checkpointing, accumulation and compile recipes; a library's own
    recipe for a downloaded model) — as ratios to backprop's peak, with each one's time.
    Rows whose results file is missing are left out.

    Raises:
        LeangradError: none of the files is there.
    """
    directory = Path(directory)
    lines = ["| model | backprop peak | leangrad, lowest exact peak | peak | time "
             "| PyTorch alone, lowest exact peak | peak | time |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    loaded: dict[str, Any] = {}
    for file, model, label in WIN_MODELS:
        path = directory / file
        if not path.exists():
            continue
        if file not in loaded:
            loaded[file] = json.loads(path.read_text())
        data = loaded[file]
        if Path(file).name == "zoo.json":
            bp, ours, theirs = _zoo_sides(data, model)
            bp_peak = fmt(bp["peak_bytes"], "gib") if bp else "—"
        else:
            bp, ours, theirs = _corpus_sides(data, model)
            bp_peak = f"{bp['peak_mib']:.0f} MiB" if bp else "—"
        if bp is None:
            continue

        def cells(r: dict[str, Any] | None, *, bold: bool) -> str:
            if r is None:
                return "— | — | —"
            peak = f"**{r['peak_ratio']:.2f}×**" if bold else f"{r['peak_ratio']:.2f}×"
            return f"{_how(r)} | {peak} | {r['time_ratio']:.2f}×"

        win = ours is not None and (theirs is None or ours["peak_ratio"] < theirs["peak_ratio"])
        lines.append(f"| {label} | {bp_peak} | {cells(ours, bold=win)} | "
                     f"{cells(theirs, bold=False)} |")  # fmt: skip
    if len(lines) == 2:
        files = ", ".join(sorted({f for f, _, _ in WIN_MODELS}))
        raise errors.LeangradError(NO_WINS.format(directory=directory, files=files))
    return "\n".join(lines)
