"""Which Hugging Face routers select their experts how: `selection_of(block, router)` reads a
router's rule from its class and attributes, as `declare_router` takes it (None for a plain top-k
of its logits). `instrument()` declares what this finds; a rule not listed here is not guessed
(a router with a bias it cannot place is warned about, and its flips stay "not judged").
"""

from __future__ import annotations

import torch

from .state import warn_once


def int_attr(modules, names: tuple[str, ...]) -> int | None:
    """The first int attribute among ``names`` of ``modules``, or None."""
    return next((getattr(m, name) for m in modules for name in names if isinstance(getattr(m, name, None), int)), None)


# Routers without expert groups that pick the top-k of sigmoid(logits) + e_score_correction_bias
# (the bias on the router or on its MoE block), read from their Hugging Face code.
SIGMOID_BIAS_ROUTERS = ("MiniMaxM2TopKRouter", "Step3p7TopKRouter", "HYV3TopKRouter")
# Those that pick the top-k of softmax(logits) + the bias (LongCat-Flash's over its zero-computation
# experts too; Ernie 4.5's bias in the router's `moe_statics`, shaped [1, experts]).
SOFTMAX_BIAS_ROUTERS = ("LongcatFlashTopkRouter", "Ernie4_5_MoeTopKRouter")
# Routers that score with their `score_fn` module plus the bias (DeepSeek-V4: sqrt(softplus)), by
# that module's class; routers that hold a token-id -> experts table (DeepSeek-V4's hash routers).
SCORE_FN_ROUTERS = ("DeepseekV4TopKRouter",)
_SCORE_FNS = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid"}
TOKEN_TABLES = ("tid2eid",)


def selection_of(block: torch.nn.Module, router: torch.nn.Module) -> dict | None:
    """How a router that is not a plain top-k of its logits selects experts, as
    `declare_router` takes it; None for plain top-k, and for routers whose rule is not known here.
    Hugging Face's DeepSeek-V3 family (DeepSeek-V3, Kimi K2, GLM-4.5, dots.llm1, MiMo, Nemotron-H:
    `num_group`/`n_group`, `topk_group` and an `e_score_correction_bias`, sigmoid scores) takes
    the top-k of sigmoid(logits) + bias in the best `topk_group` of `n_group` groups, each scored
    by its two best; MiniMax-M2, Step 3.7 and Hunyuan V3 (SIGMOID_BIAS_ROUTERS) the top-k of
    sigmoid(logits) + bias over every expert; LongCat-Flash and Ernie 4.5 (SOFTMAX_BIAS_ROUTERS)
    the top-k of softmax(logits) + bias; DeepSeek-V4's (SCORE_FN_ROUTERS) the top-k of its
    score_fn(logits) + bias, and its hash routers (a `tid2eid` table) as routing by token id;
    DeepSeek-V2's `group_limited_greedy` the top-k of softmax(logits) in the groups with the
    best single scores. Other routers with a bias are not declared: their flips stay not judged."""
    top_k = int_attr((block, router), ("top_k", "num_experts_per_tok"))
    if top_k is None:
        return None
    if any(isinstance(getattr(router, name, None), torch.Tensor) for name in TOKEN_TABLES):
        return dict(top_k=top_k, score="token")
    holders = (router, block, getattr(router, "moe_statics", None))
    bias = next((getattr(m, "e_score_correction_bias") for m in holders
                 if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)), None)
    n_group = int_attr((router, block), ("num_group", "n_group"))
    topk_group = int_attr((router, block), ("topk_group",))
    scoring = next((getattr(m, name) for m in (router, block) for name in ("scoring_func", "score_fn")
                    if isinstance(getattr(m, name, None), str)), "sigmoid")
    if n_group is not None and topk_group is not None:
        groups = dict(top_k=top_k, n_group=n_group, topk_group=topk_group)
        if bias is not None and scoring == "sigmoid":
            return _with_bias(dict(score="sigmoid", group_topk=2, **groups), bias)
        if bias is None and getattr(router, "topk_method", None) == "group_limited_greedy" and n_group > 1:
            return dict(score="softmax", group_topk=1, **groups)
    elif bias is not None and type(router).__name__ in SIGMOID_BIAS_ROUTERS:
        return _with_bias(dict(top_k=top_k, score="sigmoid"), bias)
    elif bias is not None and type(router).__name__ in SOFTMAX_BIAS_ROUTERS:
        return _with_bias(dict(top_k=top_k, score="softmax"), bias)
    elif bias is not None and type(router).__name__ in SCORE_FN_ROUTERS \
            and type(getattr(router, "score_fn", None)).__name__ in _SCORE_FNS:
        return _with_bias(dict(top_k=top_k, score=_SCORE_FNS[type(router.score_fn).__name__]), bias)
    if bias is not None:
        warn_once(f"instrument: {type(router).__name__} adds an e_score_correction_bias in a way compiledump "
                  "does not know, so compare cannot judge its expert-id flips (they are reported as not judged); "
                  "if its rule is the top-k of sigmoid or softmax scores plus the bias, in expert groups or not, "
                  "call compiledump.declare_router('layer<i>_router', ...) for each MoE layer")
    return None


def _with_bias(selection: dict, bias: torch.Tensor) -> dict | None:
    if bias.is_meta:  # weights not loaded yet (init_empty_weights, offloading)
        warn_once("instrument: a router's e_score_correction_bias is on the meta device, so its selection "
                  "is not declared and its expert-id flips cannot be judged; call instrument() after the "
                  "weights are loaded")
        return None
    return {**selection, "bias": bias.reshape(-1)}  # Ernie 4.5 keeps it as [1, experts]
