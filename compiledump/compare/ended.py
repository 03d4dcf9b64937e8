"""How a side's process ended, where its manifest says it did not end normally: rebuilt by
`compiledump recover` from a dead process's files (`recovered`), or flushed as an unhandled
exception or a signal ended it (`ended_by`). A side that died before capturing keys the other
holds could not be judged whole: a note says how it died, and the verdict exits 3 where nothing
diverged (`ended_early`), instead of reading as a run that ended normally."""

from __future__ import annotations

from ..format.reader import Dump
from .one_sided import OneSidedKeys
from .phases import other_side
from .report import Problem


def lacking_keys(problems: list[Problem], one_sided: OneSidedKeys) -> dict[str, int]:
    """{side: how many keys of the other side it lacks}: its unexplained one-sided keys and the
    steps past its last (one_sided.py `ended`)."""
    return {side: sum(problem.kind == kind for problem in problems) + len(one_sided.explained["ended"][other])
            for side, other, kind in (("RUN", "REF", "missing_in_run"), ("REF", "RUN", "extra_in_run"))}


def died_of(dump: Dump) -> str | None:
    """How the process that wrote `dump` died, where its manifest says: rebuilt by `compiledump
    recover` from a dead process's files (`recovered`), or flushed as an unhandled exception or
    a signal ended it (`ended_by`). None for a process that ended normally (or a dump without a
    manifest)."""
    manifest = dump.manifest or {}
    recovered, ended = manifest.get("recovered"), manifest.get("ended_by")
    if isinstance(recovered, dict):
        return f"was recovered from a process that died before flushing ({recovered.get('cause')})"
    if not isinstance(ended, dict):
        return None
    whose = f" (rank {ended['rank']}'s)" if ended.get("rank") is not None else ""  # (a merged side's)
    if ended.get("exception"):
        message = str(ended.get("message") or "").strip().splitlines()
        said = f": {message[0][:200]}" if message else ""
        return f"was written at exit by a process{whose} that died of an unhandled {ended['exception']}{said}"
    if ended.get("signal"):
        return f"was written by compiledump's {ended['signal']} handler as that signal ended the process{whose}"
    return None


def died_note(side: str, dump: Dump, lacking: int) -> str | None:
    """A note when a side's process died (died_of); `lacking`: the keys the other side holds that
    it lacks (and that nothing else explains), judged nowhere."""
    died = died_of(dump)
    if died is None:
        return None
    if not lacking:
        return f"{side} {died}: it holds every key the other side holds"
    return (f"{side} {died}: it ends where that process stopped, and the {lacking} keys of "
            f"{other_side(side)} past that point (listed as problems or above) were not judged")


def ended_early(dumps: dict, lacking: dict[str, int]) -> str | None:
    """For the verdict's last line and the exit status (3 where nothing diverged): which side's
    process died (died_of) before capturing keys the other side holds, or None."""
    said = [f"{side} ended early: its process died ({lacking[side]} keys of {other_side(side)} not judged)"
            for side in ("REF", "RUN") if lacking[side] and died_of(dumps[side]) is not None]
    return "; ".join(said) or None
