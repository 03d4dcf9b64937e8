"""The C++ flush's dump names (kernels/dump.cpp), from a small C++ program linked against the
native library the CMake build made (tests/native/dump_names.cpp): two Dumps of one process never
take one name, whether the first's dump was moved away, its directory spelled otherwise or removed
between flushes; the reservations go when the Dumps do. (Each case failed in a review.)"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def program(native_build, tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("dump_names") / "dump_names"
    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    subprocess.run([compiler, "-std=c++17", "-O0", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{HERE.parents[1] / 'kernels'}",
                    *(f"-I{path}" for path in torch.utils.cpp_extension.include_paths()), str(HERE / "dump_names.cpp"),
                    "-o", str(out), f"-L{native_build}", "-lcompiledump_native", f"-L{lib}", "-ltorch", "-ltorch_cpu",
                    "-lc10", f"-Wl,-rpath,{native_build}:{lib}"], check=True, timeout=300)
    return out


def test_two_dumps_of_one_process_never_share_a_name(program, tmp_path):
    done = subprocess.run([str(program)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if not line.startswith("left "))
    names = {label: Path(path).name for label, path in lines.items()}
    pid = re.fullmatch(r"compiledump_rankx_pid(\d+)\.npz", names["x"]).group(1)
    x, y = f"compiledump_rankx_pid{pid}.npz", f"compiledump_rankx_pid{pid}_2.npz"
    assert names == {"x": x, "y": y, "x-slash": x, "x-dot": x, "x-again": x, "y-again": y}
    left = sorted(line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("left "))
    assert left == sorted([x, x.replace(".npz", ".json"), y, y.replace(".npz", ".json")])  # no .claim left
