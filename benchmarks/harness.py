"""Shared pieces of the benchmarks: side-by-side timing and the test suite's helpers.

Every figure is measured A/B interleaved in one process (this machine is noisy): each round
times every case once, in a rotating order, and the reported value is the median over rounds.
Ratios are computed per round, then the median ratio is reported.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The benchmarks reuse the test suite's helpers (the seed loader) and the package's built-in model.
sys.path.insert(0, str(REPO / "tests"))


def interleaved(cases: dict, rounds: int = 15, calls: int = 1000, warmup: int = 2) -> dict[str, list[float]]:
    """Time each case `calls` times per round, rounds interleaved; return seconds per call, per round."""
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            for _ in range(max(1, calls // 10)):
                cases[name]()
    per_round = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            fn = cases[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_round[name].append((time.perf_counter() - start) / calls)
    return per_round


def median(values) -> float:
    return statistics.median(values)


def ratio(per_round: dict, a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b)."""
    return statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))


def machine() -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = f"{names[0]} x{len(names)}" if names else cpu
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}; torch {torch.__version__}; python {platform.python_version()}; load avg {load:.2f}"
