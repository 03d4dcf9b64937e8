"""GPU performance script (issue: performance): one prepared run, a summary table last.

    python benchmarks/gpu_bench.py --out gpu_bench.json          # on a GPU, under 10 minutes
    python benchmarks/gpu_bench.py --device cpu --quick          # the CPU-checkable parts

Measurements (CUDA events, medians over repeats; graphs are warmed up before capture):
  graph_capture_cost  200 captures of [64, 4, 7168] bf16 inside one CUDA graph, replayed, vs the
                      same graph without them: added microseconds per capture (goal <= 1 us);
  decode_overhead     the bench model scaled to dim 7168, 40 layers x 5 captures + logits, decode
                      batch 64, decode step in a CUDA graph with vs without captures (goal <= 2%);
  kernel_bandwidth    time per capture vs payload (hc_mult x dim of one row): achieved bytes/s,
                      and the floor (a 1-element capture: graph-node/launch overhead);
  flush_throughput    flush()'s device-to-host copy vs a plain pinned copy of the same size
                      measured in the same run (goal >= 80%);
  eager_vs_seed       eager cost per capture call, compiledump vs the seed (which copies to the
                      host, and so synchronizes, on every call).
Full numbers go to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, load_debug_dump, machine  # noqa: E402


def _events_ms(fn, repeats: int) -> float:
    """Median milliseconds of `fn` timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph(fn):
    """Warm `fn` up on a side stream (Triton compiles there), capture it, return the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _fresh(directory, **settings):
    import compiledump

    torch._dynamo.reset()
    compiledump.reset()
    compiledump.configure(dir=str(directory), **settings)


def graph_capture_cost(device, quick, tmp):
    import compiledump

    _fresh(tmp / "g", max_steps=4)
    compiledump.init(device)
    n, shape = (20, (8, 4, 256)) if quick else (200, (64, 4, 7168))
    xs = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(n)]
    ys = [torch.empty_like(x) for x in xs]

    def work():  # a stand-in for the model's own kernels, the same in both graphs
        for x, y in zip(xs, ys):
            y.copy_(x)

    def work_and_capture():
        for i, (x, y) in enumerate(zip(xs, ys)):
            y.copy_(x)
            compiledump.record(f"t{i}", y)

    without, with_ = _graph(work), _graph(work_and_capture)
    reps = 5 if quick else 50
    base = _events_ms(without.replay, reps)
    added = _events_ms(with_.replay, reps)
    return {"captures": n, "shape": list(shape), "graph_ms_without": base, "graph_ms_with": added,
            "us_per_capture": (added - base) * 1e3 / n, "goal_us": 1.0}


def decode_overhead(device, quick, tmp):
    import compiledump
    from compiledump.demo.model import NO_DUMP, ModelConfig, TinyMoE

    _fresh(tmp / "d", moe_layers=1000)
    if quick:
        cfg, batch = ModelConfig(layers=4, dim=256, vocab=4096, ffn=256, captures_per_layer=5), 8
    else:
        cfg, batch = ModelConfig(layers=40, dim=7168, vocab=32000, ffn=512, captures_per_layer=5), 64
    dtype = torch.bfloat16
    plain = torch.compile(TinyMoE(cfg, dump=NO_DUMP, device=device, dtype=dtype), fullgraph=True)
    instr = torch.compile(TinyMoE(cfg, dump=compiledump, device=device, dtype=dtype), fullgraph=True)
    tokens = torch.randint(0, cfg.vocab, (batch,), device=device)
    state = torch.randn(cfg.layers, batch, cfg.dim, device=device, dtype=dtype)
    compiledump.set_rows(1)
    with torch.no_grad():
        g_plain = _graph(lambda: plain(tokens, state))
        g_instr = _graph(lambda: instr(tokens, state))
        reps = 5 if quick else 30
        rounds = [(_events_ms(g_plain.replay, reps), _events_ms(g_instr.replay, reps)) for _ in range(5)]
    ratio = statistics.median(b / a for a, b in rounds)
    return {"layers": cfg.layers, "dim": cfg.dim, "batch": batch, "captures_per_step": cfg.layers * 5 + 1,
            "step_ms_plain": statistics.median(a for a, _ in rounds),
            "step_ms_instrumented": statistics.median(b for _, b in rounds), "ratio": ratio, "goal_ratio": 1.02}


def kernel_bandwidth(device, quick, tmp):
    import compiledump

    _fresh(tmp / "k")
    compiledump.init(device)
    rows = []
    sizes = [(4, 1)] + ([(4, 1024), (4, 7168)] if quick else [(4, 256), (4, 1024), (4, 7168), (8, 7168), (4, 16384)])
    n = 10 if quick else 100
    for hc, dim in sizes:
        xs = [torch.randn(64, hc, dim, device=device, dtype=torch.bfloat16) for _ in range(n)]
        graph = _graph(lambda: [compiledump.record(f"bw{hc}x{dim}_{i}", x) for i, x in enumerate(xs)])
        ms = _events_ms(graph.replay, 5 if quick else 50)
        per = ms * 1e3 / n
        read, written = hc * dim * 2, dim * 4  # one bf16 row in, one fp32 row out
        rows.append({"hc": hc, "dim": dim, "us_per_capture": per, "bytes": read + written,
                     "GB_per_s": (read + written) / (per * 1e-6) / 1e9})
    return {"rows": rows, "floor_us": rows[0]["us_per_capture"]}


def flush_throughput(device, quick, tmp):
    import compiledump
    from compiledump.capture.state import STATE

    _fresh(tmp / "f", max_steps=64 if not quick else 8)
    steps, width = (8, 32000) if quick else (64, 129280)
    logits = torch.randn(8, width, device=device)
    for _ in range(steps):
        compiledump.record_step("logits", logits)
    rt = STATE.runtime
    nbytes = rt.used_words * 4
    rt.snapshot()  # allocates the pinned buffers once
    snap = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rt.snapshot()
        snap.append(time.perf_counter() - start)
    pinned = torch.empty(rt.used_words, dtype=torch.float32, pin_memory=True)
    plain = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        pinned.copy_(rt.arena[: rt.used_words], non_blocking=True)
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - start)
    start = time.perf_counter()
    compiledump.flush()
    flush_s = time.perf_counter() - start
    snap_s, plain_s = statistics.median(snap), statistics.median(plain)
    return {"bytes": nbytes, "snapshot_GB_per_s": nbytes / snap_s / 1e9, "pinned_copy_GB_per_s": nbytes / plain_s / 1e9,
            "efficiency": plain_s / snap_s, "goal_efficiency": 0.8, "whole_flush_s": flush_s}


def eager_vs_seed(device, quick, tmp):
    import compiledump


    _fresh(tmp / "e", max_steps=1 << 20)
    seed = load_debug_dump(tmp / "seed", moe_layers=8)
    x = torch.randn(8, 4, 1024 if quick else 7168, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def cd():
        compiledump.record("layer0", x)

    def sd():
        seed.record("layer0", x)

    per_round = interleaved({"compiledump": cd, "seed": sd}, rounds=5 if quick else 15, calls=100 if quick else 1000)
    sync()
    seed._CAPTURED.clear()
    cd_us, seed_us = (statistics.median(per_round[k]) * 1e6 for k in ("compiledump", "seed"))
    return {"compiledump_us": cd_us, "seed_us": seed_us, "speedup": seed_us / cd_us}


PHASES = {
    "graph_capture_cost": (graph_capture_cost, True),
    "decode_overhead": (decode_overhead, True),
    "kernel_bandwidth": (kernel_bandwidth, True),
    "flush_throughput": (flush_throughput, True),
    "eager_vs_seed": (eager_vs_seed, False),
}


def _summary(name, r):
    if "error" in r or "skipped" in r:
        return r.get("error") or r["skipped"]
    if name == "graph_capture_cost":
        return f"{r['us_per_capture']:.2f} us/capture added in a replayed graph (goal <= {r['goal_us']})"
    if name == "decode_overhead":
        return (f"step {r['step_ms_plain']:.3f} -> {r['step_ms_instrumented']:.3f} ms, ratio {r['ratio']:.4f} "
                f"(goal <= {r['goal_ratio']}), {r['captures_per_step']} captures")
    if name == "kernel_bandwidth":
        best = max(r["rows"], key=lambda x: x["GB_per_s"])
        return f"floor {r['floor_us']:.2f} us/capture; best {best['GB_per_s']:.1f} GB/s at {best['hc']}x{best['dim']}"
    if name == "flush_throughput":
        return (f"{r['snapshot_GB_per_s']:.1f} vs {r['pinned_copy_GB_per_s']:.1f} GB/s plain pinned copy: "
                f"{100 * r['efficiency']:.0f}% (goal >= 80%)")
    return f"compiledump {r['compiledump_us']:.1f} us vs seed {r['seed_us']:.1f} us per call ({r['speedup']:.1f}x)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--out", default="gpu_bench.json")
    parser.add_argument("--only", nargs="*", choices=list(PHASES), help="run only these measurements")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {"machine": machine(), "device": str(device), "quick": args.quick}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (fn, needs_cuda) in PHASES.items():
            if args.only and name not in args.only:
                continue
            if needs_cuda and device.type != "cuda":
                results[name] = {"skipped": "needs a CUDA device"}
                continue
            started = time.perf_counter()
            try:
                results[name] = fn(device, args.quick, Path(tmp))
            except Exception as error:  # noqa: BLE001 - report every phase
                results[name] = {"error": f"{type(error).__name__}: {error}"}
            results[name]["seconds"] = time.perf_counter() - started
            print(f"[gpu_bench] {name}: {time.perf_counter() - started:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{results['machine']}" + (f"; {results.get('gpu')}" if "gpu" in results else ""))
    print(f"{'measurement':<22}summary")
    for name in PHASES:
        if name in results:
            print(f"{name:<22}{_summary(name, results[name])}")
    return 1 if any("error" in r for r in results.values() if isinstance(r, dict)) else 0


if __name__ == "__main__":
    sys.exit(main())
