"""`declare_router`: how a router picks its experts, written into the dump for the comparator.

A plain top-k router (Qwen3-MoE, Mixtral, Llama 4) needs no declaration: its experts are the
top-k of its logits, which `layer<N>_router` holds. DeepSeek-V3's picks the top-k of
sigmoid(logits) plus a per-expert bias, inside its best expert groups: its ids are not the top-k
of its logits, and without this declaration the comparator cannot tell a routing flip of it from a
bug (docs/compare.md, "Expert ids and near ties"). `instrument()` declares the routers it
recognises; hand-written captures call this once, after the weights are loaded (the bias is read
then, so one host copy, outside any capture).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..format.routers import RouterInfo, captured_routers
from .state import STATE


def declare_router(tag: str, *, top_k: int, score: str = "softmax", bias: torch.Tensor | Sequence[float] | None = None,
                   n_group: int = 1, topk_group: int = 1, group_topk: int = 2, rounded: bool = False,
                   cut: float | None = None, capacity: bool = False) -> RouterInfo:
    """Declare how the router whose logits are recorded as `tag` (`layer3_router`; its decode
    steps' `layer3_step_router` follow it) selects `top_k` experts: by `score` ("softmax",
    "sigmoid", "sqrtsoftplus" (DeepSeek-V4's) or "logits" (the logits themselves)) of its
    logits, plus `bias` (one value per expert, e.g. DeepSeek-V3's `e_score_correction_bias`), inside the best `topk_group` of `n_group` equal groups of
    consecutive experts, each group scored by the sum of its best `group_topk` scores (2 in
    DeepSeek-V3; 1, its best score, in DeepSeek-V2). `score="token"` says that its experts follow
    the token id, not its logits (DeepSeek-V4's hash routers): any difference is a divergence;
    `score="unknown"` that its rule is none of these: no difference is judged by its logits.
    `rounded=True` says that it computes its choice scores in the dtype of the logits it returns
    (no upcast), so that a low-precision run's rounding of them is allowed for. `cut` declares
    PhiMoE's sparsemixer (`2 * router_jitter_noise`): the top-k of the logits, each pick weighed by a
    softmax over the experts e with (pick - e) / max(|e|, pick) <= cut, so that an expert rounding
    moves across that cut is judged as a near tie, not read as a divergence of the MoE output.
    `capacity=True` says each expert takes at most a fixed number of a sequence's tokens and drops
    the rest (Switch Transformers): a token's flip may drop or spare the later tokens of its
    sequence in the same layer, so their MoE outputs there are a consequence of it, not a bug.
    Raises ValueError for a declaration that
    cannot describe a router. The manifest's `routers` holds it (docs/format.md)."""
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"compiledump.declare_router: tag must be a non-empty string, got {tag!r}")
    if isinstance(bias, torch.Tensor):
        if bias.dim() != 1:
            raise ValueError(f"compiledump.declare_router({tag!r}): bias must be 1-D, got shape {list(bias.shape)}")
        if bias.is_meta:
            raise ValueError(f"compiledump.declare_router({tag!r}): bias is on the meta device; declare the router "
                             "after its weights are loaded")
        bias = bias.detach().to("cpu", torch.float64).tolist()
    try:
        info = RouterInfo(top_k=top_k, score=score, bias=None if bias is None else tuple(float(b) for b in bias),
                          n_group=n_group, topk_group=topk_group, group_topk=group_topk, rounded=rounded,
                          cut=None if cut is None else float(cut), capacity=capacity)
        misfit = None if info.bias is None else info.fits(len(info.bias))
        if misfit is not None:
            raise ValueError(misfit)
    except (TypeError, ValueError) as error:
        raise ValueError(f"compiledump.declare_router({tag!r}): {error}") from None
    with STATE.lock:
        STATE.routers[tag] = info
        live = getattr(STATE.runtime, "live", None)
        if live is not None:
            _journal(live, tag, info)
    return info


def manifest_routers(tags: dict[str, dict]) -> dict[str, dict]:
    """The declarations of the routers captured (the manifest's `tags`: their own tag or their
    decode steps'), as the manifest's `routers` holds them. Reads a copy: flush may run from a
    signal handler and must not wait for the registry lock."""
    return captured_routers({tag: info.to_json() for tag, info in dict(STATE.routers).items()}, tags)


def journal_routers(live) -> None:
    """Journal every declaration so far into crash-proof capture's `live` files (a runtime just
    created them), so that a recovered dump keeps them too."""
    for tag, info in dict(STATE.routers).items():
        _journal(live, tag, info)


def _journal(live, tag: str, info: RouterInfo) -> None:
    """One declaration as a journal event (capture/journal.py reads it back)."""
    live.write({"event": "router", "tag": tag, "router": info.to_json()})


def withdraw(tag: str) -> None:
    """Forget the declaration of router tag `tag`, if any (`instrument` on a model whose router
    there is a plain top-k, after another model's declaration)."""
    with STATE.lock:
        if STATE.routers.pop(tag, None) is not None:
            live = getattr(STATE.runtime, "live", None)
            if live is not None:  # recover: a dump of that process has no declaration for it
                live.write({"event": "router", "tag": tag, "router": None})
