"""PhiMoE's sparsemixer: the experts each pick is weighed over, and the rows where rounding moved
an expert across that cut.

The sparsemixer (transformers' ``sparsemixer``) picks the top-k of the router logits, one at a
time, and weighs pick j by a softmax over only the experts e, not picked before it, with
``(m_j - s_e) / max(|s_e|, m_j) <= cut`` (``m_j`` the pick's logit, ``cut`` twice its
``router_jitter_noise``). An expert close to that cut falls on either side of it when the run's
logits are rounded: the ids agree, the weights do not, and the MoE output of that token differs
honestly. Such a row is judged as a near tie by the distance of the moved expert to the cut in
the reference's logits (``boundary - (m_j - s_e)``, logit units: the amount by which the two logits
must move together to carry it across), against the same epsilon as an expert-id swap
(compare/routing.py); compare/flips.py then treats the row as a flip of that token.
"""

from __future__ import annotations

import numpy as np

from .metrics import id_rows
from .routing import Routing, RoutingRow, router_rows, routing_epsilon


def margins(logits: np.ndarray, picks, cut: float) -> np.ndarray:
    """``[k, experts]``: for each pick j (in order) and expert e, ``cut * max(|s_e|, m_j) - (m_j -
    s_e)``, in float64: e is in pick j's softmax when it is >= 0 (the sparsemixer's ``>`` test,
    negated); NaN for the experts picked before j (masked out of its softmax)."""
    s = np.asarray(logits, np.float64)
    out = np.empty((len(picks), s.shape[-1]))
    for j, pick in enumerate(picks):
        m = s[int(pick)]
        out[j] = cut * np.maximum(np.abs(s), m) - (m - s)
        out[j, [int(p) for p in picks[:j]]] = np.nan
    return out


def supports(logits: np.ndarray, picks, cut: float) -> list[frozenset[int]]:
    """The experts each pick's weight is a softmax over (the pick itself included)."""
    within = margins(logits, picks, cut) >= 0  # NaN (earlier picks) compares False
    return [frozenset(np.flatnonzero(row).tolist()) for row in within]


def cut_gap(ref_logits: np.ndarray, run_logits: np.ndarray, picks, cut: float) -> float | None:
    """None when REF's and RUN's logits weigh every pick over the same experts (with the picks
    ``picks`` both sides chose); otherwise the distance, in REF's logits, to the cut of the expert
    farthest from it among those on different sides (logit units: a near tie when within the
    epsilon of an expert-id swap)."""
    ref, run = margins(ref_logits, picks, cut), margins(run_logits, picks, cut)
    moved = (ref >= 0) != (run >= 0)
    moved &= ~np.isnan(ref)
    if not moved.any():
        return None
    return float(np.max(np.abs(ref[moved])))


def add_cut_rows(routing: Routing, ref_ids: np.ndarray, run_ids: np.ndarray, router: np.ndarray, run_router: np.ndarray,
                 all_rows: bool, cut: float, near_tie: float | None, near_tie_ulps: float) -> None:
    """Adds to ``routing`` (compare/routing.py, the ids key's judgement) a row for each token whose
    ids agree but whose picks REF's and RUN's logits weigh over different experts, judged by
    :func:`cut_gap` against the row's near-tie epsilon; decides again."""
    a = id_rows(np.asarray(ref_ids))  # a decode step's [k]: one row
    b = np.asarray(run_ids).reshape(a.shape)
    ref_rows = router_rows(a.shape[0], np.asarray(router), all_rows)
    run_rows = router_rows(a.shape[0], np.asarray(run_router), all_rows) if np.shape(run_router) == np.shape(router) else {}
    differing = set(routing.differing_rows)
    for row in sorted(set(ref_rows) & set(run_rows) - differing):
        if not np.array_equal(a[row], b[row]):
            continue
        gap = cut_gap(ref_rows[row], run_rows[row], a[row].tolist(), cut)
        if gap is None:
            continue
        entry = RoutingRow(row, a.shape[1], a.shape[1], cut=True)
        if routing.not_top_k is not None:
            entry.reason = (f"REF's ids are not the top-k of its logits ({routing.not_top_k}), so its declared "
                            "sparsemixer cut does not describe it")
        else:
            entry.gap = gap
            entry.epsilon = routing_epsilon(np.asarray(ref_rows[row], np.float64), near_tie, near_tie_ulps)
        routing.rows.append(entry)
    routing.rows.sort(key=lambda entry: entry.row)
    routing.decide()
