"""Which experts a router selects from one row of logits, and how far a row of the run's expert
ids is from the reference's selection (the **tie gap**, logit units; compare/routing.py judges it
against an epsilon).

A plain top-k router selects the experts with the largest logits: the gap of a row is the largest
logit by which an expert the reference chose and the run did not beats one the run chose instead
(``row_gap``). A router declared otherwise (format/routers.py: a bias, expert groups) has no such
formula. Its gap is twice the smallest epsilon such that moving every logit by at most epsilon
makes the router select the run's experts: two logits each epsilon off swap experts 2 x epsilon
apart, so for a plain top-k it is the plain gap again. Whether a move of epsilon can do it is
decided exactly (``witness``) when each choice score moves with its own logit alone (sigmoid or
sqrt(softplus) plus a bias, softmax without one), and it only gets easier as epsilon grows, so
bisection finds the smallest. A softmax router with a bias couples every score to every logit:
without expert groups compare/softmax_bias.py decides it exactly too; with groups it is not
judged. A router that routes by token id (DeepSeek-V4's hash routers) has no gap: any
difference is far from a tie.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..format.routers import TOKEN, UNKNOWN, RouterInfo
from . import softmax_bias
from .metrics import bf16_spacing

# Bisection: relative resolution of the epsilon, and the iteration cap that reaches it.
_RESOLUTION = 1e-9
_ITERATIONS = 80
# The largest epsilon tried (logit units): a selection no move of this size reaches is out of reach.
_FARTHEST = 1e6


# Why a differing row of a router that routes by token id is far from any tie.
TOKEN_ROUTED = "its experts follow the token id (hash routing), not its logits: no rounding moves them"
# Why a differing row of a router whose rule is not known is not judged.
UNKNOWN_RULE = ("its router selects by a rule compiledump does not know (a bias it cannot place; instrument warned), "
                "so its logits cannot tell a near tie: declare it with compiledump.declare_router")


def choice_scores(info: RouterInfo, logits: np.ndarray) -> np.ndarray:
    """The scores ``info``'s router ranks experts by, in float64: ``[rows, experts]``."""
    x = np.asarray(logits, np.float64)
    if info.score in _PER_LOGIT:
        return _PER_LOGIT[info.score](x) + _bias(info)
    shifted = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True) + _bias(info)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # without overflow warnings


def _sqrtsoftplus(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.logaddexp(0.0, x))  # DeepSeek-V4's score: sqrt(log(1 + e^x))


def _logit_of_sqrtsoftplus(score: np.ndarray) -> np.ndarray:
    softplus = score * score
    return softplus + np.log(-np.expm1(-softplus))  # log(e^y - 1) without overflow


# Scores that depend on their own logit alone, increasing: the score, and its inverse.
_PER_LOGIT = {"sigmoid": _sigmoid, "sqrtsoftplus": _sqrtsoftplus, "logits": lambda x: x}
_INVERSE = {"sigmoid": lambda p: np.log(p) - np.log1p(-p), "sqrtsoftplus": _logit_of_sqrtsoftplus,
            "logits": lambda score: score}


# The slope of each per-logit score: how far a choice score moves per unit of its logit.
_SLOPE = {"sigmoid": lambda x: _sigmoid(x) * _sigmoid(-x),
          "sqrtsoftplus": lambda x: _sigmoid(x) / (2.0 * _sqrtsoftplus(x)),
          "logits": lambda x: np.ones_like(x)}


def score_rounding_epsilon(info: RouterInfo, logits: np.ndarray, ref_ids, run_ids, ulps: float) -> float | None:
    """For a router that rounds its choice scores in the run's precision (``info.rounded``): the
    tie gap, in logit units, that a rounding of ``ulps`` bf16 spacings of the choice scores
    allows, else None. Two experts a (REF chose it, RUN did not) and b (the reverse) whose scores
    are tau apart swap when each logit moves by tau / (slope_a + slope_b), a gap of twice that;
    the flattest such pair bounds it. DeepSeek-V4's sqrt(softplus) scores sit near 0.83 where
    its small logits sit near 0: their rounding, not the logits', decides a flip there. A softmax
    without a bias (DBRX) ranks by probabilities, whose rounding ties experts whose logits differ
    by about a bf16 spacing of the probability over the probability."""
    if not info.rounded or (info.score not in _SLOPE and info.score != "softmax"):
        return None
    displaced = sorted(set(int(i) for i in ref_ids) - set(int(i) for i in run_ids))
    instead = sorted(set(int(i) for i in run_ids) - set(int(i) for i in ref_ids))
    if not displaced or not instead:
        return None
    swapped = displaced + instead
    x = np.asarray(logits, np.float64)
    if info.score == "softmax":
        # DBRX's probabilities: moving logit a down and b up by e moves p_a - p_b by
        # (p_a + p_b - (p_a - p_b)^2) e, so each expert's slope at a near tie is its probability
        probabilities = choice_scores(info, x[None, :])[0]
        scores, slope_of = probabilities[swapped], lambda ids: probabilities[ids]
    else:
        scores = _PER_LOGIT[info.score](x[swapped]) + (np.asarray(info.bias, np.float64)[swapped] if info.bias else 0.0)
        slope_of = lambda ids: _SLOPE[info.score](x[ids])  # noqa: E731
    slopes = float(np.min(slope_of(displaced))) + float(np.min(slope_of(instead)))
    tau = ulps * bf16_spacing(float(np.max(np.abs(scores))))
    return 2.0 * tau / slopes if slopes > 0 else None


def _bias(info: RouterInfo) -> np.ndarray | float:
    return 0.0 if info.bias is None else np.asarray(info.bias, np.float64)


def select(info: RouterInfo, scores: np.ndarray) -> np.ndarray:
    """The expert ids ``info``'s router selects from choice scores ``[rows, experts]``, sorted
    ascending per row (ties go to the lower id)."""
    rows, experts = scores.shape
    if info.n_group > 1:
        kept = np.argsort(-_group_scores(info, scores), axis=-1, kind="stable")[:, :info.topk_group]
        mask = np.zeros((rows, info.n_group), bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        scores = np.where(np.repeat(mask, experts // info.n_group, axis=-1), scores, -np.inf)
    return np.sort(np.argsort(-scores, axis=-1, kind="stable")[:, :info.top_k], axis=-1)


def _group_scores(info: RouterInfo, scores: np.ndarray) -> np.ndarray:
    """Each group's score: the sum of its best ``group_topk`` choice scores, ``[rows, n_group]``."""
    rows, experts = scores.shape
    groups = scores.reshape(rows, info.n_group, experts // info.n_group)
    return -np.sort(-groups, axis=-1)[..., :info.group_topk].sum(axis=-1)


def judgeable(info: RouterInfo) -> str | None:
    """Why logit moves cannot judge ``info``'s selection, or None. Each choice score must depend
    on its own logit alone, increasing: sigmoid (+ bias), or softmax without a bias (a common
    factor, which no comparison sees); softmax plus a bias, which couples every score to every
    logit, is decided without expert groups only (compare/softmax_bias.py)."""
    if info.score == "softmax" and info.bias is not None and info.n_group > 1:
        return ("a softmax router with a bias in expert groups: no rule here tells how far its logits are "
                "from another selection")
    return None


def _score(info: RouterInfo, logits: np.ndarray) -> np.ndarray:
    """Choice scores up to a common positive factor, for one row, each from its own logit."""
    if info.score in _PER_LOGIT:
        return _PER_LOGIT[info.score](logits) + _bias(info)
    return np.exp(logits)  # softmax without a bias: the normalisation is a common factor


def _logit_of(info: RouterInfo, score: np.ndarray) -> np.ndarray:
    """The inverse of ``_score``."""
    if info.score in _INVERSE:
        return _INVERSE[info.score](score - _bias(info))
    return np.log(score)


def witness(info: RouterInfo, logits: np.ndarray, chosen: np.ndarray, epsilon: float,
            cap_epsilon: float | None = None) -> np.ndarray | None:
    """Logits at most ``epsilon`` from ``logits`` (one row) from which ``info``'s router selects
    the experts ``chosen`` (sorted ids), ties going the run's way; None when there are none.

    Exact for a ``judgeable`` router: with every score moving with its own logit, the best move
    for a set S of kept groups raises the chosen experts by epsilon, lowers the experts of the
    other groups by epsilon, and lifts every other expert of S as high as it may go while it stays
    below the lowest chosen score (it lifts its group); S holds the chosen experts' groups, and
    the rest of it is tried every way. With ``cap_epsilon`` < ``epsilon`` those experts stay below
    the lowest chosen score at ``cap_epsilon``: a witness with room, that rounding cannot flip.
    A softmax router with a bias (no groups) is decided by compare/softmax_bias.py; a
    ``cap_epsilon`` asks it for the witness with the most room it finds."""
    x = np.asarray(logits, np.float64)
    if info.score == "softmax" and info.bias is not None:
        return softmax_bias.witness(x, _bias(info), chosen, epsilon, robust=cap_epsilon is not None)
    experts = x.shape[0]
    up = np.zeros(experts, bool)
    up[chosen] = True
    # Centred for softmax (exp overflows otherwise); sigmoid scores depend on the logits themselves.
    shift = float(np.max(x)) if info.score == "softmax" else 0.0
    low, high = _score(info, x - shift - epsilon), _score(info, x - shift + epsilon)
    lowest_chosen = float(np.min(_score(info, x - shift + (epsilon if cap_epsilon is None else cap_epsilon))[up]))
    size = experts // info.n_group
    group_of = np.arange(experts) // size
    needed = sorted(set(group_of[up].tolist()))
    if len(needed) > info.topk_group:
        return None
    others = [g for g in range(info.n_group) if g not in needed]
    for extra in itertools.combinations(others, info.topk_group - len(needed)):
        kept = np.isin(group_of, needed + list(extra))
        rivals = kept & ~up
        if np.any(low[rivals] > lowest_chosen):
            continue  # an expert of S that stays above a chosen one
        scores = np.where(up, high, np.where(rivals, np.minimum(high, lowest_chosen), low))
        if info.n_group > 1:
            group = _group_scores(info, scores[None])[0]
            in_kept = np.isin(np.arange(info.n_group), needed + list(extra))
            if group[~in_kept].size and group[in_kept].min() < group[~in_kept].max():
                continue
        with np.errstate(divide="ignore"):  # a saturated sigmoid score: clipped to the move below
            return np.clip(_logit_of(info, scores) + shift, x - epsilon, x + epsilon)
    return None


def selection_gap(info: RouterInfo, logits: np.ndarray, ids) -> float:
    """The gap (logit units, module docstring) of the run's expert ids ``ids`` against one row
    of reference ``logits``: 0 when the router already selects them, ``inf`` when no move of
    the logits does. ``info`` must fit the row (``RouterInfo.fits``) and be ``judgeable``."""
    x = np.asarray(logits, np.float64)
    chosen = np.array(sorted({int(i) for i in ids}), dtype=np.int64)
    if chosen.size != info.top_k:
        return math.inf
    if witness(info, x, chosen, 0.0) is not None:
        return 0.0
    low, high = 0.0, float(np.ptp(x)) + 1.0
    while witness(info, x, chosen, high) is None:  # reachable sets need a move of this order
        low, high = high, 2.0 * high
        if high > _FARTHEST:
            return math.inf
    for _ in range(_ITERATIONS):
        if high - low <= _RESOLUTION * max(1.0, high):
            break
        middle = 0.5 * (low + high)
        if witness(info, x, chosen, middle) is not None:
            high = middle
        else:
            low = middle
    return 2.0 * high


def unexplained_row(info: RouterInfo, logits: np.ndarray, ids: np.ndarray) -> int | None:
    """The first row whose reference ``ids`` ``[rows, k]`` are not what ``info``'s router selects
    from its ``logits`` ``[rows, experts]`` (scores within float32 rounding of a tie may go either
    way), else None."""
    scores = choice_scores(info, logits)
    chosen = np.sort(np.asarray(ids, np.int64), axis=-1)
    up = np.zeros(scores.shape, bool)
    np.put_along_axis(up, chosen, True, axis=-1)
    slack = 1e-6 * np.maximum(1.0, np.max(np.abs(scores), axis=-1, keepdims=True))
    explained = np.all(select(info, np.where(up, scores + slack, scores - slack)) == chosen, axis=-1)
    bad = np.flatnonzero(~explained)
    return int(bad[0]) if bad.size else None


def _slack(scores: np.ndarray) -> float:
    # float32 softmax/top-k may order logits this close either way
    return 1e-6 * float(np.max(np.abs(scores[np.isfinite(scores)]), initial=0.0))


def is_top_k(logits: np.ndarray, ids) -> bool:
    """Whether ``ids`` (valid indices into ``logits``) are the experts with the largest logits."""
    scores = np.asarray(logits, np.float64)
    chosen = {int(i) for i in ids}
    others = [i for i in range(scores.shape[0]) if i not in chosen]
    return not others or min(scores[sorted(chosen)]) >= max(scores[others]) - _slack(scores)


def row_gap(logits: np.ndarray, ref_row: np.ndarray, run_row: np.ndarray,
            selection: RouterInfo | None = None) -> tuple[float | None, str | None]:
    """The tie gap of one differing row (module docstring), or (None, why) when the
    logits cannot judge it: ids outside the logits, or reference ids that are not the top-k of
    the logits (routing with a bias or grouped top-k, or logits of another row). A declared
    ``selection`` that is not plain top-k judges by its own rule (compare/selection.py)."""
    scores = np.asarray(logits, np.float64)
    experts = scores.shape[0]
    ref_ids, run_ids = [int(i) for i in ref_row], [int(i) for i in run_row]
    if any(not 0 <= i < experts for i in ref_ids + run_ids):
        return None, f"ids outside the {experts} router logits"
    if selection is not None and selection.score == TOKEN:
        return math.inf, TOKEN_ROUTED
    if selection is not None and selection.score == UNKNOWN:
        return None, UNKNOWN_RULE
    if selection is not None and not selection.plain:
        misfit = _misfit(selection, experts, len(ref_ids)) or judgeable(selection)
        if misfit is not None:
            return None, f"the declared router ({selection.describe()}): {misfit}"
        if unexplained_row(selection, scores[None], np.asarray([ref_ids])) is not None:
            return None, f"the reference ids are not what its declared router ({selection.describe()}) selects"
        return selection_gap(selection, scores, run_ids), None
    chosen = set(ref_ids)
    slack = _slack(scores)
    if not is_top_k(scores, ref_ids):
        return None, "the reference ids are not the top-k of its router logits"
    displaced = [i for i in ref_ids if i not in set(run_ids)]
    instead = [i for i in run_ids if i not in chosen]
    gap = 0.0
    if displaced and instead:
        gap = float(max(scores[displaced]) - min(scores[instead]))
    # The order of the ids, when the reference lists them by descending score: a run that lists
    # a lower-scored expert first contradicts the scores by the difference.
    ref_scores = scores[ref_ids]
    if len(ref_ids) > 1 and np.all(ref_scores[:-1] >= ref_scores[1:] - slack):
        run_scores = scores[run_ids]
        for i in range(len(run_ids)):
            later = run_scores[i + 1:]
            if later.size:
                gap = max(gap, float(np.max(later) - run_scores[i]))
    return max(gap, 0.0), None


def first_unexplained(covered: dict[int, np.ndarray], a: np.ndarray, selection: RouterInfo | None) -> int | None:
    """The first row of reference ids ``a`` ``[rows, k]`` among ``covered`` ({row: its router
    logits}) that is not the top-k of its logits, or, for a declared ``selection`` that is not
    plain top-k, not what it selects (any row, when the declaration does not fit the logits);
    None when every covered row is explained. Rows with ids outside the logits are skipped: their
    own rows are not judged (``row_gap``)."""
    if selection is not None and selection.score in (TOKEN, UNKNOWN):
        return None  # its ids follow the token ids, or a rule not known: nothing in the logits to explain
    rows = [row for row, logits in sorted(covered.items()) if np.all((0 <= a[row]) & (a[row] < np.shape(logits)[0]))]
    if selection is not None and not selection.plain and rows:
        logits = np.stack([np.asarray(covered[row], np.float64) for row in rows])
        if _misfit(selection, logits.shape[1], a.shape[1]) is not None:
            return rows[0]
        bad = unexplained_row(selection, logits, a[rows])
        return None if bad is None else rows[bad]
    for row in rows:
        if not is_top_k(np.asarray(covered[row], np.float64), a[row]):
            return row
    return None


def _misfit(selection: RouterInfo, experts: int, ids_per_row: int) -> str | None:
    """Why ``selection`` cannot apply to rows of ``experts`` logits and ``ids_per_row`` ids."""
    if ids_per_row != selection.top_k:
        return f"{ids_per_row} ids per row, not {selection.top_k}"
    return selection.fits(experts)
