"""Compiled decode step of the bench model with and without capture calls (benchmarks 1 and 2).

    python benchmarks/bench_compiled.py

Bench model: the package's TinyMoE with 8 layers, dim 1024, hc_mult 4, MoE top-2 of 8 experts,
vocab 32000, decode batch 8 (row 0 real, 7 padding), 4 captures per layer plus the logits, all
layers' MoE captures kept; `torch.compile(fullgraph=True)`.

Three child processes, each timing side by side (interleaved, median over rounds):
  enabled:  no capture calls  vs  capture calls with COMPILEDUMP_DIR set     (target <= 1.05)
            (on CPU the arena is file-backed: crash-proof capture, COMPILEDUMP_PERSIST=auto)
  memory:   the same with COMPILEDUMP_PERSIST=0 (the arena in process memory)
  disabled: no capture calls  vs  capture calls, COMPILEDUMP_DIR unset       (target <= 1.01)
The disabled child also compares the generated code of the two (it must be the same).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from harness import interleaved, machine, median, ratio, scratch_dir

BENCH = dict(layers=8, dim=1024, hc_mult=4, experts=8, top_k=2, vocab=32000, ffn=256, captures_per_layer=4)
BATCH = 8


def _child(mode: str, rounds: int, steps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)  # the per-capture cost, not OpenMP wake-ups
    from torch._inductor.utils import run_and_get_code

    import compiledump
    from compiledump.demo.model import NO_DUMP, ModelConfig, TinyMoE

    cfg = ModelConfig(**BENCH)
    if mode in ("enabled", "memory"):
        compiledump.configure(dir=scratch_dir(prefix="bench-compiled-"), moe_layers=cfg.layers)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (BATCH,), generator=g)
    state = torch.randn(cfg.layers, BATCH, cfg.dim, generator=g)
    plain = torch.compile(TinyMoE(cfg, dump=NO_DUMP), fullgraph=True)
    instrumented = torch.compile(TinyMoE(cfg, dump=compiledump), fullgraph=True)
    result = {}
    with torch.no_grad():
        _, code_plain = run_and_get_code(plain, tokens, state)
        _, code_instr = run_and_get_code(instrumented, tokens, state)
        strip = lambda codes: re.sub(r"#.*|\s+", " ", "\n".join(codes))  # noqa: E731 - comments name files
        result["captures_per_step"] = "\n".join(code_instr).count("torch.ops.compiledump.capture_v1.default(")
        result["same_code"] = strip(code_plain) == strip(code_instr)
        compiledump.set_rows(1)
        times = interleaved(
            {"plain": lambda: plain(tokens, state), "instrumented": lambda: instrumented(tokens, state)},
            rounds=rounds, calls=steps,
        )
    result["plain_ms"] = median(times["plain"]) * 1e3
    result["instrumented_ms"] = median(times["instrumented"]) * 1e3
    result["ratio"] = ratio(times, "instrumented", "plain")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per case per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--child", choices=("enabled", "memory", "disabled"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args.rounds, args.steps, args.threads)))
        return
    results = {}
    for mode in ("enabled", "memory", "disabled"):
        # COMPILEDUMP_NATIVE passes through: `=0` times the pure-Python path.
        env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_") or k == "COMPILEDUMP_NATIVE"}
        if mode == "memory":
            env["COMPILEDUMP_PERSIST"] = "0"
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--rounds", str(args.rounds), "--steps", str(args.steps),
             "--threads", str(args.threads)],
            env=env, capture_output=True, text=True, check=True,
        )
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
        results[mode] = json.loads(line[7:])
    print(f"machine: {machine()}")
    print(f"bench model: {BENCH}, decode batch {BATCH}")
    print(f"{'case':<56}{'plain ms':>10}{'instr. ms':>11}{'ratio':>8}{'target':>8}{'us/capture':>12}  notes")
    targets = {"enabled": 1.05, "memory": 1.05, "disabled": 1.01}
    labels = {"enabled": "COMPILEDUMP_DIR set (file-backed arena)", "memory": "COMPILEDUMP_DIR set, PERSIST=0",
              "disabled": "COMPILEDUMP_DIR unset"}
    for mode, r in results.items():
        notes = f"{r['captures_per_step']} capture ops/step"
        if mode == "disabled":
            notes = "generated code identical" if r["same_code"] else "GENERATED CODE DIFFERS"
        label = f"compiled step, {labels[mode]}"
        per_capture = (r["instrumented_ms"] - r["plain_ms"]) * 1e3 / max(1, r["captures_per_step"])
        print(f"{label:<56}{r['plain_ms']:>10.2f}{r['instrumented_ms']:>11.2f}{r['ratio']:>8.3f}"
              f"{targets[mode]:>8.2f}{per_capture if mode != 'disabled' else float('nan'):>12.1f}  {notes}")


if __name__ == "__main__":
    main()
