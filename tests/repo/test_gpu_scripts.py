"""The GPU check script (acceptance 8) runs its CPU-checkable phases here, so it cannot rot."""

import importlib.util
import json
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_phases_pass(tmp_path, dump_dir):
    out = tmp_path / "result.json"
    assert _load().main(["--device", "cpu", "--steps", "3", "--layers", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["phases"]["eager"]["ok"] is True
    assert result["phases"]["compiled_default"]["ok"] is True
    assert result["phases"]["compiled_default"]["max_rel_err"] < 1e-4
    for phase in ("cuda_graph", "reduce_overhead", "aoti", "native_cuda_kernel"):
        assert result["phases"][phase]["skipped"] == "needs a CUDA device"


def test_aoti_phase_on_cpu(tmp_path, dump_dir):
    """The script's AOTInductor phase (CUDA-only in the script) run on CPU: same dump as eager."""
    import torch

    script = _load()
    cfg = script.ModelConfig(layers=2, captures_per_layer=4)
    session = script.make_session(cfg, prompt_len=script.PROMPT, steps=3)
    cpu = torch.device("cpu")
    reference, _ = script.phase_eager(cfg, session, cpu, tmp_path)
    path, info = script.phase_aoti(cfg, session, cpu, tmp_path)
    verdict = script.compare_dumps(script._load(reference), script._load(path), 1e-4)
    assert verdict["ok"] and verdict["keys"] >= 10, verdict
    assert info["capture_export_owner"] in ("native", "python")


def test_compare_dumps_detects_differences():
    compare = _load().compare_dumps
    g = np.random.default_rng(0)
    ref = {"a": g.standard_normal(5).astype(np.float32), "ids": np.arange(4, dtype=np.int32)}
    assert compare(ref, dict(ref), 1e-6)["ok"]
    assert not compare(ref, {**ref, "a": ref["a"] * 1.01}, 1e-4)["ok"]
    assert compare(ref, {"a": ref["a"]}, 1e-6)["missing"] == ["ids"]
    assert compare(ref, {**ref, "ids": ref["ids"][::-1].copy()}, 1e-6)["mismatched"] == ["ids"]


def test_gpu_bench_cpu_parts(tmp_path, dump_dir):
    """benchmarks/gpu_bench.py imports and runs what needs no GPU; the rest reports skipped."""
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT.parents[1] / "benchmarks" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "bench.json"
    assert module.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["eager_vs_seed"]["compiledump_us"] > 0 and result["eager_vs_seed"]["seed_us"] > 0
    assert result["graph_capture_cost"] == {"skipped": "needs a CUDA device"}
