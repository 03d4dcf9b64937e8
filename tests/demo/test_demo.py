"""`compiledump demo`: no divergence on a clean run, the injected layer named on a broken one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import compiledump
from compiledump import cli
from compiledump.ops import native
from helpers import readme_samples


def _demo(capsys, *args):
    status = cli.main(["demo", *args])
    return status, capsys.readouterr().out


# dropped_hc in layer 3 at the default sizes is the README's `compiledump demo --inject-bug 3`.
@pytest.mark.parametrize("bug,layer,sizes", [("dropped_hc", 3, ()), ("routed_scale", 1, ("--layers", "4", "--steps", "4"))])
def test_injected_bug_is_named(dump_dir, tmp_path, capsys, bug, layer, sizes):
    status, out = _demo(capsys, *sizes, "--inject-bug", str(layer), "--bug", bug, "--out", str(tmp_path))
    assert status == 1, out
    last = out.splitlines()[-1]
    assert last.startswith(f"first divergence: layer{layer}") and f"(layer {layer})" in last, last
    if not sizes:  # the README's sample of `compiledump demo --inject-bug 3`
        sample = readme_samples.block_after("compiledump demo --inject-bug 3")
        assert readme_samples.unmatched(sample, out.splitlines()) == []


def test_default_demo_command(tmp_path):
    """The README's command as a user runs it (default sizes), in a fresh process: a clean run
    reports no divergence, without graph breaks or recompiles, and keeps both dumps. Only
    COMPILEDUMP_NATIVE passes through, so CI's pure lane runs it on the Python capture path, as a
    machine without a compiler would, instead of repeating the first lane's run."""
    native_setting = os.environ.get("COMPILEDUMP_NATIVE", "")
    # conftest's TORCHINDUCTOR_VEC_ISA_OK=0 passes through: a user's Inductor vectorizes, but
    # what this checks does not depend on it (the README's numbers are free: readme_samples), and
    # scalar kernels are the ones test_injected_bug_is_named's run at these sizes just compiled, so
    # most come from Inductor's cache (42 s instead of 90 s cold on 2 cores).
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_")}
    if native_setting:
        env["COMPILEDUMP_NATIVE"] = native_setting
    out = subprocess.run([sys.executable, "-m", "compiledump", "demo", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.splitlines()[-1].startswith("no divergence")
    assert "0 graph break(s), 0 recompile(s) after the first decode step" in out.stdout
    assert (tmp_path / "reference").is_dir() and (tmp_path / "engine").is_dir()
    # It says which capture path ran: native where the library was built into the package.
    built = (Path(compiledump.__file__).parent / native.LIBRARY_NAME).exists()
    expected = "native" if built and native_setting != "0" else "python"
    engine = [line for line in out.stdout.splitlines() if "compiled graph(s)" in line]
    assert engine and engine[0].endswith(f"capture path: {expected}"), engine
    # The README shows this output (from a pure-Python install).
    sample = readme_samples.block_after("prints, shortened")
    printed = [line.replace("capture path: native", "capture path: python") for line in out.stdout.splitlines()]
    assert readme_samples.unmatched(sample, printed) == []


def test_bad_options_exit_2(capsys):
    assert cli.main(["demo", "--graphs", "reduce-overhead"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err
    assert cli.main(["demo", "--layers", "0"]) == 2
