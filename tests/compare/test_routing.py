"""Expert-id mismatches judged by the reference's router logits (docs/compare.md, "Expert ids
and near ties"): in the fp32 class any mismatch diverges; in a low-precision class a near tie
(every expert the run chose instead scores within epsilon of every expert it displaced) is not
a divergence, a row far from any tie is, and rows without reference logits are reported
prominently without being the first divergence; a float divergence after any mismatch names it
as the likely root cause.

Dumps are built with numpy (tests/helpers/routing_dumps.py, random data); every expected gap,
epsilon and verdict is computed from the definitions, independently of compiledump.compare
(how far a flip reaches: test_routing_reach.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import dumpfactory as factory
from compiledump.cli import main
from compiledump.compare import CompareOptions, compare, format_report

from helpers.routing_dumps import (EXPERTS, LAYERS, TOKENS, TOPK, epsilon_of, gap_of, moe_captures, run_side,
                                    swap_runner_up, with_near_tie, write_pair)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_near_tie_in_a_low_precision_class_is_not_a_divergence(tmp_path, dtype, capsys):
    rng = np.random.default_rng(1)
    ref = moe_captures(rng, all_rows=False)
    ref = with_near_tie(ref, layer=1, row=TOKENS - 1, gap=0.004, all_rows=False)
    logits, ids, new = swap_runner_up(ref, 1, TOKENS - 1, all_rows=False)
    run = run_side(ref, rng, {(1, TOKENS - 1): new})
    ref_path, run_path = write_pair(tmp_path, ref, run, dtype, all_rows=False)
    code = main(["compare", str(ref_path), str(run_path), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and report["first_divergence"] is None, out[-1]
    record = next(r for r in report["keys"] if r["key"] == "layer1_topk")
    routing = record["routing"]
    assert (record["status"], record["divergent"], routing["verdict"]) == ("near_tie", False, "near_tie")
    assert routing["class"] == ("bf16" if dtype == "bfloat16" else "fp16") and routing["class_from"] == "router"
    (row,) = routing["rows"]
    assert row["row"] == TOKENS - 1 and row["near_tie"] is True
    assert row["gap"] == pytest.approx(gap_of(logits, ids, new), abs=1e-6)
    assert row["gap"] == pytest.approx(0.004, abs=1e-5)
    assert row["epsilon"] == pytest.approx(epsilon_of(logits))
    assert report["first_id_mismatch"]["key"] == "layer1_topk"
    assert [item["key"] for item in report["id_mismatches"]] == ["layer1_topk"]
    assert report["problems"] == []  # a near tie is a note, not a problem
    assert any(note.startswith("layer1_topk: expert ids differ in 1/6 rows: near tie at row 5") for note in
               report["notes"])
    assert any(line.startswith("* layer1_topk") for line in out)
    assert "expert ids differ without a divergence: layer1_topk (near tie)" in out[-1]


def test_ids_far_from_a_tie_diverge_in_a_low_precision_class(tmp_path):
    rng = np.random.default_rng(2)
    ref = moe_captures(rng, all_rows=False)
    by_key = {c.key: c for c in ref}
    logits = by_key["layer1_router"].array.astype(np.float64)
    ids = by_key["layer1_topk"].array[-1]
    worst = int(np.argmin(logits))  # the lowest-scored expert replaces the top-1: a routing bug
    new = ids.copy()
    new[0] = worst
    run = run_side(ref, rng, {(1, TOKENS - 1): new})
    report = compare(*write_pair(tmp_path, ref, run, "bfloat16", all_rows=False))
    first = report.first_divergence
    assert report.exit_status == 1
    assert (first.key, first.metric, first.routing_verdict) == ("layer1_topk", "ids", "divergence")
    (row,) = first.routing.rows
    assert row.gap == pytest.approx(gap_of(logits, ids, new), abs=1e-6)
    assert row.gap > epsilon_of(logits) == pytest.approx(row.epsilon)
    assert format_report(report)[-1].startswith("first divergence: layer1_topk (layer 1): integer ids differ")


def test_any_ids_mismatch_diverges_in_the_fp32_class(tmp_path):
    rng = np.random.default_rng(3)
    ref = with_near_tie(moe_captures(rng, all_rows=False), layer=0, row=TOKENS - 1, gap=1e-4, all_rows=False)
    _, _, new = swap_runner_up(ref, 0, TOKENS - 1, all_rows=False)
    run = run_side(ref, rng, {(0, TOKENS - 1): new})
    report = compare(*write_pair(tmp_path, ref, run, "float32", all_rows=False))
    first = report.first_divergence
    assert report.exit_status == 1 and (first.key, first.metric) == ("layer0_topk", "ids")
    assert first.routing.klass == "fp32" and first.routing.verdict == "divergence"
    assert first.routing.rows[0].near_tie is True  # a tie, and still a divergence: fp32 ids must match
    # --threshold and friends do not change it
    assert compare(*write_pair(tmp_path / "again", ref, run, "float32", all_rows=False),
                   CompareOptions(threshold=1.0)).exit_status == 1


def test_rows_without_reference_logits_are_reported_not_named(tmp_path, capsys):
    rng = np.random.default_rng(4)
    ref = moe_captures(rng, all_rows=False)  # one-row mode: the logits of the last row only
    by_key = {c.key: c for c in ref}
    ids = by_key["layer1_topk"].array
    flipped = {(1, 0): np.array([ids[0][0], next(e for e in range(EXPERTS) if e not in ids[0])], np.int32),
               (1, 2): np.array([next(e for e in range(EXPERTS) if e not in ids[2]), ids[2][1]], np.int32)}
    run = run_side(ref, rng, flipped)
    ref_path, run_path = write_pair(tmp_path, ref, run, "bfloat16", all_rows=False)
    code = main(["compare", str(ref_path), str(run_path), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 3 and report["first_divergence"] is None and report["exit_status"] == 3
    record = next(r for r in report["keys"] if r["key"] == "layer1_topk")
    assert record["status"] == "not_judged" and record["routing"]["not_judged_rows"] == [0, 2]
    assert record["routing"]["router_rows"] == [TOKENS - 1]
    (problem,) = report["problems"]
    assert problem["kind"] == "ids_not_judged" and problem["key"] == "layer1_topk"
    assert "2/6 rows" in problem["detail"] and "rows 0, 2" in problem["detail"]
    assert problem["detail"].endswith("the router logits of every row would judge each row (instrument's "
                                      "default, router_rows=\"all\"; by hand, record(..., rows=\"all\"))")
    assert any(line.startswith("ids: layer1_topk (layer 1) differ (row 0, overlap 1/2): rows 0, 2 not judged")
               for line in out)
    assert "layer1_topk (not judged)" in out[-1]
    # The same mismatch followed by floats that cross from layer 2 on: the last token attends to
    # tokens 0 and 2, which went to other experts, so whether its values differ honestly cannot
    # be told. Not a divergence (test_compare.py has a float divergence the flip does not reach).
    run = run_side(ref, rng, flipped, large_from_layer=2)
    report = compare(*write_pair(tmp_path / "b", ref, run, "bfloat16", all_rows=False))
    assert report.exit_status == 3 and report.first_divergence is None
    after = [r for r in report.keys if r.status == "after_unjudged"]
    assert after and {r.layer for r in after} == set(range(2, LAYERS)) and all(r.excused_rows == [TOKENS - 1] for r in after)
    assert "float keys after it that cross a threshold only at or after those tokens" in report.problems[0].detail


def test_all_rows_router_logits_judge_every_row(tmp_path):
    rng = np.random.default_rng(5)
    ref = with_near_tie(moe_captures(rng, all_rows=True), layer=2, row=1, gap=0.002, all_rows=True)
    logits1, ids1, new1 = swap_runner_up(ref, 2, 1, all_rows=True)
    # Row 3: the runner-up replaces a chosen expert; its distance is whatever the random logits give.
    logits3, ids3, new3 = swap_runner_up(ref, 2, 3, all_rows=True)
    run = run_side(ref, rng, {(2, 1): new1, (2, 3): new3})
    report = compare(*write_pair(tmp_path, ref, run, "bfloat16", all_rows=True))
    record = next(r for r in report.keys if r.key == "layer2_topk")
    rows = {row.row: row for row in record.routing.rows}
    assert sorted(rows) == [1, 3] and record.routing.router_rows == list(range(TOKENS))
    for row, logits, ids, new in ((1, logits1, ids1, new1), (3, logits3, ids3, new3)):
        gap, epsilon = gap_of(logits, ids, new), epsilon_of(logits)
        assert rows[row].gap == pytest.approx(gap, abs=1e-6) and rows[row].epsilon == pytest.approx(epsilon)
        assert rows[row].near_tie is (gap <= epsilon)
    expected_tie = gap_of(logits3, ids3, new3) <= epsilon_of(logits3)
    assert record.routing.verdict == ("near_tie" if expected_tie else "divergence")
    assert report.exit_status == (0 if expected_tie else 1)
    # A fixed --near-tie epsilon above both gaps makes both rows ties.
    both = max(gap_of(logits1, ids1, new1), gap_of(logits3, ids3, new3)) + 1e-3
    report = compare(*write_pair(tmp_path / "b", ref, run, "bfloat16", all_rows=True), CompareOptions(near_tie=both))
    assert report.exit_status == 0
    assert next(r for r in report.keys if r.key == "layer2_topk").routing.near_tie_rows == [1, 3]


def test_a_swapped_order_is_judged_by_the_scores(tmp_path):
    rng = np.random.default_rng(6)
    ref = moe_captures(rng, all_rows=True)
    by_key = {c.key: c for c in ref}
    router = by_key["layer0_router"].array
    ids = by_key["layer0_topk"].array
    # Row 0: make the two chosen experts nearly equal, then swap them; row 4: swap two far apart.
    first, second = ids[0]
    router[0, second] = router[0, first] - np.float32(0.001)
    gaps = {0: float(router[0, first]) - float(router[0, second]), 4: float(router[4, ids[4][0]] - router[4, ids[4][1]])}
    run = run_side(ref, rng, {(0, 0): ids[0][::-1].copy(), (0, 4): ids[4][::-1].copy()})
    report = compare(*write_pair(tmp_path, ref, run, "bfloat16", all_rows=True))
    rows = {row.row: row for row in next(r for r in report.keys if r.key == "layer0_topk").routing.rows}
    for row, gap in gaps.items():
        assert rows[row].gap == pytest.approx(gap, abs=1e-6)
        assert rows[row].near_tie is (gap <= epsilon_of(router[row].astype(np.float64)))
    assert rows[0].near_tie is True


def test_reference_ids_that_are_not_the_top_k_of_its_logits_are_not_judged(tmp_path):
    """Routing with a bias or a grouped top-k: the logits alone do not explain the choice."""
    rng = np.random.default_rng(7)
    ref = moe_captures(rng, all_rows=False)
    by_key = {c.key: c for c in ref}
    ids = by_key["layer1_topk"].array
    logits = by_key["layer1_router"].array.astype(np.float64)
    ids[-1] = np.argsort(logits, kind="stable")[:TOPK]  # the two lowest: not the top-k
    new = ids[-1].copy()
    new[0] = next(e for e in range(EXPERTS) if e not in ids[-1])
    run = run_side(ref, rng, {(1, TOKENS - 1): new})
    report = compare(*write_pair(tmp_path, ref, run, "bfloat16", all_rows=False))
    (row,) = next(r for r in report.keys if r.key == "layer1_topk").routing.rows
    assert row.gap is None and "layer1_topk row 5: ids not what they select" in row.reason
    assert report.exit_status == 3 and report.problems[0].kind == "ids_not_judged"
    assert "rows=\"all\"" not in report.problems[0].detail  # all rows would not help: the logits cannot judge


def test_one_layer_routed_by_more_than_its_logits_leaves_no_layer_judged_by_them(tmp_path):
    """Routing is one function of the model: DeepSeek-V3's group-limited top-k can swap a whole
    group for a near tie in the group scores, whose experts' logits are far apart. One reference
    row whose ids are not the top-k of its logits (here in layer 0) means no layer's logit gaps
    judge a flip; before, layer 1's swap was called a divergence (gap far above epsilon)."""
    rng = np.random.default_rng(11)
    plain = moe_captures(rng, all_rows=True)  # every reference row takes the top-k of its logits
    by_key = {c.key: c for c in plain}
    logits1 = by_key["layer1_router"].array.astype(np.float64)
    new = by_key["layer1_topk"].array[4].copy()
    new[0] = int(np.argsort(logits1[4], kind="stable")[0])  # the lowest-scored expert: far from any tie
    run = run_side(plain, rng, {(1, 4): new})
    grouped = [factory.replace(c, array=c.array.copy()) for c in plain]
    logits0 = by_key["layer0_router"].array.astype(np.float64)
    next(c for c in grouped if c.key == "layer0_topk").array[2] = np.argsort(logits0[2], kind="stable")[:TOPK]
    report = compare(*write_pair(tmp_path / "grouped", grouped, run, "bfloat16", all_rows=True))
    record = next(r for r in report.keys if r.key == "layer1_topk")
    (row,) = record.routing.rows
    assert row.gap is None and "layer0_topk row 2: ids not what they select" in row.reason
    assert record.routing.verdict == "not_judged" and not record.divergent
    assert record.routing.to_json()["not_top_k"] == "layer0_topk row 2"
    # The same swap where every reference row is top-k routing: far from a tie, a divergence.
    report = compare(*write_pair(tmp_path / "plain", plain, run, "bfloat16", all_rows=True))
    record = next(r for r in report.keys if r.key == "layer1_topk")
    (row,) = record.routing.rows
    assert record.routing.verdict == "divergence" and row.gap > row.epsilon


def test_without_router_keys_the_pair_class_decides(tmp_path):
    """No ``<prefix>_router`` key: fp32 dumps diverge on any mismatch, bf16 ones report it (exit 3:
    the comparison could not tell)."""
    rng = np.random.default_rng(8)
    ref = [c for c in moe_captures(rng, all_rows=False) if not c.key.endswith("_router")]
    ids = next(c for c in ref if c.key == "layer0_topk").array
    new = np.array([ids[3][0], next(e for e in range(EXPERTS) if e not in ids[3])], np.int32)
    run = run_side(ref, rng, {(0, 3): new})
    strict = compare(*write_pair(tmp_path / "a", ref, run, "float32", all_rows=False))
    assert strict.exit_status == 1 and strict.first_divergence.routing.class_from == "pair"
    loose = compare(*write_pair(tmp_path / "b", ref, run, "bfloat16", all_rows=False))
    assert loose.exit_status == 3 and loose.id_mismatches[0].routing.verdict == "not_judged"
    assert "REF has no layer0_router" in loose.id_mismatches[0].routing.rows[0].reason


def test_an_ids_line_names_the_first_row_whose_experts_changed(tmp_path):
    """A helper's audit: the ids line cited row 0, whose experts were only reordered ("row 0,
    overlap 2/2: a divergence"), where row 2's had changed. Synthetic fp32 dumps."""
    rng = np.random.default_rng(3)
    ids = np.array([[1, 5], [2, 6], [3, 7]], dtype=np.int32)
    ref = [factory.Capture("layer0_topk", ids, "ids", "layer0_topk"),
           factory.Capture("layer0", rng.standard_normal(32).astype(np.float32) + 0.5, "record", "layer0")]
    changed = ids.copy()
    changed[0] = changed[0, ::-1]  # the same experts in another order
    changed[2, 1] = 4  # another expert
    run = [factory.Capture("layer0_topk", changed, "ids", "layer0_topk"), ref[1]]
    report = compare(*map(str, factory.write_pair(tmp_path, ref, run)))
    lines = format_report(report)
    (line,) = [line for line in lines if line.startswith("ids: layer0_topk")]
    assert "(row 2, overlap 1/2)" in line, line
    assert (report.first_divergence.key, report.first_divergence.row) == ("layer0_topk", 2), lines[-1]


def test_the_named_rows_overlap_is_out_of_its_own_distinct_ids(tmp_path):
    """A review: rows with different numbers of distinct ids (an indexer's -1 padding) printed the
    changed row's overlap out of the first mismatching row's k ("overlap 3/2")."""
    rng = np.random.default_rng(0)
    ref_ids = np.array([[5, -1, -1, -1], [1, 2, 3, 4], [7, 2, 3, 4]], np.int32)
    run_ids = np.array([[-1, 5, -1, -1], [1, 2, 3, 4], [7, 2, 3, 6]], np.int32)  # row 0 reordered, row 2 changed
    layer0 = factory.Capture("layer0", rng.standard_normal(16).astype(np.float32), "record", "layer0")
    ref = [layer0, factory.Capture("layer1_topk", ref_ids, "ids", "layer1_topk")]
    run = [layer0, factory.Capture("layer1_topk", run_ids, "ids", "layer1_topk")]
    report = compare(*map(str, factory.write_pair(tmp_path, ref, run)))
    first = report.first_divergence
    assert (first.row, first.overlap, first.k) == (2, 3, 4), format_report(report)[-1]
