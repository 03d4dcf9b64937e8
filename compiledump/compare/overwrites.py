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
from .phases import shorter_prompt, tokens_text

# The manifest kinds whose last write wins (record, all-rows record, record_ids).
_LAST_WRITE_KINDS = ("record", "ids")
# How every reason of this module starts (text.py groups the keys by them).
WRITTEN_AGAIN = "written again after the prompt"
SHIFTED = "steps shifted"
CHUNKED = "prompt in chunks"
FIX = ("choose a prompt length that no decode batch size equals, run warm-ups and other requests inside "
       "compiledump.profiling(), or call compiledump.clear() right before the compared request")
CHUNKED_FIX = ("run the compared prompt in one forward (vLLM: --max-num-batched-tokens at least the prompt length; "
               "SGLang: --chunked-prefill-size -1), or a warm-up inside compiledump.profiling()")
_MAX_SHIFT = 16  # the most forwards before the compared request's last prompt forward that are looked for


def written_again(ref: Dump, run: Dump, old_names: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """({key: why it is not comparable}, the side that wrote more: "REF", "RUN" or None) for the
    last-write keys one side wrote more often than the other (both sides' token gates on, both
    counts in their manifests). `old_names`: RUN's keys renamed by --map, new -> old (its manifest
    keeps the old)."""
    found, wrote_more = _encoder_runs(ref, run, old_names), None
    if not (_gated(ref) and _gated(run)):
        return found, None
    prompt = (ref.manifest or {}).get("prompt_tokens")
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


def one_token_prompt(ref: Dump, run: Dump) -> tuple[str | None, set[str] | None]:
    """(a note, or None; the keys not to compare, or None) for one-token prompts whose keys later
    forwards wrote again (`one_token_prompt_sides`). Where both sides had one, the last-write keys
    written again hold the last forward's values: not compared, and `layer<N>_step_0` (the prompt's
    forward) is, so every forward is compared in its phase. None: step 0 stays out, as usual."""
    sides = one_token_prompt_sides(ref, run)
    if not sides:
        return None, None
    return one_token_prompt_note(sides), (overwritten_prompt_keys(ref, run) if sides == ["REF", "RUN"] else None)


def one_token_prompt_sides(ref: Dump, run: Dump) -> list[str]:
    """The sides ("REF", "RUN") whose prompt call had 1 token and whose prompt keys were written in
    several forwards: each decode step had as many tokens, so they hold the last forward's values,
    not the prompt's (`generate()` feeds an encoder-decoder's decoder its start token alone)."""
    return [name for name, dump in (("REF", ref), ("RUN", run)) if _gated(dump)
            and (dump.manifest or {}).get("prompt_tokens") == 1
            and any((_passes(dump, key) or 0) > 1 for key in dump.members)]


def overwritten_prompt_keys(ref: Dump, run: Dump) -> set[str]:
    """The last-write keys later forwards of the same token count wrote again as often on both sides
    (of one-token prompts, `one_token_prompt_sides` on both: the last forward's values, not the
    prompt's), where each layer's state at the last forward (`layer<N>_step_<last>`) stands in for
    them: a layer's keys where its own does, the others where every layer's does. (Keys written
    unequally often are `written_again`'s to refuse.)"""
    last = min(step_count(ref, "logits"), step_count(run, "logits")) - 1
    covered = {layer for layer in {spec.layer_of(spec.split_step_key(key)[0]) for key in ref.members
                                   if spec.stream_step_key(key)} - {None}
               if spec.step_key(f"layer{layer}_step", last) in ref.members.keys() & run.members.keys()}
    every = bool(covered) and all(spec.layer_of(tag) in covered for tag in _layer_tags(ref))
    found = set()
    for key in ref.members.keys() & run.members.keys():
        ref_passes, run_passes = _passes(ref, key), _passes(run, key)
        if ref_passes is None or ref_passes != run_passes or ref_passes < 2:
            continue
        layer = spec.layer_of(key)
        if (layer in covered) if layer is not None else every:
            found.add(key)
    return found


def _layer_tags(dump: Dump) -> set[str]:
    """The decoder layers' output tags the dump holds (`layer<N>`)."""
    return {key for key in dump.members if spec.layer_of(key) is not None and key == f"layer{spec.layer_of(key)}"}


def one_token_prompt_note(sides: list[str]) -> str:
    """The note for `one_token_prompt_sides` (both sides: their overwritten keys are not compared)."""
    both = sides == ["REF", "RUN"]
    whose, held = ("their", "the last forward's values, not the prompt's: not compared") if both else \
        ("its", "its last forward's values, not the prompt's")
    steps = ("(logits_<n>, layer<i>_step_<n>, step 0 the prompt's forward) are compared forward by forward" if both
             else "(logits_<n>, layer<i>_step_<n>) are each forward's")
    return (f"{' and '.join(sides)}: the prompt's call had 1 token, as each decode step had, so {whose} prompt keys "
            f"(layer<i>, layer<i>_attn, ...) hold {held} (generate() feeds an encoder-decoder's decoder its start token "
            f"alone); the steps {steps}. To compare the prompt's keys, give the decoder two or more prompt tokens "
            "(generate(..., decoder_input_ids=...)) or feed the steps by hand")


def _encoder_runs(ref: Dump, run: Dump, old_names: dict[str, str]) -> dict[str, str]:
    """`encoder_output` where one side ran its encoder more often: it keeps its first run's (it is
    recorded once, not token-gated), so that side's may be an earlier request's or a warm-up's. Not
    where that side ran it once per forward (as many runs as `logits_<n>` steps): a reference
    without a KV cache runs it again at every forward, on the same source."""
    key = spec.ENCODER_OUTPUT_TAG
    if key not in ref.members or key not in run.members:
        return {}
    ref_runs, run_runs = _passes(ref, key, ("record_once",)), _passes(run, old_names.get(key, key), ("record_once",))
    if ref_runs is None or run_runs is None or ref_runs == run_runs:
        return {}
    more, fewer = ("REF", "RUN") if ref_runs > run_runs else ("RUN", "REF")
    if max(ref_runs, run_runs) == step_count(ref if more == "REF" else run, "logits"):
        return {}
    return {key: f"{WRITTEN_AGAIN}: {more} ran its encoder {max(ref_runs, run_runs)} times, {fewer} "
                 f"{min(ref_runs, run_runs)}; it is recorded once, so {more}'s value may be an earlier request's"}


def shifted_steps(ref: Dump, run: Dump, wrote_more: str | None) -> str | None:
    """Why every step key is not comparable when the side that wrote the prompt's records more
    often (`wrote_more`, from `written_again`) ran its extra forwards *before* the compared request
    (a warm-up outside profiling()): its steps start with theirs, so its step n is the other
    side's step n - k (`_shift`). None when the steps line up (the extra forwards came after the
    request) or it cannot be told."""
    if wrote_more is None:
        return None
    found = _shift(run, ref) if wrote_more == "RUN" else _shift(ref, run)
    if found is None:
        return None
    k, evidence = found
    return (f"{SHIFTED}: {wrote_more} ran {k} forward(s) of the prompt's length before the compared request (a warm-up "
            f"outside profiling()), so its step n is the other side's step n - {k} ({evidence})")


def chunked_prefill(ref: Dump, run: Dump) -> str | None:
    """Why the prompt keys and every step key are not comparable when one side's prompt keys hold
    a shorter call than the other side's prompt and its steps start k earlier (`_shift`): it ran
    the prompt in k + 1 forwards (chunked prefill, module docstring), or a shorter request before
    the compared one outside profiling(); the two read the same in a dump, so the line names both
    and their fixes. None otherwise."""
    prompts = shorter_prompt(ref, run)
    if prompts is None:
        return None
    side, whole, tail = prompts
    found = _shift(run, ref) if side == "RUN" else _shift(ref, run)
    if found is None:
        return None
    k, evidence = found
    return (f"{CHUNKED}: {side}'s prompt keys hold a call of {tokens_text(tail)}, not the other side's prompt of "
            f"{whole}, and its step n is the other side's step n - {k} ({evidence}): it ran the prompt in "
            f"{k + 1} forwards (chunked prefill), or a shorter request before the compared one outside profiling()")


def _shift(more: Dump, fewer: Dump) -> tuple[int, str] | None:
    """(k, evidence) when `more`'s step k (1 <= k <= _MAX_SHIFT) is `fewer`'s step 0, the prompt's
    last token; None when step 0 lines up or it cannot be told.

    The candidates are the steps whose fed token (`input_token`, where both sides recorded it) is
    `fewer`'s at step 0 (later steps may differ after an argmax flip, and the sides may decode
    different counts); without fed tokens, every step, and the logits alone decide: `more`'s
    logits_k closest to `fewer`'s logits_0 and ten times closer than its own logits_0. With fed
    tokens, where several steps feed that token (a chunk can end on the prompt's last token, and
    an aligned pair can feed it again after a flip), the logits decide the same way where every
    candidate has them; else, or where no candidate is ten times closer, the candidate from which
    the most fed tokens in a row agree with `fewer`'s (step 0 when it ties)."""
    first = fed_token(fewer, spec.step_key(FED_TAG, 0))
    fed = [fed_token(more, spec.step_key(FED_TAG, n)) for n in range(min(step_count(more, FED_TAG), _MAX_SHIFT + 1))]
    if first is None or not fed or None in fed:  # no fed tokens: the logits alone
        errors = _logits_errors(more, fewer)
        if _undecided(errors):
            return None
        k = 1 + int(np.argmin(errors[1:]))
        return (k, f"its logits_{k} matches the other side's logits_0") if errors[k] * 10 < errors[0] else None
    candidates = [n for n, token in enumerate(fed) if token == first]
    if len(candidates) <= 1:
        return (candidates[0], f"its fed token at step {candidates[0]} is the other side's at step 0") \
            if candidates and candidates[0] else None
    errors = _logits_errors(more, fewer)  # read only where several steps feed the token (each up to a vocab wide)
    if len(errors) > candidates[-1] and all(np.isfinite(errors[n]) for n in candidates):
        k = min(candidates, key=lambda n: errors[n])
        if k == 0:
            return None
        if candidates[0] != 0 or errors[k] * 10 < errors[0]:
            return k, f"its fed token at step {k} is the other side's at step 0 and its logits_{k} matches the other " \
                      "side's logits_0"
    count = min(step_count(fewer, FED_TAG), len(fed))  # `first` is its step 0
    ahead = [first] + [fed_token(fewer, spec.step_key(FED_TAG, n)) for n in range(1, count)]
    runs = {n: next((j for j in range(len(ahead)) if n + j >= len(fed) or fed[n + j] != ahead[j]), len(ahead))
            for n in candidates}
    k = max(candidates, key=lambda n: (runs[n], -n))
    return None if k == 0 else (k, f"its fed tokens from step {k} are the other side's from step 0")


def logits_cannot_tell(more: Dump, fewer: Dump) -> bool:
    """Whether the logits cannot tell a chunked `more` (its call the shorter) from an aligned one:
    `fewer`'s logits_0, or `more`'s logits_0 and a later step, are missing (`_shift` without fed
    tokens gives up then)."""
    return _undecided(_logits_errors(more, fewer))


def _undecided(errors: list[float]) -> bool:
    return len(errors) < 2 or not np.isfinite(errors[0])


def _logits_errors(more: Dump, fewer: Dump) -> list[float]:
    """For each step n of `more` up to _MAX_SHIFT, how far its logits_n is from `fewer`'s logits_0
    (relative L2; inf where it is missing or of another shape); [] without `fewer`'s logits_0."""
    target = whole_array(fewer, spec.step_key("logits", 0))
    if target is None:
        return []
    scale = float(np.linalg.norm(target)) or 1.0
    errors = []
    for n in range(min(step_count(more, "logits"), _MAX_SHIFT + 1)):
        x = whole_array(more, spec.step_key("logits", n))
        errors.append(float(np.linalg.norm(x - target)) / scale if x is not None and x.shape == target.shape
                      else np.inf)
    return errors


def written_again_lines(records: list) -> list[str]:
    """One line for the keys `written_again` refused, one for the steps `shifted_steps` refused,
    one for the keys `chunked_prefill` refused, each with the fix."""
    lines = []
    for marker, what, fix in ((WRITTEN_AGAIN, "prompt keys were written again after the prompt", FIX),
                              (SHIFTED, "step keys are shifted", FIX),
                              (CHUNKED, "keys follow a shorter first forward", CHUNKED_FIX)):
        refused = [record for record in records if (record.reason or "").startswith(marker)]
        if not refused:
            continue
        keys = ", ".join(record.key for record in refused[:6]) + (f", ... ({len(refused) - 6} more)"
                                                                  if len(refused) > 6 else "")
        why = refused[0].reason.removeprefix(f"{marker}: ")
        lines.append(f"not comparable: {len(refused)} {what} ({keys}): {why}. Not compared; fix: {fix}")
    return lines


def step_count(dump: Dump, tag: str) -> int:
    """How many consecutive steps `<tag>_0, _1, ...` the dump holds."""
    n = 0
    while spec.step_key(tag, n) in dump.members:
        n += 1
    return n


def whole_array(dump: Dump, key: str) -> np.ndarray | None:
    """`key`'s first whole copy on `dump`, as float64; None where it cannot be read."""
    try:
        return np.asarray(dump.replicas(key)[0].whole(), dtype=np.float64)
    except (OSError, ValueError, KeyError):
        return None


def _gated(dump: Dump) -> bool:
    """Whether `dump`'s token gate was on (COMPILEDUMP_TOKENS not 0): with it off, every forward
    overwrites by design (debug_dump.py's behaviour), which the counts cannot tell apart."""
    config = (dump.manifest or {}).get("config") or {}
    return dump.manifest is not None and config.get("tokens", "auto") not in (0, "0")


def _passes(dump: Dump, key: str, kinds: tuple[str, ...] = _LAST_WRITE_KINDS) -> int | None:
    """How many writes of tag `key` (of one of `kinds`: last-write ones by default) passed every
    gate, from the manifest, or None."""
    entry = ((dump.manifest or {}).get("tags") or {}).get(key)
    if not isinstance(entry, dict) or entry.get("kind") not in kinds:
        return None
    passes = entry.get("passed")
    return passes if isinstance(passes, int) and not isinstance(passes, bool) else None
