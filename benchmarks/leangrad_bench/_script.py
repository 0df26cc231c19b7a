"""What the scripts under ``results/`` share: their ``--out FILE`` option and how they show
and save the JSON report they regenerate."""

from __future__ import annotations

import argparse
import json
from typing import Any


def out_option() -> str | None:
    """The script's ``--out FILE`` (None where not given), parsed from the command line."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    out: str | None = p.parse_args().out
    return out


def show_and_save(report: dict[str, Any], out: str | None, *,
                  shown: dict[str, Any] | None = None, newline: bool = True) -> None:
    """Print ``report`` (or ``shown``, a part of it) as JSON, indented by 1, and write the
    whole of it to ``out`` where given (``newline``: end the file with one)."""
    text = json.dumps(report, indent=1)
    print(text if shown is None else json.dumps(shown, indent=1))
    if out:
        with open(out, "w") as f:
            f.write(text + "\n" if newline else text)
