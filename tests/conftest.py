"""Shared test setup.

TRITON_INTERPRET must be set before triton is imported anywhere: it lets the Triton capture
kernel run on CPU tensors, which is how the suite checks it without a GPU.

TORCHINDUCTOR_COMPILE_THREADS=1 (unless set): Inductor compiles in the process that traced,
instead of starting a pool of compile workers in every process that compiles (each pytest
worker, and each child process the tests start). Under `-n auto` every core already runs a test,
so the pools only add process start-ups: on 2 cores the compile-heavy tests took 15 % less wall
time and 19 % less CPU time with one thread.

TORCHINDUCTOR_VEC_ISA_OK=0 (unless set): Inductor's CPU kernels are compiled without its SIMD
headers. A cold Inductor compile here is mostly g++ (a 28-kernel engine: 51 s cold, 12 s from a
warm cache) and the vector headers are a third of that. What the suite checks of a compiled model
is unchanged: the capture op is an extern call in the graph either way, and the model's fused
kernels are CPU stand-ins for the Triton kernels an engine runs on a GPU.
"""

import dataclasses
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # read when torch._inductor is imported
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")  # read when torch._inductor is imported

import pytest  # noqa: E402
import torch  # noqa: E402

import compiledump  # noqa: E402
from compiledump import config as cd_config  # noqa: E402
from helpers import lanes, triton_interpreter  # noqa: E402

triton_interpreter.install()  # one patch of triton.language per interpreted launch (see there)


def _interpreter_usable() -> str | None:
    """Why Triton's interpreter cannot run the kernel in this environment, or None."""
    import numpy
    import triton

    def major_minor(version: str) -> tuple[int, int]:
        return tuple(int(part) for part in version.split(".")[:2])

    # Triton < 3.7's interpreter turns its scalars (1-element arrays) into Python ints with int(),
    # which numpy >= 2.4 refuses: every kernel loop bound fails ("only 0-dimensional arrays...").
    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (f"triton {triton.__version__}'s interpreter needs numpy < 2.4 (this is numpy {numpy.__version__}): "
                "pip install 'numpy<2.4'")
    return None


def pytest_addoption(parser):
    parser.addoption("--lane", choices=("all", "pure"), default="all",
                     help="pure: CI's second lane, on the Python capture path (COMPILEDUMP_NATIVE=0): leaves "
                          "out the tests tests/helpers/lanes.py lists, whose outcome does not depend on it")


def pytest_configure(config):
    why = _interpreter_usable()
    if why:
        pytest.exit(f"the Triton kernel cannot run on CPU here: {why}", returncode=4)
    if config.getoption("--lane") == "pure" and os.environ.get("COMPILEDUMP_NATIVE") != "0":
        pytest.exit("--lane=pure is the Python capture path's lane: run it with COMPILEDUMP_NATIVE=0", returncode=4)


# The heaviest test files (minutes of Inductor compiles and child processes on 2 cores), run
# first: with `-n auto --dist loadfile` a file runs whole on one worker, so a heavy file
# collected late (tests/repo, tests/ops) ran alone at the end while the other worker idled.
_HEAVY_FIRST = ("capture/test_hf_models.py", "capture/test_hf_indexers.py", "capture/test_crash.py",
                "repo/test_gpu_scripts.py", "compare/test_sparsemixer.py", "demo/test_demo.py", "ops/test_ops.py",
                "ops/test_variants.py", "ops/test_triton_layout_classes.py", "compare/test_model_verdicts.py",
                "export/test_aot.py")


def pytest_ignore_collect(collection_path, config):
    """The pure lane does not import the files it leaves out whole (each of its two workers
    collects the suite: the Hugging Face test files alone import transformers' model classes)."""
    if config.getoption("--lane") != "pure":
        return None
    tests = Path(__file__).parent
    if collection_path == tests or tests not in collection_path.parents:
        return None
    relative = collection_path.relative_to(tests).as_posix() + ("/" if collection_path.is_dir() else "")
    # A path matches no entry naming single tests ("file.py::test"), nor a word only a test name
    # holds: it is left out only where every test under it is.
    return True if lanes.native_lane_only(relative) else None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--lane") == "pure":
        left_out = {item for item in items if lanes.native_lane_only(item.nodeid)}
        if left_out:
            config.hook.pytest_deselected(items=list(left_out))  # counted as "deselected" in the summary
            items[:] = [item for item in items if item not in left_out]

    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, heavy in enumerate(_HEAVY_FIRST) if path.endswith(heavy)), len(_HEAVY_FIRST))

    items.sort(key=rank)  # stable: every other file keeps its place


@pytest.fixture(autouse=True)
def _no_leaked_buffer_hooks():
    """Drop the global buffer-registration hooks a test leaves behind. torch 2.11's export registers
    one and removes it only when the export succeeds: after a test that expects an export to fail,
    the next `torch.compile(fullgraph=True)` of a module that assigns a buffer in its forward (the
    NaN injector of test_nonfinite.py) met that hook and broke the graph (seen with -n 2 on torch
    2.11; not in torch 2.13)."""
    hooks = torch.nn.modules.module._global_buffer_registration_hooks
    before = set(hooks)
    yield
    for key in set(hooks) - before:
        del hooks[key]


def _put_back_settings(before) -> None:
    after = compiledump.get_config()
    if after == before:
        return
    if any(getattr(after, f) != getattr(before, f) for f in cd_config.ARENA_FIELDS):
        compiledump.reset()
    compiledump.configure(**dataclasses.asdict(before))


@pytest.fixture(autouse=True)
def _no_leaked_settings():
    """Put back the settings a test found. A test that configures (moe_layers=3, tokens=7, ...)
    and does not restore them changed what later tests of the same xdist worker captured: a
    leaked COMPILEDUMP_MOE_LAYERS once changed the note in test_hf_models' Comparing sample, and
    which test ran before which decides such a failure. Where the test changed a capacity setting
    (which an existing arena cannot take back), its state is reset first."""
    before = compiledump.get_config()
    yield
    _put_back_settings(before)


def _process_state() -> dict:
    return {"COMPILEDUMP_* environment": {k: v for k, v in os.environ.items() if k.startswith("COMPILEDUMP_")},
            "torch default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
            "set_parallel": compiledump.get_parallel()}


@pytest.fixture(autouse=True)
def _no_leaked_process_state():
    """Fail a test that leaves process-wide state changed (an environment variable set without
    monkeypatch, the default dtype, grad mode, `set_parallel` without a reset), and put it back:
    otherwise a later test of the same xdist worker fails or passes by which file ran before it."""
    before = _process_state()
    yield
    after = _process_state()
    leaked = [name for name in before if after[name] != before[name]]
    if not leaked:
        return
    for key in set(after["COMPILEDUMP_* environment"]) - set(before["COMPILEDUMP_* environment"]):
        del os.environ[key]
    os.environ.update(before["COMPILEDUMP_* environment"])
    torch.set_default_dtype(before["torch default dtype"])
    torch.set_grad_enabled(before["grad mode"])
    if after["set_parallel"] != before["set_parallel"]:
        compiledump.reset()
    pytest.fail("the test left process-wide state changed: " + "; ".join(
        f"{name} {before[name]!r} -> {after[name]!r}" for name in leaked), pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_module_settings():
    """The same for a test file: a module-scoped fixture sets up before any test's own check
    records what it found, so what it configures was invisible there (test_aot.py's `packages`
    left tokens=7 behind, and a later file's 9-token prompt was skipped by the token gate: a CI
    failure that depended on which xdist worker ran which file after which)."""
    before = compiledump.get_config()
    yield
    _put_back_settings(before)


@pytest.fixture
def dump_dir(tmp_path):
    """Capture enabled into a fresh directory, with default settings and fresh state."""
    torch._dynamo.reset()
    compiledump.reset()
    previous = compiledump.get_config()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path / "dump"))))
    yield tmp_path / "dump"
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(previous))
    torch._dynamo.reset()


@pytest.fixture(params=["reference", "triton"])
def cpu_kernel(request, monkeypatch):
    """Run the CPU path with the reference kernel, or with the Triton kernel interpreted."""
    monkeypatch.setenv("COMPILEDUMP_CPU_KERNEL", request.param)
    return request.param


REPO = Path(__file__).resolve().parents[1]


def _setup_py():
    """setup.py as a module (its setup() call runs only as a script)."""
    spec = importlib.util.spec_from_file_location("compiledump_setup_py", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def native_build(tmp_path_factory) -> Path:
    """A CMake build directory with the native library and the C++ driver built from this tree.

    COMPILEDUMP_BUILD_DIR names one already built; otherwise it is the checkout's build
    directory for this torch, the one an editable install builds the library in (setup.py
    `checkout_build_dir`; git ignores `build/`), configured for the tests (the driver too, and
    run paths to torch's libraries: only a relink of the installed build) and brought up to date
    by `cmake --build` once per test run, by whichever xdist worker needs it first while the
    others wait on a file lock. So after `pip install -e .` only the driver is compiled, and a
    later run, or CI's second lane, rebuilds only what changed (a fresh build of both is about
    150 CPU s; seconds when nothing changed). Skipped where cmake or a C++ compiler is missing.
    """
    prebuilt = os.environ.get("COMPILEDUMP_BUILD_DIR")
    if prebuilt:
        return Path(prebuilt).resolve()
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("cmake or a C++ compiler is not installed")
    from filelock import FileLock  # a torch requirement

    build = _setup_py().checkout_build_dir(torch.utils.cmake_prefix_path)
    build.mkdir(parents=True, exist_ok=True)
    # Under xdist each worker's basetemp lies in one per-run directory (its parent).
    run = tmp_path_factory.getbasetemp()
    run = run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run
    with FileLock(str(build) + ".lock"):
        stamp = build / "built_by_run"
        if not stamp.exists() or stamp.read_text() != str(run):
            # Configured every run: an install since the last one configured it without the driver.
            commands = [["cmake", "-S", str(REPO), "-B", str(build), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                         "-DCOMPILEDUMP_BUILD_DRIVER=ON", "-DCMAKE_SKIP_BUILD_RPATH=OFF"],
                        ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)]]
            for cmd in commands:
                out = subprocess.run(cmd, capture_output=True, text=True)
                assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            stamp.write_text(str(run))
    return build
