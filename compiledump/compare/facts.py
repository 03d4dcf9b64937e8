"""Summaries over a pair's key records that the report states: what each side's manifest says
about a key, the key closest to its threshold, and the thresholds that were used."""

from __future__ import annotations

from dataclasses import dataclass

from .options import DEFAULT_THRESHOLDS, phase_thresholds


@dataclass(frozen=True)
class SideFacts:
    """What the two manifests say about one key: source dtypes, and the token count and phase of
    the call whose value each side kept (None where a manifest does not say)."""

    source_dtype_ref: str | None = None
    source_dtype_run: str | None = None
    tokens_ref: int | None = None
    tokens_run: int | None = None
    phase_ref: str | None = None
    phase_run: str | None = None

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in (
            "source_dtype_ref", "source_dtype_run", "tokens_ref", "tokens_run", "phase_ref", "phase_run")}


@dataclass(frozen=True)
class Closest:
    """The compared float key nearest to a threshold: the largest value/threshold over both
    metrics (all-rows keys: over their rows)."""

    key: str
    rank: str
    layer: int | None
    step: int | None
    metric: str
    value: float | None
    threshold: float | None
    ratio: float

    @staticmethod
    def of(records: list) -> Closest | None:
        """The closest of ``records`` (report.KeyRecord), or None without compared float keys."""
        rated = [(record.closeness, record) for record in records
                 if record.floats is not None and record.status not in ("not_comparable", "shown")]
        if not rated:
            return None
        (ratio, metric, value, threshold), record = max(rated, key=lambda item: item[0][0])
        return Closest(record.key, record.rank, record.layer, record.step, metric, value, threshold, ratio)

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in (
            "key", "rank", "layer", "step", "metric", "value", "threshold", "ratio")}


def threshold_uses(records: list) -> list[dict]:
    """The thresholds the compared float keys were judged by, one entry per source-dtype pair
    and threshold set, with how many keys used it."""
    uses: dict[tuple, dict] = {}
    for record in records:
        limits = record.limits
        if record.floats is None or limits is None:
            continue
        sides = record.sides or SideFacts()
        group = (record.rank, sides.source_dtype_ref, sides.source_dtype_run, limits)
        entry = uses.setdefault(group, {
            "rank": record.rank, "ref_dtype": sides.source_dtype_ref, "run_dtype": sides.source_dtype_run,
            "class": limits.klass, "rel_diff": limits.rel_diff, "norm_diff": limits.norm_diff,
            "rel_source": limits.rel_source, "norm_source": limits.norm_source, "keys": 0})
        entry["keys"] += 1
    return list(uses.values())


def default_thresholds_json() -> dict:
    """{class: {rel_diff, norm_diff, decode_rel_diff, decode_norm_diff}}: the defaults of every key
    but the decode steps, and those of the decode steps."""
    out = {}
    for klass, (rel, norm) in DEFAULT_THRESHOLDS.items():
        decode_rel, decode_norm = phase_thresholds(klass, "decode")
        out[klass] = {"rel_diff": rel, "norm_diff": norm, "decode_rel_diff": decode_rel,
                      "decode_norm_diff": decode_norm}
    return out
