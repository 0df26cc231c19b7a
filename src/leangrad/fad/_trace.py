"""fad's own layers under ``torch.fx``: each stays one ``call_module`` node (one fused unit).

torch.fx traces into every module outside ``torch.nn``, and a fused layer's forward checks
its input's dtype and hands it to a ``torch.autograd.Function`` — neither works on a
:class:`torch.fx.Proxy`. The layers call :func:`as_leaf` instead, which records the
layer as a leaf ``call_module`` node, whichever tracer runs (``fad.nest``, the block
discovery and the checkpoint traces of :mod:`leangrad.engines`, the user's own
``fx.symbolic_trace``). A layer that is the traced root itself has no name to call, so it
is recorded by its primitives (``inline``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import fx, nn

__all__ = ["as_leaf"]


def as_leaf(module: nn.Module, x: fx.Proxy, *, outputs: int | None,
            inline: Callable[[fx.Proxy], Any]) -> Any:  # fmt: skip
    """The traced result of ``module(x)``: one ``call_module`` node, split into ``outputs``
    proxies when that is known and above 1; ``inline(x)`` when ``module`` is the root."""
    tracer = x.tracer
    if not isinstance(tracer, fx.Tracer) or getattr(tracer, "root", None) is module:
        return inline(x)
    path = tracer.path_of_module(module)
    node = tracer.create_proxy("call_module", path, (x,), {})
    if outputs is None or outputs == 1:
        return node
    return tuple(cast(Any, node)[i] for i in range(outputs))
