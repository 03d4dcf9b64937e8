"""Expert-id mismatches judged by the reference's router logits (docs/compare.md, "Expert ids
and near ties"): in the fp32 class any mismatch diverges; in a low-precision class a near tie
(every expert the run chose instead scores within epsilon of every expert it displaced) is not
a divergence, a row far from any tie is, and rows without reference logits are reported
prominently without being the first divergence; a float divergence after any mismatch names it
as the likely root cause.

Dumps are built here (random data); every expected gap, epsilon and verdict is computed in this
file from the definitions, independently of compiledump.compare.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers import dumpfactory as factory
from compiledump.cli import main
from compiledump.compare import CompareOptions, compare, format_report
from compiledump.compare.routing import describe_routing

EXPERTS, TOPK, TOKENS, DIM, LAYERS = 8, 2, 6, 32, 3


def epsilon_of(logits: np.ndarray, ulps: float = 4.0) -> float:
    """ulps bf16 spacings (8-bit significand) of the largest absolute logit."""
    top = float(np.max(np.abs(logits)))
    return ulps * 2.0 ** (math.floor(math.log2(top)) - 7)


def top_k(logits: np.ndarray) -> np.ndarray:
    """Experts by descending logit (first index on ties), as torch.topk returns them."""
    return np.argsort(-logits, kind="stable")[:TOPK].astype(np.int32)


def moe_captures(rng: np.random.Generator, all_rows: bool) -> list[factory.Capture]:
    """A prefill of a 3-layer MoE as compiledump.instrument records it: per layer the router
    logits (the last row, or every row), the top-k ids of every row (the top-k of the logits),
    the MoE output and the layer output; then 3 decode steps of logits."""
    captures = [factory.Capture("embed", rng.standard_normal(DIM).astype(np.float32), "record", "embed")]
    for layer in range(LAYERS):
        logits = rng.standard_normal((TOKENS, EXPERTS)).astype(np.float32)
        ids = np.stack([top_k(row.astype(np.float64)) for row in logits])
        router = logits if all_rows else logits[-1]
        captures += [
            factory.Capture(f"layer{layer}_router", router, "record", f"layer{layer}_router"),
            factory.Capture(f"layer{layer}_topk", ids, "ids", f"layer{layer}_topk"),
            factory.Capture(f"layer{layer}_mlp", rng.standard_normal(DIM).astype(np.float32), "record",
                            f"layer{layer}_mlp"),
            factory.Capture(f"layer{layer}", rng.standard_normal(DIM).astype(np.float32), "record", f"layer{layer}"),
        ]
    for step in range(3):
        logits = rng.standard_normal(50).astype(np.float32)
        logits[step] += 6.0
        captures.append(factory.Capture(f"logits_{step}", logits, "step", "logits", step))
    return captures


def with_near_tie(captures: list, layer: int, row: int, gap: float, all_rows: bool) -> list:
    """Make REF's top-1 and the best unchosen expert of ``row`` in ``layer`` differ by ``gap``
    (the other logits unchanged), recomputing that row's ids."""
    out = [factory.replace(c, array=c.array.copy()) for c in captures]
    by_key = {c.key: c for c in out}
    router, ids = by_key[f"layer{layer}_router"].array, by_key[f"layer{layer}_topk"].array
    logits = router[row] if all_rows else router
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    logits[order[TOPK]] = logits[order[TOPK - 1]] - np.float32(gap)
    ids[row] = top_k(logits.astype(np.float64))
    return out


def run_side(ref: list, rng: np.random.Generator, ids_rows: dict, large_from_layer: int | None = None) -> list:
    """RUN: floats with relative noise 1e-5 (large noise 0.3 in layers >= ``large_from_layer``),
    ``ids_rows[(layer, row)] = new ids row``."""
    out = []
    for capture in ref:
        array = capture.array.copy()
        if capture.kind == "ids":
            layer = int(capture.tag[5:].split("_")[0])
            for (at_layer, row), new in ids_rows.items():
                if at_layer == layer:
                    array[row] = new
        else:
            layer = int(capture.tag[5:].split("_")[0]) if capture.tag.startswith("layer") else None
            relative = 0.3 if large_from_layer is not None and layer is not None and layer >= large_from_layer \
                else 1e-5
            array = (array + rng.standard_normal(array.shape) * relative * np.abs(array).mean()).astype(np.float32)
        out.append(factory.replace(capture, array=array))
    return out


def write_pair(tmp_path: Path, ref: list, run: list, dtype: str, all_rows: bool) -> tuple[Path, Path]:
    fields = {f"layer{layer}_router": {"rows": "all"} for layer in range(LAYERS)} if all_rows else None
    return factory.write_pair(tmp_path, ref, run, "float32", dtype, key_fields=fields)


def gap_of(logits: np.ndarray, ref_row: np.ndarray, run_row: np.ndarray) -> float:
    """The largest logit by which an expert REF chose and RUN did not beats one RUN chose instead."""
    displaced = [int(i) for i in ref_row if i not in set(run_row.tolist())]
    instead = [int(i) for i in run_row if i not in set(ref_row.tolist())]
    return float(max(logits[displaced].astype(np.float64)) - min(logits[instead].astype(np.float64)))


def swap_runner_up(ref: list, layer: int, row: int, all_rows: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """REF's logits and ids of ``row``, and a RUN ids row with REF's k-th expert replaced by the
    best unchosen one."""
    by_key = {c.key: c for c in ref}
    router = by_key[f"layer{layer}_router"].array
    logits = (router[row] if all_rows else router).astype(np.float64)
    ids = by_key[f"layer{layer}_topk"].array[row]
    order = np.argsort(-logits, kind="stable")
    new = ids.copy()
    new[list(ids).index(order[TOPK - 1])] = order[TOPK]
    return logits, ids, new


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


def test_a_token_a_near_tie_routed_elsewhere_is_not_judged_again(tmp_path):
    """All rows: layer 0's near tie sends token 2 to other experts; its hidden state then differs,
    so layer 1's routing of token 2 may differ far from any tie in REF's logits: a consequence,
    not judged; so is that of a later token, which attends to token 2. The same far mismatch in
    an earlier token is a divergence."""
    rng = np.random.default_rng(9)
    ref = with_near_tie(moe_captures(rng, all_rows=True), layer=0, row=2, gap=0.002, all_rows=True)
    _, _, tie = swap_runner_up(ref, 0, 2, all_rows=True)
    by_key = {c.key: c for c in ref}
    far = {}
    for row in (2, 4):
        logits = by_key["layer1_router"].array[row].astype(np.float64)
        ids = by_key["layer1_topk"].array[row].copy()
        ids[0] = int(np.argmin(logits))  # the lowest-scored expert: far from any tie
        far[row] = ids
        assert gap_of(logits, by_key["layer1_topk"].array[row], ids) > epsilon_of(logits)
    report = compare(*write_pair(tmp_path / "a", ref, run_side(ref, rng, {(0, 2): tie, (1, 2): far[2]}),
                                 "bfloat16", all_rows=True))
    record = next(r for r in report.keys if r.key == "layer1_topk")
    assert report.exit_status == 0 and record.status == "near_tie" and not record.divergent
    assert record.routing.after_near_tie_rows == [2] and record.routing.far_rows == []
    assert record.routing.rows[0].after_near_tie == "layer0_topk"
    # Token 4 attends to token 2 from layer 1 on: its far flip there may be a consequence too.
    report = compare(*write_pair(tmp_path / "b", ref, run_side(ref, rng, {(0, 2): tie, (1, 4): far[4]}),
                                 "bfloat16", all_rows=True))
    record = next(r for r in report.keys if r.key == "layer1_topk")
    assert report.exit_status == 0 and record.routing.after_near_tie_rows == [4]
    # Token 1 comes before token 2, which it does not attend to: its far flip is a divergence.
    logits = by_key["layer1_router"].array[1].astype(np.float64)
    far[1] = by_key["layer1_topk"].array[1].copy()
    far[1][0] = int(np.argmin(logits))
    assert gap_of(logits, by_key["layer1_topk"].array[1], far[1]) > epsilon_of(logits)
    report = compare(*write_pair(tmp_path / "d", ref, run_side(ref, rng, {(0, 2): tie, (1, 1): far[1]}),
                                 "bfloat16", all_rows=True))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_topk"
    assert report.first_divergence.routing.far_rows == [1]
    # In the fp32 class nothing is excused.
    report = compare(*write_pair(tmp_path / "c", ref, run_side(ref, rng, {(0, 2): tie}), "float32", all_rows=True))
    assert report.exit_status == 1 and report.first_divergence.key == "layer0_topk"


def test_float_keys_after_a_near_tie_are_not_judged_at_that_token_only(tmp_path):
    """All rows: token 2's later values are not judged after its near tie; token 4's are."""
    rng = np.random.default_rng(10)
    ref = with_near_tie(moe_captures(rng, all_rows=True), layer=0, row=2, gap=0.002, all_rows=True)
    ref = [factory.replace(c, array=np.tile(c.array, (TOKENS, 1)) * rng.uniform(0.5, 1.5, (TOKENS, 1)).astype(
        np.float32)) if c.kind == "record" and not c.key.endswith("_router") and c.tag.startswith("layer") else c
        for c in ref]
    _, _, tie = swap_runner_up(ref, 0, 2, all_rows=True)

    def off(rows):
        run = run_side(ref, rng, {(0, 2): tie})
        out = []
        for capture in run:
            array = capture.array.copy()
            if capture.key in ("layer0_mlp", "layer1", "layer2"):
                array[rows] *= 1.5
            out.append(factory.replace(capture, array=array))
        return out

    def pair_all_rows(path, run):
        keys = {c.key for c in ref if c.kind == "record" and c.tag.startswith("layer")}
        return factory.write_pair(path, ref, run, "float32", "bfloat16",
                                  key_fields={key: {"rows": "all"} for key in keys})

    report = compare(*pair_all_rows(tmp_path / "a", off([2])))
    by_key = {r.key: r for r in report.keys}
    assert report.exit_status == 0
    for key in ("layer0_mlp", "layer1", "layer2"):
        assert (by_key[key].status, by_key[key].excused_rows, by_key[key].excused_by) == (
            "after_near_tie", [2], ["layer0_topk"])
    assert by_key["layer0"].excused_rows is None  # nothing crossed there
    report = compare(*pair_all_rows(tmp_path / "b", off([2, 4])))
    first = report.first_divergence
    assert report.exit_status == 1 and (first.key, first.divergent_rows) == ("layer0_mlp", [4])
    assert report.root_cause.key == "layer0_topk" and report.root_cause.routing_verdict == "near_tie"


def test_the_same_experts_in_another_order_are_no_routing_flip(tmp_path):
    """A row whose run lists the reference's experts in another order computes the same weighted
    sum: in a low-precision class it is no divergence however far apart their scores are, with
    or without logits to judge it, and it reaches nothing after it; in fp32 neither (an fp32
    engine whose fused top-k sorts its output), where another expert is a divergence."""
    rng = np.random.default_rng(13)
    for all_rows in (True, False):
        ref = moe_captures(np.random.default_rng(12), all_rows=all_rows)
        ids = next(c for c in ref if c.key == "layer0_topk").array[3]
        logits = moe_captures(np.random.default_rng(12), all_rows=True)[1].array[3].astype(np.float64)
        assert logits[ids[0]] - logits[ids[1]] > epsilon_of(logits)  # the new order contradicts the scores, far from a tie
        reordered = {(0, 3): ids[::-1].copy()}
        report = compare(*write_pair(tmp_path / f"bf16_{all_rows}", ref, run_side(ref, rng, reordered), "bfloat16",
                                     all_rows=all_rows))
        record = next(r for r in report.keys if r.key == "layer0_topk")
        assert record.ids_differ and record.routing.reordered_rows == [3] and record.routing.verdict == "near_tie"
        assert report.exit_status == 0 and not any(r.excused_rows for r in report.keys)
        assert "row 3: the same experts in another order" in describe_routing(record.routing)
        assert "layer0_topk (same experts, reordered)" in format_report(report)[-1]
        # Nothing after it is excused: a bug from layer 1 on diverges.
        report = compare(*write_pair(tmp_path / f"bug_{all_rows}", ref, run_side(ref, rng, reordered, large_from_layer=1),
                                     "bfloat16", all_rows=all_rows))
        assert report.exit_status == 1 and report.first_divergence.layer == 1
    strict = compare(*write_pair(tmp_path / "fp32", ref, run_side(ref, rng, reordered), "float32", all_rows=False))
    record = next(r for r in strict.keys if r.key == "layer0_topk")
    assert strict.exit_status == 0 and record.ids_differ and record.routing.reorder_only
    assert "layer0_topk (same experts, reordered)" in format_report(strict)[-1]
    other = {(0, 3): np.array([ids[0], next(e for e in range(EXPERTS) if e not in ids)])}  # another expert
    strict = compare(*write_pair(tmp_path / "fp32_other", ref, run_side(ref, rng, other), "float32", all_rows=False))
    assert strict.exit_status == 1 and strict.first_divergence.key == "layer0_topk"
    assert "each token's experts must match" in "\n".join(format_report(strict))


def _with_router_noise(run: list, layer: int, rows: list[int], size: float) -> list:
    """RUN with ``layer``'s router logit of expert 0 off by ``size`` in ``rows``."""
    out = []
    for capture in run:
        if capture.key == f"layer{layer}_router":
            array = capture.array.copy()
            array[rows, 0] += np.float32(size)
            capture = factory.replace(capture, array=array)
        out.append(capture)
    return out


@pytest.mark.parametrize("noise_over_gap,near", [(0.6, True), (0.4, False)])
def test_the_runs_router_noise_widens_epsilon(tmp_path, noise_over_gap, near):
    """All rows: a swap 3 x the ulps epsilon from a tie is a near tie when the run's router logits
    are off by more than half of it in the layer's other rows (two logits that far off can swap
    it), and a divergence when they are not; --near-tie EPS keeps its epsilon."""
    rng = np.random.default_rng(14)
    base = moe_captures(rng, all_rows=True)
    logits = next(c for c in base if c.key == "layer0_router").array[2].astype(np.float64)
    gap = 3 * epsilon_of(logits)
    ref = with_near_tie(base, layer=0, row=2, gap=gap, all_rows=True)
    _, _, swapped = swap_runner_up(ref, 0, 2, all_rows=True)
    noise = noise_over_gap * gap
    run = _with_router_noise(run_side(ref, rng, {(0, 2): swapped}), 0, [4], noise)
    report = compare(*write_pair(tmp_path / "a", ref, run, "bfloat16", all_rows=True))
    record = next(r for r in report.keys if r.key == "layer0_topk")
    (row,) = record.routing.rows
    assert row.gap == pytest.approx(gap, rel=1e-3) and row.gap > epsilon_of(logits)
    assert record.routing.logit_noise == pytest.approx(noise, rel=1e-2)
    assert row.epsilon == pytest.approx(max(epsilon_of(logits), 2 * noise), rel=1e-2)
    assert record.routing.verdict == ("near_tie" if near else "divergence")
    assert report.exit_status == (0 if near else 1)
    fixed = compare(*write_pair(tmp_path / "b", ref, run, "bfloat16", all_rows=True),
                    CompareOptions(near_tie=epsilon_of(logits)))
    assert fixed.exit_status == 1 and fixed.id_mismatches[0].routing.logit_noise is None


def test_router_noise_is_measured_where_no_flip_reaches(tmp_path):
    """Layer 0's near tie in token 1 reaches tokens 1-5 of layer 1, whose router logits then differ
    by far more than rounding: that is not the run's noise. Layer 1's swap in token 0, 3 x the
    ulps epsilon from a tie, is judged by the ulps epsilon and diverges."""
    rng = np.random.default_rng(15)
    ref = with_near_tie(moe_captures(rng, all_rows=True), layer=0, row=1, gap=0.002, all_rows=True)
    logits = next(c for c in ref if c.key == "layer1_router").array[0].astype(np.float64)
    ref = with_near_tie(ref, layer=1, row=0, gap=3 * epsilon_of(logits), all_rows=True)
    _, _, tie = swap_runner_up(ref, 0, 1, all_rows=True)
    _, _, far = swap_runner_up(ref, 1, 0, all_rows=True)
    run = _with_router_noise(run_side(ref, rng, {(0, 1): tie, (1, 0): far}), 1, [1, 2, 3, 4, 5], 0.5)
    report = compare(*write_pair(tmp_path, ref, run, "bfloat16", all_rows=True))
    record = next(r for r in report.keys if r.key == "layer1_topk")
    assert record.routing.far_rows == [0] and record.routing.logit_noise is None
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_topk"


def test_reach_matches_its_definition_on_random_flips():
    """RoutingFlips.reach against the rule written out plainly: a flip of token t in layer L
    reaches token t at any later key, and every token after t at keys of later layers (or keys
    without a layer, or after an ids key without one); a near tie wins over an unjudged flip,
    else the earliest token's flip."""
    from compiledump.compare.flips import Flip, RoutingFlips

    rng = np.random.default_rng(16)
    for _ in range(300):
        flips, added = RoutingFlips(), {}
        for row in rng.choice(40, size=rng.integers(1, 8), replace=False).tolist():
            layer = None if rng.random() < 0.1 else int(rng.integers(0, 5))
            flip = Flip(f"layer{layer}_topk row {row}", layer, near_tie=bool(rng.random() < 0.5))  # one per row
            flips.add(row, flip)
            added[row] = flip
        layer = None if rng.random() < 0.1 else int(rng.integers(0, 6))
        rows = range(40)
        expected = {}
        for row in rows:
            found = [flip for tied, flip in sorted(added.items())
                     if row == tied or (row > tied and (layer is None or flip.layer is None or layer > flip.layer))]
            if found:
                expected[row] = next((flip for flip in found if flip.near_tie), found[0])
        assert flips.reach(rows, layer) == expected


def test_ids_an_unjudged_flip_reaches_are_a_note_and_reorders_stay_reorders(tmp_path):
    """One row: layer 0's flip in token 1 has no reference logits; layer 1's ids then differ in
    token 3 (reached: a consequence, listed as a note, not a second problem) and list token 2's
    experts in another order (reached too, but still no routing flip)."""
    rng = np.random.default_rng(17)
    ref = moe_captures(rng, all_rows=False)
    ids0 = next(c for c in ref if c.key == "layer0_topk").array
    ids1 = next(c for c in ref if c.key == "layer1_topk").array
    other = lambda row: next(e for e in range(EXPERTS) if e not in row)  # noqa: E731
    run = run_side(ref, rng, {(0, 1): np.array([ids0[1][0], other(ids0[1])], np.int32),
                              (1, 3): np.array([other(ids1[3]), ids1[3][1]], np.int32),
                              (1, 2): ids1[2][::-1].copy()})
    report = compare(*write_pair(tmp_path, ref, run, "bfloat16", all_rows=False))
    assert report.exit_status == 3 and report.first_divergence is None
    assert [problem.key for problem in report.problems] == ["layer0_topk"]
    layer1 = next(r for r in report.keys if r.key == "layer1_topk").routing
    assert layer1.after_unjudged_rows == [3] and layer1.reordered_rows == [2] and layer1.verdict == "not_judged"
    assert any(note.startswith("layer1_topk: expert ids differ in 2/6 rows: row 2: the same experts in another "
                               "order; row 3 at or after a token whose expert ids differ at layer0_topk")
               for note in report.pairs[0].notes)


def test_a_reorder_needs_exactly_the_same_experts():
    """Overlap k/k alone is not a reorder when one side repeats an expert: REF [3, 3] against RUN
    [3, 5] brings in expert 5 (the reference ids, not a plain top-k, cannot be judged by logits)."""
    from compiledump.compare.routing import judge_routing

    ref = np.array([[3, 3], [1, 2]], np.int32)
    for run, reordered in ((np.array([[3, 5], [1, 2]], np.int32), []), (np.array([[3, 3], [2, 1]], np.int32), [1])):
        routing = judge_routing(ref, run, None, None, False, "bf16", "pair", None, 4.0)
        assert routing.reordered_rows == reordered
        assert routing.reorder_only == (reordered == routing.differing_rows)


@pytest.mark.parametrize("flip_row, diverges_at, near, named", [(5, 2, True, False), (5, 2, False, False),
                                                                 (5, 6, False, True), (1, 2, False, True)])
def test_a_flip_is_a_root_cause_only_for_tokens_it_can_reach(tmp_path, flip_row, diverges_at, near, named):
    """All rows recorded, bf16: a flip at one token of layer 0 (a near tie, or far from one), a far
    error at one token of layer 1's output. A flip can reach its own token and, through causal
    attention, later ones, never an earlier token: it is named as the likely root cause only when
    it is at or before the divergent token (an audit on Gemma 4 found a near tie at token 5 named
    for a divergence at token 3). A near tie at or before the token would excuse it instead."""
    rng = np.random.default_rng(31 + flip_row + diverges_at)
    logits = rng.standard_normal((TOKENS + 2, EXPERTS)).astype(np.float32)
    order = np.argsort(-logits[flip_row].astype(np.float64))
    if near:  # the k-th expert and the runner-up within a thousandth
        logits[flip_row, order[TOPK]] = logits[flip_row, order[TOPK - 1]] - 1e-3
    ids = np.stack([top_k(row.astype(np.float64)) for row in logits])
    hidden = rng.standard_normal((TOKENS + 2, DIM)).astype(np.float32)
    ref = [factory.Capture("layer0_router", logits, "record", "layer0_router"),
           factory.Capture("layer0_topk", ids, "ids", "layer0_topk"),
           factory.Capture("layer1", hidden, "record", "layer1")]
    run_ids = ids.copy()
    run_ids[flip_row, TOPK - 1] = order[TOPK] if near else order[-1]  # the runner-up, or the last expert
    run_hidden = hidden.copy()
    run_hidden[diverges_at] *= 1.5
    run = [ref[0], factory.Capture("layer0_topk", run_ids, "ids", "layer0_topk"),
           factory.Capture("layer1", run_hidden, "record", "layer1")]
    fields = {"layer0_router": {"rows": "all"}, "layer1": {"rows": "all"}}
    report = compare(*factory.write_pair(tmp_path, ref, run, "float32", "bfloat16", key_fields=fields))
    record = next(r for r in report.keys if r.key == "layer0_topk")
    assert (record.routing.near_tie_rows, record.routing.far_rows) == (([flip_row], []) if near else ([], [flip_row]))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1"
    assert report.first_divergence.divergent_rows == [diverges_at]
    assert (report.root_cause is not None and report.root_cause.key == "layer0_topk") == named
    assert ("likely root cause: layer0_topk" in format_report(report)[-1]) == named
