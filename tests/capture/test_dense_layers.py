"""`instrument`'s taps of a dense layer's attention and MLP are kept at every layer, whatever
COMPILEDUMP_MOE_LAYERS says (it limits MoE layers' internals): with the default of 2 a dense model's
`layer<N>_attn`/`_mlp` for N >= 2 were filtered, so a bug inside a later MLP showed only in the
layer's output, diluted by the residual stream, and was missed or named a layer late (an audit
of 35 dense Hugging Face architectures: a bf16 x1.10 MLP bug at layer 2 missed on all of them at
transformers' default weight scale). Every setting here is the default one."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import transformers

from compiledump.compare import compare, format_report
from helpers.hf_dump import dump_run, load_dump

LAYERS = 5
SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def qwen2(seed: int, init: float = 0.1) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, initializer_range=init)).eval()


def gemma(seed: int, init: float = 0.02) -> transformers.PreTrainedModel:
    """Gemma scales its embeddings by sqrt(hidden): a sublayer's bug is a small part of the stream."""
    torch.manual_seed(seed)
    config = transformers.GemmaConfig(**SMALL, head_dim=16, initializer_range=init)
    return transformers.GemmaForCausalLM(config).eval()


def qwen3_moe_mixed(seed: int) -> transformers.PreTrainedModel:
    """MoE layers with a dense MLP at layer 3 (`mlp_only_layers`)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         mlp_only_layers=[3], initializer_range=0.1)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def prompt(vocab: int = SMALL["vocab_size"], tokens: int = 9) -> torch.Tensor:
    return torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(7))


def dump_prompt(model, directory, ids) -> str:
    return dump_run(model, directory, lambda: model(input_ids=ids, use_cache=False))


def own_taps(model, ids) -> dict[str, np.ndarray]:
    """The last prompt row of each layer's post-attention norm input and MLP output, read by hooks of
    this test's own."""
    got = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda _m, args, i=i: got.__setitem__(f"layer{i}_attn", args[0][0, -1].float().numpy())))
        handles.append(layer.mlp.register_forward_hook(
            lambda _m, _a, out, i=i: got.__setitem__(f"layer{i}_mlp", (out[0] if isinstance(out, tuple) else out)[0, -1]
                                                     .float().numpy())))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for handle in handles:
        handle.remove()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_model_keeps_attention_and_mlp_at_every_layer(tmp_path, dtype):
    model = qwen2(seed=3).to(dtype)
    ids = prompt()
    arrays, manifest = load_dump(dump_prompt(model, tmp_path, ids))
    expected = own_taps(model, ids)
    assert manifest["config"]["moe_layers"] == 2 and manifest["filtered_tags"] == {}
    for i in range(LAYERS):
        for tag in (f"layer{i}_attn", f"layer{i}_mlp"):
            np.testing.assert_array_equal(arrays[tag], expected[tag], err_msg=tag)


def test_an_moe_model_keeps_attention_everywhere_and_its_moe_internals_below_moe_layers(tmp_path):
    model = qwen3_moe_mixed(seed=1)
    ids = prompt()
    arrays, manifest = load_dump(dump_prompt(model, tmp_path, ids))
    expected = own_taps(model, ids)
    for i in range(LAYERS):
        np.testing.assert_array_equal(arrays[f"layer{i}_attn"], expected[f"layer{i}_attn"])
    # Layer 3's dense MLP at every setting; the MoE blocks' output and routing only below 2: a flip
    # the filter hid would otherwise read as the block's divergence.
    for i in (0, 1, 3):
        np.testing.assert_array_equal(arrays[f"layer{i}_mlp"], expected[f"layer{i}_mlp"])
    for i in (2, 4):
        assert {f"layer{i}_mlp", f"layer{i}_router", f"layer{i}_topk"} <= manifest["filtered_tags"].keys()
        assert f"layer{i}_mlp" not in arrays
    assert "layer3_router" not in manifest["filtered_tags"] and "layer1_topk" in arrays


def scaled_mlp(model, layer: int, factor: float):
    engine = copy.deepcopy(model)
    with torch.no_grad():
        engine.model.layers[layer].mlp.down_proj.weight.mul_(factor)
    return engine


def verdict(tmp_path, reference, engine, ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = compare(dump_prompt(reference, tmp_path / "ref", ids), dump_prompt(engine, tmp_path / "run", ids))
    return report, format_report(report)[-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("layer", [2, 4])
def test_a_bf16_engines_mlp_bug_past_layer_1_is_named_at_that_mlp(tmp_path, seed, layer):
    reference = qwen2(seed)
    ids = prompt()
    report, last = verdict(tmp_path / "honest", reference, copy.deepcopy(reference).to(torch.bfloat16), ids)
    assert report.exit_status == 0, last
    report, last = verdict(tmp_path / "bug", reference, scaled_mlp(reference, layer, 1.10).to(torch.bfloat16), ids)
    assert report.exit_status == 1 and report.first_divergence.key == f"layer{layer}_mlp", last


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_fp32_one_percent_mlp_bug_under_gemmas_embedding_scale_is_named_at_its_layer(tmp_path, seed):
    """Seed 1 was named at layer 3 when only `layer2` (the stream) showed layer 2."""
    reference = gemma(seed)
    report, last = verdict(tmp_path, reference, scaled_mlp(reference, 2, 1.01), prompt())
    assert report.exit_status == 1 and report.first_divergence.key == "layer2_mlp", last
