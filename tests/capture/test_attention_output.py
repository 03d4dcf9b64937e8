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
from helpers.hf_dump import dump_run, load_dump

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, num_local_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)
IDS = torch.randint(3, 160, (1, 9), generator=torch.Generator().manual_seed(3))


def build(kind: str, seed: int, init: float = 0.02, **extra) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(kind, **SMALL, initializer_range=init, **extra)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def session(model):
    def run():
        out = model(input_ids=IDS, use_cache=True)
        for token in (5, 17, 42):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return run


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
