"""Cautions on a first divergence that may be honest noise, and the notes that explain them: after
a hybrid model's recurrent layers or hyper-connection streams (whose low-precision rounding can
exceed the defaults), after MoE layers whose routing was not recorded (a routing flip nobody can
judge), past a layer step state's COMPILEDUMP_LAYER_STEPS. Each reads what the manifests say of
the model (`mixers`, `routing`, the keys' shapes, the filters); the verdict line carries the
first caution.
"""

from __future__ import annotations

import math

from ..format import spec
from ..format.reader import Dump, preview
from ..format.spec import NOT_RECURRENT_MIXERS
from .phases import layer_steps_of


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
