"""`compiledump inspect`, `--plot`, and what the comparator may import."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import dumpfactory as factory
from helpers.cli import run_cli

REPO = Path(__file__).resolve().parents[2]


def test_inspect_lists_keys_in_order_with_statistics(tmp_path, capsys):
    rng = np.random.default_rng(110)
    captures = factory.model_captures(rng, dim=47)
    embed = captures[0].array
    embed[[2, 7]] = np.nan
    embed[11] = -np.inf
    manifest = factory.manifest_for(captures, drops={"token_gate": 38, "suspended": 1},
                                    filtered_tags={"layer7_topk": "moe_layers"})
    manifest["tags"]["layer0"]["drops"] = {"token_gate": 38}
    manifest["capture_path"] = "native"
    manifest["exclude"] = ["layer{i}_mlp", "layer1"]
    path = factory.write_compiledump(tmp_path, captures, shuffle_with=rng, manifest=manifest)
    code, out, err = run_cli(capsys, "inspect", path, "--json", tmp_path / "i.json")
    assert code == 0 and not err
    listing = json.loads((tmp_path / "i.json").read_text())["files"][0]
    assert [entry["key"] for entry in listing["keys"]] == [c.key for c in captures]
    first = listing["keys"][0]
    finite = embed[np.isfinite(embed)].astype(np.float64)
    assert first["nan"] == 2 and first["inf"] == 1
    assert first["min"] == pytest.approx(finite.min()) and first["max"] == pytest.approx(finite.max())
    assert first["mean"] == pytest.approx(finite.mean(), rel=1e-9)
    assert listing["drops"] == {"token_gate": 38, "suspended": 1}
    assert listing["config"]["max_steps"] == 256
    assert listing["capture_path"] == "native"
    assert any(line.startswith("manifest:") and line.endswith(", capture path native") for line in out)
    assert any(line.startswith("drops: token_gate=38, suspended=1") for line in out)
    assert any(line.strip() == "layer0: token_gate=38" for line in out)
    assert any("filtered tags: layer7_topk (moe_layers)" in line for line in out)
    assert listing["exclude"] == ["layer{i}_mlp", "layer1"]
    assert "instrument(exclude=...): layer{i}_mlp, layer1 (those tags were never hooked)" in out
    assert any(line.startswith("config:") and "max_steps=256" in line for line in out)
    assert out[-1] == "31 keys: 14 record, 6 ids, 1 record_once, 10 step; decode steps 0..4"


def test_inspect_a_directory_lists_every_rank(tmp_path, capsys):
    rng = np.random.default_rng(112)
    for rank in (1, 0):
        factory.write_compiledump(tmp_path, factory.model_captures(rng), rank=rank, pid=10 + rank)
    code, out, _ = run_cli(capsys, "inspect", tmp_path)
    headers = [line for line in out if line.startswith("== ")]
    assert code == 0 and [Path(line[3:]).name for line in headers] == ["compiledump_rank0_pid10.npz",
                                                                      "compiledump_rank1_pid11.npz"]


def test_inspect_a_file_without_a_manifest_says_so(tmp_path, capsys):
    rng = np.random.default_rng(111)
    path = factory.write_legacy(tmp_path, factory.model_captures(rng))
    code, out, _ = run_cli(capsys, "inspect", path)
    assert code == 0
    assert out[1] == ("no manifest (legacy deepinfer_layers file): kinds, steps and order inferred from key names "
                      "and dtypes")
    with np.load(path) as data:
        assert out[-1].startswith(f"{len(data.files)} keys:")


def test_plot_is_written_or_clearly_skipped(tmp_path, capsys):
    rng = np.random.default_rng(120)
    ref = factory.model_captures(rng)
    ref_path = factory.write_compiledump(tmp_path / "ref", ref)
    run_path = factory.write_compiledump(tmp_path / "run", factory.perturb(ref, rng, from_layer=2, from_step=1))
    png = tmp_path / "plot.png"
    code, out, err = run_cli(capsys, "compare", ref_path, run_path, "--plot", png)
    assert code == 1 and out[-1].startswith("first divergence: layer2_moe_out")  # the verdict stands either way
    if importlib.util.find_spec("matplotlib") is None:
        assert err == [("compiledump: warning: plot skipped: --plot needs matplotlib: pip install matplotlib "
                        "(or compiledump[plot])")]
        assert not png.exists()
    else:
        assert not err and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_comparator_imports_numpy_and_the_standard_library_only():
    """compare, inspect and the CLI load neither torch nor the capture side of the package."""
    code = ("import sys, compiledump.compare, compiledump.compare.inspect, compiledump.cli\n"
            "print(sorted(name for name in ('torch', 'matplotlib', 'triton') if name in sys.modules))\n"
            "print(sorted(name for name in sys.modules if name.startswith('compiledump')))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    heavy, ours = done.stdout.splitlines()
    assert heavy == "[]"
    capture_side = ("capture", "ops", "aot", "demo", "runtime", "arena", "native", "parallel", "signals", "config",
                    "layout", "triton_kernel", "model", "writer")
    loaded = [name for name in eval(ours)  # noqa: S307 - a printed list of module names
              if name.removeprefix("compiledump.").split(".")[0] in capture_side
              or name.startswith("compiledump.format.writer")]
    assert loaded == []
