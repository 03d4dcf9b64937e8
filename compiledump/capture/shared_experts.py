"""What `instrument` records of an MoE block's shared expert.

A shared expert (Qwen2-MoE's and Qwen3-Next's `shared_expert`, the DeepSeek family's, GLM-4-MoE's
and ERNIE 4.5's `shared_experts`, Hunyuan V1's `shared_mlp`) runs on every token, and the block
adds its output to the routed experts' weighted sum. The block's output (`layer<i>_mlp`) holds
both, the routed experts' diluting a bug in the shared expert: a bf16 x1.05 bug there read
0.2-0.9 of the thresholds and exited 0 (benchmarks/RESULTS.md, "Shared experts"). So its own
output is `layer<i>_shared_mlp`, an MoE internal under COMPILEDUMP_MOE_LAYERS. (Not the routed
experts' sum beside it: smaller than the block's output, its honest bf16 rounding crossed the
defaults in DeepSeek-V3.2 and Qwen3-Next pairs.)

What is recorded is what the block adds, the same on every engine: Qwen2-MoE's sigmoid gate,
which Hugging Face and SGLang apply after the shared expert and vLLM inside it (`expert_gate`),
is applied to the recorded value where the engine applies it outside; under tensor parallelism,
where vLLM and SGLang leave the shared expert's output a partial sum for the block to all-reduce
(`reduce_results=False`), the tag is declared a sum across the `tp` group (docs/multi-rank.md),
whose rank and size the down projection says where `set_parallel` was not given them.
"""

from __future__ import annotations

import torch

from . import api, hf_layout as layout, parallel, residual


def tap_shared_expert(handle, i: int, path: str, block: torch.nn.Module) -> None:
    """Record the shared expert of layer `i`'s MoE block `block` (at `path`), where it has one,
    as `layer<i>_shared_mlp` (with its step rows)."""
    name = layout.child(block, layout.SHARED_EXPERTS)
    if name is None:
        return
    shared, tag = block.get_submodule(name), f"layer{i}_shared_mlp"
    gate = layout.child(block, ("shared_expert_gate",))
    gated = gate is not None and layout.child(shared, ("expert_gate",)) is None
    handle._add_stream(shared, tag, f"{path}.{name}", "call" if gated else "output",
                       read=_gated(getattr(block, gate), tag) if gated else None, moe_filtered=True)
    pattern = rf"{tag}(?:_step)?"
    parallel.withdraw_shard(pattern)  # (a model instrumented before: its own declaration)
    if (down := _partial_sum(shared)) is not None:
        parallel.declare_shard(pattern, how="sum", group="tp")
        groups = parallel.get_parallel()
        if "tp_rank" not in groups and isinstance(rank := getattr(down, "tp_rank", None), int):
            # compare orders and sums the ranks' shares by tp_rank: the engine's own
            parallel.set_parallel(**{**groups, "tp_rank": rank, "tp_size": down.tp_size})


def _gated(gate: torch.nn.Module, tag: str):
    """The shared expert's output as the block adds it, `sigmoid(gate(x)) * output`, the gate's
    forward run again on the same input (where the tag is kept: a [tokens, 1] projection)."""
    def read(args, kwargs, output):
        if not api.moe_filter_keeps(tag) or not residual.is_float(output):
            return output  # (filtered: nothing recorded)
        # (its forward, not the module: the gate's hooks, a user's tap among them, ran once already)
        logits = gate.forward(residual.first_input(args, kwargs))
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits  # (a linear layer returning its bias)
        return torch.sigmoid(logits) * output
    return read


def _partial_sum(shared: torch.nn.Module) -> torch.nn.Module | None:
    """The shared expert's down projection where its output is this rank's partial sum: a
    row-parallel linear layer of a tensor-parallel group that leaves the all-reduce to the block
    (vLLM's and SGLang's `reduce_results=False`); else None."""
    down = getattr(shared, "down_proj", None)
    if not isinstance(down, torch.nn.Module):
        last = layout.last_projection(shared)
        down = getattr(shared, last) if last is not None else None
    tp_size = getattr(down, "tp_size", 1)
    partial = getattr(down, "reduce_results", True) is False and isinstance(tp_size, int) and tp_size > 1
    return down if partial else None
