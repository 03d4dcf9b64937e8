"""Reading a crash-proof journal (`<stem>.live/journal.jsonl`, written by capture/persist.py):
its start event, the tag registry and declarations it replays, the flushes and directory switches
it records, and whether the process that wrote it still runs. capture/recover.py turns what it
reads into dumps. Needs numpy only (no torch).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ..format import spec
from ..ops import layout as L
from .collect import Slot


class RecoverError(ValueError):
    """A leftover directory that cannot be read (its journal has no start event, say)."""


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of process `pid` (Linux clock ticks since boot), or None: with the
    pid it tells a live process from a later one that reused the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


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


def last_flush(events: list[dict], live: Path, anywhere: bool = False) -> tuple[int, dict | None]:
    """(index, event) of the last flush into the directory of `live` (configure(dir=...) may have
    moved the dumps; the journal holds the directory's real path), or into any directory, or
    (-1, None)."""
    here = os.path.realpath(live.parent)
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        if event.get("event") == "flushed" and (anywhere or event.get("dir") in (None, here)):
            return index, event
    return -1, None


def switched_to(events: list[dict], live: Path) -> str | None:
    """The other directory `events` left capture in (configure(dir=...)): the last one it was
    switched to, switched off or not; None where it came back to the directory of `live` (the exit
    flush would have written there) or never left it."""
    here = os.path.realpath(live.parent)
    last = next((event["dir_real"] for event in reversed(events)
                 if event.get("event") == "dir" and event.get("dir_real") is not None), None)
    return last if last not in (None, here) else None


@dataclass
class Declarations:
    """What the journal says of the manifest's `parallel`, keys' `shard` and `filtered_tags`."""

    parallel: tuple[dict, list] | None = None  # (groups, shards as journaled); None: not journaled
    filtered: dict = field(default_factory=dict)


def registry(start: dict, events: list[dict]):
    """(slots, overflow tags, prompt length, config, router declarations, the manifest's `mixers`
    and `routing` from instrument, Declarations) as the journal last had them."""
    declarations = Declarations()
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
