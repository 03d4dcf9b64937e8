"""Whether an expert-id mismatch is a routing bug or a near tie that rounding flipped.

A top-k router picks the experts with the largest router logits. When two experts' logits are
nearly equal, the rounding of a low-precision engine can swap them: the ids differ, and nothing
is wrong. The reference's router logits of the same layer (``layer<N>_router`` beside
``layer<N>_topk``, as ``compiledump.instrument`` records them) tell the two apart for the rows
they hold: the swap is a **near tie** when every expert the run chose instead scores within
epsilon of every expert it displaced, in the reference's logits.

The rule (docs/compare.md, "Expert ids and near ties"):

* **fp32 class** (both sides' router logits, or else the pair's float keys, are float32/64): any
  id mismatch is a divergence; rounding noise there is far below any plausible gap.
* **low-precision classes** (bf16, fp16, fp8, and ``legacy``: a side without a manifest): an id
  mismatch is a divergence when a differing row's reference logits show a gap above epsilon
  (``far``). When every differing row is a near tie, or some rows have no reference logits to
  judge them by (``not_judged``: one-row mode keeps the last row only), the mismatch is reported
  but is not itself a divergence; any float key that diverges after it still names it as the
  likely root cause. What such a flip reaches in later keys is not judged (compare/flips.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..format.keys import chosen
from ..format.routers import UNKNOWN, RouterInfo
from .metrics import bf16_spacing, id_rows
from .selection import UNKNOWN_RULE, first_unexplained, row_gap, score_rounding_epsilon

STRICT_CLASSES = ("fp32",)
# Most rows listed per routing record (JSON) and in a text line.
MAX_LISTED_ROWS = 64


@dataclass
class RoutingRow:
    """One differing row of an ids key, judged against the reference's router logits.

    ``gap`` (logit units) is the largest score by which a displaced expert beats an expert the
    run chose instead (and, when the sets agree, by which the run's order contradicts the
    reference scores); None when the row could not be judged (``reason`` says why)."""

    row: int
    overlap: int
    k: int
    # RUN lists exactly REF's experts in another order: the MoE output is the same weighted sum
    # (only the order of its rounding may differ), so this is no routing change, whatever the scores
    # (but for a sparsemixer, whose picks are weighed in order: compare/cut.py).
    same_set: bool = False
    gap: float | None = None
    epsilon: float | None = None
    reason: str | None = None  # why the row was not judged
    after_near_tie: str | None = None  # an earlier ids key whose near tie reaches this token (flips.py)
    after_unjudged: str | None = None  # else one whose rows no reference logits judge reaches it
    score_rounding: bool = False  # epsilon is the rounding of the choice scores (RouterInfo.rounded)
    # The ids agree, but an expert is on either side of a pick's sparsemixer cut (compare/cut.py):
    # ``gap`` is its distance to the cut in REF's logits; the token's MoE output differs all the same.
    cut: bool = False

    @property
    def judged(self) -> bool:
        return self.gap is not None

    @property
    def near_tie(self) -> bool | None:
        return None if self.gap is None else self.gap <= self.epsilon

    def to_json(self) -> dict:
        return {"row": self.row, "overlap": self.overlap, "k": self.k, "gap": self.gap, "epsilon": self.epsilon,
                "near_tie": self.near_tie, "reason": self.reason, "after_near_tie": self.after_near_tie,
                "after_unjudged": self.after_unjudged, "cut": self.cut}

    @property
    def reached(self) -> bool:
        """An earlier routing flip reaches this token: its ids here are not judged by themselves."""
        return self.after_near_tie is not None or self.after_unjudged is not None


@dataclass
class Routing:
    """The judgement of one ids key whose ids differ.

    ``verdict``: ``divergence`` (fp32 class, or a row far from a tie), ``near_tie`` (every
    differing row a near tie) or ``not_judged`` (no row far from a tie, some rows without
    reference logits)."""

    klass: str  # the precision class the rule used
    class_from: str  # "router" (the router key's source dtypes) | "pair" (the pair's float keys)
    router_key: str | None  # the reference logits used, None when absent
    router_rows: list[int]  # the ids rows the reference logits cover
    rows: list[RoutingRow] = field(default_factory=list)
    not_top_k: str | None = None  # a REF row (any layer) whose ids are not the top-k of its logits
    verdict: str = "divergence"
    # The largest |REF - RUN| router logit of each covered row (RUN's logits of the same shape).
    row_errors: dict[int, float] = field(default_factory=dict)
    logit_noise: float | None = None  # the largest of them over quiet rows (widen_by_noise)
    fixed_epsilon: bool = False  # --near-tie EPS: the epsilon stays as given
    capacity: bool = False  # the router caps each expert's tokens (RouterInfo.capacity)
    # For such a router: {differing row: the later rows of the call whose experts (REF's or RUN's)
    # include one that row left or took}, whose place in that expert's queue it moved (flips.py)
    capacity_reach: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def differing_rows(self) -> list[int]:
        return [row.row for row in self.rows]

    def _flipped(self, row: RoutingRow) -> bool:
        """A row whose experts changed. The same experts in another order are none, in every
        class: the MoE output is the same weighted sum (fused top-k kernels sort their output,
        Hugging Face's DeepSeek-V3 asks torch.topk for sorted=False)."""
        return not row.same_set

    @property
    def reordered_rows(self) -> list[int]:
        """The same experts in another order (not a routing flip)."""
        return [row.row for row in self.rows if not self._flipped(row)]

    @property
    def flipped_rows(self) -> list[int]:
        """The rows whose experts changed (not only their order)."""
        return [row.row for row in self.rows if self._flipped(row)]

    @property
    def reorder_only(self) -> bool:
        """Every differing row lists the same experts in another order: no token's experts changed."""
        return bool(self.rows) and not self.flipped_rows

    @property
    def near_tie_rows(self) -> list[int]:
        return [row.row for row in self.rows if row.near_tie is True and self._flipped(row) and not row.reached]

    @property
    def far_rows(self) -> list[int]:
        return [row.row for row in self.rows if row.near_tie is False and self._flipped(row) and not row.reached]

    @property
    def not_judged_rows(self) -> list[int]:
        """Rows without reference logits to judge them, and rows an earlier unjudged flip reaches."""
        return [row.row for row in self.rows if row.after_near_tie is None and self._flipped(row)
                and (not row.judged or row.after_unjudged is not None)]

    @property
    def after_near_tie_rows(self) -> list[int]:
        """Rows an earlier near tie reaches (routed elsewhere, or attending to a token that was):
        their ids here are a consequence."""
        return [row.row for row in self.rows if row.after_near_tie is not None]

    def decide(self) -> None:
        """Set ``verdict`` from the rows (the rule in the module docstring)."""
        if self.far_rows or (self.klass in STRICT_CLASSES and not self.reorder_only):
            self.verdict = "divergence"
        elif self.not_judged_rows:
            self.verdict = "not_judged"
        else:
            self.verdict = "near_tie"

    @property
    def after_unjudged_rows(self) -> list[int]:
        """Rows an earlier flip that no reference logits judge reaches: whether these differ
        honestly cannot be told."""
        return [row.row for row in self.rows if row.after_near_tie is None and row.after_unjudged is not None]

    def widen_by_noise(self, quiet_rows) -> None:
        """Measure the run's router noise in this layer: the largest logit error over
        ``quiet_rows`` (rows no earlier flip reaches) whose ids agree. Two logits each that far
        off can swap experts whose reference logits differ by twice as much, so each judged
        row's epsilon is at least twice the noise (unless --near-tie fixed it). Decides again."""
        differing = set(self.differing_rows)
        quiet = [error for row, error in self.row_errors.items() if row in quiet_rows and row not in differing]
        if quiet:
            self.take_noise(max(quiet))

    def take_noise(self, noise: float) -> None:
        """Widen each judged row's epsilon to twice ``noise``, the run's router noise in this
        layer (measured here, or in the prefill rows of the same layer for a decode step's ids:
        flips.py). Decides again."""
        if self.fixed_epsilon or self.klass in STRICT_CLASSES:
            return
        self.logit_noise = noise
        for row in self.rows:
            if row.gap is not None:
                row.epsilon = max(row.epsilon, 2 * noise)
        self.decide()

    def excuse(self, near_ties: dict[int, str], unjudged: dict[int, str]) -> None:
        """Rows an earlier routing flip reaches (flips.py: {row: that ids key}) are not judged here
        (low-precision classes only): those of a near tie are a consequence, those of an
        unjudged flip may be. The verdict is decided again."""
        if self.klass in STRICT_CLASSES:
            return
        for row in self.rows:
            if self._flipped(row):  # a reorder stays a reorder, reached or not
                row.after_near_tie = near_ties.get(row.row)
                row.after_unjudged = unjudged.get(row.row) if row.after_near_tie is None else None
        self.decide()

    @property
    def worst(self) -> RoutingRow | None:
        """The judged row with the largest gap/epsilon."""
        judged = [row for row in self.rows if row.judged]
        return max(judged, key=lambda row: _ratio(row.gap, row.epsilon)) if judged else None

    @property
    def divergent(self) -> bool:
        return self.verdict == "divergence"

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "class": self.klass, "class_from": self.class_from,
                "router_key": self.router_key, "router_rows": self.router_rows[:MAX_LISTED_ROWS],
                "differing_rows": len(self.rows), "near_tie_rows": self.near_tie_rows[:MAX_LISTED_ROWS],
                "far_rows": self.far_rows[:MAX_LISTED_ROWS], "not_judged_rows": self.not_judged_rows[:MAX_LISTED_ROWS],
                "after_near_tie_rows": self.after_near_tie_rows[:MAX_LISTED_ROWS],
                "after_unjudged_rows": self.after_unjudged_rows[:MAX_LISTED_ROWS],
                "reordered_rows": self.reordered_rows[:MAX_LISTED_ROWS], "not_top_k": self.not_top_k,
                "logit_noise": self.logit_noise, "capacity": self.capacity,
                "rows": [row.to_json() for row in self.rows[:MAX_LISTED_ROWS]]}


def _ratio(gap: float, epsilon: float) -> float:
    return gap / epsilon if epsilon > 0 else (math.inf if gap > 0 else 0.0)


def routing_epsilon(logits: np.ndarray, near_tie: float | None, near_tie_ulps: float) -> float:
    """The near-tie epsilon of one row of router logits: ``near_tie`` when given (--near-tie),
    else ``near_tie_ulps`` bf16 spacings of the row's largest absolute logit."""
    if near_tie is not None:
        return near_tie
    finite = logits[np.isfinite(logits)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    return near_tie_ulps * bf16_spacing(scale)


def router_rows(ids_rows: int, router: np.ndarray | None, all_rows: bool) -> dict[int, np.ndarray]:
    """The reference logits of each ids row they cover: every row for a ``[rows, experts]``
    array (all-rows mode), the last row for a 1-D ``[experts]`` one (one-row mode keeps the
    last row of the call)."""
    if router is None:
        return {}
    if router.ndim == 2 and router.shape[0] == ids_rows:
        return {row: router[row] for row in range(ids_rows)}
    if router.ndim == 1 and not all_rows:
        return {ids_rows - 1: router}
    return {}


def top_k_counterexample(ids: np.ndarray, router: np.ndarray, all_rows: bool,
                         selection: RouterInfo | None = None) -> int | None:
    """A row whose reference ids are not the top-k of its router logits, or, for a declared
    ``selection`` that is not plain top-k, not what it selects (None: every row the logits cover
    is explained, as far as these rows tell)."""
    a = id_rows(np.asarray(ids))
    return first_unexplained(router_rows(a.shape[0], np.asarray(router), all_rows), a, selection)


def judge_routing(ref_ids: np.ndarray, run_ids: np.ndarray, router: np.ndarray | None, router_key: str | None,
                  all_rows: bool, klass: str, class_from: str, near_tie: float | None, near_tie_ulps: float,
                  unavailable: str | None = None, not_top_k: str | None = None,
                  run_router: np.ndarray | None = None, selection: RouterInfo | None = None) -> Routing:
    """Judge the differing rows of an ids key (equal sizes on both sides) by the reference's
    router logits ``router`` (None when absent; ``unavailable`` then says why) under the
    precision class ``klass``. ``not_top_k`` names a row of the reference (of any layer) whose
    ids are not the top-k of its router logits: the model routes by more than those logits (a
    bias, or DeepSeek-V3's group-limited top-k), so their gaps judge no row. ``run_router``
    (RUN's logits, when of the same shape) gives each covered row's logit error, from which
    ``Routing.widen_by_noise`` measures the run's noise once the rows earlier flips reach are known.
    ``selection``: the router's declared selection (format/routers.py), None for plain top-k."""
    a = id_rows(np.asarray(ref_ids))
    b = np.asarray(run_ids).reshape(a.shape)
    covered = router_rows(a.shape[0], None if router is None else np.asarray(router), all_rows)
    if router is not None and not covered:
        why = f"{router_key} has shape {list(np.shape(router))}, not one row or {a.shape[0]} rows of router logits"
    elif router is None:
        why = unavailable or (f"REF has no {router_key}" if router_key is not None
                              else "no router logits recorded beside these ids (<prefix>_router for <prefix>_topk)")
    else:
        why = f"REF {router_key} holds row{'s' if len(covered) > 1 else ''} {_row_list(sorted(covered))} only"
    routing = Routing(klass, class_from, router_key if router is not None else None, sorted(covered),
                      not_top_k=not_top_k, fixed_epsilon=near_tie is not None,
                      capacity=selection is not None and selection.capacity)
    if run_router is not None and router is not None and np.shape(run_router) == np.shape(router):
        run_covered = router_rows(a.shape[0], np.asarray(run_router), all_rows)
        for row, logits in covered.items():
            ref_row, run_row = np.asarray(logits, np.float64), np.asarray(run_covered[row], np.float64)
            both = np.isfinite(ref_row) & np.isfinite(run_row)  # an indexer's masked keys are -inf on both
            finite = np.abs(ref_row[both] - run_row[both])
            if finite.size:
                routing.row_errors[row] = float(finite.max())
    for row in np.flatnonzero(np.any(a != b, axis=1)).tolist():
        ref_set, run_set = set(a[row].tolist()), set(b[row].tolist())
        # A sparsemixer weighs its first pick over other experts than its second: order matters there.
        same_set = ref_set == run_set and (selection is None or selection.cut is None)
        entry = RoutingRow(row, len(ref_set & run_set), len(ref_set), same_set=same_set)
        if routing.capacity:
            moved = list(ref_set ^ run_set)  # the experts the row left and took
            queued = np.isin(a[row + 1:], moved).any(axis=1) | np.isin(b[row + 1:], moved).any(axis=1)
            routing.capacity_reach[row] = tuple((row + 1 + np.flatnonzero(queued)).tolist())
        if selection is not None and selection.score == UNKNOWN:
            entry.reason = UNKNOWN_RULE  # covered or not: no logits would judge it
        elif row in covered and not_top_k is not None and selection is not None and not selection.plain:
            entry.reason = (f"REF's ids are not what its declared router ({selection.describe()}) selects "
                            f"({not_top_k}): the declaration does not describe this model, so it judges no row")
        elif row in covered and not_top_k is not None:
            entry.reason = (f"REF routes by more than its router logits ({not_top_k}: ids not what they select; a "
                            "bias or expert groups, as DeepSeek-V3's, need compiledump.declare_router), so their "
                            "gaps cannot tell a near tie")
        elif row in covered:
            logits = np.asarray(covered[row], np.float64)
            entry.gap, entry.reason = row_gap(logits, a[row], b[row], selection)
            if entry.gap is not None:
                entry.epsilon = routing_epsilon(logits, near_tie, near_tie_ulps)
                rounding = (None if near_tie is not None or selection is None
                            else score_rounding_epsilon(selection, logits, a[row], b[row], near_tie_ulps))
                if rounding is not None and rounding > entry.epsilon:
                    entry.epsilon, entry.score_rounding = rounding, True
        else:
            entry.reason = why
        routing.rows.append(entry)
    routing.decide()
    return routing


def _row_list(rows: list[int], limit: int = 12) -> str:
    shown = ", ".join(str(row) for row in rows[:limit])
    return shown + (f", ... ({len(rows) - limit} more)" if len(rows) > limit else "")


def describe_routing(routing: Routing) -> str:
    """One phrase: why the mismatch is or is not a divergence."""
    total = len(routing.rows)
    if routing.klass in STRICT_CLASSES and not routing.reorder_only:
        worst = routing.worst
        text = f"a divergence in the {routing.klass} class, where each token's experts must match"
        if worst is not None:
            text += f" (largest router logit gap {worst.gap:.3g} at row {worst.row}; near-tie epsilon {worst.epsilon:.3g})"
        return text
    if routing.far_rows:
        far = [row for row in routing.rows if row.row in routing.far_rows]
        top = max(far, key=lambda row: _ratio(row.gap, row.epsilon))
        gap = (top.reason if math.isinf(top.gap) and top.reason else
               f"an expert {top.gap:.3g} from the sparsemixer cut (> epsilon {top.epsilon:.3g}) weighed on one side "
               "only, the ids equal" if top.cut else f"router logit gap {top.gap:.3g} > epsilon {top.epsilon:.3g}")
        return (f"not a near tie: {gap} at row {top.row} "
                f"({len(far)}/{total} differing rows far from a tie): a divergence in the {routing.klass} class")
    parts = []
    if routing.after_near_tie_rows:
        rows = routing.after_near_tie_rows
        earlier = sorted({row.after_near_tie for row in routing.rows if row.after_near_tie is not None})
        parts.append(f"row{'s' if len(rows) > 1 else ''} {_row_list(rows)} at or after a token the near tie at "
                     f"{', '.join(earlier)} routed elsewhere")
    if routing.reordered_rows:
        rows = routing.reordered_rows
        parts.append(f"row{'s' if len(rows) > 1 else ''} {_row_list(rows)}: the same {chosen(routing.router_key)} "
                     "in another order")
    ties = [row for row in routing.rows if row.row in routing.near_tie_rows]
    for cut, group in ((False, [row for row in ties if not row.cut]), (True, [row for row in ties if row.cut])):
        if not group:
            continue
        top = max(group, key=lambda row: _ratio(row.gap, row.epsilon))
        noise = (", twice the run's router noise in this layer" if routing.logit_noise is not None
                 and top.epsilon == 2 * routing.logit_noise else
                 ", the rounding of its choice scores in the run's precision" if top.score_rounding else "")
        rows = f"row{'s' if len(group) > 1 else ''} {_row_list([row.row for row in group])}"
        parts.append(f"the same experts weighed over another sparsemixer cut at {rows} (an expert {top.gap:.3g} "
                     f"from the cut <= epsilon {top.epsilon:.3g}{noise})" if cut else
                     f"near tie at {rows} (router logit gap {top.gap:.3g} <= epsilon {top.epsilon:.3g}{noise})")
    if routing.after_unjudged_rows:
        rows = routing.after_unjudged_rows
        earlier = sorted({row.after_unjudged for row in routing.rows if row.row in rows})
        parts.append(f"row{'s' if len(rows) > 1 else ''} {_row_list(rows)} at or after a token whose expert ids "
                     f"differ at {', '.join(earlier)} where no reference router logits judge them")
    rows = [row for row in routing.not_judged_rows if row not in routing.after_unjudged_rows]
    if rows:
        reasons = sorted({row.reason for row in routing.rows if not row.judged and row.row in rows})
        parts.append(f"row{'s' if len(rows) > 1 else ''} {_row_list(rows)} not judged ({'; '.join(reasons)})")
    return "; ".join(parts) + f"; not a divergence in the {routing.klass} class"
