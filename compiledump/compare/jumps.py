"""Where an fp32 divergence likely starts when its first crossing is later: the jump.

fp32 rounding grows gradually through a model (rel_diff 1e-14 to 1e-12 in the calibration, or
exactly 0 where both sides ran the same kernels), while a bug moves the first key it reaches by
orders of magnitude at once. The fp32 threshold (rel_diff 1e-8, about 0.014 % relative L2) sits
far above the noise, so a 1 % bug diluted into the residual stream (a query projection's, seen in
the stream after attention at 2e-5 to 9e-5 relative L2) passes there and the verdict names the next
key that is not diluted (the router, the MLP, or a later layer's) with the stream as its last good.
A stream key before the first divergence whose rel_diff is ``JUMP`` times every stream key's
before it in its phase and within ``JUMP`` of its threshold, after which every stream key up to the
first divergence stays above that, is where the values jump: the verdict says so (a new
user's bug-injection audit of 44 transformers models: attention bugs named at `layer1_router`,
`layer1_mlp` or `layer2_mlp` with `last good: layer1_attn`)."""

from __future__ import annotations

import math
import re

from ..format import spec
from .key_record import KeyRecord
from .report import Divergence

JUMP = 100.0  # in rel_diff: 10 times in relative L2
# The residual stream's keys, along which rounding grows gradually (a layer's state, the stream
# after its attention, at a prompt or a step): a router's 8 logits that nearly cancel can read
# 1000 times the keys before them honestly, so no other key can be where the values jump.
_STREAM = re.compile(rf"^(?:layer\d+(?:_attn)?(?:_step)?|{spec.INPUT_EMBEDS_TAG}|{spec.ENCODER_OUTPUT_TAG})$")


def _size(record: KeyRecord) -> float | None:
    """A judged float key's rel_diff (an all-rows key's largest row's); None for the others."""
    if record.floats is None or record.status not in ("ok", "divergent") or record.excused_rows:
        return None
    return record.rows.max_rel_diff if record.rows is not None else record.floats.rel_diff


def earlier_jump(records: list[KeyRecord], first: Divergence, klass: str | None) -> list[tuple[str, str]]:
    """(note, caution) when the fp32 first divergence ``first`` comes after the key where its
    phase's values jump; else nothing."""
    if klass != "fp32" or first.metric not in ("rel_diff", "norm_diff"):
        return []
    stream = [(record, size) for record in records[:first.position]
              if record.phase == first.phase and record.step == first.step and _STREAM.match(record.tag)
              and (size := _size(record)) is not None] + [(records[first.position], math.inf)]
    jump, before = None, 0.0
    for index, (record, size) in enumerate(stream[1:-1], start=1):  # (a jump needs keys before it)
        baseline = max(value for _, value in stream[:index])
        # Within JUMP of its threshold, so that the onset of rounding noise after keys both sides
        # computed alike (0 to 1e-13) is none: between there and the threshold only one jump fits.
        if size >= record.limits.rel_diff / JUMP and size >= JUMP * baseline \
                and all(value > JUMP * baseline for _, value in stream[index:]):
            jump, before = (record, size), baseline
            break
    if jump is None:
        return []
    record, size = jump
    how = (f"is {size / before:.0f} times the largest before it" if before > 0
           else "comes after keys equal on both sides")
    return [(f"{record.key} is within its thresholds, but its rel_diff {size:.2e} {how} along the residual "
             f"stream in this phase, and every stream key after it up to {first.key} stays above that: fp32 "
             f"rounding grows gradually, so the divergence "
             f"likely starts at or before {record.key} (a change there diluted below the threshold), not at "
             f"{first.key}", f"the values jump at {record.key}, before it (see the note)")]
