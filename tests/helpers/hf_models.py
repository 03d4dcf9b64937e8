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


def deepseek_v32(index_topk: int, seed: int = 0, init: float = 0.1, max_positions: int = 128, layers: int = 4):
    """DeepSeek-V3.2, `layers` layers (layer 0 dense), hidden 64, 8 routed experts top-2, and a sparse-attention
    indexer in every layer keeping `index_topk` keys per query; random weights of scale `init`."""
    import torch

    config = transformers.AutoConfig.for_model(
        "deepseek_v32", vocab_size=211, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
        index_topk=index_topk, index_head_dim=16, index_n_heads=4, initializer_range=init,
        max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def minimax_m3_vl_text(sparse_layers: tuple[int, ...] = (0, 2)):
    """MiniMax-M3-VL's text model, 4 layers, hidden 64, 8 experts top-2; the layers `sparse_layers`
    have its block-sparse indexer (picks `[batch, heads, seq, blocks]`, not one row per token)."""
    config = transformers.AutoConfig.for_model(
        "minimax_m3_vl_text", vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
        dense_intermediate_size=96, shared_intermediate_size=48, rotary_dim=8, index_n_heads=2, index_head_dim=16,
        index_block_size=4, index_topk_blocks=4, index_local_blocks=1, max_position_embeddings=64,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["minimax_m3_sparse" if i in sparse_layers else "full_attention" for i in range(4)])
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def phimoe(seed: int = 0, init: float = 0.1, layers: int = 4):
    """PhiMoE, `layers` layers, hidden 64, 8 experts top-2 weighed by its sparsemixer (router_jitter_noise 0.01:
    a cut of 0.02); random weights of scale `init`, as benchmarks/sweep_routing.py builds it."""
    import torch

    config = transformers.AutoConfig.for_model(
        "phimoe", vocab_size=211, hidden_size=64, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=init, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def glm5_next_text(index_topk: int = 8, seed: int = 0, init: float = 0.02):
    """GLM-5-Next's text model (no LM head in transformers), 4 layers (3 linear-attention, then one with
    its pooled sparse-attention indexer: pools of 2 keys, the top `index_topk` // 2 pools kept), hidden
    64, 8 routed experts top-2 from layer 1; random weights of scale `init`. The linear attention has
    4 heads of 16 (the config's defaults, 64 of 128, made each layer 8192 wide, 13 M parameters, and a
    bf16 depthwise conv over 24576 channels: a pair's prefills took 35 s of CPU instead of 5); the
    indexed layer is what the tests are about, and at this size a bf16 pair still swaps its pools
    (test_hf_indexers.py's seed exits 1 without them recorded, as at the old size)."""
    import torch

    config = transformers.AutoConfig.for_model(
        "glm5_next_text", vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0,
        qk_nope_head_dim=16, v_head_dim=16, head_dim=8, index_topk=index_topk, index_head_dim=16, index_n_heads=4,
        index_kpool=2, max_position_embeddings=128, initializer_range=init, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=4,
        linear_head_dim=16)
    torch.manual_seed(seed)
    return transformers.AutoModel.from_config(config).eval()


def from_config(kind: str, seed: int, **fields) -> transformers.PreTrainedModel:
    """Model type `kind` built from a config of `fields`, its weights drawn after
    `torch.manual_seed(seed)`, in eval mode."""
    import torch

    config = transformers.AutoConfig.for_model(kind, **fields)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()
