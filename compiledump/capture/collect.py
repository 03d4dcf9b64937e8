"""A snapshot of the arena and the control block, sliced into a dump's arrays and manifest entries.

Shared by `flush()` (a live process's registry and a fresh snapshot) and `compiledump recover`
(a registry rebuilt from the journal and the files a dead process left): both must read the
counters the same way. Pure: host arrays in, dicts out.

What a slot's words say (ops/layout.py):
- the counters: one per call (kept, or the drop reason);
- SLOT_COMMITTED: writes that finished. A write is claimed (its counter bumped) before the payload
  is stored and committed after it, so a process that died mid-write leaves one claimed write
  without its commit: that value is torn and never read (counted as the drop `interrupted`);
- SLOT_NONFINITE and the first such call (SLOT_BAD_STEP, SLOT_BAD_TOKENS).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from ..format import spec
from ..ops import layout as L


@dataclass
class Slot:
    """One tag's place in the control block and the arena: the registry's record of it
    (capture/arena.py keeps them; capture/journal.py rebuilds them from the journal)."""

    tag: str
    kind: int
    index: int  # slot number; its counters start at layout.slot_base(index)
    order: int  # first-capture order, i.e. the order the forward ran the capture points
    payload_shape: tuple | None = None  # shape of one stored capture (None until first kept)
    offset: int = -1  # arena word offset of the region; -1 = no region
    capacity: int = 1  # captures the region holds (steps for KIND_STEP)
    overflow: str = "step_capacity"  # the drop reason of steps past capacity (spec.DROP_REASONS)
    source_dtype: str | None = None
    source_shape: tuple | None = None

    @property
    def words(self) -> int:
        return math.prod(self.payload_shape) if self.payload_shape is not None else 0


@dataclass
class Collected:
    """What `collect` makes of a snapshot: the manifest's `keys`, `tags`, `drops` and
    `first_nonfinite`, and the arrays (views of the snapshot: valid while it is)."""

    arrays: dict
    keys: dict
    tags: dict
    drops: dict
    first_nonfinite: dict | None


def collect(slots, overflow_tags, arena: np.ndarray, ctrl: np.ndarray, prompt_tokens: int | None) -> Collected:
    """Slice `arena`/`ctrl` by the registry `slots` (capture/arena.py `Slot`s, any order)."""
    arrays: dict[str, np.ndarray] = {}
    keys: dict[str, dict] = {}
    tags: dict[str, dict] = {}
    totals: dict[str, int] = {}
    bad: list[tuple] = []
    for slot in sorted(slots, key=lambda s: s.order):
        if slot.index == 0:
            continue  # shared overflow slot: reported once below
        base = L.slot_base(slot.index)
        words = ctrl[base : base + L.SLOT_WORDS].astype(np.int64)
        counts = words[: L.SLOT_COUNTERS]
        written = int(counts[L.CNT_WRITTEN])
        drops = {name: int(counts[c]) for c, name in L.DROP_REASONS.items() if counts[c]}
        kept = 0
        if slot.offset >= 0 and written:
            kept, step_capacity, interrupted = _kept(slot, written, int(words[L.SLOT_COMMITTED]))
            if step_capacity:
                drops[slot.overflow] = step_capacity
            if interrupted:
                drops["interrupted"] = interrupted
        if kept:
            # Views of the snapshot (valid while this flush holds the flush lock): no per-key copies.
            region = arena[slot.offset : slot.offset + slot.words * kept]
            if slot.kind == L.KIND_IDS:
                region = region.view(np.int32)
            tokens = _kept_tokens(slot, int(words[L.SLOT_KEPT_TOKENS]))
            meta = {
                "tag": slot.tag,
                "kind": L.KIND_NAMES[slot.kind],
                "step": None,
                "order": slot.order,
                "source_dtype": slot.source_dtype,
                "source_shape": slot.source_shape,
                "dtype": str(region.dtype),
                "shape": list(slot.payload_shape),
                "tokens": tokens,
                "phase": phase_of(tokens, prompt_tokens),
            }
            if slot.kind == L.KIND_RECORD_ROWS:
                meta["rows"] = "all"
            steps = region.reshape(kept, *slot.payload_shape)
            for n in range(kept):
                is_step = slot.kind == L.KIND_STEP
                key = spec.step_key(slot.tag, n) if is_step else slot.tag
                keys[key] = {**meta, "step": n} if is_step else meta
                arrays[key] = steps[n]
        name = spec.tag_entry_name(slot.tag, slot.kind == L.KIND_STEP)
        tags[name] = {
            "tag": slot.tag,
            "kind": L.KIND_NAMES[slot.kind],
            "order": slot.order,
            "calls": int(counts.sum()),
            "passed": written,
            "kept": kept,
            "drops": drops,
        }
        nonfinite = _nonfinite(slot, words, prompt_tokens)
        if nonfinite is not None:
            tags[name]["nonfinite"] = nonfinite
            # Calls in time order: the prefill first, then by step, then in forward order.
            when = -1 if nonfinite["phase"] == "prefill" else nonfinite["step"]
            if not spec.masked_scores(slot.tag):
                bad.append((when, slot.order, nonfinite))
        for reason, count in drops.items():
            totals[reason] = totals.get(reason, 0) + count
    overflow = sorted((slot for slot in slots if slot.index == 0), key=lambda s: s.order)
    if overflow or overflow_tags:
        # Tags past the table share slot 0: their calls are counted there, tag_table_full or,
        # inside profiling(), suspended; only the totals can report them.
        shared = ctrl[L.slot_base(0) : L.slot_base(0) + L.SLOT_COUNTERS].astype(np.int64)
        for counter, reason in L.DROP_REASONS.items():
            if shared[counter]:
                totals[reason] = totals.get(reason, 0) + int(shared[counter])
        lost = {"order": None, "calls": None, "passed": 0, "kept": 0, "drops": {"tag_table_full": None}}
        for slot in overflow:  # named as a kept tag of its kind is: a record and a step tag of one name differ
            tags[spec.tag_entry_name(slot.tag, slot.kind == L.KIND_STEP)] = {
                "tag": slot.tag, "kind": L.KIND_NAMES[slot.kind], **lost}
        for tag in overflow_tags:  # of an AOT plan written before plans gave their kind
            if not any(slot.tag == tag for slot in overflow) and tag not in tags:
                tags[tag] = {"tag": tag, "kind": None, **lost}
    first = min(bad, key=lambda item: item[:2])[2] if bad else None
    return Collected(arrays, keys, tags, totals, first)


def ctrl_digest(ctrl: np.ndarray) -> str:
    """A digest of a control block's slot words (every capture's counters and commits; not the
    registers set_rows, set_gather_rows and profiling() write between steps): a flush journals
    the one it read, so that recover can tell that nothing was captured after it."""
    return hashlib.sha1(np.ascontiguousarray(ctrl[L.HEADER_WORDS :], dtype=np.int32).tobytes()).hexdigest()


def _kept(slot, written: int, committed: int) -> tuple[int, int, int]:
    """(captures kept, step_capacity drops, interrupted writes) of a slot with a region.

    Steps keep their first `committed` captures (commits only come for steps inside the region);
    a record, record_once or ids region holds one value, whole only if every write it was given
    was committed: else the process died while overwriting it and the value is dropped.
    """
    if slot.kind == L.KIND_STEP:
        claimed = min(written, slot.capacity)
        return min(committed, claimed), written - claimed, claimed - min(committed, claimed)
    claimed = 1 if slot.kind == L.KIND_RECORD_ONCE else written
    if committed >= claimed:
        return 1, 0, 0
    return 0, 0, 1


def _kept_tokens(slot, kept_word: int) -> int | None:
    """The manifest's "tokens" of a token-gated key: `shape[0]` of the call whose value was kept
    (the kernel's SLOT_KEPT_TOKENS for `[tokens, ...]` records; the stored shape for ids)."""
    if slot.kind == L.KIND_IDS:
        return slot.payload_shape[0] if slot.payload_shape else None
    if slot.kind in (L.KIND_RECORD, L.KIND_RECORD_ROWS) and kept_word > 0:  # 0: none kept, or stored whole
        return kept_word
    return None


def phase_of(tokens: int | None, prompt_tokens: int | None) -> str | None:
    """The manifest's "phase": prefill when the call had the prompt's token count, else decode;
    None when either is unknown."""
    if tokens is None or prompt_tokens is None:
        return None
    return "prefill" if tokens == prompt_tokens else "decode"


def _nonfinite(slot, words: np.ndarray, prompt_tokens: int | None) -> dict | None:
    """A tag's `nonfinite` manifest entry, or None when its kernels saw no NaN/Inf."""
    count = int(words[L.SLOT_NONFINITE])
    first = int(words[L.SLOT_BAD_STEP])
    if not count or not first:
        return None
    step = first - 1
    tokens = int(words[L.SLOT_BAD_TOKENS]) or None
    if slot.kind == L.KIND_STEP:
        phase, key = "decode", spec.step_key(slot.tag, step)
    else:
        phase, key = phase_of(tokens, prompt_tokens), slot.tag
    return {"key": key, "tag": slot.tag, "phase": phase, "step": step, "tokens": tokens,
            "count": count, "saturated": count >= L.NONFINITE_CAP}
