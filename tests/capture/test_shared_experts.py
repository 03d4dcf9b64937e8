"""A shared expert inside an MoE block, which every token runs and whose output the block adds to
the routed experts' (Qwen2-MoE's and Qwen3-Next's `shared_expert`, the DeepSeek family's, GLM-4-MoE's
and ERNIE 4.5's `shared_experts`, Hunyuan V1's `shared_mlp`), is recorded as `layer<i>_shared_mlp`
(thirty-first session): before, only the block's output held it, diluted by the routed experts',
and a bf16 x1.05 bug there exited 0 (a bf16 bug-injection audit: Qwen2-MoE, Qwen3-Next, Llama 4,
ERNIE 4.5). What is recorded is what the block adds, the same on every engine: Qwen2-MoE's sigmoid
gate applied (vLLM applies it inside the shared expert), a tensor-parallel rank's partial sum
declared a sum. Values against this test's own hooks."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import compiledump
from compiledump.capture import parallel
from compiledump.compare import compare, format_report
from helpers.hf_dump import dump_run, load_dump, prompt_then_steps
from helpers.hf_models import from_config

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, tie_word_embeddings=False)
IDS = torch.randint(3, 160, (1, 9), generator=torch.Generator().manual_seed(3))
# kind: (its shared expert's name, the MoE layers: GLM's first is dense)
MODELS = {"qwen2_moe": ("shared_expert", [0, 1, 2, 3]), "glm4_moe": ("shared_experts", [1, 2, 3])}


def build(kind: str, seed: int, init: float = 0.02, **extra) -> transformers.PreTrainedModel:
    return from_config(kind, seed, **{**SMALL, **extra}, initializer_range=init)


def session(model):
    return prompt_then_steps(model, IDS)


def last_row(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1, 64)[-1].detach().clone().numpy()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_shared_expert_is_recorded_as_the_block_adds_it(tmp_path, kind):
    model = build(kind, 0)
    name, moe_layers = MODELS[kind]
    kept = [i for i in moe_layers if i < 2]  # under COMPILEDUMP_MOE_LAYERS=2
    got: dict[str, list[np.ndarray]] = {}

    def shared_hook(i):
        block = model.model.layers[i].mlp

        def hook(_module, args, out):
            if kind == "qwen2_moe":  # the block adds it through its sigmoid gate (F.sigmoid(gate(x)) * out)
                out = F.sigmoid(block.shared_expert_gate(args[0])) * out
            got.setdefault(f"layer{i}_shared_mlp", []).append(last_row(out))
        return hook
    hooks = [getattr(model.model.layers[i].mlp, name).register_forward_hook(shared_hook(i)) for i in kept]
    arrays, manifest = load_dump(dump_run(model, tmp_path, session(model)))
    for hook in hooks:
        hook.remove()
    for i in kept:
        tag = f"layer{i}_shared_mlp"
        np.testing.assert_array_equal(arrays[tag], got[tag][0])
        for step in (1, 2, 3):  # the step rows (step 0 is the prompt's last row)
            np.testing.assert_array_equal(arrays[f"{tag}_step_{step}"], got[tag][step])
        # inside the block: after the stream it reads, before the block's output
        assert manifest["keys"][f"layer{i}_attn"]["order"] < manifest["keys"][tag]["order"] \
            < manifest["keys"][f"layer{i}_mlp"]["order"]
    for i in (2, 3):  # past COMPILEDUMP_MOE_LAYERS=2, as the block's output
        assert f"layer{i}_shared_mlp" not in arrays and manifest["filtered_tags"][f"layer{i}_shared_mlp"] == "moe_layers"
    assert ("layer0_shared_mlp" in arrays) == (0 in kept)  # (GLM's layer 0 is dense: no shared expert)
    assert manifest["routing"]["moe_outputs"] == moe_layers  # the blocks, not their shared experts (dense)
    handle = compiledump.instrument(model)
    assert handle.taps["layer1_shared_mlp"] == handle.taps["layer1_shared_mlp_step"] == f"model.layers.1.mlp.{name}"
    handle.remove()


@pytest.mark.parametrize("kind, part, dtype, scale, decode_only, want", [
    ("qwen2_moe", "shared_expert", torch.bfloat16, 1.05, False, "layer1_shared_mlp"),
    ("glm4_moe", "shared_experts", torch.bfloat16, 1.05, False, "layer1_shared_mlp"),
    ("qwen2_moe", "shared_expert", torch.float32, 1.01, True, "layer1_shared_mlp_step_1")])
def test_a_bug_in_the_shared_expert_is_named_there(tmp_path, kind, part, dtype, scale, decode_only, want):
    reference = build(kind, 1, init=0.1)
    dump_run(reference, tmp_path / "ref", session(reference))
    engine = copy.deepcopy(reference).to(dtype)

    def bug(_module, args, out):
        return out if decode_only and args[0].reshape(-1, 64).shape[0] != 1 else out * scale
    getattr(engine.model.layers[1].mlp, part).register_forward_hook(bug)
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", session(engine)))
    assert report.exit_status == 1 and report.first_divergence.key == want, format_report(report)[-1]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_honest_bf16_pairs_pass_with_the_shared_expert_recorded(tmp_path, kind):
    for seed in (1, 2):
        reference = build(kind, seed, init=0.1)
        dump_run(reference, tmp_path / f"ref{seed}", session(reference))
        engine = copy.deepcopy(reference).to(torch.bfloat16)
        report = compare(tmp_path / f"ref{seed}", dump_run(engine, tmp_path / f"run{seed}", session(engine)))
        assert report.exit_status == 0, format_report(report)[-1]
        assert "layer1_shared_mlp" in {record.key for record in report.keys}


class _GatedInside(torch.nn.Module):
    """vLLM's Qwen2-MoE shared expert (`Qwen2MoeMLP(..., expert_gate=...)`): the sigmoid gate
    applied inside it, where Hugging Face applies it in the block."""

    def __init__(self, mlp, expert_gate):
        super().__init__()
        self.mlp, self.expert_gate = mlp, expert_gate

    def forward(self, x):
        return F.sigmoid(self.expert_gate(x)) * self.mlp(x)


def _vllm_block_forward(self, hidden_states):
    batch, seq, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)
    shared = self.shared_expert(x)
    _, weights, ids = self.gate(x)
    return (self.experts(x, ids, weights) + shared).reshape(batch, seq, hidden)


def test_a_shared_expert_gated_inside_it_pairs_with_one_gated_in_the_block(tmp_path):
    """A review: vLLM's shared expert returns the gated output, Hugging Face's the ungated one;
    recording the module's output made every honest pair diverge at `layer0_shared_mlp`."""
    reference = build("qwen2_moe", 1, init=0.1)
    engine = copy.deepcopy(reference)
    for layer in engine.model.layers:
        block = layer.mlp
        block.shared_expert = _GatedInside(block.shared_expert, block.shared_expert_gate)
        del block.shared_expert_gate
        block.forward = types.MethodType(_vllm_block_forward, block)
    report = compare(dump_run(reference, tmp_path / "ref", session(reference)),
                     dump_run(engine, tmp_path / "run", session(engine)))
    lines = format_report(report)
    assert report.exit_status == 0 and "layer0_shared_mlp" in {record.key for record in report.keys}, lines[-1]


@pytest.mark.parametrize("given", [None, {"tp_rank": 0, "tp_size": 2, "dp_rank": 1}])
def test_a_tensor_parallel_ranks_partial_shared_expert_is_declared_a_sum(tmp_path, given):
    """vLLM and SGLang build shared experts with `reduce_results=False`: under tensor parallelism
    each rank's output is a partial sum, all-reduced after the block adds the routed experts'. The
    ranks' order is the engine's own where `set_parallel` was not given one (a review: otherwise
    every key was `shard_incomplete`, exit 3)."""
    model = build("glm4_moe", 0)
    for layer in model.model.layers[1:]:
        down = layer.mlp.shared_experts.down_proj
        down.reduce_results, down.tp_size, down.tp_rank = False, 2, 1
    compiledump.reset()
    compiledump.configure(dir=str(tmp_path))
    try:
        if given is not None:
            compiledump.set_parallel(**given)
        handle = compiledump.instrument(model)
        assert compiledump.get_parallel() == (given or {"tp_rank": 1, "tp_size": 2})
        with torch.no_grad():
            session(model)()
        handle.remove()
        _, manifest = load_dump(compiledump.flush())
    finally:
        compiledump.reset()
    for key in ("layer1_shared_mlp", "layer1_shared_mlp_step_1"):
        assert manifest["keys"][key]["shard"] == {"dim": None, "how": "sum", "group": "tp"}
    assert "shard" not in manifest["keys"]["layer1_mlp"]


def test_a_model_instrumented_after_a_tensor_parallel_one_declares_no_shard():
    """A review: the declaration outlived the model it was made for."""
    engine = build("glm4_moe", 0)
    for layer in engine.model.layers[1:]:
        down = layer.mlp.shared_experts.down_proj
        down.reduce_results, down.tp_size, down.tp_rank = False, 2, 0
    compiledump.reset()
    try:
        compiledump.instrument(engine).remove()
        assert parallel.shard_for("layer1_shared_mlp_step") is not None
        compiledump.instrument(build("glm4_moe", 0)).remove()  # its shared experts are whole
        assert parallel.shard_for("layer1_shared_mlp") is None and parallel.shard_for("layer1_shared_mlp_step") is None
    finally:
        compiledump.reset()


def test_the_gates_hooks_run_once_when_its_output_is_applied(tmp_path):
    """The gate's forward is run again on the expert's input, not the module: a user's tap on it
    was written twice per forward (a review: "written again after the prompt", exit 3)."""
    model = build("qwen2_moe", 0)
    calls = []
    model.model.layers[1].mlp.shared_expert_gate.register_forward_hook(lambda *_: calls.append(1))
    arrays, _ = load_dump(dump_run(model, tmp_path, session(model), taps={"layer1_seg": "model.layers.1.mlp.shared_expert_gate"}))
    assert len(calls) == 4 and "layer1_shared_mlp" in arrays and "layer1_seg" in arrays  # a prompt and 3 steps


def test_a_layer_with_both_a_shared_mlp_beside_its_block_and_one_inside_records_the_layers(tmp_path):
    """A review: both hooks wrote `layer<i>_shared_mlp`, interleaving the step rows."""
    model = from_config("granitemoeshared", 0, vocab_size=160, hidden_size=64, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, shared_intermediate_size=48, max_position_embeddings=64)
    for layer in model.model.layers:
        block = layer.block_sparse_moe
        block.shared_experts = copy.deepcopy(layer.shared_mlp)
        block.forward = (lambda b, f: lambda x: f(x) + b.shared_experts(x))(block, block.forward)
    got = []
    model.model.layers[1].shared_mlp.register_forward_hook(lambda _m, _a, out: got.append(last_row(out)))
    arrays, _ = load_dump(dump_run(model, tmp_path, session(model)))
    assert sorted(k for k in arrays if k.startswith("layer1_shared_mlp_step_")) == [
        f"layer1_shared_mlp_step_{n}" for n in (0, 1, 2, 3)]  # one per forward, not two
    for step in (1, 2, 3):
        np.testing.assert_array_equal(arrays[f"layer1_shared_mlp_step_{step}"], got[step])

