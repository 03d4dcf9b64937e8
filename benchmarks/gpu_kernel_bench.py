"""The kernel-level GPU measurements of benchmarks/gpu_bench.py (which runs them as phases):
time per capture against payload size, and wide steps split into a claim and a copy launch
against one program per capture."""

from __future__ import annotations

import statistics

import torch

import compiledump
from gpu_timing import fresh_dump, graph_of, ms_per_replay, passed_captures, rounds_of


def kernel_bandwidth(device, quick, tmp):
    fresh_dump(tmp / "k")
    compiledump.init(device)
    rows = []
    sizes = [(4, 1)] + ([(4, 1024), (4, 7168)] if quick else [(4, 256), (4, 1024), (4, 7168), (8, 7168), (4, 16384)])
    n = 10 if quick else 100
    for hc, dim in sizes:
        xs = [torch.randn(64, hc, dim, device=device, dtype=torch.bfloat16) for _ in range(n)]
        graph = graph_of(lambda: [compiledump.record(f"bw{hc}x{dim}_{i}", x) for i, x in enumerate(xs)], device)
        graph.replay()
        ms = statistics.median(ms_per_replay(graph, 3 if quick else 20, device) for _ in range(5))
        per = ms * 1e3 / n
        read, written = hc * dim * 2, dim * 4  # one bf16 row in, one fp32 row out
        rows.append({"hc": hc, "dim": dim, "us_per_capture": per, "bytes": read + written,
                     "GB_per_s": (read + written) / (per * 1e-6) / 1e9})
    return {"rows": rows, "floor_us": rows[0]["us_per_capture"]}


# Steps that decide where a split pays: a decode step of hc rows and of a hidden state (one program
# by today's rule), and logits rows (split). (shape, dtype) each.
STEP_CASES = [((64, 4, 7168), torch.bfloat16), ((64, 7168), torch.bfloat16), ((64, 32000), torch.float32),
              ((64, 129280), torch.float32)]
QUICK_STEP_CASES = [((8, 4, 256), torch.bfloat16), ((64, 10243), torch.float32)]


def wide_step(device, quick, tmp):
    """record_step inside a CUDA graph, per shape: forced into a claim launch and a copy launch over
    every tile (ops/layout.py's split thresholds set to 1) against forced into one program, which
    reads the row tile after tile; `split_by_default` says which the rule picks today."""
    from compiledump.ops import layout as L

    cases, n, replays = (QUICK_STEP_CASES, 4, 3) if quick else (STEP_CASES, 20, 20)
    steps = replays + 2  # room for every replay of a round (a full region would write nothing)
    words = max(torch.Size(shape[1:]).numel() for shape, _ in cases)
    fresh_dump(tmp / "w", max_steps=steps, arena_mb=2 * len(cases) * n * steps * words * 4 // 2**20 + 64)
    compiledump.init(device)
    compiledump.set_rows(1)
    rows = []
    for shape, dtype in cases:
        xs = [torch.randn(*shape, device=device).to(dtype) for _ in range(n)]
        label = "x".join(map(str, shape))
        graphs = {}
        for name, thresholds in (("split", (1, 1)), ("one_program", (1 << 40, 1 << 40))):
            saved = L.SPLIT_MIN_READ, L.SPLIT_MIN_COLUMNS
            L.SPLIT_MIN_READ, L.SPLIT_MIN_COLUMNS = thresholds
            try:  # the launches are fixed when the graph is captured
                graphs[name] = graph_of(lambda name=name: [compiledump.record_step(f"{name}{label}_{i}", x)
                                                           for i, x in enumerate(xs)], device)
            finally:
                L.SPLIT_MIN_READ, L.SPLIT_MIN_COLUMNS = saved
        times = rounds_of(graphs, device, rounds=3 if quick else 10, replays=replays, before=compiledump.clear)
        split, one = (statistics.median(times[k]) * 1e3 / n for k in ("split", "one_program"))
        rows.append({"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "width": shape[-1],
                     "split_by_default": L.splits(shape[1] if len(shape) == 3 else 1, shape[-1]), "us_per_capture_split": split,
                     "us_per_capture_one_program": one, "speedup": one / split})
    compiledump.clear()
    for graph in graphs.values():
        graph.replay()  # after clear(): each capture of the last case wrote one step
    passed = passed_captures(compiledump.flush())
    return {"ok": passed == 2 * n, "captures_per_graph": n, "rows": rows,
            "split_min_read": L.SPLIT_MIN_READ, "split_min_columns": L.SPLIT_MIN_COLUMNS}
