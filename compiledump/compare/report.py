"""The comparator's results as typed records, and the one place they become JSON.

:meth:`Report.to_json` gives the ``--json`` report whose fields docs/compare.md ("Output")
documents; every ``to_json`` method below is part of it. NaN and infinities become None there
(:func:`json_safe`), so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..format import spec
from .facts import Closest, SideFacts, default_thresholds_json, threshold_uses
from .metrics import FloatMetrics, IdMetrics, RowMetrics
from .options import CompareOptions, Thresholds
from .routing import Routing


@dataclass
class Problem:
    """Something the comparison met but that does not stop it: a key present on one side only,
    a shape or dtype mismatch, an unreadable member, an unpaired or duplicate rank file, ...

    A problem about a file (``file`` set: ``unpaired_rank``, ``duplicate_rank``) has no key."""

    kind: str
    rank: str | None
    detail: str
    key: str | None = None
    side: str | None = None  # REF | RUN, where it concerns one side
    file: str | None = None

    def to_json(self) -> dict:
        if self.file is not None:
            return {"kind": self.kind, "side": self.side, "rank": self.rank, "file": self.file, "detail": self.detail}
        out = {"kind": self.kind, "rank": self.rank, "key": self.key, "detail": self.detail}
        if self.side is not None:
            out["side"] = self.side
        return out


@dataclass
class RankPart:
    """One rank's share of a key on a merged side: its metrics against the matching part of the
    single side (its slice of a concatenated shard, or its copy of an unsharded key), or only
    the note that it holds a partial sum, which cannot be compared alone."""

    rank: str
    divergent: bool = False
    span: tuple[int, int] | None = None  # [start, stop) along the shard dim
    floats: FloatMetrics | None = None
    ids: IdMetrics | None = None
    partial_sum: bool = False

    @property
    def value(self) -> float | int | None:
        """The number that names how far off this rank is: rel_diff, or mismatching ids."""
        if self.floats is not None:
            return self.floats.rel_diff
        return self.ids.mismatched_elements if self.ids is not None else None

    def to_json(self) -> dict:
        if self.partial_sum:
            return {"rank": self.rank, "partial_sum": True}
        out: dict[str, Any] = {"rank": self.rank, "divergent": self.divergent}
        if self.span is not None:
            out["slice"] = list(self.span)
        if self.floats is not None:
            out.update(rel_diff=self.floats.rel_diff, max_abs=self.floats.max_abs,
                       nonfinite_mismatch=self.floats.nonfinite_mismatch)
        if self.ids is not None:
            out["mismatched_elements"] = self.ids.mismatched_elements
        return out


@dataclass
class MergeInfo:
    """How a key of a merged side was put together, and which of its ranks diverge."""

    how: str  # "concat <group> dim <d>", "sum <group>" or "each rank"
    merged_ranks: list[str]
    ranks: list[RankPart]
    divergent_ranks: list[str]
    worst_rank: str | None = None  # set when the key diverges and a rank can be named
    worst_rank_value: float | int | None = None

    def to_json(self) -> dict:
        out = {"merge": self.how, "merged_ranks": self.merged_ranks, "ranks": [part.to_json() for part in self.ranks],
               "divergent_ranks": self.divergent_ranks, "worst_rank": self.worst_rank}
        if self.worst_rank_value is not None:
            out["worst_rank_value"] = self.worst_rank_value
        return out


@dataclass
class KeyRecord:
    """One key's comparison. ``floats`` or ``ids`` holds its metrics (neither when the key was
    skipped); ``metric``/``value`` say what crossed for a divergent float key."""

    key: str
    rank: str
    kind: str
    tag: str
    layer: int | None
    step: int | None
    phase: str
    shape_ref: list[int]
    shape_run: list[int]
    dtype_ref: str
    dtype_run: str
    status: str = "ok"  # ok | divergent | mismatch | skipped | not_comparable
    divergent: bool = False
    threshold: float | None = None  # rel_diff threshold (limits.rel_diff)
    limits: Thresholds | None = None  # both thresholds, the precision class and where they come from
    floats: FloatMetrics | None = None
    ids: IdMetrics | None = None
    logits: bool = False  # margin columns computed (1-D logits)
    margin_analysis: bool = False  # decode logits: counted for argmax flips
    metric: str | None = None  # rel_diff | norm_diff | nonfinite
    value: float | int | None = None
    argmax_equal: bool | None = None  # set with near_tie_epsilon when margins were computed
    near_tie_epsilon: float | None = None
    merge: MergeInfo | None = None
    position: int = 0  # index in model order within its pair
    sides: SideFacts | None = None  # what each side's manifest says about the key
    reason: str | None = None  # status not_comparable: why
    rows: RowMetrics | None = None  # all-rows keys: per token row
    divergent_rows: list[int] | None = None
    routing: Routing | None = None  # ids that differ: near tie or divergence (compare/routing.py)
    # Token rows not judged because a near tie in an earlier ids key sent them to other experts,
    # that ids key, and the metric/value that crossed in those rows (measure.excuse_near_ties).
    excused_rows: list[int] | None = None
    excused_by: list[str] | None = None
    excused_metric: str | None = None
    excused_value: float | None = None

    @property
    def ids_differ(self) -> bool:
        """Integer ids compared and not equal (whether or not that is a divergence)."""
        return self.ids is not None and not self.ids.ids_equal

    @property
    def metric_kind(self) -> str | None:
        return "float" if self.floats is not None else ("ids" if self.ids is not None else None)

    @property
    def closeness(self) -> tuple[float, str, float | None, float | None]:
        """(value/threshold, metric, value, threshold) of the metric closest to its threshold
        (all-rows keys: over rows); ratio 0 for keys without float metrics."""
        if self.floats is None or self.limits is None:
            return 0.0, "rel_diff", None, None
        rel, norm = self.floats.rel_diff, self.floats.norm_diff
        if self.rows is not None:
            rel, norm = self.rows.max_rel_diff, self.rows.max_norm_diff
            if self.excused_rows:
                kept = [index for index in range(len(self.rows.rel_diff)) if index not in self.excused_rows]
                rel = max((self.rows.rel_diff[index] for index in kept), default=0.0)
                norm = max((self.rows.norm_diff[index] or 0.0 for index in kept), default=0.0)
        elif self.excused_rows:
            return 0.0, "rel_diff", None, None  # its one row was not judged
        ratio, metric = self.limits.ratio(rel, norm)
        if metric == "rel_diff":
            return ratio, metric, rel, self.limits.rel_diff
        return ratio, metric, norm, self.limits.norm_diff

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "key": self.key, "rank": self.rank, "kind": self.kind, "tag": self.tag, "layer": self.layer,
            "step": self.step, "phase": self.phase, "shape_ref": self.shape_ref, "shape_run": self.shape_run,
            "dtype_ref": self.dtype_ref, "dtype_run": self.dtype_run, "status": self.status,
            "divergent": self.divergent,
        }
        if self.sides is not None:
            out.update(self.sides.to_json())
        if self.reason is not None:
            out["reason"] = self.reason
        if self.floats is not None:
            out.update(metric_kind="float", threshold=self.threshold)
            if self.limits is not None:
                out.update(norm_threshold=self.limits.norm_diff, threshold_class=self.limits.klass,
                           threshold_source=self.limits.rel_source, norm_threshold_source=self.limits.norm_source)
            out.update(_float_json(self.floats))
            if self.rows is not None:
                out.update(all_rows=True, row_count=len(self.rows.rel_diff), row_rel_diff=self.rows.rel_diff,
                           row_norm_diff=self.rows.norm_diff, divergent_rows=self.divergent_rows or [])
            out.update(logits=self.logits, margin_analysis=self.margin_analysis)
            if self.metric is not None:
                out.update(metric=self.metric, value=self.value)
            if self.excused_rows:
                out.update(excused_rows=self.excused_rows, excused_by=self.excused_by,
                           excused_metric=self.excused_metric, excused_value=self.excused_value)
            if self.argmax_equal is not None:
                out.update(argmax_equal=self.argmax_equal, near_tie_epsilon=self.near_tie_epsilon)
        elif self.ids is not None:
            out["metric_kind"] = "ids"
            out.update(_ids_json(self.ids))
            if self.routing is not None:
                out["routing"] = self.routing.to_json()
        if self.merge is not None:
            out.update(self.merge.to_json())
        out["position"] = self.position
        return out


def _float_json(metrics: FloatMetrics) -> dict:
    out = {name: getattr(metrics, name) for name in (
        "rel_diff", "norm_diff", "cosine", "max_abs", "mean_abs", "rel_l2", "nan_ref", "nan_run", "inf_ref", "inf_run",
        "nonfinite_mismatch", "compared_elements")}
    if metrics.margins is not None:
        ref, run = metrics.margins.ref, metrics.margins.run
        out.update(argmax_ref=ref.argmax, argmax_run=run.argmax, margin_ref=ref.margin, margin_run=run.margin,
                   top1_ref=ref.top1, top1_run=run.top1)
    return out


def _ids_json(metrics: IdMetrics) -> dict:
    names = ["ids_equal", "mismatched_elements", "total_elements"]
    if not metrics.ids_equal:
        names += ["first_mismatch_row", "first_mismatch_index", "mismatched_rows", "rows", "overlap", "k",
                  "same_set", "ref_ids", "run_ids"]
    return {name: getattr(metrics, name) for name in names}


@dataclass
class Divergence:
    """Where a pair first diverges (in one phase, or overall): the key and what crossed.

    ``metric`` is rel_diff, nonfinite (value = mismatching positions), ids (value = mismatching
    elements, with ``row``/``overlap``/``k``) or argmax (value = reference margin, threshold =
    the near-tie epsilon). ``reason`` is set on a likely root cause."""

    key: str
    layer: int | None
    step: int | None
    phase: str
    rank: str
    position: int
    metric: str
    value: float | int | None
    threshold: float | None
    last_good: str | None = None
    last_good_step: int | None = None
    row: int | None = None
    overlap: int | None = None
    k: int | None = None
    merge: MergeInfo | None = None
    reason: str | None = None
    divergent_rows: list[int] | None = None  # all-rows keys: the token positions that diverge
    row_count: int | None = None
    routing: Routing | None = None  # ids: the routing judgement (near tie, not judged, divergence)

    @property
    def routing_verdict(self) -> str | None:
        """``divergence``, ``near_tie`` or ``not_judged`` for ids; None for other metrics or
        ids of a merged side (judged strictly)."""
        return self.routing.verdict if self.routing is not None else None

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "key": self.key, "layer": self.layer, "step": self.step, "phase": self.phase, "rank": self.rank,
            "position": self.position, "last_good": self.last_good, "last_good_step": self.last_good_step,
            "metric": self.metric, "value": self.value, "threshold": self.threshold,
        }
        if self.metric == "ids":
            out.update(row=self.row, overlap=self.overlap, k=self.k,
                       routing=self.routing.to_json() if self.routing is not None else None)
        if self.merge is not None:
            out.update(merge=self.merge.how, worst_rank=self.merge.worst_rank,
                       worst_rank_value=self.merge.worst_rank_value, merged_ranks=self.merge.merged_ranks,
                       divergent_ranks=self.merge.divergent_ranks)
        if self.reason is not None:
            out["reason"] = self.reason
        if self.divergent_rows is not None:
            out.update(divergent_rows=self.divergent_rows, row_count=self.row_count)
        return out


@dataclass
class ArgmaxFlip:
    """The first decode step whose argmax differs, classified near-tie or divergence."""

    step: int
    key: str
    tag: str
    rank: str
    kind: str  # near-tie | within-thresholds | divergence
    margin_ref: float
    margin_run: float
    argmax_ref: int
    argmax_run: int
    epsilon: float
    position: int

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in (
            "step", "key", "tag", "rank", "kind", "margin_ref", "margin_run", "argmax_ref", "argmax_run", "epsilon",
            "position")}


@dataclass
class DecodeMargins:
    """Argmax agreement over a pair's decode logits, and the smallest reference margin."""

    tags: list[str]
    steps: int
    argmax_agree: int
    compared: int
    flips: list[int]
    smallest_step: int
    smallest_key: str
    smallest_value: float

    def to_json(self) -> dict:
        return {"tags": self.tags, "steps": self.steps, "argmax_agree": self.argmax_agree, "compared": self.compared,
                "flips": self.flips, "smallest_ref_margin": {"step": self.smallest_step, "key": self.smallest_key,
                                                             "value": self.smallest_value}}


@dataclass
class PairResult:
    """The comparison of one REF/RUN pair of dumps (one rank, or one merged shard set)."""

    rank: str
    ref: str
    run: str
    ref_manifest: bool
    run_manifest: bool
    keys: list[KeyRecord]
    problems: list[Problem]
    notes: list[str]
    first_divergence: Divergence | None = None
    prefill_divergence: Divergence | None = None
    decode_divergence: Divergence | None = None
    first_id_mismatch: Divergence | None = None
    root_cause: Divergence | None = None
    first_argmax_flip: ArgmaxFlip | None = None
    decode_margins: DecodeMargins | None = None
    id_mismatches: list[Divergence] = field(default_factory=list)  # every ids key that differs, in order
    not_captured: dict[str, dict | None] = field(default_factory=dict)  # REF/RUN: phases.not_captured
    nonfinite: dict[str, dict | None] = field(default_factory=dict)  # REF/RUN: phases.first_nonfinite
    prompt_tokens: int | None = None  # the prompt length either manifest states or implies
    renamed: dict[str, str] = field(default_factory=dict)  # --map: new RUN key -> old

    @property
    def compared(self) -> int:
        return sum(1 for record in self.keys if record.status != "not_comparable")

    @property
    def not_comparable(self) -> list[KeyRecord]:
        return [record for record in self.keys if record.status == "not_comparable"]

    @property
    def divergent_keys(self) -> int:
        return sum(1 for record in self.keys if record.divergent)

    @property
    def closest(self) -> Closest | None:
        return Closest.of(self.keys)

    def to_json(self) -> dict:
        return {"rank": self.rank, "ref": self.ref, "run": self.run, "ref_manifest": self.ref_manifest,
                "run_manifest": self.run_manifest, "compared": self.compared, "divergent_keys": self.divergent_keys,
                "not_comparable": len(self.not_comparable), "prompt_tokens": self.prompt_tokens,
                "first_divergence": _opt(self.first_divergence), "first_argmax_flip": _opt(self.first_argmax_flip),
                "id_mismatches": [item.to_json() for item in self.id_mismatches],
                "decode_margins": _opt(self.decode_margins), "closest": _opt(self.closest),
                "thresholds": threshold_uses(self.keys), "not_captured": self.not_captured,
                "first_nonfinite": self.nonfinite, "renamed": self.renamed}


@dataclass
class Report:
    """The whole comparison: every pair, and the earliest findings across them."""

    ref: str
    run: str
    options: CompareOptions
    pairs: list[PairResult]
    problems: list[Problem]  # finding and pairing the files, then each pair's
    first_divergence: Divergence | None = None
    prefill_divergence: Divergence | None = None
    decode_divergence: Divergence | None = None
    first_id_mismatch: Divergence | None = None
    root_cause: Divergence | None = None
    first_argmax_flip: ArgmaxFlip | None = None
    elapsed_s: float = 0.0

    @property
    def keys(self) -> list[KeyRecord]:
        return [record for pair in self.pairs for record in pair.keys]

    @property
    def notes(self) -> list[str]:
        return [note for pair in self.pairs for note in pair.notes]

    @property
    def not_comparable(self) -> list[KeyRecord]:
        return [record for pair in self.pairs for record in pair.not_comparable]

    @property
    def closest(self) -> Closest | None:
        return Closest.of(self.keys)

    @property
    def id_mismatches(self) -> list[Divergence]:
        """Every ids key that differs, over all pairs (divergent or not: see ``routing``)."""
        return [item for pair in self.pairs for item in pair.id_mismatches]

    @property
    def exit_status(self) -> int:
        """The CLI's exit status: 1 when something diverged; else 3 when some keys were not
        comparable (different phases or token counts) or expert ids differ where no reference
        router logits could judge them (docs/compare.md); else 0."""
        if self.first_divergence is not None:
            return 1
        unjudged = any(item.routing_verdict == "not_judged" for item in self.id_mismatches)
        return 3 if self.not_comparable or unjudged else 0

    def to_json(self) -> dict:
        """The report as strict-JSON-ready data (docs/compare.md, "Output")."""
        options = self.options
        return json_safe({
            "format": spec.REPORT_FORMAT,
            "format_version": spec.REPORT_FORMAT_VERSION,
            "ref": self.ref,
            "run": self.run,
            "threshold": options.threshold,
            "threshold_for": [[pattern, value] for pattern, value in options.overrides],
            "norm_threshold": options.norm_threshold,
            "default_thresholds": default_thresholds_json(),
            "thresholds": threshold_uses(self.keys),
            "map": [[pattern, replacement] for pattern, replacement in options.maps],
            "near_tie": ({"epsilon": options.near_tie} if options.near_tie is not None
                         else {"ulps_of_ref_top1": options.near_tie_ulps}),
            "first_divergence": _opt(self.first_divergence),
            "prefill_divergence": _opt(self.prefill_divergence),
            "decode_divergence": _opt(self.decode_divergence),
            "first_id_mismatch": _opt(self.first_id_mismatch),
            "id_mismatches": [item.to_json() for item in self.id_mismatches],
            "root_cause": _opt(self.root_cause),
            "first_argmax_flip": _opt(self.first_argmax_flip),
            "closest": _opt(self.closest),
            "compared": sum(pair.compared for pair in self.pairs),
            "not_comparable": [{"key": record.key, "rank": record.rank, "reason": record.reason,
                                **(record.sides or SideFacts()).to_json()} for record in self.not_comparable],
            "keys": [record.to_json() for record in self.keys],
            "problems": [problem.to_json() for problem in self.problems],
            "notes": self.notes,
            "pairs": [pair.to_json() for pair in self.pairs],
            "elapsed_s": round(self.elapsed_s, 4),
            "exit_status": self.exit_status,
        })


def _opt(item) -> dict | None:
    return item.to_json() if item is not None else None


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None, so it serialises as strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, np.generic):
        return json_safe(value.item())
    return value


def write_json_report(report: Report, path: str | Path) -> None:
    """Write the report as strict JSON (NaN/inf become null)."""
    Path(path).write_text(json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n", encoding="utf-8")
