"""``compare --map``: RUN keys renamed to REF's names, how a map is parsed, and what a map leaves unpaired."""

from __future__ import annotations

import numpy as np
import pytest

from compiledump import compare as cmp
from compiledump.cli import main
from compiledump.compare.rename import split_map
from helpers import dumpfactory as factory
from helpers.cli import compare_json
from helpers.dumpfactory import write_pair


@pytest.fixture
def captures():
    return factory.model_captures(np.random.default_rng(1300))


@pytest.mark.parametrize("text,expected", [
    (r"^blk(\d+)$=layer\1", (r"^blk(\d+)$", r"layer\1")),
    (r"a\=b=c=d", (r"a\=b", "c=d")),
    (r"x\\=y", ("x\\\\", "y")),
])
def test_map_splits_at_the_first_unescaped_equals(text, expected):
    assert split_map(text) == expected


@pytest.mark.parametrize("text", ["no_equals", "=x", r"only\=escaped", "(=x", r"a=\2"])
def test_bad_maps_are_usage_errors(tmp_path, capsys, captures, text):
    ref_path, run_path = write_pair(tmp_path, captures, captures)
    assert main(["compare", str(ref_path), str(run_path), "--map", text]) == 2
    assert "usage:" in capsys.readouterr().err


def hf_names(captures):
    """The same captures tagged as another implementation names them."""
    def name(tag: str) -> str:
        if tag.startswith("layer"):
            layer, _, rest = tag[5:].partition("_")
            return f"model.layers.{layer}" + (f".mlp.{rest}" if rest else "")
        return {"embed": "model.embed_tokens", "final_norm": "model.norm", "logits": "lm_head",
                "final_hidden": "model.final_hidden"}[tag]

    return [factory.replace(c, key=name(c.tag) if c.kind != "step" else f"{name(c.tag)}_{c.step}", tag=name(c.tag))
            for c in captures]


def test_map_pairs_two_differently_tagged_dumps_of_one_run(tmp_path, capsys, captures):
    renamed = hf_names(captures)
    ref_path, run_path = write_pair(tmp_path, captures, renamed)
    assert main(["compare", str(ref_path), str(run_path)]) == 2  # no key in common
    assert "no keys in common" in capsys.readouterr().err
    maps = [r"^model\.layers\.(\d+)\.mlp\.=layer\1_", r"^model\.layers\.(\d+)$=layer\1",
            "^model.embed_tokens$=embed", r"^model\.norm$=final_norm", "^lm_head$=logits", r"^model\.(final_)=\1"]
    code, out, report = compare_json(capsys, ref_path, run_path, *[arg for m in maps for arg in ("--map", m)])
    assert code == 0 and report["problems"] == []
    assert [record["key"] for record in report["keys"]] == [record["key"] for record in
                                                            cmp.compare(ref_path, ref_path).to_json()["keys"]]
    assert all(record["rel_diff"] == 0 for record in report["keys"] if record.get("metric_kind") == "float")
    assert report["map"] == [list(m.split("=", 1)) for m in maps]
    assert report["pairs"][0]["renamed"]["layer3_moe_out"] == "model.layers.3.mlp.moe_out"
    assert report["pairs"][0]["renamed"]["logits_2"] == "lm_head_2"
    assert f"note: RUN: --map renamed {len(captures)} of {len(captures)} keys" in out
    # A partial map: the keys it leaves unpaired are listed, not fatal.
    code, _, report = compare_json(capsys, ref_path, run_path, "--map", maps[1])
    missing = {problem["key"] for problem in report["problems"] if problem["kind"] == "missing_in_run"}
    extra = {problem["key"] for problem in report["problems"] if problem["kind"] == "extra_in_run"}
    assert code == 0 and {record["key"] for record in report["keys"]} == {f"layer{n}" for n in range(6)}
    assert "embed" in missing and "model.embed_tokens" in extra and "layer2_moe_out" in missing


def test_two_run_keys_mapped_to_one_name_are_a_problem(tmp_path, capsys, captures):
    run = captures + [factory.Capture("layer2_copy", captures[3].array.copy(), "record", "layer2_copy")]
    ref_path, run_path = write_pair(tmp_path, captures, run)
    code, _, report = compare_json(capsys, ref_path, run_path, "--map", "_copy$=_moe_out")
    (problem,) = [problem for problem in report["problems"] if problem["kind"] == "map_collision"]
    assert problem["side"] == "RUN" and problem["key"] == "layer2_moe_out"


def test_tags_run_left_out_by_its_exclude_patterns_are_read_in_runs_own_names(tmp_path, capsys, captures):
    """RUN's `instrument(exclude=...)` patterns name RUN's tags before --map renamed them: a REF
    key whose RUN name a pattern leaves out is excluded (a note), not missing (a problem)."""
    kept = [c for c in captures if not c.tag.endswith("_moe_out")]
    assert len(kept) < len(captures)
    manifest = factory.manifest_for(kept)
    manifest["exclude"] = ["layer{i}_moe_out"]
    ref_path, run_path = write_pair(tmp_path, hf_names(captures), kept, run_manifest=manifest)
    maps = [r"^layer(\d+)_=model.layers.\1.mlp.", r"^layer(\d+)$=model.layers.\1", "^embed$=model.embed_tokens",
            "^final_norm$=model.norm", "^logits$=lm_head", "^final_hidden$=model.final_hidden"]
    code, out, report = compare_json(capsys, ref_path, run_path, *[arg for m in maps for arg in ("--map", m)])
    assert report["problems"] == [] and code == 0
    assert any("instrument(exclude=('layer{i}_moe_out',))" in line for line in out), out
    # A pattern that names no RUN tag mapped to the REF key still leaves the key missing.
    manifest["exclude"] = ["layer{i}_router"]
    ref_path, run_path = write_pair(tmp_path / "other", hf_names(captures), kept, run_manifest=manifest)
    code, _, report = compare_json(capsys, ref_path, run_path, *[arg for m in maps for arg in ("--map", m)])
    missing = {problem["key"] for problem in report["problems"] if problem["kind"] == "missing_in_run"}
    assert "model.layers.3.mlp.moe_out" in missing
