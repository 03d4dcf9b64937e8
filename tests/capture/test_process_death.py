"""A process that dies is never read as one that ran to the end, and what it leaves is never
replaced by less: a run killed by an unhandled exception is marked in its dump and compared as
cut short (exit 3, not "no divergence"); a `clear()` after the last flush does not make the exit
flush or `recover` write an empty dump over it; files a process left while it was making them
(killed before its journal's first line) are cleaned up, not advertised as data to recover.

Each scenario runs a real child process (tiny script, random values), so the exit flush, the
excepthook and SIGKILL are the real ones. The children are forked from one process that has
imported torch (helpers/forked.py: that import was most of each child's CPU time), and
the uninterrupted run the cut-short ones are compared with is made once for the file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump import cli
from compiledump.capture.recover import dead_leftovers, recover_directory
from compiledump.format import spec
from helpers import forked

# Tokens 3: a record keeps 3-row calls; the step tag takes one row per call.
CHILD = """
import os, signal, sys
import torch
torch.set_num_threads(1)
import compiledump
compiledump.configure(dir=sys.argv[1], tokens=3, persist=sys.argv[3] == "persist")
g = torch.Generator().manual_seed(int(sys.argv[4]))
steps = int(sys.argv[5])
for layer in range(4):
    compiledump.record(f"layer{layer}", torch.randn(3, 17, generator=g))
for step in range(steps):
    compiledump.record_step("logits", torch.randn(1, 29, generator=g))
how = sys.argv[2]
if how == "raise":
    raise RuntimeError("simulated engine crash\\nsecond line")
if how == "sigterm":  # a job's timeout, or torchrun stopping the ranks after one failed
    os.kill(os.getpid(), signal.SIGTERM)
if how.startswith(("clear", "move")):
    path = compiledump.flush()
    if how.startswith("move"):  # the program archives each dump it flushed
        for suffix in (".npz", ".json"):
            os.replace(path[:-4] + suffix, os.path.join(sys.argv[1], "..", "archive" + suffix))
    if how == "move_raise":
        raise RuntimeError("after the archived flush")
    if how == "move_kill":
        os.kill(os.getpid(), signal.SIGKILL)
    compiledump.clear()
    if how == "clear_profile":  # calls, none kept (profiling() suspends them)
        with compiledump.profiling():
            compiledump.record("layer0", torch.randn(3, 17, generator=g))
    if how.endswith("_kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if how.endswith("_sigterm"):
        os.kill(os.getpid(), signal.SIGTERM)
"""


def _child(directory: Path, how: str, steps: int = 5, persist: bool = False, seed: int = 0):
    env = {**os.environ, "COMPILEDUMP_SIGNALS": "1"}
    return forked.run(["-c", CHILD, *map(str, [directory, how, "persist" if persist else "-", seed, steps])], env=env,
                      timeout=120)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted run (5 decode steps, seed 0) the cut-short runs are compared with; one
    for the file, as compare only reads it. Its exit status is asserted by the first test."""
    directory = tmp_path_factory.mktemp("ref") / "ref"
    return directory, _child(directory, "exit", steps=5)


def _compare(ref: Path, run: Path) -> tuple[int, dict, str]:
    out = run.parent / f"report_{run.name}.json"  # beside RUN: REF is shared by the tests
    proc = subprocess.run([sys.executable, "-m", "compiledump", "compare", str(ref), str(run), "--json", str(out),
                           "--table", "none"], capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(out.read_text()), proc.stdout


def test_a_run_killed_by_an_unhandled_exception_is_marked_and_compared_as_cut_short(tmp_path, ref):
    (ref, made), run = ref, tmp_path / "run"
    assert made.returncode == 0, made.stderr[-2000:]
    died = _child(run, "raise", steps=2)  # the same values, 3 of 5 decode steps missing
    assert died.returncode == 1 and "simulated engine crash" in died.stderr  # the user's traceback stands
    (manifest,) = [json.loads(p.read_text()) for p in run.glob("*.json")]
    assert manifest["ended_by"] == {"exception": "RuntimeError", "message": "simulated engine crash\nsecond line"}
    status, report, text = _compare(ref, run)
    assert status == 3  # before: 0, "no divergence", as if the run had ended normally
    assert report["first_divergence"] is None and report["compared"] == 6  # 4 layers + logits_0, logits_1
    (pair,) = report["pairs"]
    assert pair["ended_early"] == "RUN ended early: its process died (3 keys of REF not judged)"
    last = text.strip().splitlines()[-1]
    assert last.startswith("no divergence") and "RUN ended early: its process died (3 keys of REF not judged)" in last
    assert any("died of an unhandled RuntimeError: simulated engine crash:" in note for note in report["notes"])
    inspected = subprocess.run([sys.executable, "-m", "compiledump", "inspect", str(run)], capture_output=True, text=True)
    assert "ended by: an unhandled RuntimeError: simulated engine crash" in inspected.stdout, inspected.stdout
    # REF's keys all held by the dead side: a note only, the exit status of a whole comparison.
    assert _child(tmp_path / "late", "raise", steps=5).returncode == 1
    status, report, _ = _compare(ref, tmp_path / "late")
    assert status == 0 and report["pairs"][0]["ended_early"] is None
    assert any("it holds every key the other side holds" in note for note in report["notes"])


def test_a_divergence_before_the_crash_is_still_named(tmp_path, ref):
    (ref, _), run = ref, tmp_path / "run"
    _child(run, "raise", steps=2, seed=1)  # other values: layer0 diverges
    status, report, _ = _compare(ref, run)
    assert status == 1 and report["first_divergence"]["key"] == "layer0"
    assert report["pairs"][0]["ended_early"] is not None


def test_a_run_a_signal_ended_is_marked_and_compared_as_cut_short(tmp_path, ref):
    (ref, _), run = ref, tmp_path / "run"
    assert _child(run, "sigterm", steps=2).returncode == -15  # it still dies of the signal
    (manifest,) = [json.loads(p.read_text()) for p in run.glob("*.json")]
    assert manifest["ended_by"] == {"signal": "SIGTERM"}
    status, report, _ = _compare(ref, run)  # before: exit 0, "no divergence"
    assert status == 3 and report["pairs"][0]["ended_early"] is not None
    assert any("was written by compiledump's SIGTERM handler as that signal ended the process" in note
               for note in report["notes"])


@pytest.mark.parametrize("how", ["clear_exit", "clear_kill", "clear_sigterm", "clear_profile", "move_clear_kill",
                                 "move_raise", "move_kill"])
def test_a_clear_after_the_last_flush_leaves_that_dump_whole(tmp_path, how):
    """Nothing kept since the clear() (or the exception) after the last flush: neither the exit
    flush, the signal handler's flush nor recover writes an empty dump over it, nor brings back
    one the program archived (before: an empty dump in each case; the last, the whole dump again)."""
    directory = tmp_path / "d"
    _child(directory, how, steps=3, persist=True)
    results, errors = recover_directory(directory)  # nothing to do after the exit flush
    assert not errors and not list(directory.glob(f"*{spec.LIVE_SUFFIX}"))
    if how == "move_kill":  # its files gone, nothing captured since: recover rebuilds that dump (as before)
        (result,) = results
        npz = result.npz
        assert npz.parent == directory and result.keys == 7
    elif how.startswith("move"):
        assert not list(directory.glob("*.npz")) and not list(directory.glob("*.json"))
        npz = tmp_path / "archive.npz"
        if how == "move_clear_kill":
            (result,) = results
            assert "nothing was captured since the clear() after its last flush: no dump to write" in result.skipped
    else:
        (npz,) = directory.glob("*.npz")
    if how == "clear_kill":  # before: recovered as an empty dump, over the complete one
        (result,) = results
        assert result.npz == npz and "left as it is" in result.notes[0]
    g = torch.Generator().manual_seed(0)  # the child's values, in its order
    expected = {f"layer{i}": torch.randn(3, 17, generator=g)[-1] for i in range(4)}  # one row: the last
    expected.update({f"logits_{n}": torch.randn(1, 29, generator=g)[0] for n in range(3)})
    with np.load(npz) as dump:  # before: 0 keys
        assert sorted(dump.files) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(dump[key], value.numpy())


def test_files_left_by_a_process_killed_while_making_them_are_removed_not_advertised(tmp_path, capsys):
    directory = tmp_path / "d"
    directory.mkdir()
    for name, journal in (("compiledump_rankx_pid999999991", None), ("compiledump_rankx_pid999999992", b'{"event":"sta')):
        live = directory / f"{name}{spec.LIVE_SUFFIX}"
        live.mkdir()
        (live / spec.LIVE_CTRL).write_bytes(bytes(64))
        if journal is not None:
            (live / spec.LIVE_JOURNAL).write_bytes(journal)  # the start line torn by the kill
        (directory / f".{name}{spec.CLAIM_SUFFIX}").touch()
        os.utime(live, (os.path.getmtime(live) - 600,) * 2)  # made 10 minutes ago
    assert dead_leftovers(directory) == []  # before: both, "recover turns it into dumps"
    assert cli.main(["recover", str(directory)]) == 0  # before: exit 2, "the journal has no start event"
    out = capsys.readouterr().out
    assert out.count("nothing to recover: its process died while making these files, before any capture") == 2
    assert sorted(p.name for p in directory.iterdir()) == []


@pytest.mark.parametrize("pid, age", [("this process", 600), (999999993, 5)])
def test_files_being_made_by_a_live_process_are_left_alone(tmp_path, pid, age):
    """Its pid alive here, or made a moment ago (its process may be on another host or in another
    pid namespace, mapping a large arena: before, recover removed those files under it)."""
    live = tmp_path / f"compiledump_rankx_pid{os.getpid() if pid == 'this process' else pid}{spec.LIVE_SUFFIX}"
    live.mkdir()
    os.utime(live, (os.path.getmtime(live) - age,) * 2)
    (result,), errors = recover_directory(tmp_path)
    assert not errors and "may still be making these files" in result.skipped and live.is_dir()
    (result,), _ = recover_directory(tmp_path, force=True)
    assert "nothing to recover" in result.skipped and not live.exists()


def test_an_exception_an_interactive_session_survives_does_not_mark_the_dump(dump_dir, monkeypatch):
    from compiledump.capture import api
    from compiledump.capture.state import STATE

    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    api._note_exception(NameError, NameError("name 'runn' is not defined"))
    assert STATE.ended_by is None
    monkeypatch.delattr(sys, "ps1")
    monkeypatch.setattr(sys, "flags", type("Flags", (), {"interactive": 0})())
    api._note_exception(NameError, NameError("x"))
    assert STATE.ended_by == {"exception": "NameError", "message": "x"}


def test_a_new_runtime_after_reset_writes_its_dump_and_a_signal_keeps_the_exception(tmp_path):
    """The clear() rule is the runtime's: a runtime made after reset() whose calls were all dropped
    still writes its dump (its drops counted) (before: nothing, because an earlier runtime had
    written one). A SIGTERM arriving during an exception's exit flush keeps the exception."""
    from compiledump.capture import flush as flush_module
    from compiledump.capture.state import STATE

    try:
        compiledump.configure(dir=str(tmp_path / "a"), tokens=3)
        compiledump.record("layer0", torch.randn(3, 8))
        assert compiledump.flush() is not None
        compiledump.reset()
        compiledump.configure(dir=str(tmp_path / "b"), tokens=3)
        compiledump.record("layer0", torch.randn(5, 8))  # the token gate drops it
        path = flush_module.flush_if_changed()
        assert path is not None and json.loads(Path(path).with_suffix(".json").read_text())["drops"] == {"token_gate": 1}
        STATE.ended_by = {"exception": "RuntimeError", "message": "CUDA error"}
        flush_module.flush_on_signal("SIGTERM")
        assert STATE.ended_by == {"exception": "RuntimeError", "message": "CUDA error"}
    finally:
        compiledump.reset()
        compiledump.configure(dir=None, tokens="auto")


def test_a_dying_process_marks_only_the_last_dump_s_directory(tmp_path):
    """A -> B -> A, then an exception: the last dump (B's, written at the switch back) holds every
    capture; A's, still there, is not rewritten with B's captures to carry `ended_by`."""
    from compiledump.capture import flush as flush_module
    from compiledump.capture.state import STATE

    a, b = tmp_path / "a", tmp_path / "b"
    try:
        compiledump.configure(dir=str(a), tokens=3)
        compiledump.record("layer0", torch.randn(3, 8))
        compiledump.configure(dir=str(b))  # A's dump written here
        compiledump.record("layerB", torch.randn(3, 8))
        compiledump.configure(dir=str(a))  # B's dump written here
        STATE.ended_by = {"exception": "RuntimeError", "message": "late"}
        flush_module.flush_if_changed()
        (npz,) = a.glob("*.npz")
        with np.load(npz) as dump:
            assert dump.files == ["layer0"]  # before: ['layer0', 'layerB']
    finally:
        compiledump.reset()
        compiledump.configure(dir=None, tokens="auto")


def test_configure_takes_a_bool_for_persist():
    try:
        assert compiledump.configure(persist=True).persist == "1"
        assert compiledump.configure(persist=False).persist == "0"
        with pytest.raises(ValueError, match="or a bool"):
            compiledump.configure(persist="yes")
    finally:
        compiledump.configure(persist="auto")
