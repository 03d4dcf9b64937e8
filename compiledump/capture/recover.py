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

import json
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
from .collect import Slot, collect, ctrl_digest

# A recovered dump's faulthandler report, kept beside it: `<stem>.fault.txt`.
FAULT_SUFFIX = ".fault.txt"


class RecoverError(ValueError):
    """A leftover directory that cannot be read (its journal has no start event, say)."""


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


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of process `pid` (Linux clock ticks since boot), or None: with the
    pid it tells a live process from a later one that reused the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


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
        try:
            start, events, _torn = read_journal(live)
        except RecoverError:
            found.append(live)  # unreadable: recover will say why
            continue
        if not running(start) and _complete_dump(live, events) is None:
            found.append(live)
    return found


def _last_flush(events: list[dict], live: Path, anywhere: bool = False) -> tuple[int, dict | None]:
    """(index, event) of the last flush into the directory of `live` (configure(dir=...) may have
    moved the dumps; the journal holds the directory's real path), or into any directory, or
    (-1, None)."""
    here = os.path.realpath(live.parent)
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        if event.get("event") == "flushed" and (anywhere or event.get("dir") in (None, here)):
            return index, event
    return -1, None


def _switched_to(events: list[dict], live: Path) -> str | None:
    """The other directory `events` left capture in (configure(dir=...)): the last one it was
    switched to, switched off or not; None where it came back to the directory of `live` (the exit
    flush would have written there) or never left it."""
    here = os.path.realpath(live.parent)
    last = next((event["dir_real"] for event in reversed(events)
                 if event.get("event") == "dir" and event.get("dir_real") is not None), None)
    return last if last not in (None, here) else None


def _complete_dump(live: Path, events: list[dict], ctrl: np.ndarray | None = None) -> Path | None:
    """The dump the process's last flush wrote (into the directory of `live`, or, after a switch of
    directory, into another), when nothing was captured after it (the control block is the one
    it read, and no clear() came after it: a cleared block can count the same again) and it is
    still there; else None."""
    index, flushed = _last_flush(events, live, anywhere=True)
    if flushed is None or any(event.get("event") == "clear" for event in events[index + 1 :]):
        return None
    npz = Path(flushed.get("dir") or live.parent) / f"{flushed['stem']}.npz"
    if not (npz.is_file() and npz.with_suffix(".json").is_file()):
        return None
    if ctrl is None:
        try:
            ctrl = np.fromfile(live / spec.LIVE_CTRL, dtype=np.int32)
        except OSError:
            return None
    return npz if flushed.get("ctrl") == ctrl_digest(ctrl) else None


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


def read_journal(live: Path) -> tuple[dict, list[dict], bool]:
    """(start event, later events, whether the last line was torn by the kill)."""
    try:
        raw = (live / spec.LIVE_JOURNAL).read_bytes()
    except OSError as exc:
        raise RecoverError(f"{live}: no journal ({exc.strerror or exc})") from None
    lines = raw.split(b"\n")
    torn = bool(lines[-1])  # a complete journal ends with a newline
    events = []
    for line in lines[:-1]:
        try:
            events.append(json.loads(line))
        except ValueError:
            raise RecoverError(f"{live}: journal line {len(events) + 1} is not JSON") from None
    if not events or events[0].get("event") != "start":
        raise RecoverError(f"{live}: the journal has no start event")
    if events[0].get("journal_version", 0) > spec.JOURNAL_VERSION:
        raise RecoverError(f"{live}: journal version {events[0]['journal_version']} is newer than this compiledump "
                           f"reads ({spec.JOURNAL_VERSION}); upgrade compiledump")
    _check_control_layout(live, events[0])
    return events[0], events[1:], torn


def _check_control_layout(live: Path, start: dict) -> None:
    """Refuse a control block laid out otherwise than this compiledump reads it (files a process
    of another version left): its counters would be read as other counters, and the dump written
    from them would be garbage. The files are left as they are, for the version that wrote them."""
    layout = start.get("control_layout")
    if layout is None:  # journals before the field: the block's size still tells most layouts apart
        max_tags = start.get("config", {}).get("max_tags")
        expected = L.control_words(max_tags) if isinstance(max_tags, int) else None
        if expected is None or start.get("ctrl_words") == expected:
            return
        layout = f"of {start.get('ctrl_words')} words for {max_tags} tags"
    elif layout == L.CONTROL_LAYOUT:
        return
    raise RecoverError(f"{live}: written by compiledump {start.get('compiledump_version') or '(unknown version)'}, "
                       f"whose control block layout ({layout}) is not this version's ({L.CONTROL_LAYOUT}); recover it "
                       "with the version that wrote it. Nothing was changed")


def running(start: dict) -> bool:
    """Whether the process that wrote the journal still runs. A journal from another host cannot
    be checked: treated as running (recover needs --force), so a live run's files on a shared
    filesystem are never taken."""
    if start.get("host") != socket.gethostname():
        return True
    pid = start.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user
    started = start.get("start_time")
    return started is None or process_start_time(pid) == started


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
            "report, or power loss")


def recover_live(live: Path, force: bool = False, keep: bool = False) -> Recovered:
    """Turn one `<stem>.live/` directory into `<stem>.npz` + `<stem>.json` next to it."""
    result = Recovered(live)
    start, events, torn = read_journal(live)
    if running(start) and not force:
        where = "on this host" if start.get("host") == socket.gethostname() else f"on host {start.get('host')!r}"
        result.skipped = (f"pid {start.get('pid')} {where} may still be running (its files are in use); "
                          "use --force if it is not")
        return result
    slots, overflow, prompt, config, declared, layers, declarations = _registry(start, events)
    ctrl = np.fromfile(live / spec.LIVE_CTRL, dtype=np.int32)
    if ctrl.size < L.control_words(0):
        raise RecoverError(f"{live}: control block of {ctrl.size} words")
    # The name the process's last flush wrote under (its rank became known), else the directory's.
    flushed_at, flushed = _last_flush(events, live)
    stem = flushed["stem"] if flushed else live.name[: -len(spec.LIVE_SUFFIX)]
    elsewhere = _switched_to(events[flushed_at + 1 :], live)
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


@dataclass
class _Declarations:
    """What the journal says of the manifest's `parallel`, keys' `shard` and `filtered_tags`."""

    parallel: tuple[dict, list] | None = None  # (groups, shards as journaled); None: not journaled
    filtered: dict = field(default_factory=dict)


def _registry(start: dict, events: list[dict]):
    """(slots, overflow tags, prompt length, config, router declarations, the manifest's `mixers`
    and `routing` from instrument, _Declarations) as the journal last had them."""
    declarations = _Declarations()
    by_index: dict[int, Slot] = {}
    slots: list[Slot] = []
    overflow: list[str] = []
    prompt = None
    config = start.get("config", {})
    declared: dict[str, dict] = {}
    layers: dict[str, dict] = {}
    for event in events:
        kind = event.get("event")
        if kind == "slot":
            slot = Slot(tag=event["tag"], kind=event["kind"], index=event["index"], order=event["order"])
            if slot.index == 0:
                overflow.append(slot.tag)
            else:
                by_index[slot.index] = slot
            slots.append(slot)
        elif kind == "region" and event["index"] in by_index:
            slot = by_index[event["index"]]
            slot.payload_shape = tuple(event["payload"])
            slot.offset, slot.capacity = event["offset"], event["capacity"]
            slot.overflow = event.get("overflow", slot.overflow)
            slot.source_dtype, slot.source_shape = event["source_dtype"], event["source_shape"]
        elif kind == "prompt":
            prompt = event["tokens"]
        elif kind == "config":
            config = event["config"]
        elif kind == "router" and event["router"] is None:  # withdrawn
            declared.pop(event["tag"], None)
        elif kind == "router":
            declared[event["tag"]] = event["router"]
        elif kind == "mixers":
            layers = {name: event[name] for name in ("mixers", "routing", "exclude") if event.get(name)}
        elif kind == "parallel":
            declarations.parallel = (event["groups"], event["shards"])
        elif kind == "filtered":
            declarations.filtered[event["tag"]] = event["reason"]
    # A slot whose region was never claimed (offset -1) reports its counters only.
    return slots, overflow, prompt, config, declared, layers, declarations


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
