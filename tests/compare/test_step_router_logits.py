"""A decode step's router logits beside its ids: shown, not judged, and where they are judged after all."""

from __future__ import annotations

import numpy as np

from helpers import dumpfactory as factory
from helpers.step_routing_dumps import EXPERTS, TOPK, run_side, step_captures, write
from compiledump.compare import compare, format_report


def test_a_steps_router_logits_are_shown_not_judged(tmp_path):
    rng = np.random.default_rng(5)
    ref = step_captures(rng)
    report = compare(*write(tmp_path, ref, run_side(ref, rng, {}, {"layer0_step_router_1"}), "bfloat16"))
    record = {record.key: record for record in report.keys}["layer0_step_router_1"]
    assert record.floats.rel_diff > 0.2 and record.status == "shown" and not record.divergent
    assert report.exit_status == 0 and report.closest.key != "layer0_step_router_1"
    # Without the ids beside them, they are plain step keys, judged.
    alone = [c for c in ref if "_step_topk_" not in c.key]
    report = compare(*write(tmp_path / "b", alone, run_side(alone, rng, {}, {"layer0_step_router_1"}), "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer0_step_router_1"


def test_last_good_is_a_judged_key_not_the_router_logits_shown_before_the_divergence(tmp_path):
    """Layer 1's step-1 router logits are far off (shown, not judged) and so is its output: the
    decode divergence is the output, and its last good key the last one judged within its
    thresholds (layer 0's output), not the far-off logits just before it."""
    rng = np.random.default_rng(11)
    ref = step_captures(rng)
    run = run_side(ref, rng, {}, {"layer1_step_router_1", "layer1_out_1"})
    report = compare(*write(tmp_path, ref, run, "bfloat16"))
    keys = {record.key: record for record in report.keys}
    assert keys["layer1_step_router_1"].status == "shown" and keys["layer1_step_router_1"].floats.rel_diff > 0.2
    first = report.first_divergence
    assert (first.key, first.last_good, first.last_good_step) == ("layer1_out_1", "layer0_out_1", 1)
    assert "last good: layer0_out_1" in format_report(report)[-1]


def test_in_fp32_a_steps_router_logits_are_judged_and_name_the_layer(tmp_path):
    """float32 routing does not flip and its decode noise is ~1e-12 (docs/compare.md): a step's
    router logits are judged there, so a decode-only bug is named at the first layer it reaches
    (here layer 1's router logits at step 1, before the layer's output), not only at the logits."""
    rng = np.random.default_rng(11)
    ref = step_captures(rng)
    run = run_side(ref, rng, {}, {"layer1_step_router_1", "layer1_out_1"}, noise=1e-9)
    report = compare(*write(tmp_path, ref, run, "float32"))
    keys = {record.key: record for record in report.keys}
    assert keys["layer1_step_router_1"].status == "divergent" and keys["layer0_step_router_1"].status == "ok"
    first = report.first_divergence
    assert (first.key, first.layer, first.step, first.last_good) == ("layer1_step_router_1", 1, 1, "layer0_out_1")


def test_what_a_steps_router_logits_still_show(tmp_path):
    """Non-finite router logits are a divergence; logits beside ids that are not compared on
    both sides, or beside ids that are not a step's (a record_ids named like a step), are
    judged as floats."""
    rng = np.random.default_rng(10)
    ref = step_captures(rng)
    run = run_side(ref, rng, {})
    {c.key: c for c in run}["layer1_step_router_2"].array[3] = np.nan
    report = compare(*write(tmp_path / "a", ref, run, "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_step_router_2"
    assert report.first_divergence.metric == "nonfinite"
    # The ids on REF only: the router logits are judged.
    run = [c for c in run_side(ref, rng, {}, {"layer1_step_router_2"}) if c.key != "layer1_step_topk_2"]
    report = compare(*write(tmp_path / "b", ref, run, "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_step_router_2"
    # A prefill record `layer0_router_0` beside record_ids `layer0_topk_0`: not a step's.
    records = [factory.Capture("layer0_router_0", rng.standard_normal(EXPERTS).astype(np.float32), "record",
                               "layer0_router_0"),
               factory.Capture("layer0_topk_0", np.arange(TOPK, dtype=np.int32), "ids", "layer0_topk_0")]
    report = compare(*factory.write_pair(tmp_path / "c", records, run_side(records, rng, {}, {"layer0_router_0"}),
                                         "float32", "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer0_router_0"


def test_the_divergent_table_leaves_out_the_router_logits_shown(tmp_path, capsys):
    """`--table divergent` prints the marked rows; a decode step's router logits are shown in the
    full table (`-`, never judged), not among them, however far off."""
    from compiledump.cli import main

    rng = np.random.default_rng(12)
    ref = step_captures(rng)
    run = run_side(ref, rng, {}, {"layer0_step_router_1", "layer2_out_2"})
    paths = [str(path) for path in write(tmp_path, ref, run, "bfloat16")]
    tables = {}
    for table in ("all", "divergent"):
        assert main(["compare", *paths, "--table", table]) == 1
        tables[table] = [line[2:].split()[0] for line in capsys.readouterr().out.splitlines()
                         if line[:2] in ("! ", "* ", "- ", "? ", "~ ", "  ") and len(line.split()) > 5
                         and line[2:].split()[0] != "key"]
    assert "layer0_step_router_1" in tables["all"] and tables["divergent"] == ["layer2_out_2"]
