"""The token mixer of each decoder layer `instrument()` tapped, written into the manifest.

The comparator reads it to qualify a low-precision divergence in a hybrid model: bf16 rounding in
linear-attention and state-space layers can exceed the defaults calibrated on attention models
(docs/compare.md, "Hybrid models"). Kinds: "attention", "mlp" (a layer without token mixing:
Nemotron-H's MoE layers), or the non-attention mixer's name ("linear_attn", "mamba", "conv", or
a `mixer` module's class name).
"""

from __future__ import annotations

import torch

from .state import STATE

ATTENTION = "attention"
NO_MIXING = "mlp"
NOT_RECURRENT = (ATTENTION, NO_MIXING)


def kind_of(layer: torch.nn.Module, name: str | None) -> str:
    """The kind of `layer`'s token mixer, its child `name` (one of instrument's MIXERS, or None)."""
    if name in ("self_attn", "self_attention"):
        return ATTENTION
    if name != "mixer":
        return name or NO_MIXING
    mixer = layer.mixer  # Nemotron-H / Falcon-H1: one `mixer` per layer, its class says which
    kind = type(mixer).__name__
    if isinstance(getattr(mixer, "experts", None), torch.nn.Module) or "mlp" in kind.lower():
        return NO_MIXING
    return ATTENTION if "attention" in kind.lower() and "linear" not in kind.lower() else kind


def declare_mixers(mixers: dict[int, str]) -> None:
    """Record `{layer index: kind}` for the model being instrumented (replacing another's)."""
    with STATE.lock:
        STATE.mixers = {str(i): kind for i, kind in mixers.items()}
        live = getattr(STATE.runtime, "live", None)
        if live is not None:
            journal_mixers(live)


def manifest_mixers() -> dict[str, str]:
    """The manifest's `mixers` (a copy: flush may run from a signal handler)."""
    return dict(STATE.mixers)


def journal_mixers(live) -> None:
    """Journal the declared mixers into crash-proof capture's `live` files (recover reads them)."""
    if STATE.mixers:
        live.write({"event": "mixers", "mixers": dict(STATE.mixers)})
