"""leangrad.fad: nested forward-mode AD of element-wise activation chains.

Paper: nested-forward-ad-activations (sections II-C to IV). An element-wise
chain with one input (``R^1 -> R^M``: Swish, GELU, Mish, ...) computes its own
derivative during the forward pass and saves only that one tensor per output,
instead of autograd's several intermediates; the backward is one multiply, so
unlike recomputation it adds no work.

- :class:`Swish`, :class:`GELU`, :class:`Mish`: ready activations;
  :func:`elementwise` turns any one-tensor function of primitives into one.
- :func:`nest`: a torch.fx pass fusing every maximal single-source element-wise
  subgraph of a traceable model (section III-B).
- :func:`nested`: the eager mode, a finite-state machine over tensor-operator
  pairs (NN, NY, YY, YN; section IV) for models fx cannot trace.

fad's own layers (the activations, any :class:`FusedChain`, :class:`Elementwise`) work
inside both modes: each is one element-wise operator of one source, so a chain runs
through it (its program whole) and still saves one derivative; alone, it stays the layer
as written. Under any torch.fx tracer each is one ``call_module`` node.
"""

from ._activations import GELU, Mish, Swish, gelu_program, mish_program, swish_program
from ._eager import NestedStats, nested
from ._elementwise import Elementwise, elementwise
from ._errors import FadDtypeError, FadError, FadOpError, FadOptionError, FadTraceError
from ._nest import Region, fused_chains, nest
from ._primitives import PRIMITIVES, Dual, Primitive
from ._program import Builder, FusedChain, Program

__all__ = [
    "GELU",
    "PRIMITIVES",
    "Builder",
    "Dual",
    "Elementwise",
    "FadDtypeError",
    "FadError",
    "FadOpError",
    "FadOptionError",
    "FadTraceError",
    "FusedChain",
    "Mish",
    "NestedStats",
    "Primitive",
    "Program",
    "Region",
    "Swish",
    "elementwise",
    "fused_chains",
    "gelu_program",
    "mish_program",
    "nest",
    "nested",
    "swish_program",
]
