"""Benchmark `compiledump compare` on a DeepSeek-V3-sized dump pair.

Writes two dumps into a temporary directory (deleted afterwards):

* REF: a compiledump file (npz + manifest), RUN: a seed-style file (npz only), so both readers run;
* 200 hidden-state keys of dim 7168 (``layer<i>_moe_out`` and ``layer<i>`` for 100 layers), 100
  int32 top-8 expert-id keys, a prefill ``logits`` row, and 256 decode steps of 129280-wide
  ``logits_<n>`` (132 MB of logits per side);
* RUN = REF + relative noise 1e-3 everywhere, a large perturbation from layer 60 on and from
  decode step 200 on.

Then runs ``compiledump compare REF RUN --json ...`` (the ``python -m compiledump`` entry, table
printed to /dev/null) in a child process and reports its wall time and peak RSS (VmHWM), next to a
child that only imports the package; does the same with compare.py loaded alone (numpy only,
without the package ``__init__``); and checks that the report names layer 60 and step 199.

Usage: python benchmarks/bench_compare.py [--steps 256] [--vocab 129280] [--layers 100] [--dim 7168]
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
    """Write the REF (with manifest) and RUN (seed-style) dumps; return their paths."""
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
            relative = 0.3 if large else 1e-3
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


# Loads compiledump/compare.py by path, without the package __init__ (which imports torch for the
# capture runtime), to measure what the comparator itself costs: numpy only.
STANDALONE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("compare_standalone", {path!r})
cmp = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = cmp
spec.loader.exec_module(cmp)
if len(sys.argv) > 1:
    report = cmp.compare(sys.argv[1], sys.argv[2])
    print("\\n".join(cmp.format_report(report)))
    cmp.write_json_report(report, sys.argv[3])
    sys.exit(report["exit_status"])
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--dim", type=int, default=7168)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
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
        standalone = STANDALONE.format(path=str(REPO / "compiledump" / "compare.py"))
        numpy_baseline = timed_child(standalone, [], hwm)
        numpy_runs = [timed_child(standalone, [str(ref_path), str(run_path), str(directory / "standalone.json")], hwm)
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
    print(f"numpy-only (compare.py loaded without the package __init__): wall min {numpy_walls[0]:.2f} s, "
          f"median {numpy_walls[len(numpy_walls) // 2]:.2f} s (comparison proper {numpy_elapsed:.2f} s); "
          f"peak RSS {max(rss for _, rss, _ in numpy_runs):.1f} MiB vs {numpy_baseline[1]:.1f} MiB for its imports alone")
    ok = ok and all(code == 1 for _, _, code in numpy_runs)
    print("check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
