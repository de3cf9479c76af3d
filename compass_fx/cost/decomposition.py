"""The paper's decomposition model: InterDecom with d parts takes ``T(d) = A*d + B + C/d``.

Pipelining d parts (collective of part i+1 beside the GEMM of part i) costs
``c + g + (d-1) * max(c, g)`` with per-part collective ``c = alpha + Cm/d`` and per-part GEMM
``g = beta + Gm/d``.  When communication dominates (Cm >= Gm) that is
``alpha*d + (Cm + beta) + Gm/d``; when computation does, ``beta*d + (Gm + alpha) + Cm/d``: in both,
A is the per-part overhead of the dominant resource, B what cannot be hidden, C what can.  The
pipeline's time is the larger of the two forms (``max(d*c + g, c + d*g)``), so the dominant one is
the model.
The optimum ``d* = sqrt(C/A)`` is derived symbolically (sympy) below, then rounded to the best
feasible part count — T is convex, so one of the two feasible neighbours of d* is optimal.

``d`` and ``d*`` are the paper's symbols, kept in the formulas (and in ``d_star``, the name the
explain report and its JSON have always used); in the code a part count is ``parts``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence


@functools.lru_cache(maxsize=1)
def _derived() -> tuple[object, object, Callable[[float, float], float], Callable[[float, float, float], float]]:
    """(T expression, d* expression, d*(A, C), T_min(A, B, C)) from sympy: dT/dd = 0, d > 0."""
    import sympy

    A, B, C, d = sympy.symbols("A B C d", positive=True)
    T = A * d + B + C / d
    roots = [r for r in sympy.solve(sympy.diff(T, d), d) if r.is_positive]
    assert len(roots) == 1, roots
    d_star = sympy.simplify(roots[0])
    assert sympy.simplify(sympy.diff(T, d, 2).subs(d, d_star)) .is_positive  # a minimum
    t_min = sympy.simplify(T.subs(d, d_star))
    return T, d_star, sympy.lambdify((A, C), d_star, "math"), sympy.lambdify((A, B, C), t_min, "math")


def optimum_expression() -> str:
    """The derived optimum as text, e.g. ``sqrt(C/A)`` (shown by the explain report)."""
    return str(_derived()[1])


@dataclass(frozen=True)
class DecompositionModel:
    """T(d) = A*d + B + C/d, all in seconds; ``regime`` says which resource dominates."""

    A: float
    B: float
    C: float
    regime: str = "comm-bound"

    def __post_init__(self) -> None:
        for name in ("A", "B", "C"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"DecompositionModel.{name} must be a finite number >= 0, got {value!r}")

    def seconds(self, parts: int) -> float:
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts!r}")
        return self.A * parts + self.B + self.C / parts

    def d_star(self) -> float:
        """The continuous optimum sqrt(C/A) (infinite when A is 0, 0 when C is 0)."""
        if self.A <= 0:
            return math.inf
        if self.C <= 0:
            return 0.0
        return float(_derived()[2](self.A, self.C))

    def min_seconds(self) -> float:
        """T at the continuous optimum: B + 2*sqrt(A*C)."""
        return float(_derived()[3](self.A, self.B, self.C))

    def best_parts(self, allowed: Sequence[int]) -> int:
        """The feasible part count with the smallest T: the better of d*'s two feasible neighbours
        (the smaller one on a tie)."""
        options = sorted(set(allowed))
        if not options or options[0] < 1:
            raise ValueError(f"allowed part counts must be positive ints, got {allowed!r}")
        star = self.d_star()
        below = [parts for parts in options if parts <= star]
        above = [parts for parts in options if parts >= star]
        near = ([below[-1]] if below else []) + ([above[0]] if above else [])
        return min(near, key=lambda parts: (self.seconds(parts), parts))
