"""Seeded random element-wise chains over the primitive table, for tests.

:func:`random_chain` writes a function of one tensor out of the FAD primitives
(paper section III-A) — unary ops, same-source binaries, binaries with
constants, in-place ops on chain values — in randomly chosen call styles
(``torch.f(x)``, ``x.f()``, operators, ``F.*``), keeping every value in the
domain of the next op (logs and roots of ``softplus(v) + c``, divisions by
``c + tanh(v)``), so float64 comparisons with autograd are meaningful.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["RandomChain", "random_chain"]


@dataclasses.dataclass(frozen=True)
class RandomChain:
    """A random chain: ``fn(x)`` returns ``outputs`` tensors; ``text`` shows the ops."""

    fn: Callable[[Tensor], Tensor | tuple[Tensor, ...]]
    text: str
    outputs: int


_Step = Callable[[list[Tensor]], Tensor]


def _pick(rng: random.Random, n: int) -> int:
    return rng.randrange(n) if rng.random() < 0.5 else n - 1  # favour the newest value


def _unary(rng: random.Random, i: int) -> tuple[_Step, str]:
    name = rng.choice(["sigmoid", "tanh", "softplus", "erf", "sin", "cos", "neg", "abs2",
                       "square", "exp_tanh", "log_sp", "sqrt_sp", "rsqrt_sp", "recip_sp",
                       "log1p_sp", "expm1_tanh", "relu_shift", "clone"])  # fmt: skip
    style = rng.randrange(3)

    def call(fname: str, v: Tensor) -> Tensor:
        if style == 0:
            return getattr(torch, fname)(v)
        if style == 1:
            return getattr(v, fname)()
        return getattr(F, fname)(v) if hasattr(F, fname) else getattr(torch, fname)(v)

    def step(vs: list[Tensor]) -> Tensor:
        v = vs[i]
        if name in ("sigmoid", "tanh", "erf", "sin", "cos", "neg", "square", "clone"):
            return call(name, v)
        if name == "softplus":
            return F.softplus(v) if style else F.softplus(v, 2.0, 5.0)
        if name == "abs2":
            return torch.abs(v - 0.3) if style else (v - 0.3).abs()
        if name == "exp_tanh":
            return torch.exp(torch.tanh(v))
        if name == "expm1_tanh":
            return torch.expm1(v.tanh())
        if name == "relu_shift":
            return torch.relu(v + 0.25)
        pos = F.softplus(v) + 0.5
        return {"log_sp": torch.log, "sqrt_sp": torch.sqrt, "rsqrt_sp": torch.rsqrt,
                "recip_sp": torch.reciprocal, "log1p_sp": torch.log1p}[name](pos)  # fmt: skip

    return step, f"{name}(v{i})"


def _binary(rng: random.Random, i: int, j: int) -> tuple[_Step, str]:
    name = rng.choice(["add", "sub", "mul", "div", "pow_int", "pow_pos", "const_add",
                       "const_mul", "rsub", "rdiv", "add_alpha", "inplace_mul",
                       "inplace_add"])  # fmt: skip
    c = round(rng.uniform(0.3, 1.7), 3)

    def step(vs: list[Tensor]) -> Tensor:
        a, b = vs[i], vs[j]
        if name == "add":
            return a + b
        if name == "sub":
            return torch.sub(a, b)
        if name == "mul":
            return a.mul(b)
        if name == "div":
            return a / (1.5 + torch.tanh(b))
        if name == "pow_int":
            return torch.tanh(a) ** rng_int
        if name == "pow_pos":
            return (F.softplus(a) + 0.5).pow(torch.tanh(b))
        if name == "const_add":
            return a + c
        if name == "const_mul":
            return c * a
        if name == "rsub":
            return c - a
        if name == "rdiv":
            return c / (F.softplus(a) + 0.5)
        if name == "add_alpha":
            return torch.add(a, b, alpha=c)
        out = a * 1.0 if name == "inplace_mul" else a.clone()
        if name == "inplace_mul":
            out.mul_(b)
        else:
            out += b
        return out

    rng_int = rng.choice([2, 3])
    return step, f"{name}(v{i}, v{j}{', ' + str(c) if 'const' in name else ''})"


def random_chain(seed: int, *, length: int = 6, max_outputs: int = 2) -> RandomChain:
    """A random chain of ``length`` steps over the primitive table (``v0`` is the input)."""
    rng = random.Random(seed)
    steps: list[_Step] = []
    text: list[str] = []
    for k in range(length):
        n = k + 1
        if rng.random() < 0.5:
            step, t = _unary(rng, _pick(rng, n))
        else:
            step, t = _binary(rng, _pick(rng, n), rng.randrange(n))
        steps.append(step)
        text.append(f"v{n} = {t}")
    outputs = rng.randint(1, max_outputs)
    picks = [length, *rng.sample(range(1, length), outputs - 1)] if length > 1 else [length]

    def fn(x: Tensor) -> Tensor | tuple[Tensor, ...]:
        vs = [x]
        for s in steps:
            vs.append(s(vs))
        outs = tuple(vs[p] for p in picks)
        return outs[0] if len(outs) == 1 else outs

    return RandomChain(fn, "; ".join(text) + f" -> {[f'v{p}' for p in picks]}", len(picks))
