"""What `compiledump compare` reads: ranks and directories, debug_dump.py files without a manifest,
unusable input (exit 2, one line, no traceback), and its memory (at most two arrays per side).

Synthetic dumps from tests/helpers/dumpfactory.py with random data; the naming of the first
divergence itself is tested in test_compare.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
import weakref
import zipfile
from pathlib import Path

import numpy as np
import pytest

from helpers import dumpfactory as factory
from helpers.cli import run_cli
from compiledump import compare as cmp
from compiledump.format.keys import infer_key_infos, order_key_infos
from compiledump.compare.inspect import inspect_dump
from compiledump.format.reader import DumpFile, Member

REPO = Path(__file__).resolve().parents[2]
DEBUG_DUMP = REPO.parent / "shared" / "seed" / "debug_dump.py"  # the original debug_dump.py


# ----------------------------------------------------------------------------------------------
# Ranks and directories
# ----------------------------------------------------------------------------------------------


def test_directories_pair_ranks_and_report_unpaired_ones(tmp_path, capsys):
    rng = np.random.default_rng(70)
    for rank, pid in ((0, 11), (1, 12), (2, 13)):
        captures = factory.model_captures(rng)
        factory.write_compiledump(tmp_path / "ref", captures, rank=rank, pid=pid)
        if rank == 2:
            continue  # RUN lost rank 2
        run = factory.perturb(captures, rng, from_layer=3 if rank == 1 else None)
        factory.write_legacy(tmp_path / "run", run, rank=rank, pid=pid + 100)
    code, out, _ = run_cli(capsys, "compare", tmp_path / "ref", tmp_path / "run", "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    assert [pair["rank"] for pair in report["pairs"]] == ["0", "1"]
    assert report["first_divergence"]["rank"] == "1" and report["first_divergence"]["key"] == "layer3_moe_out"
    assert [(p["kind"], p["rank"]) for p in report["problems"]] == [("unpaired_rank", "2")]
    assert "[rank 1]" in out[-1]


def test_several_files_of_one_rank_use_the_newest(tmp_path):
    rng = np.random.default_rng(73)
    captures = factory.model_captures(rng, layers=2)
    old = factory.write_compiledump(tmp_path / "run", factory.perturb(captures, rng, from_layer=0), pid=5)
    os.utime(old, (1_000_000, 1_000_000))
    factory.write_compiledump(tmp_path / "run", factory.perturb(captures, rng), pid=6)
    ref = factory.write_compiledump(tmp_path / "ref", captures)
    report = cmp.compare(ref, tmp_path / "run")
    assert report.exit_status == 0
    (problem,) = report.problems
    assert (problem.kind, problem.side, problem.rank, problem.file) == ("duplicate_rank", "RUN", "0", str(old))


def test_single_files_pair_regardless_of_rank(tmp_path):
    rng = np.random.default_rng(71)
    captures = factory.model_captures(rng)
    factory.write_compiledump(tmp_path / "ref", captures, rank=0)
    factory.write_compiledump(tmp_path / "run", factory.perturb(captures, rng), rank=3)
    report = cmp.compare(tmp_path / "ref", tmp_path / "run")
    assert report.exit_status == 0 and len(report.pairs) == 1 and report.problems == []


# ----------------------------------------------------------------------------------------------
# Files without a manifest (debug_dump.py files)
# ----------------------------------------------------------------------------------------------


def test_inference_of_kinds_steps_and_order_without_a_manifest():
    members = []
    for key, dtype in [("embed", np.float32), ("layer0_topk", np.int32), ("layer0", np.float32),
                       ("layer1_0", np.float32), ("layer1", np.float32), ("logits", np.float32),
                       ("final_hidden_0", np.float32), ("logits_0", np.float32), ("final_hidden_1", np.float32),
                       ("logits_1", np.float32), ("layer7_2", np.float32), ("layer7_3", np.float32),
                       ("probe_5", np.float32)]:
        members.append(Member(key, np.dtype(dtype), (4,), False, key + ".npy", 0))
    infos = infer_key_infos(members)
    assert infos["layer0_topk"].kind == "ids" and infos["layer0_topk"].layer == 0
    assert infos["layer1_0"].kind == "record" and infos["layer1_0"].layer == 1  # lone layer<N>_0: a record
    assert infos["logits_1"].kind == "step" and infos["logits_1"].step == 1 and infos["logits_1"].tag == "logits"
    assert infos["layer7_2"].kind == "record"  # family without a step 0
    assert infos["probe_5"].kind == "record"
    assert infos["logits"].kind == "record"
    ordered = [info.key for info in order_key_infos(list(infos.values()))]
    assert ordered == ["embed", "layer0_topk", "layer0", "layer1_0", "layer1", "layer7_2", "layer7_3", "logits",
                       "probe_5", "final_hidden_0", "logits_0", "final_hidden_1", "logits_1"]


@contextlib.contextmanager
def debug_dump_module(dump_dir: Path, monkeypatch):
    """Import the original debug_dump.py with dumping enabled and a stand-in `deepinfer.utils`."""
    if not DEBUG_DUMP.is_file():
        pytest.skip(f"debug_dump.py not found at {DEBUG_DUMP} (shared/ must sit beside the repository)")
    torch = pytest.importorskip("torch")
    utils = types.ModuleType("deepinfer.utils")
    utils.allow_cuda_sync = contextlib.nullcontext
    package = types.ModuleType("deepinfer")
    package.utils = utils
    monkeypatch.setitem(sys.modules, "deepinfer", package)
    monkeypatch.setitem(sys.modules, "deepinfer.utils", utils)
    monkeypatch.setenv("DEEPINFER_DUMP_LAYERS", str(dump_dir))
    monkeypatch.setenv("DEEPINFER_DUMP_MOE_LAYERS", "100")
    monkeypatch.delenv("DEEPINFER_DUMP_TOKENS", raising=False)
    spec = importlib.util.spec_from_file_location("debug_dump_under_test", DEBUG_DUMP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        yield module, torch
    finally:
        module._CAPTURED.clear()  # nothing left for its atexit flush


def debug_dump_capture(module, torch, captures: list[factory.Capture], hc: int = 4) -> None:
    """Feed debug_dump.py the tensors that produce ``captures``: 3-D [tokens, hc, dim] whose last
    token's mean over hc equals the capture, ids as int64, logits rows for the steps."""
    generator = torch.Generator().manual_seed(5)
    module.set_rows(1)
    for capture in captures:
        value = torch.from_numpy(capture.array.copy())
        if capture.kind == "ids":
            module.record_ids(capture.tag, value.to(torch.int64))
        elif capture.kind == "step":
            batch = torch.randn((3,) + tuple(value.shape), generator=generator)
            batch[0] = value  # debug_dump.py keeps row 0 of a decode batch
            module.record_step(capture.tag, batch)
        else:
            spread = torch.randn((2, hc) + tuple(value.shape), generator=generator, dtype=torch.float64)
            spread[-1] += value.double() - spread[-1].mean(dim=0)  # last token's hc mean == value
            module.record(capture.tag, spread.float(), once=capture.kind == "record_once")


def test_debug_dump_files_compare_with_compiledump_files(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(80)
    ref = factory.model_captures(rng, layers=4, dim=32)
    with debug_dump_module(tmp_path / "legacy", monkeypatch) as (module, torch):
        debug_dump_capture(module, torch, ref)
        module.flush()
    legacy_file = next((tmp_path / "legacy").glob("deepinfer_layers_rank*_pid*.npz"))
    with np.load(legacy_file) as legacy_arrays:
        assert list(legacy_arrays.files) == [c.key for c in ref]
        for capture in ref:
            assert legacy_arrays[capture.key].dtype == capture.array.dtype
            np.testing.assert_allclose(legacy_arrays[capture.key], capture.array, rtol=1e-5, atol=1e-5)
    compiledump_file = factory.write_compiledump(tmp_path / "cd", factory.perturb(ref, rng), shuffle_with=rng)
    code, out, err = run_cli(capsys, "compare", legacy_file, compiledump_file, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and not err and report["problems"] == []
    assert [record["key"] for record in report["keys"]] == [c.key for c in ref]
    assert [r["kind"] for r in report["keys"]] == [c.kind for c in ref]
    # And the other way round, with a divergence at layer 2 and step 1.
    diverged = factory.write_compiledump(tmp_path / "cd2", factory.perturb(ref, rng, from_layer=2, from_step=1))
    code, out, _ = run_cli(capsys, "compare", diverged, legacy_file, "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and out[-1].startswith("first divergence: layer2_moe_out (layer 2)")
    assert report["prefill_divergence"]["key"] == "layer2_moe_out"
    assert report["prefill_divergence"]["last_good"] == "layer1"
    assert report["decode_divergence"]["step"] == 1
    # A directory holding the debug_dump.py file works as well.
    assert run_cli(capsys, "compare", tmp_path / "legacy", compiledump_file)[0] == 0


def test_manifest_problems_become_notes_and_names_decide(tmp_path):
    rng = np.random.default_rng(81)
    captures = factory.model_captures(rng, layers=3)
    ref = factory.write_compiledump(tmp_path / "ref", captures,
                                    manifest=factory.manifest_for(captures, drops={"token_gate": 5}))
    run = factory.write_compiledump(tmp_path / "run", factory.perturb(captures, rng, from_layer=2))
    run.with_suffix(".json").write_text("{not json")
    report = cmp.compare(ref, run)
    assert report.first_divergence.key == "layer2_moe_out"
    assert report.notes[0].startswith("RUN: manifest compiledump_rank0_pid1000.json unreadable (")
    assert "not captured: REF dropped calls token_gate=5" in report.notes
    assert (report.pairs[0].ref_manifest, report.pairs[0].run_manifest) == (True, False)


# ----------------------------------------------------------------------------------------------
# Unusable input: exit 2, one line, no traceback
# ----------------------------------------------------------------------------------------------


def _malformed_cases(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    rng = np.random.default_rng(90)
    good = factory.write_compiledump(tmp_path / "good", factory.model_captures(rng))
    truncated = tmp_path / "truncated" / "compiledump_rank0_pid1.npz"
    truncated.parent.mkdir()
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    not_zip = tmp_path / "notzip.npz"
    not_zip.write_bytes(os.urandom(300))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "notes.txt").write_text("no dumps here")
    other = tmp_path / "other.npz"
    np.savez(other, unrelated=rng.standard_normal(5))
    two_ranks = tmp_path / "two_ranks"
    two_ranks.mkdir()
    for rank in (3, 4):
        shutil.copy(good, two_ranks / f"compiledump_rank{rank}_pid1.npz")
    return {
        "truncated npz": (good, truncated),
        "not a zip": (not_zip, good),
        "directory without dumps": (good, empty_dir),
        "no common keys": (good, other),
        "missing file": (good, tmp_path / "does_not_exist.npz"),
        "no rank in common": (two_ranks, good.parent),
    }


def test_a_step_of_an_integer_tensor_is_read_as_ids(tmp_path):
    """`record_step` stores an integer tensor (a step's expert ids) as float32; the manifest's
    integer source dtype makes the reader give it back as int32 ids (docs/format.md). Without a
    manifest, or with a float source dtype, a float32 step stays floats."""
    rng = np.random.default_rng(11)
    ids = rng.choice(300, size=6, replace=False).astype(np.float32)  # exact in float32
    logits = rng.standard_normal(6).astype(np.float32)
    captures = [factory.Capture("moe_topk_0", ids, "step", "moe_topk", 0),
                factory.Capture("moe_topk_1", ids[::-1].copy(), "step", "moe_topk", 1),
                factory.Capture("logits_0", logits, "step", "logits", 0),
                factory.Capture("logits_1", logits, "step", "logits", 1)]
    fields = {key: {"source_dtype": dtype} for key, dtype in
              (("moe_topk_0", "int64"), ("moe_topk_1", "uint8"))}
    path = factory.write_compiledump(tmp_path / "m", captures, manifest=factory.manifest_for(captures, key_fields=fields))
    dump = DumpFile(path, "REF")
    for key in ("moe_topk_0", "moe_topk_1"):
        assert dump.members[key].is_integer
        array = dump.array(key)
        assert array.dtype == np.int32
        np.testing.assert_array_equal(array, captures[int(key[-1])].array.astype(np.int64))
    assert not dump.members["logits_0"].is_integer and dump.array("logits_0").dtype == np.float32
    shown = {entry["key"]: entry for entry in inspect_dump(dump)["keys"]}
    assert shown["moe_topk_0"]["dtype"] == "int32" and shown["logits_0"]["dtype"] == "float32"
    legacy = DumpFile(factory.write_legacy(tmp_path / "l", captures), "REF")
    assert not legacy.members["moe_topk_0"].is_integer and legacy.array("moe_topk_0").dtype == np.float32


def test_malformed_input_exits_2_with_one_line(tmp_path, capsys):
    for name, (ref, run) in _malformed_cases(tmp_path).items():
        code, out, err = run_cli(capsys, "compare", ref, run)
        assert code == 2, name
        assert len(err) == 1 and err[0].startswith("compiledump: error:"), (name, err)
        assert out == [], name
        if name in ("missing file", "directory without dumps"):  # a run whose COMPILEDUMP_DIR was not set
            assert err[0].endswith("a run writes its dump into COMPILEDUMP_DIR (capture is off without it) "
                                   "when it captured something"), err
    code, _, err = run_cli(capsys, "inspect", tmp_path / "truncated" / "compiledump_rank0_pid1.npz")
    assert code == 2 and len(err) == 1 and err[0].startswith("compiledump: error:")


def test_malformed_input_through_python_dash_m_has_no_traceback(tmp_path):
    cases = _malformed_cases(tmp_path)
    ref, run = cases["truncated npz"]
    done = subprocess.run([sys.executable, "-m", "compiledump", "compare", str(ref), str(run)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("compiledump: error:")
    assert "Traceback" not in done.stderr and "truncated" in done.stderr


def test_unreadable_member_is_a_problem_not_a_crash(tmp_path):
    rng = np.random.default_rng(91)
    captures = factory.model_captures(rng)
    ref_path = factory.write_compiledump(tmp_path / "ref", captures)
    run_path = factory.write_compiledump(tmp_path / "run", factory.perturb(captures, rng))
    # Corrupt one member's .npy magic in place (the zip directory stays intact).
    with zipfile.ZipFile(run_path) as archive:
        info = archive.getinfo("layer1.npy")
    data = bytearray(run_path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + int.from_bytes(data[info.header_offset + 28:
                                                                               info.header_offset + 30], "little")
    data[start:start + 6] = b"BROKEN"
    run_path.write_bytes(bytes(data))
    report = cmp.compare(ref_path, run_path)
    assert [(p.kind, p.key, p.side) for p in report.problems] == [("unreadable", "layer1", "RUN")]
    # Both sides hold layer1; it was not compared, so the comparison is not called clean.
    assert [(r.key, r.status) for r in report.not_compared] == [("layer1", "skipped")]
    assert report.exit_status == 3


def test_compressed_npz_is_read(tmp_path):
    rng = np.random.default_rng(92)
    captures = factory.model_captures(rng)
    ref_path = factory.write_compiledump(tmp_path / "ref", captures)
    run_path = tmp_path / "run" / "compiledump_rank0_pid5.npz"
    run_path.parent.mkdir()
    run = factory.perturb(captures, rng, from_layer=1)
    np.savez_compressed(run_path, **{c.key: c.array for c in run})
    run_path.with_suffix(".json").write_text(json.dumps(factory.manifest_for(run, pid=5)))
    report = cmp.compare(ref_path, run_path)
    assert report.first_divergence.key == "layer1_moe_out"


# ----------------------------------------------------------------------------------------------
# Memory: at most two arrays per side alive at once
# ----------------------------------------------------------------------------------------------


def test_at_most_two_arrays_per_side_are_alive(tmp_path, monkeypatch):
    rng = np.random.default_rng(100)
    ref = factory.model_captures(rng, layers=5, dim=40_001, steps=4, vocab=50_001)
    factory.write_compiledump(tmp_path / "ref", ref)
    factory.write_compiledump(tmp_path / "run", factory.perturb(ref, rng, from_layer=3))
    live = {"REF": 0, "RUN": 0}
    peak = {"REF": 0, "RUN": 0}
    kinds = set()
    original = DumpFile.array

    def release(label):
        live[label] -= 1

    def tracked_with_release(self, key):
        array = original(self, key)
        kinds.add(type(array).__name__)
        live[self.label] += 1
        peak[self.label] = max(peak[self.label], live[self.label])
        weakref.finalize(array, release, self.label)
        return array

    monkeypatch.setattr(DumpFile, "array", tracked_with_release)
    report = cmp.compare(tmp_path / "ref", tmp_path / "run")
    assert report.first_divergence.key == "layer3_moe_out"
    assert 1 <= peak["REF"] <= 2 and 1 <= peak["RUN"] <= 2
    assert "memmap" in kinds  # large members are mapped, not read
