"""A prompt partly served from a prefix cache: one side's prompt keys hold only its last tokens.

vLLM (automatic prefix caching, on by default) and SGLang (the radix cache) keep the KV cache of
the prompts they ran; a request whose prompt begins with one that ran before (a warm-up of the
same prompt, inside `profiling()` or not, or an earlier request) runs only the rest: its prefill
forward holds the prompt's last n positions, attending to the cached ones, and the token gate
learns n. Those n positions compute what the same positions of the whole prompt do, so the
other side's prompt keys are seen on its last n positions (padding.py's `PromptRowsView`: keys of
every prompt row sliced, token counts adjusted) and compared; one note says so, with how to turn
the cache off to compare every position.

Told apart from the other ways a side's prompt keys can hold a shorter call: chunked prefill (its
first forward is the prompt's first chunk, its step 0 one of the prompt's earlier tokens:
overwrites.py) and a different prompt (nothing lines up), by step 0: both sides' prefill ended on
the same token, the one each fed at step 0 (``input_token_0``, which `instrument` records). A side
without it is left as recorded (not comparable, different token counts).
"""

from __future__ import annotations

from ..format import spec
from ..format.reader import Dump
from .inputs import FED_TAG, fed_token
from .padding import PromptRowsView
from .phases import prompt_length, tokens_text

TURN_OFF = "vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache"


def cached_prefix(ref: Dump, run: Dump) -> tuple[Dump, Dump]:
    """`(ref, run)`, the side with the longer prompt seen on the other side's last positions when
    the other's prompt call was the same prompt's tail (module docstring); else as they are."""
    prompts = {"REF": prompt_length(ref), "RUN": prompt_length(run)}
    if None in prompts.values() or prompts["REF"] == prompts["RUN"]:
        return ref, run
    cached = "RUN" if prompts["RUN"] < prompts["REF"] else "REF"
    whole, tail = max(prompts.values()), min(prompts.values())
    longer, shorter = (ref, run) if cached == "RUN" else (run, ref)
    step0 = spec.step_key(FED_TAG, 0)
    token = fed_token(shorter, step0)
    if token is None or token != fed_token(longer, step0):
        return ref, run
    view = PromptRowsView(longer)
    view.keep_rows(whole - tail, whole, whole, padded=False)
    # One token left to run is what each decode step of a batch of one runs too: the gate keeps
    # those steps' writes as well (overwrites.py then refuses the prompt keys, "written again").
    one = ("; one token is also what each decode step of a batch of one runs, so later steps may overwrite those "
           "keys" if tail == 1 else "")
    view.notes.append(
        f"its prompt keys are compared on the last {tokens_text(tail)} of its prompt of {whole}: {cached}'s prompt "
        f"keys hold a call of {tokens_text(tail)} ending where this side's does (both fed token {token} at step 0), "
        f"its first {whole - tail} positions served from a prefix cache (vLLM's automatic prefix caching or "
        f"SGLang's radix cache, after a warm-up or an earlier request with the same prompt){one}; to compare every "
        f"position, run {cached} without it ({TURN_OFF})")
    return (view, run) if cached == "RUN" else (ref, view)


__all__ = ["cached_prefix"]
