"""`compiledump.instrument(model)` on Hugging Face models built from config (random weights, nothing
downloaded), eagerly: which taps it attaches, that each dumped value equals what the model
computes (read from the model's own outputs and router, an independent path), batch rows, decode
steps and their routing, an engine's gate. Explicit taps, `exclude`, `remove()`, bad input, compiled
models and the note at exit: tests/capture/test_instrument_options.py.
Decoders laid out otherwise: tests/capture/test_instrument_layouts.py. Compiled engines against
references: tests/capture/test_hf_models.py."""

import numpy as np
import pytest
import torch

import compiledump
from compiledump.format.reader import DumpFile
from helpers.hf_dump import forward_hidden as _forward, load_dump as _load, router_output as _router_ids
from helpers.hf_example import ex


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
                     ("", "_mixer", "_attn", "_mlp") + (("_router", "_topk") if moe else ())}
    step_tags = {f"layer{i}_step_{what}" for i in range(4) for what in ("router", "topk")} if moe else set()
    step_tags |= {f"layer{i}_step" for i in range(4)}  # each layer's state at the logits' token
    # and after its attention, attention's own output and its MLP's (moe_layers=4 keeps every MoE block)
    step_tags |= {f"layer{i}_{part}_step" for i in range(4) for part in ("mixer", "attn", "mlp")}
    assert set(handle.taps) == expected_tags | step_tags | {"final_norm", "logits", "input_token", "prompt_mask"}
    assert handle.taps["prompt_mask"] == "model:attention_mask"  # _forward passes none: nothing recorded
    # A step tag is listed where its tag is: the stream after attention is a norm's input
    assert handle.taps["layer1_attn_step"] == handle.taps["layer1_attn"] == "model.layers.1.post_attention_layernorm:input"
    assert handle.taps["layer1_mlp_step"] == handle.taps["layer1_mlp"] == "model.layers.1.mlp"
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
    """The prompt's keys are written once; the logits, each layer's state and each MLP's own output
    (`layer<i>_mlp_step_<n>`), and the stream after its attention (`layer<i>_attn_step_<n>`, what
    its MLP's norm reads), read here by the test's own hooks, are kept at every forward's last
    position."""
    model = ex.build_model("llama")
    inputs = ex.Inputs(model.config.vocab_size, steps=3, batch=1)
    compiledump.instrument(model)
    seen = {i: [] for i in (0, 2)}
    streams = {i: [] for i in seen}
    hooks = [model.model.layers[i].mlp.register_forward_hook(lambda _m, _a, out, i=i: seen[i].append(out[0, -1].clone()))
             for i in seen]
    hooks += [model.model.layers[i].post_attention_layernorm.register_forward_pre_hook(
        lambda _m, args, i=i: streams[i].append(args[0][0, -1].clone())) for i in seen]
    cache = ex.DynamicCache(config=model.config)
    with torch.no_grad():
        prefill = model(input_ids=inputs.prompt, **ex.cache_kwargs(model, cache), output_hidden_states=True)
        for n in range(3):
            model(input_ids=inputs.step(n)[:1], **ex.cache_kwargs(model, cache))
    for hook in hooks:
        hook.remove()
    arrays, manifest = _load(compiledump.flush())
    for i, rows in seen.items():
        assert len(rows) == 4 and manifest["keys"][f"layer{i}_mlp_step_3"]["kind"] == "step"
        for step, (row, stream) in enumerate(zip(rows, streams[i])):
            np.testing.assert_allclose(arrays[f"layer{i}_mlp_step_{step}"], row.numpy(), rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(arrays[f"layer{i}_attn_step_{step}"], stream.numpy(), rtol=1e-6, atol=1e-6)
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
    assert not any(key.startswith(("layer3_step_router", "layer3_step_topk", "layer3_mlp")) for key in arrays)
    assert manifest["filtered_tags"]["layer3_step_topk"] == "moe_layers"
    # The MoE block's own output at each step follows the same filter as its prompt rows.
    assert manifest["filtered_tags"]["layer3_mlp_step"] == "moe_layers" and "layer1_mlp_step_3" in arrays
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


def _deepseek_v3(first_dense: int) -> torch.nn.Module:
    from helpers.hf_models import from_config

    return from_config(
        "deepseek_v3", 0, vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=first_dense,
        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, head_dim=8)


def _filter_warnings(model) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiledump.instrument(model).remove()
    return [str(w.message) for w in caught if "first MoE layer" in str(w.message)]


def test_a_model_whose_moe_layers_all_lie_past_the_moe_filter_is_warned(dump_dir):
    """DeepSeek-V3's (and GLM-4.5's) first three layers are dense: under the default
    COMPILEDUMP_MOE_LAYERS=2 nothing of its routing was recorded, and nothing said so."""
    model = _deepseek_v3(first_dense=3)
    (message,) = _filter_warnings(model)
    assert "first MoE layer is layer 3, at or past COMPILEDUMP_MOE_LAYERS=2" in message
    assert "COMPILEDUMP_MOE_LAYERS=5" in message and "configure(moe_layers=5)" in message
    compiledump.configure(moe_layers=5)  # the fix it names: layers 3 and 4 recorded
    assert _filter_warnings(model) == []
    compiledump.instrument(model)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 160, (1, 7), generator=torch.Generator().manual_seed(1)))
    arrays, _ = _load(compiledump.flush())
    assert {"layer3_router", "layer3_topk", "layer4_topk", "layer3_shared_mlp"} <= set(arrays)
    compiledump.configure(moe_layers=0)  # nothing of the MoE layers wanted, as said
    assert _filter_warnings(model) == []
    compiledump.configure(moe_layers=2)
    assert _filter_warnings(_deepseek_v3(first_dense=1)) == []  # layer 1 kept
