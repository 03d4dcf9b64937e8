"""Tiny Hugging Face models that several test files build from config (random weights, nothing
downloaded)."""

from __future__ import annotations

import transformers


def longcat_flash() -> transformers.PreTrainedModel:
    """LongCat-Flash, 2 layers, hidden 32, 8 routed experts top-2 and 2 zero-computation experts."""
    config = transformers.AutoConfig.for_model("longcat_flash", vocab_size=97, hidden_size=32, num_layers=2,
                                               num_attention_heads=2, num_key_value_heads=2, ffn_hidden_size=48,
                                               expert_ffn_hidden_size=24, n_routed_experts=8, moe_topk=2,
                                               zero_expert_num=2, kv_lora_rank=8, q_lora_rank=8,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                               max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config).eval()
