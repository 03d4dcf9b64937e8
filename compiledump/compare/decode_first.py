"""A decode step named before the prompt: when it diverges at an earlier layer.

The first divergence is the prompt's when the prompt diverges (it ran first), unless a decode step
diverges at an earlier layer than the prompt's first divergent one. A layer's decode state depends
on the prompt only through its own and earlier layers' caches (KV or recurrent state), so the
prompt's divergence at a later layer cannot explain it: the bug sits at or before the decode
step's layer, and its effect on the prompt stayed within the thresholds up to there (bf16
rounding; in one-row mode, a bug at other tokens than the last). A helper's audit: a wrong
attention scale in Gemma 2's layer 1 was named at layer 3's MLP while decode step 1 read 2.7
times the threshold at layer 1.
"""

from __future__ import annotations

from .key_record import KeyRecord
from .report import Divergence


def decode_before_prompt_layer(floats: list[KeyRecord], prefill: Divergence | None
                               ) -> tuple[KeyRecord, KeyRecord | None] | None:
    """The first decode key of one pair's float keys (in key order) that diverges at a layer
    before the prompt's first divergence ``prefill``, and the last decode key judged good before
    it; None when there is none."""
    if prefill is None or prefill.layer is None:
        return None
    last_good = None
    for record in floats:
        if record.phase != "decode":
            continue
        if record.divergent and record.layer is not None and record.layer < prefill.layer:
            return record, last_good
        if record.status == "ok":
            last_good = record
    return None


def decode_first_note(prefill: Divergence, decode: Divergence) -> str:
    return (f"the prompt's keys first diverge at {prefill.key} (layer {prefill.layer}), after the layer decode step "
            f"{decode.step} diverges at ({decode.key}, layer {decode.layer}): a layer's decode state depends on the "
            f"prompt only through its own and earlier layers' caches, so the first divergence named is the decode "
            f"step's (the bug's effect on the prompt stayed within the thresholds before layer {prefill.layer})")


def earlier_decode_layer(first: Divergence | None, pairs_first: list[Divergence | None], order) -> Divergence | None:
    """Across ranks, as within a pair: ``first`` (the earliest in key order) unless it is a prompt's
    and some rank's first divergence is a decode step's at an earlier layer (the earliest of those
    by ``order``)."""
    if first is None or first.phase != "prefill" or first.layer is None:
        return first
    earlier = [item for item in pairs_first if item is not None and item.phase == "decode"
               and item.layer is not None and item.layer < first.layer]
    return min(earlier, key=order) if earlier else first
