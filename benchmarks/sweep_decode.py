"""Verdicts on decode-only bugs under `instrument()`'s defaults, over random causal LMs.

A decode step runs other code than the prompt's forward (a paged KV cache, a decode attention
kernel, a GEMM or fused MoE for a few rows, a state-space model's one-step update), so a bug can
live in decode steps alone. Each model is built from a small config with random weights (nothing
is downloaded): 4 layers, hidden 64, `initializer_range` as given. A session runs an 8-token prompt
and 4 decode steps through the model's own cache, teacher-forced. The float32 model is the
reference; the engine is its bfloat16 copy (an honest pair: every exit 1 is a false divergence), or
a float32 copy whose layer 1 scales by x1.01, in decode steps only, the first half of the output
channels of its MLP (a Mamba layer's mixer; expected at `layer1_mlp_step_1`, `layer1_mixer_step_1`)
or of its attention (expected at `layer1_mixer_step_1`, attention's own output; not for models
without one). (Half: Gemma 2's and OLMo 2's norm after each sublayer would undo a scale of the
whole output.) The
table counts, per model and case, the pairs whose verdict is the expected one, and prints the others.

Usage: python benchmarks/sweep_decode.py [--models llama,...] [--seeds 3] [--inits 0.02,0.1]
(results in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy

import torch
import transformers as T

from harness import sweep_main

VOCAB, PROMPT, STEPS = 160, 8, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# model type: (its config beside COMMON, its layers, the MLP's or mixer's name in a layer, the attention's)
MODELS = {
    "llama": ({}, "model.layers", "mlp", "self_attn"),
    "qwen2": ({}, "model.layers", "mlp", "self_attn"),
    "gemma2": ({"head_dim": 16}, "model.layers", "mlp", "self_attn"),
    "phi3": ({}, "model.layers", "mlp", "self_attn"),
    "olmo2": ({}, "model.layers", "mlp", "self_attn"),
    "gpt2": ({"n_positions": 64}, "transformer.h", "mlp", "attn"),
    "qwen3_moe": ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "model.layers", "mlp",
                  "self_attn"),
    "mixtral": ({"num_local_experts": 8, "num_experts_per_tok": 2}, "model.layers", "mlp", "self_attn"),
    # MoE layers from layer 1 with a shared expert (recorded as layer<i>_shared_mlp) and MLA attention
    "deepseek_v3": ({"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                     "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8},
                    "model.layers", "mlp", "self_attn"),
    "qwen2_moe": ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}, "model.layers", "mlp", "self_attn"),
    "mamba": ({"state_size": 8, "expand": 2, "conv_kernel": 4}, "backbone.layers", "mixer", None),
    "falcon_mamba": ({"state_size": 8, "expand": 2, "conv_kernel": 4}, "backbone.layers", "mixer", None),
}
CASES = {"honest bf16": None, "decode-only MLP": "layer1_mlp_step_1", "decode-only attention": "layer1_mixer_step_1"}


def build(name: str, seed: int, init: float) -> torch.nn.Module:
    config = T.AutoConfig.for_model(name, **{**COMMON, **MODELS[name][0], "initializer_range": init})
    torch.manual_seed(seed)
    return T.AutoModelForCausalLM.from_config(config).eval()


def session(model, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=generator)
    steps = torch.randint(3, VOCAB, (STEPS, 1, 1), generator=generator)

    def run():
        model.decoding = False  # (read by the planted bug)
        out = model(input_ids=prompt, use_cache=True)
        model.decoding = True
        for token in steps:
            out = model(input_ids=token, cache=out.cache, use_cache=True)
    return run


def engine_for(reference: torch.nn.Module, case: str, name: str) -> torch.nn.Module:
    if case == "honest bf16":
        return copy.deepcopy(reference).to(torch.bfloat16)
    engine = copy.deepcopy(reference)
    _, layers, mlp, attention = MODELS[name]
    module = engine.get_submodule(f"{layers}.1.{mlp if case == 'decode-only MLP' else attention}")

    def bug(_module, _args, out):
        if not engine.decoding:
            return None
        # its first half of channels: Gemma 2's and OLMo 2's norm after each sublayer would undo a
        # scale of the whole output
        value = out[0] if isinstance(out, tuple) else out
        half = value.shape[-1] // 2
        value = torch.cat([value[..., :half] * 1.01, value[..., half:]], -1)
        return (value, *out[1:]) if isinstance(out, tuple) else value
    module.register_forward_hook(bug)
    return engine


def main() -> None:
    sweep_main(__doc__, MODELS, "init", "inits", "0.02,0.1", build, session, engine_for, cases_of, CASES)


def cases_of(name: str) -> dict:
    """A model's cases: a Mamba layer's mixer in place of the MLP, and no attention."""
    if MODELS[name][2] != "mixer":
        return CASES
    return {case: key and key.replace("_mlp_", "_mixer_") for case, key in CASES.items()
            if case != "decode-only attention"}


if __name__ == "__main__":
    main()
