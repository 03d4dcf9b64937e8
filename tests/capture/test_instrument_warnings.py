"""What `instrument()` cannot tap by default is said, once, with the fix: an MoE block whose router
it cannot find (a synthetic one, Doge's product-key MoE), a router that returns no logits, and
decoder layers with no module whose input is the residual stream after attention (LongCat-Flash's
norms in a ModuleList, Cohere2-MoE's parallel attention and MLP). Hugging Face models are built
from config with random weights (nothing downloaded)."""

import warnings

import numpy as np
import pytest
import torch
import transformers

import compiledump
from compiledump.capture.hf_layout import residual_after_attention
from helpers.hf_models import longcat_flash
from helpers.hf_example import ex

_TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             head_dim=16, intermediate_size=48, max_position_embeddings=64)


def _instrument(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = compiledump.instrument(model)
    return handle, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _arrays(path):
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


class _Layer(torch.nn.Module):
    """A decoder layer of the usual names around `block` (its MoE block)."""

    def __init__(self, block):
        super().__init__()
        self.self_attn, self.post_attention_layernorm, self.mlp = torch.nn.Identity(), torch.nn.LayerNorm(8), block

    def forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(self.self_attn(x)))


class _Model(torch.nn.Module):
    def __init__(self, make_block):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(make_block()) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _UnnamedRouterBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.switch = torch.nn.Linear(8, 3)  # the router, under a name instrument does not know

    def forward(self, x):
        choice = self.switch(x).argmax(-1, keepdim=True)
        return sum(torch.where(choice == e, expert(x), 0) for e, expert in enumerate(self.experts))


class _IdsOnlyRouterBlock(_UnnamedRouterBlock):
    """Its router (`gate`) returns the chosen ids twice and no logits."""

    def __init__(self):
        super().__init__()
        self.gate = _IdsOnlyRouter()

    def forward(self, x):
        choice, _ = self.gate(x)
        return sum(torch.where(choice == e, expert(x), 0) for e, expert in enumerate(self.experts))


class _IdsOnlyRouter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 3)

    def forward(self, x):
        ids = self.proj(x).argmax(-1, keepdim=True)
        return ids, ids


def test_an_moe_block_without_a_known_router_is_named_in_a_warning(dump_dir):
    handle, messages = _instrument(_Model(_UnnamedRouterBlock))
    unrouted = [m for m in messages if "route tokens to experts but have no router submodule" in m]
    assert len(unrouted) == 1 and "2 MoE block(s) (layers.0.mlp, layers.1.mlp)" in unrouted[0]
    assert "named gate or router: " in unrouted[0] and "taps={'layer{i}_router'" in unrouted[0]
    assert "layer0_router" not in handle.taps and {"layer0_attn", "layer0_mlp", "layer1"} <= set(handle.taps)
    # Hugging Face MoE models' routers and norms are found: no warning of any kind.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("qwen3_moe", "mixtral", "llama"):
            taps = compiledump.instrument(ex.build_model(name)).taps
            assert "layer1_attn" in taps and ("layer1_topk" in taps) == (name != "llama")


def test_doge_s_product_key_moe_is_named_with_the_router_it_has(dump_dir):
    """Doge's MoE keeps its experts as embeddings and routes through `router_gate` (product keys):
    no router instrument knows, so a warning names the block and that child instead of leaving the
    model silently without routing tags. Its MoE output is still recorded, equal to the block's."""
    config = transformers.AutoConfig.for_model("doge", **_TINY, is_moe=True, num_experts=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    handle, messages = _instrument(model)
    unrouted = [m for m in messages if "no router submodule" in m]
    assert len(unrouted) == 1 and "(model.layers.0.mlp, model.layers.1.mlp)" in unrouted[0]
    assert "a router under another name: router_gate?" in unrouted[0]
    assert not [tag for tag in handle.taps if tag.endswith(("_router", "_topk"))]
    got = []
    hook = model.model.layers[1].mlp.register_forward_hook(lambda _m, _a, out: got.append(out))
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    arrays = _arrays(compiledump.flush())
    out = got[0][0] if isinstance(got[0], tuple) else got[0]
    np.testing.assert_allclose(arrays["layer1_mlp"], out[0, -1].numpy(), rtol=1e-6, atol=1e-6)


def test_a_router_that_returns_no_logits_is_warned_and_left_out_of_the_taps(dump_dir):
    model = _Model(_IdsOnlyRouterBlock)
    handle, messages = _instrument(model)
    assert "layer0_router" in handle.taps  # the router is found; what it returns is seen when it runs
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            expected = model(x)
    messages = [str(w.message) for w in caught]
    assert any("_IdsOnlyRouter (a router) returns no floating-point logits" in m and "nor listed in handle.taps" in m
               for m in messages)
    assert not [tag for tag in handle.taps if tag.endswith(("_router", "_topk"))]
    arrays = _arrays(compiledump.flush())
    assert not [key for key in arrays if "router" in key or "topk" in key]
    np.testing.assert_allclose(arrays["layer1"], expected[0, -1].numpy(), rtol=1e-6, atol=1e-6)


def _cohere2_moe():
    config = transformers.AutoConfig.for_model("cohere2_moe", **_TINY, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=24)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("build, kind", [(longcat_flash, "LongcatFlashDecoderLayer"),
                                         (_cohere2_moe, "Cohere2MoeDecoderLayer")])
def test_layers_without_the_residual_after_attention_are_named_in_a_warning(dump_dir, build, kind):
    """LongCat-Flash keeps its post-attention norms in a ModuleList (never called, so a hook on it
    would never fire); Cohere2-MoE runs attention and MLP on the same input. Neither has a
    `layer<i>_attn`, and the warning says so once, with the layer class and the tap to add."""
    torch.manual_seed(0)
    handle, messages = _instrument(build())
    no_attn = [m for m in messages if "residual stream after attention" in m]
    assert len(no_attn) == 1 and f"2 decoder layer(s) (model.layers.0, model.layers.1, {kind})" in no_attn[0]
    assert "taps={'layer{i}_attn': 'model.layers.{i}.<module>:input'}" in no_attn[0]
    assert not [tag for tag in handle.taps if tag.endswith("_attn")]
    assert {"layer0", "layer1_mlp", "layer1_router", "final_norm"} <= set(handle.taps)


def test_a_norm_kept_in_a_module_list_is_not_tapped():
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Identity()
    layer.post_attention_layernorm = torch.nn.ModuleList([torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)])
    layer.mlp = torch.nn.Linear(4, 4)
    assert residual_after_attention(layer, "mlp") is None
    layer.post_attention_layernorm = torch.nn.LayerNorm(4)
    assert residual_after_attention(layer, "mlp") == "post_attention_layernorm"


def test_an_encoder_decoder_model_says_which_layers_it_tapped(dump_dir):
    """Bart's encoder and decoder each hold `layers` beside a token embedding: the decoder's are
    tapped (they run at every decode step; before 2026-12-06 the first found, the encoder's), the
    encoder's output is recorded, and a warning names the encoder's layers with the taps that add them."""
    config = transformers.BartConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=48,
                                     decoder_ffn_dim=48, max_position_embeddings=64)
    handle, messages = _instrument(transformers.BartForConditionalGeneration(config).eval())
    assert handle.taps["layer0"] == "model.decoder.layers.0" and handle.taps["encoder_output"] == "model.encoder"
    others = [m for m in messages if "the encoder's layers at" in m]
    assert len(others) == 1 and "tapped the decoder's layers at model.decoder.layers" in others[0]
    assert "taps={'encoder{i}': 'model.encoder.layers.{i}'}" in others[0]
    # A decoder-only model has one such list: no warning.
    assert not [m for m in _instrument(ex.build_model("llama"))[1] if "beside a token embedding" in m or "encoder" in m]


def test_qwen4_exp_s_hyper_connections_no_attn_warned_and_its_mixer_is_the_final_norm(dump_dir):
    """Qwen4-Exp adds attention into its hyper-connection streams inline (no module takes the
    residual after attention: warned) and ends in a stream mixer instead of a norm, whose output
    (the model's last hidden state) `final_norm` records."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    config = Qwen4ExpTextConfig(
        **{**_TINY, "vocab_size": 211}, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, hc_count=2, hc_lowrank=8, ple_layer_ids=[], ngram_vocab_size_base=256,
        heads_per_ngram=2, split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=64, indexer_compress_ratio=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    handle, messages = _instrument(model)
    assert any("2 decoder layer(s) (model.layers.0, model.layers.1, Qwen4ExpTextDecoderLayer)" in m for m in messages)
    assert handle.taps["final_norm"] == "model.hyper_connection_mixer" and "layer1_topk" in handle.taps
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    arrays = _arrays(compiledump.flush())
    np.testing.assert_allclose(arrays["final_norm"], out.hidden_states[-1][0, -1].numpy(), rtol=1e-6, atol=1e-6)
