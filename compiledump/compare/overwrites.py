"""Prompt values that a later forward of the prompt's length replaced on one side.

`record` and `record_ids` keep the last write of a tag that passes the token gate, and a forward
with as many rows as the prompt has tokens passes it: in a flat `[tokens, hidden]` engine a
decode batch padded to the prompt's length (a CUDA-graph size of 8 beside an 8-token prompt),
or a warm-up or another request run outside `profiling()`. Its rows then replace the prompt's,
and comparing them with the reference's prompt would report a divergence that is not there (or
hide one). The manifest counts the writes that passed every gate (`tags[tag].passed`): where the
two sides' counts differ and one of them is above one, a side wrote the tag again after the
prompt, so the key is not comparable (exit 3), with one line that names the fix.
"""

from __future__ import annotations

from ..format.reader import Dump

# The manifest kinds whose last write wins (record, all-rows record, record_ids).
_LAST_WRITE_KINDS = ("record", "ids")
# How every reason of this module starts (text.py groups the keys by it).
WRITTEN_AGAIN = "written again after the prompt"
FIX = ("choose a prompt length that no decode batch size equals, run warm-ups and other requests inside "
       "compiledump.profiling(), or call compiledump.clear() right before the compared request")


def written_again(ref: Dump, run: Dump, old_names: dict[str, str]) -> dict[str, str]:
    """{key: why it is not comparable} for the last-write keys one side wrote more often than the
    other (both sides' token gates on, both counts in their manifests). `old_names`: RUN's keys
    renamed by --map, new -> old (its manifest keeps the old)."""
    if not (_gated(ref) and _gated(run)):
        return {}
    prompt = (ref.manifest or {}).get("prompt_tokens")
    found = {}
    for key in ref.members.keys() & run.members.keys():
        ref_passes, run_passes = _passes(ref, key), _passes(run, old_names.get(key, key))
        if ref_passes is None or run_passes is None or ref_passes == run_passes or max(ref_passes, run_passes) < 2:
            continue
        more, fewer = ("REF", "RUN") if ref_passes > run_passes else ("RUN", "REF")
        tokens = f"the prompt's {prompt} tokens" if isinstance(prompt, int) else "the prompt's length"
        found[key] = (f"{WRITTEN_AGAIN}: {more} wrote it in {max(ref_passes, run_passes)} forwards of {tokens}, "
                      f"{fewer} in {min(ref_passes, run_passes)}; the last write wins, so {more}'s value may be a "
                      f"later forward's (a decode batch of as many rows, or a warm-up outside profiling())")
    return found


def written_again_line(records: list) -> str | None:
    """One line for the keys `written_again` refused, with the fix."""
    refused = [record for record in records if (record.reason or "").startswith(WRITTEN_AGAIN)]
    if not refused:
        return None
    keys = ", ".join(record.key for record in refused[:6]) + (f", ... ({len(refused) - 6} more)"
                                                              if len(refused) > 6 else "")
    why = refused[0].reason.removeprefix(f"{WRITTEN_AGAIN}: ")
    return (f"not comparable: {len(refused)} prompt keys were {WRITTEN_AGAIN} ({keys}): {why}. Not compared; "
            f"fix: {FIX}")


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
