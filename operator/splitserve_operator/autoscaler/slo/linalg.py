"""The few lines of linear algebra the step fit needs, by hand.

Why not numpy: the operator image stays small and free of native wheels; the systems are
5×5 and symmetric positive (semi-)definite, so a Cholesky factorisation is exact enough and
costs microseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Matrix = list[list[float]]
Vector = list[float]


def zeros(n: int) -> Matrix:
    return [[0.0] * n for _ in range(n)]


def solve_spd(a: Sequence[Sequence[float]], b: Sequence[float]) -> Vector | None:
    """Solve ``a x = b`` for symmetric positive definite ``a`` (Cholesky); None when ``a``
    is not positive definite (a pivot at or below ``1e-12`` of the largest diagonal)."""
    n = len(b)
    scale = max((abs(a[i][i]) for i in range(n)), default=0.0)
    if scale <= 0.0:
        return None
    low = zeros(n)
    for i in range(n):
        for j in range(i + 1):
            total = a[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            if i == j:
                if total <= 1e-12 * scale:
                    return None
                low[i][i] = math.sqrt(total)
            else:
                low[i][j] = total / low[j][j]
    y = [0.0] * n
    for i in range(n):
        y[i] = (b[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum(low[k][i] * x[k] for k in range(i + 1, n))) / low[i][i]
    return x


def solve_nonnegative(a: Sequence[Sequence[float]], b: Sequence[float], *, fixed: Sequence[float]) -> Vector | None:
    """Minimise ``½xᵀax - bᵀx`` subject to ``x >= 0`` by active set: solve, pin the most
    negative coordinate to 0, repeat (at most ``n`` times). ``fixed[i]`` is the value a
    coordinate takes when its row is all zero (a feature never seen: the prior's value)."""
    n = len(b)
    free = [i for i in range(n) if a[i][i] > 0.0]
    x = [max(0.0, fixed[i]) if a[i][i] <= 0.0 else 0.0 for i in range(n)]
    for _ in range(n + 1):
        if not free:
            return x
        sub = [[a[i][j] for j in free] for i in free]
        rhs = [b[i] - sum(a[i][j] * x[j] for j in range(n) if j not in free) for i in free]
        solved = solve_spd(sub, rhs)
        if solved is None:
            return None
        worst = min(range(len(free)), key=lambda k: solved[k])
        if solved[worst] >= 0.0:
            for k, i in enumerate(free):
                x[i] = solved[k]
            return x
        x[free[worst]] = 0.0
        free = [i for k, i in enumerate(free) if k != worst]
    return x
