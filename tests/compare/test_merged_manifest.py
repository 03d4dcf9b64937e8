"""What a side merged from tensor-parallel ranks reports of its manifests: the facts only one
rank's manifest holds are not lost to rank 0's (compare/shards.py `MergedDump`)."""

from __future__ import annotations

import numpy as np
import pytest

from compiledump.compare import compare, format_report
from helpers import dumpfactory as factory
from helpers.dumpfactory import Capture


def test_a_non_finite_value_in_one_ranks_shard_is_the_merged_sides_first(tmp_path):
    """The first NaN/Inf only rank 1's shard (or rank 2's, earlier) held was dropped from the
    report: the merged side read rank 0's manifest alone (a helper's audit)."""
    rng = np.random.default_rng(3)
    full = rng.standard_normal(24).astype(np.float32)
    hidden = rng.standard_normal(9).astype(np.float32)
    factory.write_compiledump(tmp_path / "ref", [Capture("layer1_up", full, "record", "layer1_up"),
                                                 Capture("layer1", hidden, "record", "layer1")], rank="x", pid=1)
    first = {"key": "layer2_up", "tag": "layer2_up", "phase": "decode", "step": 3, "tokens": 1, "count": 2,
             "saturated": False}
    firsts = {1: first, 2: {**first, "key": "layer1_up", "tag": "layer1_up", "step": 1}}
    for rank, part in enumerate(np.array_split(full, 4)):
        caps = [Capture("layer1_up", part, "record", "layer1_up"), Capture("layer1", hidden, "record", "layer1")]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest.update(world_size=4, parallel={"tp_rank": rank, "tp_size": 4}, first_nonfinite=firsts.get(rank))
        manifest["keys"]["layer1_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    report = compare(tmp_path / "ref", tmp_path / "run")
    (pair,) = report.pairs
    assert pair.nonfinite["RUN"]["key"] == "layer1_up" and pair.nonfinite["REF"] is None
    assert report.first_divergence is None  # the shards merge to REF's value


def test_ids_derived_from_a_merged_sides_router_logits_name_their_ranks(tmp_path):
    """A tensor-parallel MoE engine whose gates return their logits alone (vLLM's) records router
    logits on every rank and no ids; the reference records both. The ids compare derives from the
    merged side's logits had no rank behind them, and compare crashed (IndexError) on every such
    run, exiting 1 as for a divergence (a new user's TP bring-up)."""
    rng = np.random.default_rng(5)
    tokens, experts, top_k = 7, 8, 2
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    ids = np.argsort(-logits, axis=1)[:, :top_k].astype(np.int32)  # the reference's plain top-k
    hidden = rng.standard_normal(9).astype(np.float32)
    up = rng.standard_normal(12).astype(np.float32)
    ref = [Capture("layer0_router", logits, "record", "layer0_router"), Capture("layer0_topk", ids, "ids", "layer0_topk"),
           Capture("layer0_up", up, "record", "layer0_up"), Capture("layer0", hidden, "record", "layer0")]
    factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1)
    for rank, part in enumerate(np.array_split(up, 2)):
        caps = [Capture("layer0_router", logits, "record", "layer0_router"),  # replicated: every rank's gate
                Capture("layer0_up", part, "record", "layer0_up"), Capture("layer0", hidden, "record", "layer0")]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest.update(world_size=2, parallel={"tp_rank": rank, "tp_size": 2})
        manifest["keys"]["layer0_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    report = compare(tmp_path / "ref", tmp_path / "run")
    assert report.first_divergence is None
    (pair,) = report.pairs
    (derived,) = [record for record in pair.keys if record.key == "layer0_topk"]
    assert not derived.divergent and [part.rank for part in derived.merge.ranks] == ["0"]
    assert any("derived" in note for note in pair.notes)


@pytest.mark.parametrize("rank_one_only", [False, True])
def test_a_replicated_key_equal_on_every_rank_names_no_rank(tmp_path, rank_one_only):
    """A bug on rank 1 alone before an all-reduce leaves both ranks bit-equal values after it: the
    verdict said `worst rank 0`, the tie's first (a new user's TP bring-up). Equal copies now name
    no rank; copies that differ still name the worst."""
    rng = np.random.default_rng(8)
    hidden, up = rng.standard_normal(16).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    factory.write_compiledump(tmp_path / "ref", [Capture("layer1_up", up, "record", "layer1_up"),
                                                 Capture("layer1", hidden, "record", "layer1")], rank="x", pid=1)
    broken = hidden * np.float32(1.5)
    for rank, part in enumerate(np.array_split(up, 2)):
        value = broken if rank == 1 or not rank_one_only else hidden
        caps = [Capture("layer1_up", part, "record", "layer1_up"), Capture("layer1", value, "record", "layer1")]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest.update(world_size=2, parallel={"tp_rank": rank, "tp_size": 2})
        manifest["keys"]["layer1_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    report = compare(tmp_path / "ref", tmp_path / "run")
    merge = report.first_divergence.merge
    text = "\n".join(format_report(report))
    if rank_one_only:
        assert merge.worst_rank == "1" and not merge.identical and "on rank 1 only" in text
    else:
        assert merge.worst_rank is None and merge.identical
        assert "bit-identical" in text and "worst rank" not in text
        assert report.to_json()["pairs"][0]["first_divergence"]["identical_on_ranks"] is True


@pytest.mark.parametrize("groups", [{}, {"dp_rank": 0, "dp_size": 1}])
def test_a_rank_whose_manifest_lost_its_declarations_is_not_compared_as_whole(tmp_path, groups):
    """Rank 0 declares a partial-sum shard and its tp coordinates; rank 1's manifest has neither (a
    rank recovered from a crash before its declarations were journaled). Rank 1 was put in a set of
    its own, and its partial sum compared with the whole value: a false divergence, exit 1 (a new
    user's TP bring-up; with set_parallel(tp, dp) on rank 0 still so after the first fix, a review).
    Both ranks now form one set, and the key is a shard_mismatch."""
    rng = np.random.default_rng(11)
    whole, hidden = rng.standard_normal(12).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    factory.write_compiledump(tmp_path / "ref", [Capture("layer0_o", whole, "record", "layer0_o"),
                                                 Capture("layer0", hidden, "record", "layer0")], rank="x", pid=1)
    first = rng.standard_normal(12).astype(np.float32)
    for rank, part in enumerate((first, whole - first)):
        caps = [Capture("layer0_o", part, "record", "layer0_o"), Capture("layer0", hidden, "record", "layer0")]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest["world_size"] = 2
        if rank == 0:
            manifest["parallel"] = {"tp_rank": 0, "tp_size": 2, **groups}
            manifest["keys"]["layer0_o"]["shard"] = {"dim": None, "how": "sum", "group": "tp"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    report = compare(tmp_path / "ref", tmp_path / "run")
    assert report.first_divergence is None and report.exit_status != 1
    (pair,) = report.pairs
    assert pair.rank == "0+1"
    assert [(p.kind, p.key) for p in pair.problems if p.kind == "shard_mismatch"] == [("shard_mismatch", "layer0_o")]


def test_a_merged_side_with_a_recovered_rank_says_so(tmp_path):
    """Only rank 0's manifest was read for the merged side's facts: rank 1 recovered after a kill
    went without the note that the side ends where that process stopped."""
    rng = np.random.default_rng(13)
    up, hidden = rng.standard_normal(10).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    factory.write_compiledump(tmp_path / "ref", [Capture("layer0_up", up, "record", "layer0_up"),
                                                 Capture("layer0", hidden, "record", "layer0")], rank="x", pid=1)
    for rank, part in enumerate(np.array_split(up, 2)):
        caps = [Capture("layer0_up", part, "record", "layer0_up"), Capture("layer0", hidden, "record", "layer0")]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest.update(world_size=2, parallel={"tp_rank": rank, "tp_size": 2})
        manifest["keys"]["layer0_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        if rank == 1:
            manifest["recovered"] = {"from": "x.live", "cause": "killed", "recovered_unix": 1.0, "torn_journal_line": False}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    report = compare(tmp_path / "ref", tmp_path / "run")
    assert report.first_divergence is None
    assert any(note.startswith("RUN was recovered") and "rank 1: killed" in note for note in report.notes)


def test_a_sharded_key_replicated_across_another_group_still_names_its_worst_rank(tmp_path):
    """TP x EP: a TP-sharded key has one merged copy per EP rank, bit-equal when TP rank 1's slice
    is wrong in both; taking them for identical replicas named no rank (a review)."""
    rng = np.random.default_rng(3)
    up, experts = rng.standard_normal(10).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    factory.write_compiledump(tmp_path / "ref", [Capture("layer0_up", up, "record", "layer0_up"),
                                                 Capture("layer0_experts", experts, "record", "layer0_experts")],
                              rank="x", pid=1)
    for rank in range(4):
        tp, ep = rank % 2, rank // 2
        part = np.array_split(up, 2)[tp] * np.float32(1.5 if tp == 1 else 1)
        caps = [Capture("layer0_up", part, "record", "layer0_up"),
                Capture("layer0_experts", np.array_split(experts, 2)[ep], "record", "layer0_experts")]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest.update(world_size=4, parallel={"tp_rank": tp, "tp_size": 2, "ep_rank": ep, "ep_size": 2})
        manifest["keys"]["layer0_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        manifest["keys"]["layer0_experts"]["shard"] = {"dim": 0, "how": "concat", "group": "ep"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    merge = compare(tmp_path / "ref", tmp_path / "run").first_divergence.merge
    assert merge.worst_rank == "1" and not merge.identical and merge.divergent_ranks == ["1", "3"]


def test_a_replica_without_coordinates_beside_a_complete_set_is_compared_on_its_own(tmp_path):
    """A TP=1 replica (no parallel coordinates) beside a complete TP=2 set joined the set, so its
    whole value made the set's keys shard_mismatch and hid a divergence of its own (a review)."""
    rng = np.random.default_rng(23)
    up = rng.standard_normal(10).astype(np.float32)
    factory.write_compiledump(tmp_path / "ref", [Capture("layer0_up", up, "record", "layer0_up")], rank="x", pid=1)
    for rank, part in enumerate(np.array_split(up, 2)):
        caps = [Capture("layer0_up", part, "record", "layer0_up")]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest.update(world_size=3, parallel={"tp_rank": rank, "tp_size": 2})
        manifest["keys"]["layer0_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    factory.write_compiledump(tmp_path / "run", [Capture("layer0_up", up * np.float32(1.5), "record", "layer0_up")],
                              rank=2, pid=12)
    report = compare(tmp_path / "ref", tmp_path / "run")
    assert [pair.rank for pair in report.pairs] == ["0+1", "2"]
    assert report.first_divergence.key == "layer0_up" and report.first_divergence.rank == "2"
    assert not [problem for problem in report.problems if problem.kind == "shard_mismatch"]


def test_partial_sums_equal_on_every_rank_name_the_declaration(tmp_path):
    """An expert-parallel block output already all-reduced, declared `how="sum"`: every rank's
    "partial sum" is the whole value, and the merged sum is twice it. The divergence says the
    partials are bit-identical, as a reduced value is, and what to drop (before: "partial sums, no
    single rank can be named"); real partial sums do not say so."""
    rng = np.random.default_rng(9)
    hidden = rng.standard_normal(13).astype(np.float32)
    factory.write_compiledump(tmp_path / "ref", [Capture("layer0_mlp", hidden, "record", "layer0_mlp")], rank="x", pid=1)
    for name, parts in (("copies", [hidden, hidden]), ("partials", [hidden * 0.25, hidden * 0.75 * 1.2])):
        for rank, part in enumerate(parts):
            caps = [Capture("layer0_mlp", part.astype(np.float32), "record", "layer0_mlp")]
            manifest = factory.manifest_for(caps, rank, pid=10 + rank)
            manifest.update(world_size=2, parallel={"ep_rank": rank, "ep_size": 2})
            manifest["keys"]["layer0_mlp"]["shard"] = {"dim": None, "how": "sum", "group": "ep"}
            factory.write_compiledump(tmp_path / name, caps, rank, 10 + rank, manifest=manifest)
        report = compare(tmp_path / "ref", tmp_path / name)
        first = report.first_divergence
        assert first is not None and first.key == "layer0_mlp"
        record = report.pairs[0].keys[0]
        said = format_report(report, table="none")[-1]
        assert record.merge.equal_partial_sums is (name == "copies")
        assert ("every rank's partial sum is bit-identical" in said) is (name == "copies"), said
        assert ("drop its declare_shard" in said) is (name == "copies")


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_a_merged_side_any_of_whose_ranks_died_ended_early(tmp_path, dead_rank):
    """torchrun stops every rank after one failed: the rank whose dump says so may be any (before,
    only rank 0's `ended_by` was read: with rank 1's, exit 0)."""
    rng = np.random.default_rng(4)
    full = rng.standard_normal(16).astype(np.float32)
    steps = [rng.standard_normal(7).astype(np.float32) for _ in range(2)]
    ref = [Capture("layer0_up", full, "record", "layer0_up")] + [
        Capture(f"logits_{n}", steps[n], "step", "logits", n) for n in range(2)]
    factory.write_compiledump(tmp_path / "ref", ref, rank="x", pid=1)
    for rank, part in enumerate(np.array_split(full, 2)):
        caps = [Capture("layer0_up", part, "record", "layer0_up"), Capture("logits_0", steps[0], "step", "logits", 0)]
        manifest = factory.manifest_for(caps, rank, pid=10 + rank)
        manifest.update(world_size=2, parallel={"tp_rank": rank, "tp_size": 2})
        manifest["keys"]["layer0_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        if rank == dead_rank:
            manifest["ended_by"] = {"signal": "SIGTERM"}
        factory.write_compiledump(tmp_path / "run", caps, rank, 10 + rank, manifest=manifest)
    report = compare(tmp_path / "ref", tmp_path / "run")
    assert report.exit_status == 3 and report.pairs[0].ended_early is not None
    assert any(f"handler as that signal ended the process (rank {dead_rank}'s)" in note for note in report.notes)
