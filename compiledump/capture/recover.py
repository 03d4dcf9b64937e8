"""`compiledump recover DIR`: what dead processes left turned into ordinary dumps.

Crash-proof capture (capture/persist.py) keeps a process's arena, control block and a journal of
its tag registry in `<dir>/<stem>.live/`. When the process dies without its exit-time flush
(SIGKILL, the OOM killer, `os._exit`, a segfault, a sticky CUDA error), those files are all
there is. This module rebuilds the registry from the journal, reads the files with the same
slicing as `flush()` (capture/collect.py: a write that was claimed but not committed is dropped as
`interrupted`, never read torn) and writes `<stem>.npz` + `<stem>.json`, the manifest marked
`recovered` with the cause it can tell. Needs numpy only (no torch), like compare and inspect.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..format import spec, writer
from ..format.files import manifest_of, next_free_stem
from ..format.routers import captured_routers
from ..ops import layout as L
from . import parallel
from .collect import collect, ctrl_digest
from .journal import RecoverError, last_flush, read_journal, registry, running, switched_to

# A leftover with no start event yet is left alone this long after it was made (recover_live)
UNSTARTED_GRACE_S = 120

# A recovered dump's faulthandler report, kept beside it: `<stem>.fault.txt`.
FAULT_SUFFIX = ".fault.txt"


@dataclass
class Recovered:
    """The outcome for one `<stem>.live/` directory."""

    live: Path
    npz: Path | None = None  # the dump written; None when skipped
    cause: str | None = None
    skipped: str | None = None  # why nothing was written (the process is still running)
    keys: int = 0
    interrupted: int = 0
    notes: list[str] = field(default_factory=list)


def leftovers(directory: str | os.PathLike) -> list[Path]:
    """The `<stem>.live/` directories in `directory` (not recursive)."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(p for p in path.glob(f"*{spec.LIVE_SUFFIX}") if p.is_dir())


def dead_leftovers(directory: str | os.PathLike) -> list[Path]:
    """The leftovers whose process is gone (what `compare` and `inspect` point to recover for)."""
    found = []
    for live in leftovers(directory):
        if _unstarted(live):  # it holds nothing to recover (recover removes it)
            continue
        try:
            start, events, _torn = read_journal(live)
        except RecoverError:
            found.append(live)  # unreadable: recover will say why
            continue
        if not running(start) and _complete_dump(live, events) is None:
            found.append(live)
    return found


def _complete_dump(live: Path, events: list[dict], ctrl: np.ndarray | None = None) -> Path | None:
    """The dump the process's last flush wrote (into the directory of `live`, or, after a switch of
    directory, into another), when nothing was captured after it (_nothing_since) and it is
    still there; else None."""
    flushed, cleared = _since_last_flush(events, live)
    if flushed is None:
        return None
    npz = Path(flushed.get("dir") or live.parent) / f"{flushed['stem']}.npz"
    if not (npz.is_file() and npz.with_suffix(".json").is_file()):
        return None
    if ctrl is None:
        try:
            ctrl = np.fromfile(live / spec.LIVE_CTRL, dtype=np.int32)
        except OSError:
            return None
    return npz if _nothing_since(flushed, cleared, ctrl) else None


def _since_last_flush(events: list[dict], live: Path) -> tuple[dict | None, bool]:
    """The process's last flush event (into any directory; None without one) and whether a
    clear() came after it."""
    index, flushed = last_flush(events, live, anywhere=True)
    return flushed, any(event.get("event") == "clear" for event in events[index + 1 :])


def _nothing_since(flushed: dict, cleared: bool, ctrl: np.ndarray) -> bool:
    """Whether nothing was captured after the flush `flushed`: the control block is the one it read,
    or, `cleared` after it, no capture was kept since (a cleared block can count the same again).
    What the process captured is in that flush's dump (or was discarded): the exit flush would
    write nothing."""
    return not L.kept_any(ctrl) if cleared else flushed.get("ctrl") == ctrl_digest(ctrl)


def _annotations(npz: Path, start: dict) -> dict:
    """What only the process's Python state knew, from the dump its last flush wrote (when that
    manifest is this process's): `parallel`, `filtered_tags` and the keys' `shard` by tag."""
    manifest = manifest_of(npz)
    if manifest.get("pid") != start.get("pid"):
        return {}
    keys = manifest.get("keys") if isinstance(manifest.get("keys"), dict) else {}
    # By tag and kind: a step tag's later steps have its earlier steps' declaration.
    shards = {(entry.get("tag"), entry.get("kind")): entry["shard"] for entry in keys.values()
              if isinstance(entry, dict) and entry.get("shard")}
    return {"parallel": manifest.get("parallel") or {}, "filtered_tags": manifest.get("filtered_tags") or {},
            "shards": shards}


def fault_report(live: Path) -> str:
    """Python's faulthandler report the dead process left (a segfault's or abort's stack), or ''."""
    try:
        return (live / spec.LIVE_FAULT).read_text(errors="replace").strip()
    except OSError:
        return ""


def cause_of(fault: str, events: list[dict], report: str) -> str:
    """What the files say of how the process ended: the faulthandler report `fault` (its first
    line; `report` names where it can be read after recovery), else the journal's `events`."""
    if fault:
        return f"{fault.splitlines()[0]} (faulthandler's report: {report})"
    for event in reversed(events):
        if event.get("event") == "exit_flush_failed":
            return f"the process exited, but its flush at exit failed: {event.get('error')}"
        if event.get("event") == "exception":
            return (f"unhandled exception {event.get('type')}: {event.get('message')} (the flush at exit did not "
                    "finish)")
        if event.get("event") == "signal":
            return "a signal whose handler had flushed the dump first (recovered again, the same captures or more)"
    return ("the process ended without flushing: SIGKILL (also the OOM killer's), os._exit, a crash with no "
            "report, a SIGTERM or SIGINT with COMPILEDUMP_SIGNALS=0, or power loss")


def _unstarted(live: Path) -> bool:
    """Whether `live`'s journal has no complete line: its process was killed while making the files
    (the start event is their last step, before the runtime exists), so they hold no capture."""
    try:
        return b"\n" not in (live / spec.LIVE_JOURNAL).read_bytes()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # unreadable: read_journal says why


def _pid_alive(live: Path) -> bool:
    """Whether the pid in `live`'s name (`..._pid<P>[_<n>].live`) is a process on this host."""
    match = spec.DUMP_NAME.match(live.name[: -len(spec.LIVE_SUFFIX)] + ".npz")
    try:
        os.kill(int(match.group("pid")), 0) if match else None
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return match is not None


def recover_live(live: Path, force: bool = False, keep: bool = False) -> Recovered:
    """Turn one `<stem>.live/` directory into `<stem>.npz` + `<stem>.json` next to it."""
    result = Recovered(live)
    if _unstarted(live):
        # Its pid alive here, or made a moment ago (by a process on another host, or in another pid
        # namespace, whose pid this one cannot see: mapping a large arena takes seconds)
        young = time.time() - live.stat().st_mtime < UNSTARTED_GRACE_S
        if (_pid_alive(live) or young) and not force:
            result.skipped = ("its process may still be making these files (no start event yet); run recover again "
                              f"later (after {UNSTARTED_GRACE_S} s), or use --force if it died")
            return result
        result.skipped = ("nothing to recover: its process died while making these files, before any capture"
                          + ("" if keep else "; removed"))
        _remove(live, keep, fault_report(live), live.parent / f"{live.name[: -len(spec.LIVE_SUFFIX)]}{FAULT_SUFFIX}", [])
        return result
    start, events, torn = read_journal(live)
    if running(start) and not force:
        where = "on this host" if start.get("host") == socket.gethostname() else f"on host {start.get('host')!r}"
        result.skipped = (f"pid {start.get('pid')} {where} may still be running (its files are in use); "
                          "use --force if it is not")
        return result
    slots, overflow, prompt, config, declared, layers, declarations = registry(start, events)
    ctrl = np.fromfile(live / spec.LIVE_CTRL, dtype=np.int32)
    if ctrl.size < L.control_words(0):
        raise RecoverError(f"{live}: control block of {ctrl.size} words")
    # The name the process's last flush wrote under (its rank became known), else the directory's.
    flushed_at, flushed = last_flush(events, live)
    stem = flushed["stem"] if flushed else live.name[: -len(spec.LIVE_SUFFIX)]
    elsewhere = switched_to(events[flushed_at + 1 :], live)
    # The faulthandler report outlives the directory: its stack is what a crash's user reads next.
    kept_report = live.parent / f"{stem}{FAULT_SUFFIX}"
    fault = fault_report(live)
    result.cause = cause_of(fault, events, f"{spec.LIVE_FAULT} in {live.name}" if keep else kept_report.name)
    if torn:
        result.notes.append("the journal's last line was cut by the kill (an event after every stored capture)")
    complete = _complete_dump(live, events, ctrl)
    if complete is not None:  # written again, it would lose what only the flush knew
        result.npz = complete
        result.keys = len(manifest_of(complete).get("keys") or {})
        name = complete.name if complete.parent == live.parent else str(complete)  # (after a switch of directory)
        result.notes.append(f"nothing was captured after the flush that wrote {name}: left as it is")
        _remove(live, keep, fault, kept_report, events)
        return result
    # Cleared after its last flush, nothing kept since: the dump would be empty (its last one was
    # moved away; the exit flush writes none). Without the clear() recover rebuilds that last dump
    # from the journal: one removed by mistake comes back.
    flushed, cleared = _since_last_flush(events, live)
    if flushed is not None and cleared and not L.kept_any(ctrl):
        result.skipped = "nothing was captured since the clear() after its last flush: no dump to write; removed"
        _remove(live, keep, fault, kept_report, events)
        return result
    used = max((s.offset + s.words * s.capacity for s in slots if s.offset >= 0), default=0)
    arena = np.memmap(live / spec.LIVE_ARENA, dtype=np.float32, mode="r") if used else np.zeros(0, np.float32)
    if arena.size < used:
        raise RecoverError(f"{live}: arena file of {arena.size} words, regions up to {used}")
    got = collect(slots, overflow, arena, ctrl, prompt)
    known = _annotations(live.parent / f"{stem}.npz", start)
    if elsewhere is not None:
        # Captured for another directory since that flush (configure(dir=...)): beside its dump,
        # which holds what this directory's captures were, not over it.
        stem = next_free_stem(live.parent, stem) if flushed else stem
        result.notes.append(f"the process switched capture to {elsewhere} after its last flush here: what it "
                            f"captured since (and, unless it called clear(), before) is written as {stem}.npz")
    if declarations.parallel is not None:  # the journal's, newer than any flush's (and there without one)
        groups, shards = declarations.parallel
        known["parallel"] = parallel.manifest_fields(got.keys, lambda message: result.notes.append(message),
                                                     (groups, parallel.journaled_shards(shards)))
    else:  # a journal written before it held them: the last flush's, by tag
        shards = known.get("shards", {})
        for entry in got.keys.values():
            if (entry["tag"], entry["kind"]) in shards:
                entry["shard"] = shards[entry["tag"], entry["kind"]]
    known["filtered_tags"] = {**known.get("filtered_tags", {}), **declarations.filtered}
    routers = captured_routers(declared, got.tags)
    manifest = writer.build_manifest(
        **{k: start.get(k) for k in ("compiledump_version", "torch_version", "rank", "pid", "world_size")},
        # The run's time, not the recovery's: a rerun that flushed beside it is the newer dump.
        **({"created_unix": start["created_unix"]} if isinstance(start.get("created_unix"), (int, float)) else {}),
        device=start.get("device"),
        capture_path=start.get("capture_path"),
        config=config,
        filtered_tags=known.get("filtered_tags", {}),
        arena_words_used=used,
        prompt_tokens=prompt,
        parallel=known.get("parallel", {}),
        first_nonfinite=got.first_nonfinite,
        recovered={"from": live.name, "cause": result.cause, "recovered_unix": time.time(),
                   "torn_journal_line": torn},
        keys=got.keys,
        tags=got.tags,
        drops=got.drops,
        **({"routers": routers} if routers else {}),
        **layers,
    )
    result.npz = writer.write_dump(live.parent, stem, got.arrays, manifest)
    result.keys = len(got.keys)
    result.interrupted = got.drops.get("interrupted", 0)
    del arena  # the memmap, before its file goes
    _remove(live, keep, fault, kept_report, events)
    return result


def _remove(live: Path, keep: bool, fault: str, kept_report: Path, events: list[dict]) -> None:
    """The directory, once its dump is written, and the dead process's name reservations (the dump
    keeps its name taken)."""
    if not keep:
        if fault:
            kept_report.write_text(fault + "\n")
        shutil.rmtree(live, ignore_errors=True)
        stems = {live.name[: -len(spec.LIVE_SUFFIX)]} | {event["stem"] for event in events
                                                        if event.get("event") == "flushed" and "stem" in event}
        for stem in stems:
            (live.parent / f".{stem}{spec.CLAIM_SUFFIX}").unlink(missing_ok=True)


def recover_directory(directory: str | os.PathLike, force: bool = False,
                      keep: bool = False) -> tuple[list[Recovered], list[str]]:
    """Recover every leftover in `directory`: (outcomes, errors of the unreadable ones)."""
    results, errors = [], []
    for live in leftovers(directory):
        try:
            results.append(recover_live(live, force=force, keep=keep))
        except RecoverError as exc:
            errors.append(str(exc))
        except OSError as exc:  # a file gone, a full disk, a read-only directory: the directory stays for another try
            where = f" ({exc.filename})" if exc.filename else ""
            errors.append(f"{live}: {exc.strerror or exc}{where}; its files are left as they are")
    return results, errors
