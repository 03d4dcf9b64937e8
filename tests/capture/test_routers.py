"""`declare_router` and what `instrument` declares: the manifest's `routers` (docs/format.md),
also in a dump recovered after a crash, and the declarations Hugging Face's routers get."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump.capture import hf_routers
from compiledump.capture.recover import recover_directory
from compiledump.capture.state import STATE
from helpers.hf_models import longcat_flash


def _manifest(npz) -> dict:
    return json.loads(Path(npz).with_suffix(".json").read_text())


def test_declared_routers_of_captured_tags_reach_the_manifest(dump_dir):
    compiledump.configure(moe_layers=10)  # every layer's router captured
    bias = torch.randn(12, dtype=torch.float32)
    compiledump.declare_router("layer3_router", top_k=4, score="sigmoid", bias=bias, n_group=3, topk_group=2)
    compiledump.declare_router("layer5_router", top_k=2)  # its layer captures only decode steps
    compiledump.declare_router("layer7_router", top_k=2)  # never captured: not written
    compiledump.record("layer3_router", torch.randn(5, 12))
    compiledump.record_step("layer5_step_router", torch.randn(1, 12))
    compiledump.record("layer9_router", torch.randn(5, 12))  # captured, never declared
    routers = _manifest(compiledump.flush())["routers"]
    assert sorted(routers) == ["layer3_router", "layer5_router"]
    assert routers["layer3_router"] == {"top_k": 4, "score": "sigmoid", "bias": bias.double().tolist(),
                                        "n_group": 3, "topk_group": 2, "group_topk": 2}
    assert np.array_equal(np.asarray(routers["layer3_router"]["bias"], np.float32), bias.numpy())  # exact
    assert routers["layer5_router"]["bias"] is None and routers["layer5_router"]["score"] == "softmax"


def test_a_capacity_declaration_reaches_the_manifest_and_reads_back(dump_dir):
    """`capacity=True` (Switch Transformers: each expert takes a fixed number of a sequence's tokens)
    is written as `"capacity": true` (absent otherwise) and read back by the comparator's reader."""
    from compiledump.format.routers import router_from_json

    compiledump.declare_router("layer1_router", top_k=1, rounded=True, capacity=True)
    compiledump.declare_router("layer0_router", top_k=1)
    compiledump.record("layer1_router", torch.randn(5, 8))
    compiledump.record("layer0_router", torch.randn(5, 8))
    routers = _manifest(compiledump.flush())["routers"]
    assert routers["layer1_router"]["capacity"] is True and "capacity" not in routers["layer0_router"]
    assert router_from_json(routers["layer1_router"]).capacity
    assert not router_from_json(routers["layer0_router"]).capacity
    with pytest.raises(ValueError, match="capacity must be a bool"):
        compiledump.declare_router("layer1_router", top_k=1, capacity="yes")


def test_no_declaration_no_routers_field(dump_dir):
    compiledump.record("layer0_router", torch.randn(3, 8))
    assert "routers" not in _manifest(compiledump.flush())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(top_k=2, bias=torch.zeros(2, 4)), ValueError, "bias must be 1-D"),
    (dict(top_k=2, score="tanh"), ValueError, "score must be one of"),
    (dict(top_k=2, n_group=3, bias=torch.zeros(8)), ValueError, "do not form 3 equal groups"),
    (dict(top_k=-1), ValueError, "top_k must be a positive int"),
    (dict(top_k=9, bias=torch.zeros(8)), ValueError, "top-9 does not fit in 1 groups of 8"),
    (dict(top_k=2, bias=torch.zeros(8), n_group=8, topk_group=2), ValueError, "sums its best 2, but a group holds 1"),
    (dict(top_k=2, bias=torch.zeros(8, device="meta")), ValueError, "meta device"),
])
def test_a_declaration_that_cannot_describe_a_router_is_refused_with_its_tag(dump_dir, kwargs, error, message):
    with pytest.raises(error, match=message):
        compiledump.declare_router("layer1_router", **kwargs)
    with pytest.raises(error, match="'layer1_router'"):
        compiledump.declare_router("layer1_router", **kwargs)
    with pytest.raises(TypeError, match="non-empty string"):
        compiledump.declare_router("", top_k=2)


def test_reset_forgets_declarations(dump_dir):
    compiledump.declare_router("layer0_router", top_k=2, n_group=2)
    compiledump.reset()
    compiledump.record("layer0_router", torch.randn(3, 8))
    assert "routers" not in _manifest(compiledump.flush())


def test_a_recovered_dump_keeps_the_declarations(dump_dir):
    """Declared before the arena existed (journaled when it is created) and after (journaled at
    once): the dump `recover` writes from the crash-proof files has the flush's `routers`."""
    compiledump.configure(moe_layers=10)
    compiledump.declare_router("layer1_router", top_k=2, score="sigmoid", bias=torch.randn(8), n_group=2)
    compiledump.record("layer1_router", torch.randn(4, 8))
    compiledump.declare_router("layer2_router", top_k=3, n_group=4, topk_group=2, group_topk=1)
    compiledump.record_step("layer2_step_router", torch.randn(1, 8))
    assert compiledump.get_config().persist != "0"
    compiledump.declare_router("layer3_router", top_k=2)
    compiledump.record("layer3_router", torch.randn(4, 8))
    from compiledump.capture import routers
    routers.withdraw("layer3_router")  # instrument's, on a model whose router there is a plain top-k
    flushed = compiledump.flush()
    want = _manifest(flushed)["routers"]
    # Without the flushed files (a complete dump is left as it is), recover rebuilds the manifest
    # from the journal.
    Path(flushed).unlink()
    Path(flushed).with_suffix(".json").unlink()
    results, errors = recover_directory(dump_dir, force=True, keep=True)
    assert errors == [] and results[0].npz == Path(flushed)
    assert _manifest(flushed)["routers"] == want and sorted(want) == ["layer1_router", "layer2_router"]


transformers = pytest.importorskip("transformers")
COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=32, intermediate_size=48, moe_intermediate_size=24, n_shared_experts=1,
              first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=8, head_dim=8)


def _deepseek_v3() -> torch.nn.Module:
    """DeepSeek-V3 with its own routing: 12 experts in 4 groups, top-3 in the best 2."""
    config = transformers.DeepseekV3Config(**COMMON, n_routed_experts=12, num_experts_per_tok=3, n_group=4,
                                           topk_group=2)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _qwen3_moe() -> torch.nn.Module:
    """Qwen3-MoE: a plain top-k router (softmax, no bias)."""
    config = transformers.AutoConfig.for_model("qwen3_moe", vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                               intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                               num_experts_per_tok=2)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _flushed_routers(model, dump_dir) -> dict:
    handle = compiledump.instrument(model)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 97, (1, 5)), use_cache=False)
    routers = _manifest(compiledump.flush()).get("routers", {})
    handle.remove()
    return routers


def test_instrument_declares_deepseek_v3_routers_with_their_bias(dump_dir):
    torch.manual_seed(0)
    model = _deepseek_v3()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    compiledump.configure(moe_layers=3)
    routers = _flushed_routers(model, dump_dir)
    assert sorted(routers) == ["layer1_router", "layer2_router"]  # layer 0 is dense
    for i in (1, 2):
        expected = model.model.layers[i].mlp.gate.e_score_correction_bias.double().tolist()
        assert routers[f"layer{i}_router"] == {"top_k": 3, "score": "sigmoid", "bias": expected, "n_group": 4,
                                               "topk_group": 2, "group_topk": 2}


def test_instrument_declares_deepseek_v2_group_limited_greedy_and_nothing_for_plain_top_k(dump_dir):
    config = transformers.DeepseekV2Config(**{**COMMON, "num_key_value_heads": 2}, n_routed_experts=8,
                                           num_experts_per_tok=2, n_group=4, topk_group=2,
                                           topk_method="group_limited_greedy")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    compiledump.configure(moe_layers=3)
    routers = _flushed_routers(model, dump_dir)
    assert routers["layer1_router"] == {"top_k": 2, "score": "softmax", "bias": None, "n_group": 4, "topk_group": 2,
                                        "group_topk": 1}
    compiledump.reset()
    assert _flushed_routers(_qwen3_moe(), dump_dir) == {}


def test_instrument_on_a_model_without_loaded_weights_declares_nothing_and_says_so(dump_dir):
    with torch.device("meta"):
        model = _deepseek_v3()
    with pytest.warns(RuntimeWarning, match="meta device.*after the weights are loaded"):
        handle = compiledump.instrument(model)
    handle.remove()
    assert STATE.routers == {}


def test_instrumenting_a_plain_model_withdraws_another_model_s_declarations(dump_dir):
    """A DeepSeek-V3 then a Qwen3-MoE instrumented in one process: the Qwen3 dump must not carry
    DeepSeek's declarations for its own layer<i>_router tags."""
    compiledump.configure(moe_layers=3)
    compiledump.instrument(_deepseek_v3()).remove()
    assert "layer1_router" in STATE.routers
    assert _flushed_routers(_qwen3_moe(), dump_dir) == {}


def test_instrument_declares_minimax_m2_s_sigmoid_and_bias_over_every_expert(dump_dir):
    """MiniMax-M2 keeps its e_score_correction_bias on the MoE block and passes it to the router:
    the top-k of sigmoid(logits) + bias over all experts (no groups)."""
    config = transformers.AutoConfig.for_model("minimax_m2", vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                               intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                               max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for layer in model.model.layers:
        layer.mlp.e_score_correction_bias.normal_(0, 0.1)
    routers = _flushed_routers(model, dump_dir)
    assert sorted(routers) == ["layer0_router", "layer1_router"]
    for i, layer in enumerate(model.model.layers):
        assert routers[f"layer{i}_router"] == {"top_k": 2, "score": "sigmoid",
                                               "bias": layer.mlp.e_score_correction_bias.double().tolist(),
                                               "n_group": 1, "topk_group": 1, "group_topk": 2}



def _ernie4_5_moe():
    config = transformers.AutoConfig.for_model("ernie4_5_moe", vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                               intermediate_size=48, moe_intermediate_size=24, moe_num_experts=8,
                                               moe_k=2, moe_layer_start_index=0, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model", ["longcat_flash", "ernie4_5_moe"])
def test_instrument_declares_softmax_plus_bias_routers(dump_dir, model):
    """LongCat-Flash (its bias on the router, over its zero-computation experts too) and Ernie 4.5
    (its bias in the router's moe_statics, shaped [1, experts]) pick the top-k of softmax(logits)
    + bias: declared with the bias as their forward adds it."""
    torch.manual_seed(1)
    built = longcat_flash() if model == "longcat_flash" else _ernie4_5_moe()
    routers_by_layer = [m for m in built.modules() if type(m).__name__ in hf_routers.SOFTMAX_BIAS_ROUTERS]
    assert routers_by_layer, "no router of the expected class"
    biases = []
    for router in routers_by_layer:
        held = router.moe_statics.e_score_correction_bias if model == "ernie4_5_moe" else router.e_score_correction_bias
        held.normal_(0, 0.05)
        biases.append(held.reshape(-1).double().tolist())
    compiledump.configure(moe_layers=4)
    if model == "ernie4_5_moe":
        routers = _flushed_routers(built, dump_dir)  # the dump's manifest
    else:  # this config's LongCat-Flash does not run (its attention's rope sizes): the declarations
        compiledump.instrument(built).remove()
        routers = {tag: info.to_json() for tag, info in STATE.routers.items()}
    assert sorted(routers) == [f"layer{i}_router" for i in range(len(biases))]
    for i, bias in enumerate(biases):
        assert routers[f"layer{i}_router"] == {"top_k": 2, "score": "softmax", "bias": bias, "n_group": 1,
                                               "topk_group": 1, "group_topk": 2}
    assert len(biases[0]) == (10 if model == "longcat_flash" else 8)


def _deepseek_v4():
    config = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        num_hash_layers=2, head_dim=16, q_lora_rank=16, o_lora_rank=16, index_n_heads=2, index_head_dim=8,
        qk_rope_head_dim=8, moe_intermediate_size=24)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_instrument_declares_deepseek_v4_s_hash_and_sqrt_softplus_routers(dump_dir):
    """DeepSeek-V4: its first layers' hash routers take the experts from the token id (declared
    score "token"), the others the top-k of sqrt(softplus(logits)) + bias."""
    torch.manual_seed(2)
    model = _deepseek_v4()
    gates = [layer.mlp.gate for layer in model.model.layers]
    assert [type(gate).__name__ for gate in gates] == ["DeepseekV4HashRouter"] * 2 + ["DeepseekV4TopKRouter"] * 2
    for gate in gates[2:]:
        gate.e_score_correction_bias.normal_(0, 0.05)
    compiledump.configure(moe_layers=4)
    routers = _flushed_routers(model, dump_dir)
    for i in (0, 1):
        assert routers[f"layer{i}_router"] == {"top_k": 2, "score": "token", "bias": None, "n_group": 1,
                                               "topk_group": 1, "group_topk": 2}
    for i in (2, 3):
        assert routers[f"layer{i}_router"] == {"top_k": 2, "score": "sqrtsoftplus",
                                               "bias": gates[i].e_score_correction_bias.double().tolist(),
                                               "n_group": 1, "topk_group": 1, "group_topk": 2, "rounded": True}


class _SoftplusRouter(torch.nn.Module):
    """A router of a rule compiledump does not know: the top-k of softplus(logits) + a bias."""

    def __init__(self):
        super().__init__()
        self.top_k, self.weight = 2, torch.nn.Parameter(torch.randn(6, 8))
        self.e_score_correction_bias = torch.nn.Parameter(torch.randn(6) * 0.1, requires_grad=False)

    def forward(self, x):
        logits = torch.nn.functional.linear(x.reshape(-1, 8), self.weight)
        ids = torch.topk(torch.nn.functional.softplus(logits) + self.e_score_correction_bias, 2).indices
        return logits, None, ids


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(20, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.self_attn, layer.post_attention_layernorm = torch.nn.Identity(), torch.nn.Identity()
            layer.mlp = torch.nn.Module()
            layer.mlp.gate, layer.mlp.experts = _SoftplusRouter(), torch.nn.Linear(8, 8)


def test_a_router_with_a_bias_whose_rule_is_unknown_is_named_once(dump_dir):
    """A router with an e_score_correction_bias and a rule not known here: declared as of an
    unknown rule (so that compare does not judge its flips by its logits), and a warning names the
    router class and the fix (declare_router), once for its two layers."""
    with pytest.warns(RuntimeWarning, match=r"_SoftplusRouter adds an e_score_correction_bias.*declare_router") \
            as caught:
        handle = compiledump.instrument(_Decoder())
    handle.remove()
    assert {tag: (info.score, info.top_k, info.bias) for tag, info in STATE.routers.items()} == {
        "layer0_router": ("unknown", 2, None), "layer1_router": ("unknown", 2, None)}
    assert sum("_SoftplusRouter" in str(w.message) for w in caught) == 1
