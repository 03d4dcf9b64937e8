"""Which experts a router selects from one row of logits, and how far a row of the run's expert
ids is from the reference's selection (the **tie gap**, logit units; compare/routing.py judges it
against an epsilon).

A plain top-k router selects the experts with the largest logits: the gap of a row is the largest
logit by which an expert the reference chose and the run did not beats one the run chose instead
(``row_gap``). A router declared otherwise (format/routers.py: a bias, expert groups) has no such
formula. Its gap is twice the smallest epsilon such that moving every logit by at most epsilon
makes the router select the run's experts: the experts the run chose rise by epsilon, the others
fall by it (or, second try, those sharing a group with a chosen expert stay, since lowering them
may lower their group's score). For a plain top-k that is the plain gap again: two logits each
epsilon off swap experts 2 x epsilon apart. The smallest epsilon is found by bisection; the
witness at the reported gap always selects the run's experts, so a near tie is never called on a
row that no perturbation of that size explains.
"""

from __future__ import annotations

import math

import numpy as np

from ..format.routers import RouterInfo

# Bisection: relative resolution of the epsilon, and the iteration cap that reaches it.
_RESOLUTION = 1e-9
_ITERATIONS = 80
# Beyond the logits' spread plus this, sigmoid and softmax scores are saturated: a selection no
# such move reaches is out of reach of any (its gap is infinite).
_SATURATION = 80.0


def choice_scores(info: RouterInfo, logits: np.ndarray) -> np.ndarray:
    """The scores ``info``'s router ranks experts by, in float64: ``[rows, experts]``."""
    x = np.asarray(logits, np.float64)
    if info.score == "sigmoid":
        scores = 0.5 * (1.0 + np.tanh(0.5 * x))  # sigmoid without overflow warnings
    else:
        shifted = np.exp(x - np.max(x, axis=-1, keepdims=True))
        scores = shifted / shifted.sum(axis=-1, keepdims=True)
    if info.bias is not None:
        scores = scores + np.asarray(info.bias, np.float64)
    return scores


def select(info: RouterInfo, scores: np.ndarray) -> np.ndarray:
    """The expert ids ``info``'s router selects from choice scores ``[rows, experts]``, sorted
    ascending per row (ties go to the lower id)."""
    rows, experts = scores.shape
    if info.n_group > 1:
        groups = scores.reshape(rows, info.n_group, experts // info.n_group)
        best = -np.sort(-groups, axis=-1)[..., :info.group_topk].sum(axis=-1)
        kept = np.argsort(-best, axis=-1, kind="stable")[:, :info.topk_group]
        mask = np.zeros((rows, info.n_group), bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        scores = np.where(np.repeat(mask, experts // info.n_group, axis=-1), scores, -np.inf)
    return np.sort(np.argsort(-scores, axis=-1, kind="stable")[:, :info.top_k], axis=-1)


def _moved(info: RouterInfo, logits: np.ndarray, chosen: np.ndarray, epsilon: float, keep_mates: bool) -> np.ndarray:
    """``logits`` (one row) with the ``chosen`` experts raised by ``epsilon`` and the others
    lowered by it; with ``keep_mates``, experts in a group that holds a chosen one stay."""
    up = np.zeros(logits.shape[0], bool)
    up[chosen] = True
    delta = np.where(up, epsilon, -epsilon)
    if keep_mates and info.n_group > 1:
        size = logits.shape[0] // info.n_group
        mates = np.repeat(up.reshape(info.n_group, size).any(axis=1), size) & ~up
        delta[mates] = 0.0
    return logits + delta


def witness(info: RouterInfo, logits: np.ndarray, chosen: np.ndarray, epsilon: float) -> np.ndarray | None:
    """Logits at most ``epsilon`` from ``logits`` (one row) from which ``info``'s router selects
    the experts ``chosen`` (sorted ids), or None when neither move of the module docstring does."""
    for keep_mates in ((False, True) if info.n_group > 1 else (False,)):
        moved = _moved(info, logits, chosen, epsilon, keep_mates)
        if np.array_equal(select(info, choice_scores(info, moved[None]))[0], chosen):
            return moved
    return None


def selection_gap(info: RouterInfo, logits: np.ndarray, ids) -> float:
    """The gap (logit units, module docstring) of the run's expert ids ``ids`` against one row
    of reference ``logits``: 0 when the router already selects them, ``inf`` when no move of
    the logits does. ``info`` must fit the row (``RouterInfo.fits``)."""
    x = np.asarray(logits, np.float64)
    chosen = np.array(sorted({int(i) for i in ids}), dtype=np.int64)
    if chosen.size != info.top_k:
        return math.inf
    if witness(info, x, chosen, 0.0) is not None:
        return 0.0
    low, high = 0.0, float(np.ptp(x)) + _SATURATION
    if not witness(info, x, chosen, high) is not None:
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
    if selection is not None and not selection.plain:
        misfit = selection.fits(experts)
        if misfit is not None or len(ref_ids) != selection.top_k:
            return None, f"the declared router ({selection.describe()}) does not fit: " + (
                misfit or f"{len(ref_ids)} ids per row")
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
    plain top-k, not what it selects; None when every covered row is explained."""
    if selection is not None and not selection.plain and covered:
        rows = sorted(covered)
        logits = np.stack([np.asarray(covered[row], np.float64) for row in rows])
        experts = logits.shape[1]
        if selection.fits(experts) is not None or a.shape[1] != selection.top_k \
                or not np.all((0 <= a[rows]) & (a[rows] < experts)):
            return rows[0]
        bad = unexplained_row(selection, logits, a[rows])
        return None if bad is None else rows[bad]
    for row, logits in covered.items():
        logits = np.asarray(logits, np.float64)
        if np.all((0 <= a[row]) & (a[row] < logits.shape[0])) and not is_top_k(logits, a[row]):
            return row
    return None
