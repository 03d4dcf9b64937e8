"""What nvcc makes of the native CUDA kernel for sm_90, without a GPU (scripts/native_kernel_sass.py):
every input type's instantiation has the fast path's 16-byte vector loads, spills nothing and
multiplies no offset in 32 bits. Skipped where nvcc or cuobjdump is missing."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "native_kernel_sass.py"
sys.path.insert(0, str(SCRIPT.parent))
import native_kernel_sass  # noqa: E402


def test_sm90_sass_has_vector_loads_no_spills_and_64_bit_offsets(capsys):
    """The script's --check, run in this process: it needs nothing a fresh one would give (its
    nvcc and cuobjdump runs are child processes either way), and a child's Python start and torch
    import (for torch's include paths) were seconds of the test's time."""
    nvcc, cuobjdump = native_kernel_sass.tools()
    if nvcc is None or cuobjdump is None:
        pytest.skip(f"needs nvcc and cuobjdump (nvcc={nvcc}, cuobjdump={cuobjdump})")
    status = native_kernel_sass.main(["--check"])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert "17 instantiations: 16-byte loads on the fast path, no spills, 64-bit offsets, payload before the claim" \
        in out.out


def test_the_check_refuses_scalar_loads_spills_and_32_bit_offsets():
    """The checks themselves, on reports of a kernel without the fast path, one that spills, one
    with a 32-bit offset multiply (a remainder after div.u32 is nvcc's guarded fast division), one
    that loads the payload after the claim and one whose bookkeeping atomics reply."""
    good = {"loads": {"LDG.E.128.CONSTANT": 5}, "stores": {}, "registers": 72, "spilled_bytes": 0,
            "mul.lo.s32 (unguarded)": 0, "payload in flight through the claim": True,
            "atomics with a reply after the claim": 0}
    report = {f"t{i}": dict(good) for i in range(13)}
    assert native_kernel_sass.problems(report) == []
    report["t0"] = {**good, "loads": {"LDG.E.U16.CONSTANT": 10}}
    report["t1"] = {**good, "spilled_bytes": 16}
    report["t2"] = {**good, "mul.lo.s32 (unguarded)": 1}
    report["t3"] = {**good, "payload in flight through the claim": False}
    report["t4"] = {**good, "atomics with a reply after the claim": 2}
    assert [p.split(":")[0] for p in native_kernel_sass.problems(report)] == ["t0", "t1", "t2", "t3", "t4"]
    ptx = "div.u32 %r3, %r1, %r2;\nmul.lo.s32 %r4, %r3, %r2;\nmul.lo.s32 %r5, %r1, %r2;"
    assert native_kernel_sass.unguarded_32bit_multiplies(ptx) == 1
