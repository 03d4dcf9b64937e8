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
the lengths differ where the prompts were the same: the shorter call a prefix cache's tail; the
first of several forwards (chunked prefill), where its logits cannot tell; and, where the longer
side has no fed tokens and its call is the CUDA-graph size an engine pads the shorter length to
by default, a padded prefill (vLLM runs a batch of up to its largest capture size, prefill
included, padded at the end to the next capture size; SGLang's piecewise CUDA graphs pad a prefill
to its next token bucket: the token gate learns the padded length and a record's last row is a
padding row; with each engine's default limits, which can differ between versions). vLLM's
prefix cache holds whole blocks (16 tokens by default), so it is named only where the cached
count is a multiple of 16.
"""

from __future__ import annotations

from bisect import bisect_left

from ..format import spec
from ..format.reader import Dump
from .inputs import FED_TAG, fed_token
from .overwrites import logits_cannot_tell
from .phases import exclude_patterns, other_side, shorter_prompt, tokens_text

TURN_OFF = "vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache"
# The default CUDA-graph sizes a batch of tokens is padded to: vLLM's capture sizes (up to its
# default largest, 512) and SGLang's piecewise token buckets (`--piecewise-cuda-graph-tokens`).
PADDED_SIZES = {
    "vLLM": [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)],
    "SGLang": [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
               *range(1280, 4097, 256), *range(4608, 8193, 512)],
}
VLLM_BLOCK = 16  # vLLM's prefix cache holds whole KV blocks of this many tokens (or a multiple)


def prefix_cache_note(ref: Dump, run: Dump) -> str | None:
    """The note for a pair whose prompt calls differ in length and either line up at step 0
    (prefixed with the shorter side's label) or lack the fed tokens that would tell (module
    docstring); else None."""
    prompts = shorter_prompt(ref, run)
    if prompts is None:
        return None
    shorter, whole, tail = prompts
    key = spec.step_key(FED_TAG, 0)
    dumps = {"REF": ref, "RUN": run}
    fed = {side: fed_token(dump, key) if key in dump.members else None for side, dump in dumps.items()}
    if None in fed.values():
        missing = {side: _why_missing(dumps[side], key) for side, token in fed.items() if token is None}
        chunk_unknown = logits_cannot_tell(dumps[shorter], dumps[other_side(shorter)])
        return _unrecorded_note(shorter, whole, tail, missing, chunk_unknown)
    if fed["REF"] != fed["RUN"]:
        return None
    return (f"{shorter}: its prompt keys hold a call of {tokens_text(tail)} that ends on the token "
            f"{other_side(shorter)}'s prompt "
            f"of {whole} ends on (both fed token {fed['REF']} at step 0): either another prompt, or the same one with "
            f"{_first_positions(whole - tail)} served from a prefix cache after a warm-up or an earlier request with "
            f"the same prompt ({_caches(whole - tail)}); to compare its prompt keys, run {shorter} with the cache off "
            f"({TURN_OFF})")


def _why_missing(dump: Dump, key: str) -> str:
    """Why a side holds no readable fed token at step 0: a phrase with `{who}` (the sides, "REF and
    RUN") and `{whose}` ("REF's and RUN's") to fill in, the same for sides with the same reason."""
    patterns = exclude_patterns(dump.manifest)
    if (pattern := dump.left_out_by(FED_TAG, patterns)) is not None:
        return f"{{whose}} instrument(exclude=...) left it out ({pattern!r})"
    if key in dump.excluded:
        return "not comparable on {who} (see problems)"
    if key in dump.members or key in dump.bad_members:
        return "unreadable on {who}"
    return ("{who} recorded none (`instrument` records it only of [batch, seq] input ids, not of an engine's flat "
            "ids or of embeddings)")


def _unrecorded_note(shorter: str, whole: int, tail: int, missing: dict[str, str], chunk_unknown: bool) -> str:
    """The note where a side recorded no fed token at step 0 (`missing`: side -> why), where the
    logits cannot tell a chunk or can (`chunk_unknown`): the readings of the same prompt (module
    docstring)."""
    longer = other_side(shorter)
    readings = []
    engines = [name for name, sizes in PADDED_SIZES.items() if _next_size(sizes, tail) == whole]
    if longer in missing and engines:
        pad = "pad" if len(engines) > 1 else "pads"
        readings.append(f"{longer}'s call of {tokens_text(whole)} is its prefill padded to a CUDA-graph size "
                        f"({' and '.join(engines)} {pad} a prefill of {tail} tokens to {whole} by default: rerun both "
                        f"sides with a prompt of {whole} tokens, and COMPILEDUMP_TOKENS={whole} where it is set)")
    if chunk_unknown:  # the chunked check (overwrites.py) had no logits to go by
        readings.append(f"{shorter}'s call of {tokens_text(tail)} is the first of several forwards (the prompt in "
                        f"chunks, or a shorter request run before it outside profiling()): record the logits on both "
                        "sides so that the comparator can tell")
    readings.append(f"{shorter}'s call of {tokens_text(tail)} is the part of it a prefix cache left to run "
                    f"({_first_positions(whole - tail)} served from {_caches(whole - tail)}): run {shorter} with the "
                    f"cache off, {TURN_OFF}")
    lengths = f"REF's {whole if shorter == 'RUN' else tail} tokens, RUN's {tail if shorter == 'RUN' else whole}"
    return (f"the prompt calls differ in length ({lengths}) and no fed tokens tell whether the two sides ran the "
            f"same prompt ({FED_TAG}_0: {_reasons(missing)}); if they did, "
            + ("either " if len(readings) > 1 else "") + ", or ".join(readings))


def _reasons(missing: dict[str, str]) -> str:
    """`_why_missing`'s phrases filled in, one per reason (sides sharing one named together)."""
    groups: dict[str, list[str]] = {}
    for side, why in missing.items():
        groups.setdefault(why, []).append(side)
    return "; ".join(why.format(who=" and ".join(sides), whose=" and ".join(f"{s}'s" for s in sides))
                     for why, sides in groups.items())


def _next_size(sizes: list[int], tokens: int) -> int | None:
    """The size a batch of `tokens` is padded to, or None above the largest."""
    index = bisect_left(sizes, tokens)
    return sizes[index] if index < len(sizes) else None


def _first_positions(count: int) -> str:
    return "its first position" if count == 1 else f"its first {count} positions"


def _caches(cached: int) -> str:
    """The prefix caches that can have served `cached` positions."""
    if cached % VLLM_BLOCK == 0:
        return "vLLM's automatic prefix caching or SGLang's radix cache"
    return f"SGLang's radix cache; vLLM's caches whole blocks, of {VLLM_BLOCK} tokens by default"


__all__ = ["prefix_cache_note"]
