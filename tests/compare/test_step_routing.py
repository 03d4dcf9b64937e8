"""Routing flips of decode steps (docs/compare.md, "Expert ids and near ties", rule 6): each step
records the routing of its token (`layer<N>_step_router_<n>`, `layer<N>_step_topk_<n>`: the
ids stored as float32 with an integer source dtype, as the runtime stores `record_step` of an
integer tensor). A near tie there reaches that step's later keys and no other step; a flip far
from a tie diverges; fp32 judges strictly; a step's router logits are shown, not judged.

Dumps are built here (random data); every gap, epsilon and verdict expected is computed in this
file from the definitions, independently of compiledump.compare.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from helpers import dumpfactory as factory
from compiledump.compare import compare, format_report

EXPERTS, TOPK, DIM, VOCAB, LAYERS, STEPS = 8, 2, 32, 50, 3, 3


def epsilon_of(logits: np.ndarray, ulps: float = 4.0) -> float:
    """ulps bf16 spacings (8-bit significand) of the largest absolute logit."""
    top = float(np.max(np.abs(logits)))
    return ulps * 2.0 ** (math.floor(math.log2(top)) - 7)


def top_k(logits: np.ndarray) -> np.ndarray:
    return np.argsort(-logits.astype(np.float64), kind="stable")[:TOPK]


def step_captures(rng: np.random.Generator, prefill_router_rows: int = 0) -> list[factory.Capture]:
    """Decode steps of a 3-layer MoE as instrument records them: per step and layer the step
    token's router logits, its top-k ids (float32 values) and the layer output, then the logits.
    With ``prefill_router_rows``, a prefill first: every row's router logits and ids per layer."""
    captures = []
    for layer in range(LAYERS if prefill_router_rows else 0):
        logits = rng.standard_normal((prefill_router_rows, EXPERTS)).astype(np.float32)
        captures += [factory.Capture(f"layer{layer}_router", logits, "record", f"layer{layer}_router"),
                     factory.Capture(f"layer{layer}_topk", np.stack([top_k(row) for row in logits]).astype(np.int32),
                                     "ids", f"layer{layer}_topk")]
    for step in range(STEPS):
        for layer in range(LAYERS):
            logits = rng.standard_normal(EXPERTS).astype(np.float32)
            captures += [
                factory.Capture(f"layer{layer}_step_router_{step}", logits, "step", f"layer{layer}_step_router", step),
                factory.Capture(f"layer{layer}_step_topk_{step}", top_k(logits).astype(np.float32), "step",
                                f"layer{layer}_step_topk", step),
                factory.Capture(f"layer{layer}_out_{step}", rng.standard_normal(DIM).astype(np.float32), "step",
                                f"layer{layer}_out", step),
            ]
        logits = rng.standard_normal(VOCAB).astype(np.float32)
        logits[step] += 6.0  # a confident reference: an argmax flip is no near tie
        captures.append(factory.Capture(f"logits_{step}", logits, "step", "logits", step))
    return captures


def with_tie(ref: list, layer: int, step: int, gap: float) -> tuple[list, np.ndarray]:
    """REF with the k-th and (k+1)-th logits of that step's router ``gap`` apart (its ids
    recomputed); and the RUN ids that swap them."""
    out = [factory.replace(c, array=c.array.copy()) for c in ref]
    by_key = {c.key: c for c in out}
    logits = by_key[f"layer{layer}_step_router_{step}"].array
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    logits[order[TOPK]] = logits[order[TOPK - 1]] - np.float32(gap)
    ids = top_k(logits)
    by_key[f"layer{layer}_step_topk_{step}"].array[:] = ids
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    swapped = ids.copy()
    swapped[list(ids).index(order[TOPK - 1])] = order[TOPK]
    return out, swapped.astype(np.float32)


def run_side(ref: list, rng: np.random.Generator, ids: dict[str, np.ndarray], large: set[str] = frozenset(),
             noise: float = 1e-5) -> list:
    """RUN: floats with relative noise ``noise`` (unrelated values for the keys in ``large``: far
    beyond any threshold), ids replaced."""
    out = []
    for capture in ref:
        array = capture.array.copy()
        if capture.key in ids:
            array = ids[capture.key]
        elif capture.key in large:
            array = rng.standard_normal(array.shape).astype(np.float32)
        elif capture.kind != "ids" and "topk" not in capture.key:
            array = (array + rng.standard_normal(array.shape) * noise * np.abs(array).mean()).astype(np.float32)
        out.append(factory.replace(capture, array=array))
    return out


def write(tmp_path, ref: list, run: list, dtype: str, all_rows: bool = False):
    """REF (float32) and RUN (``dtype``), each with the manifest the runtime writes: step ids
    with an integer source dtype, prefill router logits of every row with ``all_rows``."""
    paths = []
    for side, captures, source in (("ref", ref, "float32"), ("run", run, dtype)):
        keys = {c.key for c in captures}
        fields = {key: {"source_dtype": "int64"} for key in keys if "_step_topk_" in key}
        if all_rows:
            fields.update({f"layer{layer}_router": {"rows": "all"} for layer in range(LAYERS)
                           if f"layer{layer}_router" in keys})
        manifest = factory.manifest_for(captures, source_dtype=source, key_fields=fields)
        paths.append(factory.write_compiledump(tmp_path / side, captures, manifest=manifest))
    return paths[0], paths[1]


def gap_of(logits: np.ndarray, ref_row: np.ndarray, run_row: np.ndarray) -> float:
    displaced = [int(i) for i in ref_row if i not in set(run_row.tolist())]
    instead = [int(i) for i in run_row if i not in set(ref_row.tolist())]
    return float(max(logits[displaced].astype(np.float64)) - min(logits[instead].astype(np.float64)))


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
