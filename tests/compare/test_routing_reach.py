"""How far an expert-id flip reaches (docs/compare.md, "Expert ids and near ties"): a flip at a
token reaches that token at later keys and later tokens at later layers, never earlier tokens;
what it reaches is not judged again and is named as a root cause only there; the same experts
in another order are no flip; the run's own router noise widens the near-tie epsilon.

Dumps are built with numpy (tests/helpers/routing_dumps.py); every expected gap, epsilon and
verdict is computed from the definitions, independently of compiledump.compare.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import dumpfactory as factory
from compiledump.compare import CompareOptions, compare, format_report
from compiledump.compare.routing import describe_routing

from helpers.routing_dumps import (DIM, EXPERTS, TOKENS, TOPK, epsilon_of, gap_of, moe_captures, run_side,
                                    swap_runner_up, top_k, with_near_tie, write_pair)


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


@pytest.mark.parametrize("capacity", [False, True])
def test_a_capacity_router_s_flip_reaches_the_later_tokens_that_share_its_experts(tmp_path, capacity):
    """A router that caps each expert's tokens (Switch Transformers; declared `capacity`) drops or
    spares later tokens of the sequence when a near tie sends a token elsewhere, those routed to an
    expert it left or took: their MoE output in the same layer differs (a dropped token's is zero).
    With the declaration that difference is the near tie's (exit 0, `after_near_tie`); without it,
    or at a later token of other experts, or at an earlier token, the MoE output diverges (exit 1)."""
    rng = np.random.default_rng(21)
    ref = with_near_tie(moe_captures(rng, all_rows=True), layer=0, row=2, gap=0.002, all_rows=True)
    ref = [factory.replace(c, array=rng.standard_normal((TOKENS, DIM)).astype(np.float32))
           if c.key == "layer0_mlp" else c for c in ref]
    _, ids2, tie = swap_runner_up(ref, 0, 2, all_rows=True)
    moved = sorted(set(tie.tolist()) ^ set(ids2.tolist()))  # the expert token 2 left and the one it took
    by_key = {c.key: c for c in ref}
    logits, ids = by_key["layer0_router"].array, by_key["layer0_topk"].array
    logits[4, moved[0]] = logits[4].max() + 1.0  # token 4 goes to one of them
    logits[5, moved] = logits[5].min() - 1.0  # token 5 to neither
    for row in (4, 5):
        ids[row] = top_k(logits[row].astype(np.float64))
    run = run_side(ref, rng, {(0, 2): tie})
    fields = {f"layer{layer}_router": {"rows": "all"} for layer in range(3)} | {"layer0_mlp": {"rows": "all"}}
    routers = {"layer0_router": {"top_k": TOPK, "score": "softmax", **({"capacity": True} if capacity else {})}}

    def verdict(dropped_row: int):
        moved_run = [factory.replace(c, array=c.array.copy()) for c in run]
        next(c for c in moved_run if c.key == "layer0_mlp").array[dropped_row] = 0.0  # dropped on RUN only
        manifests = []
        for captures, dtype in ((ref, "float32"), (moved_run, "bfloat16")):
            manifest = factory.manifest_for(captures, source_dtype=dtype, key_fields=fields)
            manifest["routers"] = routers
            manifests.append(manifest)
        directory = tmp_path / f"drop{dropped_row}"
        return compare(*factory.write_pair(directory, ref, moved_run, ref_manifest=manifests[0],
                                           run_manifest=manifests[1]))
    report = verdict(dropped_row=4)
    record = next(r for r in report.keys if r.key == "layer0_mlp")
    if capacity:
        assert report.exit_status == 0 and record.status == "after_near_tie" and record.excused_rows == [4], \
            format_report(report)[-1]
        assert next(r for r in report.keys if r.key == "layer0_topk").routing.to_json()["capacity"] is True
    else:
        assert report.exit_status == 1 and report.first_divergence.key == "layer0_mlp"
    for other in (5, 1):  # a later token of other experts; an earlier token
        report = verdict(dropped_row=other)
        assert report.exit_status == 1 and report.first_divergence.key == "layer0_mlp", other
