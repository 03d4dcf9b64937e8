"""Whether a move of the logits can make a **softmax router with a bias** select given experts
(Ernie 4.5, LongCat-Flash: the top-k of softmax(logits) + bias, no expert groups).

Every softmax score moves with every logit, so the per-score rule of compare/selection.py does not
apply; the question is still exact, as a small convex problem. Logits moved by at most epsilon
give unnormalised scores ``q_i = exp(x_i + d_i)`` in ``[a_i, b_i] = exp(x_i -+ epsilon)``, and
probabilities ``y = t q`` with ``t = 1 / sum(q)``. The router selects the set C when some
threshold tau has ``y_c + bias_c >= tau`` for every c in C and ``y_r + bias_r <= tau`` for every
other r. For fixed (t, tau) each y_i then lies in an interval (chosen: ``[max(a_c t, tau -
bias_c), b_c t]``, others: ``[a_r t, min(b_r t, tau - bias_r)]``) and the y must sum to 1: the
intervals are non-empty and their lower ends sum to at most 1, their upper ends to at least 1.
Both sums grow with tau, so for fixed t the feasible taus are one interval, and its length
(negative: empty) is a concave function of t (the projection of a convex set): a golden-section
search over t finds its best, and the move is possible when that is not negative.
"""

from __future__ import annotations

import math

import numpy as np

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_SEARCH_STEPS = 64  # golden-section steps over t: the bracket shrinks to 0.618^64 ~ 1e-13 of itself
_TOLERANCE = 1e-12  # probabilities: float64 rounding of a feasible tie


def witness(logits: np.ndarray, bias: np.ndarray, chosen: np.ndarray, epsilon: float,
            robust: bool = False) -> np.ndarray | None:
    """Logits at most ``epsilon`` from ``logits`` (one row) whose softmax plus ``bias`` ranks the
    experts ``chosen`` (ids) above every other, or None when there are none. The first t found
    feasible gives it (a yes/no answer, for the bisection), or with ``robust`` the t of the widest
    interval of thresholds, whose middle gives the witness with the most room against rounding."""
    x = np.asarray(logits, np.float64)
    shift = float(np.max(x))
    low, high = np.exp(x - shift - epsilon), np.exp(x - shift + epsilon)
    up = np.zeros(x.shape[0], bool)
    up[np.asarray(chosen, np.int64)] = True
    beta = np.asarray(bias, np.float64)
    width = _Widths(low, high, beta, up)
    t_low, t_high = 1.0 / high.sum(), 1.0 / low.sum()  # sum(y) = 1 bounds t
    a, b = t_low, t_high
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = width(c)[0], width(d)[0]
    for _ in range(_SEARCH_STEPS):
        if not robust and max(fc, fd) >= 0.0:
            break
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = width(c)[0]
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = width(d)[0]
    best = max((t_low, t_high, c, d), key=lambda t: width(t)[0])
    span, tau_from, tau_to = width(best)
    if span < -_TOLERANCE:
        return None
    tau = 0.5 * (tau_from + tau_to)
    lower, upper = width.bounds(best, tau)
    # The probabilities: every interval at the same fraction of its length, summing to 1.
    room = float(np.sum(upper - lower))
    fraction = 0.0 if room <= 0 else min(1.0, max(0.0, (1.0 - float(np.sum(lower))) / room))
    y = lower + fraction * (upper - lower)
    with np.errstate(divide="ignore"):
        moved = np.log(np.maximum(y, 0.0) / best) + shift
    return np.clip(moved, x - epsilon, x + epsilon)


class _Widths:
    """For one t: the interval of thresholds tau that admit probabilities ``y = t q`` (module
    docstring), as (its length, its ends)."""

    def __init__(self, low: np.ndarray, high: np.ndarray, beta: np.ndarray, up: np.ndarray) -> None:
        self.low, self.high, self.beta, self.up = low, high, beta, up

    def bounds(self, t: float, tau: float) -> tuple[np.ndarray, np.ndarray]:
        """Each y_i's interval at (t, tau)."""
        lower = np.where(self.up, np.maximum(self.low * t, tau - self.beta), self.low * t)
        upper = np.where(self.up, self.high * t, np.minimum(self.high * t, tau - self.beta))
        return lower, upper

    def __call__(self, t: float) -> tuple[float, float, float]:
        up, beta = self.up, self.beta
        chosen_low, chosen_high = self.low[up] * t, self.high[up] * t
        other_low, other_high = self.low[~up] * t, self.high[~up] * t
        # Non-empty intervals: every chosen score can reach tau, every other can stay below it.
        tau_max = float(np.min(chosen_high + beta[up]))
        tau_min = float(np.max(other_low + beta[~up])) if other_low.size else -math.inf
        # The lower ends sum to at most 1: the largest such tau (they grow with tau past each
        # chosen expert's own lower end, chosen_low + its bias).
        tau_max = min(tau_max, _largest_at_most(chosen_low + beta[up], chosen_low,
                                                1.0 - float(np.sum(other_low))))
        # The upper ends sum to at least 1: the smallest such tau (each other expert's upper end
        # grows with tau until it reaches other_high, at other_high + its bias).
        if other_high.size:
            tau_min = max(tau_min, _smallest_at_least(other_high + beta[~up], other_high,
                                                      1.0 - float(np.sum(chosen_high))))
        elif float(np.sum(chosen_high)) < 1.0 - _TOLERANCE:
            return -math.inf, math.inf, -math.inf
        return tau_max - tau_min, tau_min, tau_max


def _largest_at_most(knees: np.ndarray, floors: np.ndarray, budget: float) -> float:
    """The largest tau with ``sum(max(floors_i, tau - knees_i + floors_i)) <= budget``: each term
    is ``floors_i`` up to its knee, then grows with slope 1 (``tau - bias_i``); -inf when even
    the floors exceed the budget."""
    order = np.argsort(knees, kind="stable")
    knees, floors = knees[order], floors[order]
    base = float(np.sum(floors))
    if base > budget + _TOLERANCE:
        return -math.inf
    budget = max(budget, base)  # a sum that is 1 up to rounding
    # At knee j (sorted) the terms 0..j-1 have grown by knee_j - knee_i each.
    grown = np.arange(knees.size) * knees - np.concatenate([[0.0], np.cumsum(knees)[:-1]])
    total = base + grown
    j = int(np.searchsorted(total, budget, side="right")) - 1  # the last knee still within the budget
    return float(knees[j] + (budget - total[j]) / (j + 1))


def _smallest_at_least(knees: np.ndarray, ceilings: np.ndarray, need: float) -> float:
    """The smallest tau with ``sum(min(ceilings_i, tau - knees_i + ceilings_i)) >= need``: each
    term grows with slope 1 (``tau - bias_i``) until its knee, then stays at ``ceilings_i``."""
    order = np.argsort(knees, kind="stable")
    knees, ceilings = knees[order], ceilings[order]
    top = float(np.sum(ceilings))
    if top < need - _TOLERANCE:
        return math.inf
    need = min(need, top)  # a sum that is 1 up to rounding
    # At knee j (sorted) the terms j+1.. are still short of their ceilings by knee_i - knee_j.
    short = (np.cumsum(knees[::-1])[::-1] - knees * np.arange(knees.size, 0, -1))
    total = top - short
    j = int(np.searchsorted(total, need, side="left"))  # the first knee that reaches the need
    return float(knees[j] - (total[j] - need) / (knees.size - j))
