"""What a side merged from tensor-parallel ranks reports of its manifests: the facts only one
rank's manifest holds are not lost to rank 0's (compare/shards.py `MergedDump`)."""

from __future__ import annotations

import numpy as np

from compiledump.compare import compare
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
