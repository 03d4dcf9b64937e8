"""The C++ flush (kernels/dump.cpp, compiledump::Dump::flush) against compiledump.flush() on one
snapshot: a Python process captures into its arena (random data with NaN/Inf, every kind, drops
of each reason the counters give, a layer's step state bounded by COMPILEDUMP_LAYER_STEPS, tags
past the table), flushes, and saves the arena and the control block raw; the C++-only driver's
`--flush-snapshot` flushes the same words through the C++ API, named by the registry's plan
(compiledump.aot.plan_text). Both dumps must hold the same arrays and the same manifest entries.

The C++ dump once lacked `first_nonfinite` and each tag's `nonfinite` (a NaN in a C++-only run
went unreported), counted a bounded layer step state's deliberate drops as `step_capacity` (a
loss, with a warning to raise COMPILEDUMP_MAX_STEPS), and two Dumps of one process overwrote
each other's files.
"""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump import aot
from compiledump.capture.state import STATE

SETTINGS = dict(tokens=5, max_steps=6, layer_steps=2, max_tags=7, arena_mb=1)


def _manifest(npz: str) -> dict:
    return json.loads(Path(npz).with_suffix(".json").read_text())


def _with(x: torch.Tensor, g: torch.Generator, value: float, count: int) -> torch.Tensor:
    """`x` with `count` values of its last row (the row a record keeps and reads) set to `value`."""
    x = x.clone()
    row = x[-1].reshape(-1)  # a view unless the row is non-contiguous
    places = torch.randperm(row.numel(), generator=g)[:count]
    row[places] = value
    x[-1] = row.reshape(x[-1].shape)
    return x


def _capture(g: torch.Generator) -> None:
    """A prompt of 5 tokens, then decode steps, through every capture kind."""
    hidden = torch.randn(5, 4, 19, generator=g).bfloat16().transpose(0, 1).contiguous().transpose(0, 1)
    compiledump.record("layer0", _with(hidden, g, float("nan"), 3))  # NaN in the prompt: the first one
    compiledump.record_ids("layer0_topk", torch.randint(0, 64, (5, 2), generator=g))
    compiledump.record("layer0_mlp", torch.randn(7, 11, generator=g))  # 7 tokens: token_gate
    scores = torch.randn(5, 13, generator=g).half()
    compiledump.record("layer1_index_router", _with(scores, g, float("-inf"), 4))  # masked: never first
    compiledump.record("once", torch.randn(5, 6, generator=g)[:, ::2], once=True)
    for step in range(8):
        state = torch.randn(1, 9, generator=g).half()
        compiledump.record_step("layer0_step", state)  # 2 kept, the rest layer_steps (deliberate)
        logits = torch.randn(1, 33, generator=g)
        compiledump.record_step("logits", _with(logits, g, float("inf"), 2) if step in (3, 5) else logits)
        compiledump.record("past_the_table", logits)  # the 8th tag: tag_table_full


@pytest.fixture
def snapshot(tmp_path):
    """(the Python dump, the files the driver flushes): plan, config, ctrl and arena words."""
    previous = compiledump.get_config()
    compiledump.reset()
    try:
        compiledump.configure(dir=str(tmp_path / "python"), **SETTINGS)
        with pytest.warns(RuntimeWarning):  # the drops' warnings
            _capture(torch.Generator().manual_seed(7))
            reference = compiledump.flush()
        rt = STATE.runtime
        files = {"plan": tmp_path / "plan.txt", "config": tmp_path / "config.json",
                 "ctrl": tmp_path / "ctrl.i32", "arena": tmp_path / "arena.f32"}
        metadata = aot.plan_metadata(rt)
        files["plan"].write_text(metadata[aot.PLAN_KEY])
        files["config"].write_text(metadata[aot.CONFIG_KEY])
        files["ctrl"].write_bytes(rt.ctrl.numpy().tobytes())
        files["arena"].write_bytes(rt.arena.numpy().tobytes())
        yield reference, files
    finally:
        compiledump.reset()
        compiledump.configure(**{**vars(previous)})


def _flush_snapshot(driver: Path, files: dict, out: Path, copies: int = 1) -> list[str]:
    done = subprocess.run([str(driver), "--flush-snapshot", *(str(files[k]) for k in ("plan", "config", "ctrl", "arena")),
                           str(out), str(copies)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()


def test_cpp_flush_writes_the_python_dump(snapshot, native_build, tmp_path):
    reference, files = snapshot
    want = _manifest(reference)
    # The snapshot holds what the test means it to: each manifest entry below is exercised.
    assert want["first_nonfinite"]["key"] == "layer0" and want["first_nonfinite"]["phase"] == "prefill"
    assert want["tags"]["layer1_index_router"]["nonfinite"]["count"] == 4
    assert want["tags"]["logits_<n>"]["nonfinite"] == {
        "key": "logits_3", "tag": "logits", "phase": "decode", "step": 3, "tokens": 1, "count": 4, "saturated": False}
    assert want["tags"]["layer0_step_<n>"]["drops"] == {"layer_steps": 6}
    assert want["tags"]["logits_<n>"]["drops"] == {"step_capacity": 2}
    assert want["tags"]["layer0_mlp"]["drops"] == {"token_gate": 1}
    assert want["drops"]["tag_table_full"] == 8

    paths = _flush_snapshot(native_build / "compiledump_aoti_driver", files, tmp_path / "cpp", copies=2)
    for path in paths:
        have = _manifest(path)
        assert have["writer"] == "native"
        for field in ("keys", "tags", "drops", "filtered_tags", "first_nonfinite", "prompt_tokens", "arena_words_used"):
            assert have[field] == want[field], field
        with np.load(reference) as ref, np.load(path) as got:
            assert sorted(got.files) == sorted(ref.files)
            for key in ref.files:
                assert got[key].dtype == ref[key].dtype, key
                np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
    # Two Dumps of one process: the second takes the next free name instead of overwriting.
    first, second = paths
    assert Path(first).name.endswith(f"_pid{_manifest(first)['pid']}.npz")
    assert Path(second).name == Path(first).name.replace(".npz", "_2.npz")
    assert not list((tmp_path / "cpp").glob(".*.claim"))  # the reservations go once the dumps exist


def test_cpp_flush_leaves_another_process_files_alone(snapshot, native_build, tmp_path):
    """The dump directory holds crash-proof files (`.live`) and a dump of the name the driver would
    take, left by an earlier process of the same rank and pid (a restarted container): the C++
    flush writes beside them, never over them. The shell's pid is the driver's (exec)."""
    _, files = snapshot
    out = tmp_path / "cpp"
    out.mkdir()
    args = " ".join(str(files[k]) for k in ("plan", "config", "ctrl", "arena"))
    script = (f"mkdir {out}/compiledump_rankx_pid$$.live && touch {out}/compiledump_rankx_pid$$_2.json && "
              f"exec {native_build / 'compiledump_aoti_driver'} --flush-snapshot {args} {out}")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    written = Path(done.stdout.strip())
    pid = _manifest(str(written))["pid"]
    assert written.name == f"compiledump_rankx_pid{pid}_3.npz"
    assert (out / f"compiledump_rankx_pid{pid}_2.json").read_text() == ""
    assert not any((out / f"compiledump_rankx_pid{pid}.live").iterdir())
