"""A router's declared selection: how it picks its experts from its logits.

``compiledump.declare_router`` (which ``compiledump.instrument`` calls for the routers it
recognises) writes one entry per router tag into the manifest's ``routers``; the comparator reads
it back to judge expert-id mismatches (docs/compare.md, "Expert ids and near ties"). A plain top-k
router needs none: the top-k of softmax(logits) or sigmoid(logits) are the top-k of the logits.
DeepSeek-V3's, and the routers built like it (Kimi K2, GLM-4.5, dots.llm1, ...), pick the top-k of
``sigmoid(logits) + bias`` inside the best expert groups, a group scoring the sum of its two best
scores; DeepSeek-V2's group-limited greedy top-k scores a group by its best softmax score. One set
of rules, here, checks both the declaration and the manifest entry read back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# How a router scores experts from its logits ("logits": the logits themselves, as Kolibri adds its
# bias to them); "token": it does not (DeepSeek-V4's hash routers take the experts from the token
# id, so no rounding of the logits can move them); "unknown": by a rule compiledump does not know
# (a bias it cannot place), so no gap of its logits judges a flip.
SCORES = ("softmax", "sigmoid", "sqrtsoftplus", "logits", "token", "unknown")
TOKEN, UNKNOWN = "token", "unknown"


@dataclass(frozen=True)
class RouterInfo:
    """How a router selects ``top_k`` experts from one row of logits.

    Choice scores are ``score(logits)`` (+ ``bias`` when given); with ``n_group`` > 1 the experts
    form ``n_group`` equal groups of consecutive ids, each scored by the sum of its best
    ``group_topk`` choice scores, and the top-k is taken inside the best ``topk_group`` groups.
    ``rounded``: the router computes its choice scores in the dtype of the logits it returns
    (DeepSeek-V4's ``score_fn(logits) + bias`` with no upcast), so a low-precision run rounds them.
    ``cut``: PhiMoE's sparsemixer, which picks the top-k of the logits but weighs each pick by a
    softmax over only the experts within a relative ``cut`` of its logit (compare/cut.py), so an
    expert that rounding moves across the cut changes the weights with the ids equal. ``capacity``:
    each expert takes at most a fixed number of a sequence's tokens and drops the rest (Switch
    Transformers), so a token routed elsewhere can drop, or spare, the later tokens of its sequence
    in the same layer: a flip reaches them (compare/flips.py)."""

    top_k: int
    score: str = "softmax"
    bias: tuple[float, ...] | None = None
    n_group: int = 1
    topk_group: int = 1
    group_topk: int = 2
    rounded: bool = False
    cut: float | None = None
    capacity: bool = False

    def __post_init__(self) -> None:
        for name in ("rounded", "capacity"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("top_k", "n_group", "topk_group", "group_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if self.score in (TOKEN, UNKNOWN) and (self.bias is not None or self.n_group > 1):
            raise ValueError(f"a router of score {self.score!r} has no bias and no groups")
        if self.cut is not None:
            if not isinstance(self.cut, float) or not math.isfinite(self.cut) or self.cut <= 0:
                raise ValueError(f"cut must be a positive finite float, got {self.cut!r}")
            if self.score != "softmax" or self.bias is not None or self.n_group > 1:
                raise ValueError("a cut (PhiMoE's sparsemixer) weighs the top-k of the logits: score 'softmax', "
                                 "no bias, no groups")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) is more than n_group ({self.n_group})")
        if self.bias is not None:
            if not self.bias or not all(isinstance(b, float) and math.isfinite(b) for b in self.bias):
                raise ValueError("bias must be a non-empty sequence of finite floats, one per expert")
            if len(self.bias) % self.n_group:
                raise ValueError(f"{len(self.bias)} experts (the bias's length) do not form {self.n_group} "
                                 "equal groups")

    @property
    def plain(self) -> bool:
        """Its top-k is the top-k of the logits (no bias that moves them, one group)."""
        return self.score not in (TOKEN, UNKNOWN) and self.n_group == 1 and (self.bias is None or not any(self.bias))

    def fits(self, experts: int) -> str | None:
        """Why this selection cannot apply to ``experts`` logits, or None."""
        if self.bias is not None and len(self.bias) != experts:
            return f"its bias holds {len(self.bias)} experts, the logits {experts}"
        if experts % self.n_group:
            return f"{experts} experts do not form {self.n_group} equal groups"
        if self.top_k > experts // self.n_group * self.topk_group:
            return f"top-{self.top_k} does not fit in {self.topk_group} groups of {experts // self.n_group}"
        if self.n_group > 1 and self.group_topk > experts // self.n_group:
            return f"a group's score sums its best {self.group_topk}, but a group holds {experts // self.n_group}"
        return None

    def describe(self) -> str:
        """``top-8 of sigmoid + bias in the best 4 of 8 groups``."""
        if self.score == TOKEN:
            return f"{self.top_k} experts per token id (hash routing)"
        if self.score == UNKNOWN:
            return f"top-{self.top_k} by a rule compiledump does not know"
        text = f"top-{self.top_k} of {self.score}" + (" + bias" if self.bias is not None else "")
        if self.n_group > 1:
            text += f" in the best {self.topk_group} of {self.n_group} groups"
        if self.cut is not None:
            text += f", each pick weighed over the experts within a relative cut of {self.cut:g} (sparsemixer)"
        text += ", scores rounded in the model's dtype" if self.rounded else ""
        return text + (", each expert's tokens capped (the rest dropped)" if self.capacity else "")

    def to_json(self) -> dict:
        return {"top_k": self.top_k, "score": self.score, "bias": None if self.bias is None else list(self.bias),
                "n_group": self.n_group, "topk_group": self.topk_group, "group_topk": self.group_topk,
                **({"rounded": True} if self.rounded else {}),  # absent when False: manifests as before
                **({"cut": self.cut} if self.cut is not None else {}),
                **({"capacity": True} if self.capacity else {})}


def router_from_json(entry) -> RouterInfo | None:
    """The manifest entry ``entry`` read back, or None when it is not a valid one."""
    if not isinstance(entry, dict):
        return None
    bias = entry.get("bias")
    try:
        return RouterInfo(top_k=entry.get("top_k"), score=entry.get("score", "softmax"),
                          bias=None if bias is None else tuple(float(b) if isinstance(b, (int, float))
                                                               and not isinstance(b, bool) else b for b in bias),
                          n_group=entry.get("n_group", 1), topk_group=entry.get("topk_group", 1),
                          group_topk=entry.get("group_topk", 2), rounded=entry.get("rounded", False),
                          cut=entry.get("cut"), capacity=entry.get("capacity", False))
    except (TypeError, ValueError):
        return None


STEP_ROUTER = "_step_router"  # a decode step's router tag: layer3_step_router beside layer3_router


def declared_router(routers, tag: str) -> RouterInfo | None:
    """The declaration for router tag ``tag`` in a manifest's ``routers`` (a decode step's tag
    ``layer3_step_router`` falls back to its layer's ``layer3_router``), or None."""
    if not isinstance(routers, dict):
        return None
    if tag in routers:
        return router_from_json(routers[tag])
    if tag.endswith(STEP_ROUTER):
        return router_from_json(routers.get(tag[: -len(STEP_ROUTER)] + "_router"))
    return None


def captured_routers(declared: dict[str, dict], tags: dict[str, dict]) -> dict[str, dict]:
    """The manifest's ``routers``: the entries of ``declared`` ({tag: entry}) whose router tag,
    or its decode steps' tag, was captured (is the ``tag`` of an entry of the manifest's ``tags``)."""
    captured = {entry["tag"] for entry in tags.values()}
    return {tag: entry for tag, entry in declared.items()
            if tag in captured or tag.removesuffix("_router") + STEP_ROUTER in captured}
