"""Shard merging in the comparator: synthetic multi-rank dumps (tensor, expert and data
parallel; concatenated and partial-sum shards), merged and compared against one process's dump,
and `inspect` showing the parallel metadata.

The dumps are written here from numpy, and every expected merged value is built here
(np.concatenate / sum of the shards) and measured with the rel_diff formula written out, so
the comparator is checked against an independent reference. The runtime side (set_parallel,
declare_shard, real torch.distributed ranks) is tests/capture/test_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import dumpfactory as factory
from helpers.reference_metrics import rel_diff
from compiledump import compare as cmp
from compiledump.cli import main

D, FFN, VOCAB, TOKENS, TOPK, LAYERS, STEPS = 12, 16, 20, 3, 2, 3, 2


# ----------------------------------------------------------------------------------------------
# Synthetic sharded dumps
# ----------------------------------------------------------------------------------------------

# key -> shard entry in the manifest (None: replicated on every rank).
def shard_plan() -> dict[str, dict | None]:
    plan: dict[str, dict | None] = {"embed": None, "logits": None}
    for layer in range(LAYERS):
        plan[f"layer{layer}_up"] = {"dim": 0, "how": "concat", "group": "tp"}
        plan[f"layer{layer}_topk"] = None
        plan[f"layer{layer}_partial"] = {"dim": None, "how": "sum", "group": "tp"}
        plan[f"layer{layer}_experts"] = {"dim": 0, "how": "concat", "group": "ep"}
        plan[f"layer{layer}"] = None
    for step in range(STEPS):
        plan[f"logits_shard_{step}"] = {"dim": 0, "how": "concat", "group": "tp"}
        plan[f"logits_{step}"] = None
    return plan


def reference_captures(rng: np.random.Generator) -> list[factory.Capture]:
    """Full (unsharded) captures in model order, as a single process would dump them."""
    vec = lambda n: (rng.standard_normal(n) * 2 + 0.5).astype(np.float32)  # noqa: E731
    caps = [factory.Capture("embed", vec(D), "record", "embed")]
    for layer in range(LAYERS):
        ids = np.stack([rng.choice(16, TOPK, replace=False) for _ in range(TOKENS)]).astype(np.int32)
        caps += [
            factory.Capture(f"layer{layer}_up", vec(FFN), "record", f"layer{layer}_up"),
            factory.Capture(f"layer{layer}_topk", ids, "ids", f"layer{layer}_topk"),
            factory.Capture(f"layer{layer}_experts", np.stack([vec(D) for _ in range(4)]), "record",
                            f"layer{layer}_experts"),
            factory.Capture(f"layer{layer}_partial", vec(D), "record", f"layer{layer}_partial"),
            factory.Capture(f"layer{layer}", vec(D), "record", f"layer{layer}"),
        ]
    caps.append(factory.Capture("logits", vec(VOCAB), "record_once", "logits"))
    for step in range(STEPS):
        caps.append(factory.Capture(f"logits_shard_{step}", vec(VOCAB), "step", "logits_shard", step))
        caps.append(factory.Capture(f"logits_{step}", vec(VOCAB), "step", "logits", step))
    return caps


def split(full: np.ndarray, shard: dict | None, index: int, count: int, rng) -> np.ndarray:
    """Rank `index` of `count`'s part of `full`: a slice, a partial sum, or a replicated copy
    (with rounding-level noise, far below any threshold)."""
    if shard is None:
        if np.issubdtype(full.dtype, np.integer):
            return full.copy()
        return (full * (1 + rng.standard_normal(full.shape) * 1e-7)).astype(full.dtype)
    if shard["how"] == "concat":
        return np.array_split(full, count, axis=shard["dim"])[index].copy()
    # Partial sums: random parts that add up to full (the last one takes the remainder).
    rs = np.random.default_rng(12345)  # the same parts for every rank's call
    parts = [rs.standard_normal(full.shape) for _ in range(count - 1)]
    parts.append(full.astype(np.float64) - sum(parts, np.zeros(full.shape)))
    return parts[index].astype(full.dtype)


def coords_of(rank: int, tp: int, ep: int, dp: int) -> dict[str, int]:
    """rank = ((dp_rank * ep) + ep_rank) * tp + tp_rank."""
    return {"tp_rank": rank % tp, "tp_size": tp, "ep_rank": (rank // tp) % ep, "ep_size": ep,
            "dp_rank": rank // (tp * ep), "dp_size": dp}


def write_sharded(directory: Path, ref: list[factory.Capture], tp: int = 2, ep: int = 1, dp: int = 1,
                  bug: tuple[str, int] | None = None, seed: int = 0, ranks=None, edit=None) -> list[Path]:
    """One file per rank of a tp x ep x dp run of the reference captures. `bug` = (key, rank):
    that rank's part of the key is broken (scaled by 1.5, or one id changed). `edit(rank,
    manifest)` may alter a rank's manifest."""
    rng = np.random.default_rng(seed)
    plan = shard_plan()
    world = tp * ep * dp
    paths = []
    for rank in (ranks if ranks is not None else range(world)):
        coords = coords_of(rank, tp, ep, dp)
        caps = []
        for cap in ref:
            shard = plan[cap.key]
            index, count = 0, 1
            if shard is not None:
                index, count = coords[f"{shard['group']}_rank"], coords[f"{shard['group']}_size"]
            array = split(cap.array, shard, index, count, rng)
            if bug == (cap.key, rank):
                array = array.copy()
                if np.issubdtype(array.dtype, np.integer):
                    array.flat[0] = 99
                else:
                    array *= 1.5
            caps.append(factory.Capture(cap.key, array, cap.kind, cap.tag, cap.step))
        manifest = factory.manifest_for(caps, rank, pid=1000 + rank)
        manifest["world_size"] = world
        manifest["parallel"] = {name: value for name, value in coords.items()
                                if name.split("_")[0] in ({"tp"} | ({"ep"} if ep > 1 else set())
                                                          | ({"dp"} if dp > 1 else set()))}
        for key, entry in manifest["keys"].items():
            if plan[key] is not None and (plan[key]["group"] != "ep" or ep > 1):
                entry["shard"] = plan[key]
        if edit is not None:
            edit(rank, manifest)
        paths.append(factory.write_compiledump(directory, caps, rank, 1000 + rank, manifest=manifest))
    return paths


def sharded_case(tmp_path: Path, **kwargs) -> tuple[Path, Path, list[factory.Capture]]:
    ref = reference_captures(np.random.default_rng(kwargs.pop("ref_seed", 7)))
    ref_path = factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1)
    write_sharded(tmp_path / "run", ref, **kwargs)
    return ref_path, tmp_path / "run", ref


def record_of(report: dict, key: str, rank: str | None = None) -> dict:
    """A key's record in a JSON report."""
    (record,) = [r for r in report["keys"] if r["key"] == key and (rank is None or r["rank"] == rank)]
    return record


def key_record(report: cmp.Report, key: str) -> cmp.KeyRecord:
    """A key's record in a report from cmp.compare."""
    (record,) = [r for r in report.keys if r.key == key]
    return record


# ----------------------------------------------------------------------------------------------
# Comparator: merging shards
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_clean_tensor_parallel_run_merges_to_no_divergence(tmp_path, tp):
    ref_path, run_dir, ref = sharded_case(tmp_path, tp=tp)
    report = cmp.compare(ref_path, run_dir)
    assert report.exit_status == 0 and report.first_divergence is None
    assert report.problems == []
    assert [pair.rank for pair in report.pairs] == ["+".join(str(r) for r in range(tp))]
    assert [r.key for r in report.keys] == [c.key for c in ref]  # every key, model order
    # The merged values: shards concatenated / partial sums added, here with numpy.
    shards = [dict(np.load(p)) for p in sorted(run_dir.glob("*.npz"), key=lambda p: int(p.name.split("rank")[1][0]))]
    full = dict(np.load(ref_path))
    up = np.concatenate([s["layer1_up"] for s in shards])
    partial = sum(s["layer1_partial"].astype(np.float64) for s in shards)
    assert key_record(report, "layer1_up").floats.rel_diff == pytest.approx(rel_diff(full["layer1_up"], up),
                                                                            abs=1e-15)
    assert key_record(report, "layer1_partial").floats.rel_diff == pytest.approx(
        rel_diff(full["layer1_partial"], partial), rel=1e-6, abs=1e-15)
    assert key_record(report, "layer1_up").merge.how == "concat tp dim 0"
    assert key_record(report, "layer1_partial").merge.how == "sum tp"
    replicated = key_record(report, "layer1")
    assert replicated.merge.how == "each rank"
    assert [e.rank for e in replicated.merge.ranks] == [str(r) for r in range(tp)]
    # The replicated key reports its worst rank's value.
    assert replicated.floats.rel_diff == pytest.approx(max(rel_diff(full["layer1"], s["layer1"]) for s in shards),
                                                       rel=1e-9)
    slices = key_record(report, "layer0_up").merge.ranks
    assert [e.span for e in slices] == [(i * FFN // tp, (i + 1) * FFN // tp) for i in range(tp)]


@pytest.mark.parametrize("tp,key,rank", [
    (2, "layer1_up", 1), (2, "layer1_up", 0), (4, "layer0_up", 2),  # a wrong shard
    (2, "layer1", 1), (4, "layer0", 3),  # one rank's copy of a replicated key
    (2, "logits_shard_1", 1),  # a decode step's vocab shard
    (2, "layer1_topk", 1),  # one rank's routing ids
])
def test_bug_on_one_rank_is_reported_with_that_rank(tmp_path, capsys, tp, key, rank):
    ref_path, run_dir, _ = sharded_case(tmp_path, tp=tp, bug=(key, rank))
    code = main(["compare", str(ref_path), str(run_dir), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    first = report["first_divergence"]
    assert first["key"] == key and first["worst_rank"] == str(rank) and first["divergent_ranks"] == [str(rank)]
    assert f"worst rank {rank}" in out[-1]
    record = record_of(report, key)
    healthy = [e for e in record["ranks"] if e["rank"] != str(rank)]
    assert healthy and not any(e["divergent"] for e in healthy)
    if not key.endswith("topk"):
        # The named rank's own value is measured against the matching part of the reference.
        full = dict(np.load(ref_path))[key]
        part = dict(np.load(next(run_dir.glob(f"*rank{rank}_*.npz"))))[key]
        if record["merge"].startswith("concat"):
            full = np.array_split(full, tp)[rank]
        assert first["worst_rank_value"] == pytest.approx(rel_diff(full, part), rel=1e-9)


def test_bug_in_a_partial_sum_names_no_rank(tmp_path, capsys):
    ref_path, run_dir, _ = sharded_case(tmp_path, bug=("layer1_partial", 1))
    assert main(["compare", str(ref_path), str(run_dir)]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    report = cmp.compare(ref_path, run_dir)
    assert report.first_divergence.key == "layer1_partial"
    assert report.first_divergence.merge.worst_rank is None
    assert "partial sums, no single rank can be named" in last


def test_the_reference_side_may_be_the_sharded_one(tmp_path):
    ref = reference_captures(np.random.default_rng(3))
    write_sharded(tmp_path / "ref", ref, tp=2)
    run = factory.perturb(ref, np.random.default_rng(4), noise=1e-5, from_layer=1)
    run_path = factory.write_compiledump(tmp_path / "run", run, rank="x", pid=5)
    report = cmp.compare(tmp_path / "ref", run_path)
    assert report.pairs[0].rank == "0+1"
    assert report.first_divergence.key == "layer1_up"
    shards = [dict(np.load(p))["layer1_up"] for p in sorted((tmp_path / "ref").glob("*.npz"))]
    run_up = dict(np.load(run_path))["layer1_up"]
    assert report.first_divergence.value == pytest.approx(rel_diff(np.concatenate(shards), run_up), rel=1e-9)


def test_tensor_times_expert_parallel(tmp_path):
    # 4 ranks: tp_rank = r % 2, ep_rank = r // 2. A tp-sharded key has one copy per ep rank, an
    # ep-sharded key one per tp rank; a wrong shard on rank 3 is found in its copy.
    ref_path, run_dir, _ = sharded_case(tmp_path, tp=2, ep=2)
    clean = cmp.compare(ref_path, run_dir)
    assert clean.exit_status == 0 and clean.problems == []
    assert [e.rank for e in key_record(clean, "layer0_up").merge.ranks] == ["0", "1", "2", "3"]
    assert [e.rank for e in key_record(clean, "layer0_experts").merge.ranks] == ["0", "2", "1", "3"]
    broken = tmp_path / "broken"
    ref = reference_captures(np.random.default_rng(7))
    write_sharded(broken, ref, tp=2, ep=2, bug=("layer0_experts", 3))
    report = cmp.compare(ref_path, broken)
    first = report.first_divergence
    assert (first.key, first.merge.worst_rank, first.merge.divergent_ranks) == ("layer0_experts", "3", ["3"])


def test_data_parallel_replicas_are_compared_separately(tmp_path):
    ref_path, run_dir, _ = sharded_case(tmp_path, tp=2, dp=2, bug=("layer0", 3))
    report = cmp.compare(ref_path, run_dir)
    assert [pair.rank for pair in report.pairs] == ["0+1", "2+3"]
    assert report.pairs[0].first_divergence is None
    first = report.first_divergence
    assert (first.rank, first.key, first.merge.worst_rank) == ("2+3", "layer0", "3")


def test_shards_that_cannot_be_merged_are_problems_not_crashes(tmp_path):
    ref = reference_captures(np.random.default_rng(7))
    ref_path = factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1)
    # Rank 1 of tp_size 3 is missing.
    write_sharded(tmp_path / "gap", ref, tp=3, ranks=[0, 2])
    report = cmp.compare(ref_path, tmp_path / "gap")
    kinds = {(p.kind, p.key) for p in report.problems}
    assert ("shard_incomplete", "layer0_up") in kinds and ("shard_incomplete", "logits_shard_1") in kinds
    # Held by both sides, not compared: listed as such, and the run is not called clean (exit 3).
    assert key_record(report, "layer0_up").status == "skipped"
    assert {r.key for r in report.not_compared} == {k for kind, k in kinds if kind == "shard_incomplete"}
    assert key_record(report, "layer0").status == "ok"  # replicated keys are still compared
    assert report.exit_status == 3
    # No set_parallel on the run side: the shards cannot be ordered.
    write_sharded(tmp_path / "noparallel", ref, edit=lambda rank, m: m.pop("parallel"))
    report = cmp.compare(ref_path, tmp_path / "noparallel")
    problem = next(p for p in report.problems if p.key == "layer0_up")
    assert problem.kind == "shard_incomplete" and "set_parallel(tp_rank=...)" in problem.detail
    # Ranks that disagree on a declaration, and shards whose shapes do not fit together.
    def disagree(rank, manifest):
        if rank == 1:
            manifest["keys"]["layer0_up"]["shard"] = {"dim": None, "how": "sum", "group": "tp"}
    write_sharded(tmp_path / "disagree", ref, edit=disagree)
    report = cmp.compare(ref_path, tmp_path / "disagree")
    assert ("shard_mismatch", "layer0_up") in {(p.kind, p.key) for p in report.problems}
    def bad_dim(rank, manifest):
        manifest["keys"]["layer0_experts"]["shard"] = {"dim": 1, "how": "concat", "group": "tp"}
    write_sharded(tmp_path / "baddim", ref, edit=bad_dim, ranks=[0, 1])
    report = cmp.compare(ref_path, tmp_path / "baddim")
    skipped = key_record(report, "layer0_experts")
    assert skipped.status == "skipped"  # merged [4, 24] vs [4, 12]: a shape mismatch
    assert any(p.kind == "shape_mismatch" and p.key == "layer0_experts" for p in report.problems)


@pytest.mark.parametrize("reverse", [False, True])
def test_one_rank_of_a_sharded_run_is_not_compared_as_the_whole(tmp_path, capsys, reverse):
    # Only rank 0's file of a TP=2 run was collected. Its partial sums, held against the full
    # values, once read as a divergence in layer 0 (rel_diff ~0.6) and its concat shards as shape
    # mismatches: the verdict blamed a layer for a missing file.
    ref = reference_captures(np.random.default_rng(7))
    ref_path = factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1)
    write_sharded(tmp_path / "run", ref, tp=2, ranks=[0], bug=("layer1", 0))
    sides = [str(ref_path), str(tmp_path / "run")]
    code = main(["compare", *(sides[::-1] if reverse else sides), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    sharded = {key for key, shard in shard_plan().items() if shard is not None and shard["group"] == "tp"}
    incomplete = {p["key"] for p in report["problems"] if p["kind"] == "shard_incomplete"}
    assert incomplete == sharded and "tp_rank [0] present (ranks 0), expected 0..1" in out
    assert {r["key"] for r in report["keys"] if r["status"] == "skipped"} == sharded
    # The replicated keys are compared: the real bug (layer1 on rank 0) is the first divergence.
    assert code == 1 and report["first_divergence"]["key"] == "layer1"
    assert record_of(report, "layer0")["status"] == "ok"
    # Without the bug: nothing diverges, but the comparison could not tell everything (exit 3).
    write_sharded(tmp_path / "clean", ref, tp=2, ranks=[0])
    report = cmp.compare(ref_path, tmp_path / "clean")
    assert report.first_divergence is None and report.exit_status == 3
    assert {r.key for r in report.not_compared} == sharded
    assert f"{len(sharded)} keys held by both sides NOT COMPARED" in cmp.format_report(report)[-1]


def test_two_single_rank_files_of_sharded_runs_compare_slice_with_slice(tmp_path):
    # Rank 0 of one TP=2 run against rank 0 of another: both are parts, paired as they are.
    ref = reference_captures(np.random.default_rng(7))
    write_sharded(tmp_path / "a", ref, tp=2, ranks=[0], seed=1)
    write_sharded(tmp_path / "b", ref, tp=2, ranks=[0], seed=2)
    report = cmp.compare(tmp_path / "a", tmp_path / "b")
    assert report.exit_status == 0 and report.problems == [] and report.not_compared == []
    assert key_record(report, "layer0_up").shape_ref == [FFN // 2]


def test_without_shard_declarations_ranks_pair_by_rank_as_before(tmp_path):
    ref = reference_captures(np.random.default_rng(7))
    ref_path = factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1)
    write_sharded(tmp_path / "run", ref, edit=lambda rank, m: [e.pop("shard", None) for e in m["keys"].values()])
    first = min((tmp_path / "run").glob("*rank0_*.npz")).name  # the error names the fix (before: ranks alone)
    with pytest.raises(cmp.DumpError, match=rf"no rank in common.*compare REF with one rank's file \({first}\); where"):
        cmp.compare(ref_path, tmp_path / "run")


def test_inspect_shows_parallel_groups_and_shards(tmp_path, capsys):
    ref = reference_captures(np.random.default_rng(7))
    (first, _) = write_sharded(tmp_path, ref)
    assert main(["inspect", str(first)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "parallel: tp_rank=0 tp_size=2" in out
    assert any(line.startswith("shards: 8 keys: layer0_up (concat tp dim 0), layer0_partial (sum tp)") for line in out)


@pytest.mark.parametrize("bad_rank", [None, 1])
def test_a_step_of_ids_stays_ids_on_a_merged_side(tmp_path, bad_rank):
    """A decode step's expert ids (`record_step` of an integer tensor: stored as float32, the
    manifest's source dtype int64) replicated on each tp rank: merged, they are still compared as
    ids (strictly, as every merged side's ids), and a rank whose copy differs is named."""
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(16, TOPK, replace=False) for _ in range(STEPS)]).astype(np.float32)
    ref = [factory.Capture(f"layer0_step_topk_{n}", ids[n], "step", "layer0_step_topk", n) for n in range(STEPS)]
    ref += [factory.Capture(f"logits_{n}", rng.standard_normal(VOCAB).astype(np.float32), "step", "logits", n)
            for n in range(STEPS)]

    def manifest(captures, rank, pid):
        m = factory.manifest_for(captures, rank, pid=pid)
        for key, entry in m["keys"].items():
            if "topk" in key:
                entry["source_dtype"] = "int64"
        return m

    ref_path = factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1, manifest=manifest(ref, "x", 1))
    for rank in range(2):  # the logits are vocab shards (so the ranks merge), the ids replicated
        caps = [factory.replace(c, array=c.array.copy() if "topk" in c.key else
                                np.array_split(c.array, 2)[rank].copy()) for c in ref]
        if rank == bad_rank:
            caps[1].array[0] = 15.0 if caps[1].array[0] != 15.0 else 14.0
        m = manifest(caps, rank, 1000 + rank)
        m["world_size"], m["parallel"] = 2, {"tp_rank": rank, "tp_size": 2}
        for key, entry in m["keys"].items():
            if key.startswith("logits"):
                entry["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 1000 + rank, manifest=m)
    report = cmp.compare(ref_path, tmp_path / "run")
    record = key_record(report, "layer0_step_topk_1")
    assert record.ids is not None and record.floats is None  # read back as ids on both sides
    assert record.dtype_ref == record.dtype_run == "int32" and report.problems == []
    if bad_rank is None:
        assert report.exit_status == 0 and record.status == "ok"
    else:
        assert report.exit_status == 1 and record.divergent and record.merge.worst_rank == str(bad_rank)
        assert report.first_divergence.key == "layer0_step_topk_1"


@pytest.mark.parametrize("drop_rank", [0, 1])
def test_a_step_drop_on_any_rank_of_a_merged_side_is_seen(tmp_path, drop_rank):
    """A merged manifest kept the first rank's `tags`: rank 1's dropped step call went unseen."""
    ref = reference_captures(np.random.default_rng(7))
    ref_path = factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1)

    def edit(rank, manifest):
        if rank == drop_rank:
            manifest["tags"]["logits_shard_<n>"]["drops"] = {"row_out_of_range": 1}
    write_sharded(tmp_path / "run", ref, edit=edit)
    report = cmp.compare(ref_path, tmp_path / "run")
    assert {record.key for record in report.not_comparable} == {f"logits_shard_{n}" for n in range(2)}
    assert any(line.startswith("not comparable: the 2 step keys of logits_shard: step numbering shifted: RUN")
               for line in cmp.format_report(report))

