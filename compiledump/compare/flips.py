"""What an expert-id flip of a low-precision engine reaches, and what is then not judged.

A token whose expert ids differ without a divergence (a near tie, or a row that no reference
router logits can judge: compare/routing.py) went to other experts, so its later values differ;
so do, from the next layer on, the values of every later token, whose causal attention reads
that token's keys and values. Judging those values against the reference's would report the
flip as a divergence a second time, at a later layer (docs/compare.md, "Expert ids and near
ties"):

* rows a **near tie** reaches are not judged: their difference is honest (status
  ``after_near_tie``);
* rows a flip that **no reference logits judge** reaches are not judged either: whether they
  differ honestly cannot be told (status ``after_unjudged``; the flip itself keeps the pair's
  exit status at 3, "could not tell");
* a float key is judged in the rows no flip reaches, and diverges as before when one of those
  crosses; non-finite mismatches are never excused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .key_record import KeyRecord
from .measure import judge_rows


@dataclass(frozen=True)
class Flip:
    """The first ids key whose ids differ in a token row without a divergence."""

    key: str
    layer: int | None
    near_tie: bool  # False: no reference router logits judged the row


class RoutingFlips:
    """The token rows of the prefill whose expert ids flipped, and which rows of a later key
    each flip reaches."""

    def __init__(self) -> None:
        self._flips: dict[int, Flip] = {}

    def __bool__(self) -> bool:
        return bool(self._flips)

    def add(self, row: int, flip: Flip) -> None:
        self._flips.setdefault(row, flip)

    def reach(self, rows, layer: int | None) -> dict[int, Flip]:
        """{row: the flip that reaches it} for the token ``rows`` of a later key of ``layer``
        (a near tie first, when several do; else the earliest). Within the flip's layer only the
        flipped token itself: the experts and the residual add work token by token. From the next
        layer on (and at keys outside the numbered layers, or after an ids key without a layer
        number) every later token too: causal attention reads the flipped token."""
        attending = sorted((tied, flip) for tied, flip in self._flips.items()
                           if layer is None or flip.layer is None or layer > flip.layer)
        first_any = attending[0] if attending else None
        first_tie = next(((tied, flip) for tied, flip in attending if flip.near_tie), None)
        reached = {}
        for row in rows:
            own = self._flips.get(row)
            if first_tie is not None and first_tie[0] < row:
                reached[row] = first_tie[1]
            elif own is not None and own.near_tie:
                reached[row] = own
            elif first_any is not None and first_any[0] < row:
                reached[row] = first_any[1]
            elif own is not None:
                reached[row] = own
        return reached


def excuse_flips(records: list[KeyRecord]) -> dict[str, list[str]]:
    """Marks, in model order, the prefill keys whose differences only a routing flip before them
    explains (module docstring). Changes ``records`` in place: an ids key's reached rows are
    not judged (``Routing.excuse``); a float key that crossed only in reached rows gets status
    ``after_near_tie`` or ``after_unjudged`` and ``excused_rows``/``excused_by``. Returns
    {ids key: [the float keys whose crossing it excused]}.

    One-row keys hold the last row of the call (that of the ids' last row); all-rows keys a row
    per token."""
    flips = RoutingFlips()
    calls: dict[str, int | None] = {}  # ids key -> its row count (the call's tokens)
    excused: dict[str, list[str]] = {}
    for index, record in enumerate(records):
        if record.phase != "prefill":
            continue
        routing = record.routing
        if record.ids_differ and routing is not None:
            # The run's router noise, over the rows no earlier flip reaches, widens the epsilon.
            disturbed = flips.reach(routing.row_errors, record.layer)
            routing.widen_by_noise([row for row in routing.row_errors if row not in disturbed])
            reached = flips.reach(routing.differing_rows, record.layer)
            if reached:
                routing.excuse({row: flip.key for row, flip in reached.items() if flip.near_tie},
                               {row: flip.key for row, flip in reached.items() if not flip.near_tie})
            status = "mismatch" if routing.divergent else routing.verdict
            records[index] = record = replace(record, status=status, divergent=routing.divergent)
            if not routing.divergent:
                for row in routing.near_tie_rows:
                    flips.add(row, Flip(record.key, record.layer, near_tie=True))
                for row in routing.not_judged_rows:
                    flips.add(row, Flip(record.key, record.layer, near_tie=False))
                calls[record.key] = record.ids.rows
            continue
        if not flips or record.floats is None or not record.divergent or record.metric == "nonfinite":
            continue
        metric, value = record.metric, record.value
        if record.rows is not None and record.divergent_rows:
            # Token rows are the ids' rows only when both hold a call of as many tokens.
            same_call = len(record.rows.rel_diff) in calls.values()
            reached = flips.reach(record.divergent_rows, record.layer) if same_call else {}
            judged = judge_rows(record, record.rows, record.limits, set(reached)) if reached else None
            values = record.rows.rel_diff if metric == "rel_diff" else record.rows.norm_diff
            value = max((values[row] or 0.0) for row in reached) if reached else value  # the excused rows' worst
        else:
            # A one-row key holds the last row of its call: that of the ids' call of as many tokens.
            tokens = record.sides.tokens_ref if record.sides is not None else None
            rows = [count for count in calls.values() if count is not None]
            last = (tokens if tokens is not None else (rows[0] if rows else 0)) - 1
            reached = flips.reach([last], record.layer) if tokens is None or tokens in rows else {}
            judged = replace(record, status="ok", divergent=False, metric=None, value=None) if reached else None
        if judged is None:
            continue
        by = sorted({flip.key for flip in reached.values()})
        near_tie = all(flip.near_tie for flip in reached.values())
        judged = replace(judged, excused_rows=sorted(reached), excused_by=by, excused_metric=metric,
                         excused_value=value, excused_near_tie=near_tie)
        if not judged.divergent:
            judged.status = "after_near_tie" if near_tie else "after_unjudged"
        records[index] = judged
        for key in by:
            excused.setdefault(key, []).append(record.key)
    return excused
