"""Measuring one key of a REF/RUN pair into a :class:`KeyRecord`: the checks that decide whether
it can be compared, its metrics, and whether it diverges. For a side merged from several
ranks, also each rank's share, so the worst rank can be named."""

from __future__ import annotations

import zipfile
from dataclasses import replace

import numpy as np

from ..format.keys import KeyInfo
from ..format.reader import Dump, Member
from .metrics import Workspace, compare_float_arrays, compare_id_arrays
from .options import CompareOptions
from .report import KeyRecord, MergeInfo, Problem, RankPart


def logits_tags(infos: list[KeyInfo], members: dict[str, Member]) -> set[str]:
    """Step tags analysed for margins: those whose name contains ``logits`` if any, else every
    step tag whose arrays are 1-D floats."""
    step_infos = [info for info in infos if info.kind == "step"]
    named = {info.tag for info in step_infos if "logits" in info.tag}
    if named:
        return named
    return {info.tag for info in step_infos
            if info.key in members and len(members[info.key].shape) == 1 and not members[info.key].is_integer}


class KeyMeasurer:
    """Measures the keys of one pair; holds what every key shares (settings, buffers)."""

    def __init__(self, ref: Dump, run: Dump, options: CompareOptions, rank: str, logits: set[str],
                 workspace: Workspace) -> None:
        self.ref, self.run = ref, run
        self.options = options
        self.rank = rank
        self.logits = logits
        self.workspace = workspace

    def record(self, info: KeyInfo, problems: list[Problem]) -> KeyRecord:
        """Compare ``info.key`` (present on both sides); problems met go to ``problems``."""
        key = info.key
        ref_member, run_member = self.ref.members[key], self.run.members[key]
        record = KeyRecord(key=key, rank=self.rank, kind=info.kind, tag=info.tag, layer=info.layer, step=info.step,
                           phase=info.phase, shape_ref=list(ref_member.shape), shape_run=list(run_member.shape),
                           dtype_ref=str(ref_member.dtype), dtype_run=str(run_member.dtype))
        dtypes = f"{ref_member.dtype} vs {run_member.dtype}"
        if ref_member.is_integer != run_member.is_integer:
            problems.append(Problem("dtype_mismatch", self.rank, f"{dtypes}: integer ids vs floats, not compared", key))
            record.status = "skipped"
            return record
        if ref_member.dtype != run_member.dtype:
            how = "compared as integers" if ref_member.is_integer else "compared in float64"
            problems.append(Problem("dtype_mismatch", self.rank, f"{dtypes}: {how}", key))
        if ref_member.shape != run_member.shape:
            shapes = f"{list(ref_member.shape)} vs {list(run_member.shape)}"
            if _squeezed(ref_member.shape) != _squeezed(run_member.shape):
                problems.append(Problem("shape_mismatch", self.rank, f"{shapes}: not compared", key))
                record.status = "skipped"
                return record
            problems.append(Problem("shape_mismatch", self.rank,
                                    f"{shapes}: differ only by size-1 dimensions, compared flattened", key))
        try:
            if self.ref.merged_ranks is None and self.run.merged_ranks is None:
                (ref_copy,), (run_copy,) = self.ref.replicas(key), self.run.replicas(key)
                return self.measure(record, ref_copy.whole(), run_copy.whole(), info)
            return self._measure_merged(record, info)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            problems.append(Problem("unreadable", self.rank, f"could not read the arrays: {exc}", key))
            record.status = "skipped"
            return record

    def measure(self, record: KeyRecord, x: np.ndarray, y: np.ndarray, info: KeyInfo,
                margins: bool = True) -> KeyRecord:
        """``record`` with the metrics of REF array ``x`` against RUN array ``y`` and, when the
        key diverges, ``status``/``divergent`` and (floats) the ``metric`` and ``value`` that crossed."""
        if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
            if x.shape != y.shape:
                x, y = x.reshape(-1), y.reshape(-1)
            ids = compare_id_arrays(x, y)
            return replace(record, ids=ids, status="ok" if ids.ids_equal else "mismatch", divergent=not ids.ids_equal)
        # Decode logits drive the argmax-flip analysis; the prefill logits (a 1-D `logits`
        # record) get the same margin columns for reading, but no flip classification.
        step_logits = margins and info.kind == "step" and info.tag in self.logits
        prefill_logits = margins and info.kind != "step" and "logits" in info.tag and x.ndim == 1
        want_margins = step_logits or prefill_logits
        threshold = self.options.threshold_for(info.key)
        floats = compare_float_arrays(x, y, margins=want_margins, chunk=self.options.chunk_elements,
                                      workspace=self.workspace)
        record = replace(record, threshold=threshold, floats=floats, logits=want_margins,
                         margin_analysis=step_logits)
        if floats.nonfinite_mismatch > 0:
            record = replace(record, status="divergent", divergent=True, metric="nonfinite",
                             value=floats.nonfinite_mismatch)
        elif floats.rel_diff > threshold:
            record = replace(record, status="divergent", divergent=True, metric="rel_diff", value=floats.rel_diff)
        if floats.margins is not None and floats.margins.ref.argmax is not None:
            record = replace(record, argmax_equal=floats.margins.ref.argmax == floats.margins.run.argmax,
                             near_tie_epsilon=self.options.near_tie_epsilon(floats.margins.ref.top1))
        return record

    def _measure_merged(self, record: KeyRecord, info: KeyInfo) -> KeyRecord:
        """One side merged from several ranks: every replica of the merged side against the
        single side (the record keeps the worst), and, for concatenated shards, each rank's
        shard against the matching slice of the single side, so the worst rank can be named.
        Partial sums cannot be attributed to one rank: their ``worst_rank`` is None."""
        merged_is_ref = self.ref.merged_ranks is not None
        merged, single = (self.ref, self.run) if merged_is_ref else (self.run, self.ref)
        key = info.key
        (single_copy,) = single.replicas(key)
        other = np.asarray(single_copy.whole())

        def oriented(mine: np.ndarray, theirs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return (mine, theirs) if merged_is_ref else (theirs, mine)

        replicas = merged.replicas(key)
        trials: list[tuple[KeyRecord, list[RankPart]]] = []
        for replica in replicas:
            arrays = replica.arrays()
            whole = replica.combine(arrays)
            flat_other = other.reshape(whole.shape)
            trial = self.measure(record, *oriented(whole, flat_other), info)
            parts: list[RankPart] = []
            if replica.shard is None:
                parts.append(_part(replica.ranks[0], trial))
            elif replica.shard.how == "concat":
                start = 0
                for rank, array in zip(replica.ranks, arrays):
                    stop = start + array.shape[replica.shard.dim]
                    piece = np.take(flat_other, np.arange(start, stop), axis=replica.shard.dim)
                    result = self.measure(record, *oriented(array, piece), info, margins=False)
                    parts.append(_part(rank, result, (start, stop)))
                    start = stop
            else:
                parts.extend(RankPart(rank, partial_sum=True) for rank in replica.ranks)
            trials.append((trial, parts))
            del arrays, whole
        worst, _ = max(trials, key=lambda item: _badness(item[0]))
        every = [part for _, parts in trials for part in parts]
        rated = [part for part in every if not part.partial_sum]
        shard = replicas[0].shard
        merge = MergeInfo(shard.describe() if shard is not None else "each rank", merged.merged_ranks, every,
                          [part.rank for part in rated if part.divergent])
        if worst.divergent and rated:
            worst_part = max(rated, key=_badness)
            merge.worst_rank, merge.worst_rank_value = worst_part.rank, worst_part.value
        return replace(worst, merge=merge)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _part(rank: str, result: KeyRecord, span: tuple[int, int] | None = None) -> RankPart:
    return RankPart(rank, result.divergent, span, result.floats, result.ids)


def _badness(item: KeyRecord | RankPart) -> tuple:
    """Orders results from best to worst (for picking the worst replica or rank)."""
    if item.ids is not None:
        return (item.divergent, item.ids.mismatched_elements, 0.0)
    floats = item.floats
    return (item.divergent, floats.nonfinite_mismatch if floats else 0, floats.rel_diff if floats else 0.0)
