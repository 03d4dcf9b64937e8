"""Which dump files a path names: one file per rank label, the newest of several of one rank.

A directory may hold several files of one rank: data-parallel engines whose processes all report
RANK=0 (they differ by pid), a run done again in the same directory, or the dump `compiledump
recover` wrote of a process that died beside the one its rerun flushed. "Newest" is the run's
time, not the file's: a manifest's `created_unix` (a recovered dump's is the dead process's start,
so the recovery, done later, does not make the crashed run the newest), else the file's
modification time (a file without a manifest).

Also which names a directory's files hold (`name_taken`, `next_free_stem`): a writer never replaces
another process's dump or crash-proof files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import spec
from .reader import DumpError


@dataclass(frozen=True)
class DuplicateRank:
    """A file left out because a newer file of the same rank was found beside it."""

    rank: str
    path: Path
    used: Path


# Why a side may have no dump: capture is off unless COMPILEDUMP_DIR is set, and a run writes only
# what it captured.
_WHERE = "a run writes its dump into COMPILEDUMP_DIR (capture is off without it) when it captured something"


def collect_dumps(path: str | Path, label: str) -> tuple[dict[str, Path], list[DuplicateRank]]:
    """Dump files of one side by rank label, and the files left out as duplicates of a rank.

    ``path`` is an npz file or a directory of ``compiledump_rank<R>_pid<P>.npz`` /
    ``deepinfer_layers_rank<R>_pid<P>.npz`` files. A file whose name carries no rank gets the label
    ``?``. When a directory holds several files of one rank, the newest run's is used (module
    docstring).
    """
    path = Path(path)
    if path.is_dir():
        files = sorted({found for pattern in spec.DUMP_GLOBS for found in path.glob(pattern) if found.is_file()})
        if not files:
            raise DumpError(f"{label} {path}: directory holds no dumps ({' or '.join(spec.DUMP_GLOBS)}); {_WHERE}")
        by_rank: dict[str, list[Path]] = {}
        for found in files:  # (a name the globs match but the pattern does not, say `..._pid1_old.npz`: no rank)
            match = spec.DUMP_NAME.match(found.name)
            by_rank.setdefault(match.group("rank") if match else "?", []).append(found)
        chosen: dict[str, Path] = {}
        duplicates: list[DuplicateRank] = []
        for rank, candidates in by_rank.items():
            candidates.sort(key=lambda candidate: (_run_time(candidate), candidate.name))
            chosen[rank] = candidates[-1]
            duplicates.extend(DuplicateRank(rank, ignored, candidates[-1]) for ignored in candidates[:-1])
        return chosen, duplicates
    if not path.exists():
        raise DumpError(f"{label} {path}: no such file or directory; {_WHERE}")
    match = spec.DUMP_NAME.match(path.name)
    return {match.group("rank") if match else "?": path}, []


def manifest_of(npz: Path) -> dict:
    """The manifest beside `npz` as a JSON object, or {} where there is none that can be read
    (for a look at one field; format/reader.py reads a dump's manifest whole, with its checks)."""
    try:
        manifest = json.loads(npz.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _run_time(npz: Path) -> float:
    """When the run that wrote `npz` wrote it: its manifest's `created_unix`, else the file's time."""
    created = manifest_of(npz).get("created_unix")
    return float(created) if isinstance(created, (int, float)) else npz.stat().st_mtime


def name_taken(directory: str | Path, stem: str) -> bool:
    """Whether `directory` holds a dump, or crash-proof files, named `stem` (a link counts, even a
    dangling one)."""
    return any(os.path.lexists(os.path.join(directory, stem + suffix)) for suffix in (".npz", ".json", spec.LIVE_SUFFIX))


def next_free_stem(directory: str | Path, stem: str) -> str:
    """The first `<rank/pid stem>_<n>` after `stem` that `directory` holds nothing of (a dump the
    same process wrote is not to be replaced: recover after a switch of directory)."""
    named = spec.DUMP_NAME.match(f"{stem}.npz")
    if named is None:
        return f"{stem}_recovered"
    copy = int(named["copy"] or 1) + 1
    while name_taken(directory, spec.dump_stem(named["rank"], int(named["pid"]), copy)):
        copy += 1
    return spec.dump_stem(named["rank"], int(named["pid"]), copy)
