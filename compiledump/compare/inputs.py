"""Where the two sides fed their decode steps different tokens.

`instrument` records the token each forward feeds at the position whose logits it keeps
(``input_token_<n>``, beside ``logits_<n>``). A greedy decode loop feeds each side its own
argmax: after an argmax flip at step n-1 (a near tie in low precision, or a bug), step n and every
later step run on different inputs, and their values differ whatever the engine does. Those steps
are not comparable, which is what the verdict says instead of a divergence; the fix is to feed
the engine the reference's tokens (teacher forcing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..format.keys import KeyInfo
from ..format.reader import Dump

FED_TAG = "input_token"


@dataclass(frozen=True)
class FedTokens:
    """The first decode step whose fed token differs between the sides, and the two tokens;
    ``prompts_differ``: that step is the prompt's last position on both sides (step 0 of
    `instrument`'s steps), so the sides ran different prompts and no key of theirs can be compared."""

    step: int
    ref: int
    run: int
    prompts_differ: bool = False

    def reason(self) -> str:
        """Why a key is not compared (the table's note): a step key at or after ``step``; every
        key of sides fed different prompts."""
        if self.prompts_differ:
            return "the sides were fed different prompts (their last tokens differ)"
        return f"the sides fed different tokens from step {self.step}"

    def to_json(self) -> dict:
        return {"step": self.step, "ref": self.ref, "run": self.run, "prompts_differ": self.prompts_differ}


def first_fed_difference(ref: Dump, run: Dump, ordered: list[KeyInfo]) -> FedTokens | None:
    """The first step whose ``input_token`` both sides hold and that differs, or None."""
    steps = sorted((info.step, info.key) for info in ordered
                   if info.tag == FED_TAG and info.step is not None and info.key in ref.members
                   and info.key in run.members)
    for step, key in steps:
        x, y = (fed_token(dump, key) for dump in (ref, run))
        if x is not None and y is not None and x != y:
            return FedTokens(step, x, y, prompts_differ=step == 0 and both_instrumented(ref, run))
    return None


def fed_token(dump: Dump, key: str) -> int | None:
    """The fed token of ``key`` (one id), or None when it cannot be read as one."""
    try:
        values = np.asarray(dump.replicas(key)[0].whole()).reshape(-1)
    except (OSError, ValueError, KeyError):
        return None
    return int(values[0]) if values.size == 1 and np.isfinite(values[0]) else None


def step_zero_in_prompt(ref: Dump, run: Dump) -> bool:
    """Whether step 0 holds the prompt's last position: the steps count forwards, the prefill's
    first, as `instrument` records them (its manifests have `mixers`) or as a side that recorded
    the token its step 0 fed (``input_token_0``) did."""
    return any("mixers" in (dump.manifest or {}) or f"{FED_TAG}_0" in dump.members for dump in (ref, run))


def both_instrumented(ref: Dump, run: Dump) -> bool:
    """Whether both sides' steps are `instrument`'s (their manifests have `mixers`), whose step 0 is
    the prompt's forward: a hand-written `record_step` may start at the first decode step, where a
    prefill bug that changes the first token would read as different prompts."""
    return all("mixers" in (dump.manifest or {}) for dump in (ref, run))


def after_fed_difference(info: KeyInfo, fed: FedTokens | None) -> bool:
    """Whether ``info`` is a step key at or after the step where the fed tokens differ, or any key
    where the prompts differ (before, a DP rank that served another request was compared on its
    prompt keys: a false divergence at the first layer)."""
    if fed is not None and fed.prompts_differ:
        return True
    return fed is not None and info.kind == "step" and info.step is not None and info.step >= fed.step
