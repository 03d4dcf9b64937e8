"""The ``--json`` report's fields, pinned: docs/compare.md ("Output") documents them and scripts
read them, so the typed report must serialise to exactly these field sets.

The expected sets below were taken from the reports of the comparator as it was before it
returned typed records (one module, compiledump/compare.py, building dicts); this test passed
against it unchanged. Every kind of record they cover is produced here and checked, and the test
fails if a kind is no longer produced, so the pin cannot pass vacuously.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

from helpers import dumpfactory as factory
from compiledump.compare import CompareOptions, compare, write_json_report


TOP = {"format", "format_version", "ref", "run", "threshold", "threshold_for", "near_tie", "first_divergence",
       "prefill_divergence", "decode_divergence", "first_id_mismatch", "root_cause", "first_argmax_flip", "keys",
       "problems", "notes", "pairs", "elapsed_s", "exit_status",
       # issue 13: thresholds from the data, norm_diff, phases, --map, the closest key
       "norm_threshold", "default_thresholds", "thresholds", "map", "closest", "compared", "not_comparable",
       # expert ids judged by the router logits: every ids key that differs
       "id_mismatches"}

BASE = {"key", "rank", "kind", "tag", "layer", "step", "phase", "shape_ref", "shape_run", "dtype_ref", "dtype_run",
        "status", "divergent", "position",
        "source_dtype_ref", "source_dtype_run", "tokens_ref", "tokens_run", "phase_ref", "phase_run"}
FLOAT = {"metric_kind", "threshold", "rel_diff", "cosine", "max_abs", "mean_abs", "rel_l2", "nan_ref", "nan_run",
         "inf_ref", "inf_run", "nonfinite_mismatch", "compared_elements", "logits", "margin_analysis",
         "norm_diff", "norm_threshold", "threshold_class", "threshold_source", "norm_threshold_source"}
ROWS = {"all_rows", "row_count", "row_rel_diff", "row_norm_diff", "divergent_rows"}
MARGINS = {"argmax_ref", "argmax_run", "margin_ref", "margin_run", "top1_ref", "top1_run", "argmax_equal",
           "near_tie_epsilon"}
CROSSED = {"metric", "value"}
IDS = {"metric_kind", "ids_equal", "mismatched_elements", "total_elements"}
IDS_DIFFER = {"first_mismatch_row", "first_mismatch_index", "mismatched_rows", "rows", "overlap", "k", "same_set",
              "ref_ids", "run_ids"}
MERGE = {"merge", "merged_ranks", "ranks", "divergent_ranks", "worst_rank", "identical_on_ranks", "equal_partial_sums"}
ROUTING = {"routing"}  # ids that differ, unless a side is merged (judged strictly)
EXCUSED = {"excused_rows", "excused_by", "excused_metric", "excused_value", "excused_near_tie"}

# (metric_kind, status, margins computed, merged, worst rank named, all rows) -> the record's fields;
# the records with token rows excused by a near tie are in EXCUSED_RECORDS.
RECORDS = {
    (None, "skipped", False, False, False, False): BASE,
    ("float", "ok", False, False, False, False): BASE | FLOAT,
    ("float", "ok", True, False, False, False): BASE | FLOAT | MARGINS,
    ("float", "divergent", False, False, False, False): BASE | FLOAT | CROSSED,
    ("float", "divergent", True, False, False, False): BASE | FLOAT | MARGINS | CROSSED,
    ("ids", "ok", False, False, False, False): BASE | IDS,
    ("ids", "mismatch", False, False, False, False): BASE | IDS | IDS_DIFFER | ROUTING,
    ("ids", "near_tie", False, False, False, False): BASE | IDS | IDS_DIFFER | ROUTING,
    ("ids", "not_judged", False, False, False, False): BASE | IDS | IDS_DIFFER | ROUTING,
    ("float", "ok", False, True, False, False): BASE | FLOAT | MERGE,
    ("float", "ok", True, True, False, False): BASE | FLOAT | MARGINS | MERGE,
    ("float", "divergent", False, True, False, False): BASE | FLOAT | CROSSED | MERGE,  # partial sums: no rank named
    ("float", "divergent", False, True, True, False): BASE | FLOAT | CROSSED | MERGE | {"worst_rank_value"},
    ("float", "divergent", True, True, True, False): BASE | FLOAT | MARGINS | CROSSED | MERGE | {"worst_rank_value"},
    ("ids", "ok", False, True, False, False): BASE | IDS | MERGE,
    ("ids", "mismatch", False, True, True, False): BASE | IDS | IDS_DIFFER | MERGE | {"worst_rank_value"},
    (None, "not_comparable", False, False, False, False): BASE | {"reason"},
    ("float", "ok", False, False, False, True): BASE | FLOAT | ROWS,
    ("float", "divergent", False, False, False, True): BASE | FLOAT | CROSSED | ROWS,
}
EXCUSED_RECORDS = {
    ("float", "after_near_tie", False, False, False, False): BASE | FLOAT | EXCUSED,
    ("float", "after_near_tie", False, False, False, True): BASE | FLOAT | ROWS | EXCUSED,
    ("float", "after_unjudged", False, False, False, False): BASE | FLOAT | EXCUSED,
    ("float", "after_unjudged", True, False, False, False): BASE | FLOAT | MARGINS | EXCUSED,  # the prefill logits
    ("float", "divergent", False, False, False, True): BASE | FLOAT | CROSSED | ROWS | EXCUSED,
}
RANK_PARTS = {
    frozenset({"rank", "divergent", "rel_diff", "max_abs", "nonfinite_mismatch"}),  # a copy of an unsharded key
    frozenset({"rank", "divergent", "slice", "rel_diff", "max_abs", "nonfinite_mismatch"}),  # a concat shard
    frozenset({"rank", "divergent", "mismatched_elements"}),  # ids
    frozenset({"rank", "partial_sum"}),
}
KEY_PROBLEM = {"kind", "rank", "key", "detail"}
FILE_PROBLEM = {"kind", "side", "rank", "file", "detail"}
PROBLEMS = {
    "missing_in_run": KEY_PROBLEM, "extra_in_run": KEY_PROBLEM, "shape_mismatch": KEY_PROBLEM,
    "dtype_mismatch": KEY_PROBLEM, "no_common_keys": KEY_PROBLEM,
    "unreadable": KEY_PROBLEM | {"side"},  # a member of one side (an array that fails to read later: no side)
    "shard_incomplete": KEY_PROBLEM | {"side"}, "shard_mismatch": KEY_PROBLEM | {"side"},
    "missing_on_rank": KEY_PROBLEM | {"side"}, "unpaired_rank": FILE_PROBLEM, "duplicate_rank": FILE_PROBLEM,
    "mixed_phases": KEY_PROBLEM | {"side"}, "map_collision": KEY_PROBLEM | {"side"},
    "ids_not_judged": KEY_PROBLEM, "padded_row": KEY_PROBLEM | {"side"},
}
DIVERGENCE = {"key", "layer", "step", "phase", "rank", "position", "last_good", "last_good_step", "metric", "value",
              "threshold"}
MERGED_DIVERGENCE = {"merge", "worst_rank", "worst_rank_value", "merged_ranks", "divergent_ranks", "identical_on_ranks"}
# (metric, merged, root cause, all rows) -> fields of first_divergence / prefill_divergence / ... / root_cause
DIVERGENCES = {
    ("rel_diff", False, False, False): DIVERGENCE,
    ("norm_diff", False, False, False): DIVERGENCE,
    ("nonfinite", False, False, False): DIVERGENCE,
    ("argmax", False, False, False): DIVERGENCE,
    ("ids", False, False, False): DIVERGENCE | {"row", "overlap", "k", "routing"},
    ("ids", False, True, False): DIVERGENCE | {"row", "overlap", "k", "routing", "reason"},
    ("rel_diff", True, False, False): DIVERGENCE | MERGED_DIVERGENCE,
    ("norm_diff", True, False, False): DIVERGENCE | MERGED_DIVERGENCE,
    ("ids", True, False, False): DIVERGENCE | {"row", "overlap", "k", "routing"} | MERGED_DIVERGENCE,
    ("rel_diff", False, False, True): DIVERGENCE | {"divergent_rows", "row_count"},
}
FLIP = {"step", "key", "tag", "rank", "kind", "margin_ref", "margin_run", "argmax_ref", "argmax_run", "epsilon",
        "position"}
PAIR = {"rank", "ref", "run", "ref_manifest", "run_manifest", "compared", "divergent_keys", "first_divergence",
        "first_argmax_flip", "decode_margins", "id_mismatches",
        "not_comparable", "prompt_tokens", "prompt_tokens_ref", "prompt_tokens_run", "closest", "thresholds", "not_captured", "first_nonfinite", "renamed",
        "fed_tokens_differ", "fewer_steps", "ended_early"}
CLOSEST = {"key", "rank", "layer", "step", "metric", "value", "threshold", "ratio"}
THRESHOLD_USE = {"rank", "ref_dtype", "run_dtype", "class", "rel_diff", "norm_diff", "rel_source", "norm_source", "keys"}
NOT_COMPARABLE = {"key", "rank", "reason", "source_dtype_ref", "source_dtype_run", "tokens_ref", "tokens_run",
                  "phase_ref", "phase_run"}
NOT_CAPTURED = {"filtered_tags", "filtered", "tags_none_kept", "drops", "gated_after_kept"}
DECODE_MARGINS = {"tags", "steps", "argmax_agree", "compared", "flips", "smallest_ref_margin"}
ROUTING_FIELDS = {"verdict", "class", "class_from", "router_key", "router_rows", "differing_rows", "near_tie_rows",
                  "far_rows", "not_judged_rows", "after_near_tie_rows", "after_unjudged_rows", "reordered_rows", "not_top_k",
                  "logit_noise", "capacity", "rows"}
ROUTING_ROW = {"row", "overlap", "k", "gap", "epsilon", "near_tie", "reason", "after_near_tie", "after_unjudged", "cut"}


def write_tp2(directory: Path, captures: list[factory.Capture], shards: dict[str, dict],
              broken: dict[str, int] | None = None) -> list[Path]:
    """Two tensor-parallel rank files of ``captures``: keys in ``shards`` split (concat) or as
    partial sums, the others replicated; ``broken[key] = rank``: that rank's part is wrong."""
    rng = np.random.default_rng(5)
    paths = []
    for rank in (0, 1):
        caps = []
        for cap in captures:
            shard, array = shards.get(cap.key), cap.array
            if shard is not None and shard["how"] == "concat":
                array = np.array_split(array, 2, axis=shard["dim"])[rank].copy()
            elif shard is not None:
                part = np.random.default_rng(12345).standard_normal(array.shape)  # the same on both ranks
                array = (part if rank == 0 else array - part).astype(array.dtype)
            elif not np.issubdtype(array.dtype, np.integer):
                array = (array * (1 + rng.standard_normal(array.shape) * 1e-7)).astype(array.dtype)
            if (broken or {}).get(cap.key) == rank:
                if np.issubdtype(array.dtype, np.integer):
                    array = array.copy()
                    array.flat[0] = 99
                else:
                    array = (array * 1.5).astype(array.dtype)
            caps.append(factory.replace(cap, array=array))
        manifest = factory.manifest_for(caps, rank, pid=100 + rank)
        manifest["parallel"] = {"tp_rank": rank, "tp_size": 2}
        manifest["world_size"] = 2
        for key, shard in shards.items():
            manifest["keys"][key]["shard"] = shard
        paths.append(factory.write_compiledump(directory, caps, rank, 100 + rank, manifest=manifest))
    return paths


def corrupt_member(path: Path, key: str) -> None:
    """Overwrite the .npy magic of one member in place (the zip directory stays intact)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(f"{key}.npy")
    data = bytearray(path.read_bytes())
    extra = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + len(info.filename) + extra
    data[start:start + 6] = b"BROKEN"
    path.write_bytes(bytes(data))


def reports(tmp_path: Path) -> list[dict]:
    """JSON reports covering every kind of record, problem and finding."""
    out = []

    def run(ref, run_side, **options):
        path = tmp_path / f"report{len(out)}.json"
        write_json_report(compare(ref, run_side, CompareOptions(**options)), path)
        out.append(json.loads(path.read_text()))

    rng = np.random.default_rng(200)
    ref = factory.model_captures(rng, layers=5, dim=31, steps=4, vocab=101)
    ref_path = factory.write_compiledump(tmp_path / "ref", ref)
    # One pair: float and id divergences, a root cause, prefill and decode logits, key problems.
    changed = factory.perturb(ref, rng, from_layer=3, from_step=2, ids_layer=3)  # flip and divergence in one layer: not reached
    changed = [c for c in changed if c.key != "layer0"]
    changed.append(factory.Capture("probe", np.ones(3, np.float32) + 0.25, "record", "probe"))
    changed = [factory.replace(c, array=np.concatenate([c.array, c.array[:1]])) if c.key == "layer2" else c
               for c in changed]
    changed = [factory.replace(c, array=c.array.astype(np.float32)) if c.key == "layer4_topk" else c
               for c in changed]
    changed_path = factory.write_compiledump(tmp_path / "a", changed)
    corrupt_member(changed_path, "layer3")
    run(ref_path, changed_path)
    # A NaN on one side only, and (with a huge threshold) an argmax flip as the first divergence.
    noisy = factory.perturb(ref, rng)
    noisy[[c.key for c in noisy].index("layer2_moe_out")].array[3] = np.nan
    run(ref_path, factory.write_compiledump(tmp_path / "b", noisy))
    flipped = factory.perturb(ref, rng)
    flipped[[c.key for c in flipped].index("logits_1")].array[0] = 1e3
    run(ref_path, factory.write_compiledump(tmp_path / "c", flipped), threshold=10.0, norm_threshold=1e9, near_tie=0.5)
    # An id mismatch alone, and ranks: unpaired, duplicate, no common keys.
    for rank in (0, 1, 2):
        factory.write_compiledump(tmp_path / "d/ref", ref, rank=rank, pid=10 + rank)
    factory.write_compiledump(tmp_path / "d/run", factory.perturb(ref, rng, ids_layer=2), rank=0, pid=20)
    old = factory.write_compiledump(tmp_path / "d/run", ref, rank=0, pid=19)
    os.utime(old, (1_000_000, 1_000_000))
    np.savez(tmp_path / "d/run/deepinfer_layers_rank1_pid21.npz", other=rng.standard_normal(3))  # no manifest
    run(tmp_path / "d/ref", tmp_path / "d/run")
    # Sharded: concat, partial sums, replicated floats and ids, each with a broken rank.
    shards = {"layer1_moe_out": {"dim": 0, "how": "concat", "group": "tp"},
              "layer2_moe_out": {"dim": None, "how": "sum", "group": "tp"},
              "logits_0": {"dim": 0, "how": "concat", "group": "tp"}}
    write_tp2(tmp_path / "e", ref, shards)
    run(ref_path, tmp_path / "e")
    for name, broken in (("f", {"layer1_moe_out": 1}), ("g", {"layer2_moe_out": 0}), ("h", {"layer1_topk": 1}),
                         ("i", {"logits_2": 0}), ("j", {"layer3": 1})):
        write_tp2(tmp_path / name, ref, shards, broken)
        run(ref_path, tmp_path / name)
    # Shards that cannot be merged, and a key held by one rank only.
    _, rank1 = write_tp2(tmp_path / "k", ref, shards)
    manifest = json.loads(rank1.with_suffix(".json").read_text())
    manifest["keys"]["layer1_moe_out"]["shard"] = {"dim": None, "how": "sum", "group": "tp"}
    manifest["parallel"] = {"tp_size": 2}  # no tp_rank: the other shards cannot be ordered
    rank1.with_suffix(".json").write_text(json.dumps(manifest))
    with np.load(rank1) as data:
        arrays = {key: data[key] for key in data.files if key != "layer3"}
    np.savez(rank1, **arrays)
    run(ref_path, tmp_path / "k")
    # Values of different phases (the token gate off on RUN): not comparable; RUN mixes phases.
    prompt = 3
    calls = factory.manifest_for(ref, key_fields=factory.call_fields(ref, prompt, prompt, prompt), prompt_tokens=prompt)
    phased = factory.write_compiledump(tmp_path / "l/ref", ref, manifest=calls)
    decoded = factory.perturb(ref, rng)
    mixed = factory.manifest_for(decoded, key_fields=factory.call_fields(decoded, 4, prompt, prompt),
                                 prompt_tokens=prompt, filtered_tags={"layer9_topk": "moe_layers"})
    run(phased, factory.write_compiledump(tmp_path / "l/run", decoded, manifest=mixed))
    # A request row padded on the right (instrument's prompt_mask): one-row keys hold padding.
    padded = [factory.replace(c, array=np.concatenate([c.array, c.array[:1]])) if c.kind == "ids" else c for c in ref]
    padded.append(factory.Capture("prompt_mask", np.array([1, 1, 1, 0], np.int32), "ids", "prompt_mask"))
    right = factory.manifest_for(padded, key_fields=factory.call_fields(padded, 4, 4, 4), prompt_tokens=4)
    run(phased, factory.write_compiledump(tmp_path / "l/padded", padded, manifest=right))
    # All-rows keys (one row off) and a key scaled by 1.05 (norm_diff crosses first).
    rows_ref = ref + [factory.Capture(f"layer{n}_rows", rng.standard_normal((4, 31)).astype(np.float32), "record",
                                      f"layer{n}_rows") for n in (0, 1)]
    rows_run = factory.perturb(rows_ref, rng)
    rows_run[-1].array[2] *= 1.2
    rows_run = [factory.replace(c, array=(c.array * 1.05).astype(np.float32)) if c.key == "layer2_moe_out" else c
                for c in rows_run]
    fields = {"layer0_rows": {"rows": "all", "tokens": 4}, "layer1_rows": {"rows": "all", "tokens": 4}}
    run(factory.write_compiledump(tmp_path / "m/ref", rows_ref,
                                  manifest=factory.manifest_for(rows_ref, key_fields=fields)),
        factory.write_compiledump(tmp_path / "m/run", rows_run,
                                  manifest=factory.manifest_for(rows_run, key_fields=fields)))
    scaled = [factory.replace(c, array=(c.array * 1.05).astype(np.float32)) if c.key == "layer2_moe_out" else c
              for c in factory.perturb(ref, rng)]
    run(ref_path, factory.write_compiledump(tmp_path / "n", scaled))
    # Expert ids judged by router logits: near ties (one row, and rows of all-rows keys) excuse the
    # float keys of those tokens after them; a row without logits is not judged.
    for mode in ("one", "all"):
        ref_moe, run_moe, moe_fields = moe_pair(np.random.default_rng(300), mode)
        run(factory.write_compiledump(tmp_path / f"p{mode}/ref", ref_moe,
                                      manifest=factory.manifest_for(ref_moe, key_fields=moe_fields)),
            factory.write_compiledump(tmp_path / f"p{mode}/run", run_moe,
                                      manifest=factory.manifest_for(run_moe, key_fields=moe_fields)))
    # --map: RUN tags differ; two RUN keys map to one name.
    renamed = [factory.replace(c, key=c.key.replace("layer", "blk"), tag=c.tag.replace("layer", "blk"))
               for c in factory.perturb(ref, rng)]
    renamed.append(factory.Capture("blk0x", np.ones(3, np.float32), "record", "blk0x"))
    run(ref_path, factory.write_compiledump(tmp_path / "o", renamed), maps=[("^blk", "layer"), ("^layer0x$", "layer0")])
    return out


def moe_pair(rng: np.random.Generator, mode: str) -> tuple[list, list, dict]:
    """REF/RUN captures (bf16 manifests) of two MoE layers of 5 tokens: router logits (the last
    row, or every row), top-2 ids (the top-2 of the logits), MoE and layer output. RUN: layer 0's
    ids swap the 2nd and 3rd expert of row 4 (one mode) or row 2 (all mode) after REF's logits
    there were made a near tie (gap 1e-3); layer 1's ids take row 0's lowest-scored expert (no logits
    in one mode);
    the floats of layer 0 and after are 30 % off in that token (all mode: also in token 3 of
    ``layer0_mlp``)."""
    tokens, experts, dim = 5, 8, 16
    tie_row = tokens - 1 if mode == "one" else 2
    ref, run, moe_fields = [], [], {}
    for layer in (0, 1):
        logits = rng.standard_normal((tokens, experts)).astype(np.float32)
        order = np.argsort(-logits[tie_row])
        if layer == 0:
            logits[tie_row, order[2]] = logits[tie_row, order[1]] - np.float32(1e-3)
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :2].astype(np.int32)
        run_ids = ids.copy()
        if layer == 0:
            run_ids[tie_row, 1] = np.argsort(-logits[tie_row], kind="stable")[2]
        else:
            run_ids[0, 1] = np.argsort(-logits[0], kind="stable")[-1]  # the lowest-scored expert: far from a tie
        router = logits if mode == "all" else logits[-1]
        shape = (tokens, dim) if mode == "all" else (dim,)
        mlp, out = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
        off_mlp, off_out = mlp.copy(), out.copy()
        for array in (off_mlp, off_out):
            if mode == "all":
                array[tie_row] *= 1.3
            else:
                array *= 1.3
        if mode == "all" and layer == 0:
            off_mlp[3] *= 1.3
        names = [f"layer{layer}_router", f"layer{layer}_topk", f"layer{layer}_mlp", f"layer{layer}"]
        for name, ref_array, run_array in zip(names, (router, ids, mlp, out), (router, run_ids, off_mlp, off_out)):
            kind = "ids" if name.endswith("topk") else "record"
            ref.append(factory.Capture(name, ref_array, kind, name))
            run.append(factory.Capture(name, run_array, kind, name))
            if mode == "all" and kind == "record":
                moe_fields[name] = {"rows": "all", "tokens": tokens}
    return ref, run, moe_fields


def fields(item: dict) -> frozenset:
    return frozenset(item)


def test_json_report_fields_are_pinned(tmp_path):
    seen_records, seen_problems, seen_divergences, seen_parts = set(), set(), set(), set()
    seen_pair_facts, seen_exits = set(), set()
    seen_cautions = 0
    all_reports = reports(tmp_path)
    for report in all_reports:
        assert set(report) == TOP
        assert report["format"] == "compiledump-compare" and report["format_version"] == 1
        assert set(report["near_tie"]) in ({"epsilon"}, {"ulps_of_ref_top1"})
        for record in report["keys"]:
            kind = (record.get("metric_kind"), record["status"], "argmax_ref" in record, "merge" in record,
                    record.get("worst_rank") is not None, "all_rows" in record)
            table = EXCUSED_RECORDS if "excused_rows" in record else RECORDS
            assert kind in table, (kind, sorted(record))
            assert set(record) == table[kind], (kind, sorted(set(record) ^ table[kind]))
            seen_records.add((kind, table is EXCUSED_RECORDS))
            for part in record.get("ranks", ()):
                assert fields(part) in RANK_PARTS, sorted(part)
                seen_parts.add(fields(part))
        for problem in report["problems"]:
            assert set(problem) == PROBLEMS[problem["kind"]], problem
            seen_problems.add(problem["kind"])
        for name in ("first_divergence", "prefill_divergence", "decode_divergence", "first_id_mismatch", "root_cause"):
            item = report[name]
            if item is not None:
                kind = (item["metric"], "merge" in item, name == "root_cause", "divergent_rows" in item)
                # `caution` is there when the verdict has one (a hybrid model's bf16 layers, one-row mode).
                assert set(item) - {"caution"} == DIVERGENCES[kind], (name, kind, sorted(item))
                seen_divergences.add(kind)
                seen_cautions += "caution" in item
        for item in report["id_mismatches"]:
            kind = (item["metric"], "merge" in item, False, "divergent_rows" in item)
            assert set(item) == DIVERGENCES[kind], sorted(item)
            routing = item["routing"]
            assert routing is None or set(routing) == ROUTING_FIELDS, sorted(routing)
            for row in (routing or {}).get("rows", ()):
                assert set(row) == ROUTING_ROW, sorted(row)
        if report["first_argmax_flip"] is not None:
            assert set(report["first_argmax_flip"]) == FLIP
        for pair in report["pairs"]:
            assert set(pair) == PAIR
            if pair["decode_margins"] is not None:
                assert set(pair["decode_margins"]) == DECODE_MARGINS
                assert set(pair["decode_margins"]["smallest_ref_margin"]) == {"step", "key", "value"}
            assert set(pair["closest"]) == CLOSEST
            assert all(set(use) == THRESHOLD_USE for use in pair["thresholds"]) and pair["thresholds"]
            for side in pair["not_captured"].values():
                assert side is None or set(side) == NOT_CAPTURED
            seen_pair_facts.update(name for name in ("prompt_tokens", "renamed") if pair[name])
        assert set(report["closest"]) == CLOSEST and set(report["default_thresholds"]) == {
            "fp32", "fp16", "bf16", "fp8", "legacy"}
        assert all(set(use) == THRESHOLD_USE for use in report["thresholds"])
        assert all(set(item) == NOT_COMPARABLE for item in report["not_comparable"])
        assert report["compared"] == sum(pair["compared"] for pair in report["pairs"])
        unjudged = any((item["routing"] or {}).get("verdict") == "not_judged" for item in report["id_mismatches"])
        not_compared = any(record["status"] == "skipped" for record in report["keys"])
        expected = 1 if report["first_divergence"] is not None else (
            3 if report["not_comparable"] or unjudged or not_compared else 0)
        assert report["exit_status"] == expected
        seen_exits.add(report["exit_status"])
    # Every kind was produced: the pin checks something.
    expected_records = {(kind, False) for kind in RECORDS} | {(kind, True) for kind in EXCUSED_RECORDS}
    assert seen_records == expected_records, expected_records - seen_records
    assert seen_parts == RANK_PARTS
    assert seen_problems == set(PROBLEMS), set(PROBLEMS) - seen_problems
    assert seen_divergences == set(DIVERGENCES), set(DIVERGENCES) - seen_divergences
    assert seen_cautions
    assert any(report["first_argmax_flip"] for report in all_reports)
    assert seen_pair_facts == {"prompt_tokens", "renamed"} and seen_exits == {0, 1, 3}
    assert any(report["not_comparable"] for report in all_reports)
