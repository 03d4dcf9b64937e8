"""The first NaN/Inf, found by the capture kernels with no reference: NaN injected into one layer
at one decode step of the built-in model, eager and compiled; `inspect` names that key and step,
`compare` against a clean run reports it ahead of the divergences."""

import dataclasses
import json

import pytest
import torch

import compiledump
from compiledump import config as cd_config
from compiledump.demo.model import TinyMoE, make_session, run_session

from helpers.cli import run_cli
from helpers.crash_child import CONFIG as CRASH_CONFIG, NanAt

NAN_STEP = 3
# crash_child's model, less its third layer: NaN goes into layer 1, so layer 0 is the clean layer
# before it and the logits the captures after it; a third layer only lengthened each cold
# compile (2 here) by ~2 C++ kernels.
CONFIG = dataclasses.replace(CRASH_CONFIG, layers=2)


def _run(directory, nan: bool, compiled: bool, **settings):
    torch._dynamo.reset()
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory), **settings)))
    # The clean run is the same program with no NaN injected (step -1): compiled, one graph
    # serves both runs, and the two dumps differ only by the injected value.
    model = NanAt(TinyMoE(CONFIG, dump=compiledump), NAN_STEP if nan else -1)
    forward = torch.compile(model, fullgraph=True) if compiled else model
    run_session(forward, compiledump, make_session(CONFIG, prompt_len=7, steps=6, pad_rows=2), engine=False)
    path = compiledump.flush()
    compiledump.reset()
    return path


@pytest.fixture
def restore_config():
    previous = compiledump.get_config()
    yield
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(previous))
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("settings", [
    {"nonfinite": "all"},  # the token gate skips decode records: the whole-input count sees them
    {"nonfinite": "read", "tokens": 0},  # the gate off: decode records are kept, and read
], ids=["all", "read-gate-off"])
def test_injected_nan_is_named_and_reported_first(tmp_path, capsys, restore_config, compiled, settings):
    clean = _run(tmp_path / "ref", nan=False, compiled=compiled, **settings)
    broken = _run(tmp_path / "run", nan=True, compiled=compiled, **settings)
    manifest = json.loads(open(broken.replace(".npz", ".json")).read())
    first = manifest["first_nonfinite"]
    assert (first["key"], first["phase"], first["step"]) == ("layer1_mix", "decode", NAN_STEP), first
    assert json.loads(open(clean.replace(".npz", ".json")).read())["first_nonfinite"] is None
    # Every later capture of layer 1 and after sees the NaN too: each tag dates its own first.
    tags = manifest["tags"]
    assert "nonfinite" not in tags["layer0_mix"] and "nonfinite" not in tags["layer0"]
    assert tags["logits_<n>"]["nonfinite"]["key"] == f"logits_{NAN_STEP}"

    # The CLI in process (helpers/cli.py); `python -m compiledump` as a process: test_crash,
    # test_process_death, test_compare_inputs.
    status, shown, _ = run_cli(capsys, "inspect", broken)
    assert status == 0 and any(f"first non-finite: layer1_mix (decode, step {NAN_STEP}); " in line
                                for line in shown), shown
    status, clean_shown, _ = run_cli(capsys, "inspect", clean)
    assert status == 0 and any("first non-finite: none seen by the capture kernels" in line
                                for line in clean_shown), clean_shown
    status, lines, _ = run_cli(capsys, "compare", clean, broken)
    assert status == 1, lines[-40:]
    nan_line = next(i for i, line in enumerate(lines) if line.startswith("RUN first non-finite: layer1_mix"))
    assert f"(decode, step {NAN_STEP})" in lines[nan_line]
    assert all(i > nan_line for i, line in enumerate(lines) if "divergen" in line and "first" in line), lines


def test_steps_begun_date_records_and_clear_resets_them(dump_dir):
    from compiledump.capture.state import STATE
    from compiledump.ops import layout as L

    compiledump.configure(tokens=0)
    x = torch.randn(3, 16)
    for _ in range(3):
        compiledump.record_step("logits", x)
    assert int(STATE.runtime.ctrl[L.REG_STEPS]) == 3
    bad = x.clone()
    bad[-1, 5] = float("inf")  # record() keeps the last row: it reads the Inf
    compiledump.record("hidden", bad)
    manifest = json.loads(open(compiledump.flush().replace(".npz", ".json")).read())
    assert manifest["first_nonfinite"]["key"] == "hidden" and manifest["first_nonfinite"]["step"] == 3
    compiledump.clear()
    assert int(STATE.runtime.ctrl[L.REG_STEPS]) == 0
    assert json.loads(open(compiledump.flush().replace(".npz", ".json")).read())["first_nonfinite"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_mapped_arenas_run_one_program_committed_at_system_scope(dtype):
    """A capture into a host-mapped arena (crash-proof capture on CUDA) launches its own variant,
    one program whose commit is at system scope (scripts/kernel_ptx.py checks the PTX), and writes
    what the reference kernel writes; the same arena unmapped runs several programs."""
    from compiledump.ops import layout as L
    from compiledump.ops import triton_kernel, variants
    from compiledump.ops.reference import capture_reference

    x = torch.randn(3, 4, 5000, dtype=dtype)[:, :, 3:4999]  # a wide row, read with strides
    geometry = (3, 4, 4996, 20000, 5000, 1, L.REG_RECORD_ROW, True)
    assert variants.launches_for(geometry, L.KIND_RECORD)[0][1] > 1
    results = {}
    for mapped in (False, True):
        arena = torch.full((3 * 4996,), -7.0)
        ctrl = torch.zeros(L.control_words(2), dtype=torch.int32)
        ctrl[L.REG_ENABLED] = 1
        ctrl[L.REG_MAX_ROWS] = 1 << 20
        ctrl[L.REG_RECORD_ROW] = -1
        if mapped:
            variants.MAPPED_ARENAS.add(arena.data_ptr())
        launched = []
        real_launch = triton_kernel._launch
        try:
            triton_kernel._launch = lambda v, programs, *args: (launched.append((v, programs)),
                                                                real_launch(v, programs, *args))[1]
            triton_kernel.launch(x, arena, ctrl, geometry, L.slot_base(1), 4996, 1, L.KIND_RECORD, 0)
        finally:
            triton_kernel._launch = real_launch
            variants.MAPPED_ARENAS.discard(arena.data_ptr())
        variant, programs = launched[-1]
        assert variant.host_arena is mapped and (programs == 1) is mapped
        results[mapped] = (arena, ctrl)
    ref_arena = torch.full((3 * 4996,), -7.0)
    ref_ctrl = results[False][1].clone()
    ref_ctrl[L.HEADER_WORDS:] = 0
    capture_reference(x, ref_arena, ref_ctrl, L.KIND_RECORD, L.slot_base(1), 4996, 1, 0)
    for arena, ctrl in results.values():
        assert torch.equal(arena, ref_arena) and torch.equal(ctrl, ref_ctrl)
