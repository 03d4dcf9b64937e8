"""Routing flips of decode steps (docs/compare.md, "Expert ids and near ties", rule 6): each step
records the routing of its token (`layer<N>_step_router_<n>`, `layer<N>_step_topk_<n>`: the
ids stored as float32 with an integer source dtype, as the runtime stores `record_step` of an
integer tensor). A near tie there reaches that step's later keys and no other step; a flip far
from a tie diverges; fp32 judges strictly. A step's router logits (shown, not judged):
test_step_router_logits.py.

Dumps are built with tests/helpers/step_routing_dumps.py (random data); every gap, epsilon and
verdict expected is computed from the definitions, independently of compiledump.compare.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import dumpfactory as factory
from helpers.step_routing_dumps import LAYERS, TOPK, epsilon_of, gap_of, run_side, step_captures, top_k, with_tie, write
from compiledump.compare import compare, format_report


def test_a_near_tie_at_a_step_excuses_that_steps_later_keys_only(tmp_path):
    rng = np.random.default_rng(3)
    ref, swapped = with_tie(step_captures(rng), layer=1, step=1, gap=0.002)
    logits = {c.key: c.array for c in ref}["layer1_step_router_1"]
    assert gap_of(logits, {c.key: c.array for c in ref}["layer1_step_topk_1"], swapped) < epsilon_of(logits)
    # The flipped token's later layers and logits differ far beyond the decode-step thresholds.
    after = {"layer1_out_1", "layer2_out_1", "logits_1", "layer2_step_router_1"}
    report = compare(*write(tmp_path / "a", ref, run_side(ref, rng, {"layer1_step_topk_1": swapped}, after),
                            "bfloat16"))
    keys = {record.key: record for record in report.keys}
    assert report.exit_status == 0, "\n".join(format_report(report))
    assert keys["layer1_step_topk_1"].status == "near_tie"
    for key in ("layer1_out_1", "layer2_out_1", "logits_1"):
        assert keys[key].status == "after_near_tie" and keys[key].excused_by == ["layer1_step_topk_1"], key
    assert keys["layer0_out_1"].status == "ok"  # before the flip's layer
    assert keys["layer2_step_router_1"].status == "shown" and not keys["layer2_step_router_1"].divergent
    flip = report.first_argmax_flip  # RUN's logits_1 are unrelated values: its argmax differs
    assert flip.step == 1 and flip.kind == "after-routing-flip" and flip.margin_ref > flip.epsilon
    # The same crossing in another step is judged: the flip does not reach it.
    report = compare(*write(tmp_path / "b", ref, run_side(ref, rng, {"layer1_step_topk_1": swapped},
                                                          after | {"logits_2"}), "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "logits_2"
    # Nor does it reach keys before it in its own step.
    report = compare(*write(tmp_path / "c", ref, run_side(ref, rng, {"layer1_step_topk_1": swapped},
                                                          after | {"layer0_out_1"}), "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer0_out_1"


def test_a_step_flip_far_from_a_tie_diverges_and_fp32_judges_strictly(tmp_path):
    rng = np.random.default_rng(4)
    ref = step_captures(rng)
    by_key = {c.key: c.array for c in ref}
    logits = by_key["layer0_step_router_2"].astype(np.float64)
    far = by_key["layer0_step_topk_2"].copy()
    far[1] = float(np.argmin(logits))  # the lowest-scored expert
    assert gap_of(logits, by_key["layer0_step_topk_2"], far) > epsilon_of(logits)
    report = compare(*write(tmp_path / "a", ref, run_side(ref, rng, {"layer0_step_topk_2": far}, {"logits_2"}),
                            "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "logits_2"
    assert report.root_cause is not None and report.root_cause.key == "layer0_step_topk_2"
    # Alone, the far flip is the divergence.
    report = compare(*write(tmp_path / "b", ref, run_side(ref, rng, {"layer0_step_topk_2": far}), "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer0_step_topk_2"
    # fp32: a near tie is a mismatch too, and nothing after it is excused.
    ref, swapped = with_tie(ref, layer=0, step=0, gap=1e-6)
    report = compare(*write(tmp_path / "c", ref, run_side(ref, rng, {"layer0_step_topk_0": swapped}), "float32"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer0_step_topk_0"
    assert {record.key: record for record in report.keys}["layer0_step_topk_0"].status == "mismatch"


@pytest.mark.parametrize("prefill_noise", [True, False])
def test_a_steps_epsilon_takes_the_prefill_router_noise_of_its_layer(tmp_path, prefill_noise):
    """All-rows prefill: layer 0's router logits of RUN are off by up to ``noise`` in the rows
    whose ids agree, and one row flips there (so the prefill measures the noise). A step's swap
    with a gap between the 4-ulp epsilon and twice that noise is a near tie only with it."""
    rng = np.random.default_rng(6)
    ref = step_captures(rng, prefill_router_rows=5)
    ref, swapped = with_tie(ref, layer=0, step=1, gap=1.5 * epsilon_of({c.key: c for c in ref}["layer0_step_router_1"].array))
    by_key = {c.key: c for c in ref}
    eps = epsilon_of(by_key["layer0_step_router_1"].array)
    assert eps < gap_of(by_key["layer0_step_router_1"].array, by_key["layer0_step_topk_1"].array, swapped) < 2 * eps
    prefill = by_key["layer0_router"].array
    run = run_side(ref, rng, {"layer0_step_topk_1": swapped})
    run_by_key = {c.key: c for c in run}
    if prefill_noise:
        noisy = prefill.copy()
        noisy[1:] += np.float32(eps)  # an error of eps in every row but row 0: the noise is eps
        run_by_key["layer0_router"].array[:] = noisy
        # Row 0 flips in the prefill (far: a bug would be one; here it is reordered only).
        run_by_key["layer0_topk"].array[0] = by_key["layer0_topk"].array[0][::-1]
    report = compare(*write(tmp_path, ref, run, "bfloat16", all_rows=True))
    record = {record.key: record for record in report.keys}["layer0_step_topk_1"]
    if prefill_noise:
        assert record.status == "near_tie" and record.routing.logit_noise == pytest.approx(eps, rel=1e-3)
        assert report.exit_status == 0
    else:
        assert record.status == "mismatch" and report.exit_status == 1


def _far(ref: list, layer: int, step: int) -> np.ndarray:
    """RUN ids of that step and layer with REF's second expert replaced by the lowest-scored one."""
    by_key = {c.key: c.array for c in ref}
    logits = by_key[f"layer{layer}_step_router_{step}"].astype(np.float64)
    ids = by_key[f"layer{layer}_step_topk_{step}"]
    far = ids.copy()
    far[1] = float(np.argmin(logits))
    assert gap_of(logits, ids, far) > 2 * epsilon_of(logits)
    return far


def test_a_steps_ids_an_earlier_tokens_flip_reaches_are_not_judged(tmp_path):
    """Step 2 attends to step 0's token: after a near tie there in layer 0, step 2's routing of
    layer 1 may differ far from any tie (a consequence); of layer 0 it may not (nothing before
    layer 0 reaches it). A prefill flip reaches every step the same way."""
    rng = np.random.default_rng(7)
    ref, swapped = with_tie(step_captures(rng, prefill_router_rows=5), layer=0, step=0, gap=0.001)
    far1, far0 = _far(ref, 1, 2), _far(ref, 0, 2)
    report = compare(*write(tmp_path / "a", ref, run_side(ref, rng, {"layer0_step_topk_0": swapped,
                                                                     "layer1_step_topk_2": far1}), "bfloat16"))
    record = {record.key: record for record in report.keys}["layer1_step_topk_2"]
    assert record.status == "near_tie" and record.routing.rows[0].after_near_tie == "layer0_step_topk_0"
    assert record.routing.far_rows == [] and report.exit_status == 0
    report = compare(*write(tmp_path / "b", ref, run_side(ref, rng, {"layer0_step_topk_0": swapped,
                                                                     "layer0_step_topk_2": far0}), "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer0_step_topk_2"
    # Without the flip at step 0, step 2's far routing of layer 1 is a divergence.
    report = compare(*write(tmp_path / "c", ref, run_side(ref, rng, {"layer1_step_topk_2": far1}), "bfloat16"))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_step_topk_2"
    # A near tie in a prompt row of layer 0 (all rows) reaches it too.
    by_key = {c.key: c.array for c in ref}
    prompt_logits = by_key["layer0_router"]
    order = np.argsort(-prompt_logits[3].astype(np.float64), kind="stable")
    tied = [factory.replace(c, array=c.array.copy()) for c in ref]
    tied_by_key = {c.key: c.array for c in tied}
    tied_by_key["layer0_router"][3, order[TOPK]] = prompt_logits[3, order[TOPK - 1]] - np.float32(0.001)
    tied_by_key["layer0_topk"][3] = top_k(tied_by_key["layer0_router"][3])
    prompt_ids = tied_by_key["layer0_topk"].copy()
    row = prompt_ids[3].tolist()
    row[row.index(order[TOPK - 1])] = order[TOPK]
    prompt_ids[3] = row
    report = compare(*write(tmp_path / "d", tied, run_side(tied, rng, {"layer0_topk": prompt_ids,
                                                                       "layer1_step_topk_2": far1}),
                            "bfloat16", all_rows=True))
    record = {record.key: record for record in report.keys}["layer1_step_topk_2"]
    assert record.routing.rows[0].after_near_tie == "layer0_topk" and report.exit_status == 0


@pytest.mark.parametrize("disturbed", [False, True])
def test_a_steps_epsilon_takes_the_router_noise_of_undisturbed_steps(tmp_path, disturbed):
    """RUN's router logits of layer 1 are off by ``delta`` at step 2, whose ids agree. A swap at
    step 0 in layer 1 with a gap between the 4-ulp epsilon and 2 x delta is a near tie by that
    noise, unless step 2's routing of layer 1 may have been disturbed: a flip in layer 0 at step 1
    (a near tie) reaches it, and its error is then no noise sample."""
    rng = np.random.default_rng(8)
    ref = step_captures(rng)
    ref, swapped = with_tie(ref, layer=1, step=0,
                            gap=1.5 * epsilon_of({c.key: c.array for c in ref}["layer1_step_router_0"]))
    ref, tie1 = with_tie(ref, layer=0, step=1, gap=0.001)
    by_key = {c.key: c.array for c in ref}
    eps = epsilon_of(by_key["layer1_step_router_0"])
    assert eps < gap_of(by_key["layer1_step_router_0"], by_key["layer1_step_topk_0"], swapped) < 2 * eps
    ids = {"layer1_step_topk_0": swapped}
    if disturbed:
        ids["layer0_step_topk_1"] = tie1
    run = run_side(ref, rng, ids)
    noisy = {c.key: c for c in run}["layer1_step_router_2"].array
    noisy += np.float32(eps)  # every logit off by eps: the ids (top-k) stay the same
    np.testing.assert_array_equal(top_k(noisy), by_key["layer1_step_topk_2"])
    report = compare(*write(tmp_path, ref, run, "bfloat16"))
    record = {record.key: record for record in report.keys}["layer1_step_topk_0"]
    if disturbed:
        assert record.status == "mismatch" and report.exit_status == 1
    else:
        assert record.status == "near_tie" and record.routing.logit_noise == pytest.approx(eps, rel=1e-3)
        assert report.exit_status == 0


def test_a_step_is_the_token_after_the_prompt_not_the_prompt_row_of_its_number(tmp_path):
    """A near tie in prompt row 1 reaches step 1's later layers through attention (its ids), but
    is not step 1's token: step 1's logits far off are judged (exit 1). A step's ids that an
    earlier token's near tie reaches and that do differ are its own token's flip: its logits are
    then not judged."""
    rng = np.random.default_rng(9)
    ref = step_captures(rng, prefill_router_rows=4)
    by_key = {c.key: c.array for c in ref}
    logits = by_key["layer0_router"][1].astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    by_key["layer0_router"][1, order[TOPK]] = by_key["layer0_router"][1, order[TOPK - 1]] - np.float32(0.001)
    by_key["layer0_topk"][1] = top_k(by_key["layer0_router"][1])
    prompt_ids = by_key["layer0_topk"].copy()
    row = prompt_ids[1].tolist()
    row[row.index(order[TOPK - 1])] = order[TOPK]
    prompt_ids[1] = row
    report = compare(*write(tmp_path / "a", ref, run_side(ref, rng, {"layer0_topk": prompt_ids}, {"logits_1"}),
                            "bfloat16", all_rows=True))
    assert report.exit_status == 1 and report.first_divergence.key == "logits_1"
    # Step 1's own ids differ in layer 1, reached by that near tie: its logits are not judged.
    far = _far(ref, 1, 1)
    report = compare(*write(tmp_path / "b", ref, run_side(ref, rng, {"layer0_topk": prompt_ids,
                                                                     "layer1_step_topk_1": far}, {"logits_1"}),
                            "bfloat16", all_rows=True))
    keys = {record.key: record for record in report.keys}
    assert keys["layer1_step_topk_1"].routing.after_near_tie_rows == [0]
    assert keys["logits_1"].status == "after_near_tie" and keys["logits_1"].excused_by == ["layer1_step_topk_1"]
    assert report.exit_status == 0, "\n".join(format_report(report))


def test_step_ids_of_several_rows_are_judged_alone(tmp_path):
    """A hand-written step of [tokens, k] ids is no one token's routing: a near tie in its last
    row (which the step's router logits cover) is taken as no token's flip, in particular not as
    that of the next step's token (row prompt + n + 1), whose logits far off stay a divergence."""
    rng = np.random.default_rng(12)
    ref, swapped = with_tie(step_captures(rng), layer=0, step=1, gap=0.001)
    ids = {c.key: c.array for c in ref}["layer0_step_topk_1"]
    ref = [factory.replace(c, array=np.stack([ids, ids])) if c.key == "layer0_step_topk_1" else c for c in ref]
    report = compare(*write(tmp_path, ref, run_side(ref, rng, {"layer0_step_topk_1": np.stack([ids, swapped])},
                                                    {"logits_1", "logits_2"}), "bfloat16"))
    keys = {record.key: record for record in report.keys}
    assert keys["layer0_step_topk_1"].status == "near_tie"  # judged by the logits of its last row
    assert keys["logits_1"].divergent and keys["logits_2"].divergent and report.exit_status == 1


@pytest.mark.parametrize("instrumented", [True, False])
def test_instrument_s_step_0_is_the_prompt_s_last_token(tmp_path, instrumented):
    """instrument's steps count forwards (its manifests have `mixers`): step 0's logits are the
    prompt's last token's, so a near tie in that token's prompt ids is step 0's own flip, and
    logits_0 far off is not judged, though no step ids say so again (an engine's gates record
    none). Hand-written steps start after the prompt: there logits_0 is judged (exit 1)."""
    rng = np.random.default_rng(4)
    ref = [c for c in step_captures(rng, prefill_router_rows=4) if "_step_" not in c.key]
    by_key = {c.key: c.array for c in ref}
    last = by_key["layer0_router"][3]
    order = np.argsort(-last.astype(np.float64), kind="stable")
    last[order[TOPK]] = last[order[TOPK - 1]] - np.float32(0.001)
    by_key["layer0_topk"][3] = top_k(last)
    prompt_ids = by_key["layer0_topk"].copy()
    row = prompt_ids[3].tolist()
    row[row.index(order[TOPK - 1])] = order[TOPK]
    prompt_ids[3] = row
    ref_path, run_path = write(tmp_path, ref, run_side(ref, rng, {"layer0_topk": prompt_ids}, {"logits_0"}),
                               "bfloat16", all_rows=True)
    if instrumented:
        for path in (ref_path, run_path):
            manifest = path.with_suffix(".json")
            data = json.loads(manifest.read_text())
            manifest.write_text(json.dumps({**data, "mixers": {str(i): "attention" for i in range(LAYERS)}}))
    report = compare(ref_path, run_path)
    keys = {record.key: record for record in report.keys}
    assert keys["layer0_topk"].status == "near_tie"
    if instrumented:
        assert keys["logits_0"].status == "after_near_tie" and keys["logits_0"].excused_by == ["layer0_topk"]
        assert report.exit_status == 0, "\n".join(format_report(report))
    else:
        assert report.exit_status == 1 and report.first_divergence.key == "logits_0"
