"""The verdict sweep runs as documented (a small slice of it: two random models per mode, an engine
bug included), so its arguments and its use of the library cannot break unseen. Its numbers live in
RESULTS.md, not here."""

import os
from pathlib import Path

import pytest
from helpers import forked  # the sweeps' processes forked from one that imported torch

pytest.importorskip("transformers")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_sweep_routing_prints_its_verdict_table(tmp_path):
    out = forked.run([str(BENCHMARKS / "sweep_routing.py"), "--seeds", "2", "--models", "qwen3_moe,deepseek_v3_grouped",
                      "--engine-bug", "no_groups"], timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith(("qwen3_moe rows=", "deepseek_v3_grouped rows=")) for line in lines) == 8
    table = lines[lines.index(next(line for line in lines if line.startswith("model "))) + 1:]
    rows = [line.split() for line in table if line.split() and line.split()[0] in ("qwen3_moe", "deepseek_v3_grouped")]
    assert [(row[0], row[1]) for row in rows] == [("qwen3_moe", "one"), ("qwen3_moe", "all"),
                                                  ("deepseek_v3_grouped", "one"), ("deepseek_v3_grouped", "all")]
    assert all(int(row[2]) == 2 == sum(int(value) for value in row[3:6]) for row in rows)


def test_sweep_routing_counts_where_a_scaled_layer_is_named(tmp_path):
    out = forked.run([str(BENCHMARKS / "sweep_routing.py"), "--seeds", "2", "--models", "qwen3_moe", "--rows", "one",
                      "--engine-bug", "experts_x1.05"], timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("model "))
    assert header.endswith("at layer 1")
    (row,) = [line.split() for line in lines[lines.index(header) + 1:] if line.startswith("qwen3_moe ")]
    pairs, exit0, exit1, exit3, named = (int(value) for value in row[2:7])
    assert pairs == 2 == exit0 + exit1 + exit3 and named <= exit1


def test_sweep_engines_prints_its_verdict_table(tmp_path):
    out = forked.run([str(BENCHMARKS / "sweep_engines.py"), "--seeds", "2", "--models", "qwen3_moe", "--bug",
                      "renormalize"], timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("model "))
    (row,) = [line.split() for line in lines[lines.index(header) + 1:] if line.startswith("qwen3_moe ")]
    assert row[:5] == ["qwen3_moe", "vllm", "bfloat16", "2", "renormalize"]
    assert [int(value) for value in row[5:9]] == [2, 0, 2, 0] and row[9:] == ["layer0_mlp", "2"]


def test_a_timing_benchmark_leaves_no_scratch_directory(tmp_path):
    """The timing benchmarks dump into scratch directories of their own (harness.scratch_dir):
    removed at exit, and not written back by compiledump's exit flush (each one used to leave a
    directory in /tmp per run)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    # A child forked from one that imported torch (its exit: atexit, compiledump's exit flush, as a
    # fresh interpreter's; tempfile reads this TMPDIR): not a fresh interpreter's torch import.
    out = forked.run([str(BENCHMARKS / "bench_eager.py"), "--rounds", "1", "--calls", "5"], env=env, timeout=300,
                     cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiledump record_ids" in out.stdout
    assert sorted(path.name for path in scratch.iterdir()) == []
