"""The comparison's settings: thresholds and the near-tie rule for argmax flips."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .metrics import CHUNK_ELEMENTS, bf16_spacing

# rel_diff above this is a divergence. 1e-3 is the convention of DeepGEMM's `calc_diff` tests and
# SGLang's dump comparator; docs/compare.md has the measurements behind it for bf16 vs fp32.
DEFAULT_THRESHOLD = 1e-3
# An argmax flip is a near-tie when the reference top-1/top-2 margin is below this many bf16
# spacings of the reference top-1 logit (bf16 output rounding alone moves a margin by up to one).
DEFAULT_NEAR_TIE_ULPS = 4.0


@dataclass
class CompareOptions:
    """Thresholds and classification settings for a comparison."""

    threshold: float = DEFAULT_THRESHOLD
    # (regex, threshold) from --threshold-for; the last pattern that matches a key wins.
    overrides: list[tuple[str, float]] = field(default_factory=list)
    # Fixed near-tie epsilon in logit units; None means near_tie_ulps bf16 spacings of the top-1.
    near_tie: float | None = None
    near_tie_ulps: float = DEFAULT_NEAR_TIE_ULPS
    chunk_elements: int = CHUNK_ELEMENTS

    def threshold_for(self, key: str) -> float:
        """The rel_diff threshold that applies to ``key``."""
        value = self.threshold
        for pattern, override in self.overrides:
            if re.search(pattern, key):
                value = override
        return value

    def near_tie_epsilon(self, top1_ref: float) -> float:
        """Reference margin below which an argmax flip is a near-tie."""
        if self.near_tie is not None:
            return self.near_tie
        return self.near_tie_ulps * bf16_spacing(top1_ref)
