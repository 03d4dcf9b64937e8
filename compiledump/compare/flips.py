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
  crosses; non-finite mismatches are never excused;
* a decode step holds one token after the prompt's: its expert ids (``layer<N>_step_topk_<n>``)
  follow the same reach, its float keys are excused by its own flip only (the decode-step
  thresholds allow for what reaches a step through attention).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .key_record import KeyRecord
from .measure import judge_rows
from ..format.keys import router_key_for


@dataclass(frozen=True)
class Flip:
    """The first ids key whose ids differ in a token row without a divergence."""

    key: str
    layer: int | None
    near_tie: bool  # False: no reference router logits judged the row
    # Its router caps each expert's tokens: the later tokens of its call, in its own layer, routed to an
    # expert it left or took (Routing.capacity_reach), whose place in that expert's queue it moved.
    queued: frozenset[int] = frozenset()


class RoutingFlips:
    """The token rows whose expert ids flipped (the prompt's, then one per decode step), and
    which rows of a later key each flip reaches."""

    def __init__(self) -> None:
        self._flips: dict[int, Flip] = {}

    def __bool__(self) -> bool:
        return bool(self._flips)

    def add(self, row: int, flip: Flip) -> None:
        self._flips.setdefault(row, flip)

    def own(self, row: int) -> Flip | None:
        """The flip of token ``row`` itself, which reaches every later key of that token (the
        rest of the flip's layer included), else None."""
        return self._flips.get(row)

    def reach(self, rows, layer: int | None) -> dict[int, Flip]:
        """{row: the flip that reaches it} for the token ``rows`` of a later key of ``layer``
        (a near tie first, when several do; else the earliest). Within the flip's layer only the
        flipped token itself: the experts and the residual add work token by token (but where the
        router caps each expert's tokens, also the later tokens of its call routed to an expert it
        left or took: it moved their place in that expert's queue, which may drop or spare them;
        a decode step's call routes its own token alone). From the next layer on (and at keys outside
        the numbered layers, or after an ids key without a layer number) every later token too: causal
        attention reads the flipped token."""
        attending = sorted((tied, flip) for tied, flip in self._flips.items()
                           if layer is None or flip.layer is None or layer > flip.layer)
        first_any = attending[0] if attending else None
        first_tie = next(((tied, flip) for tied, flip in attending if flip.near_tie), None)
        queued = sorted(((tied, flip) for tied, flip in self._flips.items() if flip.queued and flip.layer == layer),
                        key=lambda item: (not item[1].near_tie, item[0]))  # a near tie first
        reached = {}
        for row in rows:
            own = self._flips.get(row)
            if own is None or not own.near_tie:
                own = next((flip for _, flip in queued if row in flip.queued), own)
            if first_tie is not None and first_tie[0] < row:
                reached[row] = first_tie[1]
            elif own is not None and own.near_tie:
                reached[row] = own
            elif first_any is not None and first_any[0] < row:
                reached[row] = first_any[1]
            elif own is not None:
                reached[row] = own
        return reached


def excuse_flips(records: list[KeyRecord], step_zero_in_prompt: bool = False) -> dict[str, list[str]]:
    """Marks, in model order, the keys whose differences only a routing flip before them
    explains (module docstring). Changes ``records`` in place: an ids key's reached rows are
    not judged (``Routing.excuse``); a float key that crossed only in reached rows gets status
    ``after_near_tie`` or ``after_unjudged`` and ``excused_rows``/``excused_by``. Returns
    {ids key: [the float keys whose crossing it excused]}.

    Prefill: one-row keys hold the last row of the call (that of the ids' last row); all-rows
    keys a row per token. Decode steps: each step's keys hold one token, after the prompt's,
    whose routing the step's ids keys (``layer<N>_step_topk_<n>``) record (docs/compare.md,
    "Decode steps"). With ``step_zero_in_prompt`` (instrument's steps count forwards, the prefill
    first) step 0 is the prompt's last token, so a flip of that token in the prefill's ids is
    step 0's own (an engine's gates record no step ids to say so again)."""
    excused: dict[str, list[str]] = {}
    flips = RoutingFlips()
    prompt, noise = _excuse_prefill(records, flips, excused)
    _excuse_steps(records, flips, prompt - 1 if step_zero_in_prompt and prompt else prompt, noise, excused)
    return excused


def _excuse_prefill(records: list[KeyRecord], flips: RoutingFlips,
                    excused: dict[str, list[str]]) -> tuple[int, dict[int | None, float]]:
    """The prefill part of :func:`excuse_flips` (its flips go to ``flips``); returns the
    prompt's row count (that of the prefill ids, 0 without any) and the run's router noise per
    layer where the prefill measured it."""
    calls: dict[str, int | None] = {}  # ids key -> its row count (the call's tokens)
    noise: dict[int | None, float] = {}
    prompt = 0
    for index, record in enumerate(records):
        if record.phase != "prefill":
            continue
        routing = record.routing
        if record.ids is not None and len(record.shape_ref) == 2:
            prompt = max(prompt, record.shape_ref[0])  # ids [tokens, k] of the prompt
        if record.routing_differs and routing is not None:
            # The run's router noise, over the rows no earlier flip reaches, widens the epsilon.
            disturbed = flips.reach(routing.row_errors, record.layer)
            routing.widen_by_noise([row for row in routing.row_errors if row not in disturbed])
            if routing.logit_noise is not None:
                noise[record.layer] = routing.logit_noise
            if _judge_flip(records, index, flips):
                # (ids that agree, a sparsemixer's cut flip, count no rows: their shape does)
                calls[record.key] = record.ids.rows or (record.shape_ref[0] if len(record.shape_ref) >= 2 else 1)
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
            judged = _cleared(record) if reached else None
        if judged is not None:
            _excuse(records, index, judged, reached, metric, value, excused)
    return prompt, noise


def _excuse_steps(records: list[KeyRecord], flips: RoutingFlips, step_zero: int, noise: dict[int | None, float],
                  excused: dict[str, list[str]]) -> None:
    """The decode-step part of :func:`excuse_flips`. Step n's keys hold one token, taken as row
    ``step_zero + n`` (the prompt's rows before it): its ids are not judged where a flip reaches them
    (its own in an earlier layer, or through attention one of any earlier token, prompt or
    step, in an earlier layer), as in the prefill; its float keys are not judged where its own
    flip reaches them, and keep the decode-step thresholds, which allow for what reaches a step
    through attention, otherwise. A step's ids take the run's router noise of their layer: in
    the prefill, and in the steps whose routing nothing can have disturbed (_quiet_step_noise)."""
    step_noise = _quiet_step_noise(records)
    for index, record in enumerate(records):
        if record.phase != "decode" or record.step is None:
            continue
        row = step_zero + record.step
        routing = record.routing
        if record.routing_differs and routing is not None:
            if len(routing.rows) != 1 or routing.rows[0].row != 0:
                continue  # not one token's ids (a hand-written step of [tokens, k]): judged alone
            widest = max((value for value in (noise.get(record.layer), step_noise.get(record.layer))
                          if value is not None), default=None)
            if widest is not None:
                routing.take_noise(widest)
            _judge_flip(records, index, flips, first_row=row)
            continue
        if not flips or record.floats is None or not record.divergent or record.metric == "nonfinite":
            continue
        own = flips.own(row)
        if own is not None:
            # Rows of a step key are the step's own: its one row is row 0.
            _excuse(records, index, _cleared(record), {0: own}, record.metric, record.value, excused)


def _judge_flip(records: list[KeyRecord], index: int, flips: RoutingFlips, first_row: int = 0) -> bool:
    """Judges the differing ids of ``records[index]`` after the flips before it (their reached
    rows are not judged), updates the record, and adds its own flips to ``flips``. Its row r is
    token row ``first_row + r`` (a decode step's one row follows the prompt's). Returns whether
    the ids flipped without a divergence."""
    record = records[index]
    routing = record.routing
    reached = flips.reach([first_row + row for row in routing.differing_rows], record.layer)
    if reached:
        routing.excuse({row - first_row: flip.key for row, flip in reached.items() if flip.near_tie},
                       {row - first_row: flip.key for row, flip in reached.items() if not flip.near_tie})
    status = "mismatch" if routing.divergent else routing.verdict
    records[index] = record = replace(record, status=status, divergent=routing.divergent)
    if routing.divergent:
        return False
    # A row an earlier near tie reaches went to other experts here too, honestly: it is that
    # token's own flip from this layer on (in the prompt the earlier tie already reaches all it
    # reaches; a decode step's float keys are excused by their token's own flip only).
    def flip(row: int, near_tie: bool) -> Flip:
        queued = frozenset(first_row + later for later in routing.capacity_reach.get(row, ()))
        return Flip(record.key, record.layer, near_tie=near_tie, queued=queued)
    for row in routing.near_tie_rows + routing.after_near_tie_rows:
        flips.add(first_row + row, flip(row, True))
    for row in routing.not_judged_rows:
        flips.add(first_row + row, flip(row, False))
    return True


def _quiet_step_noise(records: list[KeyRecord]) -> dict[int | None, float]:
    """{layer: the largest router logit error of a decode step whose routing nothing can have
    disturbed}: the step's ids agree in that layer, no ids differ in an earlier layer in the
    prompt or in that or an earlier step (whatever the verdict), and no float key of the step
    diverges (a step something is wrong in is no measure of noise). A step's router key holds
    one row, so its ``max_abs`` is that row's error."""
    floats = {record.key: record for record in records if record.floats is not None}
    wrong = {record.step for record in records if record.phase == "decode" and record.divergent
             and record.floats is not None}
    lowest = min((record.layer for record in records if record.phase == "prefill" and record.routing_differs
                  and record.layer is not None), default=None)
    noise: dict[int | None, float] = {}
    # Records are in model order: decode steps by step, then in capture order.
    for record in (r for r in records if r.phase == "decode" and r.ids is not None and r.step is not None):
        if record.routing_differs and record.layer is not None:
            lowest = record.layer if lowest is None else min(lowest, record.layer)
            continue
        router = floats.get(router_key_for(record.key, step=True) or "")
        quiet = (lowest is None or record.layer is None or record.layer <= lowest) and record.step not in wrong
        if record.routing_differs or not quiet or router is None or router.floats.max_abs is None:
            continue
        noise[record.layer] = max(noise.get(record.layer, 0.0), router.floats.max_abs)
    return noise


def _cleared(record: KeyRecord) -> KeyRecord:
    """A one-row key whose only row a flip reaches: nothing of it is judged."""
    return replace(record, status="ok", divergent=False, metric=None, value=None)


def _excuse(records: list[KeyRecord], index: int, judged: KeyRecord, reached: dict[int, Flip], metric, value,
            excused: dict[str, list[str]]) -> None:
    """Stores ``judged`` (``records[index]`` judged without the ``reached`` rows) with what was
    excused and by which flips."""
    by = sorted({flip.key for flip in reached.values()})
    near_tie = all(flip.near_tie for flip in reached.values())
    judged = replace(judged, excused_rows=sorted(reached), excused_by=by, excused_metric=metric,
                     excused_value=value, excused_near_tie=near_tie)
    if not judged.divergent:
        judged.status = "after_near_tie" if near_tie else "after_unjudged"
    records[index] = judged
    for key in by:
        excused.setdefault(key, []).append(records[index].key)


def argmax_flip_kind(record: KeyRecord, margin: float, epsilon: float) -> str:
    """``near-tie`` (reference margin below epsilon), ``after-routing-flip`` (the step's token
    went to other experts in an earlier layer without a divergence: its logits are not judged,
    above), ``within-thresholds`` (the step's logits stay within the decode-step
    defaults of a low-precision class, which an unrecorded routing flip of the decoded token
    reaches: docs/compare.md) or ``divergence``."""
    if margin < epsilon:
        return "near-tie"
    if record.status in ("after_near_tie", "after_unjudged"):
        return "after-routing-flip"
    limits = record.limits
    if (not record.divergent and limits is not None and limits.rel_source.endswith(" decode")
            and limits.norm_source.endswith(" decode")):
        return "within-thresholds"
    return "divergence"
