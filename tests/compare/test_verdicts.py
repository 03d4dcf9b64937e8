"""Verdicts a user can trust (issue 13), on synthetic dumps: thresholds that follow the two sides'
source dtypes, the scale-sensitive norm_diff, the closest key on a clean run, what the manifests say
was not captured. ``--map``: test_key_map.py; all-rows keys: test_all_rows.py; values of different
phases: test_phases.py.

Expected values are computed here with numpy from the formulas in docs/compare.md; data is random,
never zeros.
"""

from __future__ import annotations

import numpy as np
import pytest

from compiledump.compare.metrics import compare_float_arrays
from compiledump.compare.options import DEFAULT_STEP_THRESHOLDS, DEFAULT_THRESHOLDS, pair_class
from helpers import dumpfactory as factory
from helpers.cli import compare_json
from helpers.dumpfactory import scaled, write_pair
from helpers.reference_metrics import norm_diff, rel_diff


@pytest.fixture
def captures():
    return factory.model_captures(np.random.default_rng(1300))


# ----------------------------------------------------------------------------------------------
# Thresholds from the data
# ----------------------------------------------------------------------------------------------



@pytest.mark.parametrize("ref,run,expected", [
    ("float32", "float32", "fp32"), ("float64", "float32", "fp32"), ("float64", "float64", "fp32"),
    ("float32", "float16", "fp16"), ("float32", "bfloat16", "bf16"), ("float16", "bfloat16", "bf16"),
    ("bfloat16", "float8_e4m3fn", "fp8"), ("float8_e5m2", "float32", "fp8"), ("torch.float32", "float32", "fp32"),
    (None, "float32", "legacy"), ("float32", None, "legacy"), ("float32", "int64", "legacy"),
])
def test_precision_class_is_the_lower_of_the_two_sides(ref, run, expected):
    assert pair_class(ref, run) == expected


def test_fp32_pair_names_a_one_percent_scale_that_the_old_default_passed(tmp_path, capsys, captures):
    rng = np.random.default_rng(1)
    run = scaled(factory.perturb(captures, rng, noise=1e-7), "layer2_moe_out", 1.01)
    ref_path, run_path = write_pair(tmp_path, captures, run)
    code, out, report = compare_json(capsys, ref_path, run_path)
    first = report["first_divergence"]
    assert code == 1 and (first["key"], first["layer"], first["last_good"]) == ("layer2_moe_out", 2, "layer1")
    x = captures[[c.key for c in captures].index("layer2_moe_out")].array
    y = run[[c.key for c in run].index("layer2_moe_out")].array
    assert rel_diff(x, y) < 1e-3  # the old default would have said "no divergence"
    assert first["metric"] == "rel_diff" and first["value"] == pytest.approx(rel_diff(x, y), rel=1e-9)
    assert first["threshold"] == DEFAULT_THRESHOLDS["fp32"][0]
    line = "thresholds: float32 vs float32 -> rel_diff <= 1e-08, norm_diff <= 1e-05 (fp32 defaults, calibrated: " \
           "docs/compare.md; 25 keys)"
    assert line in out
    (use,) = report["thresholds"]
    assert (use["class"], use["rel_diff"], use["norm_diff"], use["rel_source"], use["keys"]) == (
        "fp32", 1e-8, 1e-5, "calibrated", 25)
    by_key = {record["key"]: record for record in report["keys"]}
    assert by_key["layer2_moe_out"]["threshold_class"] == "fp32"
    assert by_key["layer2_moe_out"]["source_dtype_run"] == "float32"
    assert by_key["layer0_topk"]["source_dtype_ref"] == "int64"


def test_a_float32_key_of_a_bf16_run_is_judged_in_bf16(tmp_path, capsys, captures):
    """A bf16 model that upcasts one value (DeepSeek-V3's router, logits an engine casts to
    float32) stores it as float32 with bf16's error in it: judged in the precision the pair
    computes in, not by float32's 1e-8, and the report says why. A bf16-sized bug in that key is
    still named; in an all-float32 pair the same key keeps float32's thresholds."""
    rng = np.random.default_rng(3)
    noisy = factory.perturb(captures, rng, noise=3e-3)  # bf16-like rounding everywhere
    upcast = {"layer2_moe_out": {"source_dtype": "float32"}}
    paths = write_pair(tmp_path / "clean", captures, noisy, "float32", "bfloat16", key_fields=None,
                       run_manifest=factory.manifest_for(noisy, source_dtype="bfloat16", key_fields=upcast))
    code, out, report = compare_json(capsys, *paths)
    by_key = {record["key"]: record for record in report["keys"]}
    x = captures[[c.key for c in captures].index("layer2_moe_out")].array
    y = noisy[[c.key for c in noisy].index("layer2_moe_out")].array
    assert DEFAULT_THRESHOLDS["fp32"][0] < rel_diff(x, y) < DEFAULT_THRESHOLDS["bf16"][0]
    assert by_key["layer2_moe_out"]["source_dtype_run"] == "float32"
    assert by_key["layer2_moe_out"]["threshold_class"] == "bf16" and code == 0
    assert ("thresholds: float32 vs float32 -> rel_diff <= 2e-03, norm_diff <= 3e-02 (bf16 defaults, as the pair's "
            "other keys are bf16, calibrated: docs/compare.md; 1 key)") in out
    broken = scaled(noisy, "layer2_moe_out", 1.1)
    paths = write_pair(tmp_path / "bug", captures, broken, "float32", "bfloat16",
                       run_manifest=factory.manifest_for(broken, source_dtype="bfloat16", key_fields=upcast))
    code, out, report = compare_json(capsys, *paths)
    assert code == 1 and report["first_divergence"]["key"] == "layer2_moe_out"
    paths = write_pair(tmp_path / "fp32", captures, noisy, "float32", "float32")
    code, out, report = compare_json(capsys, *paths)
    assert code == 1 and {record["key"]: record for record in report["keys"]}["layer2_moe_out"]["threshold_class"] == "fp32"
    # One fp8 key in a bf16 run: the float32 key takes fp8, the bf16 keys stay bf16 (not loosened).
    fp8 = {**upcast, "layer1_moe_out": {"source_dtype": "float8_e4m3fn"}}
    paths = write_pair(tmp_path / "fp8", captures, noisy, "float32", "bfloat16",
                       run_manifest=factory.manifest_for(noisy, source_dtype="bfloat16", key_fields=fp8))
    code, out, report = compare_json(capsys, *paths)
    classes = {record["key"]: record["threshold_class"] for record in report["keys"] if record.get("threshold_class")}
    assert (classes["layer2_moe_out"], classes["layer1_moe_out"], classes["layer2"]) == ("fp8", "fp8", "bf16")


def test_the_same_arrays_as_bf16_or_without_a_manifest_use_looser_defaults(tmp_path, capsys, captures):
    rng = np.random.default_rng(2)
    run = scaled(factory.perturb(captures, rng, noise=1e-7), "layer2_moe_out", 1.01)
    ref_path, run_path = write_pair(tmp_path / "bf16", captures, run, "float32", "bfloat16")
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 0 and report["thresholds"][0]["class"] == "bf16"
    assert any(line.startswith("thresholds: float32 vs bfloat16 -> rel_diff <= 2e-03, norm_diff <= 3e-02")
               for line in out)
    ref_path, run_path = write_pair(tmp_path / "legacy", captures, run, "float32", None)
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 0
    uses = {use["rel_source"]: use for use in report["thresholds"]}
    assert sorted(uses) == ["legacy", "legacy decode"]  # decode steps have their own defaults
    use = uses["legacy"]
    assert (use["class"], use["rel_diff"], use["run_dtype"]) == ("legacy", 1e-3, None)
    assert (uses["legacy decode"]["rel_diff"], uses["legacy decode"]["norm_diff"]) == DEFAULT_STEP_THRESHOLDS["legacy"]
    assert any(line.startswith("thresholds: float32 vs unknown -> rel_diff <= 1e-03") and "legacy" in line
               for line in out)


def test_threshold_flags_override_each_metric_and_say_so(tmp_path, capsys, captures):
    rng = np.random.default_rng(3)
    run = scaled(factory.perturb(captures, rng, noise=1e-7), "layer2_moe_out", 1.01)
    ref_path, run_path = write_pair(tmp_path, captures, run)
    # rel_diff loosened alone: norm_diff (0.01 > 1e-5) still catches the scale.
    code, out, report = compare_json(capsys, ref_path, run_path, "--threshold", "1e-3")
    assert code == 1 and report["first_divergence"]["metric"] == "norm_diff"
    assert report["first_divergence"]["threshold"] == 1e-5
    # both loosened: nothing diverges, and the report says where the numbers come from.
    code, out, report = compare_json(capsys, ref_path, run_path, "--threshold", "1e-3", "--norm-threshold", "0.05")
    assert code == 0
    assert any(line.startswith("thresholds: float32 vs float32 -> rel_diff <= 1e-03, norm_diff <= 5e-02 "
                               "(--threshold, --norm-threshold;") or
               ("rel_diff from --threshold" in line and "norm_diff from --norm-threshold" in line) for line in out)
    assert report["norm_threshold"] == 0.05 and report["threshold"] == 1e-3
    # --threshold-for sets rel_diff for the keys it matches only.
    code, out, report = compare_json(capsys, ref_path, run_path, "--norm-threshold", "0.05", "--threshold-for",
                                "moe_out$=1e-3")
    assert code == 0
    by_key = {record["key"]: record for record in report["keys"]}
    assert by_key["layer2_moe_out"]["threshold"] == 1e-3 and by_key["layer2"]["threshold"] == 1e-8
    assert by_key["layer2_moe_out"]["threshold_source"] == "--threshold-for moe_out$"


# ----------------------------------------------------------------------------------------------
# norm_diff
# ----------------------------------------------------------------------------------------------



def test_norm_diff_matches_numpy_across_chunks_and_non_finite_positions():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(1000) * 3 + 0.5).astype(np.float32)
    y = (x * 1.0123 + rng.standard_normal(1000).astype(np.float32) * 1e-3).astype(np.float32)
    x[[5, 600]] = np.nan
    y[[5, 601]] = np.nan
    finite = np.isfinite(x) & np.isfinite(y)
    for chunk in (7, 64, 1 << 20):
        metrics = compare_float_arrays(x, y, chunk=chunk)
        assert metrics.norm_diff == pytest.approx(norm_diff(x[finite], y[finite]), rel=1e-12)
    assert compare_float_arrays(np.zeros(3), np.ones(3)).norm_diff is None
    assert compare_float_arrays(np.zeros(3), np.zeros(3)).norm_diff == 0.0


def test_norm_diff_catches_a_scale_that_rel_diff_misses(tmp_path, capsys, captures):
    rng = np.random.default_rng(5)
    run = scaled(factory.perturb(captures, rng), "layer3", 1.05)
    ref_path, run_path = write_pair(tmp_path, captures, run, "bfloat16", "bfloat16")
    code, out, report = compare_json(capsys, ref_path, run_path)
    x = captures[[c.key for c in captures].index("layer3")].array
    y = run[[c.key for c in run].index("layer3")].array
    assert rel_diff(x, y) < DEFAULT_THRESHOLDS["bf16"][0] < norm_diff(x, y)
    first = report["first_divergence"]
    assert code == 1 and first["key"] == "layer3" and first["metric"] == "norm_diff"
    assert first["value"] == pytest.approx(norm_diff(x, y), rel=1e-9)
    assert first["threshold"] == DEFAULT_THRESHOLDS["bf16"][1] == 3e-2
    assert out[-1].startswith(f"first divergence: layer3 (layer 3): norm_diff {first['value']:.3e} > threshold 3.0e-02")


# ----------------------------------------------------------------------------------------------
# Saying what was and was not compared
# ----------------------------------------------------------------------------------------------



def test_clean_run_ends_with_the_key_closest_to_its_threshold(tmp_path, capsys, captures):
    rng = np.random.default_rng(8)
    run = scaled(factory.perturb(captures, rng, noise=1e-4), "layer4", 1.004)
    ref_path, run_path = write_pair(tmp_path, captures, run, "bfloat16", "bfloat16")
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 0
    rel_limit, norm_limit = DEFAULT_THRESHOLDS["bf16"]
    best = None
    for ref_capture, run_capture in zip(captures, run):
        if np.issubdtype(ref_capture.array.dtype, np.integer):
            continue
        x, y = ref_capture.array, run_capture.array
        for metric, value, limit in (("rel_diff", rel_diff(x, y), rel_limit),
                                     ("norm_diff", norm_diff(x, y), norm_limit)):
            if best is None or value / limit > best[0]:
                best = (value / limit, ref_capture.key, metric, value, limit)
    _, key, metric, value, limit = best
    assert (key, metric) == ("layer4", "norm_diff")
    assert out[-1] == (f"no divergence: {len(captures)} keys compared; closest: layer4 (layer 4) norm_diff "
                       f"{value:.2g} vs threshold 3e-02")
    closest = report["closest"]
    assert (closest["key"], closest["metric"], closest["threshold"]) == ("layer4", "norm_diff", limit)
    assert closest["value"] == pytest.approx(value, rel=1e-9) and closest["ratio"] == pytest.approx(value / limit)


def test_filtered_and_dropped_tags_are_counted_in_one_note(tmp_path, capsys, captures):
    rng = np.random.default_rng(9)
    run = factory.perturb(captures, rng)
    ref_manifest = factory.manifest_for(captures, drops={"token_gate": 38, "suspended": 1},
                                        filtered_tags={"layer6_topk": "moe_layers", "layer6_moe_out": "moe_layers"})
    ref_manifest["tags"]["layer0"]["kept"] = 0
    run_manifest = factory.manifest_for(run, drops={"token_gate": 40},
                                        filtered_tags={"layer6_topk": "moe_layers", "layer6_moe_out": "moe_layers",
                                                       "layer7_topk": "moe_layers"})
    ref_path, run_path = write_pair(tmp_path, captures, run, ref_manifest=ref_manifest, run_manifest=run_manifest)
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 0
    notes = [line for line in out if line.startswith("note:")]
    assert notes == ["note: not captured: REF 2 tags filtered (2 by COMPILEDUMP_MOE_LAYERS), 1 tags with every call dropped, "
                     "dropped calls token_gate=38 suspended=1; RUN 3 tags filtered (3 by COMPILEDUMP_MOE_LAYERS), dropped calls "
                     "token_gate=40"]
    facts = report["pairs"][0]["not_captured"]
    assert facts["RUN"]["filtered"] == ["layer6_moe_out", "layer6_topk", "layer7_topk"]
    assert facts["REF"]["tags_none_kept"] == ["layer0"] and facts["REF"]["drops"] == {"token_gate": 38, "suspended": 1}
    assert report["notes"] == [notes[0][len("note: "):]]
