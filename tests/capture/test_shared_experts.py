"""A shared expert inside an MoE block, which every token runs and whose output the block adds to
the routed experts' (Qwen2-MoE's and Qwen3-Next's `shared_expert`, the DeepSeek family's, GLM-4-MoE's
and ERNIE 4.5's `shared_experts`, Hunyuan V1's `shared_mlp`), is recorded as `layer<i>_shared_mlp`
(thirty-first session): before, only the block's output held it, where the routed experts' diluted
it, and a bf16 x1.05 bug there exited 0 (a bf16 bug-injection audit: Qwen2-MoE, Qwen3-Next,
Llama 4, ERNIE 4.5). As an MoE internal it follows COMPILEDUMP_MOE_LAYERS. Values against this
test's own hooks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

import compiledump
from compiledump.compare import compare, format_report
from helpers.hf_dump import dump_run, load_dump

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, tie_word_embeddings=False)
IDS = torch.randint(3, 160, (1, 9), generator=torch.Generator().manual_seed(3))
# (kind, the MoE block's attribute and its shared expert's, the MoE layers: GLM's first is dense)
MODELS = {"qwen2_moe": ("mlp", "shared_expert", [0, 1, 2, 3]), "glm4_moe": ("mlp", "shared_experts", [1, 2, 3])}


def build(kind: str, seed: int, init: float = 0.02) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(kind, **SMALL, initializer_range=init)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def session(model):
    def run():
        out = model(input_ids=IDS, use_cache=True)
        for token in (5, 17, 42):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return run


def shared_expert(model, kind: str, i: int) -> torch.nn.Module:
    block, shared, _ = MODELS[kind]
    return getattr(getattr(model.model.layers[i], block), shared)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_shared_expert_is_recorded_inside_the_moe_block(tmp_path, kind):
    model = build(kind, 0)
    got: dict[int, list[torch.Tensor]] = {}
    moe = [i for i in MODELS[kind][2] if i < 2]  # under COMPILEDUMP_MOE_LAYERS=2
    hooks = [shared_expert(model, kind, i).register_forward_hook(
        lambda _m, _a, out, i=i: got.setdefault(i, []).append(out.reshape(-1, 64)[-1].detach().clone()))
        for i in moe]
    arrays, manifest = load_dump(dump_run(model, tmp_path, session(model)))
    for hook in hooks:
        hook.remove()
    for i in moe:
        np.testing.assert_array_equal(arrays[f"layer{i}_shared_mlp"], got[i][0].numpy())
        for step in (1, 2, 3):  # the step rows (step 0 is the prompt's last row)
            np.testing.assert_array_equal(arrays[f"layer{i}_shared_mlp_step_{step}"], got[i][step].numpy())
        # inside the block: after the stream it reads, before the block's output
        assert manifest["keys"][f"layer{i}_attn"]["order"] < manifest["keys"][f"layer{i}_shared_mlp"]["order"] \
            < manifest["keys"][f"layer{i}_mlp"]["order"]
    for i in (2, 3):  # past COMPILEDUMP_MOE_LAYERS=2, as the block's output
        assert f"layer{i}_shared_mlp" not in arrays and manifest["filtered_tags"][f"layer{i}_shared_mlp"] == "moe_layers"
    assert ("layer0_shared_mlp" in arrays) == (0 in moe)  # (GLM's layer 0 is dense: no shared expert)
    assert manifest["routing"]["moe_outputs"] == MODELS[kind][2]  # the blocks, not their shared experts (dense)
    handle = compiledump.instrument(model)
    assert handle.taps["layer1_shared_mlp"] == handle.taps["layer1_shared_mlp_step"] == \
        f"model.layers.1.mlp.{MODELS[kind][1]}"
    handle.remove()


@pytest.mark.parametrize("kind, dtype, scale, decode_only", [
    ("qwen2_moe", torch.bfloat16, 1.05, False), ("glm4_moe", torch.bfloat16, 1.05, False),
    ("qwen2_moe", torch.float32, 1.01, True)])
def test_a_bug_in_the_shared_expert_is_named_there(tmp_path, kind, dtype, scale, decode_only):
    reference = build(kind, 1, init=0.1)
    dump_run(reference, tmp_path / "ref", session(reference))
    engine = copy.deepcopy(reference).to(dtype)

    def bug(_module, args, out):
        return out if decode_only and args[0].reshape(-1, 64).shape[0] != 1 else out * scale
    shared_expert(engine, kind, 1).register_forward_hook(bug)
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", session(engine)))
    first = report.first_divergence
    want = "layer1_shared_mlp_step_1" if decode_only else "layer1_shared_mlp"
    assert report.exit_status == 1 and first.key == want, format_report(report)[-1]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_honest_bf16_pairs_pass_with_the_shared_expert_recorded(tmp_path, kind):
    """The same pairs without the bug: the shared expert's thresholds are a dense MLP's, and its
    bf16 rounding stays within them."""
    for seed in (1, 2):
        reference = build(kind, seed, init=0.1)
        dump_run(reference, tmp_path / f"ref{seed}", session(reference))
        engine = copy.deepcopy(reference).to(torch.bfloat16)
        report = compare(tmp_path / f"ref{seed}", dump_run(engine, tmp_path / f"run{seed}", session(engine)))
        assert report.exit_status == 0, format_report(report)[-1]
        assert any(record.key == "layer1_shared_mlp" for record in report.keys)
