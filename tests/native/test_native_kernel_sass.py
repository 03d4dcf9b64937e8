"""What nvcc makes of the native CUDA kernel for sm_90, without a GPU (scripts/native_kernel_sass.py):
every input type's instantiation has the fast path's 16-byte vector loads, spills nothing and
multiplies no offset in 32 bits. Skipped where nvcc or cuobjdump is missing.

The script compiles the kernel template (kernels/capture_kernel.cuh) in a translation unit of its
own, for the dtype list capture_cuda.cu dispatches (one macro both expand); the launch's checks
here hold capture_cuda.cu to launching exactly those instantiations."""

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
    that loads the payload after the claim and one whose bookkeeping atomics reply; and on
    reports missing an instantiation or holding one of a dtype the list does not name."""
    good = {"loads": {"LDG.E.128.CONSTANT": 5}, "stores": {}, "registers": 72, "spilled_bytes": 0,
            "mul.lo.s32 (unguarded)": 0, "payload in flight through the claim": True,
            "atomics with a reply after the claim": 0}
    dtypes = sorted(native_kernel_sass.TYPES.values())
    report = {dtype: dict(good) for dtype in dtypes}
    assert len(report) == 17 and native_kernel_sass.problems(report) == []
    report[dtypes[0]] = {**good, "loads": {"LDG.E.U16.CONSTANT": 10}}
    report[dtypes[1]] = {**good, "spilled_bytes": 16}
    report[dtypes[2]] = {**good, "mul.lo.s32 (unguarded)": 1}
    report[dtypes[3]] = {**good, "payload in flight through the claim": False}
    report[dtypes[4]] = {**good, "atomics with a reply after the claim": 2}
    assert [p.split(":")[0] for p in native_kernel_sass.problems(report)] == dtypes[:5]
    ptx = "div.u32 %r3, %r1, %r2;\nmul.lo.s32 %r4, %r3, %r2;\nmul.lo.s32 %r5, %r1, %r2;"
    assert native_kernel_sass.unguarded_32bit_multiplies(ptx) == 1

    fewer = {dtype: dict(good) for dtype in dtypes[1:]}
    more = {**{dtype: dict(good) for dtype in dtypes}, "N3c1013Float8_e8m0fnuE": dict(good)}
    for report in (fewer, more):
        (problem,) = native_kernel_sass.problems(report)
        assert problem.startswith("instantiations "), problem


def test_capture_cuda_launches_exactly_the_instantiations_the_script_compiles():
    """capture_cuda.cu takes its kernel from capture_kernel.cuh and dispatches exactly
    CD_CAPTURE_DTYPES, the list the script's translation unit instantiates (so the SASS
    checked is that of every kernel the library launches); each way of launching others is refused."""
    text = native_kernel_sass.LAUNCHER.read_text()
    assert native_kernel_sass.launch_problems(text) == []
    assert '#include "capture_kernel.cuh"' in native_kernel_sass.TRANSLATION_UNIT
    assert "CD_CAPTURE_DTYPES);" in native_kernel_sass.TRANSLATION_UNIT
    header = native_kernel_sass.KERNEL.read_text()
    assert "#define CD_CAPTURE_DTYPES" in header and "__global__ void capture_kernel(" in header

    listed = "AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, at::kBool"
    # (what is changed, the refusal's words)
    changed = {
        "a list of its own": (text.replace("}), CD_CAPTURE_DTYPES);", f"}}), {listed});"),
                              "not exactly CD_CAPTURE_DTYPES"),
        "one dtype more": (text.replace("CD_CAPTURE_DTYPES);",
                                        "CD_CAPTURE_DTYPES, at::kComplexFloat);"),
                           "not exactly CD_CAPTURE_DTYPES"),
        "another launch": (text.replace("C10_CUDA_KERNEL_LAUNCH_CHECK();",
                                        "capture_kernel<float><<<1, 1>>>(nullptr, nullptr, nullptr, args);\n"
                                        "C10_CUDA_KERNEL_LAUNCH_CHECK();"), "['scalar_t', 'float']"),
        "a kernel of its own": (text.replace("namespace compiledump {",
                                             "__global__ void other() {}\nnamespace compiledump {", 1),
                                "a kernel of its own"),
        "a second dispatch": (text.replace("C10_CUDA_KERNEL_LAUNCH_CHECK();",
                                           "AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), \"f\", [&] {});\n"
                                           "C10_CUDA_KERNEL_LAUNCH_CHECK();"), "not one AT_DISPATCH_V2"),
        "no shared header": (text.replace('#include "capture_kernel.cuh"\n', ""), "does not include"),
    }
    for why, (source, words) in changed.items():
        assert source != text, why
        (problem,) = native_kernel_sass.launch_problems(source)
        assert words in problem, (why, problem)
