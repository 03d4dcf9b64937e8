"""How benchmarks/gpu_bench.py builds and times CUDA graphs, in the engine flow.

``graph_of`` warms a function up on a side stream and captures it, both under ``profiling()``;
``ms_per_replay`` times one graph's replays; ``rounds_of`` times several graphs in interleaved
rounds. On CPU (``--emulate``) eager calls stand in for the replays, so the code paths run in the
suite; the numbers mean nothing. ``fresh_dump`` starts each measurement's dump and
``passed_captures`` reads back how many of its captures wrote.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import compiledump


class _Eager:
    """--emulate on CPU: eager calls stand in for a captured graph's replays (the numbers mean nothing)."""

    def __init__(self, fn):
        self.replay = fn


def graph_of(fn, device):
    """Warm `fn` up on a side stream and capture it, both under profiling() (engine flow)."""
    if device.type != "cuda":
        with compiledump.profiling():
            fn()
        return _Eager(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), compiledump.profiling():
        for _ in range(2):  # Triton compiles here, never during capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with compiledump.profiling(), torch.cuda.graph(graph):
        fn()
    return graph


def ms_per_replay(graph, replays, device) -> float:
    """Mean ms per replay over `replays` back-to-back replays (CUDA events; on CPU, wall time)."""
    if device.type != "cuda":
        begun = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        return (time.perf_counter() - begun) * 1e3 / replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def rounds_of(graphs: dict, device, rounds: int, replays: int, before=None) -> dict[str, list[float]]:
    """ms per replay of each graph, per round; rounds interleaved in a rotating order."""
    names = list(graphs)
    for name in names:  # untimed first replays
        graphs[name].replay()
    per_round = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if before is not None:
                before()
            per_round[name].append(ms_per_replay(graphs[name], replays, device))
    return per_round


def fresh_dump(directory, **settings):
    """A new dump in `directory`: dynamo and compiledump reset, the token gate off unless given."""
    torch._dynamo.reset()
    compiledump.reset()
    compiledump.configure(dir=str(directory), **{"tokens": 0, **settings})


def passed_captures(npz_path) -> int:
    """Captures that passed every gate, summed over the tags of a flushed dump (its manifest)."""
    manifest = json.loads(Path(npz_path).with_suffix(".json").read_text())
    return sum(tag.get("passed") or 0 for tag in manifest["tags"].values())
