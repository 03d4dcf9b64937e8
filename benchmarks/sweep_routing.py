"""How often does an honest low-precision MoE pair exit 1? A sweep over many random models.

Each pair is a Hugging Face model built from a small config with random weights (nothing is
downloaded): the float32 model eager is the reference, the same weights in bfloat16 eager the
engine; one 7-token prompt per model, no KV cache, every MoE layer recorded
(``COMPILEDUMP_MOE_LAYERS=4``), dumped with ``compiledump.instrument`` in one-row and in all-rows
mode, and compared with ``compiledump.compare.compare`` and the defaults, exactly as ``compiledump
compare`` does. Nothing is wrong in any pair, so every exit 1 is a false divergence; exit 3 means
the comparator could not tell (expert ids differ where no reference router logits judge them).
With ``--engine-bug`` the engine is broken instead (the biased routers' bias forgotten,
DeepSeek-V3's groups ignored, layer 1's experts scaled by 1.05, where the table also counts the
verdicts that name layer 1, or PhiMoE's sparsemixer cut doubled), and every exit 1 is the bug found.

Models (4 layers, hidden 64, 8 experts top-2, ``initializer_range`` 0.1): Qwen3-MoE, Mixtral and
DeepSeek-V3 with one expert group (plain top-k of sigmoid scores; one shared expert, layer 0
dense), and DeepSeek-V3 with its own routing (``deepseek_v3_grouped``: 16 experts in 4 groups,
top-4 in the best 2, sigmoid scores plus a random bias; judged by the selection ``instrument``
declares), MiniMax-M2 (``minimax_m2``: sigmoid scores plus a random bias over all 8 experts)
Ernie 4.5 (``ernie4_5_moe``: softmax scores plus a random bias over all 8 experts, one
shared expert) and DeepSeek-V4 (``deepseek_v4``: two layers routed by token id, then two by
sqrt(softplus) scores plus a random bias). ``--models`` also takes AFMoE, A.X-K2-Light (its
indexer keeping every key), Laguna, Kolibri, LFM2-MoE, Nemotron-H, gpt-oss, Granite-MoE with
sliding windows and Qwen3-Next (MORE_CONFIGS: the seventh session's audit), and Ergo, Kolibri 1.1
and MiniMax-M3-VL's text model (the eighth's), and DeepSeek-V3.2 (``deepseek_v32``: an indexer keeping 4
keys per query, fewer than the prompt's) and PhiMoE (``phimoe``: its sparsemixer's weight cut; ``--engine-bug
cut_x2`` doubles it) and DBRX (``dbrx``: the top-k of a softmax its block computes in the model's
dtype). benchmarks/calibrate.py calibrates the thresholds themselves; this
sweep counts verdicts over more random models than it can afford (docs/compare.md, "Expert ids
and near ties").

Usage: python benchmarks/sweep_routing.py [--seeds 100] [--models qwen3_moe,mixtral,deepseek_v3,...]
       [--rows one,all] [--tokens 7] [--engine-bug none|no_bias|no_groups|experts_x1.05|cut_x2] [--hidden 64] [--layers 4]
       [--init 0.1] [--expert-width N] [--verbose]
(about 30 seconds for the defaults on a 2-core CPU box; results in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import compiledump
from compiledump.capture import hf_layout  # where Hugging Face decoders keep their layers and MLPs
from compiledump.capture.hf_routers import BIAS_NAMES  # where routers keep their selection bias
from compiledump.compare import compare, format_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.hf_dump import dump_prefill  # noqa: E402  (the tests' way of dumping one prefill)

PROMPT_TOKENS = 7
COMMON = dict(vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=64, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8, head_dim=16),
    "mixtral": dict(intermediate_size=96, num_local_experts=8),
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    # DeepSeek-V3's own routing: 16 experts in 4 groups, top-4 inside the best 2 groups, by
    # sigmoid scores plus a random bias (build() draws it: a trained model's is not zero).
    "deepseek_v3_grouped": dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=16,
                                n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                num_experts_per_tok=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    # MiniMax-M2: the top-k of sigmoid(logits) + a bias over all 8 experts (the bias on the MoE block).
    "minimax_m2": dict(intermediate_size=96, num_local_experts=8, head_dim=16),
    # Ernie 4.5: the top-k of softmax(logits) + a bias over all 8 experts (in the router's moe_statics).
    "ernie4_5_moe": dict(intermediate_size=96, moe_intermediate_size=48, moe_num_experts=8, moe_k=2,
                         moe_layer_start_index=0, moe_num_shared_experts=1, head_dim=16),
    # DeepSeek-V4: layers 0-1 route by token id (a random table), 2-3 by sqrt(softplus) + a bias.
    "deepseek_v4": dict(num_local_experts=8, num_hash_layers=2, num_key_value_heads=1, head_dim=32,
                        q_lora_rank=32, o_lora_rank=32, index_n_heads=4, index_head_dim=16, qk_rope_head_dim=16,
                        moe_intermediate_size=48),
}
# More architectures (the seventh session's audit of transformers' MoE models; not in the default
# run): routers instrument recognises since, Nemotron-H's MoE mixers, LFM2's conv layers, and a
# hybrid with Gated DeltaNet layers (Qwen3-Next: honest bf16 pairs cross the defaults there, with a
# caution on the verdict: docs/compare.md, "Hybrid models").
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
MORE_CONFIGS = {
    "afmoe": dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_dense_layers=1,
                  num_shared_experts=1, head_dim=16, sliding_window=16, global_attn_every_n_layers=2),
    "axk2": dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse"], index_topk=64, index_head_dim=16,
                 index_n_heads=4, head_dim=8, gated_norm_rank=4, **_MLA),
    "laguna": dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8, head_dim=16,
                   shared_expert_intermediate_size=48, sliding_window=16,
                   layer_types=["full_attention", "sliding_attention"] * 2),
    "kolibri1": dict(moe_intermediate_size=48, num_experts=8, head_dim=16, sliding_window=16,
                     shared_expert_intermediate_size=48),
    "lfm2_moe": dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_dense_layers=1,
                     layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "nemotron_h": dict(layers_block_type=["mamba", "moe", "attention", "moe"], intermediate_size=96,
                       n_routed_experts=8, moe_intermediate_size=48, moe_shared_expert_intermediate_size=48,
                       n_group=1, topk_group=1, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=16, n_groups=1, chunk_size=8, use_mamba_kernels=False),
    "gpt_oss": dict(intermediate_size=48, num_local_experts=8, head_dim=16, sliding_window=16),
    "granitemoe_swa": dict(intermediate_size=48, num_local_experts=8, sliding_window=16, shared_intermediate_size=48),
    "qwen3_next": dict(intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=48,
                       num_experts=8, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4),
    # The eighth session's audit of transformers 5.25: routers declared since.
    "ergo": dict(first_dense_intermediate_size=96, num_dense_blocks=1, moe_intermediate_size=48,
                 shared_intermediate_size=48, num_experts=8, sliding_window=16, global_attention_every_n_layers=2,
                 head_dim=16),
    "kolibri1_1": dict(moe_intermediate_size=48, num_experts=8, head_dim=16, sliding_window=16,
                       shared_expert_intermediate_size=48, mlp_only_layers=[0], mlp_only_intermediate_size=96,
                       num_key_value_heads=1, index_num_heads=2, index_topk=64, index_pool_size=64,
                       index_compression=4, index_num_local_tokens=4, index_num_sink_tokens=1),
    "minimax_m3_vl": dict(intermediate_size=48, num_local_experts=8, head_dim=16, dense_intermediate_size=96,
                          shared_intermediate_size=48, rotary_dim=8, index_n_heads=2, index_head_dim=16,
                          index_block_size=4, index_topk_blocks=4, index_local_blocks=1,
                          mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # A sparse-attention indexer in every layer keeping 4 keys per query, so that the default 7-token
    # prompts exceed it (docs/compare.md, "Sparse-attention indexers").
    "deepseek_v32": dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=1, topk_group=1, index_topk=4, index_head_dim=16,
                         index_n_heads=4, head_dim=8, **_MLA),
    # PhiMoE: top-2 of the logits, each pick weighed by a softmax over the experts within a relative cut
    # (2 * router_jitter_noise) of it (its sparsemixer; docs/compare.md, "PhiMoE's sparsemixer").
    "phimoe": dict(intermediate_size=48, num_local_experts=8),
    # DBRX: its block picks the top-k of a softmax in the model's dtype (bf16 ties near-equal
    # probabilities: declared `rounded`); clip_qkv set because transformers 5.25 fails on its None.
    "dbrx": dict(attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000),
                 ffn_config=dict(ffn_hidden_size=48, moe_num_experts=8, moe_top_k=2)),
}
CONFIGS.update(MORE_CONFIGS)
DEFAULT_MODELS = [name for name in CONFIGS if name not in MORE_CONFIGS]
MODEL_TYPES = {"deepseek_v3_grouped": "deepseek_v3", "minimax_m3_vl": "minimax_m3_vl_text"}  # its text model
# build() draws their router bias (zeros as built; a trained model's is not).
BIASED = ("deepseek_v3_grouped", "minimax_m2", "ernie4_5_moe", "deepseek_v4", "afmoe", "axk2", "laguna", "kolibri1",
          "lfm2_moe", "nemotron_h", "ergo", "kolibri1_1", "minimax_m3_vl")
BIAS_STD = 0.02  # about the spread of the sigmoid scores of these random routers
# The fields of an expert's (and a shared expert's) intermediate width, which --expert-width sets.
EXPERT_WIDTHS = ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                 "shared_intermediate_size")
EXPERT_WIDTH: int | None = None


def build(model: str, seed: int) -> torch.nn.Module:
    """The float32 model ``model`` with random weights from ``seed``, eval mode."""
    fields = {**COMMON, **CONFIGS[model]}
    if EXPERT_WIDTH is not None:  # --expert-width: every expert and shared expert that wide
        fields.update({name: EXPERT_WIDTH for name in EXPERT_WIDTHS if name in fields})
    for name, value in fields.items():  # per-layer patterns (layer_types, ...) repeated to --layers
        if isinstance(value, list) and len(value) != COMMON["num_hidden_layers"]:
            fields[name] = (value * COMMON["num_hidden_layers"])[:COMMON["num_hidden_layers"]]
    model_type = MODEL_TYPES.get(model, model)
    # Under the names the config class keeps them (DBRX's d_model, n_layers: its MoE config copies
    # d_model when built, and would not see a hidden_size set through the alias afterwards)
    names = getattr(transformers.CONFIG_MAPPING[model_type], "attribute_map", {})
    config = transformers.AutoConfig.for_model(model_type, **{names.get(k, k): v for k, v in fields.items()})
    torch.manual_seed(seed)
    built = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in built.named_parameters():
            # AFMoE's and Kolibri 1.1's router weights start at zero
            if (".router." in name or ".gate." in name) and parameter.dim() == 2 and not parameter.any():
                parameter.normal_(0.0, COMMON["initializer_range"])
        for module in built.modules():
            for name in BIAS_NAMES:
                bias = getattr(module, name, None)
                if isinstance(bias, torch.Tensor) and model in BIASED:
                    bias.normal_(0.0, BIAS_STD)
            table = getattr(module, "tid2eid", None)  # a hash router's token -> experts table (zeros as built)
            if isinstance(table, torch.Tensor):
                experts = config.num_local_experts
                table.copy_(torch.stack([torch.randperm(experts)[:table.shape[1]] for _ in range(table.shape[0])]))
    return built


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]


@torch.no_grad()
def _forget_bias(model: torch.nn.Module) -> None:
    for module in model.modules():
        for name in BIAS_NAMES:
            if isinstance(getattr(module, name, None), torch.Tensor):
                getattr(module, name).zero_()


def _ignore_groups(model: torch.nn.Module) -> None:
    for router in _routers(model):
        router.num_group = router.topk_group = 1


BUG_LAYER = 1  # where --engine-bug experts_x1.05 scales the experts


@torch.no_grad()
def _scale_experts(model: torch.nn.Module) -> None:
    """x1.05 every weight of layer BUG_LAYER's experts (its MLP where it has none), as calibrate.py's
    bf16 bug: a wrong scale in one layer, with the router untouched."""
    _, layers = hf_layout.find_layers(dict(model.named_modules()))  # the layers instrument() taps
    block = getattr(layers[BUG_LAYER], hf_layout.child(layers[BUG_LAYER], (*hf_layout.MLP_BLOCKS, "mixer")))
    for parameter in getattr(block, "experts", block).parameters():
        parameter.mul_(1.05)


def _double_cut(model: torch.nn.Module) -> None:
    """PhiMoE's sparsemixer cut twice as wide (2 * jitter_eps passed where jitter_eps is due): the
    same expert ids, other weights."""
    for module in model.modules():
        if isinstance(getattr(module, "router_jitter_noise", None), float):
            module.router_jitter_noise *= 2


# Bugs an engine can have (--engine-bug): forgetting the score-correction bias (DeepSeek-V3,
# MiniMax-M2, Ernie 4.5), taking the top-k over every expert instead of inside the best groups
# (DeepSeek-V3), a x1.05 scale on one layer's experts (every model; counted when the verdict
# names that layer), or PhiMoE's sparsemixer cut doubled.
ENGINE_BUGS = {"none": lambda model: None, "no_bias": _forget_bias, "no_groups": _ignore_groups,
               "experts_x1.05": _scale_experts, "cut_x2": _double_cut}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=100, help="random models per architecture (default 100)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated (default {','.join(DEFAULT_MODELS)}; also {','.join(MORE_CONFIGS)})")
    parser.add_argument("--rows", default="one,all", help="recording modes (default one,all)")
    parser.add_argument("--tokens", type=int, default=PROMPT_TOKENS, help=f"prompt length (default {PROMPT_TOKENS})")
    parser.add_argument("--engine-bug", default="none", choices=sorted(ENGINE_BUGS),
                        help="break the engine's routing (the biased routers) or scale layer 1's experts: every "
                             "pair is then wrong, and exit 1 is the detection (default none: every pair honest)")
    parser.add_argument("--hidden", type=int, default=COMMON["hidden_size"], help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=COMMON["num_hidden_layers"], help="decoder layers (default 4)")
    parser.add_argument("--expert-width", type=int, default=None,
                        help=f"the experts' and shared experts' intermediate width, where the config has one of "
                             f"{', '.join(EXPERT_WIDTHS)} (every shared expert here; routed experts whose width is "
                             "intermediate_size or the like keep theirs: Mixtral's, MiniMax's, MiniMax-M3-VL's, "
                             "gpt-oss', PhiMoE's, Granite's, DBRX's; default: each model's own, mostly 48; a real "
                             "model's are 1024-2048 wide)")
    parser.add_argument("--init", type=float, default=COMMON["initializer_range"],
                        help="initializer_range (default 0.1)")
    parser.add_argument("--verbose", action="store_true", help="print the report of every pair that exits 1")
    args = parser.parse_args()
    # Larger or deeper models than the tiny default: is it the worst case for the bf16 defaults?
    COMMON.update(hidden_size=args.hidden, num_hidden_layers=args.layers, initializer_range=args.init)
    global EXPERT_WIDTH
    EXPERT_WIDTH = args.expert_width
    torch.set_num_threads(1)
    started = time.perf_counter()
    counts: dict[tuple[str, str], collections.Counter] = {}
    with tempfile.TemporaryDirectory(prefix="compiledump_sweep_") as tmp:
        for model in args.models.split(","):
            for seed in range(args.seeds):
                reference = build(model, seed)
                engine = copy.deepcopy(reference).to(torch.bfloat16)
                ENGINE_BUGS[args.engine_bug](engine)
                ids = torch.randint(3, COMMON["vocab_size"], (1, args.tokens),
                                    generator=torch.Generator().manual_seed(seed + 1))
                for rows in args.rows.split(","):
                    root = Path(tmp) / f"{model}_{seed}_{rows}"
                    dump_prefill(reference, root / "ref", ids, rows, COMMON["num_hidden_layers"])
                    dump_prefill(engine, root / "run", ids, rows, COMMON["num_hidden_layers"])
                    report = compare(root / "ref", root / "run")
                    lines = format_report(report)
                    counts.setdefault((model, rows), collections.Counter())[report.exit_status] += 1
                    first = report.first_divergence
                    counts[model, rows]["named"] += first is not None and first.layer == BUG_LAYER
                    print(f"{model} rows={rows} seed={seed}: exit {report.exit_status} | {lines[-1]}", flush=True)
                    if args.verbose and report.exit_status == 1:
                        print("\n".join("    " + line for line in lines if line[:1] in "!*" or ":" in line[:20]))
    compiledump.configure(dir=None)
    print()
    named = args.engine_bug == "experts_x1.05"  # exits 1 whose first divergence is at the bug's layer
    print(f"{'model':<12} {'rows':<4} {'pairs':>5} {'exit 0':>7} {'exit 1':>7} {'exit 3':>7}"
          + (f" {'at layer ' + str(BUG_LAYER):>10}" if named else ""))
    for (model, rows), counter in counts.items():
        print(f"{model:<12} {rows:<4} {counter[0] + counter[1] + counter[3]:>5} {counter[0]:>7} {counter[1]:>7} "
              f"{counter[3]:>7}" + (f" {counter['named']:>10}" if named else ""))
    print(f"elapsed {time.perf_counter() - started:.0f} s; torch {torch.__version__}; transformers "
          f"{transformers.__version__}; seeds {args.seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
