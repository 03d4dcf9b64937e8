"""Nothing captured is lost to a crash: the built-in model's compiled decode loop, killed, stopped
or crashed at random moments, then `compiledump recover`, against an uninterrupted run.

100 SIGKILLs cost 100 compiles, so most of the kill moments are taken from one run: SIGSTOP
freezes every thread of the process exactly where a SIGKILL would end it, and a copy of its
crash-proof files (`<stem>.live/`, mapped shared: the page cache is what a reader sees) taken
while it is stopped is what a SIGKILL at that moment would leave. The run then goes on. A few
real SIGKILLs, `os._exit`, a segfault and an unhandled exception check the same thing for real.
"""

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump.capture.recover import recover_directory, recover_live
from compiledump.capture.state import STATE
from compiledump.ops import layout as L
from helpers import forked
from helpers.npz_members import array, assert_same, members

CHILD = Path(__file__).parents[1] / "helpers" / "crash_child.py"
# Gate off: every decode step overwrites every record, so kills land inside record writes too.
ENV = {"COMPILEDUMP_TOKENS": "0", "COMPILEDUMP_ARENA_MB": "3", "COMPILEDUMP_SIGNALS": "1",
       "COMPILEDUMP_MAX_STEPS": "2048"}
STEPS = 2048  # about 0.5 ms each, compiled
KILLS = 100


class Child:
    """A crash_child.py process (forked from one that imported torch: helpers/forked.py) and the
    decode steps it has reported."""

    def __init__(self, mode: str, directory: Path, steps: int, compiled: bool, *extra: str):
        read, write = os.pipe()
        env = {key: value for key, value in {**os.environ, **ENV}.items() if key != "COMPILEDUMP_DIR"}
        self.proc = forked.start([str(CHILD), mode, str(directory), str(write), str(steps), "1" if compiled else "0",
                                  *extra], env=env, pass_fds=(write,), stdout=subprocess.DEVNULL)
        os.close(write)
        self.pipe, self.buffer, self.ready = read, b"", False
        self.last = -1  # the last decode step reported finished

    def drain(self, timeout: float = 0.0) -> None:
        """Read what the child has reported (waiting up to `timeout` for the first bytes)."""
        while select.select([self.pipe], [], [], timeout)[0]:
            chunk = os.read(self.pipe, 65536)
            if not chunk:
                break
            self.buffer += chunk
            timeout = 0.0
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if line == b"ready":
                self.ready = True
            else:
                self.last = int(line)

    def wait_step(self, step: int) -> None:
        deadline = time.monotonic() + 300
        while self.last < step:
            assert self.proc.poll() is None, self.proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, f"the child never finished decode step {step}"
            self.drain(timeout=1.0)

    def finish(self) -> int:
        code = self.proc.wait(timeout=300)
        self.drain()
        os.close(self.pipe)
        return code


def _stopped(pid: int) -> bool:
    """Wait until `pid` is stopped (SIGSTOP is delivered asynchronously); False if it has exited."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # exited and already reaped (by the fork server, not this process)
            return False
        if state in ("T", "t"):
            return True
        if state in ("Z", "X"):
            return False
    raise AssertionError(f"pid {pid} did not stop: state {state}")


def _members(directory: Path) -> dict[str, bytes]:
    """The arrays of the dump in `directory`, as raw .npy members (helpers/npz_members.py)."""
    (path,) = directory.glob("compiledump_*.npz")
    return members(path)


def _manifest(directory: Path) -> dict:
    (path,) = directory.glob("compiledump_*.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted compiled run: its dump (_members), and every record's values after the
    prefill and after each decode step (crash_child.py: row 1 + s after decode step s)."""
    directory = tmp_path_factory.mktemp("reference")
    child = Child("reference", directory, STEPS, True)
    assert child.finish() == 0, child.proc.stderr.read()[-3000:]
    assert child.last == STEPS - 1
    assert not list(directory.glob("*.live")), "a normal exit removes the crash-proof files"
    with np.load(directory / "per_step.npz") as per_step:
        return _members(directory), {key: per_step[key] for key in per_step.files}


def _check_recovered(directory: Path, last: int, reference) -> dict:
    """The recovered dump in `directory` against the uninterrupted run, with `last` the last
    decode step the dead process had reported finished. Returns its manifest."""
    final, per_step = reference
    got = _members(directory)
    manifest = _manifest(directory)
    assert manifest["recovered"]["cause"]
    steps = sorted(int(key.rsplit("_", 1)[1]) for key in got if key.startswith("logits_"))
    # Every reported step is there, and at most the one being run when it died is beyond them.
    assert steps == list(range(len(steps))) and last < len(steps) <= last + 2, (last, steps)
    for n in steps:
        assert_same(got[f"logits_{n}"], final[f"logits_{n}"], f"logits_{n}")
    interrupted = [tag for tag, entry in manifest["tags"].items() if entry["drops"].get("interrupted")]
    assert len(interrupted) <= 1, interrupted  # captures are serialized: at most one was in flight
    records = [key for key in manifest["tags"] if not key.endswith("_<n>")]
    for key in records:
        if key in interrupted:
            assert key not in got  # a torn value is never read
            continue
        kept = manifest["tags"][key]["kept"]
        if not kept:
            continue  # filtered or never written (ids of a new shape: shape_changed)
        # The value of the last reported step (or of the prefill), or of the step in flight if its
        # write was committed: rows last + 1 and last + 2 of its values (the prefill's in row 0).
        value = array(got[key])
        assert key in per_step and any(np.array_equal(value, row) for row in per_step[key][last + 1 : last + 3]), \
            (key, last)
    return manifest


def test_sigkill_at_100_moments_loses_no_reported_step(reference, tmp_path):
    directory = tmp_path / "run"
    child = Child("run", directory, STEPS, True)
    child.wait_step(0)  # compiled: the moments are spread over the decode loop, not its compile
    rng = random.Random(15)
    moments = []
    ran, first = 0.0, child.last  # seconds the child ran between stops, and where it started
    while len(moments) < KILLS and child.proc.poll() is None:
        # Spread what is left of the loop over the moments left, at the pace seen so far.
        pace = max(child.last - first, 1) / ran if ran else 2000.0  # steps per second
        remaining = (STEPS - child.last) / pace  # seconds of the loop left, at that pace
        left = remaining / (KILLS - len(moments))
        # At most half of what is left: the last few pauses, drawn up to 1.6x their share, could
        # otherwise outlast the loop (one run under heavy load ended after 99 stops).
        pause = min(rng.uniform(0, 1.6 * left), 0.5 * remaining)
        time.sleep(pause)
        ran += pause
        child.proc.send_signal(signal.SIGSTOP)
        try:
            if not _stopped(child.proc.pid):
                break  # it had just exited
            child.drain()
            lives = list(directory.glob("*.live"))
            if not lives:  # past its last step, the exit flush has run: nothing left to lose
                assert child.last == STEPS - 1
                continue
            snapshot = tmp_path / f"kill{len(moments)}"
            snapshot.mkdir()
            shutil.copytree(lives[0], snapshot / lives[0].name)
            moments.append((snapshot, child.last))
        finally:
            child.proc.send_signal(signal.SIGCONT)
    assert child.finish() == 0, child.proc.stderr.read()[-3000:]
    assert len(moments) == KILLS, f"the run ended after {len(moments)} stops: make it longer"
    # The run itself, uninterrupted in its values, equals the reference and cleaned up after itself.
    final, _ = reference
    got = _members(directory)
    assert sorted(got) == sorted(final) and all(np.array_equal(array(got[k]), array(final[k])) for k in final)
    assert not list(directory.glob("*.live"))
    torn = 0
    for snapshot, last in moments:
        (live,) = snapshot.glob("*.live")
        result = recover_live(live, force=True)  # the copied journal names a pid that still ran
        assert result.npz is not None and not live.exists()
        manifest = _check_recovered(snapshot, last, reference)
        torn += bool(manifest["drops"].get("interrupted"))
    print(f"{KILLS} moments, last reported steps {moments[0][1]}..{moments[-1][1]}, {torn} inside a capture")


@pytest.mark.parametrize("seed", [1, 2])
def test_real_sigkill(reference, tmp_path, seed):
    child = Child("run", tmp_path, STEPS, True)
    child.wait_step(0)
    time.sleep(random.Random(seed).uniform(0.0, 0.2))  # the loop runs for about 0.5 s
    child.proc.send_signal(signal.SIGKILL)
    assert child.finish() == -signal.SIGKILL
    (live,) = tmp_path.glob("*.live")
    # compare and inspect point to recover; recover by the command line.
    note = subprocess.run([sys.executable, "-m", "compiledump", "inspect", str(tmp_path)], capture_output=True,
                          text=True)
    assert f"compiledump recover {tmp_path}" in note.stderr
    out = subprocess.run([sys.executable, "-m", "compiledump", "recover", str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    assert "cause: the process ended without flushing: SIGKILL" in out, out
    assert not live.exists()
    _check_recovered(tmp_path, child.last, reference)


@pytest.fixture(scope="module")
def eager_reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eager")
    child = Child("reference", directory, 8, False)
    assert child.finish() == 0, child.proc.stderr.read()[-3000:]
    with np.load(directory / "per_step.npz") as data:
        return _members(directory), {key: data[key] for key in data.files}


@pytest.mark.parametrize("mode, cause", [
    ("exit", "the process ended without flushing"),
    ("segfault", "Fatal Python error: Segmentation fault"),
])
def test_crash_without_flush_is_recovered(eager_reference, tmp_path, mode, cause):
    child = Child(mode, tmp_path, 8, False)
    code = child.finish()
    assert code == (3 if mode == "exit" else -signal.SIGSEGV), child.proc.stderr.read()[-2000:]
    assert child.last == 2 and not list(tmp_path.glob("*.npz"))
    results, errors = recover_directory(tmp_path)
    assert errors == [] and len(results) == 1 and cause in results[0].cause
    _check_recovered(tmp_path, 2, eager_reference)
    # A segfault's stack outlives the directory recover removes, where the cause says it is.
    reports = list(tmp_path.glob("*.fault.txt"))
    if mode == "segfault":
        assert [path.name for path in reports] == [results[0].npz.name.replace(".npz", ".fault.txt")]
        assert results[0].cause.endswith(f"(faulthandler's report: {reports[0].name})")
        assert reports[0].read_text().startswith(cause) and "File " in reports[0].read_text()
    else:
        assert reports == []


def test_unhandled_exception_flushes_and_cleans_up(eager_reference, tmp_path):
    child = Child("raise", tmp_path, 8, False)
    assert child.finish() == 1
    assert not list(tmp_path.glob("*.live"))  # the flush at exit ran and removed them
    got, final = _members(tmp_path), eager_reference[0]
    assert sorted(k for k in got if k.startswith("logits_")) == [f"logits_{n}" for n in range(3)]
    assert all(np.array_equal(array(got[k]), array(final[k])) for k in got if k.startswith("logits_"))
    assert recover_directory(tmp_path) == ([], [])


# --- The commit counter and the journal, decided without timing luck ---------------------------


def _live_run(tmp_path):
    compiledump.configure(tokens=0)
    g = torch.Generator().manual_seed(4)
    values = [torch.randn(3, 2, 33, generator=g) for _ in range(3)]
    for x in values:
        compiledump.record("rec", x)
        compiledump.record_step("steps", x[:, 0])
    compiledump.record_ids("ids", torch.arange(5))
    rt = STATE.runtime
    (live,) = tmp_path.glob("*.live")
    return rt, live, values


def test_a_write_claimed_but_not_committed_is_dropped_not_read(dump_dir):
    tmp_path = dump_dir
    rt, live, values = _live_run(tmp_path)
    ctrl = np.memmap(live / "ctrl.i32", dtype=np.int32, mode="r+")
    arena = np.memmap(live / "arena.f32", dtype=np.float32, mode="r+")
    rec = rt.slots[("rec", False)]
    steps = rt.slots[("steps", True)]
    # A kill inside a fourth record and a fourth step: claimed, half written, never committed.
    ctrl[L.slot_base(rec.index) + L.CNT_WRITTEN] += 1
    arena[rec.offset : rec.offset + 16] = 7.0
    ctrl[L.slot_base(steps.index) + L.CNT_WRITTEN] += 1
    arena[steps.offset + 3 * 33 : steps.offset + 3 * 33 + 5] = 7.0
    ctrl.flush()
    arena.flush()
    del ctrl, arena
    STATE.runtime = None  # the process "died": its runtime must not remove the files
    result = recover_live(live, force=True)
    assert result.interrupted == 2
    manifest = _manifest(tmp_path)
    got = {key: array(member) for key, member in _members(tmp_path).items()}
    assert "rec" not in got and manifest["tags"]["rec"]["drops"]["interrupted"] == 1
    assert sorted(k for k in got if k.startswith("steps_")) == ["steps_0", "steps_1", "steps_2"]
    for n, x in enumerate(values):
        np.testing.assert_array_equal(got[f"steps_{n}"], x[0, 0].numpy())
    np.testing.assert_array_equal(got["ids"], np.arange(5, dtype=np.int32))
    assert manifest["tags"]["steps_<n>"]["drops"]["interrupted"] == 1


def test_recover_matches_flush_and_skips_live_processes(dump_dir):
    tmp_path = dump_dir
    rt, live, _ = _live_run(tmp_path)
    flushed = compiledump.flush()
    want = dict(np.load(flushed))
    want_manifest = _manifest(tmp_path)
    # This process is alive: recover leaves its files alone unless forced.
    results, errors = recover_directory(tmp_path)
    assert errors == [] and results[0].skipped and "still be running" in results[0].skipped and live.exists()
    # Without the flushed files (a dump left in place is complete: recover would keep it), recover
    # slices the same arena and control block into the same dump.
    Path(flushed).unlink()
    Path(flushed).with_suffix(".json").unlink()
    results, _ = recover_directory(tmp_path, force=True, keep=True)
    assert results[0].npz == Path(flushed) and live.exists()
    got, manifest = dict(np.load(flushed)), _manifest(tmp_path)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    for field in ("keys", "tags", "drops", "config", "prompt_tokens", "first_nonfinite", "rank", "pid"):
        assert manifest[field] == want_manifest[field], field
    compiledump.reset()
    assert not live.exists()  # reset forgets the captures and their files


def test_unreadable_leftover_is_an_error_not_a_crash(tmp_path, capsys):
    from compiledump import cli

    (tmp_path / "compiledump_rank0_pid1.live").mkdir()
    (tmp_path / "compiledump_rank0_pid1.live" / "journal.jsonl").write_text("not json\n")
    assert cli.main(["recover", str(tmp_path)]) == 2
    assert "journal line 1 is not JSON" in capsys.readouterr().err
    assert cli.main(["recover", str(tmp_path / "missing")]) == 2


def test_no_disk_space_for_a_region_is_counted_not_a_crash(dump_dir, monkeypatch):
    import errno

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    compiledump.record("early", torch.randn(2, 8))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.warns(RuntimeWarning, match="no disk space for tag 'late'"):
        compiledump.record("late", torch.randn(2, 8))
    compiledump.record("late", torch.randn(2, 8))
    manifest = json.loads(Path(compiledump.flush()).with_suffix(".json").read_text())
    assert manifest["tags"]["late"]["drops"] == {"arena_full": 2} and "early" in manifest["keys"]


def test_unmappable_directory_falls_back_to_memory_with_a_warning(dump_dir, monkeypatch):
    import errno

    from compiledump.capture import persist

    def refuse(*_args, **_kwargs):
        raise OSError(errno.ENODEV, "mmap not supported here")

    monkeypatch.setattr(persist, "_mapped", refuse)
    with pytest.warns(RuntimeWarning, match="crash-proof capture is off.*mmap not supported"):
        compiledump.record("x", torch.randn(2, 8))
    assert STATE.runtime.live is None and not list(dump_dir.glob("*.live"))
    assert "x" in np.load(compiledump.flush())


def test_a_forked_child_leaves_its_parents_files_alone(tmp_path):
    """A child forked after capture started shares the mapped arena; its normal exit (atexit
    flush) must not remove or journal into the parent's crash-proof files."""
    script = f"""
import os, signal, sys, torch, compiledump
compiledump.configure(dir={str(tmp_path)!r})
compiledump.record_step("s", torch.arange(6.0).reshape(2, 3))
pid = os.fork()
if pid == 0:
    sys.exit(0)  # atexit: the child's flush
os.waitpid(pid, 0)
compiledump.record_step("s", torch.arange(6.0).reshape(2, 3) + 1)
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_")}
    proc = forked.run(["-c", script], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert len(lives := list(tmp_path.glob("*.live"))) == 1, "the child's exit removed the parent's files"
    results, errors = recover_directory(tmp_path)
    assert errors == [] and [r.npz.name for r in results] == [lives[0].name.replace(".live", ".npz")]
    with np.load(results[0].npz) as data:
        np.testing.assert_array_equal(data["s_1"], np.array([1.0, 2.0, 3.0], dtype=np.float32))  # row 0
