"""Each layout class of the Triton kernel equals the reference kernel (JIT and direct launches); sm_90 compiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compiledump.ops import layout as L
from compiledump.ops import register, variants
from compiledump.ops.geometry import geometry
from compiledump.ops.reference import capture_reference

from helpers.samples import generator_for
from helpers.triton_stand_in import CompiledStandIn, stand_in_jit

pytest.importorskip("compiledump.ops.triton_kernel")
ROOT = Path(__file__).resolve().parents[2]


def _case(name):
    g = generator_for(name)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "fast_path_bf16_hc": (L.KIND_RECORD, rnd(5, 4, 64, dtype=torch.bfloat16)),
        "unaligned_fp16_hc": (L.KIND_RECORD, rnd(5 * 4 * 64 + 1, dtype=torch.float16)[1:].view(5, 4, 64)),
        "strided_fp32_hc": (L.KIND_RECORD, rnd(5, 64, 4).transpose(1, 2)),
        "odd_width_bf16": (L.KIND_RECORD, rnd(7, 4, 67, dtype=torch.bfloat16)),
        "wide_multi_program_fp16": (L.KIND_RECORD, rnd(3, 4, 4100, dtype=torch.float16)),
        "hc6_two_chunks_fp32": (L.KIND_RECORD, rnd(3, 6, 72)),
        "all_rows_bf16": (L.KIND_RECORD_ROWS, rnd(9, 4, 2100, dtype=torch.bfloat16)),
        "all_rows_2d_fp32": (L.KIND_RECORD_ROWS, rnd(11, 33)),
        "once_wide_fp32": (L.KIND_RECORD_ONCE, rnd(3, 4500)),
        "step_wide_fp32": (L.KIND_STEP, rnd(3, 4500)),
        "step_3d_bf16": (L.KIND_STEP, rnd(4, 3, 40, dtype=torch.bfloat16)),
        "step_split_bf16": (L.KIND_STEP, rnd(2, 4, 2100, dtype=torch.bfloat16)),  # claim launch, then copy launch
        "ids_flat": (L.KIND_IDS, torch.randint(-50, 1000, (33, 8), generator=g)),
        "ids_strided": (L.KIND_IDS, torch.randint(0, 1000, (8, 33), generator=g).t()),
        "whole_3d_fp16": (L.KIND_RECORD, rnd(2, 3, 5, 7, dtype=torch.float16)),
    }[name]


CASES = ["fast_path_bf16_hc", "unaligned_fp16_hc", "strided_fp32_hc", "odd_width_bf16", "wide_multi_program_fp16",
         "hc6_two_chunks_fp32", "all_rows_bf16", "all_rows_2d_fp32", "once_wide_fp32", "step_wide_fp32",
         "step_3d_bf16", "step_split_bf16", "ids_flat", "ids_strided", "whole_3d_fp16"]


@pytest.fixture(params=["jit", "direct"])
def launch_path(request, monkeypatch):
    """How the capture launches: through Triton's JIT (the interpreter), or straight to the
    compiled kernel its JIT launch returned (as on a GPU; the binder checks every direct launch)."""
    if request.param == "jit":
        variants.forget()
        yield None
        variants.forget()
    else:
        with stand_in_jit(monkeypatch) as keys:
            yield keys


@pytest.mark.parametrize("name", CASES)
def test_layout_class_equals_reference(name, launch_path):
    _assert_equals_reference(name, launch_path, aligned_arena=True)


@pytest.mark.parametrize("name", ["fast_path_bf16_hc", "step_split_bf16", "ids_strided"])
def test_an_arena_the_kernel_was_not_compiled_for_goes_through_the_jit(name, monkeypatch):
    """Triton specializes the arena pointer on its alignment too: into an arena that is not 16-byte
    aligned, a prepared variant's launches go through the JIT (which picks its own kernel)."""
    with stand_in_jit(monkeypatch) as keys:
        _assert_equals_reference(name, keys, aligned_arena=False)


def _assert_equals_reference(name, keys, aligned_arena):
    """Two captures of case `name` through the Triton layer equal the reference kernel's; with the
    stand-in JIT `keys`, the launches after the variants' preparation go straight into the compiled
    kernel exactly when the arena is the aligned kind the kernel was compiled for."""
    kind, x = _case(name)
    g = torch.Generator().manual_seed(7)
    ctrl = torch.zeros(L.control_words(2), dtype=torch.int32)
    ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS] = 1, 1, 4
    ctrl[L.REG_RECORD_ROW], ctrl[L.REG_STEP_ROW] = -2, 1
    arena = torch.randn(3 * x.numel() + 64, generator=g)  # untouched words must stay as they are
    if not aligned_arena:
        arena = arena[1:]
    want_arena, want_ctrl = arena.clone(), ctrl.clone()
    for _ in range(2):  # steps append, keep-first keeps the first
        register.capture_triton(x, arena, ctrl, kind, L.slot_base(1), 8, 3, 0)
        capture_reference(x, want_arena, want_ctrl, kind, L.slot_base(1), 8, 3, 0)
    assert torch.equal(L.without_claims(ctrl), want_ctrl)  # a split capture also publishes its claim
    assert torch.equal(arena.view(torch.int32), want_arena.view(torch.int32))  # every kernel sums in h order
    assert int(ctrl[L.slot_base(1) + L.CNT_WRITTEN]) == 2
    if keys is not None:
        launches = 2 * len(variants.launches_for(geometry(x, kind)[1], kind))
        prepared = len(variants.Variant(x.dtype, False, False, 1, True).siblings())  # each once on scratch
        assert keys.direct == prepared + (launches if aligned_arena else 0)


def test_a_compiled_kernel_that_does_not_launch_directly_leaves_the_jit_launch(monkeypatch):
    """A Triton whose compiled kernels take other arguments (the first H200 run's direct call met
    "takes exactly 36 arguments (29 given)") fails while the variant is prepared, outside any
    capture: one warning that names it, and every launch goes through the JIT, storing the same."""

    class Refusing(CompiledStandIn):
        def __getitem__(self, grid):
            def runner(*args):
                raise TypeError("function takes exactly 36 arguments (29 given)")

            return runner

    x = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    ctrl = torch.zeros(L.control_words(2), dtype=torch.int32)
    ctrl[L.REG_ENABLED], ctrl[L.REG_RECORD_ROW] = 1, 2
    arena = torch.randn(256, generator=torch.Generator().manual_seed(6))
    want_arena, want_ctrl = arena.clone(), ctrl.clone()
    with stand_in_jit(monkeypatch, compiled=Refusing) as keys:
        with pytest.warns(RuntimeWarning, match=r"did not launch directly \(TypeError: function takes exactly 36 "
                          r"arguments.*Triton's JIT launch.*Nothing is lost"):
            register.capture_triton(x, arena, ctrl, L.KIND_RECORD, L.slot_base(1), 8, 1, 0)
        register.capture_triton(x, arena, ctrl, L.KIND_RECORD, L.slot_base(1), 8, 1, 0)
    for _ in range(2):
        capture_reference(x, want_arena, want_ctrl, L.KIND_RECORD, L.slot_base(1), 8, 1, 0)
    assert keys.direct == 0
    assert torch.equal(ctrl, want_ctrl) and torch.equal(arena, want_arena)
    np.testing.assert_allclose(arena[8:72].numpy(), x[2].float().mean(0).numpy(), rtol=1e-3)


# --- what Triton emits for sm_90 ----------------------------------------------------------

PTX_SCRIPT = ROOT / "scripts" / "kernel_ptx.py"


def test_sm90_ptx_has_vector_loads_and_64_bit_offsets():
    """Compiled for sm_90 without a GPU (a fresh process: the suite interprets Triton); every
    input type in every layout class compiles (the interpreter accepts what the compiler may not)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(PTX_SCRIPT), "--check", "--all"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("fast paths vectorized, offsets 64-bit, host-mapped commit at system scope, "
            "one register snapshot per program") in out.stdout
    assert "payload in flight through the claim" in out.stdout  # read from the SASS's scoreboards
    assert "--all: 0 variant(s) failed to compile, of " in out.stdout  # every input type and layout class
