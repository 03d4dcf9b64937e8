"""Whether the two values of a key can be compared at all, and what the manifests say was never
captured.

A record key holds the value of one call: the last one that passed the token gate (the first for
``record_once``). With the gate off (``COMPILEDUMP_TOKENS=0``) that call is the last decode step,
whose last row is padding in a padded decode batch, while the ids keep the prefill's (their shape
changed, so later calls were dropped). The manifest says which call a value comes from (optional
fields ``keys[k].tokens``/``phase`` and ``prompt_tokens``, docs/format.md); values of different
phases or token counts are never compared, because any difference between them would be reported
as a divergence that is not one.
"""

from __future__ import annotations

from collections import Counter

from ..format.keys import KeyInfo, order_key_infos
from ..format.reader import Dump, preview

RECORD_KIND_NAMES = ("record", "record_once")


def tokens_text(count: int) -> str:
    """``1 token``, ``7 tokens``."""
    return f"{count} token{'' if count == 1 else 's'}"


def _call(info: KeyInfo) -> str:
    phase = info.written_phase or "a call"
    return f"{phase} ({tokens_text(info.tokens)})" if info.tokens is not None else phase


def not_comparable_reason(kind: str, ref: KeyInfo, run: KeyInfo) -> str | None:
    """Why the REF and RUN values of a key cannot be compared, or None when they can (or when a
    side does not say). Steps are never refused: each is one decode row by construction."""
    if kind == "step":
        return None
    if ref.written_phase and run.written_phase and ref.written_phase != run.written_phase:
        return f"REF value from the {_call(ref)}, RUN value from the {_call(run)}"
    if ref.tokens is not None and run.tokens is not None and ref.tokens != run.tokens:
        return f"REF value from a call of {tokens_text(ref.tokens)}, RUN value from a call of {tokens_text(run.tokens)}"
    return None


def prompt_length(*dumps: Dump) -> int | None:
    """The prompt length a side's token gate used or learned (manifest ``prompt_tokens``), else
    the token count of a value written in the prefill, else None."""
    for dump in dumps:
        value = (dump.manifest or {}).get("prompt_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for dump in dumps:
        for info in dump.infos.values():
            if info.written_phase == "prefill" and info.tokens:
                return info.tokens
    return None


def shorter_prompt(ref: Dump, run: Dump) -> tuple[str, int, int] | None:
    """("REF" or "RUN", the longer prompt length, the shorter) where both sides' prompt lengths
    (`prompt_length`) are known and differ: the side whose prompt call is shorter first; else None."""
    lengths = prompt_length(ref), prompt_length(run)
    if None in lengths or lengths[0] == lengths[1]:
        return None
    return ("RUN" if lengths[1] < lengths[0] else "REF"), max(lengths), min(lengths)


def gate_length(dump: Dump) -> int | None:
    """The prompt length a side's token gate used where it differs from its prompt's tokens: the
    width of a padded request row (compare/padding.py), which ``COMPILEDUMP_TOKENS`` must be; else None."""
    value = (dump.manifest or {}).get("gate_tokens")
    return value if isinstance(value, int) else None


def fix_hint(prompt: int | None, prompts: tuple[int | None, int | None] = (None, None)) -> str:
    """How to make such values comparable: with the two sides' prompt lengths (`prompts`, REF and
    RUN) known and different, the runs had different prompts or prefilled one differently (in
    chunks, partly from a prefix cache, padded: prefix_cache.py's note says which fits), which no
    setting makes comparable; else the token gate kept another call on one side."""
    ref, run = prompts
    if ref and run and ref != run:
        return (f"compare runs of the same prompt, each prefilled whole in one unpadded forward (REF's prompt call "
                f"has {tokens_text(ref)}, RUN's {tokens_text(run)})")
    value = f"{prompt} (the prompt length)" if prompt else "<prompt length>"
    return f"set COMPILEDUMP_TOKENS={value} or leave COMPILEDUMP_TOKENS at its default auto (not 0) on both sides"


def mixed_phase_keys(dump: Dump) -> tuple[list[str], Counter, Counter]:
    """Record keys of one side whose call's token count differs from that of the same layer's
    ids keys (the side's prefill-labelled keys mix two phases), with the token counts involved:
    (keys, Counter of record tokens, Counter of ids tokens)."""
    ids_tokens: dict[int, set[int]] = {}
    for info in dump.infos.values():
        if info.kind == "ids" and info.layer is not None and info.tokens is not None:
            ids_tokens.setdefault(info.layer, set()).add(info.tokens)
    keys, record_counts, ids_counts = [], Counter(), Counter()
    for info in order_key_infos(list(dump.infos.values())):
        if info.kind in RECORD_KIND_NAMES and info.layer in ids_tokens and info.tokens is not None \
                and info.tokens not in ids_tokens[info.layer]:
            keys.append(info.key)
            record_counts[info.tokens] += 1
            ids_counts.update(ids_tokens[info.layer])
    return keys, record_counts, ids_counts


def mixed_phase_detail(side: str, keys: list[str], record_counts: Counter, ids_counts: Counter,
                       prompt: int | None) -> str:
    """The one-line description of a side's mixed-phase keys."""
    return (f"{side}: {len(keys)} record keys hold a call of {_counts(record_counts)} while the ids of their "
            f"layers hold a call of {_counts(ids_counts)} ({preview(keys, 4)}): this side's prefill keys mix two "
            f"phases; {fix_hint(prompt)}")


def _counts(counts: Counter) -> str:
    values = sorted(counts)
    return " or ".join(str(value) for value in values[:-1]) + (" or " if len(values) > 1 else "") + \
        tokens_text(values[-1])


def not_captured(dump: Dump) -> dict | None:
    """What a side's manifest says it never captured: tags filtered on the host (by reason),
    tags all of whose calls were dropped, and dropped calls by reason. None without a manifest."""
    manifest = dump.manifest
    if manifest is None:
        return None
    filtered = manifest.get("filtered_tags")
    filtered = {str(tag): str(why) for tag, why in filtered.items()} if isinstance(filtered, dict) else {}
    drops = manifest.get("drops")
    drops = {str(why): count for why, count in drops.items() if isinstance(count, int) and count} \
        if isinstance(drops, dict) else {}
    tags = manifest.get("tags")
    entries = {name: entry for name, entry in (tags.items() if isinstance(tags, dict) else ())
               if isinstance(entry, dict)}
    none_kept = sorted(name for name, entry in entries.items() if entry.get("kept") == 0)
    # Calls the token gate dropped of tags that kept a call: later forwards (a decode), not a tensor
    # whose first dim is never the token count (a tag that kept nothing)
    gated = [(entry.get("drops") or {}).get("token_gate") for entry in entries.values()
             if isinstance(entry.get("kept"), int) and entry["kept"] > 0]
    later = sum(count for count in gated if isinstance(count, int))
    return {"filtered_tags": dict(Counter(filtered.values())), "filtered": sorted(filtered),
            "tags_none_kept": none_kept, "drops": drops, "gated_after_kept": later}


def first_nonfinite(dump: Dump) -> dict | None:
    """The manifest's `first_nonfinite`: the first call whose capture kernel saw a NaN/Inf (key,
    phase, step, count), found without any reference. None without one (or without a manifest)."""
    entry = (dump.manifest or {}).get("first_nonfinite")
    return entry if isinstance(entry, dict) and isinstance(entry.get("key"), str) else None


def other_side(side: str) -> str:
    """The other side of a pair: "RUN" for "REF", "REF" for "RUN"."""
    return "RUN" if side == "REF" else "REF"


_FILTERS = {"moe_layers": "COMPILEDUMP_MOE_LAYERS"}


def moe_layers_of(manifest: dict | None) -> int | None:
    """The COMPILEDUMP_MOE_LAYERS a side captured with (its manifest's config), or None."""
    config = (manifest or {}).get("config")
    return config.get("moe_layers") if isinstance(config, dict) else None


def layer_steps_of(manifest: dict | None) -> int | None:
    """The COMPILEDUMP_LAYER_STEPS a side captured with (its manifest's config), or None."""
    config = (manifest or {}).get("config")
    cap = config.get("layer_steps") if isinstance(config, dict) else None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0 else None


def exclude_patterns(manifest: dict | None) -> list[str]:
    """The `instrument(exclude=...)` patterns a side was captured with (its manifest's), or none."""
    patterns = (manifest or {}).get("exclude")
    return [p for p in patterns if isinstance(p, str)] if isinstance(patterns, list) else []


def not_captured_note(facts: dict[str, dict | None]) -> str | None:
    """One line over both sides: tags filtered, tags never kept, dropped calls, with counts."""
    parts = []
    for side, fact in facts.items():
        if not fact:
            continue
        bits = []
        if fact["filtered"]:
            # The only host filter today is COMPILEDUMP_MOE_LAYERS (manifest reason "moe_layers").
            reasons = ", ".join(f"{count} by {_FILTERS.get(why, why)}"
                                for why, count in sorted(fact["filtered_tags"].items()))
            bits.append(f"{len(fact['filtered'])} tags filtered ({reasons})")
        if fact["tags_none_kept"]:
            bits.append(f"{len(fact['tags_none_kept'])} tags with every call dropped")
        if fact["drops"]:
            bits.append("dropped calls " + " ".join(f"{why}={count}" for why, count in fact["drops"].items()))
        if bits:
            parts.append(f"{side} " + ", ".join(bits))
    return "not captured: " + "; ".join(parts) if parts else None
