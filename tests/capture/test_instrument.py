"""`compiledump.instrument(model)` on Hugging Face models built from config (random weights, nothing
downloaded), eagerly: which taps it attaches, that each dumped value equals what the model
computes (read from the model's own outputs and router, an independent path), batch rows, explicit
taps, `remove()`, bad input, compiled models, and the note at exit when nothing ran.
Compiled engines against references: tests/capture/test_hf_models.py."""

import importlib.util
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import compiledump
from compiledump.format.reader import DumpFile

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("hf_example", REPO / "examples" / "hf_reference_vs_compiled.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


def _load(path):
    manifest = json.loads(Path(path).with_suffix(".json").read_text())
    with np.load(path) as data:
        return {key: data[key] for key in data.files}, manifest


def _forward(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True)


def _router_ids(model, layer, ids):
    """What layer `layer`'s router returns for `ids` (its block is `mlp` or `feed_forward`, its
    router `gate` or `router`)."""
    block = getattr(model.model.layers[layer], "mlp", None) or model.model.layers[layer].feed_forward
    router = getattr(block, "router", None) or block.gate
    got = []
    hook = router.register_forward_hook(lambda _m, _a, out: got.append(out))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    return got[0]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "llama"])
def test_default_taps_capture_what_the_model_computes(dump_dir, name):
    compiledump.configure(moe_layers=4)
    model = ex.build_model(name)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    handle = compiledump.instrument(model)
    out = _forward(model, ids)
    arrays, manifest = _load(compiledump.flush())
    handle.remove()
    moe = name != "llama"
    expected_tags = {f"layer{i}{suffix}" for i in range(4) for suffix in
                     ("", "_attn", "_mlp") + (("_router", "_topk") if moe else ())}
    step_tags = {f"layer{i}_step_{what}" for i in range(4) for what in ("router", "topk")} if moe else set()
    step_tags |= {f"layer{i}_step" for i in range(4)}  # each layer's state at the logits' token
    assert set(handle.taps) == expected_tags | step_tags | {"final_norm", "logits", "input_token"}
    assert set(arrays) == expected_tags | {f"{tag}_0" for tag in step_tags} | {"final_norm", "logits_0", "input_token_0"}
    # The token the forward fed at the position whose logits logits_0 holds (the prompt's last).
    assert handle.taps["input_token"] == "model.embed_tokens:input"
    assert arrays["input_token_0"].tolist() == [ids[0, -1].item()]
    for i in range(3):  # hidden_states[i + 1] is layer i's output, last position (the last one is normed)
        np.testing.assert_allclose(arrays[f"layer{i}"], out.hidden_states[i + 1][0, -1].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(arrays[f"layer{i}_step_0"], out.hidden_states[i + 1][0, -1].numpy(), rtol=1e-6,
                                   atol=1e-6)
    np.testing.assert_allclose(arrays["final_norm"], out.hidden_states[4][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        normed = model.model.norm(torch.from_numpy(arrays["layer3"]))
    np.testing.assert_allclose(normed.detach().numpy(), arrays["final_norm"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(arrays["logits_0"], out.logits[0, -1].numpy(), rtol=1e-5, atol=1e-5)
    # The residual stream after attention: what post_attention_layernorm normalises.
    layer = model.model.layers[1]
    with torch.no_grad():
        normed = layer.post_attention_layernorm(torch.from_numpy(arrays["layer1_attn"]))
        rebuilt = torch.from_numpy(arrays["layer1_attn"]) + layer.mlp(normed[None, None])[0, 0]
    np.testing.assert_allclose(rebuilt.numpy(), arrays["layer1"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(arrays["layer1_mlp"], (rebuilt - torch.from_numpy(arrays["layer1_attn"])).numpy(),
                               rtol=1e-4, atol=1e-5)
    if moe:
        logits, _, top = _router_ids(model, 2, ids)
        np.testing.assert_array_equal(arrays["layer2_topk"], top.numpy())  # every prompt token: ids are whole
        # Every prompt row of the router logits (router_rows="all", the default), as the ids.
        np.testing.assert_allclose(arrays["layer2_router"], logits.numpy(), rtol=1e-6, atol=1e-6)
        assert manifest["keys"]["layer2_router"]["rows"] == "all" and "rows" not in manifest["keys"]["layer2"]
        # Step 0 (the prompt's last position, as logits_0) holds that token's routing too.
        np.testing.assert_allclose(arrays["layer2_step_router_0"], logits[-1].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(arrays["layer2_step_topk_0"], top[-1].numpy())
        assert manifest["keys"]["layer2_step_topk_0"]["source_dtype"] == "int64"
    assert manifest["keys"]["layer0"]["tokens"] == 7 and manifest["prompt_tokens"] == 7


@pytest.mark.parametrize("router_rows, env_rows, all_rows", [("one", "all", False), (None, "one", False),
                                                             (None, "all", True)])
def test_router_rows_keeps_the_last_row_or_follows_the_environment(dump_dir, router_rows, env_rows, all_rows):
    """`router_rows="one"` keeps the last prompt row of the router logits, None records them as
    the other taps (COMPILEDUMP_ROWS); the ids are whole either way."""
    compiledump.configure(moe_layers=4, rows=env_rows)
    model = ex.build_model("mixtral")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    handle = compiledump.instrument(model, router_rows=router_rows)
    _forward(model, ids)
    arrays, manifest = _load(compiledump.flush())
    handle.remove()
    logits, _, top = _router_ids(model, 1, ids)
    np.testing.assert_allclose(arrays["layer1_router"], (logits if all_rows else logits[-1]).numpy(), rtol=1e-6,
                               atol=1e-6)
    assert manifest["keys"]["layer1_router"].get("rows") == ("all" if all_rows else None)
    np.testing.assert_array_equal(arrays["layer1_topk"], top.numpy())


def test_router_rows_must_be_all_one_or_none():
    with pytest.raises(ValueError, match="router_rows must be 'all', 'one' or None, got 'last'"):
        compiledump.instrument(ex.build_model("mixtral"), router_rows="last")


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


def test_padded_batch_keeps_the_request_row(dump_dir):
    model = ex.build_model("qwen3_moe")
    g = torch.Generator().manual_seed(3)
    request = torch.randint(0, model.config.vocab_size, (1, 7), generator=g)
    batch = torch.cat([request, torch.randint(0, model.config.vocab_size, (3, 7), generator=g)])
    compiledump.instrument(model)
    out = _forward(model, batch)
    arrays, manifest = _load(compiledump.flush())
    alone = _forward(model, request)
    np.testing.assert_allclose(arrays["layer1"], out.hidden_states[2][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(arrays["layer1"], alone.hidden_states[2][0, -1].numpy(), rtol=1e-4, atol=1e-5)
    _, _, top = _router_ids(model, 1, request)
    np.testing.assert_array_equal(arrays["layer1_topk"], top.numpy())  # the request's 7 tokens, not 28
    assert manifest["keys"]["layer1_topk"]["tokens"] == 7


def test_all_rows_keep_every_prompt_position(dump_dir):
    compiledump.configure(rows="all")
    model = ex.build_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    compiledump.instrument(model)
    out = _forward(model, ids)
    arrays, manifest = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["layer1"], out.hidden_states[2][0].numpy(), rtol=1e-6, atol=1e-6)
    assert arrays["layer1"].shape == (7, model.config.hidden_size)
    assert manifest["keys"]["layer1"]["rows"] == "all" and manifest["keys"]["layer1"]["tokens"] == 7


def test_decode_steps_are_token_gated_and_logits_are_steps(dump_dir):
    model = ex.build_model("llama")
    inputs = ex.Inputs(model.config.vocab_size, steps=3, batch=1)
    compiledump.instrument(model)
    cache = ex.DynamicCache(config=model.config)
    with torch.no_grad():
        prefill = model(input_ids=inputs.prompt, **ex.cache_kwargs(model, cache), output_hidden_states=True)
        for n in range(3):
            model(input_ids=inputs.step(n)[:1], **ex.cache_kwargs(model, cache))
    arrays, manifest = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["layer0"], prefill.hidden_states[1][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    assert sorted(k for k in arrays if k.startswith("logits")) == ["logits_0", "logits_1", "logits_2", "logits_3"]
    assert manifest["tags"]["layer0"]["drops"] == {"token_gate": 3}
    assert manifest["keys"]["layer0"]["phase"] == "prefill"


def test_each_step_records_the_routing_of_its_logits_row(dump_dir):
    """`layer<i>_step_router_<n>`/`_step_topk_<n>` hold the routing of the token whose logits
    `logits_<n>` holds (the request, row 0 of a padded batch), read from the router itself, in
    the MoE layers the filter keeps (the default 2 here)."""
    model = ex.build_model("qwen3_moe")
    inputs = ex.Inputs(model.config.vocab_size, steps=3, batch=2)
    seen: dict[int, list] = {1: [], 3: []}
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(
        lambda _m, _a, out, i=i: seen[i].append((out[0].clone(), out[2].clone()))) for i in seen]
    first = compiledump.instrument(model)
    cache = ex.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=inputs.prefill(), **ex.cache_kwargs(model, cache))
        for n in range(3):
            model(input_ids=inputs.step(n), **ex.cache_kwargs(model, cache))
    for hook in hooks:
        hook.remove()
    path = compiledump.flush()
    arrays, manifest = _load(path)
    prompt = inputs.prompt.shape[1]
    for step, (logits, top) in enumerate(seen[1]):
        # The router sees [batch * seq, experts]: the request's last position is row seq - 1.
        row = prompt - 1 if step == 0 else 0
        np.testing.assert_allclose(arrays[f"layer1_step_router_{step}"], logits[row].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(arrays[f"layer1_step_topk_{step}"], top[row].numpy())
    assert not any(key.startswith(("layer3_step_router", "layer3_step_topk")) for key in arrays)
    assert manifest["filtered_tags"]["layer3_step_topk"] == "moe_layers"
    # Stored as float32; the reader gives a step of an integer tensor back as int32 ids.
    dump = DumpFile(path, "REF")
    assert dump.members["layer1_step_topk_2"].is_integer and dump.array("layer1_step_topk_2").dtype == np.int32
    # step_routing=False: no step routing, and nothing else missing (the layers' states of each step stay).
    first.remove()
    compiledump.reset()
    handle = compiledump.instrument(model, step_routing=False)
    cache = ex.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=inputs.prefill(), **ex.cache_kwargs(model, cache))
        model(input_ids=inputs.step(0), **ex.cache_kwargs(model, cache))
    handle.remove()
    arrays_without, _ = _load(compiledump.flush())
    routing = ("_step_router", "_step_topk")
    assert set(arrays_without) == {key for key in arrays if not any(what in key for what in routing)
                                   and not key.endswith(("_2", "_3"))}
    assert "layer3_step_1" in arrays_without and not any(what in tag for tag in handle.taps for what in routing)


def test_explicit_taps_inputs_and_remove(dump_dir):
    model = ex.build_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    seen = {}
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda _m, a, o: seen.update(x=a[0], y=o))
    handle = compiledump.instrument(model, {"layer{i}_q": "model.layers.{i}.self_attn.q_proj",
                                            "layer0_qin": "model.layers.0.self_attn.q_proj:input"}, defaults=False)
    _forward(model, ids)
    hook.remove()
    assert set(handle.taps) == {"layer0_q", "layer1_q", "layer2_q", "layer3_q", "layer0_qin"}
    arrays, _ = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["layer0_q"], seen["y"][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(arrays["layer0_qin"], seen["x"][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    handle.remove()
    compiledump.reset()
    _forward(model, ids)
    assert compiledump.flush() is None  # nothing hooked any more


def test_exclude_leaves_out_tags_and_what_depends_on_them(dump_dir):
    """`exclude` patterns (`{i}`: every layer) leave tags out of the hooks, the taps and the dump,
    with their steps: `layer{i}_mlp` alone; `layer1` with `layer1_step_<n>`; `layer{i}_router`
    with the picks and step routing of every layer. What is kept is captured as without `exclude`.
    The manifest names the patterns, and compared against a dump with every tag, the keys left out
    are one note naming them (either side), not a problem per key."""
    model = ex.build_model("qwen3_moe")
    inputs = ex.Inputs(model.config.vocab_size, steps=2, batch=1)
    patterns = ["layer{i}_mlp", "layer1", "layer{i}_router"]

    def run(name, **kwargs):
        compiledump.reset()
        compiledump.configure(dir=str(dump_dir / name))
        handle = compiledump.instrument(model, **kwargs)
        cache = ex.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=inputs.prompt, **ex.cache_kwargs(model, cache))
            for n in range(2):
                model(input_ids=inputs.step(n)[:1], **ex.cache_kwargs(model, cache))
        handle.remove()
        path = compiledump.flush()
        return handle, path, *_load(path)

    _, full_path, full, full_manifest = run("full")
    handle, kept_path, kept, manifest = run("kept", exclude=patterns)
    gone = {key for key in full if key.endswith("_mlp") or key == "layer1" or key.startswith("layer1_step_")
            or "_router" in key or "_topk" in key}
    assert {"layer0_mlp", "layer1", "layer1_step_1", "layer0_router", "layer1_step_topk_1"} <= gone
    assert set(kept) == set(full) - gone and {"layer0", "layer1_attn", "layer0_step_1", "logits_2"} <= set(kept)
    for key in kept:
        np.testing.assert_array_equal(kept[key], full[key], err_msg=key)
    assert not any(tag.endswith(("_mlp", "_router", "_topk")) for tag in handle.taps)
    assert "layer1" not in handle.taps and "layer1_step" not in handle.taps and "layer0_step" in handle.taps
    assert manifest["exclude"] == patterns and "exclude" not in full_manifest

    compared = {key for key in full if not (key.startswith("layer") and key.endswith("_step_0"))}  # (never are)
    for ref, run_, side in ((full_path, kept_path, "REF"), (kept_path, full_path, "RUN")):
        report = compiledump.compare.compare(ref, run_)
        (pair,) = report.pairs
        assert not pair.problems and report.exit_status == 0, pair.problems
        (note,) = [note for note in pair.notes if "instrument(exclude=" in note]
        other = "RUN" if side == "REF" else "REF"
        assert note.startswith(f"{side} has {len(gone & compared)} keys whose tags {other}'s instrument(exclude="
                               f"('layer{{i}}_mlp', 'layer1', 'layer{{i}}_router')) left out: not compared"), note
        assert {record.key for record in pair.keys} == compared - gone


def test_exclude_patterns_must_match_a_tag(dump_dir):
    model = ex.build_model("llama")
    with pytest.raises(ValueError, match=r"'layer{i}_router', 'layer9' match no tag attached \(tags: .*layer{i}_mlp"):
        compiledump.instrument(model, exclude=("layer{i}_router", "layer9", "layer{i}_mlp"))
    with pytest.raises(TypeError, match=r"exclude=\('logits',\)"):
        compiledump.instrument(model, exclude="logits")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    _forward(model, ids)
    assert compiledump.flush() is None  # the refused calls left no hook behind


def test_bad_arguments_are_clear_errors(dump_dir):
    model = ex.build_model("llama")
    with pytest.raises(ValueError, match=r"no module at 'model.layers.{i}.nope' \(.*e.g. 'model'\)"):
        compiledump.instrument(model, {"x{i}": "model.layers.{i}.nope"}, defaults=False)


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




def test_a_compiled_model_is_retraced_with_the_hooks(dump_dir):
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6)])
            self.layers[0].self_attn = torch.nn.Identity()

        def forward(self, x):
            return self.layers[0](x)

    toy = Toy()
    compiled = torch.compile(toy, fullgraph=True)
    x = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(6))
    compiled(x)  # traced without hooks
    with pytest.warns(RuntimeWarning, match="cleared dynamo's caches"):
        compiledump.instrument(compiled)
    expected = compiled(x)
    arrays, _ = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["layer0"], expected[0, -1].detach().numpy(), rtol=1e-6)


def test_record_says_how_it_reads_an_ambiguous_3d_tensor(dump_dir):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 7, 64, generator=g)  # [batch, seq, hidden], passed as is
    with pytest.warns(RuntimeWarning, match=r"\[1, 7, 64\] tensor is read as \[tokens, hc_mult, dim\]") as caught:
        compiledump.record("h", hidden)
        compiledump.record("h", hidden)
    assert sum("read as" in str(w.message) for w in caught) == 1  # once per tag
    compiledump.record("flat", hidden, layout="batch_seq_dim")
    compiledump.record("hc", torch.randn(7, 4, 64, generator=g))  # a plausible hc_mult: no warning
    compiledump.record("confirmed", hidden, layout="tokens_hc_dim")
    arrays, _ = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["h"], hidden[0].mean(0).numpy(), rtol=1e-6)  # what the warning said
    np.testing.assert_allclose(arrays["flat"], hidden[0, -1].numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="layout must be one of"):
        compiledump.record("x", hidden, layout="bsd")
    with pytest.raises(ValueError, match="needs a 3-D tensor"):
        compiledump.record("x", hidden[0], layout="batch_seq_dim")
    with pytest.raises(ValueError, match="does not combine with once=True"):
        compiledump.record("x", hidden[0], once=True, rows="all")


@pytest.mark.parametrize("case, script, expected", [
    ("nothing captured", "compiledump.configure(dir=DIR)", "nothing was captured"),
    ("hooks after compile",
     """
     model = torch.nn.Module()
     model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
     model.layers[0].self_attn = torch.nn.Identity()
     forward = torch.compile(lambda x: model.layers[0](x))
     forward(torch.randn(2, 4))
     compiledump.configure(dir=DIR)
     compiledump.instrument(model)
     forward(torch.randn(2, 4))  # code traced before instrument(): the hooks never run
     """, "its capture hooks never ran"),
])
def test_silence_is_reported_at_exit(tmp_path, case, script, expected):
    code = "import torch, compiledump\nDIR = " + repr(str(tmp_path)) + "\n" + textwrap.dedent(script)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert expected in out.stderr, out.stderr[-2000:]


def test_no_silence_note_after_a_dump_was_written(tmp_path):
    """A script that flushed its dump and then called reset() (tests, notebooks, one dump per
    request) captured plenty: the exit note "nothing was captured" would be false."""
    code = textwrap.dedent(f"""
        import torch, compiledump
        compiledump.configure(dir={str(tmp_path)!r})
        compiledump.record("h", torch.randn(3, 8))
        print(compiledump.flush())
        compiledump.reset()
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).exists()
    assert "nothing was captured" not in out.stderr, out.stderr[-2000:]


def test_an_engine_gate_returning_logits_and_none_records_the_logits_only(dump_dir):
    """vLLM's and SGLang's MoE gates are linear layers returning (logits, output_bias=None), on flat
    [tokens, hidden] states; their fused MoE picks the experts by a rule not visible here. The
    router logits are recorded (the last token's row), no ids and no step routing."""
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 6, bias=False)

        def forward(self, x):
            return self.linear(x), None

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.gate, self.experts = 2, Gate(), torch.nn.Linear(8, 8)

        def forward(self, x):
            logits, _ = self.gate(x)
            seen.append(logits.detach().clone())
            return self.experts(x)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.post_attention_layernorm, self.mlp = torch.nn.Identity(), torch.nn.Identity(), Block()

        def forward(self, x):
            return x + self.mlp(self.post_attention_layernorm(x + self.self_attn(x)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(20, 8)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(2))

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            for layer in self.layers:
                x = layer(x)
            return x

    seen: list[torch.Tensor] = []
    model = Model()
    handle = compiledump.instrument(model)
    with torch.no_grad():
        model(torch.tensor([3, 5, 7, 11, 13]))  # flat: five tokens of one request
    arrays, _ = _load(compiledump.flush())
    handle.remove()
    np.testing.assert_array_equal(arrays["layer0_router"], seen[0].numpy())  # every row: router_rows="all"
    np.testing.assert_array_equal(arrays["layer1_router"], seen[1].numpy())
    assert not any("topk" in key or "step_router" in key for key in arrays), sorted(arrays)


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
