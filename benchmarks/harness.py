"""Shared pieces of the benchmarks: side-by-side timing, the machine's description, the
debug_dump.py module that compiledump replaces (the baseline some benchmarks time), and the
verdict sweeps' run of a reference against each of its engines.

Every figure is measured A/B interleaved in one process (this machine is noisy): each round
times every case once, in a rotating order, and the reported value is the median over rounds.
Ratios are computed per round, then the median ratio is reported.
"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# debug_dump.py, kept beside the checkout (../shared/seed/); not part of the package.
DEBUG_DUMP = REPO.parent / "shared" / "seed" / "debug_dump.py"


def load_debug_dump(dump_dir, tokens: int = 0, moe_layers: int = 2, max_rows: int = 1):
    """A fresh instance of debug_dump.py writing into `dump_dir`, loaded as the tests load it (the
    reference lives in tests/helpers/seed.py: it reads its settings from the environment at
    import, and imports `deepinfer.utils.allow_cuda_sync`, stubbed there)."""
    if not DEBUG_DUMP.exists():
        raise FileNotFoundError(f"{DEBUG_DUMP} is missing: this benchmark compares against it")
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    from helpers.seed import load_debug_dump as load

    return load(DEBUG_DUMP, dump_dir, tokens, moe_layers, max_rows)


def scratch_dir(prefix: str) -> str:
    """A new temporary directory for a benchmark's dumps, removed when the process exits. Capture is
    switched off first, so that compiledump's own exit flush does not write the dump back."""
    path = tempfile.mkdtemp(prefix=prefix)

    def remove() -> None:
        import compiledump

        compiledump.configure(dir=None)
        shutil.rmtree(path, ignore_errors=True)
    atexit.register(remove)
    return path


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


def judge_cases(reference, run_on, engine_for, cases: dict, root: Path) -> dict[str, tuple[bool, int, str]]:
    """A verdict sweep's pairs: `reference` dumped under `root` running `run_on(reference)`, then each
    case's engine `engine_for(reference, case)` dumped and compared with it (tests/helpers/hf_dump.py,
    as the tests dump and compare). {case: (whether the verdict is the expected one, the exit status,
    the report's last line)}; expected: exit 0 where `cases[case]` is None (an honest pair), else exit 1
    with the first divergence at that key."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    from helpers.hf_dump import compare_run, dump_run

    ref = dump_run(reference, root / "ref", run_on(reference))
    verdicts = {}
    for case, key in cases.items():
        engine = engine_for(reference, case)
        report, last = compare_run(ref, engine, root / case.replace(" ", "_"), run_on(engine))
        expected = report.exit_status == 0 if key is None else \
            report.exit_status == 1 and report.first_divergence.key == key
        verdicts[case] = (expected, report.exit_status, last)
    return verdicts


def sweep_grid(column: str, values: list, names: list[str], seeds: int, build, run_on, engine_for, cases,
               table_cases: dict) -> None:
    """A verdict sweep over (`column` value, model, seed): the reference `build(name, seed, value)`
    against each case's engine `engine_for(reference, case, name)`, each running `run_on(model,
    seed)` (judge_cases, in a scratch directory removed after); every pair whose verdict is not the
    expected one printed, then the table of `table_cases` (print_verdict_table). `cases(name)`: the
    model's cases, {case: the key its bug is expected at, None for an honest pair}."""
    expected, total = collections.Counter(), collections.Counter()
    for value in values:
        for name in names:
            for seed in range(seeds):
                with tempfile.TemporaryDirectory(prefix="compiledump_sweep_") as root:
                    verdicts = judge_cases(build(name, seed, value), lambda model: run_on(model, seed),
                                           lambda reference, case: engine_for(reference, case, name), cases(name),
                                           Path(root))
                for case, (good, status, last) in verdicts.items():
                    total[(value, name, case)] += 1
                    expected[(value, name, case)] += good
                    if not good:
                        print(f"  {column} {value} {name} seed {seed} {case}: exit {status}: {last}")
    print_verdict_table(column, table_cases, expected, total)


def sweep_main(doc: str, models, column: str, flag: str, default: str, build, run_on, engine_for, cases,
               table_cases: dict) -> None:
    """A verdict sweep's command line (its script's `doc` describes it): --models (`models`),
    --seeds (3) and --`flag` (comma-separated `column` values, `default`), then sweep_grid with the
    other arguments, on one thread and with warnings off."""
    import argparse
    import warnings

    import torch

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(f"--{flag}", default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    sweep_grid(column, [float(value) for value in getattr(args, flag).split(",")], args.models.split(","), args.seeds,
               build, run_on, engine_for, cases, table_cases)


def print_verdict_table(column: str, cases, expected, total) -> None:
    """The Markdown table of a verdict sweep: a row per (`column` value, model), a cell per case,
    "expected/pairs" from the counters keyed (value, model, case)."""
    print(f"\n| {column} | model | {' | '.join(cases)} |")
    print(f"| --- | --- | {' | '.join('---' for _ in cases)} |")
    for value, name in dict.fromkeys((value, name) for value, name, _ in total):
        cells = [f"{expected[(value, name, case)]}/{total[(value, name, case)]}" if total[(value, name, case)]
                 else "-" for case in cases]  # (a case the model has no place for)
        print(f"| {value} | {name} | {' | '.join(cells)} |")


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
