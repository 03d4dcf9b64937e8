"""The plan: the tag registry of an exported program, written into its package as metadata.

A flush needs the registry to name the arena's regions (tags, kinds, regions, shapes); a process
that loads a package has none, so `aot.package` stores it as text (docs/export.md, "Plan";
kernels/dump.cpp parses the same text) and `aot.load` restores it.
"""

from __future__ import annotations

import json

from .. import config as _config
from ..capture.arena import Runtime, Slot
from ..capture import persist
from ..capture.state import STATE, warn_once
from ..ops import layout as L
from ..version import __version__

PLAN_KEY = "compiledump.plan"  # package metadata: the tag registry, one line per slot
CONFIG_KEY = "compiledump.config"  # package metadata: the settings (JSON, without "dir")
PLAN_HEADER = "compiledump-plan 1"


def plan_metadata(rt: Runtime | None = None) -> dict[str, str]:
    """The package metadata that describes the arena: {PLAN_KEY: plan text, CONFIG_KEY: json}."""
    rt = rt or STATE.runtime
    if rt is None:
        raise RuntimeError("compiledump.aot: nothing was exported yet (no arena)")
    settings = _config.settings(rt.config)
    settings.pop("dir")
    return {PLAN_KEY: plan_text(rt), CONFIG_KEY: json.dumps(settings, separators=(",", ":"))}


def plan_text(rt: Runtime) -> str:
    """The registry as lines of space-separated fields (docs/export.md; parsed by kernels/dump.cpp).

    `slot <index> <kind> <order> <offset> <capacity> <source_dtype> <ndim> <dims...> <source_ndim>
    <source dims, -1 = dynamic...> <tag>` (an ndim of -1: unknown, no dims follow), then
    `past_capacity <index> <reason>` for a step tag whose steps past its capacity are not
    `step_capacity` drops (a layer's step state bounded by COMPILEDUMP_LAYER_STEPS: `layer_steps`,
    deliberate), `filtered <tag> <reason>` and `overflow <tag> <kind>`.
    """
    lines = [
        PLAN_HEADER,
        f"version {__version__}",
        f"arena_words {rt.arena.numel()}",
        f"ctrl_words {rt.ctrl.numel()}",
        f"used_words {rt.used_words}",
        f"max_rows {rt.config.max_rows}",
        f"prompt_tokens {rt.config.fixed_tokens}",
        f"device_type {rt.device.type}",
    ]
    for slot in sorted(rt.slots.values(), key=lambda s: s.order):
        if slot.index == 0:
            continue
        shape = list(slot.payload_shape) if slot.payload_shape is not None else None
        source = [-1 if d is None else d for d in slot.source_shape] if slot.source_shape is not None else None
        fields = [slot.index, slot.kind, slot.order, slot.offset if shape is not None else -1, slot.capacity,
                  slot.source_dtype or "-", -1 if shape is None else len(shape), *(shape or []),
                  -1 if source is None else len(source), *(source or []), slot.tag]
        lines.append("slot " + " ".join(str(f) for f in fields))
    # A line of its own, not a slot field: readers of older plans ignore it (and slot lines end
    # with the tag).
    lines += [f"past_capacity {slot.index} {slot.overflow}" for slot in sorted(rt.slots.values(), key=lambda s: s.order)
              if slot.index != 0 and slot.overflow != "step_capacity"]
    lines += [f"filtered {tag} {reason}" for tag, reason in STATE.filtered_tags.items()]
    # One line per tag past the table and its kind (a record and a step tag of one name are two);
    # a tag restored from an older plan, which gave no kind, as that plan had it.
    past = sorted((slot for slot in rt.slots.values() if slot.index == 0), key=lambda slot: slot.order)
    lines += [f"overflow {slot.tag} {slot.kind}" for slot in past]
    lines += [f"overflow {tag}" for tag in rt.overflow_tags if not any(slot.tag == tag for slot in past)]
    return "\n".join(lines) + "\n"


def restore_plan(text: str, rt: Runtime) -> None:
    """Recreate the registry a package was exported with (a fresh process), or check that the
    one in place agrees with it (the exporting process)."""
    lines = text.splitlines()
    if not lines or lines[0] != PLAN_HEADER:
        raise ValueError(f"compiledump.aot: not a compiledump plan (first line {lines[:1]!r})")
    header = plan_header(text)
    if int(header["arena_words"]) != rt.arena.numel() or int(header["ctrl_words"]) != rt.ctrl.numel():
        raise RuntimeError("compiledump.aot: the package was exported for another arena size; "
                           "load it before any other capture")
    past_capacity, restored = [], []
    for line in lines[1:]:
        kind_of_line, _, rest = line.partition(" ")
        if kind_of_line == "past_capacity":
            past_capacity.append(rest.split(" "))
        elif kind_of_line == "filtered":
            tag, reason = rest.split(" ")
            STATE.filtered_tags[tag] = reason
        elif kind_of_line == "overflow":
            tag, *kind = rest.split(" ")
            if kind:  # the registry past a full table, as the exporting process had it
                rt.slot_for(tag, int(kind[0]))
            elif tag not in rt.overflow_tags:  # a plan written before plans gave the kind
                rt.overflow_tags.append(tag)
        elif kind_of_line == "slot":
            restored += [slot for slot in (_restore_slot(rt, rest.split(" ")),) if slot is not None]
    for index, reason in past_capacity:  # after every slot line, whatever the order
        rt.by_index[int(index)].overflow = reason
    rt.used_words = max(rt.used_words, int(header["used_words"]))
    if rt.live is not None:
        _journal_restored(rt.live, restored)


def _journal_restored(live, slots: list[Slot]) -> None:
    """Journal the registry the plan restored, as captures journal theirs (the regions reserved on
    disk first): a process that loaded a package and then died is recovered with its captures."""
    for slot in slots:
        live.write(persist.slot_event(slot))
        if slot.payload_shape is not None and slot.offset >= 0 and slot.words:
            try:
                live.touch(slot.offset, slot.words * slot.capacity)
            except OSError as error:
                warn_once(f"no disk space for tag {slot.tag!r}'s region in {live.path} ({error.strerror}): after a "
                          "crash, `compiledump recover` may find it torn")
            live.write(persist.region_event(slot, slot.payload_shape))
    live.note_filtered(STATE.filtered_tags)


def plan_header(text: str) -> dict[str, str]:
    """The plan's `name value` header lines (arena_words, device_type, ...) as a dict."""
    return dict(line.split(" ", 1) for line in text.splitlines()[1:]
                if line and not line.startswith(("slot ", "past_capacity ", "filtered ", "overflow ")))


def _restore_slot(rt: Runtime, f: list[str]) -> Slot | None:
    """The slot of one plan line, new to the registry (None: the registry had it)."""
    index, kind, order, offset, capacity = (int(v) for v in f[:5])
    source_dtype = None if f[5] == "-" else f[5]
    ndim = int(f[6])
    shape = tuple(int(v) for v in f[7 : 7 + max(ndim, 0)]) if ndim >= 0 else None
    at = 7 + max(ndim, 0)
    source = None if int(f[at]) < 0 else [None if int(v) < 0 else int(v) for v in f[at + 1 : at + 1 + int(f[at])]]
    tag = f[-1]
    existing = rt.slots.get((tag, kind == L.KIND_STEP))
    if existing is not None:
        if (existing.index, existing.offset, existing.payload_shape) != (index, offset, shape):
            raise RuntimeError(f"compiledump.aot: tag {tag!r} already has another arena region in this process")
        return None
    slot = Slot(tag=tag, kind=kind, index=index, order=order, payload_shape=shape, offset=offset,
                       capacity=capacity, source_dtype=source_dtype, source_shape=source)
    rt.slots[(tag, kind == L.KIND_STEP)] = slot
    rt.by_index.setdefault(index, slot)
    rt.next_slot = max(rt.next_slot, index + 1)
    return slot
