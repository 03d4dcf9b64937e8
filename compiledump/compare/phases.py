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

import math
from collections import Counter

from ..format.keys import KeyInfo, order_key_infos
from ..format.reader import Dump, preview
from ..format import spec
from ..format.spec import NOT_RECURRENT_MIXERS

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


def recovered_note(side: str, dump: Dump) -> str | None:
    """A note when a side's dump was rebuilt by `compiledump recover` from a dead process's files."""
    recovered = (dump.manifest or {}).get("recovered")
    if not isinstance(recovered, dict):
        return None
    return (f"{side} was recovered from a process that died before flushing ({recovered.get('cause')}): it ends "
            "where that process stopped")


def _where(layer: float) -> str:
    """`layer 3`, or `after the layers` for a key after every layer (math.inf: the final norm, logits)."""
    return f"layer {layer}" if layer != math.inf else "after the layers"


# The end of a model caution's note (hybrid_note, hyper_connection_note): what the user can do.
_MAY_BE_NOISE = ("so a small crossing there may be noise; compare an fp32 engine run to localise a bug of a few "
                 "percent (docs/compare.md, \"Hybrid models\")")


def hybrid_note(manifests: list, layer: float | None, klass: str | None) -> str | None:
    """A caution when a low-precision pair first diverges at or after a linear-attention or
    state-space layer (the first of `manifests` with `mixers`, which `instrument` writes): their
    honest bf16 rounding can exceed the defaults calibrated on attention models (docs/compare.md)."""
    mixers = next((m["mixers"] for m in manifests if isinstance(m, dict) and m.get("mixers")), None)
    if layer is None or klass in (None, "fp32") or not isinstance(mixers, dict):
        return None
    recurrent = sorted((int(i), kind) for i, kind in mixers.items()
                       if str(i).isdigit() and int(i) <= layer and kind not in NOT_RECURRENT_MIXERS)
    if not recurrent:
        return None
    kinds = ", ".join(sorted({kind for _, kind in recurrent}))
    return (f"the first divergence ({_where(layer)}) is at or after {len(recurrent)} layer(s) whose token mixer is not "
            f"attention ({kinds}; first: layer {recurrent[0][0]}): in {klass} their honest rounding can exceed the "
            f"defaults (seen with random weights of larger scale), {_MAY_BE_NOISE}")


def _hyper_connection_layers(manifest) -> dict[int, int]:
    """{layer: hc_mult} of the decoder layers whose state a side stored as the mean over hyper-
    connection streams: `layer<N>` read from `[tokens, hc_mult, hidden]` (manifest source_shape)."""
    keys = manifest.get("keys") if isinstance(manifest, dict) else None
    found = {}
    for key, entry in (keys or {}).items():
        source, shape = (entry.get("source_shape"), entry.get("shape")) if isinstance(entry, dict) else (None, None)
        if spec.LAYER_ONLY.match(key) and isinstance(source, list) and isinstance(shape, list) and len(source) == 3 \
                and len(shape) < 3 and shape and shape[-1] == source[-1] and isinstance(source[1], int) \
                and 2 <= source[1] <= 8:
            found[int(key[len("layer"):])] = source[1]
    return found


def hyper_connection_note(manifests: list, layer: float | None, klass: str | None) -> str | None:
    """A caution when a low-precision pair first diverges at or after a layer whose residual is
    several hyper-connection streams (DeepSeek-V4's mHC): the weights that mix the streams are
    computed from them, the dump holds their mean, and honest bf16 rounding crossed the defaults
    in tiny random models where no other MoE model's did (docs/compare.md, "Hybrid models")."""
    if layer is None or klass in (None, "fp32"):
        return None
    streams = {}
    for manifest in manifests:
        streams.update(_hyper_connection_layers(manifest))
    before = sorted(i for i in streams if i <= layer)
    if not before:
        return None
    return (f"the first divergence ({_where(layer)}) is at or after {len(before)} layer(s) whose residual is "
            f"{streams[before[0]]} hyper-connection streams (first: layer {before[0]}; stored as their mean): the "
            f"weights that mix them are computed from the streams, and in {klass} their honest rounding can exceed "
            f"the defaults (seen with random weights), {_MAY_BE_NOISE}")


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


def routing_recorded_below(ref: Dump, run: Dump) -> float:
    """The layers below which both sides recorded every routing decision of the model as ids:
    their manifest's ``routing`` (``instrument``'s) says complete, and the first routed layer
    whose ids were filtered out (COMPILEDUMP_MOE_LAYERS) is this one (``math.inf``: none; 0 where
    a side cannot say). While every ids key agrees, no route before it can have flipped, and a
    decode step's key of an earlier layer needs no allowance for one: its state depends on the
    fed token and on its own and earlier layers' caches only (docs/compare.md, "Default
    thresholds"). A key of no layer (the logits) needs every layer's routing."""
    sides = [_unrecorded_routing(dump) for dump in (ref, run)]
    if None in sides:
        return 0
    return min(sides[0] + sides[1], default=math.inf)


def _unrecorded_routing(dump: Dump) -> list[int] | None:
    """The routed layers whose ids ``dump`` filtered out, or None when it cannot say that every
    routing decision was recorded otherwise: its manifest does not say so, or a routed layer the
    filter kept holds no ids (an engine's gate returns logits alone, its fused MoE picking the
    experts out of sight: vLLM's, SGLang's)."""
    manifest = dump.manifest or {}
    routing = manifest.get("routing")
    if not isinstance(routing, dict) or routing.get("complete") is not True:
        return None
    filtered = manifest.get("filtered_tags") or {}
    routed = [i for i in routing.get("routed") or [] if isinstance(i, int)]
    out = [i for i in routed if f"layer{i}_topk" in filtered or f"layer{i}_step_topk" in filtered]
    recorded = dump.members.keys() - getattr(dump, "derived", set())  # not ids derived from logits (picked.py)
    return None if any(i not in out and f"layer{i}_topk" not in recorded for i in routed) else out


def unrecorded_routing_note(ref: Dump, run: Dump) -> str | None:
    """What to set so that decode steps can be judged without the routing-flip allowance, when
    the only thing missing is routed layers the MoE layer filter left out."""
    sides = [_unrecorded_routing(dump) for dump in (ref, run)]
    if None in sides or not any(sides):
        return None
    layers = sorted(set(sides[0]) | set(sides[1]))
    return (f"decode steps' keys from layer {layers[0]} on (and their logits) are judged with the routing-flip "
            f"allowance of the decode-step defaults: the routing of layer(s) {preview([str(i) for i in layers], 4)} "
            f"is not recorded (COMPILEDUMP_MOE_LAYERS); with COMPILEDUMP_MOE_LAYERS={layers[-1] + 1} on both sides, "
            "steps before any differing expert ids are judged at the prefill thresholds, which catch a decode-only "
            "bug of a few percent")


def after_the_layers(key: str) -> bool:
    """Whether `key` (a key of no layer) comes after every layer: the final norm, the prompt's or a
    step's logits."""
    return key in ("final_norm", "logits") or (spec.split_step_key(key) or ("",))[0] == "logits"


def first_cautions(ref: Dump, run: Dump, key: str, layer: int | None, klass: str | None) -> list[tuple[str, str]]:
    """(note, caution) for a float first divergence `key` at `layer` in precision class `klass`
    that may be noise: after a hybrid model's recurrent layers or hyper-connection streams, after
    MoE layers whose routing is
    not recorded (the final norm and the logits come after every layer). Either side's manifest
    says so (an instrumented reference beside an engine's hand-written captures)."""
    found = []
    # The one a setting can remove first: the verdict line carries the first caution only
    at = math.inf if layer is None and after_the_layers(key) else layer
    if (note := unrecorded_flip_note(ref, run, at, klass)):
        found.append((note, "after MoE layers whose routing is not recorded (see the note)"))
    for note in (hybrid_note([ref.manifest, run.manifest], at, klass),
                 hyper_connection_note([ref.manifest, run.manifest], at, klass)):
        if note is not None:
            found.append((note, "after layers whose bf16 rounding can exceed the defaults (see the note)"))
    return found


def unrecorded_flip_note(ref: Dump, run: Dump, layer: float | None, klass: str | None) -> str | None:
    """A caution when a low-precision pair first diverges at or after (`layer`: math.inf for a key
    after every layer) an MoE layer whose expert ids the MoE layer filter left out, on either side
    that can say (an engine whose gates record logits alone cannot): a near-tie routing flip there
    moves the stream by as much as a small bug, and without the ids nothing can tell them apart."""
    filtered = set().union(*(known for dump in (ref, run) if (known := _unrecorded_routing(dump)) is not None))
    before = sorted(i for i in filtered if layer is not None and i <= layer)
    if klass in (None, "fp32") or not before:
        return None
    return (f"the first divergence ({_where(layer)}) is at or after MoE layer(s) {preview([str(i) for i in before], 4)} "
            f"whose expert ids are not recorded (COMPILEDUMP_MOE_LAYERS): in {klass} a near-tie routing flip there "
            "moves the stream as a small bug does, and cannot be told from one; set COMPILEDUMP_MOE_LAYERS="
            f"{max(filtered) + 1} on both sides to judge their routing")


def layer_steps_note(manifests: list, step: int | None, key: str) -> str | None:
    """Why a decode step's first divergence is named at a step key without a layer: the layers'
    states (`layer<N>_step_<n>`) were kept for the first COMPILEDUMP_LAYER_STEPS forwards only, and
    `step` is past them (on either side)."""
    cap = min((c for c in map(layer_steps_of, manifests) if c), default=None)  # (0: none kept)
    if step is None or cap is None or step < cap or key.startswith("layer"):
        return None
    return (f"each layer's state at a decode step is kept for the first {cap} forwards (COMPILEDUMP_LAYER_STEPS="
            f"{cap}, steps 0-{cap - 1}); step {step} is past them, so the layer where it first diverges is not "
            f"known: set COMPILEDUMP_LAYER_STEPS above {step} on both sides to name it")
