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
from .inputs import FedTokens
from .key_record import KeyRecord, MergeInfo
from .options import CompareOptions
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
    caution: str | None = None  # why this divergence may be noise (a hybrid model's bf16 layers: a note says more)

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
                       divergent_ranks=self.merge.divergent_ranks, identical_on_ranks=self.merge.identical)
        if self.reason is not None:
            out["reason"] = self.reason
        if self.caution is not None:
            out["caution"] = self.caution
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
    kind: str  # near-tie | after-routing-flip | within-thresholds | divergence
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
    prompt_tokens_ref: int | None = None  # each side's own
    prompt_tokens_run: int | None = None
    renamed: dict[str, str] = field(default_factory=dict)  # --map: new RUN key -> old
    fed_tokens: FedTokens | None = None  # the first decode step fed different tokens (inputs.py)
    step_zero_in_prompt: bool = False  # step 0 is the prompt's last position (inputs.step_zero_in_prompt)
    fewer_steps: str | None = None  # one side ran fewer decode steps (one_sided.py `fewer_steps`)
    ended_early: str | None = None  # a side's process died before the other's keys (phases.ended_early)

    @property
    def compared(self) -> int:
        return sum(1 for record in self.keys if record.status not in ("not_comparable", "skipped"))

    @property
    def not_comparable(self) -> list[KeyRecord]:
        return [record for record in self.keys if record.status == "not_comparable"]

    @property
    def not_compared(self) -> list[KeyRecord]:
        """Keys both sides hold that were not compared (shapes or dtypes that cannot be, an
        unreadable array): their problems say why."""
        return [record for record in self.keys if record.status == "skipped"]

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
                "prompt_tokens_ref": self.prompt_tokens_ref, "prompt_tokens_run": self.prompt_tokens_run,
                "first_divergence": _opt(self.first_divergence), "first_argmax_flip": _opt(self.first_argmax_flip),
                "id_mismatches": [item.to_json() for item in self.id_mismatches],
                "decode_margins": _opt(self.decode_margins), "closest": _opt(self.closest),
                "thresholds": threshold_uses(self.keys), "not_captured": self.not_captured,
                "first_nonfinite": self.nonfinite, "renamed": self.renamed,
                "fed_tokens_differ": _opt(self.fed_tokens), "fewer_steps": self.fewer_steps,
                "ended_early": self.ended_early}


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
    def not_compared(self) -> list[KeyRecord]:
        return [record for pair in self.pairs for record in pair.not_compared]

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
        comparable (different phases or token counts) or not compared (shapes or dtypes that
        cannot be), expert ids differ where no reference router logits could judge them, or a
        side's process died before capturing keys the other holds (docs/compare.md); else 0."""
        if self.first_divergence is not None:
            return 1
        unjudged = any(item.routing_verdict == "not_judged" for item in self.id_mismatches)
        died = any(pair.ended_early for pair in self.pairs)
        return 3 if self.not_comparable or self.not_compared or unjudged or died else 0

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


def report_json_text(report: Report) -> str:
    """The report as strict JSON text (NaN/inf become null)."""
    return json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n"


def write_json_report(report: Report, path: str | Path) -> None:
    """Write the report as strict JSON (NaN/inf become null)."""
    Path(path).write_text(report_json_text(report), encoding="utf-8")
