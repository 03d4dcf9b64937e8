"""GPU performance script (issue: performance): one prepared run, one summary table last.

    python benchmarks/gpu_bench.py --device cuda --out gpu_bench.json   # on a GPU (scripts/gpu_run.sh)
    python benchmarks/gpu_bench.py --device cuda --dry-run              # the plan; CUDA not initialized
    python benchmarks/gpu_bench.py --device cpu --quick                 # the CPU-checkable parts
    python benchmarks/gpu_bench.py --device cpu --quick --emulate       # every phase, eager stand-ins

The engine flow throughout (README, docs/compiling.md): the arena first (`init`), warm-up on a side
stream and graph capture under `compiledump.profiling()`, then replays with capture on. The token
gate is off (`tokens=0`), so every capture in a replay writes. Times are CUDA events around many
replays, rounds interleaved, medians.

Measurements, in run order (what issue 16's goals and the open decisions need first; a short
--time-limit drops the last ones):
  graph_capture_cost  N `record`s of a [64, 4, 7168] bf16 tensor inside one CUDA graph, replayed,
                      vs the same graph without them: added device microseconds per capture (goal <= 1),
                      and against a 1-element kernel in each capture's place (the launch floor) and,
                      on the Triton kernel, against captures whose commit is relaxed (its fence's cost)
                      and captures that load the payload only after the claim (what loading it
                      before saves);
  decode_overhead     the built-in model at dim 7168, 40 layers x 5 taps + logits, decode batch 64,
                      eager kernels in a CUDA graph: replay with captures vs the same model without
                      capture points (goal ratio <= 1.02), and with a 1-element kernel at each capture
                      point instead (the launch floor);
  flush_throughput    flush()'s device-to-host part (the runtime's snapshot) vs a plain
                      `pinned.copy_(arena, non_blocking=True)` + sync of the same bytes (goal >= 80%);
  graph_equals_eager  the decode model's dump from graph replays equals its eager dump, and the
                      replays run clean under torch.cuda.set_sync_debug_mode("error");
  wide_step           record_step in a graph of [64, 4, 7168] and [64, 7168] bf16 and of [64, 32000]
                      and [64, 129280] fp32 logits: split (claim launch + copy over every tile) vs one
                      program per capture, each forced (where should layout.splits split?);
  compiled_host_cost  N captures in a function compiled without CUDA graphs (how engines run large
                      prefills) vs the same function without them: host microseconds per capture
                      call (goal <= 5);
  kernel_bandwidth    time per capture vs payload (hc_mult x dim of one row): bytes/s, and the floor
                      (a 1-element capture: graph-node overhead);
  latency_chain       the capture kernel's dependency chain built up one stage at a time in a
                      one-program kernel (empty, store, control-register read, block agreement,
                      claim atomic, payload load, release commit; then the payload load not
                      waiting for the claim): µs per graph node, and what each stage adds;
  eager_vs_seed       eager cost per capture call, compiledump vs debug_dump.py (which copies to the
                      host, and so synchronizes, on every call); skipped where that file is absent;
  decode_overhead_compiled  decode_overhead with torch.compile(fullgraph=True) inside the graphs
                      (last: its compiles take minutes; --time-limit skips it when time is short).
Each phase is wrapped: a failure is recorded (error, the traceback's last line) and the next phase
runs; the JSON (--out) is rewritten after every phase. Exit status: 0, 1 if a phase failed, 2 for
bad options or a CUDA device asked for where there is none.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parent / "scripts"), str(_HERE), str(_HERE.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import compiledump  # noqa: E402
import gpu_common  # noqa: E402
from compiledump.ops import register, variants  # noqa: E402
from gpu_kernel_bench import kernel_bandwidth, latency_chain, wide_step  # noqa: E402
from gpu_summary import summary_line  # noqa: E402
from gpu_timing import fresh_dump, graph_of, passed_captures, rounds_of  # noqa: E402
from harness import DEBUG_DUMP, interleaved, load_debug_dump, machine  # noqa: E402


def graph_capture_cost(device, quick, tmp):
    fresh_dump(tmp / "g", max_steps=4)
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

    ticks = torch.zeros(n, 1, device=device)

    def work_and_empty_node():  # the launch floor: one 1-element kernel where each capture would be
        for x, y, tick in zip(xs, ys, ticks):
            y.copy_(x)
            tick.add_(1)

    graphs = {"without": graph_of(work, device), "with": graph_of(work_and_capture, device),
              "floor": graph_of(work_and_empty_node, device)}
    triton = not register.native_owns_capture("cuda")
    if triton:  # the Triton kernel with a relaxed commit (what its release fence costs), and
        # loading the payload after the claim (what loading it before saves); the launches are
        # fixed when the graph is captured
        for name, switch in (("relaxed", "COMMIT_RELEASE"), ("claim_first", "PAYLOAD_FIRST")):
            setattr(variants, switch, False)
            try:
                graphs[name] = graph_of(work_and_capture, device)
            finally:
                setattr(variants, switch, True)
    replays = 3 if quick else 20
    times = rounds_of(graphs, device, rounds=3 if quick else 15, replays=replays)
    base, added, floor = (statistics.median(times[k]) for k in ("without", "with", "floor"))
    compiledump.clear()
    graphs["with"].replay()  # one replay after clear(): each of the n captures must have written
    passed = passed_captures(compiledump.flush())
    us, floor_us = (added - base) * 1e3 / n, (floor - base) * 1e3 / n
    result = {"ok": passed == n, "captures": n, "shape": list(shape), "dtype": "bfloat16",
              "replays_per_round": replays, "graph_ms_without": base, "graph_ms_with": added,
              "graph_ms_with_empty_nodes": floor, "us_per_capture": us,
              # What one more graph node costs at all (a 1-element add): no one-kernel capture is cheaper.
              "us_per_empty_node": floor_us, "us_over_empty_node": us - floor_us,
              "captures_passed_per_replay": passed, "goal_us": 1.0, "meets_goal": us <= 1.0}
    if triton:
        result["us_per_capture_relaxed_commit"] = (statistics.median(times["relaxed"]) - base) * 1e3 / n
        result["us_per_capture_claim_first"] = (statistics.median(times["claim_first"]) - base) * 1e3 / n
    return result


def compiled_host_cost(device, quick, tmp):
    """N captures inside one compiled function run without CUDA graphs (as engines run large
    prefills), against the same function without them: host microseconds per capture call."""
    fresh_dump(tmp / "h", max_steps=4, moe_layers=10**6)
    compiledump.init(device)
    n, dim = (6, 64) if quick else (64, 7168)
    x = torch.randn(8, 4, dim, device=device, dtype=torch.bfloat16)

    def body(x, dump):
        h = x * 2
        for i in range(n):
            if dump is not None and i % 2 == 0:
                dump.record(f"c{i}", h)
            elif dump is not None:
                dump.record_step(f"c{i}", h[:, 0])
        return h

    plain = torch.compile(lambda x: body(x, None), fullgraph=True)
    instrumented = torch.compile(lambda x: body(x, compiledump), fullgraph=True)
    calls = {"plain": lambda: plain(x), "instrumented": lambda: instrumented(x)}
    for fn in calls.values():
        fn()  # compile
    rounds, per_round = (3 if quick else 15), (5 if quick else 200)
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in list(calls)[r % 2:] + list(calls)[: r % 2]:
            begun = time.perf_counter()
            for _ in range(per_round):
                calls[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - begun) * 1e6 / per_round)
    plain_us, instr_us = (statistics.median(times[k]) for k in ("plain", "instrumented"))
    from compiledump.capture.state import STATE

    us = (instr_us - plain_us) / n
    return {"captures": n, "dim": dim, "capture_path": STATE.runtime.capture_path, "call_us_plain": plain_us,
            "call_us_instrumented": instr_us, "host_us_per_capture": us, "goal_us": 5.0, "meets_goal": us <= 5.0}


@functools.lru_cache(maxsize=1)
def _decode_model(device, quick):
    from compiledump.demo.model import ModelConfig, TinyMoE

    if quick:
        # On CPU (only --emulate runs it there: eager steps stand in for replays) at width 64: CPU
        # bf16 einsums at 256 took 0.2 s a step, and nothing emulated depends on the width.
        width = 64 if device.type == "cpu" else 256
        cfg, batch = ModelConfig(layers=4, dim=width, vocab=4096, ffn=width, captures_per_layer=5), 8
    else:
        cfg, batch = ModelConfig(layers=40, dim=7168, vocab=32000, ffn=512, captures_per_layer=5), 64
    model = TinyMoE(cfg, device=device, dtype=torch.bfloat16)
    return model, cfg, batch


def _decode_overhead(device, quick, tmp, compiled):
    from compiledump.demo.model import NO_DUMP

    fresh_dump(tmp / "d", moe_layers=1000, max_steps=256)  # every layer's taps; clear() keeps steps < 256
    compiledump.init(device)
    model, cfg, batch = _decode_model(device, quick)
    step = torch.compile(model, fullgraph=True) if compiled else model
    tokens = torch.randint(0, cfg.vocab, (batch,), device=device)
    state = torch.randn(cfg.layers, batch, cfg.dim, device=device, dtype=torch.bfloat16)
    compiledump.set_rows(1)
    dumps = [("plain", NO_DUMP), ("captures", compiledump)]
    if not compiled:  # (Inductor would fuse the stand-in kernels: no floor to measure there)
        dumps.append(("empty_nodes", _empty_nodes(device)))
    graphs = {}
    with torch.no_grad():
        for name, dump in dumps:
            model.dump = dump  # captured graphs keep their kernels; dynamo re-traces on the swap
            graphs[name] = graph_of(lambda: step(tokens, state), device)
        model.dump = NO_DUMP
        replays = 3 if quick else 50
        times = rounds_of(graphs, device, rounds=3 if quick else 10, replays=replays, before=compiledump.clear)
    ratio = statistics.median(b / a for a, b in zip(times["plain"], times["captures"]))
    plain, with_ = (statistics.median(times[k]) for k in ("plain", "captures"))
    captures = cfg.layers * cfg.captures_per_layer + 1
    result = {"compiled": compiled, "layers": cfg.layers, "taps_per_layer": cfg.captures_per_layer, "dim": cfg.dim,
              "batch": batch, "captures_per_step": captures, "step_ms_plain": plain, "step_ms_instrumented": with_,
              "ratio": ratio, "us_per_capture": (with_ - plain) * 1e3 / captures, "goal_ratio": 1.02,
              "meets_goal": ratio <= 1.02}
    if "empty_nodes" in times:  # the same step with a 1-element kernel at each capture point
        result["step_ms_empty_nodes"] = statistics.median(times["empty_nodes"])
        result["ratio_empty_nodes"] = statistics.median(b / a for a, b in zip(times["plain"], times["empty_nodes"]))
    return result


def _empty_nodes(device):
    """A stand-in for compiledump whose every capture is one 1-element kernel: what the decode step
    pays for a graph node per capture point at all (the floor of any one-kernel capture)."""
    tick = torch.zeros(1, device=device)

    def node(*_args, **_kwargs):
        tick.add_(1)

    return types.SimpleNamespace(record=node, record_step=node, record_ids=node, set_rows=lambda *_: None)


def decode_overhead(device, quick, tmp):
    return _decode_overhead(device, quick, tmp, compiled=False)


def decode_overhead_compiled(device, quick, tmp):
    return _decode_overhead(device, quick, tmp, compiled=True)


def flush_throughput(device, quick, tmp):
    from compiledump.capture.state import STATE

    steps, width = (8, 32000) if quick else (256, 129280)  # full: 132 MB of logits steps
    fresh_dump(tmp / "f", max_steps=steps)
    compiledump.set_rows(1)
    logits = torch.randn(8, width, device=device)
    for _ in range(steps):
        compiledump.record_step("logits", logits)
    rt = STATE.runtime
    used = rt.arena[: rt.used_words]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pinned = torch.empty(used.numel(), dtype=torch.float32, pin_memory=device.type == "cuda")
    rt.snapshot()  # allocates its pinned buffers once

    def snapshot():
        rt.snapshot()

    def plain():
        pinned.copy_(used, non_blocking=True)
        sync()

    sync()
    per_round = interleaved({"snapshot": snapshot, "plain": plain}, rounds=3 if quick else 10, calls=1, warmup=1)
    snap_s, plain_s = (statistics.median(per_round[k]) for k in ("snapshot", "plain"))
    begun = time.perf_counter()
    compiledump.flush()
    nbytes = used.numel() * 4
    return {"bytes": nbytes, "snapshot_GB_per_s": nbytes / snap_s / 1e9, "pinned_copy_GB_per_s": nbytes / plain_s / 1e9,
            "efficiency": plain_s / snap_s, "goal_efficiency": 0.8, "meets_goal": plain_s / snap_s >= 0.8,
            "whole_flush_s": time.perf_counter() - begun}


def graph_equals_eager(device, quick, tmp):
    from compiledump.demo.model import NO_DUMP

    model, cfg, batch = _decode_model(device, quick)
    steps = 4
    g = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (steps, batch), generator=g, device=device)
    states = torch.randn(steps, cfg.layers, batch, cfg.dim, generator=g, device=device).bfloat16()
    fresh_dump(tmp / "eq", moe_layers=1000)
    compiledump.init(device)
    compiledump.set_rows(1)
    model.dump = compiledump
    try:
        with torch.no_grad():
            for s in range(steps):
                model(tokens[s], states[s])
            eager = gpu_common.load_npz(compiledump.flush())
            static_tokens, static_state = tokens[0].clone(), states[0].clone()
            graph = graph_of(lambda: model(static_tokens, static_state), device)
            sync_error = None
            for attempt in ("error", 0):
                compiledump.clear()
                gpu_common.poison_arena()  # clear() keeps old payloads: a missed write must show
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(attempt)
                try:
                    for s in range(steps):  # an engine's step: inputs into the buffers, rows, replay
                        static_tokens.copy_(tokens[s])
                        static_state.copy_(states[s])
                        compiledump.set_rows(1)
                        graph.replay()
                    break
                except RuntimeError as error:  # a host sync during replays: record it, compare anyway
                    sync_error = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
                finally:
                    if device.type == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
            replayed = gpu_common.load_npz(compiledump.flush())
    finally:
        model.dump = NO_DUMP
    verdict = gpu_common.compare_dumps(eager, replayed, rtol=1e-6)
    return {**verdict, "ok": verdict["ok"] and sync_error is None, "replays": steps,
            "sync_debug": "not checked (no CUDA)" if device.type != "cuda" else sync_error or "clean"}


def eager_vs_seed(device, quick, tmp):
    if not DEBUG_DUMP.exists():
        raise gpu_common.SkipPhase(f"{DEBUG_DUMP} is absent")
    fresh_dump(tmp / "e", max_steps=1 << 20)
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


# name -> (function, needs CUDA unless --emulate, rough seconds on one H200: the --time-limit estimate)
PHASES = {
    "graph_capture_cost": (graph_capture_cost, True, 20),
    "decode_overhead": (decode_overhead, True, 40),
    "flush_throughput": (flush_throughput, True, 15),
    "graph_equals_eager": (graph_equals_eager, True, 20),
    "wide_step": (wide_step, True, 30),
    "compiled_host_cost": (compiled_host_cost, True, 40),
    "kernel_bandwidth": (kernel_bandwidth, True, 30),
    "latency_chain": (latency_chain, True, 15),
    "eager_vs_seed": (eager_vs_seed, False, 20),
    "decode_overhead_compiled": (decode_overhead_compiled, True, 180),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpu_common.add_arguments(parser, default_out="gpu_bench.json")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", nargs="*", choices=list(PHASES), help="run only these measurements")
    parser.add_argument("--emulate", action="store_true",
                        help="on CPU, run the graph phases with eager calls standing in for replays (tests)")
    started = gpu_common.start(parser, argv, "gpu_bench")
    if isinstance(started, int):
        return started
    args, device, note = started
    selected = [name for name in PHASES if not args.only or name in args.only]
    emulate = args.emulate and device.type == "cpu"
    if args.dry_run:
        plan = [(name, PHASES[name][1] and not emulate, PHASES[name][2]) for name in selected]
        gpu_common.print_plan("gpu_bench", device, args.device, note, args.out, plan, args.time_limit)
        return 0
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {**gpu_common.metadata(device), "machine": machine(), "quick": args.quick, "emulated": emulate,
               "phases": {}}
    runner = gpu_common.Runner("gpu_bench", device, args.out, args.time_limit, results)
    with tempfile.TemporaryDirectory() as tmp:
        for name in selected:
            fn, needs_cuda, estimate = PHASES[name]
            runner.run(name, functools.partial(fn, device, args.quick, Path(tmp)),
                       needs_cuda=needs_cuda and not emulate, estimate_s=2 if args.quick else estimate)
    _decode_model.cache_clear()
    if emulate:
        print("emulated: eager calls stood in for CUDA graph replays; the numbers below mean nothing")
    return runner.summary(summary_line)


if __name__ == "__main__":
    sys.exit(main())
