"""How many decode steps the arena keeps of a step tag (`record_step`'s `<tag>_<n>`).

Every step tag keeps COMPILEDUMP_MAX_STEPS steps; a layer's step states (`layer<N>_step` and its
sublayers', `layer<N>_attn_step`, `layer<N>_mlp_step`, `layer<N>_mixer_step`: format/spec.py) keep
the first COMPILEDUMP_LAYER_STEPS, where a decode-only bug first shows. The sublayers' states
together take at most an eighth of the arena: regions are claimed at a tag's first capture, in
model order, so without a bound an 80-layer, 8192-wide model's sublayer states (84 MB for 16
steps) would claim the room of the logits, which come last. Past the bound a layer's sublayer
states keep fewer steps or none (counted as `layer_steps`, warned once); its state
`layer<N>_step` still names the layer.
"""

from __future__ import annotations

from ..format import spec
from .state import warn_once

SUBLAYER_SHARE = 8  # the sublayers' step states take at most 1/SUBLAYER_SHARE of the arena


class StepBudget:
    """The step capacity of each step tag of one arena, in the order their regions are claimed."""

    def __init__(self, max_steps: int, layer_steps: int, arena_words: int, arena_mb: int) -> None:
        self.max_steps, self.layer_steps, self.arena_mb = max_steps, layer_steps, arena_mb
        self.sublayer_room = arena_words // SUBLAYER_SHARE  # words left to the sublayers' step states
        self.limited = False  # whether the share has limited a tag (warned once)

    def capacity(self, tag: str, step_words: int) -> tuple[int, str]:
        """(steps to keep of `tag`, whose steps are `step_words` words each; the drop reason of
        the steps past them)."""
        if not spec.stream_step_tag(tag) or not 0 < self.layer_steps < self.max_steps:
            return self.max_steps, "step_capacity"
        capacity = self.layer_steps
        if spec.sublayer_step_tag(tag):
            capacity = min(capacity, self.sublayer_room // max(step_words, 1))
            self.sublayer_room -= capacity * step_words
            if capacity < self.layer_steps and not self.limited:
                self.limited = True
                warn_once(f"the sublayers' decode-step states (layer<i>_attn_step, _mlp_step, ...) fill their share of "
                          f"the arena (an eighth of COMPILEDUMP_ARENA_MB={self.arena_mb}) from {tag!r} on: later "
                          f"layers keep fewer of their steps or none (their layer's state layer<i>_step still names "
                          "the layer; counted as layer_steps). Raise COMPILEDUMP_ARENA_MB to keep them")
        return capacity, "layer_steps"
