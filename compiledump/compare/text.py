"""The comparator's report as terminal lines: the per-key table, the summary and the last line."""

from __future__ import annotations

import math
from typing import Any

from .report import Divergence, KeyRecord, MergeInfo, Report


def fmt_value(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def where(item: Divergence) -> str:
    """`` (layer L, step S)`` for what has a layer or step, else empty."""
    parts = []
    if item.layer is not None:
        parts.append(f"layer {item.layer}")
    if item.step is not None:
        parts.append(f"step {item.step}")
    return f" ({', '.join(parts)})" if parts else ""


def describe_divergence(item: Divergence) -> str:
    """One phrase for a divergence: key, place and the metric that crossed."""
    text = f"{item.key}{where(item)}"
    if item.metric == "rel_diff":
        text += f": rel_diff {item.value:.3e} > threshold {item.threshold:.1e}"
    elif item.metric == "nonfinite":
        text += f": {item.value} positions NaN/Inf on one side only"
    elif item.metric == "ids":
        row = f"row {item.row}" if item.row is not None else "the ids"
        text += f": integer ids differ ({row}, overlap {item.overlap}/{item.k})"
    elif item.metric == "argmax":
        text += f": argmax flip with reference margin {item.value:.4g} >= near-tie epsilon {item.threshold:.3g}"
    if item.merge is not None:
        text += f" [{_worst_rank_text(item.merge)}]"
    return text


def _worst_rank_text(merge: MergeInfo) -> str:
    """Which rank of a merged side a divergence comes from, as far as it can be told."""
    rank = merge.worst_rank
    if rank is None:
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
    parts = []
    ids = record.ids
    if ids is not None:
        if ids.ids_equal:
            parts.append("ids equal")
        else:
            at = f"row {ids.first_mismatch_row}" if ids.first_mismatch_row is not None \
                else f"index {ids.first_mismatch_index}"
            parts.append(f"IDS DIFFER at {at}: overlap {ids.overlap}/{ids.k}, "
                         f"{ids.mismatched_rows}/{ids.rows} rows differ")
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
            merged += f"; {_worst_rank_text(record.merge)}"
        parts.append(merged)
    return "; ".join(parts)


def format_table(records: list[KeyRecord]) -> list[str]:
    """One line per key in order: ``!`` marks divergent rows, ``?`` keys not compared."""
    width = max([len(record.key) for record in records] + [3])
    width = min(width, 48)
    header = (f"  {'key':<{width}} {'layer':>5} {'step':>5} {'shape':<14} {'rel_diff':>10} {'cosine':>10} "
              f"{'max_abs':>10} {'mean_abs':>10} {'rel_l2':>9} {'nan':>7} {'inf':>7}  note")
    lines = [header]
    for record in records:
        mark = "!" if record.divergent else ("?" if record.status == "skipped" else " ")
        shape = "x".join(str(n) for n in record.shape_ref) or "scalar"
        floats = record.floats
        nan = f"{floats.nan_ref}/{floats.nan_run}" if floats else "-"
        inf = f"{floats.inf_ref}/{floats.inf_run}" if floats else "-"
        metrics = [(getattr(floats, name) if floats else None, spec) for name, spec in (
            ("rel_diff", ".3e"), ("cosine", ".6f"), ("max_abs", ".3e"), ("mean_abs", ".3e"), ("rel_l2", ".2e"))]
        rel_diff, cosine, max_abs, mean_abs, rel_l2 = (fmt_value(value, spec) for value, spec in metrics)
        lines.append(
            f"{mark} {record.key:<{width}} {fmt_value(record.layer, 'd'):>5} {fmt_value(record.step, 'd'):>5} "
            f"{shape:<14} {rel_diff:>10} {cosine:>10} {max_abs:>10} {mean_abs:>10} {rel_l2:>9} "
            f"{nan:>7} {inf:>7}  {_note_for(record)}".rstrip()
        )
    return lines


def format_report(report: Report, table: str = "all") -> list[str]:
    """The terminal report: per-pair tables, problems, the summary, and a last line that starts
    with ``first divergence:`` or ``no divergence``. ``table`` is all, divergent or none."""
    lines: list[str] = []
    many = len(report.pairs) > 1
    for pair in report.pairs:
        rank = f"rank {pair.rank}: " if pair.rank != "?" else ""
        lines.append(f"== {rank}REF {pair.ref}  vs  RUN {pair.run}  (threshold {report.options.threshold:.1e})")
        records = pair.keys
        if table == "divergent":
            records = [record for record in records if record.divergent or record.status == "skipped"]
        if table != "none" and records:
            lines.extend(format_table(records))
    for note in report.notes:
        lines.append(f"note: {note}")
    if report.problems:
        lines.append(f"problems: {len(report.problems)}")
        for problem in report.problems:
            at = f" [rank {problem.rank}]" if many and problem.rank is not None else ""
            key = f"{problem.key}: " if problem.key else ""
            lines.append(f"  {problem.kind}{at}: {key}{problem.detail}")
    for pair in report.pairs:
        margins = pair.decode_margins
        if margins:
            prefix = f"rank {pair.rank} " if many else ""
            lines.append(
                f"{prefix}decode margins ({', '.join(margins.tags)}): argmax agrees at "
                f"{margins.argmax_agree}/{margins.compared} steps; smallest reference margin "
                f"{fmt_value(margins.smallest_value, '.4g')} at step {margins.smallest_step}"
            )
    flip = report.first_argmax_flip
    if flip is not None:
        relation = "<" if flip.kind == "near-tie" else ">="
        lines.append(
            f"first argmax flip: step {flip.step} ({flip.key}): {flip.kind} -- reference margin "
            f"{fmt_value(flip.margin_ref, '.4g')} {relation} epsilon {flip.epsilon:.3g} "
            f"(argmax REF {flip.argmax_ref}, RUN {flip.argmax_run})"
        )
    prefill, decode = report.prefill_divergence, report.decode_divergence
    if prefill is not None:
        what = f"layer {prefill.layer}" if prefill.layer is not None else "key"
        lines.append(f"prefill: first divergent {what}: {describe_divergence(prefill)}; "
                     f"last good: {prefill.last_good or 'none (first prefill key)'}")
    if decode is not None:
        lines.append(f"decode: first divergent step {decode.step}: {describe_divergence(decode)}; "
                     f"last good: {decode.last_good or 'none (first decode key)'}")
    if report.first_id_mismatch is not None and report.root_cause is None:
        lines.append(f"ids: first mismatch {describe_divergence(report.first_id_mismatch)}")
    if report.root_cause is not None:
        lines.append(f"likely root cause: {describe_divergence(report.root_cause)}, "
                     f"before the first float divergence")
    lines.append(final_line(report))
    return lines


def final_line(report: Report) -> str:
    """The report's last line: ``first divergence: ...`` or ``no divergence: ...``."""
    first = report.first_divergence
    if first is None:
        compared = sum(pair.compared for pair in report.pairs)
        extra = f"; {len(report.problems)} problems listed above" if report.problems else ""
        flip = report.first_argmax_flip
        tie = f"; near-tie argmax flip at step {flip.step}" if flip is not None else ""
        return f"no divergence: {compared} keys compared, all within threshold{tie}{extra}"
    rank = f" [rank {first.rank}]" if len(report.pairs) > 1 else ""
    last = f"; last good: {first.last_good}" if first.last_good else ""
    cause = report.root_cause
    why = f"; likely root cause: {cause.key}{where(cause)} ids differ" if cause is not None else ""
    return f"first divergence: {describe_divergence(first)}{rank}{last}{why}"
