"""Eager cost of one capture call on this machine: compiledump vs the seed's approach.

    python benchmarks/bench_eager.py

Cases (CPU tensors, the decode-time sizes of the bench model): `record` of a `[8, 4, 1024]`
hidden state (fp32 and bf16), `record_step` of `[8, 32000]` logits, `record_ids` of `[8, 2]`
expert ids; each through compiledump and through the seed (`../shared/seed/debug_dump.py`,
which copies to the host in the call), plus an empty Python call as the floor.
Prints the median microseconds per call and the compiledump/seed ratio.
"""

from __future__ import annotations

import argparse

import torch

from harness import interleaved, load_debug_dump, machine, median, scratch_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: per-call overhead, not OpenMP wake-ups)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import compiledump

    tmp = scratch_dir(prefix="bench-eager-")
    compiledump.configure(dir=f"{tmp}/cd", max_steps=1 << 30 // 32000, moe_layers=8)
    seed = load_debug_dump(f"{tmp}/seed", moe_layers=8)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 4, 1024, generator=g)
    hidden_bf16 = hidden.to(torch.bfloat16)
    logits = torch.randn(8, 32000, generator=g)
    ids = torch.randint(0, 8, (8, 2), generator=g)

    def noop(*_args):
        return None

    cases = {
        "empty call": lambda: noop("layer0", hidden),
        "compiledump record fp32": lambda: compiledump.record("layer0", hidden),
        "seed record fp32": lambda: seed.record("layer0", hidden),
        "compiledump record bf16": lambda: compiledump.record("layer1", hidden_bf16),
        "seed record bf16": lambda: seed.record("layer1", hidden_bf16),
        "compiledump record_step": lambda: compiledump.record_step("logits", logits),
        "seed record_step": lambda: seed.record_step("logits", logits),
        "compiledump record_ids": lambda: compiledump.record_ids("layer0_topk", ids),
        "seed record_ids": lambda: seed.record_ids("layer0_topk", ids),
    }
    # record_step appends a 128 KB row per call: keep its call count within the arena.
    per_round = interleaved(cases, rounds=args.rounds, calls=args.calls)
    print(f"machine: {machine()}")
    print(f"{'case':<28}{'us/call':>10}{'vs seed':>10}")
    for name, times in per_round.items():
        us = median(times) * 1e6
        seed_name = name.replace("compiledump", "seed")
        vs = ""
        if name.startswith("compiledump") and seed_name in per_round:
            vs = f"{statistics_ratio(times, per_round[seed_name]):.2f}x"
        print(f"{name:<28}{us:>10.2f}{vs:>10}")
    seed._CAPTURED.clear()


def statistics_ratio(a, b) -> float:
    import statistics

    return statistics.median(x / y for x, y in zip(a, b))


if __name__ == "__main__":
    main()
