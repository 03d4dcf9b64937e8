"""One key's comparison as a typed record (:class:`KeyRecord`), with how a merged multi-rank key
was put together (:class:`MergeInfo`, :class:`RankPart`), and their part of the ``--json``
report (docs/compare.md, "Output"). The pair- and report-level records are in report.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..format.keys import chosen
from .facts import SideFacts
from .metrics import FloatMetrics, IdMetrics, RowMetrics
from .options import Thresholds
from .routing import Routing


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
    identical: bool = False  # every rank holds a bit-equal copy: none of them can be named
    # Partial sums bit-equal on every rank: a value already all-reduced, declared how="sum"
    equal_partial_sums: bool = False

    def to_json(self) -> dict:
        out = {"merge": self.how, "merged_ranks": self.merged_ranks, "ranks": [part.to_json() for part in self.ranks],
               "divergent_ranks": self.divergent_ranks, "worst_rank": self.worst_rank,
               "identical_on_ranks": self.identical, "equal_partial_sums": self.equal_partial_sums}
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
    # ok | divergent | mismatch | skipped | not_comparable; ids: near_tie | not_judged;
    # floats after a routing flip (flips.py): after_near_tie | after_unjudged; a decode step's
    # router logits, read to judge its ids and not judged themselves: shown
    status: str = "ok"
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
    # A decode step's rel_diff/norm_diff taken relative to the median REF row of this prompt key
    # (measure.py _against_prompt_rows): the step's own row was smaller.
    scale_from: str | None = None
    routing: Routing | None = None  # ids that differ: near tie or divergence (compare/routing.py)
    # Token rows not judged because a routing flip in an earlier ids key reaches them (flips.py),
    # that ids key, and the metric/value that crossed in those rows (flips.excuse_flips).
    excused_rows: list[int] | None = None
    excused_by: list[str] | None = None
    excused_metric: str | None = None
    excused_value: float | None = None
    excused_near_tie: bool = True  # every excused row is reached by a near tie (else: "after_unjudged")

    @property
    def ids_differ(self) -> bool:
        """Integer ids compared and not equal (whether or not that is a divergence)."""
        return self.ids is not None and not self.ids.ids_equal

    @property
    def routing_differs(self) -> bool:
        """The ids differ, or they agree but a sparsemixer cut weighs a token's experts otherwise
        (compare/cut.py): some token may have been routed otherwise, honestly or not."""
        return self.ids_differ or (self.routing is not None and bool(self.routing.rows))

    @property
    def routes_flipped(self) -> bool:
        """Some token went to other experts (not only the same ones in another order), or the ids
        differ where no routing analysis can tell."""
        return self.routing_differs and (self.routing is None or bool(self.routing.flipped_rows))

    def ids_text(self) -> str:
        """``expert ids differ in 1/7 rows``."""
        ids = self.ids
        if ids.ids_equal:  # a sparsemixer's weights (compare/cut.py)
            total = ids.total_elements // max(self.routing.rows[0].k, 1)
            return f"expert weights differ in {len(self.routing.rows)}/{total} rows, the ids equal"
        noun = "picked keys" if chosen(self.key) == "keys" else "expert ids"
        return f"{noun} differ in {ids.mismatched_rows}/{ids.rows} rows" if ids.rows is not None else "ids differ"

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
            if self.scale_from is not None:
                out.update(scale_from=self.scale_from)
            out.update(logits=self.logits, margin_analysis=self.margin_analysis)
            if self.metric is not None:
                out.update(metric=self.metric, value=self.value)
            if self.excused_rows:
                out.update(excused_rows=self.excused_rows, excused_by=self.excused_by,
                           excused_metric=self.excused_metric, excused_value=self.excused_value,
                           excused_near_tie=self.excused_near_tie)
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
