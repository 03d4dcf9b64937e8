"""Prompt values that a later forward of the prompt's length replaced on one side.

`record` and `record_ids` keep the last write of a tag that passes the token gate, and a forward
with as many rows as the prompt has tokens passes it: in a flat `[tokens, hidden]` engine a
decode batch padded to the prompt's length (a CUDA-graph size of 8 beside an 8-token prompt),
or a warm-up or another request run outside `profiling()`. Its rows then replace the prompt's,
and comparing them with the reference's prompt would report a divergence that is not there (or
hide one). The manifest counts the writes that passed every gate (`tags[tag].passed`): where the
two sides' counts differ and one of them is above one, a side wrote the tag again after the
prompt, so the key is not comparable (exit 3), with one line that names the fix.

The steps of such a side are misaligned with the other's when its extra forwards came before the
compared request (a warm-up), and so are a side's that ran the prompt itself in several forwards
(chunked prefill, as vLLM and SGLang do for a prompt longer than their chunk): its token gate
learned the first chunk's length, so its prompt keys hold the first chunk, and each chunk's
forward is a step of its logits. Both are told by the fed tokens (or the logits) of the side with
more steps matching the other's from a later step on; every step key is then not comparable, and
for chunks the prompt keys too, each case with its own line and fix.
"""

from __future__ import annotations

import numpy as np

from ..format import spec
from ..format.reader import Dump
from .inputs import FED_TAG, fed_token
from .phases import prompt_length, tokens_text

# The manifest kinds whose last write wins (record, all-rows record, record_ids).
_LAST_WRITE_KINDS = ("record", "ids")
# How every reason of this module starts (text.py groups the keys by them).
WRITTEN_AGAIN = "written again after the prompt"
SHIFTED = "steps shifted"
CHUNKED = "prompt in chunks"
FIX = ("choose a prompt length that no decode batch size equals, run warm-ups and other requests inside "
       "compiledump.profiling(), or call compiledump.clear() right before the compared request")
CHUNKED_FIX = ("run the compared prompt in one forward (vLLM: max_num_batched_tokens at least the prompt length; "
               "SGLang: --chunked-prefill-size -1)")


def written_again(ref: Dump, run: Dump, old_names: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """({key: why it is not comparable}, the side that wrote more: "REF", "RUN" or None) for the
    last-write keys one side wrote more often than the other (both sides' token gates on, both
    counts in their manifests). `old_names`: RUN's keys renamed by --map, new -> old (its manifest
    keeps the old)."""
    if not (_gated(ref) and _gated(run)):
        return {}, None
    prompt = (ref.manifest or {}).get("prompt_tokens")
    found, wrote_more = {}, None
    for key in ref.members.keys() & run.members.keys():
        ref_passes, run_passes = _passes(ref, key), _passes(run, old_names.get(key, key))
        if ref_passes is None or run_passes is None or ref_passes == run_passes or max(ref_passes, run_passes) < 2:
            continue
        more, fewer = ("REF", "RUN") if ref_passes > run_passes else ("RUN", "REF")
        wrote_more = wrote_more or more
        tokens = f"the prompt's {prompt} tokens" if isinstance(prompt, int) else "the prompt's length"
        found[key] = (f"{WRITTEN_AGAIN}: {more} wrote it in {max(ref_passes, run_passes)} forwards of {tokens}, "
                      f"{fewer} in {min(ref_passes, run_passes)}; the last write wins, so {more}'s value may be a "
                      f"later forward's (a decode batch of as many rows, or a warm-up outside profiling())")
    return found, wrote_more


def shifted_steps(ref: Dump, run: Dump, wrote_more: str | None) -> str | None:
    """Why every step key is not comparable when the side that wrote the prompt's records more
    often (`wrote_more`, from `written_again`) ran its extra forwards *before* the compared request
    (a warm-up outside profiling()):
    its steps start with theirs, so its step n is the other side's step n - k. Told by the fed
    tokens where both sides recorded them (`input_token`), else by which of its logits steps matches
    the other side's `logits_0` far better. None when the steps line up (the extra forwards came
    after the request) or it cannot be told."""
    if wrote_more is None:
        return None
    more, fewer = (run, ref) if wrote_more == "RUN" else (ref, run)
    extra = _steps(more, "logits") - _steps(fewer, "logits")
    evidence = _shift(more, fewer, extra)
    if evidence is None:
        return None
    return (f"{SHIFTED}: {wrote_more} ran {extra} forward(s) of the prompt's length before the compared request (a warm-up "
            f"outside profiling()), so its step n is the other side's step n - {extra} ({evidence})")


def chunked_prefill(ref: Dump, run: Dump) -> str | None:
    """Why the prompt keys and every step key are not comparable when one side ran the prompt in
    several forwards (module docstring): its prompt (the length its gate learned) is shorter than
    the other side's, and its steps from k on are the other side's from 0, k being how many more
    steps it holds. None otherwise."""
    prompts = {"REF": prompt_length(ref), "RUN": prompt_length(run)}
    if None in prompts.values() or prompts["REF"] == prompts["RUN"]:
        return None
    side = "RUN" if prompts["RUN"] < prompts["REF"] else "REF"
    more, fewer = (run, ref) if side == "RUN" else (ref, run)
    extra = _steps(more, "logits") - _steps(fewer, "logits")
    evidence = _shift(more, fewer, extra)
    if evidence is None:
        return None
    return (f"{CHUNKED}: {side} ran the prompt in {extra + 1} forwards (chunked prefill): its prompt keys hold its first "
            f"forward's {tokens_text(min(prompts.values()))} of the other side's {max(prompts.values())}, and its step n "
            f"is the other side's step n - {extra} ({evidence})")


def _shift(more: Dump, fewer: Dump, extra: int) -> str | None:
    """How `more`'s steps are seen to start `extra` steps before `fewer`'s (its step n is the other
    side's step n - extra), or None when they line up or it cannot be told: the fed tokens where
    both sides recorded them (`input_token`), else which of its logits steps matches the other
    side's `logits_0` far better."""
    if extra < 1:
        return None
    counts = [_steps(dump, "logits") for dump in (more, fewer)]
    fed = [[fed_token(dump, spec.step_key(FED_TAG, n)) for n in range(min(_steps(dump, FED_TAG), counts[0]))]
           for dump in (more, fewer)]
    if [len(tokens) for tokens in fed] == counts and None not in fed[0] + fed[1]:
        aligned = all(a == b for a, b in zip(fed[0], fed[1]))
        shifted = all(a == b for a, b in zip(fed[0][extra:], fed[1]))
        evidence = "its fed tokens from step {k} on are the other side's from step 0"
    else:
        first = [_array(fewer, spec.step_key("logits", 0)), _array(more, spec.step_key("logits", 0)),
                 _array(more, spec.step_key("logits", extra))]
        if any(x is None or x.shape != first[0].shape for x in first):
            return None
        scale = float(np.linalg.norm(first[0])) or 1.0
        errors = [float(np.linalg.norm(x - first[0])) / scale for x in first[1:]]
        aligned, shifted = errors[0] <= 10 * errors[1], errors[1] * 10 < errors[0]
        evidence = "its logits_{k} matches the other side's logits_0"
    return None if aligned or not shifted else evidence.format(k=extra)


def written_again_lines(records: list) -> list[str]:
    """One line for the keys `written_again` refused, one for the steps `shifted_steps` refused,
    one for the keys `chunked_prefill` refused, each with the fix."""
    lines = []
    for marker, what, fix in ((WRITTEN_AGAIN, "prompt keys were written again after the prompt", FIX),
                              (SHIFTED, "step keys are shifted", FIX),
                              (CHUNKED, "keys hold another split of the prompt", CHUNKED_FIX)):
        refused = [record for record in records if (record.reason or "").startswith(marker)]
        if not refused:
            continue
        keys = ", ".join(record.key for record in refused[:6]) + (f", ... ({len(refused) - 6} more)"
                                                                  if len(refused) > 6 else "")
        why = refused[0].reason.removeprefix(f"{marker}: ")
        lines.append(f"not comparable: {len(refused)} {what} ({keys}): {why}. Not compared; fix: {fix}")
    return lines


def _steps(dump: Dump, tag: str) -> int:
    """How many consecutive steps `<tag>_0, _1, ...` the dump holds."""
    n = 0
    while spec.step_key(tag, n) in dump.members:
        n += 1
    return n


def _array(dump: Dump, key: str) -> np.ndarray | None:
    try:
        return np.asarray(dump.replicas(key)[0].whole(), dtype=np.float64)
    except (OSError, ValueError, KeyError):
        return None


def _gated(dump: Dump) -> bool:
    """Whether `dump`'s token gate was on (COMPILEDUMP_TOKENS not 0): with it off, every forward
    overwrites by design (debug_dump.py's behaviour), which the counts cannot tell apart."""
    config = (dump.manifest or {}).get("config") or {}
    return dump.manifest is not None and config.get("tokens", "auto") not in (0, "0")


def _passes(dump: Dump, key: str) -> int | None:
    """How many writes of last-write tag `key` passed every gate, from the manifest, or None."""
    entry = ((dump.manifest or {}).get("tags") or {}).get(key)
    if not isinstance(entry, dict) or entry.get("kind") not in _LAST_WRITE_KINDS:
        return None
    passes = entry.get("passed")
    return passes if isinstance(passes, int) and not isinstance(passes, bool) else None
