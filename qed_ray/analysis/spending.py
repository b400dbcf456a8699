"""Group-sequential pass boundaries: how an adaptive sweep (``adaptive:``, :mod:`qed_ray.spec.claim`) spends the
verdict's false-pass rate across its registered looks (docs/claim.md, "Seeds by looks").

Z_k = S_k / sqrt(t_k), S a Brownian motion on the information fraction t_k = n_k / n_max (the paired bootstrap's unit is
the seed). Under the null the upper boundaries c_1..c_K solve, one look after the other, P(Z_1 < c_1, ..., Z_{k-1} <
c_{k-1}, Z_k >= c_k) = A(t_k) - A(t_{k-1}) for the Lan-DeMets spending function A, the probabilities integrated over S's
density on the continuation region (Armitage, McPherson and Rowe's recursion; Jennison and Turnbull 2000, ch. 19) with
Simpson's rule, each c_k root-found: exact to about 1e-9. Fail stops are non-binding, so no lower boundary enters the
recursion."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from scipy import optimize, stats

Spending = Literal["obrien_fleming", "pocock"]
SPENDINGS: tuple[str, ...] = ("obrien_fleming", "pocock")
_GRID = 1201  # Simpson points over S's continuation region (odd)
_TAIL = 9.0  # the region's lower end in standard deviations of S_k (mass below it < 1e-18)


def spent(t, alpha: float, rule: Spending):
    """A(t): the one-sided false-pass rate spent by information fraction ``t`` (0 < t <= 1; any shape)."""
    t = np.asarray(t, dtype=np.float64)
    if rule == "obrien_fleming":
        return 2.0 - 2.0 * stats.norm.cdf(stats.norm.ppf(1.0 - alpha / 2.0) / np.sqrt(t))
    if rule == "pocock":
        return alpha * np.log1p((math.e - 1.0) * t)
    raise ValueError(f"spending: {rule!r}; allowed {', '.join(SPENDINGS)}")


def _simpson(n: int) -> np.ndarray:
    w = np.ones(n)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return w / 3.0


def boundaries(fractions, alpha: float, rule: Spending) -> list[float]:
    """The upper z-boundaries c_1..c_K at the increasing information ``fractions`` (the last 1) for a one-sided
    false-pass rate ``alpha`` spent by ``rule`` (module notes)."""
    t = [float(x) for x in fractions]
    if not t or any(b <= a for a, b in zip(t, t[1:])) or t[0] <= 0 or abs(t[-1] - 1.0) > 1e-12:
        raise ValueError(f"information fractions {t}: need increasing values in (0, 1] ending at 1")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha {alpha}: need 0 < alpha < 0.5")
    targets = np.diff(np.concatenate([[0.0], spent(t, alpha, rule)]))
    out: list[float] = []
    grid = dens = None  # S_{k-1}'s sub-density on its continuation region
    for k, (tk, want) in enumerate(zip(t, targets)):
        if grid is None:
            cross = lambda c: stats.norm.sf(c) - want  # noqa: E731
        else:
            sd = math.sqrt(tk - t[k - 1])
            cross = lambda c, g=grid, d=dens, s=sd: float(  # noqa: E731
                np.sum(d * stats.norm.sf((c * math.sqrt(tk) - g) / s))) - want
        c = optimize.brentq(cross, -10.0, 40.0, xtol=1e-12)
        out.append(c)
        grid, dens = _continue(grid, dens, t[k - 1] if k else 0.0, tk, c)
    return out


def _continue(grid, dens, t_prev: float, t: float, c: float) -> tuple[np.ndarray, np.ndarray]:
    """S_k's sub-density (times Simpson weights) on (-TAIL sd, c sqrt(t)) given S_{k-1}'s (None: S_0 = 0)."""
    top = c * math.sqrt(t)
    x = np.linspace(min(-_TAIL * math.sqrt(t), top - 1e-6), top, _GRID)
    h = x[1] - x[0]
    if grid is None:
        f = stats.norm.pdf(x / math.sqrt(t)) / math.sqrt(t)
    else:
        sd = math.sqrt(t - t_prev)
        f = (stats.norm.pdf((x[:, None] - grid[None, :]) / sd) / sd) @ dens
    return x, f * _simpson(_GRID) * h


def nominal_levels(fractions, alpha: float, rule: Spending) -> list[float]:
    """Per look the two-sided level of the interval whose lower end decides a pass: 1 - 2 (1 - Phi(c_k)), so that
    "lower end >= threshold" is the one-sided test at boundary c_k."""
    return [1.0 - 2.0 * float(stats.norm.sf(c)) for c in boundaries(fractions, alpha, rule)]
