"""The comparator's results as typed records, and the one place they become JSON.

:meth:`Report.to_json` gives the ``--json`` report whose fields docs/compare.md ("Output")
documents; every ``to_json`` method below is part of it. NaN and infinities become None there
(:func:`json_safe`), so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..format import spec
from .metrics import FloatMetrics, IdMetrics
from .options import CompareOptions


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
    status: str = "ok"  # ok | divergent | mismatch | skipped
    divergent: bool = False
    threshold: float | None = None
    floats: FloatMetrics | None = None
    ids: IdMetrics | None = None
    logits: bool = False  # margin columns computed (1-D logits)
    margin_analysis: bool = False  # decode logits: counted for argmax flips
    metric: str | None = None  # rel_diff | nonfinite
    value: float | int | None = None
    argmax_equal: bool | None = None  # set with near_tie_epsilon when margins were computed
    near_tie_epsilon: float | None = None
    merge: MergeInfo | None = None
    position: int = 0  # index in model order within its pair

    @property
    def metric_kind(self) -> str | None:
        return "float" if self.floats is not None else ("ids" if self.ids is not None else None)

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "key": self.key, "rank": self.rank, "kind": self.kind, "tag": self.tag, "layer": self.layer,
            "step": self.step, "phase": self.phase, "shape_ref": self.shape_ref, "shape_run": self.shape_run,
            "dtype_ref": self.dtype_ref, "dtype_run": self.dtype_run, "status": self.status,
            "divergent": self.divergent,
        }
        if self.floats is not None:
            out.update(metric_kind="float", threshold=self.threshold)
            out.update(_float_json(self.floats))
            out.update(logits=self.logits, margin_analysis=self.margin_analysis)
            if self.metric is not None:
                out.update(metric=self.metric, value=self.value)
            if self.argmax_equal is not None:
                out.update(argmax_equal=self.argmax_equal, near_tie_epsilon=self.near_tie_epsilon)
        elif self.ids is not None:
            out["metric_kind"] = "ids"
            out.update(_ids_json(self.ids))
        if self.merge is not None:
            out.update(self.merge.to_json())
        out["position"] = self.position
        return out


def _float_json(metrics: FloatMetrics) -> dict:
    out = {name: getattr(metrics, name) for name in (
        "rel_diff", "cosine", "max_abs", "mean_abs", "rel_l2", "nan_ref", "nan_run", "inf_ref", "inf_run",
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

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "key": self.key, "layer": self.layer, "step": self.step, "phase": self.phase, "rank": self.rank,
            "position": self.position, "last_good": self.last_good, "last_good_step": self.last_good_step,
            "metric": self.metric, "value": self.value, "threshold": self.threshold,
        }
        if self.metric == "ids":
            out.update(row=self.row, overlap=self.overlap, k=self.k)
        if self.merge is not None:
            out.update(merge=self.merge.how, worst_rank=self.merge.worst_rank,
                       worst_rank_value=self.merge.worst_rank_value, merged_ranks=self.merge.merged_ranks,
                       divergent_ranks=self.merge.divergent_ranks)
        if self.reason is not None:
            out["reason"] = self.reason
        return out


@dataclass
class ArgmaxFlip:
    """The first decode step whose argmax differs, classified near-tie or divergence."""

    step: int
    key: str
    tag: str
    rank: str
    kind: str  # near-tie | divergence
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

    @property
    def compared(self) -> int:
        return len(self.keys)

    @property
    def divergent_keys(self) -> int:
        return sum(1 for record in self.keys if record.divergent)

    def to_json(self) -> dict:
        return {"rank": self.rank, "ref": self.ref, "run": self.run, "ref_manifest": self.ref_manifest,
                "run_manifest": self.run_manifest, "compared": self.compared, "divergent_keys": self.divergent_keys,
                "first_divergence": _opt(self.first_divergence), "first_argmax_flip": _opt(self.first_argmax_flip),
                "decode_margins": _opt(self.decode_margins)}


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
    def exit_status(self) -> int:
        """1 when something diverged, else 0 (the CLI's exit status)."""
        return 1 if self.first_divergence is not None else 0

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
            "near_tie": ({"epsilon": options.near_tie} if options.near_tie is not None
                         else {"ulps_of_ref_top1": options.near_tie_ulps}),
            "first_divergence": _opt(self.first_divergence),
            "prefill_divergence": _opt(self.prefill_divergence),
            "decode_divergence": _opt(self.decode_divergence),
            "first_id_mismatch": _opt(self.first_id_mismatch),
            "root_cause": _opt(self.root_cause),
            "first_argmax_flip": _opt(self.first_argmax_flip),
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
