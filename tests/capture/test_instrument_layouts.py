"""`compiledump.instrument(model)` on decoders laid out otherwise than Llama's (Hugging Face models
built from config, random weights, nothing downloaded, eagerly): other layer structures and names,
hyper-connection residuals, a vision-language model's language model, a causal LM nested in another
module, `{i}` taps over blocks not named `layers`, routers beside a dense MLP, a layer run twice.
Each dumped value is checked against what the model computes (its own outputs, or hooks on its
modules: an independent path). Steps and rows: tests/capture/test_instrument.py; options and
errors: tests/capture/test_instrument_options.py."""

import warnings

import numpy as np
import pytest
import torch
import transformers

import compiledump
from helpers.hf_example import ex
from helpers.hf_dump import forward_hidden as _forward, load_dump as _load, router_output as _router_ids


def _mlp(block, x):
    out = block(x[None, None])
    out = out[0] if isinstance(out, tuple) else out  # gpt-oss's MLP returns (out, scores), Llama 4's (out, logits)
    return out.reshape(-1, x.shape[-1])[0]  # Llama 4's MoE returns flat [tokens, hidden]


# How the layer output follows from the residual stream after attention (`layer<i>_attn`), as each
# architecture's decoder layer computes it (transformers' modeling files).
_REBUILD = {
    "gemma2": lambda layer, a: a + layer.post_feedforward_layernorm(
        _mlp(layer.mlp, layer.pre_feedforward_layernorm(a))),
    "olmo2": lambda layer, a: a + layer.post_feedforward_layernorm(_mlp(layer.mlp, a)),
    "gpt_oss": lambda layer, a: a + _mlp(layer.mlp, layer.post_attention_layernorm(a)),
    "jamba": lambda layer, a: a + _mlp(layer.feed_forward, layer.pre_ff_layernorm(a)),
    "llama4_text": lambda layer, a: a + _mlp(layer.feed_forward, layer.post_attention_layernorm(a)),
    "qwen3_next": lambda layer, a: a + _mlp(layer.mlp, layer.post_attention_layernorm(a)),
}


@pytest.mark.parametrize("name", sorted(_REBUILD))
def test_default_taps_follow_other_layer_structures(dump_dir, name):
    """Sandwich norms (Gemma 2), post-norms (OLMo 2), a router named `router` (gpt-oss), hybrid
    linear-attention layers (Qwen3-Next), Mamba layers with `feed_forward` blocks and a
    `final_layernorm` (Jamba), a router returning (scores, logits) (Llama 4): the same tags, each
    holding what its name says."""
    compiledump.configure(moe_layers=4)
    config = transformers.AutoConfig.for_model(
        name, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=211, max_position_embeddings=64, num_experts=4,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_layer_period=4, attn_layer_offset=3)  # Jamba: layer 3 attends, the others are Mamba layers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 211, (1, 7), generator=torch.Generator().manual_seed(6))
    handle = compiledump.instrument(model)
    out = _forward(model, ids)
    arrays, _ = _load(compiledump.flush())
    handle.remove()
    moe = name in ("gpt_oss", "jamba", "llama4_text", "qwen3_next")
    suffixes = ("", "_attn", "_mlp") + (("_router", "_topk") if moe else ())
    assert {f"layer1{suffix}" for suffix in suffixes} <= set(arrays)
    assert set(arrays) >= {"final_norm", "logits_0"}
    # The last hidden state Hugging Face returns is the final norm's output (Jamba: final_layernorm).
    np.testing.assert_allclose(arrays["final_norm"], out.hidden_states[-1][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    for i in range(3):
        np.testing.assert_allclose(arrays[f"layer{i}"], out.hidden_states[i + 1][0, -1].numpy(), rtol=1e-5, atol=1e-5)
        layer, attn = model.model.layers[i], torch.from_numpy(arrays[f"layer{i}_attn"])
        with torch.no_grad():
            rebuilt = _REBUILD[name](layer, attn)
        np.testing.assert_allclose(rebuilt.numpy(), arrays[f"layer{i}"], rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # lm_head's output: Gemma 2 soft-caps the logits after it
        logits = model.lm_head(out.hidden_states[-1][0, -1])
    np.testing.assert_allclose(arrays["logits_0"], logits.numpy(), rtol=1e-5, atol=1e-5)
    if moe:
        output = _router_ids(model, 1, ids)  # layer 1 is an MoE layer in each of them
        if name == "llama4_text":  # (scores, logits): the scores are 0 but at the experts used
            scores, logits = output
            top = np.sort(np.nonzero(scores.numpy())[1].reshape(len(scores), -1), axis=-1)
            np.testing.assert_array_equal(np.sort(arrays["layer1_topk"], axis=-1), top)
        else:
            logits, _, top = output
            np.testing.assert_array_equal(arrays["layer1_topk"], top.numpy())
        np.testing.assert_allclose(arrays["layer1_router"], logits.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ["one", "all"])
def test_a_hyper_connection_residual_is_the_request_s_mean_over_hc_mult(dump_dir, rows):
    """DeepSeek-V4 keeps its residual as hc_mult parallel streams, `[batch, seq, hc_mult, hidden]`:
    `layer<i>` is the request's rows averaged over hc_mult (as `record` stores `[tokens, hc,
    dim]`), in a batch of two with the second request recorded; the router rows and ids are that
    request's too. (Before, the 4-D layer output was read as one token and the token gate dropped
    every `layer<i>`, and the router logits kept both requests' rows.)"""
    config = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        num_hash_layers=1, head_dim=16, q_lora_rank=16, o_lora_rank=16, index_n_heads=2, index_head_dim=8,
        qk_rope_head_dim=8, moe_intermediate_size=24)
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    compiledump.configure(moe_layers=3, rows=rows)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    gates = []
    hook = model.model.layers[2].mlp.gate.register_forward_hook(lambda _m, _a, out: gates.append(out))
    handle = compiledump.instrument(model, batch_row=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no drop, no doubtful layout
        out = _forward(model, ids)
        arrays, manifest = _load(compiledump.flush())
    handle.remove()
    hook.remove()
    last = slice(None) if rows == "all" else -1
    assert out.hidden_states[1].shape == (2, 9, config.hc_mult, 32) and config.hc_mult > 1
    for i in range(2):  # hidden_states[i + 1]: layer i's output, all hc streams
        expected = out.hidden_states[i + 1][1].double().mean(dim=1)[last].numpy()
        np.testing.assert_allclose(arrays[f"layer{i}"], expected, rtol=1e-5, atol=1e-6)
        assert manifest["keys"][f"layer{i}"]["source_shape"] == [9, config.hc_mult, 32]
    logits, _, top = gates[0]
    np.testing.assert_allclose(arrays["layer2_router"], logits.reshape(2, 9, -1)[1].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(arrays["layer2_topk"], top.reshape(2, 9, -1)[1].numpy())
    # The logits too: the request's last position (docs/api.md), not batch row 0's.
    np.testing.assert_allclose(arrays["logits_0"], out.logits[1, -1].numpy(), rtol=1e-6, atol=1e-6)
    assert "drops" not in manifest or not manifest["drops"]


def test_a_vision_language_model_is_tapped_in_its_language_model(dump_dir):
    """Llava's vision encoder also has `layers` with `self_attn`, first in module order; the
    decoder's are the ones beside `embed_tokens`."""
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=299)).eval()
    ids = torch.randint(0, 290, (1, 6), generator=torch.Generator().manual_seed(7))
    handle = compiledump.instrument(model)
    out = _forward(model, ids)
    arrays, _ = _load(compiledump.flush())
    assert handle.taps["layer0"] == "model.language_model.layers.0"
    assert handle.taps["final_norm"] == "model.language_model.norm"
    for i in range(2):  # the last hidden state Hugging Face returns is the final norm's output
        np.testing.assert_allclose(arrays[f"layer{i}"], out.hidden_states[i + 1][0, -1].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(arrays["final_norm"], out.hidden_states[-1][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(arrays["logits_0"], out.logits[0, -1].numpy(), rtol=1e-5, atol=1e-5)


def test_a_causal_lm_nested_in_another_module_keeps_its_logits(dump_dir):
    """Llama 4's multimodal class holds its text model as `language_model` (with `lm_head`)."""
    class Outer(torch.nn.Module):
        def __init__(self, language_model):
            super().__init__()
            self.language_model = language_model

        def forward(self, **kwargs):
            return self.language_model(**kwargs)

    inner = ex.build_model("llama")
    ids = torch.randint(0, inner.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(8))
    handle = compiledump.instrument(Outer(inner))
    out = _forward(inner, ids)
    arrays, _ = _load(compiledump.flush())
    assert handle.taps["logits"] == "language_model.lm_head"
    assert handle.taps["layer0"] == "language_model.model.layers.0"
    np.testing.assert_allclose(arrays["logits_0"], out.logits[0, -1].numpy(), rtol=1e-5, atol=1e-5)


def test_an_i_tap_expands_over_blocks_that_are_not_named_layers(dump_dir):
    """DBRX-style: the decoder's blocks are `transformer.blocks`, so no `layers` are found; a `{i}`
    tap expands over the indices whose module exists, from 0."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = torch.nn.Module()
            self.transformer.blocks = torch.nn.ModuleList([torch.nn.Linear(5, 5) for _ in range(3)])

        def forward(self, x):
            for block in self.transformer.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 5)
    with torch.no_grad():
        expected, h = [], x
        for block in model.transformer.blocks:
            expected.append(h := block(h))
    handle = compiledump.instrument(model, {"block{i}": "transformer.blocks.{i}"}, defaults=False)
    with torch.no_grad():
        model(x)
    arrays, _ = _load(compiledump.flush())
    handle.remove()
    assert sorted(handle.taps) == ["block0", "block1", "block2"]
    for i in range(3):
        np.testing.assert_allclose(arrays[f"block{i}"], expected[i][-1].numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no decoder layers found"):
        compiledump.instrument(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        compiledump.instrument(lambda x: x)


_COMMON = dict(vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)


# Decoder layers named otherwise: Nemotron-H's MoE block is the layer's `mixer`; LFM2-MoE's layers
# are `conv` or `self_attn`, its MLP `feed_forward`, its final norm `embedding_norm`; JetMoE's
# attention is `self_attention`.
_OTHER_NAMES = {
    "nemotron_h": dict(layers_block_type=["mamba", "moe", "attention", "moe"], n_routed_experts=8,
                       moe_intermediate_size=48, moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1,
                       head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                       chunk_size=8, use_mamba_kernels=False, intermediate_size=96),
    "lfm2_moe": dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_dense_layers=1,
                     layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "jetmoe": dict(intermediate_size=48, num_local_experts=8, kv_channels=16, num_key_value_heads=2),
}


@pytest.mark.parametrize("name", sorted(_OTHER_NAMES))
def test_default_taps_find_other_layer_names(dump_dir, name):
    """Each model's layers are found, `layer<i>` and `final_norm` hold what the model returns, the
    MoE blocks' outputs and routers are tapped where the router returns Hugging Face's (logits,
    weights, ids) and where JetMoE's returns its dispatch ids first and its logits last (its ids
    are then the top-k of those logits, as its router takes them); JetMoE's attention, a mixture
    of heads, has its router tapped as `layer<i>_attn_router`/`_attn_topk`."""
    compiledump.configure(moe_layers=4)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(name, **{**_COMMON, **_OTHER_NAMES[name]})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(9))
    blocks = {i: getattr(layer, "mixer" if name == "nemotron_h" else ("feed_forward" if name == "lfm2_moe" else "mlp"))
              for i, layer in enumerate(model.model.layers)}
    moe = [i for i, block in blocks.items() if any(isinstance(getattr(block, child, None), torch.nn.Module)
                                                   for child in ("experts", "router"))]
    outputs, routed = {}, {}
    hooks = [blocks[i].register_forward_hook(lambda _m, _a, out, i=i: outputs.__setitem__(i, out)) for i in moe]
    heads = {}  # JetMoE's attention routes each token to its heads too
    if name == "jetmoe":
        hooks += [blocks[i].router.register_forward_hook(lambda _m, _a, out, i=i: routed.__setitem__(i, out[-1]))
                  for i in moe]
        hooks += [layer.self_attention.experts.router.register_forward_hook(
            lambda _m, _a, out, i=i: heads.__setitem__(i, out[-1])) for i, layer in enumerate(model.model.layers)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = compiledump.instrument(model)
        out = _forward(model, ids)
        arrays, manifest = _load(compiledump.flush())
    handle.remove()
    for hook in hooks:
        hook.remove()
    assert moe and "final_norm" in handle.taps
    # Each layer's token mixer, as the comparator's hybrid caution reads it.
    assert manifest["mixers"] == {"nemotron_h": {"0": "mamba", "1": "mlp", "2": "attention", "3": "mlp"},
                                  "lfm2_moe": {"0": "conv", "1": "attention", "2": "conv", "3": "attention"},
                                  "jetmoe": {str(i): "attention" for i in range(4)}}[name]
    np.testing.assert_allclose(arrays["final_norm"], out.hidden_states[-1][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    for i in range(3):
        np.testing.assert_allclose(arrays[f"layer{i}"], out.hidden_states[i + 1][0, -1].numpy(), rtol=1e-5, atol=1e-6)
    messages = [str(w.message) for w in caught]
    for i in moe:
        block_out = outputs[i][0] if isinstance(outputs[i], tuple) else outputs[i]
        np.testing.assert_allclose(arrays[f"layer{i}_mlp"], block_out.reshape(7, -1)[-1].numpy(), rtol=1e-6, atol=1e-6)
        assert arrays[f"layer{i}_router"].shape == (7, 8) and arrays[f"layer{i}_topk"].shape == (7, 2)
        if name == "jetmoe":
            for tag, logits in ((f"layer{i}_router", routed[i]), (f"layer{i}_attn_router", heads[i])):
                np.testing.assert_allclose(arrays[tag], logits.numpy(), rtol=1e-6, atol=1e-6)
                np.testing.assert_array_equal(arrays[tag.replace("router", "topk")], torch.topk(logits, 2).indices.numpy())
        else:
            assert not [tag for tag in arrays if tag.endswith("_attn_router")]
    assert not [m for m in messages if "returns no floating-point logits" in m or "no router submodule" in m]


def test_gemma4_s_router_beside_its_dense_mlp_and_afmoe_s_pre_mlp_norm(dump_dir):
    """Gemma 4 keeps its MoE router and experts on the layer, beside a dense `mlp`, and its router
    returns softmax probabilities first: `layer<i>_router` holds their log (the logits up to a
    per-row constant: the same top-k and gaps), `layer<i>_topk` its ids. AFMoE normalises the
    residual stream after attention in `pre_mlp_layernorm`."""
    compiledump.configure(moe_layers=4)
    text = dict(_COMMON, intermediate_size=96, head_dim=16, enable_moe_block=True, num_experts=8, top_k_experts=2,
                moe_intermediate_size=48, hidden_size_per_layer_input=0, vocab_size_per_layer_input=211,
                sliding_window=16)
    del text["num_experts_per_tok"]
    torch.manual_seed(0)
    gemma = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gemma4", text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=True)).eval()
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(10))
    layer = gemma.model.language_model.layers[1] if hasattr(gemma.model, "language_model") else gemma.model.layers[1]
    got = []
    hook = layer.router.register_forward_hook(lambda _m, _a, out: got.append(out))
    handle = compiledump.instrument(gemma)
    _forward(gemma, ids)
    arrays, manifest = _load(compiledump.flush())
    handle.remove()
    hook.remove()
    probabilities, _, top = got[0]
    np.testing.assert_allclose(arrays["layer1_router"], np.log(probabilities.numpy()), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(arrays["layer1_topk"], top.numpy())
    assert handle.taps["layer1_router"].endswith("layers.1.router") and "layer1_mlp" in arrays  # the dense MLP
    # ... which is no MoE block's output: its decode steps get no MoE output allowance (a review found
    # the routed layers' list taken for it: its dense layer<i>_mlp_step_<n> got twice the thresholds)
    assert manifest["routing"]["routed"] == [0, 1, 2, 3] and manifest["routing"]["moe_outputs"] == []
    # Under the default MoE filter the dense MLP stays at every layer; the router beside it does not
    compiledump.reset()
    compiledump.configure(dir=str(dump_dir / "filtered"), moe_layers=2)
    handle = compiledump.instrument(gemma)
    _forward(gemma, ids)
    arrays, manifest = _load(compiledump.flush())
    handle.remove()
    assert "layer2_mlp" in arrays and "layer2_router" in manifest["filtered_tags"]
    compiledump.reset()
    compiledump.configure(dir=str(dump_dir / "afmoe"), moe_layers=4)

    torch.manual_seed(0)
    afmoe = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "afmoe", **_COMMON, intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_dense_layers=1,
        num_shared_experts=1, head_dim=16, sliding_window=16, global_attn_every_n_layers=2)).eval()
    norm_inputs = []
    hook = afmoe.model.layers[2].pre_mlp_layernorm.register_forward_pre_hook(lambda _m, args: norm_inputs.append(args[0]))
    handle = compiledump.instrument(afmoe)
    _forward(afmoe, ids)
    arrays, manifest = _load(compiledump.flush())
    handle.remove()
    hook.remove()
    np.testing.assert_allclose(arrays["layer2_attn"], norm_inputs[0][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    assert manifest["routers"]["layer2_router"]["score"] == "sigmoid"  # its expert_bias, on the MoE block
    assert manifest["routing"]["moe_outputs"] == [1, 2, 3]  # (layer 0 is dense)


def test_a_layer_that_runs_twice_in_one_forward_is_named_once(dump_dir):
    """A looped decoder (Inkling 2 Loop runs some layers twice per forward) keeps only the last
    pass under `layer<i>`: a warning names the layer. Two forwards of a plain decoder do not warn."""
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + self.self_attn(x)

    class Decoder(torch.nn.Module):
        def __init__(self, loop: bool):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([Layer() for _ in range(3)])
            self.loop = loop

        def forward(self, x):
            for layer in self.model.layers:
                x = layer(x)
            return self.model.layers[1](x) if self.loop else x

    x = torch.randn(1, 5, 8)
    for loop in (False, True):
        compiledump.reset()
        model = Decoder(loop)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = compiledump.instrument(model)
            with torch.no_grad():
                model(x)
                model(x)
                model.model.layers[0](x)  # layer by layer, as some engines call them
                model.model.layers[1](x)
        handle.remove()
        named = [str(w.message) for w in caught if "ran more than once" in str(w.message)]
        assert len(named) == (1 if loop else 0)
        if loop:
            assert "decoder layer model.layers.1 ran more than once in one forward" in named[0]
