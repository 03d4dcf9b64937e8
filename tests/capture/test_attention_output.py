"""Attention's own output beside an MLP is recorded as `layer<i>_mixer` (thirtieth session): before,
only the residual stream after it (`layer<i>_attn`) was, and a bf16 x1.05 bug in `o_proj`, `v_proj`
or the norm before attention, diluted by the stream, read 0.4-0.96 of the thresholds there and
exited 0 (a bf16 bug-injection audit: OLMoE, Mixtral, PhiMoE, GPT-OSS, Gemma 3, Granite). In a
model with MoE layers it follows COMPILEDUMP_MOE_LAYERS (a near-tie flip of another token's
unrecorded routing moved it past the thresholds in honest pairs); a linear-attention mixer beside
an MLP is not recorded (its own bf16 rounding exceeds the defaults). Values against this test's
own hooks."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
import transformers

from compiledump.compare import compare, format_report
from helpers.hf_dump import dump_run, load_dump, prompt_then_steps
from helpers.hf_models import from_config

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, num_local_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)
IDS = torch.randint(3, 160, (1, 9), generator=torch.Generator().manual_seed(3))


def build(kind: str, seed: int, init: float = 0.02, **extra) -> transformers.PreTrainedModel:
    return from_config(kind, seed, **SMALL, initializer_range=init, **extra)


def session(model):
    return prompt_then_steps(model, IDS)


@pytest.mark.parametrize("kind, kept", [("llama", [0, 1, 2, 3]), ("olmoe", [0, 1])])
def test_attention_output_is_recorded_before_the_stream_after_it(tmp_path, kind, kept):
    model = build(kind, 0)
    got: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda _m, _a, out, i=i: got.setdefault(i, []).append(out[0][0, -1].detach().clone()))
        for i, layer in enumerate(model.model.layers)]
    arrays, manifest = load_dump(dump_run(model, tmp_path, session(model)))
    for hook in hooks:
        hook.remove()
    for i in kept:
        np.testing.assert_array_equal(arrays[f"layer{i}_mixer"], got[i][0].numpy())
        for step in (1, 2, 3):  # the step rows (step 0 is the prompt's last row)
            np.testing.assert_array_equal(arrays[f"layer{i}_mixer_step_{step}"], got[i][step].numpy())
        assert manifest["keys"][f"layer{i}_mixer"]["order"] < manifest["keys"][f"layer{i}_attn"]["order"]
    for i in sorted(set(range(4)) - set(kept)):  # an MoE model's, past COMPILEDUMP_MOE_LAYERS=2
        assert f"layer{i}_mixer" not in arrays and manifest["filtered_tags"][f"layer{i}_mixer"] == "moe_layers"


def _tiny(kind: str, **fields):
    return from_config(kind, 0, vocab_size=160, max_position_embeddings=64, **fields)


RESIDUAL_ADDING = {  # attention modules that add the residual themselves, and where their own output is
    "bloom": (lambda: _tiny("bloom", hidden_size=64, n_layer=3, n_head=4), "transformer.h.1.self_attention.dense"),
    "bert": (lambda: _tiny("bert", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                           is_decoder=True), "bert.encoder.layer.1.attention.output.dense"),
    "dbrx": (lambda: _tiny("dbrx", d_model=64, n_heads=4, n_layers=3, max_seq_len=64,
                           attn_config=dict(kv_n_heads=2, rope_theta=10000, clip_qkv=8.0),
                           ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)),
             "transformer.blocks.1.norm_attn_norm.attn"),
}


@pytest.mark.parametrize("kind", sorted(RESIDUAL_ADDING))
def test_attention_that_adds_the_residual_itself_is_read_before_it(tmp_path, kind):
    """Bloom's attention takes the residual and adds it, BERT's `output` adds it and normalises,
    DBRX's `norm_attn_norm` returns it first: the module whose output is attention's own is tapped
    (a review found `layer<i>_mixer` a byte-identical copy of `layer<i>_attn` there)."""
    build, inner = RESIDUAL_ADDING[kind]
    model = build()
    got = []
    hook = model.get_submodule(inner).register_forward_hook(
        lambda _m, _a, out: got.append((out[0] if isinstance(out, tuple) else out)[0, -1].detach().clone()))
    ids = torch.randint(3, 150, (1, 7), generator=torch.Generator().manual_seed(0))
    arrays, manifest = load_dump(dump_run(model, tmp_path, lambda: model(input_ids=ids, use_cache=False)))
    hook.remove()
    np.testing.assert_array_equal(arrays["layer1_mixer"], got[0].numpy())
    assert np.abs(arrays["layer1_mixer"] - arrays["layer1_attn"]).max() > 1e-3
    assert manifest["keys"]["layer1_mixer"]["order"] < manifest["keys"]["layer1_attn"]["order"]


def test_gemma4s_experts_beside_its_mlp_make_it_an_moe_model(tmp_path):
    """Gemma 4 keeps its router and experts on the layer, beside a dense `mlp`: attention's output
    follows COMPILEDUMP_MOE_LAYERS there too (a review found it recorded at every layer)."""
    text = dict(vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, intermediate_size=96,
                head_dim=16, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=48,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=211, sliding_window=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gemma4", text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=True)).eval()
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(10))
    arrays, manifest = load_dump(dump_run(model, tmp_path, lambda: model(input_ids=ids, use_cache=False)))
    assert {"layer0_mixer", "layer1_mixer", "layer1_router"} <= arrays.keys()
    assert manifest["filtered_tags"]["layer3_mixer"] == manifest["filtered_tags"]["layer3_router"] == "moe_layers"


def test_a_linear_attention_mixer_beside_an_mlp_is_not_recorded(tmp_path):
    model = build("qwen3_next", 0, layer_types=["linear_attention", "full_attention"] * 2, n_shared_experts=1,
                  shared_expert_intermediate_size=32)
    arrays, manifest = load_dump(dump_run(model, tmp_path, lambda: model(input_ids=IDS, use_cache=False)))
    assert "layer1_mixer" in arrays and "layer0_mixer" not in arrays
    assert "layer0_mixer" not in manifest["filtered_tags"]  # not tapped at all
    assert manifest["mixers"] == {"0": "linear_attn", "1": "attention", "2": "linear_attn", "3": "attention"}


@pytest.mark.parametrize("kind, module, seed", [("olmoe", "self_attn.o_proj", 0), ("olmoe", "self_attn.v_proj", 1),
                                                ("mixtral", "input_layernorm", 0), ("llama", "self_attn.o_proj", 2)])
def test_a_five_percent_attention_bug_in_bf16_is_named_at_attentions_output(tmp_path, kind, module, seed):
    reference = build(kind, seed, init=0.1)  # a trained model's sublayers weigh more than 0.02's
    dump_run(reference, tmp_path / "ref", session(reference))
    honest = copy.deepcopy(reference).to(torch.bfloat16)
    report = compare(tmp_path / "ref", dump_run(honest, tmp_path / "honest", session(honest)))
    assert report.exit_status == 0, format_report(report)[-1]
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    engine.model.layers[1].get_submodule(module).register_forward_hook(lambda _m, _a, out: out * 1.05)
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", session(engine)))
    first = report.first_divergence
    assert report.exit_status == 1 and first.key == "layer1_mixer", format_report(report)[-1]
    assert first.last_good in ("layer0", "layer0_step_3"), format_report(report)[-1]


def test_an_older_dump_without_attention_output_is_a_note_not_a_problem(tmp_path):
    model = build("llama", 0)
    new = dump_run(model, tmp_path / "new", session(model))
    arrays, manifest = load_dump(new)
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    np.savez(old_dir / "compiledump_old.npz", **{k: v for k, v in arrays.items() if "_mixer" not in k})
    manifest["keys"] = {k: v for k, v in manifest["keys"].items() if "_mixer" not in k}
    manifest["tags"] = {k: v for k, v in manifest["tags"].items() if "_mixer" not in k}
    (old_dir / "compiledump_old.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = compare(old_dir / "compiledump_old.npz", new)
    assert report.exit_status == 0 and report.problems == [], report.problems
    (note,) = [line for line in report.notes if "token mixer's own output" in line]
    assert note.startswith("RUN holds 16 keys")  # 4 layers x (the prompt's row + 3 decode steps' rows)


def test_an_attention_bug_after_jetmoes_attention_router_keeps_the_one_row_note(tmp_path):
    """JetMoE's attention routes heads (`layer<i>_attn_router`, captured inside attention, before its
    output): the last good key is then in the same layer, and the one-row note, that attention mixes
    in other tokens, must still be given for `layer1_mixer` (a review found it lost)."""
    config = transformers.AutoConfig.for_model(
        "jetmoe", vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2, intermediate_size=48, num_local_experts=8, kv_channels=16,
        initializer_range=0.1)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    engine = copy.deepcopy(reference)
    engine.model.layers[1].self_attention.register_forward_hook(lambda _m, _a, out: (out[0] * 1.05, *out[1:]))
    ids = torch.randint(3, 211, (1, 9), generator=torch.Generator().manual_seed(9))
    dump_run(reference, tmp_path / "ref", lambda: reference(input_ids=ids, use_cache=False))
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", lambda: engine(input_ids=ids, use_cache=False)))
    first = report.first_divergence
    assert (first.key, first.last_good) == ("layer1_mixer", "layer1_attn_router"), format_report(report)[-1]
    assert any("holds the prompt's last token only" in note for note in report.notes), report.notes
