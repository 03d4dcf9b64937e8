"""Compile the native CUDA capture kernel (kernels/capture_kernel.cuh, which capture_cuda.cu
launches) for sm_90 without a GPU and report what its PTX and SASS say, one line per input type.

    python scripts/native_kernel_sass.py           # table: loads, stores, registers, spills
    python scripts/native_kernel_sass.py --check   # exit 1 unless every instantiation has 16-byte
                                                   # vector loads (the fast path), spills nothing,
                                                   # multiplies no offset in 32 bits, loads the payload
                                                   # before the claim and awaits no reply after it

nvcc compiles a translation unit of its own (TRANSLATION_UNIT): the kernel template that
capture_cuda.cu includes, instantiated through the same AT_DISPATCH_V2 over the same dtype list
(CD_CAPTURE_DTYPES), with capture_cuda.cu's nvcc flags; so the same function bodies and
the same instantiations, without parsing the torch/ATen and c10 CUDA headers only the op around
the launch needs (they were half the CPU time of compiling capture_cuda.cu itself, whose SASS for
the kernel is the same). The check also refuses a capture_cuda.cu that launches the kernel for
other dtypes than that list (`launch_problems`).

Needs nvcc (CUDA 12 or newer) and cuobjdump (on PATH, or the one Triton bundles); torch's headers
come from the installed torch (the CPU wheel's will do). The twin for the Triton kernel is scripts/kernel_ptx.py.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_control  # noqa: E402 - scripts/, beside this file

REPO = Path(__file__).resolve().parents[1]
KERNEL = REPO / "kernels" / "capture_kernel.cuh"  # the __global__ template and its dtype list
LAUNCHER = REPO / "kernels" / "capture_cuda.cu"  # the op that dispatches and launches it
# What nvcc compiles: every instantiation capture_cuda.cu's dispatch makes (taking the kernel's
# address instantiates it, as the launch does), nothing else.
TRANSLATION_UNIT = """#include <ATen/Dispatch_v2.h>

#include "capture_kernel.cuh"

void compiledump_instantiate_capture_kernel(c10::ScalarType dtype) {
  AT_DISPATCH_V2(dtype, "capture_kernel", AT_WRAP([&] { (void)&capture_kernel<scalar_t>; }),
                 CD_CAPTURE_DTYPES);
}
"""
# Itanium-mangled template arguments of capture_kernel<scalar_t>, by the dtype they stand for:
# the dtypes of CD_CAPTURE_DTYPES, which --check requires the cubin to hold, no more.
TYPES = {"f": "float32", "d": "float64", "N3c104HalfE": "float16", "N3c108BFloat16E": "bfloat16",
         "l": "int64", "i": "int32", "s": "int16", "a": "int8", "h": "uint8", "t": "uint16", "j": "uint32",
         "m": "uint64", "b": "bool", "N3c1013Float8_e4m3fnE": "float8_e4m3fn", "N3c1011Float8_e5m2E": "float8_e5m2",
         "N3c1015Float8_e4m3fnuzE": "float8_e4m3fnuz", "N3c1015Float8_e5m2fnuzE": "float8_e5m2fnuz"}


def tools() -> tuple[str | None, str | None]:
    """(nvcc, cuobjdump), each None where not found."""
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        try:
            import triton

            bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            cuobjdump = str(bundled) if bundled.exists() else None
        except ImportError:
            pass
    return shutil.which("nvcc"), cuobjdump


def _code(text: str) -> str:
    """C++ source with its comments and string literals blanked (so parentheses and commas in
    them do not count)."""
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', " ", text, flags=re.S)


def _arguments(code: str, start: int) -> list[str]:
    """The top-level arguments of the call whose "(" is at code[start]."""
    depth, args, begin = 0, [], start + 1
    for i in range(start, len(code)):
        if code[i] in "([{":
            depth += 1
        elif code[i] in ")]}":
            depth -= 1
            if depth == 0:
                return [*args, code[begin:i].strip()]
        elif code[i] == "," and depth == 1:
            args.append(code[begin:i].strip())
            begin = i + 1
    raise ValueError("unbalanced call")


def launch_problems(text: str) -> list[str]:
    """Why the kernels TRANSLATION_UNIT compiles might not be the ones the launcher (the text of
    capture_cuda.cu) launches: it must take the kernel from capture_kernel.cuh, define none of its
    own, and launch it only as capture_kernel<scalar_t> in one AT_DISPATCH_V2 whose dtype list is
    exactly CD_CAPTURE_DTYPES."""
    code, out = _code(text), []
    if '#include "capture_kernel.cuh"' not in text:
        out.append("capture_cuda.cu does not include capture_kernel.cuh")
    if "__global__" in code:
        out.append("capture_cuda.cu defines a kernel of its own (its SASS would go unchecked)")
    dispatches = list(re.finditer(r"\b(AT_DISPATCH\w*)\s*\(", code))
    if [m.group(1) for m in dispatches] != ["AT_DISPATCH_V2"]:
        out.append(f"capture_cuda.cu dispatches with {[m.group(1) for m in dispatches]}, not one AT_DISPATCH_V2")
        return out
    args = _arguments(code, dispatches[0].end() - 1)
    if args[3:] != ["CD_CAPTURE_DTYPES"]:
        out.append(f"capture_cuda.cu dispatches {args[3:]}, not exactly CD_CAPTURE_DTYPES")
    launched = re.findall(r"\bcapture_kernel\s*<([^<>]*)>", code)
    if launched != ["scalar_t"] or "capture_kernel<scalar_t>" not in args[2].replace(" ", ""):
        out.append(f"capture_cuda.cu launches capture_kernel with the template arguments {launched}, not once as "
                   "capture_kernel<scalar_t> in the dispatch")
    return out


def compile_kernel(nvcc: str, tmp: Path) -> tuple[str, Path]:
    """The kernel's PTX text and the path of its cubin for sm_90 (one nvcc run of TRANSLATION_UNIT,
    -keep'ing the PTX)."""
    import torch.utils.cpp_extension

    include = torch.utils.cpp_extension.include_paths()
    # The flags CMakeLists.txt gives nvcc for capture_cuda.cu.
    source, cubin = tmp / "capture_kernels.cu", tmp / "capture.cubin"
    source.write_text(TRANSLATION_UNIT)
    command = [nvcc, "-std=c++20", "--expt-relaxed-constexpr", "-O3", "-arch=sm_90", "-cubin", "-keep",
               f"-keep-dir={tmp}", *(f"-I{p}" for p in include),
               f"-I{REPO / 'kernels'}", str(source), "-o", str(cubin)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{done.stderr[-4000:]}")
    (ptx,) = tmp.glob("*.ptx")
    return ptx.read_text(), cubin


def _sections(text: str, start: str) -> dict[str, str]:
    """The text of each kernel instantiation, by dtype: `start` begins a kernel's section."""
    out, name = {}, None
    for line in text.splitlines():
        if start in line:
            found = re.search(r"capture_kernelI(.+?)EEvPKT_", line)
            name = TYPES.get(found.group(1), found.group(1)) if found else None
            out.setdefault(name, [])
        if name is not None:
            out[name].append(line)
    return {k: "\n".join(v) for k, v in out.items() if k is not None}


def unguarded_32bit_multiplies(ptx: str) -> int:
    """32-bit multiplies other than nvcc's own 64-bit division fast path (a div.u32 taken when
    both operands fit in 32 bits, then mul.lo.s32 and sub.s32 for the remainder)."""
    lines = ptx.splitlines()
    return sum(1 for i, line in enumerate(lines) if "mul.lo.s32" in line and not (i and "div.u32" in lines[i - 1]))


def describe(ptx: str, cubin: Path, cuobjdump: str) -> dict[str, dict]:
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    ptx_of, sass_of, usage_of = _sections(ptx, ".entry"), _sections(sass, "Function :"), _sections(usage, "Function ")
    report = {}
    for dtype in sorted(sass_of):
        ops = re.findall(r"\b((?:LDG|STG)[A-Z0-9._]*)", sass_of[dtype])
        code = sass_control.parse(sass_of[dtype])
        claim = next((i for i, ins in enumerate(code) if "ATOMG.E.ADD" in ins.text), len(code))
        resources = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage_of.get(dtype, "")))
        report[dtype] = {
            "loads": {op: ops.count(op) for op in sorted(set(ops)) if op.startswith("LDG")},
            "stores": {op: ops.count(op) for op in sorted(set(ops)) if op.startswith("STG")},
            "registers": int(resources.get("REG", -1)),
            "spilled_bytes": int(resources.get("STACK", 0)) + int(resources.get("LOCAL", 0)),
            "mul.lo.s32 (unguarded)": unguarded_32bit_multiplies(ptx_of.get(dtype, "")),
            # Payload first: a 16-byte load in flight through the claim's atomic (nothing waits
            # for it before the atomic issues); and the bookkeeping after it (REG_STEPS, the kept
            # token count, the published claim) as a reduction and stores, not atomics whose reply
            # a later wait on the payload would also wait for.
            "payload in flight through the claim": bool(sass_control.in_flight_through(code, r"LDG\.E\.128",
                                                                                       r"ATOMG\.E\.ADD")),
            "atomics with a reply after the claim": sum(bool(re.search(r"ATOMG\.E\.(EXCH|MAX)", ins.text))
                                                        for ins in code[claim:]),
        }
    return report


def problems(report: dict[str, dict]) -> list[str]:
    """What --check refuses."""
    out = []
    for dtype, info in report.items():
        if not any(".128" in op for op in info["loads"]):
            out.append(f"{dtype}: no 16-byte vector load (the fast path): {info['loads']}")
        if info["spilled_bytes"]:
            out.append(f"{dtype}: {info['spilled_bytes']} bytes of stack/local memory (spills)")
        if info["mul.lo.s32 (unguarded)"]:
            out.append(f"{dtype}: {info['mul.lo.s32 (unguarded)']} 32-bit multiplies (offset math must be 64-bit)")
        if not info["payload in flight through the claim"]:
            out.append(f"{dtype}: the payload is not in flight through the claim (one more round trip)")
        if info["atomics with a reply after the claim"]:
            out.append(f"{dtype}: {info['atomics with a reply after the claim']} bookkeeping atomics with a reply "
                       "after the claim (a wait on the payload waits for them too)")
    if set(report) != set(TYPES.values()):
        out.append(f"instantiations {sorted(report)}, not those of CD_CAPTURE_DTYPES: "
                   f"{sorted(TYPES.values())}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 unless every instantiation vectorizes, "
                        "spills nothing, keeps its offsets 64-bit and loads the payload before the claim")
    args = parser.parse_args(argv)
    nvcc, cuobjdump = tools()
    if nvcc is None or cuobjdump is None:
        print(f"native_kernel_sass.py: needs nvcc and cuobjdump (found nvcc={nvcc}, cuobjdump={cuobjdump})",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = compile_kernel(nvcc, Path(tmp))
        report = describe(ptx, cubin, cuobjdump)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    print(f"{KERNEL.relative_to(REPO)} as {LAUNCHER.relative_to(REPO)} instantiates it, for sm_90 ({version})")
    for dtype, info in report.items():
        print(f"{dtype:>16}: registers {info['registers']}, spilled {info['spilled_bytes']} B, "
              f"unguarded mul.lo.s32 {info['mul.lo.s32 (unguarded)']}; loads {info['loads']}; "
              f"stores {info['stores']}; payload in flight through the claim "
              f"{info['payload in flight through the claim']}")
    found = launch_problems(LAUNCHER.read_text()) + problems(report)
    for problem in found:
        print(f"  {problem}")
    if not found:
        print(f"{len(report)} instantiations: 16-byte loads on the fast path, no spills, 64-bit offsets, "
              "payload before the claim")
    return 1 if found and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
