"""The comparator's per-key table (``compiledump compare``'s first lines): one line per key,
its metrics and a note on what it found."""

from __future__ import annotations

import math
from typing import Any

from ..format.keys import chosen
from .key_record import KeyRecord, MergeInfo
from .routing import describe_routing


def fmt_value(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def rows_text(rows: list[int], count: int | None) -> str:
    """``tokens 2, 5 of 7`` (0-based token positions of an all-rows key)."""
    shown = ", ".join(str(row) for row in rows[:12]) + (f", ... ({len(rows) - 12} more)" if len(rows) > 12 else "")
    return f"token{'s' if len(rows) > 1 else ''} {shown}" + (f" of {count}" if count is not None else "")


def worst_rank_text(merge: MergeInfo) -> str:
    """Which rank of a merged side a divergence comes from, as far as it can be told."""
    rank = merge.worst_rank
    if rank is None:
        if merge.identical:
            return ("on every rank, bit-identical: the ranks' values were made equal (an all-reduce or "
                    "all-gather) after the divergence began, so no rank can be named here")
        if merge.how.startswith("sum") and merge.equal_partial_sums:
            # (a helper's EP bring-up declared an all-reduced block output how="sum": 2x the value)
            return (f"merged {merge.how}: but every rank's partial sum is bit-identical, as a value already "
                    "all-reduced is: if it was, it is not a partial sum (drop its declare_shard), and the merged "
                    "value is the ranks' count times it")
        if merge.how.startswith("sum"):
            return f"merged {merge.how}: partial sums, no single rank can be named"
        return f"merged {merge.how}"
    value = merge.worst_rank_value
    if isinstance(value, float):
        detail = f" (rel_diff {value:.3e})"
    else:
        detail = f" ({value} ids differ)" if value is not None else ""
    divergent = merge.divergent_ranks or [rank]
    if merge.how == "each rank":
        if len(divergent) > 1 and len(divergent) == len(merge.merged_ranks or ()):
            return f"on every rank, worst rank {rank}{detail}"
        return f"on rank {'+'.join(divergent)} only, worst rank {rank}{detail}"
    others = f"; parts of ranks {'+'.join(divergent)} diverge" if len(divergent) > 1 else ""
    return f"worst rank {rank}: its part{detail}{others}"


def _note_for(record: KeyRecord) -> str:
    if record.status == "skipped":
        return "not compared (see problems)"
    if record.status == "not_comparable":
        return f"NOT COMPARABLE: {record.reason}"
    parts = []
    if record.divergent_rows and record.status != "shown":
        parts.append(f"diverges at {rows_text(record.divergent_rows, len(record.rows.rel_diff))}")
    elif record.divergent and record.metric == "norm_diff":
        parts.append(f"norm_diff {record.value:.3e} > {record.limits.norm_diff:.1e}")
    if record.excused_rows:
        what = ""
        if record.excused_metric in ("rel_diff", "norm_diff") and record.excused_value is not None:
            what = f"{record.excused_metric} {record.excused_value:.3e} "
        count = (len(record.rows.rel_diff) if record.rows is not None else
                 record.sides.tokens_ref if record.sides is not None else None)  # a one-row key: its call's
        by = ", ".join(record.excused_by)
        if record.step is not None:  # a decode step: its one token's own routing changed
            how = "by a near tie" if record.excused_near_tie else "where no reference router logits judge it"
            parts.append(f"{what}not judged: the step's token went to other {chosen(by)} at {by} ({how})")
        else:
            why = (f"the near tie at {by} routed to other {chosen(by)}" if record.excused_near_tie else
                   f"whose expert ids differ at {by} where no reference router logits judge them")
            parts.append(f"{what}not judged at {rows_text(record.excused_rows, count)}: at or after a token {why}")
    if record.status == "shown":
        parts.append("read to judge this step's expert ids, not judged itself" if record.step is not None
                     else "read to judge the keys its indexer picks, not judged itself")
    ids = record.ids
    if ids is not None:
        if ids.ids_equal:
            parts.append("ids equal")
            if record.routing is not None and record.routing.rows:  # a sparsemixer's weights (compare/cut.py)
                parts.append(describe_routing(record.routing))
        else:
            at = f"row {ids.first_mismatch_row}" if ids.first_mismatch_row is not None \
                else f"index {ids.first_mismatch_index}"
            parts.append(f"IDS DIFFER at {at}: overlap {ids.overlap}/{ids.k}, "
                         f"{ids.mismatched_rows}/{ids.rows} rows differ")
            if record.routing is not None:
                parts.append(describe_routing(record.routing))
    floats = record.floats
    if record.logits and floats.margins.ref.argmax is not None:
        ref, run = floats.margins.ref, floats.margins.run
        flag = "" if record.argmax_equal else " FLIP"
        parts.append(f"argmax {ref.argmax}|{run.argmax}{flag} "
                     f"margin {fmt_value(ref.margin, '.3g')}|{fmt_value(run.margin, '.3g')}")
    if floats is not None and floats.nonfinite_mismatch:
        parts.append(f"{floats.nonfinite_mismatch} NaN/Inf mismatches")
    if record.merge is not None:
        merged = f"ranks {'+'.join(record.merge.merged_ranks)}: {record.merge.how}"
        if record.divergent:
            merged += f"; {worst_rank_text(record.merge)}"
        parts.append(merged)
    return "; ".join(parts)


def format_table(records: list[KeyRecord]) -> list[str]:
    """One line per key in order: ``!`` marks divergent rows, ``*`` ids that differ without
    being a divergence (a near tie, or rows without reference router logits) and what they
    excuse, ``-`` a decode step's router logits (shown, not judged), ``?`` keys not compared,
    ``~`` keys not comparable (values of different phases or token counts)."""
    width = max([len(record.key) for record in records] + [3])
    width = min(width, 48)
    header = (f"  {'key':<{width}} {'layer':>5} {'step':>5} {'shape':<14} {'rel_diff':>10} {'norm_diff':>10} "
              f"{'cosine':>10} {'max_abs':>10} {'mean_abs':>10} {'rel_l2':>9} {'nan':>7} {'inf':>7}  note")
    lines = [header]
    marks = {"skipped": "?", "not_comparable": "~", "near_tie": "*", "not_judged": "*", "after_near_tie": "*",
             "after_unjudged": "*", "shown": "-"}
    for record in records:
        mark = "!" if record.divergent else marks.get(record.status, " ")
        shape = "x".join(str(n) for n in record.shape_ref) or "scalar"
        if record.status == "skipped" and not record.shape_ref:
            shape = "x".join(str(n) for n in record.shape_run) or "-"  # REF could not give it (problems)
        floats = record.floats
        nan = f"{floats.nan_ref}/{floats.nan_run}" if floats else "-"
        inf = f"{floats.inf_ref}/{floats.inf_run}" if floats else "-"
        metrics = [(getattr(floats, name) if floats else None, spec) for name, spec in (
            ("rel_diff", ".3e"), ("norm_diff", ".3e"), ("cosine", ".6f"), ("max_abs", ".3e"), ("mean_abs", ".3e"),
            ("rel_l2", ".2e"))]
        rel_diff, norm_diff, cosine, max_abs, mean_abs, rel_l2 = (fmt_value(value, spec) for value, spec in metrics)
        lines.append(
            f"{mark} {record.key:<{width}} {fmt_value(record.layer, 'd'):>5} {fmt_value(record.step, 'd'):>5} "
            f"{shape:<14} {rel_diff:>10} {norm_diff:>10} {cosine:>10} {max_abs:>10} {mean_abs:>10} {rel_l2:>9} "
            f"{nan:>7} {inf:>7}  {_note_for(record)}".rstrip()
        )
    return lines


__all__ = ["fmt_value", "format_table", "rows_text", "worst_rank_text"]
