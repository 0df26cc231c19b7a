"""Whether ``torch.fx`` may trace a module, judged from its ``forward``'s signature
alone. Shared by :mod:`leangrad.engines.checkpoint._engine` (tracing blocks) and
:mod:`leangrad.engines._transforms` (fad's fx pass), which both import it from below.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["untraceable_signature"]


def untraceable_signature(module: nn.Module) -> str | None:
    """Why ``torch.fx.symbolic_trace(module)`` would be unsafe from ``module.forward``'s
    signature alone, or ``None``: an optional argument becomes a placeholder that the
    trace treats as given (``if attention_mask is not None`` is taken for good, and the
    default flows into the ops when a caller leaves it out), and variadic ones are not
    traced — every Hugging Face block and model takes such arguments."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return "its forward has no Python signature fx could trace"
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    loose = [p.name for p in sig.parameters.values()
             if p.kind not in plain or p.default is not p.empty]  # fmt: skip
    if not loose:
        return None
    shown = ", ".join(loose[:4]) + (", ..." if len(loose) > 4 else "")
    return (f"its forward takes optional or variadic arguments ({shown}), which a trace "
            "would take as given")  # fmt: skip
