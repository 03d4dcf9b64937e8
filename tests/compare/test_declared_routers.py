"""Expert ids of a router that is not a plain top-k, judged by its declared selection (the
manifest's ``routers``; docs/compare.md, "Expert ids and near ties").

DeepSeek-V3's router picks the top-k of sigmoid(logits) + bias inside the best expert groups: its
ids are not the top-k of its logits. Without a declaration the comparator cannot judge a flip of
them (exit 3); with one, a flip within the noise is a near tie (exit 0) and a flip that no small
move of the logits explains is a divergence (exit 1). Dumps are built here with numpy; the
reference router is written out plainly below, and the expected verdicts follow from bounds
computed here, not from compiledump.compare.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from helpers import dumpfactory as factory
from compiledump.compare import compare

EXPERTS, GROUPS, KEPT, TOPK, TOKENS, DIM, LAYERS = 16, 4, 2, 4, 7, 32, 3
SIZE = EXPERTS // GROUPS


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def v3_pick(logits: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's selection of one row, written out: group score = sum of its two best
    scores, keep the best KEPT groups, then the best TOPK experts among them (sorted ids)."""
    scores = sigmoid(logits) + bias
    group_score = {g: sum(sorted(scores[g * SIZE:(g + 1) * SIZE])[-2:]) for g in range(GROUPS)}
    kept = sorted(group_score, key=lambda g: -group_score[g])[:KEPT]
    candidates = [e for e in range(EXPERTS) if e // SIZE in kept]
    return np.array(sorted(sorted(candidates, key=lambda e: -scores[e])[:TOPK]), np.int32)


def epsilon_of(logits: np.ndarray, ulps: float = 4.0) -> float:
    top = float(np.max(np.abs(logits)))
    return ulps * 2.0 ** (math.floor(math.log2(top)) - 7)


def captures(rng, bias: np.ndarray, steps: int = 2) -> list[factory.Capture]:
    """A prefill (every row's router logits and ids, all-rows mode) and decode steps of a 3-layer
    MoE with DeepSeek-V3 routing."""
    out = []
    for layer in range(LAYERS):
        logits = rng.standard_normal((TOKENS, EXPERTS)).astype(np.float32)
        out += [factory.Capture(f"layer{layer}_router", logits, "record", f"layer{layer}_router"),
                factory.Capture(f"layer{layer}_topk", np.stack([v3_pick(row, bias) for row in logits]), "ids",
                                f"layer{layer}_topk"),
                factory.Capture(f"layer{layer}", rng.standard_normal((TOKENS, DIM)).astype(np.float32), "record",
                                f"layer{layer}")]
    for step in range(steps):
        for layer in range(LAYERS):
            logits = rng.standard_normal(EXPERTS).astype(np.float32)
            out += [factory.Capture(f"layer{layer}_step_router_{step}", logits, "step", f"layer{layer}_step_router",
                                    step),
                    factory.Capture(f"layer{layer}_step_topk_{step}", v3_pick(logits, bias).astype(np.float32), "step",
                                    f"layer{layer}_step_topk", step)]
        logits = rng.standard_normal(50).astype(np.float32)
        logits[step] += 6.0
        out.append(factory.Capture(f"logits_{step}", logits, "step", "logits", step))
    return out


def honest_run(ref: list, rng) -> list:
    """RUN: the same values with relative noise 1e-6 (far below any threshold), ids as REF's."""
    return [factory.replace(c, array=c.array.copy() if c.kind == "ids" or "topk" in c.tag else
                            (c.array + rng.standard_normal(c.array.shape) * 1e-6).astype(np.float32)) for c in ref]


def with_tie(logits: np.ndarray, bias: np.ndarray, difference: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """``logits`` (one row) with the best expert the router leaves out of its kept groups moved to
    score ``difference`` below the weakest one it picks, and the run's ids that swap the two."""
    logits = logits.astype(np.float64).copy()
    picked = v3_pick(logits, bias)
    scores = sigmoid(logits) + bias
    weakest = min(picked, key=lambda e: scores[e])
    kept = {e // SIZE for e in picked}
    left_out = [e for e in range(EXPERTS) if e // SIZE in kept and e not in picked]
    for other in sorted(left_out, key=lambda e: -scores[e]):
        target = scores[weakest] - bias[other] - difference
        if 0.05 < target < 0.95:
            logits[other] = math.log(target / (1 - target))
            assert np.array_equal(v3_pick(logits, bias), picked)
            return logits, np.sort(np.array([e for e in picked if e != weakest] + [other], np.int32))
    raise AssertionError("no expert to tie with")


def tie(ref: list, run: list, bias: np.ndarray, layer: int, row: int | None = None,
        step: int | None = None) -> np.ndarray:
    """A near tie (``with_tie``) in REF's router logits of ``layer`` (prefill row ``row``, or
    decode step ``step``), on both sides, and RUN's ids that swap it; returns the tied logits."""
    name = f"layer{layer}_router" if step is None else f"layer{layer}_step_router_{step}"
    ids_name = f"layer{layer}_topk" if step is None else f"layer{layer}_step_topk_{step}"
    at = row if step is None else slice(None)
    ref_by_key, run_by_key = {c.key: c for c in ref}, {c.key: c for c in run}
    logits, flipped = with_tie(ref_by_key[name].array[at], bias.astype(np.float64))
    for side in (ref_by_key, run_by_key):
        side[name].array[at] = logits
    run_by_key[ids_name].array[at] = flipped
    return logits


def write(tmp_path, ref, run, bias, declared: bool, name: str = "pair"):
    manifest_fields = {f"layer{layer}_router": {"rows": "all"} for layer in range(LAYERS)}
    manifests = []
    for side in (ref, run):
        manifest = factory.manifest_for(side, source_dtype="float32" if side is ref else "bfloat16",
                                        key_fields=manifest_fields)
        for key, entry in manifest["keys"].items():
            if "topk" in key and entry["kind"] == "step":
                entry["source_dtype"] = "int64"  # a step of ids, stored as float32
        if declared and side is ref:
            manifest["routers"] = {f"layer{layer}_router": {"top_k": TOPK, "score": "sigmoid",
                                                            "bias": [float(b) for b in bias], "n_group": GROUPS,
                                                            "topk_group": KEPT, "group_topk": 2}
                                   for layer in range(LAYERS)}
        manifests.append(manifest)
    return factory.write_pair(tmp_path / name, ref, run, ref_manifest=manifests[0], run_manifest=manifests[1])


def record(report, key):
    return next(r for r in report.keys if r.key == key)


@pytest.fixture
def bias():
    return (np.random.default_rng(3).standard_normal(EXPERTS) * 0.05).astype(np.float32)


def test_a_flip_within_the_noise_is_a_near_tie_only_with_the_declaration(tmp_path, bias):
    rng = np.random.default_rng(11)
    ref = captures(rng, bias)
    run = honest_run(ref, rng)
    logits = tie(ref, run, bias, layer=1, row=4)

    report = compare(*write(tmp_path, ref, run, bias, declared=True, name="declared"))
    topk = record(report, "layer1_topk")
    (row,) = topk.routing.rows
    assert topk.status == "near_tie" and row.row == 4 and row.reason is None
    assert 0 < row.gap <= 0.01 < epsilon_of(logits)
    assert report.exit_status == 0

    report = compare(*write(tmp_path, ref, run, bias, declared=False, name="undeclared"))
    (row,) = record(report, "layer1_topk").routing.rows
    assert row.gap is None and "declare_router" in row.reason
    assert report.exit_status == 3


def test_a_flip_into_a_far_group_is_a_divergence(tmp_path, bias):
    """RUN takes an expert of the group with the worst group score: any move that explains it
    lifts that group's score (two sigmoid scores, each moved at most epsilon/4) above the best
    kept group's, so the gap is at least twice the group scores' difference."""
    rng = np.random.default_rng(12)
    ref = captures(rng, bias)
    run = honest_run(ref, rng)
    by_key = {c.key: c for c in run}
    logits = by_key["layer0_router"].array[2].astype(np.float64)
    scores = sigmoid(logits) + bias
    group_score = np.array([np.sort(scores[g * SIZE:(g + 1) * SIZE])[-2:].sum() for g in range(GROUPS)])
    worst = int(np.argmin(group_score))
    ids = by_key["layer0_topk"].array[2].copy()
    ids[-1] = worst * SIZE + int(np.argmax(scores[worst * SIZE:(worst + 1) * SIZE]))
    by_key["layer0_topk"].array[2] = np.sort(ids)
    bound = 2 * (np.sort(group_score)[-KEPT] - group_score[worst])
    assert bound > epsilon_of(logits)

    report = compare(*write(tmp_path, ref, run, bias, declared=True))
    topk = record(report, "layer0_topk")
    (row,) = topk.routing.rows
    assert topk.status == "mismatch" and topk.divergent and row.gap >= bound * (1 - 1e-9)
    assert report.exit_status == 1


def test_a_decode_step_s_ids_follow_their_layer_s_declaration(tmp_path, bias):
    rng = np.random.default_rng(13)
    ref = captures(rng, bias)
    run = honest_run(ref, rng)
    tie(ref, run, bias, layer=2, step=1)
    report = compare(*write(tmp_path, ref, run, bias, declared=True))
    step = record(report, "layer2_step_topk_1")
    assert step.status == "near_tie" and 0 < step.routing.rows[0].gap <= 0.01
    assert report.exit_status == 0


def test_reference_ids_the_declared_router_does_not_select_are_not_judged(tmp_path, bias):
    """A declaration that does not describe the model (here: REF picked without the bias) cannot
    judge: the comparator says so instead of judging by a wrong rule."""
    rng = np.random.default_rng(14)
    ref = captures(rng, np.zeros(EXPERTS, np.float32))
    run = honest_run(ref, rng)
    by_key = {c.key: c for c in run}
    by_key["layer1_topk"].array[3] = np.sort(np.argsort(-by_key["layer1_router"].array[3])[:TOPK])
    assert not np.array_equal(by_key["layer1_topk"].array[3], {c.key: c for c in ref}["layer1_topk"].array[3]) \
        or pytest.skip("the plain top-k equals the grouped one in this row")
    biased = np.where(np.arange(EXPERTS) % 2 == 0, 0.3, -0.3).astype(np.float32)
    report = compare(*write(tmp_path, ref, run, biased, declared=True))
    (row,) = record(report, "layer1_topk").routing.rows
    assert row.gap is None and "not what its declared router (top-4 of sigmoid + bias in the best 2 of 4 groups)" \
        in row.reason and "_topk" in row.reason
    assert report.exit_status == 3


def test_a_declaration_on_the_run_side_is_found_through_map(tmp_path, bias):
    """The engine names its layers `blk<N>` and declares its router; REF (no declaration) is
    compared with `--map ^blk=layer`: the engine's declaration judges the renamed keys."""
    from compiledump.compare import CompareOptions

    rng = np.random.default_rng(15)
    ref = captures(rng, bias, steps=0)
    run = honest_run(ref, rng)
    tie(ref, run, bias, layer=1, row=4)
    run = [factory.replace(c, key="blk" + c.key[5:], tag="blk" + c.tag[5:]) for c in run]
    manifests = [factory.manifest_for(side, source_dtype=dtype, key_fields={
        f"{prefix}{layer}_router": {"rows": "all"} for layer in range(LAYERS)})
        for side, dtype, prefix in ((ref, "float32", "layer"), (run, "bfloat16", "blk"))]
    manifests[1]["routers"] = {f"blk{layer}_router": {"top_k": TOPK, "score": "sigmoid", "bias": [float(b) for b in bias],
                                                      "n_group": GROUPS, "topk_group": KEPT} for layer in range(LAYERS)}
    ref_path, run_path = factory.write_pair(tmp_path, ref, run, ref_manifest=manifests[0], run_manifest=manifests[1])
    report = compare(ref_path, run_path, CompareOptions(maps=[("^blk", "layer")]))
    assert record(report, "layer1_topk").status == "near_tie" and report.exit_status == 0


def test_inspect_shows_the_declared_routers(tmp_path, bias, capsys):
    from compiledump.cli import main

    rng = np.random.default_rng(16)
    ref = captures(rng, bias, steps=0)
    ref_path, _ = write(tmp_path, ref, honest_run(ref, rng), bias, declared=True)
    manifest_path = ref_path.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    manifest["routers"]["layer9_router"] = {"top_k": "two"}
    manifest_path.write_text(json.dumps(manifest))
    assert main(["inspect", str(ref_path)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("routers:")]
    assert line.startswith("routers: 4 declared: layer0_router (top-4 of sigmoid + bias in the best 2 of 4 groups)")
    assert line.endswith("layer9_router (malformed: not used)")
    assert main(["inspect", str(ref_path), "--json", str(tmp_path / "i.json")]) == 0
    (summary,) = json.loads((tmp_path / "i.json").read_text())["files"]
    assert summary["routers"]["layer9_router"] == "malformed: not used"
    assert summary["routers"]["layer2_router"] == "top-4 of sigmoid + bias in the best 2 of 4 groups"


def test_a_router_of_unknown_rule_is_not_judged_even_where_its_ids_look_like_top_k(tmp_path):
    """`instrument` declares score "unknown" for a router with a bias it cannot place. REF's ids
    may then agree with the top-k of its logits in every row by chance (a small bias moves few
    rows), which must not let those logits judge a flip: here RUN swaps in the expert with the
    lowest logit (far from a tie by the logits, a divergence when undeclared), and with the
    declaration the flip is not judged (exit 3), without the all-rows hint that cannot help."""
    rng = np.random.default_rng(17)
    ref = captures(rng, np.zeros(EXPERTS, np.float32), steps=0)
    by_key = {c.key: c for c in ref}
    for layer in range(LAYERS):  # plain top-k ids in every row
        logits = by_key[f"layer{layer}_router"].array
        by_key[f"layer{layer}_topk"].array[:] = np.sort(np.argsort(-logits, axis=-1)[:, :TOPK], axis=-1)
    run = honest_run(ref, rng)
    ids = {c.key: c for c in run}["layer1_topk"].array
    ids[5, -1] = int(np.argmin(by_key["layer1_router"].array[5]))
    ids[5] = np.sort(ids[5])

    def pair(declared: bool):
        manifests = [factory.manifest_for(side, source_dtype=dtype, key_fields={
            f"layer{layer}_router": {"rows": "all"} for layer in range(LAYERS)})
            for side, dtype in ((ref, "float32"), (run, "bfloat16"))]
        if declared:
            manifests[0]["routers"] = {f"layer{layer}_router": {"top_k": TOPK, "score": "unknown"}
                                       for layer in range(LAYERS)}
        name = "declared" if declared else "undeclared"
        return factory.write_pair(tmp_path / name, ref, run, ref_manifest=manifests[0], run_manifest=manifests[1])

    report = compare(*pair(declared=False))
    assert record(report, "layer1_topk").routing.verdict == "divergence" and report.exit_status == 1
    report = compare(*pair(declared=True))
    topk = record(report, "layer1_topk")
    (row,) = topk.routing.rows
    assert row.row == 5 and row.gap is None and "a rule compiledump does not know" in row.reason
    assert topk.routing.verdict == "not_judged" and not topk.divergent and report.exit_status == 3
    problem = next(p for p in report.pairs[0].problems if p.kind == "ids_not_judged")
    assert "declare_router" in problem.detail and "router_rows" not in problem.detail
