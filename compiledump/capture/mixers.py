"""The token mixer of each decoder layer `instrument()` tapped, and whether it recorded every
routing decision of the model, written into the manifest.

The comparator reads it to qualify a low-precision divergence in a hybrid model: bf16 rounding in
linear-attention and state-space layers can exceed the defaults calibrated on attention models
(docs/compare.md, "Hybrid models"). Kinds: "attention", "mlp" (a layer without token mixing:
Nemotron-H's MoE layers), or the non-attention mixer's name ("linear_attn", "mamba", "conv", or
the class name of a `self_attn`/`mixer` module that is not softmax attention).

`routing` (`{"routed": [layer indices], "complete": bool, "moe_outputs": [layer indices]}`) tells
the comparator whether every token-routing decision of the model is recorded as ids: the MoE
layers whose router instrument tapped, and `complete` false when some MoE block had no router it
could tap, a step's routing is not recorded (`step_routing=False`), or something else selects per
token (a sparse-attention indexer, attention heads routed as experts). With every decision
recorded and none differing, nothing can have flipped a route, and decode steps are judged at the
prefill thresholds (docs/compare.md, "Default thresholds"). `moe_outputs`: the layers whose
`layer<i>_mlp` is an MoE block's output, whose decode steps get the MoE output allowance.
"""

from __future__ import annotations

import re

import torch

from ..format.spec import MIXER_ATTENTION as ATTENTION, MIXER_NONE as NO_MIXING
from .state import STATE


# Words in a mixer's class name that say it is not softmax attention, though a model may name the
# child `self_attn` (Kimi-Linear's KimiLinearDeltaAttention, MiniMax's MiniMaxLightningAttention,
# Bailing's BailingHybridDeltaAttention) or `mixer` (Nemotron-H's NemotronHMamba2Mixer). They are
# looked for after the prefix every mixer class of the model shares (its name: "KimiLinear").
RECURRENT_WORDS = ("linear", "delta", "lightning", "mamba", "ssm", "retention", "rwkv", "recurrent")
_BY_CLASS = ("self_attn", "self_attention", "mixer", "attn", "attention", "cross_attn", "temporal_block",
             "norm_attn_norm",  # DBRX's attention between its norms
             "SelfAttention", "LocalSelfAttention", "TransientGlobalSelfAttention",  # T5's, LongT5's, in a sublayer
             "multi_head_attention")  # CTRL


def kinds_of(layers, names: list[str | None]) -> dict[int, str]:
    """{layer index: kind} for decoder `layers` whose token mixer is their child `names[i]` (one of
    instrument's MIXERS, or None): a child named for what it is (`linear_attn`, `mamba`, `conv`)
    is that; `self_attn`, `self_attention`, `attn`, `attention` and `mixer` are what their class says."""
    classes = {i: type(layer.get_submodule(name)).__name__ for i, (layer, name) in enumerate(zip(layers, names))
               if _leaf(name) in _BY_CLASS}
    distinct = sorted(set(classes.values()))
    shared = len(_common_prefix(distinct)) if len(distinct) > 1 else 0
    kinds = {}
    for i, (layer, name) in enumerate(zip(layers, names)):
        if name is None or _leaf(name) not in _BY_CLASS:
            kinds[i] = name or NO_MIXING
            continue
        kind = classes[i]
        words = kind[shared:].lower()
        mixer = layer.get_submodule(name)
        if name == "mixer" and (isinstance(getattr(mixer, "experts", None), torch.nn.Module)
                                or "mlp" in words or "moe" in words):
            kinds[i] = NO_MIXING  # Nemotron-H's MoE layers: one `mixer` per layer, its class says which
        elif "mamba" in words:
            kinds[i] = "mamba"
        elif any(word in words for word in RECURRENT_WORDS):
            kinds[i] = kind
        else:
            kinds[i] = ATTENTION if name != "mixer" or "attention" in words else kind
    return kinds


def _leaf(path: str | None) -> str | None:
    """A mixer's own name, without the sublayer it sits in (T5's `layer.0.SelfAttention`)."""
    return None if path is None else path.rpartition(".")[2]


def _common_prefix(names: list[str]) -> str:
    first, last = min(names), max(names)
    end = next((n for n, (a, b) in enumerate(zip(first, last)) if a != b), min(len(first), len(last)))
    return first[:end]


_LAYER_TOPK = re.compile(r"layer(\d+)_topk")


def routing_fact(taps, unrouted: bool, step_routing: bool, moe_outputs: list[int]) -> dict:
    """The manifest's `routing` from instrument's `taps`: the layers whose router is tapped, and
    whether that is every per-token selection of the model (no MoE block left `unrouted`, no other
    selection such as an indexer's picks, each step's routing recorded); `moe_outputs`, the layers
    whose `layer<i>_mlp` is an MoE block's output (the comparator's allowance for its steps)."""
    routed = sorted(int(match.group(1)) for tag in taps if (match := _LAYER_TOPK.fullmatch(tag)))
    other = [tag for tag in taps if tag.endswith("_topk") and not _LAYER_TOPK.fullmatch(tag)
             and not tag.endswith("_step_topk")]  # an indexer's picks, attention heads routed as experts
    return {"routed": routed, "complete": not unrouted and not other and (step_routing or not routed),
            "moe_outputs": sorted(moe_outputs)}


def declare_mixers(mixers: dict[int, str], routing: dict | None = None) -> None:
    """Record `{layer index: kind}` and the `routing` fact for the model being instrumented
    (replacing another's)."""
    with STATE.lock:
        STATE.mixers = {str(i): kind for i, kind in mixers.items()}
        STATE.routing = dict(routing or {})
        live = getattr(STATE.runtime, "live", None)
        if live is not None:
            journal_mixers(live)


def declare_exclude(patterns: list[str]) -> None:
    """Record the `instrument(exclude=...)` patterns of the model being instrumented (replacing
    another's): the comparator tells the keys they left out from keys missing for other reasons."""
    with STATE.lock:
        STATE.exclude = list(patterns)
        live = getattr(STATE.runtime, "live", None)
        if live is not None:
            journal_mixers(live)


def manifest_layers() -> dict:
    """The manifest's `mixers`, `routing` and `exclude`, those declared (copies: flush may run from
    a signal handler)."""
    return {name: type(value)(value) for name, value in (("mixers", STATE.mixers), ("routing", STATE.routing),
                                                           ("exclude", STATE.exclude)) if value}


def journal_mixers(live) -> None:
    """Journal what instrument() declared (mixers, routing, exclude) into crash-proof capture's
    `live` files (recover reads them)."""
    if declared := manifest_layers():
        live.write({"event": "mixers", **declared})
