"""The comparator's report as terminal lines: the per-key table (:mod:`.table`), problems, the
summary and the last line."""

from __future__ import annotations

from ..format import spec
from ..format.keys import chosen
from .facts import threshold_uses
from .options import pair_class
from .overwrites import CHUNKED, SHIFTED, WRITTEN_AGAIN, written_again_lines
from .phases import fix_hint, tokens_text
from .report import Divergence, PairResult, Report
from .routing import describe_routing
from .step_drops import STEP_DROPS
from .table import fmt_value, format_table, rows_text, worst_rank_text


def nonfinite_text(entry: dict) -> str:
    """A manifest `first_nonfinite` entry: ``layer3 (decode, step 5); 12 NaN/Inf values in tag layer3``."""
    phase, step = entry.get("phase"), entry.get("step")
    when = "prefill" if phase == "prefill" else ", ".join(
        part for part in (phase, f"step {step}" if step is not None else None) if part)
    count = entry.get("count")
    many = f"{'at least ' if entry.get('saturated') else ''}{count} NaN/Inf value{'' if count == 1 else 's'}"
    return f"{entry['key']} ({when or 'call unknown'}); {many} in tag {entry.get('tag')}"


def where(item: Divergence) -> str:
    """`` (layer L, step S)`` for what has a layer or step, else empty."""
    parts = []
    if item.layer is not None:
        parts.append(f"layer {item.layer}")
    if item.step is not None:
        parts.append(f"step {item.step}")
    return f" ({', '.join(parts)})" if parts else ""


# What a key named by no layer holds, said beside it when it diverges first.
MEANINGS = {spec.INPUT_EMBEDS_TAG: "the first layer's input, token embeddings plus any tower features merged in",
            spec.ENCODER_OUTPUT_TAG: "the encoder's output, its first source row, which the decoder attends to"}


def describe_divergence(item: Divergence) -> str:
    """One phrase for a divergence: key, place and the metric that crossed."""
    text = f"{item.key}{where(item)}" + (f" ({MEANINGS[item.key]})" if item.key in MEANINGS else "")
    if item.metric in ("rel_diff", "norm_diff"):
        text += f": {item.metric} {item.value:.3e} > threshold {item.threshold:.1e}"
        if item.divergent_rows:
            text += f" at {rows_text(item.divergent_rows, item.row_count)}"
    elif item.metric == "nonfinite":
        text += f": {item.value} positions NaN/Inf on one side only"
    elif item.metric == "ids":
        row = f"row {item.row}" if item.row is not None else "the ids"
        text += f": integer ids differ ({row}, overlap {item.overlap}/{item.k})"
        if item.routing_verdict in ROUTING_WORDS:
            text += f" [{ROUTING_WORDS[item.routing_verdict]}]"
    elif item.metric == "argmax":
        text += f": argmax flip with reference margin {item.value:.4g} >= near-tie epsilon {item.threshold:.3g}"
    if item.merge is not None:
        text += f" [{worst_rank_text(item.merge)}]"
    return text


# How a non-divergent id mismatch is named in one phrase.
ROUTING_WORDS = {"near_tie": "near tie", "not_judged": "not judged"}


def _routing_word(item) -> str:
    """How an ids mismatch is summed up in the last line: its verdict, or that its rows only
    list the same experts in another order."""
    if item.routing is not None and item.routing.reorder_only:
        return f"same {chosen(item.key)}, reordered"
    word = ROUTING_WORDS.get(item.routing_verdict, "divergence")
    if item.routing is not None and item.routing.rows and all(row.cut for row in item.routing.rows):
        return f"weights: {word}"  # the ids agree, a sparsemixer cut does not (compare/cut.py)
    return word


def format_report(report: Report, table: str = "all") -> list[str]:
    """The terminal report: per-pair tables, problems, the summary, and a last line that starts
    with ``first divergence:`` or ``no divergence``. ``table`` is all, divergent or none."""
    lines: list[str] = []
    many = len(report.pairs) > 1
    for pair in report.pairs:
        rank = f"rank {pair.rank}: " if pair.rank != "?" else ""
        lines.append(f"== {rank}REF {pair.ref}  vs  RUN {pair.run}")
        records = pair.keys
        if table == "divergent":
            # The marked rows (!, *, ?, ~); a decode step's router logits (-) are shown, never judged.
            records = [record for record in records if record.divergent or record.status not in ("ok", "shown")]
        if table != "none" and records:
            lines.extend(format_table(records))
    for note in report.notes:
        lines.append(f"note: {note}")
    for pair in report.pairs:  # found by the capture kernels, no reference needed: ahead of divergences
        prefix = f"rank {pair.rank} " if many else ""
        for side in ("RUN", "REF"):
            if pair.nonfinite.get(side):
                lines.append(f"{prefix}{side} first non-finite: {nonfinite_text(pair.nonfinite[side])}")
    for pair in report.pairs:
        prefix = f"rank {pair.rank} " if many else ""
        lines.extend(f"{prefix}{line}" for line in threshold_lines(pair))
        for line in (not_comparable_line(pair), *written_again_lines(pair.not_comparable), fed_tokens_line(pair),
                     *unseen_flip_lines(pair), *step_drops_lines(pair)):
            if line is not None:
                lines.append(f"{prefix}{line}")
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
        within = ""
        if flip.kind == "within-thresholds":
            within = " (the step's logits stay within the decode-step thresholds: not a divergence)"
        elif flip.kind == "after-routing-flip":
            within = (" (the step's token went to other experts in an earlier layer without a divergence: its "
                      "logits are not judged)")
        lines.append(
            f"first argmax flip: step {flip.step} ({flip.key}): {flip.kind} -- reference margin "
            f"{fmt_value(flip.margin_ref, '.4g')} {relation} epsilon {flip.epsilon:.3g} "
            f"(argmax REF {flip.argmax_ref}, RUN {flip.argmax_run}){within}"
        )
    prefill, decode = report.prefill_divergence, report.decode_divergence
    if prefill is not None:
        what = f"layer {prefill.layer}" if prefill.layer is not None else "key"
        lines.append(f"prefill: first divergent {what}: {describe_divergence(prefill)}; "
                     f"last good: {prefill.last_good or 'none (no earlier prefill key judged good)'}")
    if decode is not None:
        # instrument's steps count forwards: its step 0 is the prefill's last position, not a decode step.
        prefill_step = decode.step == 0 and any(pair.step_zero_in_prompt for pair in report.pairs
                                                if pair.rank == decode.rank)
        step = f"{decode.step} (the prefill's last position)" if prefill_step else decode.step
        lines.append(f"decode: first divergent step {step}: {describe_divergence(decode)}; "
                     f"last good: {decode.last_good or 'none (no earlier decode key judged good)'}")
    mismatches = report.id_mismatches
    for item in mismatches[:8]:
        at = f" [rank {item.rank}]" if many else ""
        row = f"row {item.row}" if item.row is not None else "the ids"
        why = f": {describe_routing(item.routing)}" if item.routing is not None else ": a divergence (merged side)"
        lines.append(f"ids: {item.key}{where(item)}{at} differ ({row}, overlap {item.overlap}/{item.k}){why}")
    if len(mismatches) > 8:
        lines.append(f"ids: ... {len(mismatches) - 8} more ids keys differ (see the table or --json)")
    if report.root_cause is not None:
        lines.append(f"likely root cause: {describe_divergence(report.root_cause)}, "
                     f"before the first float divergence")
    lines.append(final_line(report))
    return lines


def _number(value: float) -> str:
    return format(value, ".0e") if value and float(format(value, ".0e")) == value else format(value, ".2g")


def threshold_lines(pair: PairResult) -> list[str]:
    """Which thresholds the pair's float keys were judged by, and why: one line per source-dtype
    pair and threshold set."""
    lines = []
    for use in threshold_uses(pair.keys):
        sides = f"{use['ref_dtype'] or 'unknown'} vs {use['run_dtype'] or 'unknown'}"
        # A key judged below its own dtypes' class: the rest of the pair computes in that one.
        lowered = use["class"] != pair_class(use["ref_dtype"], use["run_dtype"])
        computed = f", as the pair's other keys are {use['class']}" if lowered else ""
        origin = {"calibrated": f"{use['class']} defaults{computed}, calibrated: docs/compare.md",
                  "calibrated decode": f"{use['class']} decode-step defaults{computed}, calibrated: docs/compare.md",
                  "calibrated decode, layer state": f"{use['class']} decode-step defaults for a layer's state{computed}, "
                                                    "calibrated: docs/compare.md",
                  "calibrated decode, no routing flip": f"{use['class']} defaults{computed} for decode steps no routing "
                                                        "flip reaches (every route recorded and none differs so far, "
                                                        "or none to record), calibrated: docs/compare.md",
                  "calibrated decode, layer state, MoE output": f"{use['class']} decode-step defaults for a layer's "
                                                                f"state{computed}, twice them for an MoE block's "
                                                                "output, calibrated: docs/compare.md",
                  "calibrated decode, no routing flip, MoE output": f"{use['class']} defaults{computed} for decode "
                                                                    "steps no routing flip reaches, twice them "
                                                                    "for an MoE block's output, calibrated: "
                                                                    "docs/compare.md",
                  "legacy": "legacy default: a side has no source dtype (no manifest)",
                  "legacy decode": "legacy decode-step default: a side has no source dtype (no manifest)"}
        if use["rel_source"] == use["norm_source"]:
            why = origin.get(use["rel_source"], use["rel_source"])
        else:
            why = (f"rel_diff from {origin.get(use['rel_source'], use['rel_source'])}, norm_diff from "
                   f"{origin.get(use['norm_source'], use['norm_source'])}")
        count = f"{use['keys']} key{'s' if use['keys'] != 1 else ''}"
        lines.append(f"thresholds: {sides} -> rel_diff <= {_number(use['rel_diff'])}, norm_diff <= "
                     f"{_number(use['norm_diff'])} ({why}; {count})")
    return lines


def fed_tokens_line(pair: PairResult) -> str | None:
    """One line for the decode steps run on different tokens (compare/inputs.py), with the fix."""
    fed = pair.fed_tokens
    if fed is None:
        return None
    refused = [record for record in pair.not_comparable if record.reason == fed.reason()]
    if fed.prompts_differ:
        return (f"not comparable: every key ({len(refused)} keys): the sides were fed different prompts (their last "
                f"tokens: REF {fed.ref}, RUN {fed.run}); fix: compare runs of the same request (of a data-parallel "
                "engine, the rank that served the reference's request; of a batch, its row: set_gather_rows, or "
                "instrument's batch_row)")
    steps = sorted({record.step for record in refused})
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {fed.step}"
    flip = pair.first_argmax_flip
    # The flip that feeds the first differing token: the step before it, or the prompt's logits
    # for the first decode step (step 1 where step 0 is the prompt's last position).
    first_decode = 1 if pair.step_zero_in_prompt else 0
    if flip is not None and (flip.step == fed.step - 1 or (flip.step is None and fed.step == first_decode)):
        at = f"step {flip.step}" if flip.step is not None else f"the prompt's {flip.key}"
        after = f", each side decoding its own argmax after the argmax flip at {at} ({flip.kind})"
        fix = "feed the engine the reference's tokens (teacher forcing) to compare the steps after a flip"
    else:  # no flip before it: the sides' own argmax did not part them (a helper's bring-up: no gather row)
        after = ", with no argmax flip right before it"
        fix = ("check that both sides decode the same request: a padded batch's recorded row must be the "
               "request's (set_gather_rows(step=...)), and the fed tokens the ones sampled from the logits recorded "
               "(or feed the engine the reference's tokens: teacher forcing)")
    return (f"not comparable: decode {span} ({len(refused)} keys): the sides fed different tokens from step "
            f"{fed.step} (REF {fed.ref}, RUN {fed.run}){after}; fix: {fix}")


def unseen_flip_lines(pair: PairResult) -> list[str]:
    """A line per decode step whose crossing keys a routing flip one side did not record may explain
    (compare/picked.py); steps are never refused for their phases."""
    fed = pair.fed_tokens
    by_step: dict[int, list] = {}
    for record in pair.not_comparable:
        if record.kind == "step" and (fed is None or record.reason != fed.reason()) \
                and not (record.reason or "").startswith((SHIFTED, CHUNKED, STEP_DROPS)):
            by_step.setdefault(record.step, []).append(record)
    return [f"not comparable: decode step {step} ({', '.join(r.key for r in refused)}): {refused[0].reason}"
            for step, refused in sorted(by_step.items())]


def step_drops_lines(pair: PairResult) -> list[str]:
    """A line per step tag whose keys a dropped call renumbered (compare/step_drops.py)."""
    by_tag: dict[str, list] = {}
    for record in pair.not_comparable:
        if (record.reason or "").startswith(STEP_DROPS):
            by_tag.setdefault(record.tag, []).append(record)
    return [f"not comparable: the {len(refused)} step keys of {tag}: {refused[0].reason}"
            for tag, refused in by_tag.items()]


def not_comparable_line(pair: PairResult) -> str | None:
    """One line for the keys whose two values come from different phases or token counts."""
    fed = pair.fed_tokens  # (different prompts: fed_tokens_line says so)
    refused = [record for record in pair.not_comparable
               if record.kind != "step" and not (record.reason or "").startswith((WRITTEN_AGAIN, CHUNKED))
               and not (fed is not None and record.reason == fed.reason())]
    if not refused:
        return None
    calls: dict[tuple, int] = {}
    for record in refused:
        sides = record.sides
        call = (sides.phase_ref, sides.tokens_ref, sides.phase_run, sides.tokens_run)
        calls[call] = calls.get(call, 0) + 1
    described = []
    for (phase_ref, tokens_ref, phase_run, tokens_run), count in calls.items():
        described.append(f"{count} x REF {_call(phase_ref, tokens_ref)} vs RUN {_call(phase_run, tokens_run)}")
    keys = ", ".join(record.key for record in refused[:6]) + (f", ... ({len(refused) - 6} more)"
                                                              if len(refused) > 6 else "")
    fix = fix_hint(pair.prompt_tokens, (pair.prompt_tokens_ref, pair.prompt_tokens_run))
    return (f"not comparable: {len(refused)} keys hold values of different phases or token counts "
            f"({'; '.join(described)}): {keys}; not compared, fix: {fix}")


def _call(phase: str | None, tokens: int | None) -> str:
    text = phase or "call"
    return f"{text} of {tokens_text(tokens)}" if tokens is not None else text


def _prompt_only(report: Report) -> str:
    """Where neither side recorded a decode step though later forwards ran (the token gate skipped
    their calls: taps or records without `record_step`), "no divergence" covers the prompt alone."""
    if any(record.kind == "step" for record in report.keys):
        return ""
    gated = {side: sum((pair.not_captured.get(side) or {}).get("gated_after_kept", 0) for pair in report.pairs)
             for side in ("REF", "RUN")}
    if not all(gated.values()):
        return ""
    return (f"; the prompt's keys only: no decode step recorded, other forwards' calls skipped by the token gate "
            f"(REF {gated['REF']}, RUN {gated['RUN']}), so a bug only decode steps see is not judged: record "
            "each step with record_step (instrument's defaults do)")


def final_line(report: Report) -> str:
    """The report's last line: ``first divergence: ...`` or ``no divergence: ...``."""
    first = report.first_divergence
    if first is None:
        compared = sum(pair.compared for pair in report.pairs)
        closest = report.closest
        near = ""
        if closest is not None and closest.threshold is not None:
            at = f" [rank {closest.rank}]" if len(report.pairs) > 1 else ""
            place = where(closest)
            near = (f"; closest: {closest.key}{place}{at} {closest.metric} {fmt_value(closest.value, '.2g')} "
                    f"vs threshold {_number(closest.threshold)}")
        refused = len(report.not_comparable)
        skipped = f"; {refused} keys NOT COMPARABLE (see above)" if refused else ""
        if report.not_compared:
            skipped += f"; {len(report.not_compared)} keys held by both sides NOT COMPARED (see the problems)"
        extra = f"; {len(report.problems)} problems listed above" if report.problems else ""
        flip = report.first_argmax_flip
        tie = f"; {flip.kind} argmax flip at step {flip.step}" if flip is not None else ""
        ids = report.id_mismatches
        routed = ""
        if ids:
            verdicts = ", ".join(f"{item.key} ({_routing_word(item)})"
                                 for item in ids[:4])
            more = f", ... ({len(ids) - 4} more)" if len(ids) > 4 else ""
            noun = "expert ids" if all(chosen(item.key) == "experts" for item in ids) else "ids"  # or indexer picks
            routed = f"; {noun} differ without a divergence: {verdicts}{more}"
            excused = [record for record in report.keys if record.excused_rows]
            if excused:
                routed += f" ({len(excused)} keys not judged at or after the tokens whose {noun} differ"
                if any(record.phase == "prefill" and len(record.shape_ref) == 1 for record in excused):
                    # A one-row key holds the last token only: one earlier flip leaves it unjudged.
                    routed += (", one-row keys among them, whose one token an earlier token's flip reaches: "
                               "all-rows mode (COMPILEDUMP_ROWS=all) judges the tokens no flip reaches")
                routed += ")"
        fewer = "".join(f"; {said}" + (f" [rank {pair.rank}]" if len(report.pairs) > 1 else "")
                        for pair in report.pairs if (said := pair.ended_early or pair.fewer_steps))
        return (f"no divergence: {compared} keys compared{near}{skipped}{routed}{tie}{fewer}{extra}"
                f"{_prompt_only(report)}")
    rank = f" [rank {first.rank}]" if len(report.pairs) > 1 else ""
    last = f"; last good: {first.last_good}" if first.last_good else ""
    cause = report.root_cause
    why = ""
    if cause is not None:
        kind = f" ({ROUTING_WORDS[cause.routing_verdict]})" if cause.routing_verdict in ROUTING_WORDS else ""
        why = f"; likely root cause: {cause.key}{where(cause)} ids differ{kind}"
    caution = f"; caution: {first.caution}" if first.caution else ""
    return f"first divergence: {describe_divergence(first)}{rank}{last}{why}{caution}"
