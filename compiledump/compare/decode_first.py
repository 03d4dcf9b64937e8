"""A decode step named before the prompt: when it diverges at an earlier layer.

The first divergence is the prompt's when the prompt diverges (it ran first), unless a decode step
diverges at an earlier layer than the prompt's first divergent one. A layer's decode state depends
on the prompt only through its own and earlier layers' caches (KV or recurrent state), so the
prompt's divergence at a later layer cannot explain it: the bug sits at or before the decode
step's layer, and its effect on the prompt stayed within the thresholds up to there (bf16
rounding; in one-row mode, a bug at other tokens than the last). A helper's audit: a wrong
attention scale in Gemma 2's layer 1 was named at layer 3's MLP while decode step 1 read 2.7
times the threshold at layer 1. The prompt's keys after its layers (`final_norm`, its logits)
count as after every layer.

That holds only while both sides fed the step the same token. Where both record the tokens fed
(`input_token_<n>`), the steps after a difference are refused before this runs; where they do not
(a hand-instrumented engine, flat-id engines), greedy decoding after an argmax flip at step s feeds
the sides different tokens from step s + 1, and every layer of those steps differs whatever the
prompt's bug was: only steps up to the first argmax flip are read (`fed_alike_through`).
"""

from __future__ import annotations

import math

from .inputs import FED_TAG
from .key_record import KeyRecord
from .cautions import after_the_layers
from .report import ArgmaxFlip, Divergence


def fed_alike_through(records: list[KeyRecord], flip: ArgmaxFlip | None, step_zero_in_prompt: bool) -> float:
    """The last decode step the two sides are known to have fed the same token. Where both
    recorded the tokens fed, the step before the first whose tokens are not seen equal; else
    greedy decoding feeds each side its own argmax after an argmax flip: the first flip's step, or
    none (-1) when the prompt's own logits flipped and step 0 is the first decode forward (fed by
    them; with `instrument`'s steps, step 0 is the prompt's last position and its flip counts);
    else every step."""
    fed = sorted((record.step, record.status == "ok") for record in records
                 if record.tag == FED_TAG and record.kind == "step" and record.step is not None)
    if fed:
        return next((step - 1 for step, ok in fed if not ok), math.inf)
    if not step_zero_in_prompt and any(record.kind != "step" and "logits" in record.tag and record.argmax_equal is False
                                       for record in records):
        return -1
    return math.inf if flip is None else flip.step


def prompt_layer(prefill: Divergence) -> float | None:
    """The layer of the prompt's first divergence; a key after every layer (`final_norm`, the
    prompt's logits) is past all of them; None for one before them or of no layer."""
    if prefill.layer is not None:
        return prefill.layer
    return math.inf if after_the_layers(prefill.key) else None


def decode_before_prompt_layer(floats: list[KeyRecord], prefill: Divergence | None, fed_alike: float
                               ) -> tuple[KeyRecord, KeyRecord | None] | None:
    """The first decode key of one pair's float keys (in key order) at a step up to ``fed_alike``
    that diverges at a layer before the prompt's first divergence ``prefill``, and the last decode
    key judged good before it; None when there is none."""
    layer = prompt_layer(prefill) if prefill is not None else None
    if layer is None:
        return None
    last_good = None
    for record in floats:
        if record.phase != "decode" or record.step is None or record.step > fed_alike:
            continue
        if record.divergent and record.layer is not None and record.layer < layer:
            return record, last_good
        if record.status == "ok":
            last_good = record
    return None


def decode_first_note(prefill: Divergence, decode: Divergence) -> str:
    where = f"layer {prefill.layer}" if prefill.layer is not None else "after the layers"
    return (f"the prompt's keys first diverge at {prefill.key} ({where}), a later layer than decode step "
            f"{decode.step}'s first divergence ({decode.key}, layer {decode.layer}): a layer's decode state depends on "
            f"the fed token and on the prompt only through its own and earlier layers' caches, so the first "
            f"divergence named is the decode step's (the bug's effect on the prompt stayed within the thresholds "
            f"up to there)")


def earlier_decode_layer(first: Divergence | None, pairs_first: list[Divergence | None], order) -> Divergence | None:
    """Across ranks, as within a pair: ``first`` (the earliest in key order) unless it is a prompt's
    and some rank's first divergence is a decode step's float key at an earlier layer (the earliest
    of those by ``order``): a rank's own rule already kept to the steps fed alike."""
    layer = prompt_layer(first) if first is not None and first.phase == "prefill" else None
    if layer is None:
        return first
    earlier = [item for item in pairs_first if item is not None and item.phase == "decode"
               and item.metric not in ("ids", "argmax") and item.layer is not None and item.layer < layer]
    return min(earlier, key=order) if earlier else first
