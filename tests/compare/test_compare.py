"""Tests of `compiledump compare` on synthetic dumps: the first divergent layer and step, root
causes, argmax flips, thresholds, mismatched and non-finite keys (test_compare_inputs.py: what
compare reads: ranks, files without a manifest, unusable input, memory).

Every expected value is computed here from numpy formulas written out independently of
compiledump.compare; data is random (never zeros).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import dumpfactory as factory
from helpers.cli import run_cli
from helpers.reference_metrics import rel_diff
from compiledump import compare as cmp

def dump_pair(tmp_path: Path, seed: int = 0, source_dtype: str = "bfloat16",
              **perturbation) -> tuple[Path, Path, list, list]:
    """REF and RUN dumps of the factory's toy model; ``source_dtype`` is every float key's (the
    decode steps of a low-precision class have loose defaults: docs/compare.md)."""
    rng = np.random.default_rng(seed)
    ref = factory.model_captures(rng)
    run = factory.perturb(ref, rng, **perturbation)
    paths = [factory.write_compiledump(tmp_path / name, side, shuffle_with=rng,
                                       manifest=factory.manifest_for(side, source_dtype=source_dtype))
             for name, side in (("ref", ref), ("run", run))]
    return paths[0], paths[1], ref, run


# ----------------------------------------------------------------------------------------------
# Naming the first divergent layer and step
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer,step,seed", [(0, 0, 10), (3, 2, 11), (5, 4, 12), (2, None, 13), (None, 1, 14)])
def test_reports_exactly_the_perturbed_layer_and_step(tmp_path, capsys, layer, step, seed):
    ref_path, run_path, ref, _ = dump_pair(tmp_path, seed, "float32", noise=1e-7, from_layer=layer, from_step=step)
    report_path = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "compare", ref_path, run_path, "--json", report_path)
    report = json.loads(report_path.read_text())
    assert code == 1 and not err
    assert report["problems"] == []
    prefill, decode = report["prefill_divergence"], report["decode_divergence"]
    if layer is None:
        assert prefill is None
    else:
        assert prefill["key"] == f"layer{layer}_moe_out" and prefill["layer"] == layer
        assert prefill["last_good"] == ("embed" if layer == 0 else f"layer{layer - 1}")
        assert prefill["metric"] == "rel_diff" and prefill["value"] > 1e-3
    if step is None:
        assert decode is None
    else:
        assert decode["step"] == step and decode["key"] == f"final_hidden_{step}"
        assert decode["last_good"] == (None if step == 0 else f"logits_{step - 1}")
    first = report["first_divergence"]
    expected = prefill if prefill is not None else decode
    assert {name: first[name] for name in ("key", "layer", "step", "metric", "value")} == \
           {name: expected[name] for name in ("key", "layer", "step", "metric", "value")}
    assert out[-1].startswith("first divergence: " + expected["key"])
    # Keys come out in model order although the npz members were shuffled.
    assert [record["key"] for record in report["keys"]] == [c.key for c in ref]
    # The reported rel_diff is the formula's value for that key.
    with np.load(ref_path) as ref_arrays, np.load(run_path) as run_arrays:
        value = rel_diff(ref_arrays[first["key"]], run_arrays[first["key"]])
    assert first["value"] == pytest.approx(value, rel=1e-9)


def test_noise_only_is_no_divergence(tmp_path, capsys):
    ref_path, run_path, _, _ = dump_pair(tmp_path, 20)
    code, out, err = run_cli(capsys, "compare", ref_path, run_path)
    assert code == 0 and not err
    assert out[-1].startswith("no divergence")
    assert not any(line.startswith("!") for line in out)


def test_identical_dumps_do_not_diverge_even_at_threshold_zero(tmp_path, capsys):
    """rel_diff 0 is not above a threshold of 0: a divergence needs rel_diff > threshold."""
    rng = np.random.default_rng(23)
    captures = factory.model_captures(rng, layers=3, dim=37, steps=3, vocab=211)
    path = factory.write_compiledump(tmp_path / "a", captures)
    copy = factory.write_compiledump(tmp_path / "b", [factory.replace(c, array=c.array.copy()) for c in captures])
    for ref, run in ((path, path), (path, copy)):
        code, out, err = run_cli(capsys, "compare", ref, run, "--threshold", "0")
        assert (code, err) == (0, []) and out[-1].startswith(f"no divergence: {len(captures)} keys compared")
        assert not any(line.startswith("!") for line in out)


def test_table_marks_exactly_the_divergent_rows(tmp_path, capsys):
    ref_path, run_path, ref, _ = dump_pair(tmp_path, 21, from_layer=4)
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path)
    marked = [line.split()[1] for line in out if line.startswith("! ")]
    floats_after = [c.key for c in ref if c.kind != "step" and c.kind != "ids"
                    and (c.tag.startswith(("layer4", "layer5")) or c.key in ("final_norm", "logits"))]
    assert code == 1 and marked == floats_after


def test_table_option_selects_rows(tmp_path, capsys):
    ref_path, run_path, ref, _ = dump_pair(tmp_path, 22, from_layer=5)
    _, full, _ = run_cli(capsys, "compare", ref_path, run_path)
    _, divergent, _ = run_cli(capsys, "compare", ref_path, run_path, "--table", "divergent")
    _, none, _ = run_cli(capsys, "compare", ref_path, run_path, "--table", "none")
    rows = lambda lines: [line[2:].split()[0] for line in lines  # noqa: E731
                          if line[:2] in ("! ", "  ", "? ") and len(line.split()) > 5 and line.split()[0] != "key"]
    assert rows(full) == [c.key for c in ref]
    assert rows(divergent) == ["layer5_moe_out", "layer5", "final_norm", "logits"]
    assert rows(none) == []
    assert full[-1] == divergent[-1] == none[-1]


def test_argmax_flip_with_tiny_reference_margin_is_a_near_tie(tmp_path, capsys):
    rng = np.random.default_rng(30)
    ref = factory.model_captures(rng, steps=6)
    run = factory.perturb(ref, rng)
    flip_step = 3
    ref_logits = next(c for c in ref if c.key == f"logits_{flip_step}").array
    run_logits = next(c for c in run if c.key == f"logits_{flip_step}").array
    winner = int(np.argmax(ref_logits))
    runner = int(np.argsort(ref_logits)[-2])
    ref_logits[runner] = ref_logits[winner] - 0.01  # reference margin 0.01 < 4 bf16 spacings
    run_logits[:] = ref_logits
    run_logits[runner] = ref_logits[winner] + 0.01  # RUN prefers the runner-up
    ref_path = factory.write_compiledump(tmp_path / "ref", ref)
    run_path = factory.write_compiledump(tmp_path / "run", run)
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--json", tmp_path / "r.json")
    flip = json.loads((tmp_path / "r.json").read_text())["first_argmax_flip"]
    assert flip["step"] == flip_step and flip["kind"] == "near-tie"
    assert (flip["argmax_ref"], flip["argmax_run"]) == (winner, runner)
    sorted_ref = np.sort(ref_logits.astype(np.float64))
    assert flip["margin_ref"] == pytest.approx(sorted_ref[-1] - sorted_ref[-2], abs=1e-6)
    assert flip["epsilon"] == pytest.approx(4 * 2.0 ** (np.floor(np.log2(abs(sorted_ref[-1]))) - 7))
    # A near-tie alone is not a divergence: the logits are otherwise equal.
    assert code == 0 and out[-1].startswith("no divergence")
    assert any(line.startswith(f"first argmax flip: step {flip_step}") and "near-tie" in line for line in out)
    # With a fixed epsilon below the margin the same flip is a divergence (with thresholds of the
    # user's: bf16 decode-step defaults tolerate a confident flip, see the next test).
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--near-tie", "0.001", "--threshold", "1e-3",
                           "--norm-threshold", "2e-2", "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_argmax_flip"]["kind"] == "divergence"
    assert code == 1
    # ... and, when no float key crosses its threshold, the flip itself is the first divergence.
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--near-tie", "0.001", "--threshold", "10")
    assert code == 1
    assert out[-1].startswith(f"first divergence: logits_{flip_step} (step {flip_step}): argmax flip with reference "
                              f"margin ")


def test_argmax_flip_within_the_low_precision_decode_thresholds_is_not_a_divergence(tmp_path, capsys):
    """In a low-precision class a decode step's defaults tolerate an unrecorded routing flip of
    the decoded token, which can flip a confident argmax; a flip whose logits stay within them is
    reported, not named. With explicit thresholds it is a divergence again."""
    rng = np.random.default_rng(32)
    ref = factory.model_captures(rng, steps=4)
    run = factory.perturb(ref, rng)
    logits = next(c for c in run if c.key == "logits_2").array
    ref_logits = next(c for c in ref if c.key == "logits_2").array
    winner, runner = int(np.argmax(ref_logits)), int(np.argsort(ref_logits)[-2])
    logits[[winner, runner]] = ref_logits[[runner, winner]]  # swap the two best: a confident flip
    margin = float(np.sort(ref_logits.astype(np.float64))[-1] - np.sort(ref_logits.astype(np.float64))[-2])
    ref_path, run_path = (factory.write_compiledump(tmp_path / name, side) for name, side in (("ref", ref), ("run", run)))
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    flip = report["first_argmax_flip"]
    logits_record = next(r for r in report["keys"] if r["key"] == "logits_2")
    assert logits_record["threshold_source"] == "calibrated decode" and not logits_record["divergent"]
    assert flip["kind"] == "within-thresholds" and flip["margin_ref"] == pytest.approx(margin, abs=1e-5)
    assert flip["margin_ref"] >= flip["epsilon"]
    assert code == 0 and "within-thresholds argmax flip at step 2" in out[-1]
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--threshold", "1e-2", "--norm-threshold", "2e-2")
    assert code == 1 and out[-1].startswith("first divergence: logits_2 (step 2): argmax flip")


def test_argmax_flip_after_a_large_perturbation_is_a_divergence(tmp_path):
    rng = np.random.default_rng(31)
    ref = factory.model_captures(rng, steps=6)
    run = factory.perturb(ref, rng, noise=1e-7, from_step=2)
    flip_step = 4
    run_logits = next(c for c in run if c.key == f"logits_{flip_step}").array
    ref_logits = next(c for c in ref if c.key == f"logits_{flip_step}").array
    loser = int(np.argmin(ref_logits))
    run_logits[loser] = ref_logits.max() + 5.0
    for name, side in (("ref", ref), ("run", run)):
        factory.write_compiledump(tmp_path / name, side, manifest=factory.manifest_for(side, source_dtype="float32"))
    report = cmp.compare(tmp_path / "ref", tmp_path / "run")
    flips = [r.step for r in report.keys if r.margin_analysis and not r.argmax_equal]
    flip = report.first_argmax_flip
    assert flip.step == min(flips)
    if min(flips) == flip_step:
        sorted_ref = np.sort(ref_logits.astype(np.float64))
        assert flip.margin_ref == pytest.approx(sorted_ref[-1] - sorted_ref[-2], abs=1e-6)
    assert flip.kind == "divergence" and flip.margin_ref >= flip.epsilon
    assert report.decode_divergence.step == 2


def test_expert_id_mismatch_before_the_float_divergence_is_the_root_cause(tmp_path, capsys):
    """Ids that no router logits judge differ in token 0 of layer 1; the last token's float keys
    of the same layer diverge. The experts work token by token, so the flip does not reach them:
    they are the first divergence, and the flip its likely root cause."""
    ref_path, run_path, _, _ = dump_pair(tmp_path, 40, from_layer=1, ids_layer=1)
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    assert report["first_divergence"]["key"] == "layer1_moe_out"
    assert report["root_cause"]["key"] == "layer1_topk" and report["root_cause"]["layer"] == 1
    assert report["root_cause"]["row"] == 0
    with np.load(ref_path) as ref_data, np.load(run_path) as run_data:
        ref_ids, run_ids = ref_data["layer1_topk"], run_data["layer1_topk"]
    assert report["root_cause"]["overlap"] == len(set(ref_ids[0]) & set(run_ids[0])) == 3
    assert "likely root cause: layer1_topk" in out[-1]


def test_keys_an_unjudged_expert_id_flip_reaches_are_not_judged(tmp_path, capsys):
    """The same flip in token 0 of layer 1, and the floats cross from layer 4 on: from layer 2 on
    the last token attends to token 0, which went to other experts, so whether they differ
    honestly cannot be told (a bf16 engine's honest flip does this through attention). Not a
    divergence: exit 3, each such key marked and listed, none unjudged in silence."""
    ref_path, run_path, _, _ = dump_pair(tmp_path, 40, from_layer=4, ids_layer=1)
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 3 and report["first_divergence"] is None
    crossed = [r for r in report["keys"] if r["phase"] == "prefill" and r.get("excused_rows")]
    assert [r["key"] for r in crossed] == ["layer4_moe_out", "layer4", "layer5_moe_out", "layer5", "final_norm", "logits"]
    for record in crossed:
        assert record["status"] == "after_unjudged" and not record["divergent"] and record["excused_rows"] == [2]
        assert record["excused_by"] == ["layer1_topk"] and record["excused_near_tie"] is False
        assert record["excused_value"] == record["rel_diff"] > record["threshold"]
    (problem,) = [p for p in report["problems"] if p["kind"] == "ids_not_judged"]
    assert problem["detail"].endswith("by itself; nor are the 6 float keys after it that cross a threshold only at or "
                                      "after those tokens: layer4_moe_out, layer4, layer5_moe_out, layer5, final_norm, "
                                      "logits")
    row = next(line for line in out if line.startswith("* layer4_moe_out"))
    assert "not judged at token 2: at or after a token whose expert ids differ at layer1_topk" in row
    assert out[-1].startswith("no divergence") and "(6 keys not judged at or after" in out[-1]
    # In the fp32 class an id mismatch is itself a divergence: nothing after it is excused.
    ref_path, run_path, _, _ = dump_pair(tmp_path / "fp32", 40, "float32", noise=1e-7, from_layer=4, ids_layer=1)
    report = cmp.compare(ref_path, run_path)
    assert report.exit_status == 1 and report.first_divergence.key == "layer4_moe_out"
    assert report.root_cause.key == "layer1_topk" and report.root_cause.routing_verdict == "divergence"


def test_id_mismatch_after_the_float_divergence_is_not_the_root_cause(tmp_path):
    ref_path, run_path, _, _ = dump_pair(tmp_path, 41, from_layer=2, ids_layer=4)
    report = cmp.compare(ref_path, run_path)
    assert report.first_divergence.key == "layer2_moe_out"
    assert report.root_cause is None
    assert report.first_id_mismatch.key == "layer4_topk"


def test_id_mismatch_alone_is_the_first_divergence_in_fp32(tmp_path, capsys):
    rng = np.random.default_rng(42)
    ref = factory.model_captures(rng)
    run = factory.perturb(ref, rng, noise=1e-9, ids_layer=3)
    paths = [factory.write_compiledump(tmp_path / name, side, manifest=factory.manifest_for(side, source_dtype="float32"))
             for name, side in (("ref", ref), ("run", run))]
    code, out, _ = run_cli(capsys, "compare", *paths)
    assert code == 1
    assert out[-1].startswith("first divergence: layer3_topk") and "ids differ" in out[-1]


def test_id_mismatch_alone_in_bf16_without_router_logits_is_reported_not_named(tmp_path, capsys):
    """No router logits to judge the row by: a problem, not the first divergence, and exit 3 (the
    comparison could not tell; test_routing.py has the near-tie rule itself)."""
    ref_path, run_path, _, _ = dump_pair(tmp_path, 42, ids_layer=3)
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path)
    assert code == 3
    assert any(line.startswith("  ids_not_judged: layer3_topk: expert ids differ in 1/3 rows") for line in out)
    assert out[-1].startswith("no divergence") and "layer3_topk (not judged)" in out[-1]


def test_thresholds_and_last_matching_override(tmp_path, capsys):
    # rel_diff thresholds only: norm_diff is switched off with a norm threshold no key reaches.
    ref_path, run_path, _, _ = dump_pair(tmp_path, 50, from_layer=3)
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--threshold", "0.5", "--norm-threshold", "10")
    assert code == 0 and out[-1].startswith("no divergence")
    # Broad override first, a narrower one later: the later one wins for layer3_moe_out.
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--threshold-for", "^layer3=0.5",
                           "--threshold-for", "moe_out$=1e-3", "--norm-threshold", "10", "--json", tmp_path / "r.json")
    first = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    assert code == 1 and first["key"] == "layer3_moe_out" and first["threshold"] == 1e-3
    code, out, _ = run_cli(capsys, "compare", ref_path, run_path, "--threshold-for", "^layer3=0.5",
                           "--norm-threshold", "10", "--json", tmp_path / "r.json")
    first = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    assert first["key"] == "layer4_moe_out" and first["last_good"] == "layer3"
    code, _, err = run_cli(capsys, "compare", ref_path, run_path, "--threshold-for", "([=1")
    assert code == 2 and any("bad regex" in line for line in err)


def test_threshold_is_a_strict_upper_bound_on_rel_diff(tmp_path):
    ref_path, run_path, _, _ = dump_pair(tmp_path, 51, from_layer=3)
    with np.load(ref_path) as ref_data, np.load(run_path) as run_data:
        value = rel_diff(ref_data["layer3_moe_out"], run_data["layer3_moe_out"])
    above = cmp.compare(ref_path, run_path, cmp.CompareOptions(threshold=value * 0.999, norm_threshold=10.0))
    assert above.first_divergence.key == "layer3_moe_out"
    below = cmp.compare(ref_path, run_path, cmp.CompareOptions(threshold=value * 1.001, norm_threshold=10.0))
    assert below.first_divergence.key != "layer3_moe_out"
    assert below.first_divergence.last_good == "layer3_moe_out"


def test_missing_extra_shape_and_dtype_mismatches_are_listed_not_fatal(tmp_path, capsys):
    rng = np.random.default_rng(60)
    ref = factory.model_captures(rng)
    run = factory.perturb(ref, rng)
    run = [c for c in run if c.key != "layer2"]  # missing in RUN
    run.append(factory.Capture("extra_probe", np.ones(5, np.float32) + 0.5, "record", "extra_probe"))
    run = [factory.replace(c, array=np.concatenate([c.array, c.array[:1]])) if c.key == "layer3" else c for c in run]
    run = [factory.replace(c, array=c.array.astype(np.float32)) if c.key == "layer4_topk" else c for c in run]
    run = [factory.replace(c, array=c.array.reshape(1, -1)) if c.key == "layer5" else c for c in run]
    ref_path = factory.write_compiledump(tmp_path / "ref", ref)
    run_path = factory.write_compiledump(tmp_path / "run", run)
    code, out, err = run_cli(capsys, "compare", ref_path, run_path, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    kinds = {(p["kind"], p["key"]) for p in report["problems"]}
    assert ("missing_in_run", "layer2") in kinds and ("extra_in_run", "extra_probe") in kinds
    assert ("shape_mismatch", "layer3") in kinds and ("dtype_mismatch", "layer4_topk") in kinds
    assert ("shape_mismatch", "layer5") in kinds  # [48] vs [1, 48]: compared flattened
    by_key = {r["key"]: r for r in report["keys"]}
    assert by_key["layer3"]["status"] == "skipped" and by_key["layer4_topk"]["status"] == "skipped"
    assert by_key["layer5"]["status"] == "ok" and by_key["layer5"]["rel_diff"] < 1e-6
    # Two keys both sides hold were not compared: not counted as compared, and the comparison could
    # not tell everything (exit 3, as for keys not comparable).
    assert report["compared"] == len(report["keys"]) - 2
    assert code == 3 and not err and out[-1].startswith(f"no divergence: {report['compared']} keys compared")
    assert "; 2 keys held by both sides NOT COMPARED (see the problems)" in out[-1]
    assert any(line.startswith("? layer3 ") and line.endswith("not compared (see problems)") for line in out)


def test_nan_in_run_only_is_a_divergence(tmp_path):
    rng = np.random.default_rng(61)
    ref = factory.model_captures(rng)
    run = factory.perturb(ref, rng)
    run[[c.key for c in run].index("layer2_moe_out")].array[5] = np.nan
    factory.write_compiledump(tmp_path / "ref", ref)
    factory.write_compiledump(tmp_path / "run", run)
    report = cmp.compare(tmp_path / "ref", tmp_path / "run")
    assert report.first_divergence.key == "layer2_moe_out"
    assert (report.first_divergence.metric, report.first_divergence.value) == ("nonfinite", 1)
