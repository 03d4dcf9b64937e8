"""The comparison: every key of every pair measured in model order, then each pair's findings
(first divergence per phase, likely root cause, argmax flips, decode margins), then the report
that combines the pairs."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from ..format import spec
from ..format.keys import order_key_infos
from ..format.reader import Dump, DumpError, rank_sort_key
from .decode_first import decode_before_prompt_layer, decode_first_note, earlier_decode_layer, fed_alike_through
from .flat_steps import flat_step_zero
from .flips import argmax_flip_kind, excuse_flips
from .inputs import after_fed_difference, first_fed_difference, step_zero_in_prompt
from .measure import KeyMeasurer, float_class, logits_tags
from .metrics import Workspace
from .one_row import one_row_note
from .one_sided import OneSidedKeys
from .overwrites import chunked_prefill, one_token_prompt, shifted_steps, written_again
from .options import CompareOptions
from .padding import unpadded
from .prefix_cache import prefix_cache_note
from .picked import unseen_step_flips, with_picked_ids
from .pairing import find_pairs
from .cautions import first_cautions, layer_steps_note, routing_recorded_below, unrecorded_routing_note
from .phases import (
    first_nonfinite,
    gate_length,
    mixed_phase_detail,
    mixed_phase_keys,
    not_captured,
    not_captured_note,
    not_comparable_reason,
    prompt_length,
)
from .ended import died_note, ended_early, lacking_keys
from .rename import RenamedDump
from .jumps import earlier_jump
from .key_record import KeyRecord
from .report import ArgmaxFlip, DecodeMargins, Divergence, PairResult, Problem, Report
from .routing import describe_routing
from .selection import UNKNOWN_RULE
from .step_drops import shifted_step_tags


class NoCommonKeys(DumpError):
    """A REF/RUN pair shares no key, so nothing can be compared."""


def compare(ref_path: str | Path, run_path: str | Path, options: CompareOptions | None = None) -> Report:
    """Compare REF and RUN (npz files or directories of per-rank files); return the report.

    Raises :class:`DumpError` for unusable input (missing path, not an npz, no dumps in a
    directory, no common rank or keys). docs/compare.md describes the report.
    """
    options = options or CompareOptions()
    started = time.perf_counter()
    pairs, problems = find_pairs(ref_path, run_path)
    results = []
    empty: list[str] = []
    for pair in pairs:
        try:
            # A request row its attention mask pads: each side on its prompt's real positions
            # (padding.py), before --map renames RUN's keys.
            ref, run = unpadded(pair.ref), unpadded(pair.run)
            run = RenamedDump(run, options.maps) if options.maps else run
            results.append(compare_pair(ref, run, options, pair.rank))
        except NoCommonKeys as exc:
            # One rank without common keys is a problem to list; all of them is unusable input.
            empty.append(str(exc))
            problems.append(Problem("no_common_keys", pair.rank, str(exc)))
    if not results:
        raise DumpError(empty[0] if len(empty) == 1 else f"no keys in common for any of {len(empty)} rank pairs")
    return build_report(str(ref_path), str(run_path), options, results, problems, time.perf_counter() - started)


def compare_pair(ref: Dump, run: Dump, options: CompareOptions, rank: str) -> PairResult:
    """Compare two dumps key by key, in model order; return this pair's part of the report.

    Arrays are read one key at a time and released before the next, so each side holds at most
    one mapped array and one float64 chunk.
    """
    problems: list[Problem] = []
    notes = [f"REF: {note}" for note in ref.notes] + [f"RUN: {note}" for note in run.notes]
    renamed = run.renamed() if isinstance(run, RenamedDump) else {}
    # Expert ids an engine's gate did not give, from its router logits (picked.py)
    ref, run, picked = with_picked_ids(ref, run)
    notes.extend(picked)
    unseen = unseen_step_flips(ref, run, options.near_tie, options.near_tie_ulps)
    for side, dump in (("REF", ref), ("RUN", run)):
        for key, why in dump.bad_members.items():
            problems.append(Problem("unreadable", rank, f"{side} {why}", key, side=side))
        for problem in dump.problems:
            problems.append(Problem(problem.kind, rank, f"{side} {problem.detail}", problem.key, side=side))
    # Key meanings come from a manifest when one side has it (authoritative), else from REF.
    authority, other = (ref, run) if ref.manifest is not None or run.manifest is None else (run, ref)
    meanings = dict(authority.infos)
    for key, info in other.infos.items():
        meanings.setdefault(key, info)
    ordered = order_key_infos(list(meanings.values()))
    common = ref.members.keys() & run.members.keys()
    if not common:
        raise NoCommonKeys(
            f"no keys in common between REF {ref.path} ({len(ref.members)} keys) and "
            f"RUN {run.path} ({len(run.members)} keys)"
        )
    float_sizes = [member.size for key, member in ref.members.items() if key in common and not member.is_integer]
    workspace = Workspace(min(options.chunk_elements, max(float_sizes, default=1)))
    measurer = KeyMeasurer(ref, run, options, rank, logits_tags(ordered, authority.members | other.members),
                           workspace, float_class(ref, run, sorted(common)))
    records: list[KeyRecord] = []
    again, wrote_more = written_again(ref, run, renamed)  # prompt values a later forward replaced (overwrites.py)
    chunked = chunked_prefill(ref, run)  # a side ran the prompt in several forwards: prompt and steps misaligned
    shifted = chunked or shifted_steps(ref, run, wrote_more)  # ... or a warm-up before the request
    if not chunked:  # prompt calls of different lengths that end alike: another prompt, or a prefix cache's tail
        notes.extend(note for note in (prefix_cache_note(ref, run),) if note)
    one_token_note, overwritten = one_token_prompt(ref, run)  # 1-token prompts: their keys hold the last forward's
    notes.extend([one_token_note] if one_token_note else [])
    fed = None if shifted else first_fed_difference(ref, run, ordered)
    flat_zero, flat_notes = flat_step_zero(ref, run, renamed)  # a flat engine's step-0 routing: a prompt row
    notes.extend(flat_notes)
    # Every routing decision up to a layer recorded on both sides: until some ids differ, no route
    # has flipped that a decode step's key of that layer can depend on.
    recorded_below = routing_recorded_below(ref, run)
    no_flip = True  # no ids differ so far
    captured = {"REF": not_captured(ref), "RUN": not_captured(run)}
    step_drops = shifted_step_tags(ref, run)  # step tags a dropped call renumbered (step_drops.py)
    # keys one side holds: a note per reason, or a problem
    one_sided = OneSidedKeys(ref, run, captured, bool(shifted))
    for info in ordered:
        key = info.key
        if (spec.prompt_stream_step(key) and overwritten is None) or key in flat_zero or key in (overwritten or ()):  # the prompt's `layer<N>` holds it
            continue
        if (key not in run.members or key not in ref.members) and _held(ref, key) and _held(run, key):
            # Both sides hold it, one of them unusably (shards that cannot be merged, an
            # unreadable array): its problem says why; it counts as not compared.
            records.append(measurer.not_compared(info))
            continue
        if key not in run.members or key not in ref.members:
            if not (info.kind == "step" and info.tag in step_drops):  # (its tag's line says why)
                problems.extend(problem for problem in (one_sided.sort(info, rank),) if problem is not None)
            continue
        # From the step where greedy decoding fed the sides different tokens on, their values
        # cannot be compared (inputs.py).
        refused = fed.reason() if after_fed_difference(info, fed) else again.get(key)
        if shifted and info.kind == "step":
            refused = shifted
        elif chunked and (key in again or not_comparable_reason(info.kind, ref.infos.get(key, info),
                                                                run.infos.get(key, info))):
            refused = chunked  # its prompt keys hold the first chunk
        refused = refused or (step_drops.get(info.tag) if info.kind == "step" else None)
        unflipped = no_flip and (recorded_below == math.inf or (info.layer is not None and info.layer < recorded_below))
        records.append(measurer.record(info, problems, refused, unflipped))
        if records[-1].divergent and info.step in unseen and records[-1].floats is not None \
                and records[-1].limits.klass != "fp32":  # (fp32 routing does not flip honestly)
            records[-1] = measurer.record(info, problems, unseen[info.step], unflipped)  # (picked.py)
        no_flip = no_flip and not records[-1].routes_flipped
    for position, record in enumerate(records):
        record.position = position
    prompt = prompt_length(ref, run)
    for side, dump in (("REF", ref), ("RUN", run)):
        mixed = mixed_phase_keys(dump)
        if mixed[0]:
            problems.append(Problem("mixed_phases", rank, mixed_phase_detail(side, *mixed, gate_length(dump) or prompt),
                                    side=side))
    note = not_captured_note(captured)
    if note is not None:
        notes.append(note)
    notes.extend(one_sided.notes())
    lacking = lacking_keys(problems, one_sided)  # (a side whose process died: ended.py)
    notes.extend(note for note in (died_note("REF", ref, lacking["REF"]), died_note("RUN", run, lacking["RUN"])) if note)
    if any(r.phase == "decode" and r.floats is not None and r.limits is not None
           and r.limits.rel_source.endswith(" decode") for r in records):
        notes.extend(note for note in (unrecorded_routing_note(ref, run),) if note)
    result = PairResult(rank=rank, ref=str(ref.path), run=str(run.path), ref_manifest=ref.manifest is not None,
                        run_manifest=run.manifest is not None, keys=records, problems=problems, notes=notes,
                        not_captured=captured, prompt_tokens=prompt, prompt_tokens_ref=prompt_length(ref),
                        prompt_tokens_run=prompt_length(run),
                        nonfinite={"REF": first_nonfinite(ref), "RUN": first_nonfinite(run)},
                        renamed=renamed, fed_tokens=fed, step_zero_in_prompt=step_zero_in_prompt(ref, run),
                        fewer_steps=one_sided.fewer_steps(), ended_early=ended_early({"REF": ref, "RUN": run}, lacking))
    analyse_pair(result)
    first = result.first_divergence
    if first is not None and first.metric != "ids":
        limits = records[first.position].limits
        klass = limits.klass if limits else None
        for note, caution in earlier_jump(records, first, klass) + first_cautions(ref, run, first.key, first.layer, klass):
            result.notes.append(note)
            first.caution = first.caution or caution
    if first is not None and (note := layer_steps_note([ref.manifest, run.manifest], first.step, first.key)):
        result.notes.append(note)
    blind_spot = one_row_note(records, result.prefill_divergence, prompt)
    if blind_spot is not None:
        result.notes.append(blind_spot[0])
        if blind_spot[1] and first is not None and first.key == result.prefill_divergence.key and first.caution is None:
            first.caution = "one-row mode: the bug may sit earlier, at other tokens (see the note)"
    return result


def _held(dump: Dump, key: str) -> bool:
    """Whether ``dump`` holds ``key``, usable or not (``excluded``: shards that do not merge;
    ``bad_members``: an unreadable array)."""
    return key in dump.members or key in dump.excluded or key in dump.bad_members


def _divergence(record: KeyRecord, last_good: KeyRecord | None) -> Divergence:
    divergence = Divergence(
        key=record.key, layer=record.layer, step=record.step, phase=record.phase, rank=record.rank,
        position=record.position, metric=record.metric, value=record.value,
        threshold=record.limits.norm_diff if record.metric == "norm_diff" and record.limits else record.threshold,
        last_good=last_good.key if last_good else None, last_good_step=last_good.step if last_good else None,
        merge=record.merge,
    )
    if record.divergent_rows:
        divergence = replace(divergence, divergent_rows=record.divergent_rows, row_count=len(record.rows.rel_diff))
    if record.ids is not None:
        ids = record.ids
        divergence = replace(divergence, metric="ids", value=ids.mismatched_elements, threshold=None,
                             row=ids.first_mismatch_row, overlap=ids.overlap, k=ids.k, routing=record.routing)
        if ids.ids_equal and record.routing is not None and record.routing.rows:  # a sparsemixer's weights
            first = record.routing.rows[0]
            divergence = replace(divergence, row=first.row, overlap=first.k, k=first.k)
        elif record.routing is not None and record.routing.flipped_rows:  # not a row that only reorders
            flip = next(row for row in record.routing.rows if row.row == record.routing.flipped_rows[0])
            divergence = replace(divergence, row=flip.row, overlap=flip.overlap, k=flip.k)
    return divergence


def _first_in_phase(floats: list[KeyRecord], phase: str) -> Divergence | None:
    """The first divergent float key of ``phase`` and the last key before it judged within its
    thresholds (last good): a key shown but not judged (a decode step's router logits) or not
    judged at some tokens may be far off, and is no evidence that the state was still good."""
    last_good = None
    for record in floats:
        if record.phase != phase:
            continue
        if record.divergent:
            return _divergence(record, last_good)
        if record.status == "ok":
            last_good = record
    return None


def analyse_pair(pair: PairResult) -> None:
    """Fill in ``pair``'s findings from its key records."""
    records = pair.keys
    excused = excuse_flips(records, pair.step_zero_in_prompt)
    floats = [record for record in records if record.floats is not None]
    pair.prefill_divergence = _first_in_phase(floats, "prefill")
    pair.decode_divergence = _first_in_phase(floats, "decode")
    # Every ids key that differs; in a low-precision class a near tie (or a row without reference
    # router logits) is reported but is not a divergence by itself (compare/routing.py).
    differing = [record for record in records if record.routing_differs]
    pair.id_mismatches = [_divergence(record, None) for record in differing]
    first_ids = pair.id_mismatches[0] if differing else None
    pair.first_id_mismatch = first_ids
    divergent_ids = next((_divergence(record, None) for record in differing if record.divergent), None)
    for record in differing:
        verdict = record.routing.verdict if record.routing is not None else "divergence"
        keys = excused.get(record.key, [])
        shown = ", ".join(keys[:8]) + (f", ... ({len(keys) - 8} more)" if len(keys) > 8 else "")
        consequence = verdict == "not_judged" and set(record.routing.not_judged_rows) <= set(
            record.routing.after_unjudged_rows)
        if consequence:
            # Every row it cannot judge is one an earlier unjudged flip reaches: that flip's
            # problem already says so.
            pair.notes.append(f"{record.key}: {record.ids_text()}: {describe_routing(record.routing)}")
        elif verdict == "not_judged":
            routing = record.routing
            # Rows the reference's logits do not cover (one-row mode keeps the last row only), in a
            # model whose logits could judge them.
            uncovered = routing.router_key is not None and routing.not_top_k is None and any(
                row not in routing.router_rows for row in routing.not_judged_rows) and not any(
                row.reason == UNKNOWN_RULE for row in routing.rows)
            hint = ("; the router logits of every row would judge each row (instrument's default, "
                    "router_rows=\"all\"; by hand, record(..., rows=\"all\"))") if uncovered else ""
            reached = (f"; nor are the {len(keys)} float keys after it that cross a threshold only at or after "
                       f"those tokens: {shown}" if keys else "")
            pair.problems.append(Problem(
                "ids_not_judged", pair.rank, f"{record.ids_text()}: {describe_routing(routing)} by itself"
                f"{reached}{hint}", record.key))
        elif verdict == "near_tie":
            pair.notes.append(f"{record.key}: {record.ids_text()}: {describe_routing(record.routing)}")
        if keys and verdict == "near_tie":
            pair.notes.append(f"{record.key}: the tokens its near tie routed elsewhere (and, from the next layer "
                              f"on, the tokens after them) are not judged in the {len(keys)} keys after it that "
                              f"crossed a threshold only there: {shown}")
    flips = [record for record in records if record.margin_analysis and record.argmax_equal is False]
    if flips:
        flip = flips[0]
        ref_top, run_top = flip.floats.margins.ref, flip.floats.margins.run
        epsilon = flip.near_tie_epsilon
        pair.first_argmax_flip = ArgmaxFlip(
            step=flip.step, key=flip.key, tag=flip.tag, rank=pair.rank,
            kind=argmax_flip_kind(flip, ref_top.margin, epsilon), margin_ref=ref_top.margin,
            margin_run=run_top.margin, argmax_ref=ref_top.argmax, argmax_run=run_top.argmax, epsilon=epsilon,
            position=flip.position)
    float_first = pair.prefill_divergence or pair.decode_divergence
    fed_alike = fed_alike_through(records, pair.first_argmax_flip, pair.step_zero_in_prompt)  # (decode_first.py)
    earlier = decode_before_prompt_layer(floats, pair.prefill_divergence, fed_alike)
    if earlier is not None:
        float_first = _divergence(*earlier)
        pair.notes.append(decode_first_note(pair.prefill_divergence, float_first))
    # The same experts in another order change no token's experts: no root cause; nor can a flip
    # only at tokens after every token a prefill key diverges at (causal attention).
    causes = [item for item in pair.id_mismatches if float_first is not None
              and item.position < float_first.position and _can_cause(item, float_first, fed_alike)]
    # One that is a divergence by itself (far from any tie) before near ties: a near tie explains
    # only what it reaches (compare/flips.py), a far flip (a decode step's) is the likelier cause.
    cause = next((item for item in causes if item.routing_verdict not in ("near_tie", "not_judged")),
                 causes[0] if causes else None)
    if cause is not None:
        reason = "integer ids differ before the first float divergence"
        if cause.routing_verdict in ("near_tie", "not_judged"):
            reason += f" ({'a near tie' if cause.routing_verdict == 'near_tie' else 'not judged'}: "
            reason += "the tokens went to other experts, and the floats after them differ)"
        pair.root_cause = replace(cause, reason=reason)
    first = float_first or divergent_ids
    flip = pair.first_argmax_flip
    if first is None and flip is not None and flip.kind == "divergence":
        flipped = records[flip.position]
        first = Divergence(key=flipped.key, layer=flipped.layer, step=flipped.step, phase="decode", rank=pair.rank,
                           position=flipped.position, metric="argmax", value=flip.margin_ref,
                           threshold=flip.epsilon)
    pair.first_divergence = first
    with_margins = [record for record in records if record.margin_analysis and record.argmax_equal is not None]
    if with_margins:
        smallest = min(with_margins, key=lambda record: _nan_last(record.floats.margins.ref.margin))
        pair.decode_margins = DecodeMargins(
            tags=sorted({record.tag for record in with_margins}),
            steps=len({record.step for record in with_margins}),
            argmax_agree=sum(1 for record in with_margins if record.argmax_equal),
            compared=len(with_margins),
            flips=[record.step for record in flips],
            smallest_step=smallest.step, smallest_key=smallest.key,
            smallest_value=smallest.floats.margins.ref.margin,
        )


def _can_cause(ids: Divergence, float_first: Divergence | None, fed_alike: float) -> bool:
    """Whether the ids mismatch `ids` can explain `float_first`: some token's experts changed
    (not only their order) at or before a token where it diverges (an all-rows key's rows), in
    its layer or an earlier one (a prompt's flip at a later layer cannot reach a decode step's
    earlier layer, at a step both sides fed alike)."""
    if float_first is not None and ids.layer is not None and float_first.layer is not None \
            and ids.layer > float_first.layer and (float_first.step or 0) <= fed_alike:
        return False
    if ids.routing is None:
        return True
    flipped = ids.routing.flipped_rows
    if not flipped:
        return False
    if float_first is None or not float_first.divergent_rows or ids.step is not None or float_first.step is not None:
        return True
    return min(flipped) <= max(float_first.divergent_rows)


def _nan_last(value: float | None) -> float:
    return math.inf if value is None or math.isnan(value) else value


def build_report(ref: str, run: str, options: CompareOptions, pairs: list[PairResult], side_problems: list[Problem],
                 elapsed: float) -> Report:
    """Combine per-pair results into the report: earliest divergence across pairs (by position
    in model order, then rank), earliest argmax flip (by step, then rank)."""

    def earliest(name: str, order):
        found = [getattr(pair, name) for pair in pairs if getattr(pair, name) is not None]
        return min(found, key=order) if found else None

    def by_position(item: Divergence) -> tuple:
        return (item.position, rank_sort_key(item.rank))

    first = earlier_decode_layer(earliest("first_divergence", by_position),
                                 [pair.first_divergence for pair in pairs], by_position)
    root_cause = None
    if first is not None:
        root_cause = next(pair for pair in pairs if pair.rank == first.rank).root_cause
    return Report(
        ref=ref, run=run, options=options, pairs=pairs,
        problems=side_problems + [problem for pair in pairs for problem in pair.problems],
        first_divergence=first,
        prefill_divergence=earliest("prefill_divergence", by_position),
        decode_divergence=earliest("decode_divergence", by_position),
        first_id_mismatch=earliest("first_id_mismatch", by_position),
        root_cause=root_cause,
        first_argmax_flip=earliest("first_argmax_flip", lambda item: (item.step, rank_sort_key(item.rank))),
        elapsed_s=elapsed,
    )
