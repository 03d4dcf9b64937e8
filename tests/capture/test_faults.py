"""Failure modes that end the process: signals, and a process killed while flushing.

Each test runs a child Python process (a signal or a kill ends it) and checks its dump against
values the test itself put in. Flushes and captures racing on threads of one live process:
test_flush_threads.py. The children are forked from a process that imported torch once
(helpers/forked.py): each is still a process of its own, with its own handlers and exit, and the
10 of this file no longer import torch 10 times (about 6 s of CPU each on the CI box).
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from compiledump import compare as cmp
from compiledump.cli import main
from helpers import forked

REPO = Path(__file__).resolve().parents[2]


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_") and k != "RANK"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               RANK="0", **extra)
    return env


_children: list[forked.Child] = []


@pytest.fixture(autouse=True)
def _kill_leftover_children():
    """A failed test must not leave a child running (some ignore SIGTERM)."""
    yield
    while _children:
        proc = _children.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_child(script: str, **env) -> forked.Child:
    proc = forked.start(["-c", textwrap.dedent(script)], env=child_env(**env))
    _children.append(proc)
    return proc


def wait_for_line(proc: forked.Child, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) before {text!r}: {proc.stderr.read()}")
    raise AssertionError(f"child never printed {text!r}")


def load_dump(directory: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The one dump in `directory`, fully read (every array), and its manifest."""
    (npz,) = directory.glob("compiledump_rank*_pid*.npz")
    with np.load(npz, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    manifest = json.loads(npz.with_suffix(".json").read_text())
    return arrays, manifest


# A child that captures until a file STOP exists: step n stores the value n (record_step),
# `last` the latest n.
CAPTURING = """
    import os, signal, sys, torch, compiledump
    STOP = None
    {setup}
    for n in range(10**9):
        compiledump.record_step("h", torch.full((1, 8), float(n)))
        compiledump.record("last", torch.full((2, 8), float(n)))
        if n == 20:
            print("ready", flush=True)
        if n > 20 and STOP and os.path.exists(STOP):
            break
"""


def check_capturing_dump(directory: Path) -> None:
    arrays, manifest = load_dump(directory)
    steps = sorted((k for k in arrays if k.startswith("h_")), key=lambda k: int(k[2:]))
    assert len(steps) >= 21 and steps == [f"h_{n}" for n in range(len(steps))]
    for n, key in enumerate(steps):
        np.testing.assert_array_equal(arrays[key], np.full(8, float(n), np.float32))
    calls_h = manifest["tags"]["h_<n>"]["calls"]
    calls_last = manifest["tags"]["last"]["calls"]
    # The signal may land between the two captures of one iteration.
    assert calls_h - calls_last in (0, 1)
    assert set(manifest["keys"]) == set(arrays)
    assert float(arrays["last"][0]) == calls_last - 1


@pytest.mark.parametrize("host", ["none", "python_handler", "ignore"])
def test_sigterm_flushes_a_complete_dump_and_chains(tmp_path, host):
    """Acceptance 2: SIGTERM to a capturing child leaves a complete, loadable dump; the
    application's own handler still runs, an ignored SIGTERM stays ignored (the child goes on
    until told to stop), and without a handler the process dies of SIGTERM."""
    dump, stop = tmp_path / "dump", tmp_path / "stop"
    setup = {
        "none": "",
        "python_handler": "signal.signal(signal.SIGTERM, lambda *a: (print('host handler', flush=True), sys.exit(3)))",
        "ignore": f"signal.signal(signal.SIGTERM, signal.SIG_IGN); STOP = {str(stop)!r}",
    }[host]
    # The application's handler comes first; compiledump becomes active after it (configure).
    setup = "; ".join(filter(None, [setup, f"compiledump.configure(dir={str(dump)!r})"]))
    proc = start_child(CAPTURING.format(setup=setup))
    wait_for_line(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    if host == "ignore":
        deadline = time.monotonic() + 30
        while not list(dump.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert proc.poll() is None  # SIGTERM was ignored after the flush: still capturing
        check_capturing_dump(dump)
        stop.touch()
    out, err = proc.communicate(timeout=60)
    expected = {"none": -signal.SIGTERM, "python_handler": 3, "ignore": 0}[host]
    assert proc.returncode == expected, err
    assert "on signal" in err
    if host == "python_handler":
        assert "host handler" in out
    check_capturing_dump(dump)
    assert not list(dump.glob(".*.tmp"))
    assert not list(dump.glob("*.live"))  # the dump is complete: no crash-proof files are left


def test_sigint_flushes_then_raises_keyboardinterrupt(tmp_path):
    proc = start_child(CAPTURING.format(setup=""), COMPILEDUMP_DIR=str(tmp_path))
    wait_for_line(proc, "ready")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err and "on signal" in err
    assert proc.returncode in (-signal.SIGINT, 1, 130)
    check_capturing_dump(tmp_path)
    assert not list(tmp_path.glob("*.live"))


def test_signal_while_the_interrupted_frame_holds_the_runtime_locks(tmp_path):
    """The handler runs on the main thread between two bytecodes of whatever it interrupted:
    a capture registering a tag (runtime lock), a CPU capture (kernel lock) or a flush (flush
    lock). It must flush without waiting for them (a plain lock would deadlock)."""
    script = f"""
        import os, signal, time, torch, compiledump
        from compiledump.capture.state import STATE
        from compiledump.ops.register import KERNEL_LOCK
        T0 = None
        # The application's handler, chained after the flush: reports how long the flush took.
        signal.signal(signal.SIGTERM, lambda *a: (print(f"elapsed {{time.monotonic() - T0:.3f}}", flush=True),
                                                  os._exit(7)))
        compiledump.configure(dir={str(tmp_path)!r})
        compiledump.record("a", torch.arange(6.0).reshape(2, 3))
        compiledump.record_step("s", torch.ones(1, 4))
        with STATE.lock, STATE.flush_lock, KERNEL_LOCK:
            T0 = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
        print("not reached", flush=True)
    """
    proc = start_child(script)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert "not reached" not in out
    # Flushed at once: no lock wait, not even one that would time out.
    assert float(out.split("elapsed ")[1]) < 2.0, out
    arrays, manifest = load_dump(tmp_path)
    np.testing.assert_array_equal(arrays["a"], [3.0, 4.0, 5.0])
    np.testing.assert_array_equal(arrays["s_0"], np.ones(4, np.float32))


def test_signal_inside_the_kernel_waits_for_the_capture_to_finish(tmp_path):
    """Deterministic version of the race the capturing tests hit by chance: SIGTERM raised on
    the line right after the CPU kernel counted a capture and before it wrote it. The handler
    must not flush that half-done capture: it lets the call finish and takes the signal again."""
    script = f"""
        import inspect, os, signal, sys, time, torch, compiledump
        from compiledump.ops import reference  # stepped through: COMPILEDUMP_NATIVE=0 below
        compiledump.configure(dir={str(tmp_path)!r})
        compiledump.record_step("h", torch.full((1, 8), 1.0))
        lines, first = inspect.getsourcelines(reference.capture_reference)
        counted = next(first + i for i, line in enumerate(lines) if "regs[base + counter] =" in line)
        fired = []

        def tracer(frame, event, arg):
            if frame.f_code is not reference.capture_reference.__code__:
                return None
            def line(frame, event, arg):
                if event == "line" and frame.f_lineno > counted and not fired:
                    fired.append(frame.f_lineno)
                    print("fired", flush=True)
                    os.kill(os.getpid(), signal.SIGTERM)
                return line
            return line

        sys.settrace(tracer)
        compiledump.record_step("h", torch.full((1, 8), 2.0))
        sys.settrace(None)
        print("returned", flush=True)
        time.sleep(30)  # the deferred signal ends the process
    """
    proc = start_child(script, COMPILEDUMP_NATIVE="0")
    out, err = proc.communicate(timeout=90)
    assert out.split() == ["fired", "returned"], (out, err)
    assert proc.returncode == -signal.SIGTERM, err
    arrays, manifest = load_dump(tmp_path)
    np.testing.assert_array_equal(arrays["h_0"], np.full(8, 1.0, np.float32))
    np.testing.assert_array_equal(arrays["h_1"], np.full(8, 2.0, np.float32))
    assert manifest["tags"]["h_<n>"]["calls"] == 2


def test_handlers_only_from_the_main_thread_and_can_be_turned_off(tmp_path):
    script = f"""
        import signal, threading, compiledump
        from compiledump.capture import signals
        t = threading.Thread(target=lambda: compiledump.configure(dir={str(tmp_path)!r}))
        t.start(); t.join()
        print("thread", signals.installed(), flush=True)
        compiledump.configure(dir={str(tmp_path)!r})
        print("main", signals.installed(), flush=True)
    """
    default, off = start_child(script), start_child(script, COMPILEDUMP_SIGNALS="0")
    out, err = default.communicate(timeout=60)
    assert out.split("\n")[:2] == ["thread False", "main True"], err
    out, err = off.communicate(timeout=60)
    assert out.split("\n")[:2] == ["thread False", "main False"], err


# ----------------------------------------------------------------------------------------------
# Killed while flushing
# ----------------------------------------------------------------------------------------------


FLUSHING = """
    import torch, compiledump
    compiledump.configure(dir={dir!r}, arena_mb=64)
    for t in range(24):
        compiledump.record(f"t{{t}}", torch.full((2, 131072), float(t)))
    n = 0
    while True:
        compiledump.record_step("s", torch.full((1, 4), float(n)))
        n += 1
        compiledump.flush()
        if n == 2:
            print("flushing", flush=True)
"""


@pytest.mark.parametrize("target", [".npz.", ".json."])
def test_kill_during_flush_leaves_no_truncated_file(tmp_path, target):
    """Acceptance 2: SIGKILL while a flush writes (a temporary file of the npz, or of the
    manifest, exists at that moment) leaves the final files complete: every array loads with
    the values captured, and the manifest only names keys the npz holds."""
    proc = start_child(FLUSHING.format(dir=str(tmp_path)))
    wait_for_line(proc, "flushing")
    caught = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not caught:
        for entry in os.scandir(tmp_path):
            if entry.name.startswith(".") and target in entry.name and entry.name.endswith(".tmp"):
                proc.kill()
                caught = True
                break
    proc.kill()
    proc.communicate(timeout=60)
    assert caught, f"never saw a {target} temporary file"
    arrays, manifest = load_dump(tmp_path)
    for t in range(24):
        np.testing.assert_array_equal(arrays[f"t{t}"], np.full(131072, float(t), np.float32))
    steps = sorted((k for k in arrays if k.startswith("s_")), key=lambda k: int(k[2:]))
    assert steps == [f"s_{n}" for n in range(len(steps))] and len(steps) >= 2
    for n, key in enumerate(steps):
        np.testing.assert_array_equal(arrays[key], np.full(4, float(n), np.float32))
    # The npz may be one flush ahead of the manifest (it is written first), never behind.
    assert set(manifest["keys"]) <= set(arrays)
    for key, entry in manifest["keys"].items():
        assert list(arrays[key].shape) == entry["shape"]
    # Leftover temporaries are hidden files the readers never pick up.
    assert main(["inspect", str(tmp_path)]) == 0
    assert len(cmp.collect_dumps(tmp_path, "REF")[0]) == 1
