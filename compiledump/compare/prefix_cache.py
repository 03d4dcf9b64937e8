"""Prompt calls of different lengths on the two sides of a pair that may have run the same
prompt: a prefix cache's tail, or a prefill padded to a CUDA-graph size. A note, not a comparison.

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

An engine's flat token ids record no fed tokens (`instrument` reads `[batch, seq]` ids only), so
for such a pair nothing tells another prompt from the same one. Its note names what could make
the lengths differ where the prompts were the same: the shorter call a prefix cache's tail, or,
where the longer call has a CUDA-graph size a few tokens above the shorter one, a prefill the engine
padded to it (vLLM runs a batch of up to its largest capture size, prefill included, padded to the
next capture size: 1, 2, 4, then multiples of 8 by default; the padding rows come last, so a
record's last row and the token gate's length are the padding's).
"""

from __future__ import annotations

from ..format import spec
from ..format.reader import Dump
from .inputs import FED_TAG, fed_token
from .phases import shorter_prompt, tokens_text

TURN_OFF = "vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache"


def prefix_cache_note(ref: Dump, run: Dump) -> str | None:
    """The note for a pair whose prompt calls differ in length and either line up at step 0
    (prefixed with the shorter side's label) or lack the fed tokens that would tell (module
    docstring); else None."""
    prompts = shorter_prompt(ref, run)
    if prompts is None:
        return None
    shorter, whole, tail = prompts
    key = spec.step_key(FED_TAG, 0)
    if missing := [side for side, dump in (("REF", ref), ("RUN", run)) if key not in dump.members]:
        return _unrecorded_note(shorter, whole, tail, " and ".join(missing))
    ref0, run0 = fed_token(ref, key), fed_token(run, key)
    if ref0 is None or ref0 != run0:
        return None
    other = "REF" if shorter == "RUN" else "RUN"
    return (f"{shorter}: its prompt keys hold a call of {tokens_text(tail)} that ends on the token {other}'s prompt "
            f"of {whole} ends on (both fed token {ref0} at step 0): either another prompt, or the same one with its "
            f"first {whole - tail} positions served from a prefix cache (vLLM's automatic prefix caching or SGLang's "
            f"radix cache, after a warm-up or an earlier request with the same prompt); to compare its prompt keys, "
            f"run {shorter} with the cache off ({TURN_OFF})")


def _unrecorded_note(shorter: str, whole: int, tail: int, missing: str) -> str:
    """The note where a side (`missing`: which) recorded no fed tokens: the readings of the same
    prompt (module docstring)."""
    longer = "REF" if shorter == "RUN" else "RUN"
    readings = []
    if (whole % 8 == 0 or whole in (2, 4)) and whole - tail < 16:  # vLLM's default capture sizes, and their gaps
        readings.append(f"{longer}'s call of {tokens_text(whole)} is its prefill padded to a CUDA-graph size (vLLM "
                        f"runs a prefill of up to its largest capture size padded to the next one: compare a prompt "
                        f"whose length is a capture size, such as {whole}, which it runs unpadded)")
    readings.append(f"{shorter}'s call of {tokens_text(tail)} is the tail of it a prefix cache left (its first "
                    f"{whole - tail} positions served from vLLM's automatic prefix caching or SGLang's radix cache: "
                    f"run {shorter} with the cache off, {TURN_OFF})")
    lengths = f"REF's {whole if shorter == 'RUN' else tail} tokens, RUN's {tail if shorter == 'RUN' else whole}"
    return (f"the prompt calls differ in length ({lengths}) and no fed tokens tell whether the two sides ran the "
            f"same prompt (no {FED_TAG}_0 on {missing}: `instrument` records it of [batch, seq] ids, not of an "
            f"engine's flat ids); if they did, " + ", or ".join(readings))


__all__ = ["prefix_cache_note"]
