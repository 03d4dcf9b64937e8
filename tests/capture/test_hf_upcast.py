"""A bfloat16 model that computes some values in float32: Hugging Face's DeepSeek-V3 router casts
the hidden states to float32 before its matrix product, so the engine's `layer<i>_router` is a
float32 key whose value carries bfloat16 rounding. Judged by float32's thresholds it was a false
divergence on every bf16 run; judged in the precision the pair computes in, it is not (random
weights from a config, eager, no compile; tests/compare/test_verdicts.py has the rule on data).
Whether a whole pair is clean depends on this random model's routing flips, which
tests/compare/test_routing.py judges."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.hf_dump import dump_prefill
from compiledump.compare import compare, format_report

transformers = pytest.importorskip("transformers")


def _deepseek_v3():
    config = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
        max_position_embeddings=64, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def models():
    reference = _deepseek_v3()
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    return reference, engine


def test_a_float32_router_of_a_bf16_model_is_judged_in_bf16(models, tmp_path):
    reference, engine = models
    ids = torch.randint(0, 211, (1, 7), generator=torch.Generator().manual_seed(1))
    dump_prefill(reference, tmp_path / "ref", ids)
    dump_prefill(engine, tmp_path / "run", ids)
    report = compare(tmp_path / "ref", tmp_path / "run")
    text = "\n".join(format_report(report))
    # Layer 1 is the first MoE layer: no routing flip comes before its router, so its difference
    # is the bf16 rounding of the dense layer 0 and of layer 1's attention alone.
    (router,) = [r for r in report.keys if r.key == "layer1_router"]
    assert router.dtype_run == "float32" and router.sides.source_dtype_run == "float32"
    assert 1e-7 < router.floats.rel_diff < 2e-3  # above float32's threshold, far below bfloat16's
    assert router.limits.klass == "bf16" and router.limits.rel_diff == 2e-3 and not router.divergent, text
    assert "float32 vs float32 -> rel_diff <= 2e-03" in text and "as the pair's other keys are bf16" in text
