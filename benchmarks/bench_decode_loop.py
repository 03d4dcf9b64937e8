"""A compiled 64-step decode loop: compiles and wall time, compiledump vs the seed (benchmark 4).

    python benchmarks/bench_decode_loop.py

Each side runs in a fresh process: the bench model (benchmarks/bench_compiled.py) compiled, a
prefill, then 64 decode steps with capture on. compiledump compiles with fullgraph=True; the
seed cannot (it copies to the host inside the forward: a graph break), so it compiles with
fullgraph=False, and its per-tag Python step counter changes a guarded value every step.
Reported: graphs compiled, graph breaks, whether dynamo gave up (recompile limit) and ran the
model eagerly from then on, and wall time of the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from harness import load_debug_dump, machine, scratch_dir

BENCH = dict(layers=8, dim=1024, hc_mult=4, experts=8, top_k=2, vocab=32000, ffn=256, captures_per_layer=4)
BATCH = 8


def _child(side: str, steps: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from compiledump.demo.model import ModelConfig, TinyMoE

    cfg = ModelConfig(**BENCH)
    tmp = scratch_dir(prefix="bench-loop-")
    if side == "compiledump":
        import compiledump as dump

        dump.configure(dir=tmp, moe_layers=cfg.layers)
        fullgraph = True
    else:

        dump = load_debug_dump(tmp, moe_layers=cfg.layers)
        fullgraph = False
    model = torch.compile(TinyMoE(cfg, dump=dump), fullgraph=fullgraph)
    g = torch.Generator().manual_seed(0)
    counters.clear()
    start = time.perf_counter()
    with torch.no_grad():
        dump.set_rows(1)
        _, state = model(torch.randint(0, cfg.vocab, (7,), generator=g))
        state = torch.cat([state, torch.randn(cfg.layers, BATCH - 1, cfg.dim, generator=g)], 1)
        first_step = None
        for step in range(steps):
            _, state = model(torch.randint(0, cfg.vocab, (BATCH,), generator=g), state)
            if step == 0:
                first_step = time.perf_counter()
    end = time.perf_counter()
    return {
        "frames_compiled": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        # A frame that failed to compile (dynamo's recompile limit) runs eagerly from then on.
        "fell_back_to_eager": counters["frames"]["total"] > counters["frames"]["ok"],
        "loop_s": end - start,
        "after_first_step_s": end - first_step,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--child", choices=("compiledump", "seed"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args.steps)))
        return
    results = {}
    for side in ("compiledump", "seed"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILEDUMP_", "DEEPINFER_"))}
        out = subprocess.run([sys.executable, __file__, "--child", side, "--steps", str(args.steps)],
                             env=env, capture_output=True, text=True)
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{side} child failed:\n{out.stderr[-3000:]}")
        results[side] = json.loads(lines[-1][7:])
    print(f"machine: {machine()}")
    print(f"bench model: {BENCH}, decode batch {BATCH}, prefill 7 tokens + {args.steps} decode steps")
    print(f"{'side':<14}{'graphs compiled':>16}{'graph breaks':>14}{'eager fallback':>16}{'loop s':>9}"
          f"{'after step 0 s':>16}")
    for side, r in results.items():
        print(f"{side:<14}{r['frames_compiled']:>16}{r['graph_breaks']:>14}{str(r['fell_back_to_eager']):>16}"
              f"{r['loop_s']:>9.2f}{r['after_first_step_s']:>16.2f}")
    print(f"wall-time ratio seed/compiledump: {results['seed']['loop_s'] / results['compiledump']['loop_s']:.1f}x")


if __name__ == "__main__":
    main()
