"""Multi-rank runs, the runtime side: set_parallel and declare_shard, the parallel metadata in
the manifest, and real tensor-parallel ranks (torch.distributed, gloo, torch.compile) whose
merged dumps equal one process's (the comparator's merging on synthetic dumps:
tests/compare/test_shard_merge.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump import compare as cmp
from helpers import forked

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


# ----------------------------------------------------------------------------------------------
# Runtime: set_parallel, declare_shard, the manifest
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 1}, "<group>_rank or <group>_size"),
    ({"tp_rank": -1}, "non-negative int"),
    ({"tp_rank": True}, "non-negative int"),
    ({"tp_rank": 1.0}, "non-negative int"),
    ({"tp_rank": 2, "tp_size": 2}, "not below tp_size=2"),
    ({"tp_size": 0}, "must be positive"),
    ({"world_rank": 0}, "come from RANK"),
])
def test_set_parallel_rejects_bad_input(dump_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compiledump.set_parallel(**kwargs)


@pytest.mark.parametrize("args,kwargs,error,match", [
    (("",), {"dim": 0}, TypeError, "non-empty regex"),
    (("layer(",), {"dim": 0}, ValueError, "bad regex"),
    (("x",), {"dim": 0, "how": "mean"}, ValueError, "how must be one of"),
    (("x",), {}, ValueError, "needs an int dim"),
    (("x",), {"dim": 0, "how": "sum"}, ValueError, "takes no dim"),
    (("x",), {"dim": 0, "group": "t p"}, ValueError, "group must be a name"),
])
def test_declare_shard_rejects_bad_input(dump_dir, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        compiledump.declare_shard(*args, **kwargs)


def test_manifest_records_parallel_groups_and_shards(dump_dir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    compiledump.set_parallel(tp_rank=1, tp_size=2, dp_rank=0, dp_size=2)
    compiledump.declare_shard(r"layer\d+_up", dim=-1)
    compiledump.declare_shard("layer0_up", dim=0, group="world")  # the last matching declaration wins
    compiledump.declare_shard("part", how="sum")
    compiledump.declare_shard("logits", dim=0)
    compiledump.record("layer0_up", torch.randn(3, 8))
    compiledump.record("layer1_up", torch.randn(3, 4, 8))
    compiledump.record("part", torch.randn(3, 8))
    compiledump.record("layer1", torch.randn(3, 8))
    compiledump.record_step("logits", torch.randn(1, 10))
    compiledump.record_step("logits", torch.randn(1, 10))
    manifest = json.loads(Path(compiledump.flush()).with_suffix(".json").read_text())
    assert manifest["rank"] == "1" and manifest["world_size"] == 4
    assert manifest["parallel"] == {"tp_rank": 1, "tp_size": 2, "dp_rank": 0, "dp_size": 2}
    keys = manifest["keys"]
    assert keys["layer0_up"]["shard"] == {"dim": 0, "how": "concat", "group": "world"}
    assert keys["layer1_up"]["shard"] == {"dim": 0, "how": "concat", "group": "tp"}  # -1 of a 1-D row
    assert keys["part"]["shard"] == {"dim": None, "how": "sum", "group": "tp"}
    assert keys["logits_0"]["shard"] == keys["logits_1"]["shard"] == {"dim": 0, "how": "concat", "group": "tp"}
    assert "shard" not in keys["layer1"]
    assert compiledump.get_parallel() == {"tp_rank": 1, "tp_size": 2, "dp_rank": 0, "dp_size": 2}
    compiledump.reset()
    assert compiledump.get_parallel() == {}


def test_a_declared_layer_tag_covers_its_decode_step_states(dump_dir):
    """An EP rank's MoE output before the all-reduce, declared as the docs show: its steps
    (`layer<i>_mlp_step`, instrument's) are partial sums too (before: unmarked, compared as whole
    values, a false divergence at `layer0_mlp_step_1`); a hand-written `<tag>_step` of another
    kind of tag is not covered."""
    compiledump.set_parallel(ep_rank=0, ep_size=2)
    compiledump.declare_shard(r"layer\d+_attn_step", dim=-1, group="ep")  # the step tag's own declaration wins
    compiledump.declare_shard(r"layer\d+_attn", how="sum", group="ep")
    compiledump.declare_shard(r"layer\d+_mlp", how="sum", group="ep")
    compiledump.declare_shard(r"layer\d+", dim=-1, group="ep")
    compiledump.declare_shard("probe", dim=-1, group="ep")
    for tag in ("layer0_mlp", "layer1", "probe", "layer0_attn"):
        compiledump.record(tag, torch.randn(3, 8))
        compiledump.record_step(f"{tag}_step", torch.randn(1, 8))
    keys = json.loads(Path(compiledump.flush()).with_suffix(".json").read_text())["keys"]
    assert keys["layer0_mlp_step_0"]["shard"] == keys["layer0_mlp"]["shard"] == {"dim": None, "how": "sum", "group": "ep"}
    assert keys["layer1_step_0"]["shard"] == keys["layer1"]["shard"] == {"dim": 0, "how": "concat", "group": "ep"}
    assert "shard" in keys["probe"] and "shard" not in keys["probe_step_0"]
    assert keys["layer0_attn_step_0"]["shard"]["how"] == "concat" and keys["layer0_attn"]["shard"]["how"] == "sum"


def test_a_broad_declaration_then_an_override_cover_the_steps_as_the_override(dump_dir):
    compiledump.set_parallel(tp_rank=0, tp_size=2, ep_rank=0, ep_size=2)
    compiledump.declare_shard(r"layer\d+_\w+", dim=-1, group="tp")  # every layer internal, then the MoE output
    compiledump.declare_shard(r"layer\d+_mlp", how="sum", group="ep")
    compiledump.record("layer0_mlp", torch.randn(3, 8))
    compiledump.record_step("layer0_mlp_step", torch.randn(1, 8))
    keys = json.loads(Path(compiledump.flush()).with_suffix(".json").read_text())["keys"]
    assert keys["layer0_mlp_step_0"]["shard"] == keys["layer0_mlp"]["shard"] == {"dim": None, "how": "sum", "group": "ep"}


def test_shard_declarations_that_cannot_apply_warn_at_flush(dump_dir):
    compiledump.declare_shard("a", dim=1)  # the stored row of a 2-D record is 1-D
    compiledump.declare_shard("b", dim=0, group="ep")  # no ep_rank given
    compiledump.record("a", torch.randn(3, 8))
    compiledump.record("b", torch.randn(3, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = compiledump.flush()
    messages = [str(w.message) for w in caught]
    assert any("key 'a' has 1 dimension(s); not marked as a shard" in m for m in messages)
    assert any("set_parallel() was not given ep_rank" in m for m in messages)
    keys = json.loads(Path(path).with_suffix(".json").read_text())["keys"]
    assert "shard" not in keys["a"] and keys["b"]["shard"]["group"] == "ep"


def test_parallel_api_is_exported_lazily():
    code = ("import sys, compiledump; assert 'torch' not in sys.modules; "
            "assert {'set_parallel', 'declare_shard', 'get_parallel'} <= set(compiledump.__all__); "
            "compiledump.declare_shard('x', dim=0); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


# ----------------------------------------------------------------------------------------------
# Real processes: torch.distributed (gloo) ranks under torch.compile
# ----------------------------------------------------------------------------------------------


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "helpers"), str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_tensor_parallel_ranks_under_compile_merge_against_one_process(tmp_path, dump_dir):
    """Acceptance 1: 2 gloo ranks run a column/row-parallel model compiled with
    fullgraph=True (all_reduce and all_gather inside the graph), each writes its file, and the
    comparator merges them against the unsharded single-process reference; a wrong shard on
    rank 1 is reported with rank 1 named."""
    from helpers import tp_model

    world = 2
    store = tmp_path / "store"
    # Each rank a process of its own, forked from one that imported torch (helpers/forked.py).
    procs = [forked.start([str(TESTS / "helpers" / "tp_model.py"), str(rank), str(world), f"file://{store}",
                           str(tmp_path), "1"], env=_child_env())
             for rank in range(world)]
    # The reference, unsharded and eager, in this process while the ranks compile.
    reference_tokens = tp_model.generate(tp_model.make_forward(None), tp_model.weights())
    ref_path = compiledump.flush()
    outputs = ["".join(proc.communicate(timeout=240)) for proc in procs]  # stdout, then stderr
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
    for rank, output in enumerate(outputs):
        assert f"rank {rank} run: tokens {reference_tokens}" in output, output
        assert f"rank {rank} run: graph breaks 0" in output and f"rank {rank} run_bug: graph breaks 0" in output

    # One file per rank, named by the torch.distributed rank, in one shared directory; the
    # flush at exit (after destroy_process_group) rewrote the same files.
    run_dir, bug_dir = tmp_path / "run", tmp_path / "run_bug"
    names = sorted(p.name for p in run_dir.iterdir())
    assert [n.split("_pid")[0] for n in names] == ["compiledump_rank0"] * 2 + ["compiledump_rank1"] * 2
    for rank in range(world):
        (manifest_path,) = run_dir.glob(f"compiledump_rank{rank}_pid*.json")
        manifest = json.loads(manifest_path.read_text())
        assert manifest["rank"] == str(rank) and manifest["world_size"] == world
        assert manifest["parallel"] == {"tp_rank": rank, "tp_size": world}
        assert manifest["keys"]["layer0_up"]["shard"] == {"dim": 0, "how": "concat", "group": "tp"}
        assert manifest["keys"]["layer1_partial"]["shard"] == {"dim": None, "how": "sum", "group": "tp"}

    report = cmp.compare(ref_path, run_dir)
    assert report.exit_status == 0 and report.problems == [], report.problems
    assert report.pairs[0].rank == "0+1"
    with np.load(ref_path) as ref_data:
        assert report.pairs[0].compared == len(ref_data.files)
    assert max(r.floats.rel_diff for r in report.keys if r.floats is not None) < 1e-10
    assert next(r for r in report.keys if r.key == "layer1_up").merge.how == "concat tp dim 0"

    buggy = cmp.compare(ref_path, bug_dir)
    first = buggy.first_divergence
    assert (first.key, first.merge.worst_rank, first.merge.divergent_ranks) == ("layer1_up", "1", ["1"])
    assert first.last_good == "layer0"
    assert "worst rank 1" in cmp.final_line(buggy)


def test_data_parallel_processes_all_reporting_rank0_share_a_directory(tmp_path):
    """Several processes with RANK=0 writing into one directory at once: one complete file
    each (the pid tells them apart), none lost or overwritten."""
    script = textwrap.dedent("""
        import os, torch, compiledump
        for step in range(50):
            compiledump.record_step("h", torch.full((1, 64), float(os.getpid())))
            if step % 10 == 0:
                compiledump.flush()
    """)
    env = dict(_child_env(), COMPILEDUMP_DIR=str(tmp_path), RANK="0")
    # Processes of their own, forked from one that imported torch (helpers/forked.py).
    procs = [forked.start(["-c", script], env=env) for _ in range(3)]
    pids = {proc.pid for proc in procs}
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    files = sorted(tmp_path.glob("compiledump_rank0_pid*.npz"))
    assert {int(p.stem.split("pid")[1]) for p in files} == pids
    for path in files:
        pid = int(path.stem.split("pid")[1])
        with np.load(path) as data:
            assert sorted(data.files, key=lambda k: int(k[2:])) == [f"h_{n}" for n in range(50)]
            assert all((data[k] == pid).all() for k in data.files)
    assert not list(tmp_path.glob(".*.tmp"))
