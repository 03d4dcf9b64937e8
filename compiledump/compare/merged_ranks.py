"""A key one side holds merged from several ranks (tensor/expert parallel): every replica measured
against the single side, and each rank's shard against its slice of it, so the worst rank can
be named (``compiledump.compare.shards`` merges the files; this measures the result)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..format.keys import KeyInfo
from ..format.reader import Dump
from .key_record import KeyRecord, MergeInfo, RankPart


def measure_merged(measure, ref: Dump, run: Dump, record: KeyRecord, info: KeyInfo) -> KeyRecord:
    """One side merged from several ranks: every replica of the merged side against the
    single side (the record keeps the worst), and, for concatenated shards, each rank's
    shard against the matching slice of the single side, so the worst rank can be named.
    Partial sums cannot be attributed to one rank: their ``worst_rank`` is None. `measure` is
    ``KeyMeasurer.measure``: one pair of arrays into a record."""
    merged_is_ref = ref.merged_ranks is not None
    merged, single = (ref, run) if merged_is_ref else (run, ref)
    key = info.key
    (single_copy,) = single.replicas(key)
    other = np.asarray(single_copy.whole())

    def oriented(mine: np.ndarray, theirs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (mine, theirs) if merged_is_ref else (theirs, mine)

    replicas = merged.replicas(key)
    trials: list[tuple[KeyRecord, list[RankPart]]] = []
    # Copies of one rank each (a replicated key): bit-equal on every rank, none of them can be named.
    first_whole = None
    equal_partials = False  # (below)
    identical = len(replicas) > 1 and all(replica.shard is None and len(replica.parts) == 1 for replica in replicas)
    for replica in replicas:
        arrays = replica.arrays()
        whole = replica.combine(arrays)
        if first_whole is None:
            first_whole = np.array(whole, copy=True)
        elif identical:  # bit-equal replicas (after an all-reduce): no one rank made the value
            identical = whole.shape == first_whole.shape and np.array_equal(whole, first_whole, equal_nan=True)
        flat_other = other.reshape(whole.shape)
        trial = measure(record, *oriented(whole, flat_other), info)
        parts: list[RankPart] = []
        if replica.shard is None:
            parts.append(_part(replica.ranks[0], trial))
        elif replica.shard.how == "concat":
            start = 0
            for rank, array in zip(replica.ranks, arrays):
                stop = start + array.shape[replica.shard.dim]
                piece = np.take(flat_other, np.arange(start, stop), axis=replica.shard.dim)
                result = measure(record, *oriented(array, piece), info, margins=False)
                parts.append(_part(rank, result, (start, stop)))
                start = stop
        else:
            parts.extend(RankPart(rank, partial_sum=True) for rank in replica.ranks)
            equal_partials = equal_partials or (len(arrays) > 1 and bool(np.any(arrays[0])) and all(
                array.shape == arrays[0].shape and np.array_equal(array, arrays[0]) for array in arrays[1:]))
        trials.append((trial, parts))
        del arrays, whole
    worst, _ = max(trials, key=lambda item: _badness(item[0]))
    every = [part for _, parts in trials for part in parts]
    rated = [part for part in every if not part.partial_sum]
    shard = replicas[0].shard
    merge = MergeInfo(shard.describe() if shard is not None else "each rank", merged.merged_ranks, every,
                      [part.rank for part in rated if part.divergent], identical=identical,
                      equal_partial_sums=equal_partials)
    if worst.divergent and rated and not identical:
        worst_part = max(rated, key=_badness)
        merge.worst_rank, merge.worst_rank_value = worst_part.rank, worst_part.value
    return replace(worst, merge=merge)


def _part(rank: str, result: KeyRecord, span: tuple[int, int] | None = None) -> RankPart:
    return RankPart(rank, result.divergent, span, result.floats, result.ids)


def _badness(item: KeyRecord | RankPart) -> tuple:
    """Orders results from best to worst (for picking the worst replica or rank)."""
    if item.ids is not None:
        return (item.divergent, item.ids.mismatched_elements, 0.0)
    floats = item.floats
    return (item.divergent, floats.nonfinite_mismatch if floats else 0, floats.rel_diff if floats else 0.0)


__all__ = ["measure_merged"]
