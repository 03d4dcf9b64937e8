"""`capture/hf_routers.py` against transformers' own routers: for each router class it declares,
the declared rule (compare/selection.py) selects the experts that router selects, on random
logits and a random bias (routers built from a config with the identity as their weight, so the
hidden state fed in is the logits row; nothing is downloaded). Routers whose rule it does not
know are warned about, once per class, and declared of score "unknown"."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from compiledump.capture import hf_routers
from compiledump.capture.state import STATE
from compiledump.compare import selection
from compiledump.format.routers import RouterInfo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXPERTS, K = 16, 3


def _router(model: str, **extra):
    """(block, router, forward) of `model`'s router class with the identity as its weight."""
    import importlib
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    common = dict(hidden_size=EXPERTS, num_experts_per_tok=K, num_attention_heads=1, num_key_value_heads=1)
    if model == "laguna":
        router = module.LagunaTopKRouter(transformers.LagunaConfig(num_experts=EXPERTS, **common, **extra))
    elif model == "muse_spark":
        from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
        router = module.MuseSparkTopkRouter(MuseSparkTextConfig(num_local_experts=EXPERTS, **common, **extra))
    elif model == "lfm2_moe":
        config = transformers.Lfm2MoeConfig(num_experts=EXPERTS, use_expert_bias=True, moe_intermediate_size=8,
                                            **common, **extra)
        block = module.Lfm2MoeSparseMoeBlock(config)
        return block, block.gate, lambda hidden: block.gate(hidden, block.expert_bias)
    elif model == "afmoe":  # the bias on the MoE block, the weight in the router's `gate`, [batch, seq, hidden] in
        config = transformers.AfmoeConfig(num_experts=EXPERTS, moe_intermediate_size=8, **common, **extra)
        block = module.AfmoeSparseMoeBlock(config)
        block.router.weight = block.router.gate.weight
        return block, block.router, lambda hidden: block.router(hidden[None], block.expert_bias)
    elif model == "axk2":  # A.X-K2-Light: no expert groups
        router = module.AXK2TopkRouter(transformers.AXK2Config(num_local_experts=EXPERTS, **common, **extra))
    elif model == "inkling2":
        from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig
        router = module.Inkling2TopKRouter(Inkling2TextConfig(num_local_experts=EXPERTS, **common, **extra))
    elif model == "kolibri1":
        router = module.Kolibri1TopKRouter(transformers.Kolibri1Config(num_experts=EXPERTS, **common, **extra))
    elif model == "kolibri1_1":
        router = module.Kolibri1_1TopKRouter(transformers.Kolibri1_1Config(num_experts=EXPERTS, index_num_heads=1,
                                                                         **common, **extra))
    elif model == "ergo":  # its weight in the router's `linear`
        router = module.ErgoTopkRouter(transformers.ErgoConfig(num_experts=EXPERTS, **common, **extra))
        router.weight = router.linear.weight
    elif model == "minimax_m3_vl":
        from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
        router = module.MiniMaxM3VLTopKRouter(MiniMaxM3VLTextConfig(num_local_experts=EXPERTS, **common, **extra))
    elif model == "mistral4":
        router = module.Mistral4TopkRouter(transformers.Mistral4Config(num_local_experts=EXPERTS, **common, **extra))
    else:
        from transformers.models.mistral_large4.configuration_mistral_large4 import MistralLarge4TextConfig
        router = module.MistralLarge4TextTopkRouter(MistralLarge4TextConfig(num_local_experts=EXPERTS, **common,
                                                                            **extra))
    return router, router, router


# (model, config extras, the rule hf_routers must declare)
DECLARED = [
    ("laguna", {}, dict(score="sigmoid")),
    ("muse_spark", {}, dict(score="sigmoid")),
    ("lfm2_moe", {}, dict(score="sigmoid", rounded=True)),  # sigmoid + bias in the logits' dtype
    ("inkling2", {}, dict(score="sigmoid")),
    ("afmoe", {}, dict(score="sigmoid")),
    ("axk2", {}, dict(score="sigmoid")),
    ("kolibri1", {}, dict(score="logits")),
    ("kolibri1_1", {}, dict(score="logits")),
    ("ergo", {}, dict(score="sigmoid")),
    ("minimax_m3_vl", {}, dict(score="sigmoid")),
    ("mistral4", dict(n_group=4, topk_group=2), dict(score="softmax", n_group=4, topk_group=2, group_topk=2)),
    ("mistral_large4", dict(n_group=4, topk_group=2), dict(score="softmax", n_group=4, topk_group=2, group_topk=2)),
]


@pytest.mark.parametrize("model, extra, rule", DECLARED, ids=[case[0] for case in DECLARED])
def test_the_declared_rule_selects_what_their_router_selects(model, extra, rule):
    rng = np.random.default_rng(len(model))
    block, router, forward = _router(model, **extra)
    bias_held = next((getattr(m, name) for m in (router, block) for name in hf_routers.BIAS_NAMES
                      if isinstance(getattr(m, name, None), torch.Tensor)), None)
    with torch.no_grad():
        router.weight.copy_(torch.eye(EXPERTS))
        if bias_held is not None:  # zeros as built: a trained model's is not
            bias_held.copy_(torch.from_numpy(rng.standard_normal(EXPERTS) * 0.05))
    declared = hf_routers.selection_of(block, router)
    assert declared is not None
    bias = declared.pop("bias", None)
    assert (bias is None) == (bias_held is None)
    assert declared == {"top_k": K, **rule}
    info = RouterInfo(**declared, bias=None if bias is None else tuple(float(b) for b in bias))
    hidden = (rng.standard_normal((400, EXPERTS)) * rng.uniform(0.3, 3.0, (400, 1))).astype(np.float32)
    with torch.no_grad():
        logits, _, ids = forward(torch.from_numpy(hidden))[:3]
    logits = logits.float().numpy()
    theirs = np.sort(ids.numpy(), axis=-1)
    assert np.array_equal(selection.select(info, selection.choice_scores(info, logits)), theirs)
    # The rule matters: their picks are not the plain top-k of the logits.
    assert not np.array_equal(np.sort(np.argsort(-logits, axis=-1)[:, :K], axis=-1), theirs)


def test_a_router_with_an_unknown_bias_or_groups_is_warned_about_once_and_declared_unknown():
    """ZAYA-like: a per-expert `balancing_biases` buffer; a grouped router of an unknown class;
    an `e_score_correction_bias` added in an unknown way. Each class is named once, and each such
    router is declared of score "unknown" (compare then judges none of its flips by its logits);
    plain routers, DeepSeek-V2's greedy one among them, are not declared."""
    class BalancedRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k = 2
            self.balancing_biases = torch.nn.Buffer(torch.zeros(8))

    class GroupedRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.n_group, self.topk_group = 2, 4, 2

    class CorrectedRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k = 2
            self.e_score_correction_bias = torch.nn.Buffer(torch.zeros(8))

    class PlainRouter(torch.nn.Linear):  # a linear layer's own `bias` is part of the logits
        top_k = 2

    class GreedyRouter(GroupedRouter):  # DeepSeek-V2's topk_method="greedy" ignores its groups
        topk_method = "greedy"

    STATE.warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for router in (BalancedRouter(), BalancedRouter(), GroupedRouter(), CorrectedRouter()):
            assert hf_routers.selection_of(torch.nn.Module(), router) == {"top_k": 2, "score": "unknown"}
        for router in (PlainRouter(4, 8), GreedyRouter()):
            assert hf_routers.selection_of(torch.nn.Module(), router) is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3
    assert "BalancedRouter holds balancing_biases in a way compiledump does not know" in messages[0]
    assert "GroupedRouter selects inside the best 2 of 4 expert groups" in messages[1]
    assert "CorrectedRouter adds an e_score_correction_bias in a way" in messages[2]
    assert all("declare_router" in message for message in messages)
    STATE.warned.clear()


@pytest.mark.parametrize("name", hf_routers.PROBABILITY_ROUTERS)
def test_probability_routers_return_probabilities_first(name):
    """instrument records the log of these routers' first output: it must be softmax
    probabilities (rows summing to 1), whose log is the logits up to a per-row constant."""
    import importlib
    model = {"Gemma4TextRouter": "gemma4", "DiffusionGemmaTextRouter": "diffusion_gemma"}[name]
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    config_class = getattr(importlib.import_module(f"transformers.models.{model}.configuration_{model}"),
                           name.replace("Router", "Config"))
    torch.manual_seed(0)
    router = getattr(module, name)(config_class(hidden_size=EXPERTS, num_experts=8, top_k_experts=2))
    with torch.no_grad():
        first = router(torch.randn(5, EXPERTS))[0]
    assert first.shape == (5, 8) and torch.all(first > 0)
    torch.testing.assert_close(first.sum(-1), torch.ones(5))
