"""The summary table of benchmarks/gpu_bench.py: one line per phase, the number each goal of issue 16
is about (the whole result is in the JSON). Kept apart so the measuring module holds measurements."""

from __future__ import annotations

from gpu_kernel_bench import KERNEL_PHASES, kernel_summary


def summary_line(name: str, r: dict) -> str:
    """One phase's result `r` (its JSON entry) as the summary table's line: the number its goal is about."""
    if name == "graph_capture_cost":
        return (f"{r['us_per_capture']:.3f} us/capture added ({r['captures']} x {r['shape']} bf16 per graph; "
                f"goal <= {r['goal_us']}; an empty node adds {r['us_per_empty_node']:.3f}"
                + (f", a relaxed commit {r['us_per_capture_relaxed_commit']:.3f}"
                   if "us_per_capture_relaxed_commit" in r else "")
                + (f", the payload after the claim {r['us_per_capture_claim_first']:.3f}"
                   if "us_per_capture_claim_first" in r else "") + "); "
                f"{r['captures_passed_per_replay']} passed per replay")
    if name.startswith("decode_overhead"):
        floor = f"; empty nodes instead: {r['ratio_empty_nodes']:.4f}" if "ratio_empty_nodes" in r else ""
        return (f"ratio {r['ratio']:.4f} (goal <= {r['goal_ratio']}): {r['step_ms_plain']:.3f} -> "
                f"{r['step_ms_instrumented']:.3f} ms/step, {r['captures_per_step']} captures{floor}")
    if name == "flush_throughput":
        return (f"{100 * r['efficiency']:.0f}% of the pinned copy (goal >= 80%): {r['snapshot_GB_per_s']:.1f} vs "
                f"{r['pinned_copy_GB_per_s']:.1f} GB/s, {r['bytes'] / 2**20:.0f} MiB")
    if name == "graph_equals_eager":
        return (f"{'equal' if r['ok'] else 'DIFFERENT'}: max_rel_err {r['max_rel_err']:.1e} over {r['keys']} keys "
                f"(mismatched {r['mismatched'][:3]}, missing {r['missing'][:3]}); sync debug: {r['sync_debug']}")
    if name == "compiled_host_cost":
        return (f"{r['host_us_per_capture']:.2f} host us/capture (goal <= {r['goal_us']}), "
                f"{r['captures']} captures, {r['capture_path']} path")
    if name in KERNEL_PHASES:
        return kernel_summary(name, r)
    return f"compiledump {r['compiledump_us']:.1f} us vs debug_dump.py {r['seed_us']:.1f} us per call ({r['speedup']:.1f}x)"
