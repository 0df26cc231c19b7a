"""Training metrics as JSON lines, and plots of them at the end of a run.

Each line is one record: ``{"kind": "step", "step": ..., "loss": ...}`` after
every optimizer step, ``{"kind": "epoch", ...}`` after every epoch (test loss and
accuracy), ``{"kind": "event", ...}`` for starts, resumes and stops. Lines are
flushed as they are written, so a killed run keeps every finished step. On
resume the file is cut back to the checkpoint's step, so it stays one clean
history. Plots need matplotlib (the ``plot`` extra); without it they are
skipped with a note.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

__all__ = ["MetricsWriter", "plot_metrics", "read_metrics"]

NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install 'leangrad[plot]')"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics file (a torn last line is skipped)."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsWriter:
    """Append records to a JSONL file; ``resume_step`` first drops records after it.

    Args:
        path: the ``metrics.jsonl`` file.
        resume_step: keep only records with ``step <= resume_step`` (a resumed run);
            ``None`` starts a new file.
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self._file: IO[str] = open(self.path, "w")  # noqa: SIM115 - closed in close()
        else:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
            self._file = open(self.path, "a")  # noqa: SIM115

    def write(self, **record: Any) -> None:
        """Write one record and flush it."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def plot_metrics(path: str | Path, out: str | Path) -> str | None:
    """Plot training loss per step and test accuracy per epoch into ``out`` (PNG).

    Returns:
        ``None`` when written, else a note saying why not (matplotlib missing, no data).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    records = read_metrics(path)
    steps = [r for r in records if r.get("kind") == "step"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    if not steps:
        return "plots skipped: no training steps recorded"
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8)
    axes[0].set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    if epochs:
        axes[1].plot([r["epoch"] for r in epochs], [r["test_acc"] for r in epochs], "o-")
    axes[1].set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return None
