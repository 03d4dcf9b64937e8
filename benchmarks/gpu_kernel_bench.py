"""The kernel-level GPU measurements of benchmarks/gpu_bench.py (which runs them as phases):
time per capture against payload size, wide steps split into a claim and a copy launch against
one program per capture, and the capture kernel's dependency chain built up stage by stage."""

from __future__ import annotations

import os
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
    from compiledump.ops.geometry import geometry

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
                     "split_by_default": L.splits(*geometry(xs[0], L.KIND_STEP)[1][1:3]), "us_per_capture_split": split,
                     "us_per_capture_one_program": one, "speedup": one / split})
    compiledump.clear()
    for graph in graphs.values():
        graph.replay()  # after clear(): each capture of the last case wrote one step
    passed = passed_captures(compiledump.flush())
    return {"ok": passed == 2 * n, "captures_per_graph": n, "rows": rows,
            "split_min_read": L.SPLIT_MIN_READ, "split_min_columns": L.SPLIT_MIN_COLUMNS}


# The capture kernel's dependency chain, built up one stage at a time in a one-program kernel (the
# stages are cumulative; `payload_first` is `commit` with the payload load no longer waiting for
# the claim). On the first H200 run a capture added 3.99 us to a replayed graph and an empty
# kernel node 1.28 us, whatever the payload's size: the rest is latency, and the differences
# between these rows say which stage holds it, so the kernel is reshaped where it pays.
CHAIN_STAGES = ["empty", "store", "register", "agree", "claim", "payload", "commit", "payload_first"]


def _chain_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["D"])
    def chain(ctrl_ptr, x_ptr, out_ptr, D, STAGE: tl.constexpr, BLOCK: tl.constexpr):
        if STAGE >= 1:  # store: one tile of zeros
            cols = tl.arange(0, BLOCK)
            row = tl.zeros([], tl.int64)
            if STAGE >= 2:  # register: the store's address waits for a control-block word
                row = tl.load(ctrl_ptr).to(tl.int64)
            if STAGE >= 3:  # agree: one block-wide snapshot of it (the capture kernel's reduction)
                row = tl.max(tl.full([BLOCK], 0, tl.int64) + row, axis=0)
            value = tl.zeros([BLOCK], tl.float32)
            if STAGE == 7:  # payload_first: the row's load is issued before the claim and waits for the register only
                value = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            old = tl.zeros([], tl.int64)
            if STAGE >= 4:  # claim: a counter's old value decides where the row goes
                old = tl.atomic_add(ctrl_ptr + 8, 1, sem="relaxed").to(tl.int64)
            # payload: the load waits for the claim too (its mask), as in the capture kernel
            if STAGE == 5 or STAGE == 6:
                limit = tl.where(old >= 0, D, 0)  # a limit, not a scalar in the mask (the interpreter's dislike)
                value = tl.load(x_ptr + row * D + cols, mask=cols < limit, other=0.0).to(tl.float32)
            # The address uses the register (0 at run time) and the claim, so the store waits for both.
            tl.store(out_ptr + ((old + row) & 3) * BLOCK + cols, value, mask=cols < D)
            if STAGE >= 6:  # commit: a release after the block's stores
                tl.debug_barrier()
                tl.atomic_add(ctrl_ptr + 9, 1, sem="release")

    return chain


def latency_chain(device, quick, tmp):
    """Device µs per graph node of each CHAIN_STAGES kernel (200 nodes per graph, one program of 8
    warps, a 2048-column bf16 row), and what each stage adds to the one before it."""
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        import gpu_common  # scripts/, on the path gpu_bench.py sets

        raise gpu_common.SkipPhase("raw Triton kernels: a CUDA device, or TRITON_INTERPRET=1 on CPU")
    chain = _chain_kernel()
    n, block = (4 if quick else 200), 2048
    ctrl = torch.zeros(16, dtype=torch.int32, device=device)
    x = torch.randn(4, block, device=device).bfloat16()
    outs = {stage: torch.zeros(4 * block, device=device) for stage in CHAIN_STAGES}

    def nodes(stage):
        index = CHAIN_STAGES.index(stage)
        return lambda: [chain[(1,)](ctrl, x, outs[stage], block, STAGE=index, BLOCK=block, num_warps=8)
                        for _ in range(n)]

    graphs = {stage: graph_of(nodes(stage), device) for stage in CHAIN_STAGES}  # compiled in its warm-up
    times = rounds_of(graphs, device, rounds=2 if quick else 10, replays=2 if quick else 20)
    us = {stage: statistics.median(times[stage]) * 1e3 / n for stage in CHAIN_STAGES}
    # What each stage adds to the one before it (payload_first is commit reordered: see its saving).
    rows = [{"stage": stage, "us_per_node": us[stage],
             "us_added": None if i == 0 or stage == "payload_first" else us[stage] - us[CHAIN_STAGES[i - 1]]}
            for i, stage in enumerate(CHAIN_STAGES)]
    # Every stage that loads the payload stored row 0 of x (ctrl's words are 0): the kernels did the work.
    stored = all(torch.equal(outs[stage][:block].view(-1), x[0].float()) for stage in ("payload", "commit",
                                                                                        "payload_first"))
    return {"ok": stored, "nodes_per_graph": n, "rows": rows,
            "payload_first_saves_us": us["commit"] - us["payload_first"]}


KERNEL_PHASES = ("kernel_bandwidth", "wide_step", "latency_chain")


def kernel_summary(name, r) -> str:
    """The summary table's key number of one of these phases' results."""
    if name == "kernel_bandwidth":
        best = max(r["rows"], key=lambda x: x["GB_per_s"])
        return f"floor {r['floor_us']:.2f} us/capture; best {best['GB_per_s']:.1f} GB/s at {best['hc']}x{best['dim']}"
    if name == "latency_chain":
        return (", ".join(f"{row['stage']} +{row['us_added']:.2f}" for row in r["rows"] if row["us_added"] is not None)
                + f" us (empty node {r['rows'][0]['us_per_node']:.2f}); payload first saves "
                  f"{r['payload_first_saves_us']:.2f}")
    return "; ".join(f"{'x'.join(map(str, row['shape']))} {row['dtype']}: {row['us_per_capture_split']:.2f} us "
                     f"split vs {row['us_per_capture_one_program']:.2f} one program" for row in r["rows"])
