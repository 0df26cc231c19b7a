"""Highway backpropagation: iterative gradient propagation along the residual path
(Fagnou et al., "Accelerated training through iterative gradient propagation along the
residual path"; DESIGN.md, "highway/").

Layers are written as ``f(x) = r(x, g(x))`` with a cheap ``K = ∂r/∂x`` (Table 1):
:class:`HighwayBlock` s chained in a :class:`ResidualStack`, or the recurrent
:class:`GRULayer` / :class:`LSTMLayer` with hand-written J-vjps; a :class:`HighwayNet`
(stem -> stacks -> head) is what ``leangrad.engine("highway", k=...)`` differentiates.
"""

from ..engines._scan import cumsumprod, cumsumprod_parallel, cumsumprod_sequential
from ..layers._highway import (
    K_STRUCTURES,
    HighwayBlock,
    HighwayError,
    HighwayNet,
    HighwayStack,
    KStructure,
    Trace,
    check_block,
)
from ._blocks import PostLNSublayer, PostReLUBlock, PreActBlock, PreLNSublayer, ResidualStack
from ._diagnostics import KPoint, KSchedule, convergence, suggest_k
from ._recurrent import GRULayer, LSTMLayer

__all__ = [
    "K_STRUCTURES",
    "GRULayer",
    "HighwayBlock",
    "HighwayError",
    "HighwayNet",
    "HighwayStack",
    "KPoint",
    "KSchedule",
    "KStructure",
    "LSTMLayer",
    "PostLNSublayer",
    "PostReLUBlock",
    "PreActBlock",
    "PreLNSublayer",
    "ResidualStack",
    "Trace",
    "check_block",
    "convergence",
    "cumsumprod",
    "cumsumprod_parallel",
    "cumsumprod_sequential",
    "suggest_k",
]
