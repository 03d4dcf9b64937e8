"""The native build through pip (setup.py): by default it is tried and, where it cannot be made,
the package installs pure Python with a note; COMPILEDUMP_BUILD_NATIVE=0 never runs cmake; `1`
ships the library that compiledump/ops/native.py loads or fails the build. (The default build in
pip's isolated environment, which must find the installed torch and compiles the library for
real, is what CI's first lane runs: it checks that the README's install gives the native path.)

Every build runs on a copy of the checkout (the files git does not ignore) in a tmp dir: pip builds in
tree, and nothing may write into the repository. A `cmake` first on PATH stands in for the real
one: it records its calls and fails, or, for the wheel that ships the library, "builds" it by
copying the library the suite's own CMake build made from these sources (`native_build`), so this
file checks setup.py's commands, packaging and loading without compiling the library a third time.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY = "compiledump/libcompiledump_native.so"


@pytest.fixture
def source(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (git lists the files to copy)")
    # Tracked and untracked-but-not-ignored files: the work tree, less build outputs and venvs.
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout
    copy = tmp_path / "src"
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():  # a tracked file may be deleted in the work tree
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    return copy


def _stand_in_cmake(tmp_path, then: str) -> tuple[dict, Path]:
    """A `cmake` that logs its arguments, then runs the shell line `then`; returns (environment
    with it first on PATH, log)."""
    bin_dir, log = tmp_path / "fake-bin", tmp_path / "cmake-calls"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n{then}\n')
    (bin_dir / "cmake").chmod(0o755)
    env = _env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env, log


@pytest.fixture
def fake_cmake(tmp_path):
    """A `cmake` that records its call and fails; returns (environment with it first on PATH, log)."""
    return _stand_in_cmake(tmp_path, "exit 1")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("COMPILEDUMP_BUILD_NATIVE", "COMPILEDUMP_NATIVE")}
    env.update(extra)
    return env


def _pip(args, env, cwd):
    # --no-index: these builds need nothing from the network (no isolation, no dependencies).
    cmd = [sys.executable, "-m", "pip", *args, "--no-index", "--disable-pip-version-check"]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)


def _wheel(source, out, env):
    return _pip(["wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)], env, source.parent)


def test_opt_out_wheel_is_pure_and_runs_no_cmake(source, fake_cmake, tmp_path):
    env, log = fake_cmake
    env["COMPILEDUMP_BUILD_NATIVE"] = "0"
    # A library left in the package by a manual `cmake --install` must not leak into a pure wheel.
    (source / LIBRARY).write_bytes(b"stale")
    out = _wheel(source, tmp_path / "dist", env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    assert not log.exists(), f"cmake ran: {log.read_text()}"


def test_default_build_falls_back_to_pure_with_a_note(source, fake_cmake, tmp_path):
    env, log = fake_cmake
    (source / LIBRARY).write_bytes(b"stale")
    out = _pip(["wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(tmp_path / "dist"), str(source)], env,
               source.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert log.exists(), "the default install did not try cmake"
    assert "the native capture library was not built" in out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]


def test_opt_in_fails_loudly_when_cmake_fails(source, fake_cmake, tmp_path):
    env, log = fake_cmake
    env["COMPILEDUMP_BUILD_NATIVE"] = "1"
    out = _wheel(source, tmp_path / "dist", env)
    assert out.returncode != 0, "a failed native build must fail the wheel, not fall back to pure"
    assert log.exists(), "the opt-in did not run cmake"
    assert "COMPILEDUMP_BUILD_NATIVE=1" in out.stdout + out.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


def test_opt_in_wheel_ships_the_library(source, native_build, tmp_path):
    # The stand-in cmake logs its calls; `cmake --build DIR` puts the suite's library in DIR.
    built = native_build / Path(LIBRARY).name
    env, log = _stand_in_cmake(tmp_path, f'if [ "$1" = "--build" ]; then mkdir -p "$2" && cp "{built}" "$2/"; fi')
    env["COMPILEDUMP_BUILD_NATIVE"] = "1"
    out = _wheel(source, tmp_path / "dist", env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    configure, build = log.read_text().splitlines()
    assert configure.startswith(f"-S {source} -B ") and "-DCOMPILEDUMP_BUILD_DRIVER=OFF" in configure, configure
    assert "-DCMAKE_SKIP_BUILD_RPATH=ON" in configure and "-DCMAKE_PREFIX_PATH=" in configure, configure
    assert build.startswith("--build ") and "--target compiledump_native" in build, build
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert not wheel.name.endswith("-none-any.whl"), wheel.name  # platform-specific: it holds a .so
    assert zipfile.ZipFile(wheel).read(LIBRARY) == built.read_bytes()  # what cmake built, not a stale copy

    # Installed, the existing loader finds it (it loads when the ops, the capture API, are imported).
    site = tmp_path / "site"
    out = _pip(["install", "--no-deps", "--target", str(site), str(wheel)], _env(), tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    probe = "import compiledump.ops.native as n; print(n.native_available(), n.loaded_path())"
    out = subprocess.run([sys.executable, "-c", probe], env=_env(PYTHONPATH=str(site)), cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", str(site / LIBRARY)]
