"""`compiledump recover` of a run that died: how long it takes, against the flush it replaces.

    python benchmarks/bench_recover.py

A child process runs the bench model of bench_compiled.py (8 layers, dim 1024, vocab 32000, 33
tags: 4 per layer and the logits steps) eagerly for 256 decode steps with crash-proof capture
(COMPILEDUMP_PERSIST, on by default on CPU) and the token gate off, so every tag is written at
every step; then it dies with os._exit (no flush). The parent times `recover_directory` on what it
left (target: under 1 s), and, side by side, a normal `flush()` of the same captures in a second
child for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from harness import machine, median, scratch_dir

STEPS = 256
BENCH = dict(layers=8, dim=1024, hc_mult=4, experts=8, top_k=2, vocab=32000, ffn=256, captures_per_layer=4)


def _child(directory: str, flush: bool) -> None:
    import torch

    import compiledump
    from compiledump.demo.model import ModelConfig, TinyMoE

    torch.set_num_threads(1)
    cfg = ModelConfig(**BENCH)
    compiledump.configure(dir=directory, tokens=0, moe_layers=cfg.layers, max_steps=STEPS)
    model = TinyMoE(cfg, dump=compiledump)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, state = model(torch.randint(0, cfg.vocab, (7,), generator=g))
        for _ in range(STEPS):
            compiledump.set_rows(1)
            _, state = model(torch.randint(0, cfg.vocab, (1,), generator=g), state)
        if flush:
            start = time.perf_counter()
            compiledump.flush()
            print("FLUSH_S", time.perf_counter() - start, flush=True)
    os._exit(0)  # no exit-time flush: the crash-proof files stay


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="dead runs to recover")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--flush", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.flush)
        return
    from compiledump.capture.recover import recover_directory

    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_") or k == "COMPILEDUMP_NATIVE"}
    recover_s, flush_s, keys, tags = [], [], 0, 0
    for _ in range(args.rounds):
        directory = scratch_dir(prefix="bench-recover-")
        subprocess.run([sys.executable, __file__, "--child", directory], env=env, check=True)
        start = time.perf_counter()
        results, errors = recover_directory(directory)
        recover_s.append(time.perf_counter() - start)
        assert not errors and len(results) == 1 and results[0].npz is not None, (results, errors)
        keys = results[0].keys
        with open(str(results[0].npz).replace(".npz", ".json")) as handle:
            tags = len(json.load(handle)["tags"])
        out = subprocess.run([sys.executable, __file__, "--child", scratch_dir(prefix="bench-flush-"),
                              "--flush"], env=env, check=True, capture_output=True, text=True).stdout
        flush_s.append(float(out.split("FLUSH_S")[1].split()[0]))
    print(f"machine: {machine()}")
    print(f"bench model: {BENCH}; {STEPS} decode steps, token gate off; {tags} tags, {keys} keys recovered")
    print(f"{'case':<48}{'median s':>10}{'target':>8}")
    print(f"{'compiledump recover (a dead run, os._exit)':<48}{median(recover_s):>10.3f}{1.0:>8.2f}")
    print(f"{'flush() of the same captures, in the process':<48}{median(flush_s):>10.3f}{'-':>8}")


if __name__ == "__main__":
    main()
