"""Finding the two sides' dump files and pairing them: by rank, single file with single file, or
a single file with the merged shard sets of a sharded multi-rank run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..format.files import DuplicateRank, collect_dumps
from ..format.reader import Dump, DumpError, DumpFile, rank_sort_key
from .phases import other_side
from .report import Problem
from .shards import holds_a_part, merge_side


@dataclass
class Pair:
    """Two sides to compare, and the rank label of the pair (``0``, ``?``, or ``0+1`` merged)."""

    rank: str
    ref: Dump
    run: Dump


def find_pairs(ref_path: str | Path, run_path: str | Path) -> tuple[list[Pair], list[Problem]]:
    """The pairs to compare, and the problems met finding them (duplicate and unpaired ranks).

    Raises :class:`DumpError` for unusable input: a missing path, a directory without dumps, no
    rank in common, a file that cannot be read."""
    ref_files, ref_duplicates = collect_dumps(ref_path, "REF")
    run_files, run_duplicates = collect_dumps(run_path, "RUN")
    problems = _duplicates(ref_duplicates, "REF") + _duplicates(run_duplicates, "RUN")
    pairs = _merged_pairs(ref_files, run_files)
    if pairs is None:
        ranked, unpaired = pair_by_rank(ref_files, run_files)
        problems += unpaired
        pairs = [Pair(rank, DumpFile(ref, "REF"), DumpFile(run, "RUN")) for rank, ref, run in ranked]
    return pairs, problems


def _duplicates(duplicates: list[DuplicateRank], side: str) -> list[Problem]:
    return [Problem("duplicate_rank", found.rank, f"{side} has several files for rank {found.rank}; using the newest, "
                                                  f"{found.used.name}", side=side, file=str(found.path))
            for found in duplicates]


def pair_by_rank(ref: dict[str, Path], run: dict[str, Path]) -> tuple[list[tuple[str, Path, Path]], list[Problem]]:
    """Pair the two sides' files by rank; a side with one file pairs with the other's single file."""
    if len(ref) == 1 and len(run) == 1:
        (ref_rank, ref_path), (run_rank, run_path) = next(iter(ref.items())), next(iter(run.items()))
        label = ref_rank if ref_rank == run_rank else (ref_rank if ref_rank != "?" else run_rank)
        return [(label, ref_path, run_path)], []
    pairs = [(rank, ref[rank], run[rank]) for rank in sorted(ref.keys() & run.keys(), key=rank_sort_key)]
    problems = []
    for side, mine, other in (("REF", ref, run), ("RUN", run, ref)):
        for rank in sorted(mine.keys() - other.keys(), key=rank_sort_key):
            problems.append(Problem("unpaired_rank", rank, f"rank {rank} exists only in {side} ({mine[rank].name})",
                                    side=side, file=str(mine[rank])))
    if not pairs:
        hint = ""
        for side, mine, other in (("REF", ref, run), ("RUN", run, ref)):
            if len(mine) == 1 and len(other) > 1:  # one process against several ranks that declared no shards
                several, first = other_side(side), other[min(other, key=rank_sort_key)]
                hint = (f"; {several}'s ranks declare no shards (compiledump.declare_shard), so they are paired by "
                        f"rank, not merged: where each rank holds whole values (replicated or all-reduced), compare "
                        f"{side} with one rank's file ({first.name}); where they hold parts, declare them on "
                        f"{several} (docs/multi-rank.md)")
        raise DumpError(
            f"no rank in common: REF has ranks {sorted(ref, key=rank_sort_key)}, "
            f"RUN has ranks {sorted(run, key=rank_sort_key)}{hint}"
        )
    return pairs, problems


def _merged_pairs(ref: dict[str, Path], run: dict[str, Path]) -> list[Pair] | None:
    """When one side is a single file and the other several per-rank files whose manifests
    declare shards, pair each merged shard set of the several with the single file (labelled
    by its ranks, e.g. ``0+1``). The same when the other side is one file that is a part of a
    sharded run (rank 0 of tp_size 2, its other ranks' files missing) and the single file is
    not: its shards cannot be merged and must not be compared as whole values (a partial sum
    against the full value would be a false divergence). None otherwise: files are paired by rank."""
    parts = None  # two single files: which of them is one rank's part, decided once
    if len(ref) == 1 and len(run) == 1:
        parts = {"REF": _is_a_part(ref), "RUN": _is_a_part(run)}
        if parts["REF"] == parts["RUN"]:
            return None  # compared as they are, shards against shards (or wholes against wholes)
    for single, several, label in ((ref, run, "RUN"), (run, ref, "REF")):
        if len(single) != 1 or not several or (parts is not None and not parts[label]):
            continue
        merged = merge_side(several, label)
        if merged is None:
            continue
        (only,) = single.values()
        pairs = []
        for dump in merged:
            other = DumpFile(only, "RUN" if label == "REF" else "REF")
            name = "+".join(dump.merged_ranks)
            pairs.append(Pair(name, dump, other) if label == "REF" else Pair(name, other, dump))
        return pairs
    return None


def _is_a_part(files: dict[str, Path]) -> bool:
    """Whether the one file in ``files`` holds only its rank's part of a key (holds_a_part)."""
    ((rank, path),) = files.items()
    return holds_a_part(DumpFile(path, "REF"), rank)
