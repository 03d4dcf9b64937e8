"""The comparator on real dumps: debug_dump.py and the compiledump runtime, both driven through the
built-in TinyMoE model and engine-like session, compared against each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import compiledump
from compiledump.cli import main
from compiledump.demo.model import ModelConfig, TinyMoE, make_session, run_session
from helpers.seed import load_seed

PROMPT = 7
STEPS = 12


@pytest.fixture(scope="module")
def legacy_file(tmp_path_factory) -> Path:
    """debug_dump.py's dump of a clean run (eager, fp32): the reference side."""
    directory = tmp_path_factory.mktemp("legacy")
    debug_dump = load_seed(directory, tokens=PROMPT, moe_layers=3)
    run_session(TinyMoE(ModelConfig(), dump=debug_dump), debug_dump, make_session(ModelConfig(), PROMPT, STEPS))
    debug_dump.flush()
    (path,) = directory.glob("deepinfer_layers_rank*_pid*.npz")
    return path


def compiledump_file(cfg: ModelConfig) -> Path:
    compiledump.configure(tokens=PROMPT, moe_layers=3)
    run_session(TinyMoE(cfg, dump=compiledump), compiledump, make_session(ModelConfig(), PROMPT, STEPS))
    return Path(compiledump.flush())


def compare_json(capsys, tmp_path: Path, ref: Path, run: Path, *flags: str) -> tuple[int, dict, list[str]]:
    code = main(["compare", str(ref), str(run), "--json", str(tmp_path / "report.json"), *flags])
    out = capsys.readouterr().out.splitlines()
    return code, json.loads((tmp_path / "report.json").read_text()), out


def test_clean_runtime_dump_matches_the_debug_dump_file(dump_dir, legacy_file, tmp_path, capsys):
    run = compiledump_file(ModelConfig())
    assert run.with_suffix(".json").is_file()  # a real manifest from the runtime
    code, report, out = compare_json(capsys, tmp_path, legacy_file, run)
    assert code == 0, out[-3:]
    assert report["problems"] == []
    assert out[-1].startswith("no divergence")
    keys = [record["key"] for record in report["keys"]]
    assert keys[:4] == ["layer0_topk", "layer0_moe_out", "layer0", "layer1_topk"]
    assert keys[-1] == f"logits_{STEPS - 1}"
    assert all(record["rel_diff"] < 1e-10 for record in report["keys"] if record.get("metric_kind") == "float")
    assert report["pairs"][0]["decode_margins"]["argmax_agree"] == STEPS


# With moe_layers=3, layers 0-2 record `_topk`, `_moe_out` and the hidden state; layer 3 only
# `layer3`. routed_scale multiplies the layer's MoE output by 1.5; dropped_hc drops hc stream 1's
# update after the MoE, so that layer's MoE output is still equal and the hidden state is first.
# dropped_hc at layer 2 moves `layer2` by rel_diff 7e-4 only (the row is a mean over 4 streams),
# under the default 1e-3 meant for bf16-vs-fp32: both sides are fp32 here, so a tight threshold
# is the right one (docs/compare.md, "same precision").
@pytest.mark.parametrize("bug,layer,threshold,first_key,last_good", [
    ("routed_scale", 1, "1e-3", "layer1_moe_out", "layer0"),
    ("dropped_hc", 2, "1e-6", "layer2", "layer2_moe_out"),
    ("routed_scale", 3, "1e-3", "layer3", "layer2"),
])
def test_injected_model_bug_is_named(dump_dir, legacy_file, tmp_path, capsys, bug, layer, threshold, first_key,
                                     last_good):
    run = compiledump_file(ModelConfig(bug=bug, bug_layer=layer))
    # Both directions: the runtime's file as RUN and, reversed, as REF.
    for ref_path, run_path in ((legacy_file, run), (run, legacy_file)):
        code, report, out = compare_json(capsys, tmp_path, ref_path, run_path, "--threshold", threshold)
        first = report["first_divergence"]
        assert code == 1
        assert (first["key"], first["layer"], first["last_good"]) == (first_key, layer, last_good)
        assert report["decode_divergence"]["step"] == 0
        assert report["root_cause"] is None
        assert out[-1].startswith(f"first divergence: {first_key}")
