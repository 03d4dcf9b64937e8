"""Benchmark `compiledump compare` on a DeepSeek-V3-sized dump pair.

Writes two dumps into a temporary directory (deleted afterwards):

* REF: a compiledump file (npz + manifest), RUN: a file without a manifest (npz only, as debug_dump.py
  writes it), so both ways of reading key meanings run;
* 200 hidden-state keys of dim 7168 (``layer<i>_moe_out`` and ``layer<i>`` for 100 layers), 100
  int32 top-8 expert-id keys, a prefill ``logits`` row, and 256 decode steps of 129280-wide
  ``logits_<n>`` (132 MB of logits per side);
* RUN = REF + relative noise 1e-3 everywhere, a large perturbation from layer 60 on (0.3) and from
  decode step 200 on (1.0: the decode-step defaults are loose).

Then runs ``compiledump compare REF RUN --json ...`` (the ``python -m compiledump`` entry, table
printed to /dev/null) in a child process and reports its wall time and peak RSS (VmHWM), next to a
child that only imports the package; does the same calling ``compiledump.compare`` directly from
Python (no CLI, and checked to load no torch); and checks that the report names layer 60 and step 199.

Usage: python benchmarks/bench_compare.py [--steps 256] [--vocab 129280] [--layers 100] [--dim 7168]
       python benchmarks/bench_compare.py --calibrate   # the bf16 noise measurement behind docs/compare.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


class NpzStream:
    """Write an npz member by member (the layout numpy.savez produces), so generating the data
    never holds more than one array."""

    def __init__(self, path: Path) -> None:
        self.archive = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def add(self, key: str, array: np.ndarray) -> None:
        with self.archive.open(f"{key}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)

    def close(self) -> None:
        self.archive.close()


def generate(directory: Path, layers: int, dim: int, steps: int, vocab: int, diverge_layer: int,
             diverge_step: int, seed: int = 0) -> tuple[Path, Path]:
    """Write the REF (with manifest) and RUN (no manifest) dumps; return their paths."""
    rng = np.random.default_rng(seed)
    ref_path = directory / "ref" / "compiledump_rank0_pid1.npz"
    run_path = directory / "run" / "deepinfer_layers_rank0_pid2.npz"
    ref_path.parent.mkdir()
    run_path.parent.mkdir()
    ref, run = NpzStream(ref_path), NpzStream(run_path)
    keys: dict[str, dict] = {}
    order: dict[tuple[str, bool], int] = {}

    def put(key: str, tag: str, kind: str, step: int | None, array: np.ndarray, large: bool) -> None:
        slot = order.setdefault((tag, kind == "step"), len(order))
        keys[key] = {"tag": tag, "kind": kind, "step": step, "order": slot, "source_dtype": "bfloat16",
                     "source_shape": list(array.shape), "dtype": str(array.dtype), "shape": list(array.shape)}
        ref.add(key, array)
        if array.dtype.kind == "f":
            # Decode steps are judged by loose defaults (a routing flip of the decoded token moves
            # logits that far: docs/compare.md): their perturbation must be gross to be named.
            relative = (1.0 if kind == "step" else 0.3) if large else 1e-3
            noise = rng.standard_normal(array.shape, dtype=np.float32) * np.float32(relative * array.std())
            array = array + noise
        run.add(key, array)

    for layer in range(layers):
        ids = np.sort(rng.choice(256, size=(1, 8), replace=False), axis=1).astype(np.int32)
        put(f"layer{layer}_topk", f"layer{layer}_topk", "ids", None, ids, False)
        for tag in (f"layer{layer}_moe_out", f"layer{layer}"):
            put(tag, tag, "record", None, rng.standard_normal(dim, dtype=np.float32), layer >= diverge_layer)
    put("logits", "logits", "record_once", None, rng.standard_normal(vocab, dtype=np.float32) * 3, True)
    for step in range(steps):
        logits = rng.standard_normal(vocab, dtype=np.float32) * 3
        put(f"logits_{step}", "logits", "step", step, logits, step >= diverge_step)
    ref.close()
    run.close()
    manifest = {"format": "compiledump-dump", "format_version": 1, "compiledump_version": "0.1.0",
                "torch_version": None, "created_unix": time.time(), "rank": "0", "pid": 1, "world_size": None,
                "device": "cuda:0", "config": {}, "keys": keys, "tags": {}, "drops": {}, "filtered_tags": {}}
    ref_path.with_suffix(".json").write_text(json.dumps(manifest))
    return ref_path, run_path


# Calls the comparator from Python, without the CLI, to measure what it costs itself. The package
# imports its capture side (and torch) lazily, so this is numpy only; checked.
STANDALONE = """
import sys
import compiledump.compare as cmp
assert "torch" not in sys.modules, "compiledump.compare imported torch"
if len(sys.argv) > 1:
    report = cmp.compare(sys.argv[1], sys.argv[2])
    print("\\n".join(cmp.format_report(report)))
    cmp.write_json_report(report, sys.argv[3])
    assert "torch" not in sys.modules, "the comparison imported torch"
    sys.exit(report.exit_status)
"""


# Prepended to every child: at exit, write the process's own peak resident set (VmHWM, reset at
# exec) to the file named by $BENCH_HWM_FILE. ru_maxrss from wait4 is not usable here: it can carry
# the forking parent's size.
HWM_PREFIX = """
import atexit, os
def _report_hwm():
    status = open("/proc/self/status").read()
    with open(os.environ["BENCH_HWM_FILE"], "w") as handle:
        handle.write(status.split("VmHWM:")[1].split()[0])
atexit.register(_report_hwm)
"""
CLI = """
import runpy, sys
runpy.run_module("compiledump", run_name="__main__", alter_sys=True)
"""


def timed_child(code: str, args: list[str], hwm_file: Path) -> tuple[float, float, int]:
    """Run ``python -c code args`` with stdout to /dev/null; return (wall seconds, peak RSS of the
    child in MiB, exit status)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", HWM_PREFIX + code, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, BENCH_HWM_FILE=str(hwm_file)))
    wall = time.perf_counter() - started
    if done.stderr:
        print(done.stderr, file=sys.stderr)
    return wall, int(hwm_file.read_text()) / 1024, done.returncode


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even) and return as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return bits.view(np.float32).astype(np.float64)


def calibrate(tokens: int = 64, seed: int = 0) -> None:
    """The measurement behind the default threshold and near-tie epsilon (docs/compare.md).

    A toy 61-layer residual MoE (dim 1024, 16 experts of hidden 512, top-4, RMSNorm, SiLU) run in
    float64 and with bf16 emulated (weights, and every activation after a matmul, nonlinearity or
    residual add, rounded to bf16). Prints the per-token rel_diff of the residual stream by layer,
    with routing forced to the reference's (pure rounding noise) and free (routing flips), the
    effect of two bugs, and the logit margin change through a bf16 lm_head.
    """
    rng = np.random.default_rng(seed)
    dim, hidden, layers, experts, topk, vocab = 1024, 512, 61, 16, 4, 32000

    def rel_diff(x, y):
        return ((x - y) ** 2).sum(-1) / ((x * x).sum(-1) + (y * y).sum(-1))

    def rmsnorm(h):
        return h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)

    weights = [(rng.standard_normal((experts, dim, hidden)) / np.sqrt(dim),
                rng.standard_normal((experts, hidden, dim)) / np.sqrt(hidden) * 0.5,
                rng.standard_normal((dim, experts)) / np.sqrt(dim)) for _ in range(layers)]
    weights_bf16 = [tuple(_bf16(w) for w in layer) for layer in weights]

    def forward(h, low, forced=None, bug=None):
        rnd = _bf16 if low else (lambda a: a)
        states, routes = [], []
        h = rnd(h)
        for index in range(layers):
            up, down, router = (weights_bf16 if low else weights)[index]
            x = rnd(rmsnorm(h))
            scores = x @ router
            top = np.argsort(-scores, axis=-1)[:, :topk] if forced is None else forced[index]
            gate = np.take_along_axis(scores, top, -1)
            gate = np.exp(gate - gate.max(-1, keepdims=True))
            gate /= gate.sum(-1, keepdims=True)
            out = np.zeros_like(h)
            for expert in range(experts):
                rows, slots = np.nonzero(top == expert)
                if bug == ("drop_expert", index):
                    keep = slots != topk - 1
                    rows, slots = rows[keep], slots[keep]
                if len(rows):
                    act = rnd(x[rows] @ up[expert])
                    y = rnd(rnd(act / (1 + np.exp(-act))) @ down[expert])
                    np.add.at(out, rows, gate[rows, slots][:, None] * y)
            if bug == ("scale", index):
                out *= 1.05
            h = rnd(h + rnd(out))
            states.append(h.copy())
            routes.append(top)
        return states, routes

    h0 = rng.standard_normal((tokens, dim))
    ref, ref_routes = forward(h0, False)
    free, free_routes = forward(h0, True)
    forced, _ = forward(h0, True, forced=ref_routes)
    print(f"per-token rel_diff of the residual stream, bf16-emulated vs float64 ({tokens} tokens: median / max)")
    print("layer   routing forced        routing free          top-k sets differ")
    for index in range(0, layers, 10):
        a, b = rel_diff(ref[index], forced[index]), rel_diff(ref[index], free[index])
        changed = np.mean(np.any(np.sort(ref_routes[index], -1) != np.sort(free_routes[index], -1), -1))
        print(f"{index:5d}   {np.median(a):.1e} / {a.max():.1e}     {np.median(b):.1e} / {b.max():.1e}     "
              f"{changed:.0%}")
    vector = rng.standard_normal(7168)
    print(f"one bf16 rounding of a 7168-vector: {rel_diff(vector, _bf16(vector)):.1e}")
    for bug in (("drop_expert", 20), ("scale", 20)):
        buggy, _ = forward(h0, False, forced=ref_routes, bug=bug)
        print(f"float64 bug {bug[0]} at layer 20: rel_diff median {np.median(rel_diff(ref[20], buggy[20])):.1e} "
              f"at layer 20, {np.median(rel_diff(ref[-1], buggy[-1])):.1e} at the last layer")
    head = rng.standard_normal((dim, vocab)) / np.sqrt(dim) * 3.0
    logits_ref = rmsnorm(ref[-1]) @ head
    logits_low = _bf16(_bf16(rmsnorm(forced[-1])) @ _bf16(head))
    ordered_ref, ordered_low = np.sort(logits_ref, -1), np.sort(logits_low, -1)
    margin_ref = ordered_ref[:, -1] - ordered_ref[:, -2]
    change = np.abs((ordered_low[:, -1] - ordered_low[:, -2]) - margin_ref)
    print(f"lm_head (vocab {vocab}, logit std 3, median top-1 {np.median(ordered_ref[:, -1]):.1f}): per-logit diff rms "
          f"{np.sqrt(((logits_low - logits_ref) ** 2).mean()):.3f}; |margin change| median {np.median(change):.3f}, "
          f"max {change.max():.3f}; argmax flips {(logits_ref.argmax(-1) != logits_low.argmax(-1)).sum()}/{tokens}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--dim", type=int, default=7168)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calibrate", action="store_true",
                        help="instead, run the bf16-noise measurement behind the default threshold (~1.5 min)")
    args = parser.parse_args()
    if args.calibrate:
        calibrate()
        return 0
    diverge_layer, diverge_step = int(args.layers * 0.6), int(args.steps * 0.78)
    with tempfile.TemporaryDirectory(prefix="compiledump_bench_") as tmp:
        directory = Path(tmp)
        started = time.perf_counter()
        ref_path, run_path = generate(directory, args.layers, args.dim, args.steps, args.vocab,
                                      diverge_layer, diverge_step)
        generation = time.perf_counter() - started
        size = ref_path.stat().st_size + run_path.stat().st_size
        report_path = directory / "report.json"
        hwm = directory / "hwm"
        baseline = timed_child("import compiledump.compare", [], hwm)
        runs = [timed_child(CLI, ["compare", str(ref_path), str(run_path), "--json", str(report_path)], hwm)
                for _ in range(args.repeat)]
        report = json.loads(report_path.read_text())
        numpy_baseline = timed_child(STANDALONE, [], hwm)
        numpy_runs = [timed_child(STANDALONE, [str(ref_path), str(run_path), str(directory / "standalone.json")], hwm)
                      for _ in range(args.repeat)]
        numpy_elapsed = json.loads((directory / "standalone.json").read_text())["elapsed_s"]
    walls = sorted(wall for wall, _, _ in runs)
    peak = max(rss for _, rss, _ in runs)
    prefill, decode = report["prefill_divergence"], report["decode_divergence"]
    ok = (all(code == 1 for _, _, code in runs) and prefill["key"] == f"layer{diverge_layer}_moe_out"
          and prefill["last_good"] == f"layer{diverge_layer - 1}" and decode["step"] == diverge_step)
    print(f"dumps: {len(report['keys'])} keys compared, {size / 2**20:.0f} MiB on disk for both sides "
          f"(generated in {generation:.1f} s)")
    print(f"compare wall time (child process, {args.repeat} runs, warm page cache): "
          f"min {walls[0]:.2f} s, median {walls[len(walls) // 2]:.2f} s, max {walls[-1]:.2f} s")
    print(f"  of which comparison proper (report elapsed_s, last run): {report['elapsed_s']:.2f} s; "
          f"interpreter + package import alone: {baseline[0]:.2f} s")
    print(f"peak RSS: compare {peak:.1f} MiB; a child that only imports compiledump.compare {baseline[1]:.1f} MiB")
    print(f"report: first divergence {prefill['key']} (last good {prefill['last_good']}), "
          f"decode step {decode['step']}; first argmax flip: step {report['first_argmax_flip']['step']} "
          f"{report['first_argmax_flip']['kind']} (reference margin {report['first_argmax_flip']['margin_ref']:.4f})")
    numpy_walls = sorted(wall for wall, _, _ in numpy_runs)
    print(f"numpy-only (compiledump.compare called from Python, no CLI): wall min {numpy_walls[0]:.2f} s, "
          f"median {numpy_walls[len(numpy_walls) // 2]:.2f} s (comparison proper {numpy_elapsed:.2f} s); "
          f"peak RSS {max(rss for _, rss, _ in numpy_runs):.1f} MiB vs {numpy_baseline[1]:.1f} MiB for its imports alone")
    ok = ok and all(code == 1 for _, _, code in numpy_runs)
    print("check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
