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


# Routers without expert groups that pick the top-k of sigmoid(logits) + bias (the bias on the
# router or on its MoE block: BIAS_NAMES), read from their Hugging Face code.
SIGMOID_BIAS_ROUTERS = ("MiniMaxM2TopKRouter", "Step3p7TopKRouter", "HYV3TopKRouter", "LagunaTopKRouter",
                        "MuseSparkTopkRouter", "Lfm2MoeTopKRouter", "AfmoeTokenChoiceRouter", "AXK2TopkRouter",
                        "ErgoTopkRouter", "MiniMaxM3VLTopKRouter")
# Those that pick the top-k of softmax(logits) + the bias (LongCat-Flash's over its zero-computation
# experts too; Ernie 4.5's bias in the router's `moe_statics`, shaped [1, experts]).
SOFTMAX_BIAS_ROUTERS = ("LongcatFlashTopkRouter", "Ernie4_5_MoeTopKRouter")
# Those that pick the top-k of the logits + the bias themselves (Kolibri; sigmoid weights the chosen).
LOGITS_BIAS_ROUTERS = ("Kolibri1TopKRouter", "Kolibri1_1TopKRouter")
# Routers that score with their `score_fn` module plus the bias (DeepSeek-V4: sqrt(softplus);
# Inkling 2: its config's scoring_func), by that module's class.
SCORE_FN_ROUTERS = ("DeepseekV4TopKRouter", "Inkling2TopKRouter", "Inkling2LoopTopKRouter")
_SCORE_FNS = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid", "SigmoidActivation": "sigmoid"}
# Routers that return bare logits, whose MoE block picks the top-k of their softmax in the logits'
# dtype and hands the picks to its experts (DBRX: `route_tokens_to_experts`). bf16 rounding ties
# near-equal probabilities there, so the block's picks can differ from the top-k of the logits: the
# ids are read where the experts receive them (router_taps.py), and the rule declared `rounded`.
EXPERTS_PICKED_ROUTERS = ("DbrxRouter",)
# Routers that return the experts they dispatch to as a one-hot mask [..., experts] first, the argmax
# of their float32 softmax cast to the model's dtype (Switch Transformers' top-1; a token past its
# expert's capacity in the sequence gets an all-zero row: dropped), then the probability, then the
# logits. Declared `rounded` (the cast ties near-equal probabilities in bf16) and `capacity`.
ONE_HOT_ROUTERS = ("SwitchTransformersTop1Router",)
# Those that compute their choice scores in the dtype of the logits they return, with no upcast
# (DeepSeek-V4's `score_fn(logits) + bias`, LFM2-MoE's `sigmoid(logits) + expert_bias` on the bf16
# logits of a bf16 model, DBRX's softmax), declared `rounded` (the others upcast to float32 first).
ROUNDED_SCORE_ROUTERS = ("DeepseekV4TopKRouter", "Lfm2MoeTopKRouter", *EXPERTS_PICKED_ROUTERS, *ONE_HOT_ROUTERS)
# Routers with expert groups and no bias that keep the groups with the best sums of two softmax
# scores (Mistral 4 and Mistral Large 4's text model).
GROUPED_SOFTMAX_ROUTERS = ("Mistral4TopkRouter", "MistralLarge4TextTopkRouter")
# Routers whose first output is softmax probabilities instead of logits (Gemma 4, DiffusionGemma);
# instrument records their log, which is the logits up to a per-row constant.
PROBABILITY_ROUTERS = ("Gemma4TextRouter", "DiffusionGemmaTextRouter")
# Routers that hold a token-id -> experts table (DeepSeek-V4's hash routers).
TOKEN_TABLES = ("tid2eid",)
# Top-k of the logits, each pick weighed over the experts within 2 * router_jitter_noise of it (sparsemixer).
CUT_ROUTERS = ("PhimoeTopKRouter",)
# Where the per-expert selection bias lives, on the router, its MoE block or Ernie's moe_statics.
BIAS_NAMES = ("e_score_correction_bias", "expert_bias")


def selection_of(block: torch.nn.Module, router: torch.nn.Module) -> dict | None:
    """How a router that is not a plain top-k of its logits selects experts, as
    `declare_router` takes it; None for plain top-k, and for routers whose rule is not known here.
    Hugging Face's DeepSeek-V3 family (DeepSeek-V3, Kimi K2, GLM-4.5, dots.llm1, MiMo, Nemotron-H:
    `num_group`/`n_group`, `topk_group` and an `e_score_correction_bias`, sigmoid scores) takes
    the top-k of sigmoid(logits) + bias in the best `topk_group` of `n_group` groups, each scored
    by its two best; MiniMax-M2, Step 3.7, Hunyuan V3, Laguna, MuseSpark, LFM2-MoE, AFMoE and
    A.X-K2-Light (SIGMOID_BIAS_ROUTERS) the top-k of sigmoid(logits) + bias over every expert; LongCat-Flash
    and Ernie 4.5 (SOFTMAX_BIAS_ROUTERS) the top-k of softmax(logits) + bias; Kolibri
    (LOGITS_BIAS_ROUTERS) the top-k of logits + bias; DeepSeek-V4's and Inkling 2's
    (SCORE_FN_ROUTERS) the top-k of their score_fn(logits) + bias, and DeepSeek-V4's hash routers
    (a `tid2eid` table) as routing by token id; DeepSeek-V2's `group_limited_greedy` the top-k of
    softmax(logits) in the groups with the best single scores, Mistral 4's
    (GROUPED_SOFTMAX_ROUTERS) in the groups with the best two. DeepSeek-V4's and LFM2-MoE's
    and DBRX's softmax (ROUNDED_SCORE_ROUTERS) and Switch Transformers' top-1 of a softmax
    (ONE_HOT_ROUTERS) are declared `rounded`; PhiMoE's (CUT_ROUTERS) with the `cut` of its
    sparsemixer, 2 * `router_jitter_noise`. Other routers with a bias, or with expert
    groups, are declared of score "unknown" (their flips are not judged), with one warning per
    class."""
    selection = _rule(block, router)
    jitter = getattr(router, "router_jitter_noise", None)
    if type(router).__name__ in CUT_ROUTERS and selection is None and isinstance(jitter, (int, float)) and jitter > 0:
        top_k = int_attr((block, router), ("top_k", "num_experts_per_tok"))
        return dict(top_k=top_k, score="softmax", cut=2.0 * float(jitter)) if top_k is not None else None
    if selection is not None and type(router).__name__ in ROUNDED_SCORE_ROUTERS:
        selection["rounded"] = True
    return selection


def _rule(block: torch.nn.Module, router: torch.nn.Module) -> dict | None:
    """`selection_of` without the `rounded` flag."""
    if type(router).__name__ in ONE_HOT_ROUTERS:
        return dict(top_k=1, score="softmax", capacity=True)
    top_k = int_attr((block, router), ("top_k", "num_experts_per_tok"))
    if top_k is None:
        return None
    if any(isinstance(getattr(router, name, None), torch.Tensor) for name in TOKEN_TABLES):
        return dict(top_k=top_k, score="token")
    kind = type(router).__name__
    holders = (router, block, getattr(router, "moe_statics", None))
    bias_name, bias = next(((name, getattr(m, name)) for m in holders for name in BIAS_NAMES
                            if isinstance(getattr(m, name, None), torch.Tensor)), (None, None))
    n_group = int_attr((router, block), ("num_group", "n_group"))
    topk_group = int_attr((router, block), ("topk_group",))
    scoring = next((getattr(m, name) for m in (router, block) for name in ("scoring_func", "score_fn")
                    if isinstance(getattr(m, name, None), str)), "sigmoid")
    if n_group is not None and topk_group is not None:
        groups = dict(top_k=top_k, n_group=n_group, topk_group=topk_group)
        if bias is not None and scoring == "sigmoid":
            return _with_bias(dict(score="sigmoid", group_topk=2, **groups), bias)
        if bias is None and n_group > 1 and getattr(router, "topk_method", None) == "group_limited_greedy":
            return dict(score="softmax", group_topk=1, **groups)
        if bias is None and n_group > 1 and kind in GROUPED_SOFTMAX_ROUTERS:
            return dict(score="softmax", group_topk=2, **groups)
    elif bias is None and kind in EXPERTS_PICKED_ROUTERS:
        return dict(top_k=top_k, score="softmax")
    elif bias is not None and kind in SIGMOID_BIAS_ROUTERS:
        return _with_bias(dict(top_k=top_k, score="sigmoid"), bias)
    elif bias is not None and kind in SOFTMAX_BIAS_ROUTERS:
        return _with_bias(dict(top_k=top_k, score="softmax"), bias)
    elif bias is not None and kind in LOGITS_BIAS_ROUTERS:
        return _with_bias(dict(top_k=top_k, score="logits"), bias)
    elif bias is not None and kind in SCORE_FN_ROUTERS \
            and type(getattr(router, "score_fn", None)).__name__ in _SCORE_FNS:
        return _with_bias(dict(top_k=top_k, score=_SCORE_FNS[type(router.score_fn).__name__]), bias)
    if getattr(router, "topk_method", None) != "greedy" \
            and _warn_unknown_rule(kind, bias_name, holders, n_group, topk_group):  # DeepSeek-V2's greedy: no groups
        return dict(top_k=top_k, score="unknown")  # its flips are reported not judged, not judged by its logits
    return None


def _warn_unknown_rule(kind: str, bias_name: str | None, holders, n_group: int | None,
                       topk_group: int | None) -> bool:
    """Warn once per router class whose selection may not be the top-k of its logits: a known
    bias it adds in a way not listed above, another per-expert bias buffer (ZAYA's
    `balancing_biases`), or expert groups that matter; True when it is such a router. Its flips
    are then reported not judged (declared with score "unknown": the reference's ids may agree
    with the top-k of its logits in every row by chance, which would not make those gaps judge)."""
    if bias_name is not None:
        what = f"adds an {bias_name}"
    elif n_group is not None and topk_group is not None and topk_group < n_group:
        what = f"selects inside the best {topk_group} of {n_group} expert groups"
    else:
        other = sorted({name for m in holders if m is not None
                        for name, _ in [*m.named_buffers(recurse=False), *m.named_parameters(recurse=False)]
                        if "bias" in name and name != "bias"})
        if not other:
            return False
        what = f"holds {', '.join(other)}"
    warn_once(f"instrument: {kind} {what} in a way compiledump does not know, so its expert ids may not be the "
              "top-k of its logits and compare cannot judge their flips (reported as not judged); if its rule is "
              "the top-k of sigmoid, softmax or raw scores plus a bias, in expert groups or not, call "
              "compiledump.declare_router('layer<i>_router', ...) for each MoE layer")
    return True


def _with_bias(selection: dict, bias: torch.Tensor) -> dict | None:
    if bias.is_meta:  # weights not loaded yet (init_empty_weights, offloading)
        warn_once("instrument: a router's e_score_correction_bias is on the meta device, so its selection "
                  "is not declared and its expert-id flips cannot be judged; call instrument() after the "
                  "weights are loaded")
        return None
    return {**selection, "bias": bias.reshape(-1)}  # Ernie 4.5 keeps it as [1, experts]
