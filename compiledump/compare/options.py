"""The comparison's settings: thresholds per precision class, the key renames of ``--map`` and
the near-tie rule for argmax flips."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..format import spec
from .metrics import CHUNK_ELEMENTS, bf16_spacing

# Default (rel_diff, norm_diff) thresholds by precision class: the lower precision of the two
# sides' source dtypes (manifest keys[k].source_dtype). Measured with benchmarks/calibrate.py;
# docs/compare.md ("Default thresholds") has the measurements and the reasoning.
DEFAULT_THRESHOLDS: dict[str, tuple[float, float]] = {
    "fp32": (1e-8, 1e-5),
    "fp16": (1e-4, 1e-2),
    "bf16": (2e-3, 3e-2),
    "fp8": (1e-2, 1e-1),
    # A side without a known source dtype (a file without a manifest, most often debug_dump.py on
    # a large bf16 model): rel_diff keeps the 1e-3 of DeepGEMM's `calc_diff` tests and SGLang's
    # dump comparator, the default of every earlier version.
    "legacy": (1e-3, 2e-2),
}
# Decode step keys (manifest kind "step": the logits of each decode step) of the low-precision
# classes use their own defaults: a routing flip of the decoded token in some MoE layer, which no
# dump shows (expert ids are recorded for the prompt only), moves a step's logits by up to 8e-2 in
# rel_diff and 2e-2 in norm_diff in the calibration, far above rounding noise (docs/compare.md).
# fp32 has no such flips and keeps DEFAULT_THRESHOLDS for every key.
DEFAULT_STEP_THRESHOLDS: dict[str, tuple[float, float]] = {
    "fp16": (2e-1, 5e-2),
    "bf16": (2e-1, 5e-2),
    "fp8": (2e-1, 1e-1),
    "legacy": (2e-1, 5e-2),
}


# A decoder layer's state at a decode step (`layer<N>_step_<n>`) that a routing flip may have
# reached: a flip moves the residual stream itself more than it moves the logits (norm_diff up to
# 4.6e-2 in bf16 and 4.4e-2 in fp16 in the calibration, the logits 2.1e-2), so its norm_diff
# allowance is twice theirs.
DEFAULT_LAYER_STEP_NORM = 1e-1
DECODE_LAYER = "decode_layer"

# An MoE block's output at a decode step (`layer<N>_mlp_step_<n>` of a layer in the manifest's
# `routing.moe_outputs`; not Gemma 4's dense `mlp` beside its router) is no residual
# stream: the gate weights move with the router logits (more near a tie, whether or not an expert
# flips) and nothing dilutes them. In the calibration it came closest to the allowance of every key
# (bf16/fp16 after a flip: rel_diff 1.7e-1 against 2e-1, norm_diff 9.6e-2 against 1e-1; bf16 with
# no flip norm_diff 2.4e-2 against 3e-2), so it gets twice its phase's thresholds in the
# low-precision classes.
MOE_STEP_FACTOR = 2.0

# The phase of a decode step that no routing flip can have reached: every routing decision of the
# model recorded on both sides, and every ids key so far equal.
DECODE_NO_FLIP = "decode_no_flip"


def phase_thresholds(klass: str, phase: str = "prefill") -> tuple[float, float]:
    """The default (rel_diff, norm_diff) of precision class ``klass`` for a key of ``phase``
    (``prefill``: every key but the decode steps; ``decode``: step keys; ``decode_layer``: a
    layer's step state, ``layer<N>_step_<n>``)."""
    if phase == DECODE_LAYER and klass in DEFAULT_STEP_THRESHOLDS:
        rel, norm = DEFAULT_STEP_THRESHOLDS[klass]
        return rel, max(norm, DEFAULT_LAYER_STEP_NORM)
    if phase == "decode" and klass in DEFAULT_STEP_THRESHOLDS:
        return DEFAULT_STEP_THRESHOLDS[klass]
    return DEFAULT_THRESHOLDS[klass]


# rel_diff threshold of the legacy class (and the value --threshold had as its default before
# thresholds followed the data).
DEFAULT_THRESHOLD = DEFAULT_THRESHOLDS["legacy"][0]
# An argmax flip is a near-tie when the reference top-1/top-2 margin is below this many bf16
# spacings of the reference top-1 logit (bf16 output rounding alone moves a margin by up to one).
DEFAULT_NEAR_TIE_ULPS = 4.0

# Precision classes from lowest to highest; a pair takes the lower of its two sides'.
PRECISION_ORDER = ("fp8", "bf16", "fp16", "fp32")
_DTYPE_CLASS = {"float64": "fp32", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def precision_class(source_dtype: str | None) -> str | None:
    """The precision class of a torch dtype name (``float32``, ``bfloat16``, ``float8_e4m3fn``,
    ...), or None for an unknown, missing or integer dtype."""
    if not isinstance(source_dtype, str):
        return None
    name = source_dtype.removeprefix("torch.")
    if name.startswith("float8"):
        return "fp8"
    return _DTYPE_CLASS.get(name)


def pair_class(ref_dtype: str | None, run_dtype: str | None) -> str:
    """The class whose defaults a pair of source dtypes uses: the lower precision of the two,
    ``legacy`` when either side's dtype is unknown."""
    classes = [precision_class(ref_dtype), precision_class(run_dtype)]
    if None in classes:
        return "legacy"
    return min(classes, key=PRECISION_ORDER.index)


def judged_class(klass: str, computes_in: str | None) -> str:
    """The class a key of class ``klass`` is judged in, in a pair of dumps that computes in
    ``computes_in`` (measure.float_class: its float keys' lowest class). A float32 key takes that
    class: a float32 value computed from bfloat16 ones (a router or logits the model upcasts)
    carries their rounding, not float32's. Low-precision keys keep their own (a bf16 key beside an
    fp8 one is not loosened to fp8)."""
    if klass == "fp32" and computes_in in PRECISION_ORDER:
        return computes_in
    return klass


@dataclass(frozen=True)
class Thresholds:
    """The thresholds one key is judged by, and where they come from."""

    rel_diff: float
    norm_diff: float
    klass: str  # the precision class of the pair (fp32, fp16, bf16, fp8, legacy)
    rel_source: str  # calibrated | legacy (+ " decode" for step keys) | --threshold | --threshold-for <regex>
    norm_source: str  # calibrated | legacy (+ " decode" for step keys) | --norm-threshold

    def ratio(self, rel_diff: float | None, norm_diff: float | None) -> tuple[float, str]:
        """The larger of value/threshold over both metrics, and that metric's name."""
        rel = _ratio(rel_diff, self.rel_diff)
        norm = _ratio(norm_diff, self.norm_diff)
        return (rel, "rel_diff") if rel >= norm else (norm, "norm_diff")


def _ratio(value: float | None, threshold: float) -> float:
    if value is None or not value > 0:
        return 0.0
    return value / threshold if threshold > 0 else math.inf


@dataclass
class CompareOptions:
    """Thresholds, renames and classification settings for a comparison."""

    # --threshold: rel_diff threshold for every key; None: the pair's precision-class default.
    threshold: float | None = None
    # (regex, threshold) from --threshold-for; the last pattern that matches a key wins.
    overrides: list[tuple[str, float]] = field(default_factory=list)
    # --norm-threshold: norm_diff threshold for every key; None: the precision-class default.
    norm_threshold: float | None = None
    # (pattern, replacement) from --map, applied in order with re.sub to every RUN key.
    maps: list[tuple[str, str]] = field(default_factory=list)
    # Fixed near-tie epsilon in logit units; None means near_tie_ulps bf16 spacings of the top-1.
    near_tie: float | None = None
    near_tie_ulps: float = DEFAULT_NEAR_TIE_ULPS
    chunk_elements: int = CHUNK_ELEMENTS

    def thresholds_for(self, key: str, ref_dtype: str | None = None, run_dtype: str | None = None,
                       phase: str = "prefill", computes_in: str | None = None, moe_output: bool = False) -> Thresholds:
        """The thresholds of ``key`` (of ``phase``: ``decode`` for step keys) whose sides' source
        dtypes are ``ref_dtype`` and ``run_dtype``, in a pair of dumps whose float keys say they
        compute in precision class ``computes_in`` (``judged_class``); ``moe_output``: the key is an
        MoE block's output (MOE_STEP_FACTOR at a decode step)."""
        klass = judged_class(pair_class(ref_dtype, run_dtype), computes_in)
        origin = "legacy" if klass == "legacy" else "calibrated"
        if phase == DECODE_NO_FLIP:
            # A step before any differing ids, every routing decision recorded: no allowance for a
            # routing flip is needed, so the prefill defaults apply (compare/cautions.py routing_recorded_below).
            default_rel, default_norm = phase_thresholds(klass, "prefill")
            if klass in DEFAULT_STEP_THRESHOLDS:
                origin += " decode, no routing flip"
        else:
            if phase == "decode" and spec.stream_step_key(key):
                phase = DECODE_LAYER
            default_rel, default_norm = phase_thresholds(klass, phase)
            if phase in ("decode", DECODE_LAYER) and klass in DEFAULT_STEP_THRESHOLDS:
                origin += " decode" if phase == "decode" else " decode, layer state"
        if moe_output and phase != "prefill" and klass in DEFAULT_STEP_THRESHOLDS:
            default_rel, default_norm = default_rel * MOE_STEP_FACTOR, default_norm * MOE_STEP_FACTOR
            origin += ", MoE output"
        rel, rel_source = default_rel, origin
        if self.threshold is not None:
            rel, rel_source = self.threshold, "--threshold"
        for pattern, override in self.overrides:
            if re.search(pattern, key):
                rel, rel_source = override, f"--threshold-for {pattern}"
        norm, norm_source = default_norm, origin
        if self.norm_threshold is not None:
            norm, norm_source = self.norm_threshold, "--norm-threshold"
        return Thresholds(rel, norm, klass, rel_source, norm_source)

    def threshold_for(self, key: str, ref_dtype: str | None = None, run_dtype: str | None = None) -> float:
        """The rel_diff threshold that applies to ``key``."""
        return self.thresholds_for(key, ref_dtype, run_dtype).rel_diff

    def near_tie_epsilon(self, top1_ref: float) -> float:
        """Reference margin below which an argmax flip is a near-tie."""
        if self.near_tie is not None:
            return self.near_tie
        return self.near_tie_ulps * bf16_spacing(top1_ref)
