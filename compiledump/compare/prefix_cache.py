"""A prompt that may have been partly served from a prefix cache: a note, not a comparison.

vLLM (automatic prefix caching, on by default) and SGLang (the radix cache) keep the KV cache of
the prompts they ran; a request whose prompt begins with one that ran before (a warm-up of the
same prompt inside `profiling()`, or an earlier request) runs only the rest: its prefill forward
holds the prompt's last n positions and its token gate learns n, so its prompt keys hold a
shorter call than the other side's whole prompt and are not comparable (different token counts),
with "fix: compare runs of the same prompt", which the user may have done.

What a dump holds cannot tell that apart from another prompt that ends on the same token (chat
templates end most prompts alike): both sides' prefill ends on the token each fed at step 0, and
nothing records where a call's positions start. Comparing the other side's last n positions on
that guess would turn a different prompt into a divergence at layer 0, so the comparator only
says what the pair is consistent with and how to make it comparable: one note, where the prompt
calls differ in length and end on the same token at step 0, and the pair is not a chunked
prefill (verdict.py asks overwrites.py first: a first chunk can end on the prompt's last token too).
"""

from __future__ import annotations

from ..format import spec
from ..format.reader import Dump
from .inputs import FED_TAG, fed_token
from .phases import shorter_prompt, tokens_text

TURN_OFF = "vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache"


def prefix_cache_note(ref: Dump, run: Dump) -> str | None:
    """The note for a pair whose prompt calls differ in length but line up at step 0 (module
    docstring), prefixed with the shorter side's label; else None."""
    prompts = shorter_prompt(ref, run)
    if prompts is None:
        return None
    shorter, whole, tail = prompts
    key = spec.step_key(FED_TAG, 0)
    ref0, run0 = fed_token(ref, key), fed_token(run, key)
    if ref0 is None or ref0 != run0:
        return None
    other = "REF" if shorter == "RUN" else "RUN"
    return (f"{shorter}: its prompt keys hold a call of {tokens_text(tail)} that ends on the token {other}'s prompt "
            f"of {whole} ends on (both fed token {ref0} at step 0): either another prompt, or the same one with its "
            f"first {whole - tail} positions served from a prefix cache (vLLM's automatic prefix caching or SGLang's "
            f"radix cache, after a warm-up or an earlier request with the same prompt); to compare its prompt keys, "
            f"run {shorter} with the cache off ({TURN_OFF})")


__all__ = ["prefix_cache_note"]
