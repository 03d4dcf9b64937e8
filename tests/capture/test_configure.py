"""configure() once the arena exists: switching the dump directory (what is written where, and
when, and what `compiledump recover` writes after a crash), a setting that applies from then on
(layer_steps)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump.capture.recover import recover_directory
from compiledump.format import writer
from helpers import forked


def test_switching_the_directory_writes_what_was_captured_for_the_first(dump_dir):
    """configure(dir=B) while capturing into A: A got nothing and B's dump held A's captures."""
    first, second = torch.randn(3, 7), torch.randn(2, 7)
    compiledump.record("a", first)
    other = dump_dir.parent / "other"
    compiledump.configure(dir=str(other))
    (written,) = dump_dir.glob("*.npz")
    with np.load(written) as data:
        assert data.files == ["a"]
        np.testing.assert_array_equal(data["a"], first[-1].numpy())
    compiledump.clear()  # the documented way to start the new directory's dump empty
    compiledump.record("b", second)
    compiledump.flush()
    (later,) = other.glob("*.npz")
    with np.load(later) as data:
        assert data.files == ["b"]
        np.testing.assert_array_equal(data["b"], second[-1].numpy())


def test_layer_steps_set_after_the_arena_applies_to_step_tags_not_captured_yet(dump_dir):
    """configure(layer_steps=N) once the arena existed was ignored (16 steps kept) while the
    manifest's config said N."""
    compiledump.record("first", torch.randn(2, 4))  # the arena exists
    compiledump.configure(layer_steps=4)
    for _ in range(9):
        compiledump.record_step("layer0_step", torch.randn(1, 6))
    with pytest.warns(RuntimeWarning, match="layer_steps"):
        manifest = json.loads(Path(compiledump.flush()).with_suffix(".json").read_text())
    assert manifest["config"]["layer_steps"] == 4
    assert manifest["tags"]["layer0_step_<n>"]["kept"] == 4
    assert manifest["tags"]["layer0_step_<n>"]["drops"] == {"layer_steps": 5}


def test_switching_back_writes_no_dump_into_a_directory_that_captured_nothing(dump_dir):
    """A -> B -> A with nothing captured while B was in force wrote A's captures into B."""
    compiledump.record("a", torch.randn(3, 7))
    other = dump_dir.parent / "other"
    compiledump.configure(dir=str(other))
    compiledump.configure(dir=str(dump_dir))
    assert not other.exists() or not list(other.glob("*.npz"))
    assert len(list(dump_dir.glob("*.npz"))) == 1


def test_switching_away_from_a_directory_that_cannot_be_written_warns_and_switches(dump_dir, monkeypatch):
    """configure(dir=B) raised when A's dump could not be written, leaving capture on A: a full or
    vanished A is why one switches. The captures go into B's dump instead."""
    x = torch.randn(3, 7)
    compiledump.record("a", x)
    real_write = writer.write_dump

    def full(directory, *args, **kwargs):
        if Path(directory) == dump_dir:
            raise OSError(28, "No space left on device")
        return real_write(directory, *args, **kwargs)

    monkeypatch.setattr(writer, "write_dump", full)
    other = dump_dir.parent / "other"
    with pytest.warns(RuntimeWarning, match="could not write the dump of .* first .*No space left"):
        compiledump.configure(dir=str(other))
    assert compiledump.get_config().dir == str(other)
    with np.load(compiledump.flush()) as data:
        np.testing.assert_array_equal(data["a"], x[-1].numpy())


def test_a_directory_named_through_a_symlink_is_one_dump(dump_dir):
    """Names were reserved per spelling of the directory (abspath): the same directory reached
    through a symbolic link got a second dump, `_2`."""
    compiledump.record("a", torch.randn(2, 4))
    compiledump.flush()
    link = dump_dir.parent / "link"
    link.symlink_to(dump_dir, target_is_directory=True)
    compiledump.configure(dir=str(link))
    compiledump.record("b", torch.randn(2, 4))
    compiledump.flush()
    assert len(list(dump_dir.glob("*.npz"))) == 1


_SWITCH_THEN_DIE = """
import os, sys, torch, compiledump
compiledump.configure(dir=sys.argv[1])
compiledump.record("a", torch.full((2, 5), 1.0))
compiledump.configure(dir=sys.argv[2])  # A's dump is written first
if sys.argv[3] not in ("keep", "back"):
    compiledump.clear()  # B's dump starts empty
compiledump.record("b", torch.full((2, 5), 2.0))
if sys.argv[3] == "off":
    compiledump.configure(dir=None)  # B's dump is written: complete
if sys.argv[3] == "back":
    compiledump.configure(dir=sys.argv[1])  # back to A (B's dump written), capturing for A again
    compiledump.record("c", torch.full((2, 5), 3.0))
os._exit(0)
"""


@pytest.mark.parametrize("clear", ["clear", "keep", "off", "back"])
def test_recover_after_a_switch_of_directory_keeps_the_first_directorys_dump(tmp_path, clear):
    """configure(dir=B) writes A's dump, and the crash-proof files stay in A; after a crash,
    recover A wrote what was captured for B over A's dump (key a lost). It writes beside it, or
    nothing where B's dump holds it all (capture switched off after B's flush)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILEDUMP_")}
    first, second = tmp_path / "A", tmp_path / "B"
    # Its own process (it dies without its exit flush), forked from one that imported torch.
    proc = forked.run(["-c", _SWITCH_THEN_DIE, str(first), str(second), clear], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (flushed,) = first.glob("*.npz")
    (result,), errors = recover_directory(first)
    if clear == "off":
        assert errors == [] and result.npz == second / flushed.name and list(first.glob("*.npz")) == [flushed]
        return
    if clear == "back":  # as the exit flush would have: A's dump, with everything since (no clear())
        assert errors == [] and result.npz == flushed and list(first.glob("*.npz")) == [flushed]
        with np.load(flushed) as data:
            assert sorted(data.files) == ["a", "b", "c"]
        return
    assert errors == [] and result.npz != flushed and result.npz.name == flushed.name.replace(".npz", "_2.npz")
    assert any(str(second) in note for note in result.notes)
    with np.load(flushed) as data:
        assert data.files == ["a"]
    with np.load(result.npz) as data:
        assert sorted(data.files) == (["b"] if clear == "clear" else ["a", "b"])
