"""Chain layers with the rules Moonwalk and RevBackprop need (DESIGN.md, "Layer rules")."""

from ._base import (
    ChainLayer,
    FragmentalLayer,
    LayerConditionError,
    NotInvertibleError,
    NotSubmersiveError,
    PrecisionWarning,
)
from ._bits import PackedBits, pack_bits, unpack_bits, unpack_nonzero
from ._chain import Chain
from ._conv import SubmersiveConv2d
from ._fragmental import FragmentalConv1d, FragmentalConv2d
from ._invertible import AdditiveCoupling, LeakyReLU, SpaceToDepth, Tanh
from ._linear import SubmersiveLinear
from ._swap import SwapHalves

__all__ = [
    "AdditiveCoupling",
    "Chain",
    "ChainLayer",
    "FragmentalConv1d",
    "FragmentalConv2d",
    "FragmentalLayer",
    "LayerConditionError",
    "LeakyReLU",
    "NotInvertibleError",
    "NotSubmersiveError",
    "PackedBits",
    "PrecisionWarning",
    "SpaceToDepth",
    "SubmersiveConv2d",
    "SubmersiveLinear",
    "SwapHalves",
    "Tanh",
    "pack_bits",
    "unpack_bits",
    "unpack_nonzero",
]
