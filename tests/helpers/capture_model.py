"""The capture calls' semantics restated in plain Python and numpy: what a dump must contain after
a sequence of calls (docs/api.md, docs/format.md). The reference of tests/ops/test_fuzz.py; it
imports nothing from compiledump, so a shared mistake cannot hide in both.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

ARENA_ALIGN = 4  # arena regions start on 16-byte (4-word) boundaries
TAG_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


@dataclasses.dataclass
class MSlot:
    tag: str
    call: str  # record | record_once | step | ids
    order: int
    overflow: bool  # beyond max_tags: every call counts as tag_table_full, nothing is kept
    shape: tuple | None = None  # payload shape, fixed by the first call that passes the host gates
    source: tuple | None = None  # (dtype name, shape) of that call
    fits: bool = False
    capacity: int = 1
    counts: dict = dataclasses.field(default_factory=dict)
    written: int = 0
    kept_tokens: int | None = None  # shape[0] of the last kept [tokens, ...] record
    data: list = dataclasses.field(default_factory=list)  # kept payloads, in step order


class Model:
    """What the dump must contain after a sequence of calls (docs/api.md, docs/format.md)."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.profiling = 0
        self.rows = 0
        self.record_row, self.step_row = -1, 0
        self.slots: dict[tuple[str, bool], MSlot] = {}
        self.filtered: dict[str, str] = {}
        self.used = 0
        self.table = 0  # slots handed out (max_tags of them)
        # The token gate's prompt length: fixed by a number (read when the arena is created, or
        # set later), else the first gated capture's token count outside profiling() (learned
        # with the gate off too, for the phase labels).
        self.prompt = None
        self.arena = False  # created by the first capture that gets a slot
        self.overflow_calls = {}  # drop reason -> count for tags past the table

    # -- host-side rules -----------------------------------------------------------------------

    def _moe_keeps(self, tag: str) -> bool:
        if "_" not in tag or not tag.startswith("layer"):
            return True
        digits = tag.split("_", 1)[0][5:]
        try:
            return int(digits) < self.cfg["moe_layers"]
        except ValueError:
            return True

    @staticmethod
    def _step_prefix(tag: str) -> str | None:
        match = re.fullmatch(r"(.+)_(0|[1-9][0-9]*)", tag)  # step keys have no leading zeros
        return match.group(1) if match else None

    def _slot(self, tag: str, call: str) -> MSlot:
        is_step = call == "step"
        slot = self.slots.get((tag, is_step))
        if slot is not None:
            if slot.call != call:
                raise ValueError("first captured with")
            return slot
        if is_step and any(not s and self._step_prefix(t) == tag for t, s in self.slots):
            raise ValueError("collides with the step keys")
        if not is_step and (self._step_prefix(tag), True) in self.slots:
            raise ValueError("collides with the step keys")
        if not self.arena:
            self.arena = True
            self.prompt = self.cfg["tokens"] if self.cfg["tokens"] not in (0, "auto") else None
        overflow = self.table >= self.cfg["max_tags"]
        if not overflow:
            self.table += 1
        slot = MSlot(tag, call, len(self.slots), overflow)
        self.slots[(tag, is_step)] = slot
        return slot

    def _token_gated(self, shape: tuple, call: str) -> bool:
        tokens = shape[0]
        # A 3-D record that does not look like [tokens, hc_mult, dim] (middle dim > 16, or one
        # token with several middle rows) teaches no prompt length (docs/api.md, layouts).
        doubtful = call == "record" and len(shape) == 3 and (shape[1] > 16 or shape[0] == 1 < shape[1])
        if self.prompt is None and not self.profiling and not doubtful:
            self.prompt = tokens
        return self.cfg["tokens"] != 0 and self.prompt is not None and tokens != self.prompt

    @staticmethod
    def _payload_shape(shape: tuple, call: str) -> tuple:
        if call == "ids":
            return shape
        if call == "step":
            return shape[1:] if len(shape) >= 2 else shape
        if len(shape) in (2, 3):
            return shape[-1:]
        return (math.prod(shape),)

    # -- a capture call ------------------------------------------------------------------------

    def capture(self, call: str, tag: str, x: np.ndarray, dtype: str) -> None:
        """`x` holds the tensor's values exactly (float64 for floats, int64 for integers)."""
        if call == "ids" and dtype.startswith(("float", "bfloat")):
            raise TypeError("integer tensor")
        if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
            raise ValueError("invalid tag")
        if call != "step" and not self._moe_keeps(tag):
            self.filtered[tag] = "moe_layers"
            return
        slot = self._slot(tag, call)
        # Host gates (fixed by the shape), in order; the first call that passes them outside
        # profiling() fixes the tag's payload shape and arena region, even if the device then
        # gates it (a suspended call does not: an engine's profile run has dummy shapes).
        reason = None
        if slot.overflow:
            reason = "tag_table_full"
        elif call in ("record", "ids") and x.ndim > 0 and self._token_gated(x.shape, call):
            reason = "token_gate"
        else:
            payload = self._payload_shape(x.shape, call)
            if slot.shape is None and not self.profiling:
                slot.shape, slot.source = payload, (dtype, list(x.shape))
                slot.capacity = self.cfg["max_steps"] if call == "step" else 1
                words = math.prod(payload) * slot.capacity
                start = -(-self.used // ARENA_ALIGN) * ARENA_ALIGN
                if start + words <= self.cfg["arena_mb"] * (1 << 20) // 4:
                    slot.fits, self.used = True, start + words
            if slot.shape is None:
                pass  # suspended below, before any region exists
            elif payload != slot.shape:
                reason = "shape_changed"
            elif not slot.fits:
                reason = "arena_full"
        # Device gates, in order of precedence.
        row = 0
        if call in ("record", "record_once") and x.ndim in (2, 3):
            row, rows = self.record_row, x.shape[0]
        elif call == "step" and x.ndim >= 2:
            row, rows = self.step_row, x.shape[0]
        else:
            rows = 1
        row = row + rows if row < 0 else row
        if self.profiling:
            reason = "suspended"
        elif reason is None and call == "step" and self.rows > self.cfg["max_rows"]:
            reason = "rows_gate"
        elif reason is None and not 0 <= row < rows:
            reason = "row_out_of_range"
        if reason is not None:
            if slot.overflow:
                self.overflow_calls[reason] = self.overflow_calls.get(reason, 0) + 1
            else:
                slot.counts[reason] = slot.counts.get(reason, 0) + 1
            return
        slot.written += 1
        if call == "record":  # a tensor stored whole has no token count
            slot.kept_tokens = x.shape[0] if x.ndim in (2, 3) else None
        value = self._value(call, x, row)
        if call == "step":
            if slot.written <= slot.capacity:
                slot.data.append(value)
        elif call == "record_once":
            if slot.written == 1:
                slot.data = [value]
        else:
            slot.data = [value]

    @staticmethod
    def _value(call: str, x: np.ndarray, row: int) -> np.ndarray:
        if call == "ids":
            return x.astype(np.int64).astype(np.int32)  # int32, wrapping like a C cast
        f32 = x.astype(np.float32)
        if call == "step":
            return f32[row] if x.ndim >= 2 else f32
        if x.ndim == 3:  # mean over hc: fp32 sum over h in order, then one division
            acc = np.zeros(x.shape[2], np.float32)
            for h in range(x.shape[1]):
                acc = acc + f32[row, h]
            return acc / np.float32(x.shape[1])
        if x.ndim == 2:
            return f32[row]
        return f32.reshape(-1)

    # -- the dump ------------------------------------------------------------------------------

    def dump(self) -> tuple[dict, dict]:
        """(arrays, manifest parts) that a flush now must write."""
        arrays, keys, tags, totals = {}, {}, {}, {}
        for slot in self.slots.values():
            if slot.overflow:  # named as a kept tag of its kind is
                tags[f"{slot.tag}_<n>" if slot.call == "step" else slot.tag] = {
                    "calls": None, "kept": 0, "drops": {"tag_table_full": None}}
                continue
            drops = dict(slot.counts)
            kept = min(slot.written, slot.capacity) if slot.fits else 0
            if slot.call == "step" and slot.fits and slot.written > slot.capacity:
                drops["step_capacity"] = slot.written - slot.capacity
            for n in range(kept):
                key = f"{slot.tag}_{n}" if slot.call == "step" else slot.tag
                arrays[key] = np.asarray(slot.data[n]).reshape(slot.shape)
                tokens = slot.shape[0] if slot.call == "ids" and slot.shape else (
                    slot.kept_tokens if slot.call == "record" else None)
                phase = None if tokens is None or self.prompt is None else (
                    "prefill" if tokens == self.prompt else "decode")
                keys[key] = {"tag": slot.tag, "kind": slot.call, "step": n if slot.call == "step" else None,
                             "order": slot.order, "source_dtype": slot.source[0], "source_shape": slot.source[1],
                             "dtype": "int32" if slot.call == "ids" else "float32", "shape": list(slot.shape),
                             "tokens": tokens, "phase": phase}
            name = f"{slot.tag}_<n>" if slot.call == "step" else slot.tag
            tags[name] = {"calls": slot.written + sum(slot.counts.values()), "kept": kept, "drops": drops}
            for reason, count in drops.items():
                totals[reason] = totals.get(reason, 0) + count
        for reason, count in self.overflow_calls.items():
            totals[reason] = totals.get(reason, 0) + count
        return arrays, {"keys": keys, "tags": tags, "drops": totals, "filtered_tags": dict(self.filtered),
                        "prompt_tokens": self.prompt}
