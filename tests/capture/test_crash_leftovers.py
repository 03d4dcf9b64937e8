"""What a dead process left is never destroyed by the next one, nor by a version that cannot read
it, and a flush writes what the manifest must say even when no capture changed.

A restarted container's process, or a replica in another pid namespace, can have the same rank
and pid as the process whose dump or crash-proof files are already in the directory. Simulated
here by rewriting a real leftover's journal to this process's pid with another process's start
time (what such a process would find).

The tests that need a process killed after its captures fork it from one process that has
imported torch (helpers/forked.py: that import was most of each child's CPU time).
"""

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump import cli
from compiledump.capture import flush as flush_module
from compiledump.capture import persist
from compiledump.capture.flush import flush_at_exit
from compiledump.capture.recover import dead_leftovers, read_journal, recover_directory, recover_live
from compiledump.capture.state import STATE
from compiledump.format import spec
from compiledump.format.files import collect_dumps
from helpers import forked


def _rewrite_start(live: Path, **fields) -> None:
    journal = live / spec.LIVE_JOURNAL
    lines = journal.read_text().splitlines()
    start = {**json.loads(lines[0]), **fields}
    start = {k: v for k, v in start.items() if v is not None}
    journal.write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")


def _leftover_of_an_earlier_process(directory: Path, values) -> Path:
    """`<stem of this process>.live` with `values` recorded as steps, left by a "dead" process
    that had this pid (another start time)."""
    for x in values:
        compiledump.record_step("s", x)
    live = STATE.runtime.live.path
    kept = directory.parent / "kept.live"
    shutil.copytree(live, kept)
    compiledump.reset()  # this process forgets them; the copy is the dead process's
    flush_module._CLAIMED.clear()  # and the file name: it was never this process's
    shutil.move(kept, live)
    start, _, _ = read_journal(live)
    _rewrite_start(live, start_time=start["start_time"] - 1)
    return live


def test_a_later_process_with_the_same_pid_never_removes_or_overwrites_the_earlier_ones_files(dump_dir):
    g = torch.Generator().manual_seed(0)
    earlier = [torch.randn(3, 17, generator=g) for _ in range(3)]
    live = _leftover_of_an_earlier_process(dump_dir, earlier)
    base = live.name.removesuffix(spec.LIVE_SUFFIX)
    # A dump the earlier process flushed before it died, under the same name.
    (dump_dir / f"{base}.json").write_text("{}")

    mine = torch.randn(5, 17, generator=g)[:, ::1]
    compiledump.record_step("s", mine)
    path = Path(compiledump.flush())
    assert path.name == f"{base}_2.npz" and live.is_dir() and (dump_dir / f"{base}.json").read_text() == "{}"
    assert STATE.runtime.live.path.name == f"{base}_2{spec.LIVE_SUFFIX}"
    with np.load(path) as data:
        np.testing.assert_array_equal(data["s_0"], mine[0].numpy())
    flush_at_exit()  # this process's exit: its own crash-proof files go, the earlier one's stay
    assert live.is_dir() and not (dump_dir / f"{base}_2{spec.LIVE_SUFFIX}").exists()

    (dump_dir / f"{base}.json").unlink()
    results, errors = recover_directory(dump_dir)
    assert errors == [] and [r.npz.name for r in results] == [f"{base}.npz"]
    with np.load(results[0].npz) as data:
        for n, x in enumerate(earlier):
            np.testing.assert_array_equal(data[f"s_{n}"], x[0].numpy())
    # Both files are rank x's: the reader reads the later run's (the recovery, done after it, takes
    # the dead run's start as its time) and names the other.
    assert spec.DUMP_NAME.match(path.name).group("rank") == "x"
    chosen, duplicates = collect_dumps(dump_dir, "RUN")
    assert chosen["x"].name == f"{base}_2.npz" and [d.path.name for d in duplicates] == [f"{base}.npz"]


def test_the_stem_a_flush_wrote_under_is_the_one_recover_writes(dump_dir, monkeypatch):
    """The rank became known after the crash-proof files were made (init_process_group after the
    first capture): the flush writes rank 0's name, and so does recover after a kill."""
    monkeypatch.delenv("RANK", raising=False)
    compiledump.record_step("s", torch.randn(2, 9))
    live = STATE.runtime.live.path
    assert "_rankx_" in live.name
    monkeypatch.setenv("RANK", "0")
    flushed = Path(compiledump.flush())
    assert "_rank0_" in flushed.name
    compiledump.record_step("s", torch.randn(2, 9))  # after the flush, then the process is killed
    STATE.runtime = None  # "killed": nothing of this process touches the files again
    result = recover_live(live, force=True)
    assert result.npz == flushed and sorted(np.load(flushed).files) == ["s_0", "s_1"]
    assert sorted(p.name for p in dump_dir.glob("*.npz")) == [flushed.name]


@pytest.mark.parametrize("start_fields", [
    {"control_layout": 7013},
    # A journal from before the field: a block of another size for its max_tags.
    {"control_layout": None, "ctrl_words": 8 + 1025 * 13},
], ids=["another_layout", "older_journal"])
def test_recover_refuses_a_control_block_of_another_layout_and_changes_nothing(dump_dir, capsys, start_fields):
    compiledump.record_step("s", torch.randn(2, 9))
    live = STATE.runtime.live.path
    STATE.runtime = None
    _rewrite_start(live, compiledump_version="0.0.1", **start_fields)
    before = sorted((p.name, p.stat().st_size) for p in live.iterdir())
    results, errors = recover_directory(dump_dir, force=True)
    assert results == [] and len(errors) == 1 and "layout" in errors[0] and "0.0.1" in errors[0]
    assert sorted((p.name, p.stat().st_size) for p in live.iterdir()) == before
    assert not list(dump_dir.glob("*.npz"))
    assert cli.main(["recover", "--force", str(dump_dir)]) == 2
    assert "recover it with the version that wrote it" in capsys.readouterr().err and live.is_dir()


def test_a_full_disk_for_the_journal_warns_and_never_fails_the_model(dump_dir, monkeypatch):
    compiledump.record("early", torch.randn(2, 8))

    def full(self, event):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persist.LiveFiles, "_append", full)
    x = torch.randn(2, 8)
    with pytest.warns(RuntimeWarning, match="cannot append to the crash-proof journal.*No space left"):
        compiledump.record("late", x)
    compiledump.record_step("later", x)  # warned once
    with np.load(compiledump.flush()) as data:
        np.testing.assert_array_equal(data["late"], x[-1].numpy())
        assert "later_0" in data.files and "early" in data.files


def test_switching_capture_off_writes_what_it_captured(dump_dir):
    x = torch.randn(3, 11)
    compiledump.record("a", x)
    compiledump.record_step("s", x)
    live = STATE.runtime.live.path
    compiledump.configure(dir=None)
    (written,) = dump_dir.glob("*.npz")
    with np.load(written) as data:
        np.testing.assert_array_equal(data["a"], x[-1].numpy())
        np.testing.assert_array_equal(data["s_0"], x[0].numpy())
    flush_at_exit()  # capture is off; the dump holds everything, so the crash-proof files go
    assert not live.exists() and list(dump_dir.glob("*.npz")) == [written]


def test_the_exit_flush_writes_declarations_made_after_the_last_flush(dump_dir):
    compiledump.record("layer0_mlp", torch.randn(3, 8))
    compiledump.flush()
    compiledump.set_parallel(tp_rank=1, tp_size=2)
    compiledump.declare_shard("layer0_mlp", dim=-1)
    flush_at_exit()
    manifest = json.loads(next(dump_dir.glob("*.json")).read_text())
    assert manifest["parallel"]["tp_rank"] == 1
    assert manifest["keys"]["layer0_mlp"]["shard"]["how"] == "concat"


_FLUSH_THEN_DIE = """
import os, sys, torch, compiledump
compiledump.configure(dir=sys.argv[1])
compiledump.set_parallel(tp_rank=1, tp_size=2)
compiledump.declare_shard("h", dim=-1)
g = torch.Generator().manual_seed(3)
for _ in range(2):
    compiledump.record_step("h", torch.randn(2, 6, generator=g))
compiledump.flush()
if sys.argv[2] == "more":
    compiledump.record_step("h", torch.randn(2, 6, generator=g))
os._exit(0)  # (an application's own signal handler ending the process after compiledump's flushed)
"""


@pytest.mark.parametrize("after_flush", ["nothing", "more"])
def test_recover_keeps_a_complete_dump_and_what_only_the_flush_knew(tmp_path, after_flush):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_")}
    proc = forked.run(["-c", _FLUSH_THEN_DIE, str(tmp_path), after_flush], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (npz,) = tmp_path.glob("*.npz")
    flushed = npz.read_bytes()
    assert [live.name for live in dead_leftovers(tmp_path)] == ([] if after_flush == "nothing" else
                                                                [npz.name.replace(".npz", spec.LIVE_SUFFIX)])
    results, errors = recover_directory(tmp_path)
    assert errors == [] and [r.npz for r in results] == [npz] and not list(tmp_path.glob("*.live"))
    manifest = json.loads(npz.with_suffix(".json").read_text())
    assert manifest["parallel"] == {"tp_rank": 1, "tp_size": 2}
    steps = sorted(key for key in manifest["keys"] if key.startswith("h_"))
    if after_flush == "nothing":
        assert npz.read_bytes() == flushed and "recovered" not in manifest and "left as it is" in results[0].notes[0]
        assert steps == ["h_0", "h_1"]
    else:
        assert manifest["recovered"] and steps == ["h_0", "h_1", "h_2"]
        assert all(manifest["keys"][key]["shard"]["how"] == "concat" for key in steps)


_DIE_BEFORE_ANY_FLUSH = """
import os, sys, torch, compiledump
compiledump.configure(dir=sys.argv[1], moe_layers=1)
early = sys.argv[2] == "early"
if early:
    compiledump.set_parallel(tp_rank=1, tp_size=2)
    compiledump.declare_shard("layer\\d+_mlp", dim=-1)
g = torch.Generator().manual_seed(3)
for _ in range(2):
    compiledump.record_step("layer0_mlp", torch.randn(2, 6, generator=g))
    compiledump.record("layer5_mlp", torch.randn(2, 6, generator=g))  # past moe_layers: filtered
    if not early:  # declared once the crash-proof files exist (an engine's workers set up late)
        compiledump.set_parallel(tp_rank=1, tp_size=2)
        compiledump.declare_shard("layer\\d+_mlp", dim=-1)
        compiledump.declare_shard("nothing_matches", dim=0)
os._exit(0)  # killed before any flush
"""


@pytest.mark.parametrize("declared", ["early", "late"])
def test_a_rank_killed_before_any_flush_keeps_its_shards(tmp_path, declared):
    """Only a flush's manifest held set_parallel, declare_shard and the filtered tags, so a TP rank
    killed before its first flush was recovered without them: compare could not merge its shards
    with the other ranks'. The journal holds them now."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_")}
    proc = forked.run(["-c", _DIE_BEFORE_ANY_FLUSH, str(tmp_path), declared], env=env, timeout=120)
    assert proc.returncode == 0 and not list(tmp_path.glob("*.npz")), proc.stderr[-2000:]
    results, errors = recover_directory(tmp_path)
    assert errors == [] and len(results) == 1
    manifest = json.loads(results[0].npz.with_suffix(".json").read_text())
    assert manifest["recovered"] and manifest["parallel"] == {"tp_rank": 1, "tp_size": 2}
    assert manifest["filtered_tags"] == {"layer5_mlp": "moe_layers"}
    assert [key for key in manifest["keys"]] == ["layer0_mlp_0", "layer0_mlp_1"]
    assert all(entry["shard"] == {"dim": 0, "how": "concat", "group": "tp"} for entry in manifest["keys"].values())


def test_a_failed_exit_flush_is_the_cause_recover_gives(dump_dir, monkeypatch, capsys):
    """A normal exit whose flush failed (a full disk) was reported as a kill by recover."""
    from compiledump.format import writer

    compiledump.record_step("s", torch.randn(2, 5))
    live = STATE.runtime.live.path

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_dump", full)
    flush_at_exit()
    assert "flush at exit failed" in capsys.readouterr().err and live.is_dir()
    monkeypatch.undo()
    STATE.runtime = None  # the process has exited
    result = recover_live(live, force=True)
    assert result.cause.startswith("the process exited, but its flush at exit failed: OSError(28")
    assert "s_0" in np.load(result.npz).files


def test_captures_after_clear_are_recovered_though_the_counts_repeat_the_flushed_ones(dump_dir):
    """flush(), clear(), the same request again, then a kill: the counters equal the flushed ones,
    and recover kept the first request's dump as complete (a review)."""
    first, second = torch.randn(2, 6), torch.randn(2, 6)
    compiledump.record_step("s", first)
    compiledump.flush()
    compiledump.clear()
    compiledump.record_step("s", second)
    live = STATE.runtime.live.path
    STATE.runtime = None  # killed
    result = recover_live(live, force=True)
    assert not result.notes
    np.testing.assert_array_equal(np.load(result.npz)["s_0"], second[0].numpy())


def test_a_name_another_process_reserved_is_not_taken(dump_dir):
    """Two processes of one rank and pid (pid namespaces) choosing a name together: the one that
    finds the other's reservation moves on (a review: without persistence both wrote one file)."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    base = spec.dump_stem("x", os.getpid())
    (dump_dir / f".{base}{spec.CLAIM_SUFFIX}").touch()  # the other process's, made a moment before
    compiledump.record("a", torch.randn(2, 4))
    assert Path(compiledump.flush()).name == f"{base}_2.npz"
    flush_at_exit()
    assert sorted(p.name for p in dump_dir.iterdir()) == [f".{base}{spec.CLAIM_SUFFIX}", f"{base}_2.json",
                                                          f"{base}_2.npz"]  # this process's reservation went


@pytest.mark.parametrize("later", [{"dir": None}, {"max_rows": 4}])
def test_settings_changed_while_capture_is_off_keep_the_dump_complete(dump_dir, capsys, later):
    compiledump.record("a", torch.randn(2, 4))
    live = STATE.runtime.live.path
    compiledump.configure(dir=None)
    compiledump.configure(**later)
    flush_at_exit()
    assert not live.exists() and "never flushed" not in capsys.readouterr().err
    assert [p.name for p in dump_dir.glob("*.npz")] == [live.name.replace(spec.LIVE_SUFFIX, ".npz")]


def test_crash_files_of_another_host_with_this_pid_and_start_are_not_taken(dump_dir, monkeypatch):
    """A shared filesystem: another host's process with this pid and start tick. Its directory is
    never removed, even where this process's name reservation says the name is this one's."""
    from compiledump.capture.journal import process_start_time

    base = spec.dump_stem("x", os.getpid())
    live = dump_dir / f"{base}{spec.LIVE_SUFFIX}"
    live.mkdir(parents=True)
    (live / spec.LIVE_JOURNAL).write_text(json.dumps({"event": "start", "pid": os.getpid(), "host": "elsewhere",
                                                      "start_time": process_start_time(os.getpid())}) + "\n")
    monkeypatch.setitem(flush_module._CLAIMED, (os.path.abspath(dump_dir), "x", os.getpid()), base)
    with pytest.warns(RuntimeWarning, match="crash-proof capture is off.*another process's crash-proof files"):
        compiledump.record("a", torch.randn(2, 3))
    assert STATE.runtime.live is None and (live / spec.LIVE_JOURNAL).read_text().count("elsewhere") == 1


def test_a_dump_complete_after_two_identical_flushes_around_a_clear_is_left_as_it_is(dump_dir):
    """flush, clear(), the same request again, flush, killed: the two flush events are equal, and
    the clear between them made recover rewrite a complete dump as a SIGKILL's (a review)."""
    x = torch.randn(2, 6)
    compiledump.record_step("s", x)
    compiledump.flush()
    compiledump.clear()
    compiledump.record_step("s", x * 2)
    flushed = Path(compiledump.flush())
    live = STATE.runtime.live.path
    STATE.runtime = None  # killed
    result = recover_live(live, force=True)
    assert result.npz == flushed and result.notes and "left as it is" in result.notes[0]
    assert "recovered" not in json.loads(flushed.with_suffix(".json").read_text())


def test_a_dump_directory_reached_through_a_symlink_is_the_same_directory(tmp_path, dump_dir):
    link = tmp_path / "link"
    dump_dir.mkdir(parents=True, exist_ok=True)
    link.symlink_to(dump_dir)
    compiledump.configure(dir=str(link))
    compiledump.record_step("s", torch.randn(2, 6))
    flushed = Path(compiledump.flush())
    live = dump_dir / STATE.runtime.live.path.name
    STATE.runtime = None  # killed
    result = recover_live(live, force=True)
    assert result.npz.name == flushed.name and "left as it is" in result.notes[0]


def test_recover_removes_the_dead_processs_name_reservation(dump_dir):
    compiledump.record_step("s", torch.randn(2, 6))
    live = STATE.runtime.live.path
    claim = dump_dir / f".{live.name.removesuffix(spec.LIVE_SUFFIX)}{spec.CLAIM_SUFFIX}"
    assert claim.exists()
    STATE.runtime = None  # killed
    recover_live(live, force=True)
    assert not claim.exists() and not live.exists()


def test_captures_cleared_while_capture_is_off_leave_nothing_behind(dump_dir, capsys):
    compiledump.record("a", torch.randn(2, 4))
    live = STATE.runtime.live.path
    compiledump.configure(dir=None)  # flushes
    compiledump.clear()
    flush_at_exit()
    assert not live.exists() and "never flushed" not in capsys.readouterr().err
    assert "a" in np.load(next(dump_dir.glob("*.npz"))).files
