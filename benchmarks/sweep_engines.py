"""Verdicts on engines built as vLLM and SGLang build their models, over many random seeds.

    python benchmarks/sweep_engines.py [--models llama,qwen3_moe] [--dtype bfloat16] [--seeds 12]
        [--moe-layers 2] [--sglang] [--bug norm_eps|rope_base|decode_position|renormalize]

Each seed builds the Hugging Face model (examples/hf_reference_vs_compiled.py's tiny configs,
random weights) and its engine (examples/vllm_style_engine.py), dumps both with
`compiledump.instrument` (a 7-token prompt, 4 teacher-forced decode steps) and compares them.
Honest pairs (no `--bug`) should all exit 0; with a bug the table counts where it is named. The
numbers are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

from compiledump.compare import compare

ENGINE = Path(__file__).resolve().parents[1] / "examples" / "vllm_style_engine.py"


def _engines():
    spec = importlib.util.spec_from_file_location("vllm_style_engine", ENGINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,qwen3_moe")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--sglang", action="store_true")
    parser.add_argument("--bug", choices=("norm_eps", "rope_base", "decode_position", "renormalize"))
    args = parser.parse_args(argv)
    engines = _engines()
    started = time.perf_counter()
    rows = []
    for model in args.models.split(","):
        exits, named = collections.Counter(), collections.Counter()
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory() as out:
                engines.run_pair(Path(out), model, seed, getattr(torch, args.dtype), args.bug, args.moe_layers,
                                 args.sglang)
                report = compare(Path(out) / "ref", Path(out) / "run")
            exits[report.exit_status] += 1
            first = report.first_divergence
            named[first.key if first is not None else "-"] += 1
            print(f"{model} seed={seed} exit {report.exit_status} first divergence "
                  f"{first.key if first is not None else '-'}", flush=True)
        rows.append((model, exits, named))
    print()
    flavor = "sglang" if args.sglang else "vllm"
    print("model      engine  dtype     moe_layers  bug              pairs  exit0  exit1  exit3  first divergence")
    for model, exits, named in rows:
        keys = ", ".join(f"{key} {count}" for key, count in named.most_common() if key != "-") or "-"
        print(f"{model:<10} {flavor:<7} {args.dtype:<9} {args.moe_layers:<11} {args.bug or 'none':<16} "
              f"{sum(exits.values()):<6} {exits[0]:<6} {exits[1]:<6} {exits[3]:<6} {keys}")
    print(f"elapsed {time.perf_counter() - started:.0f} s; torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
