"""Public API behaviour: bad input (acceptance 7), files and manifest, lifecycle, devices."""

import json
import os
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump.capture.state import STATE
from compiledump.format import writer
from helpers import forked


# --- bad input: a clear error at the call, never a corrupt file --------------------------------


@pytest.mark.parametrize(
    "call,args,error,match",
    [
        (compiledump.record, ("t", [1.0, 2.0]), TypeError, "expected a torch.Tensor"),
        (compiledump.record_step, ("t", np.zeros(3)), TypeError, "expected a torch.Tensor"),
        (compiledump.record_ids, ("t", 3), TypeError, "expected a torch.Tensor"),
        (compiledump.record, ("t", torch.randn(2, 3, dtype=torch.complex64)), TypeError, "complex"),
        (compiledump.record_step, ("t", torch.randn(2, 3, dtype=torch.complex64)), TypeError, "complex"),
        (compiledump.record_ids, ("t", torch.randn(4, 2)), TypeError, "integer tensor"),
        (compiledump.record, ("t", torch.randn(0, 4)), ValueError, "empty tensor"),
        (compiledump.record_ids, ("t", torch.zeros(3, 0, dtype=torch.long)), ValueError, "empty tensor"),
        (compiledump.record, ("a/b", torch.randn(2, 3)), ValueError, "invalid tag"),
        (compiledump.record, ("", torch.randn(2, 3)), ValueError, "invalid tag"),
        (compiledump.record, ("two words", torch.randn(2, 3)), ValueError, "invalid tag"),
        (compiledump.record, (7, torch.randn(2, 3)), ValueError, "invalid tag"),
        (compiledump.record_step, ("x" * 201, torch.randn(2, 3)), ValueError, "invalid tag"),
    ],
)
def test_bad_input_is_a_clear_error(dump_dir, call, args, error, match):
    compiledump.record("good", torch.randn(2, 3))
    with pytest.raises(error, match=match):
        call(*args)
    path = compiledump.flush()
    with np.load(path) as data:
        assert data.files == ["good"]


def test_tag_conflicts(dump_dir):
    compiledump.record_step("logits", torch.randn(2, 5))
    compiledump.record("logits", torch.randn(2, 5), once=True)  # the seed's own pairing: allowed
    with pytest.raises(ValueError, match="collides with the step keys"):
        compiledump.record("logits_3", torch.randn(2, 5))
    compiledump.record("h_0", torch.randn(2, 5))
    with pytest.raises(ValueError, match="collides with the step keys"):
        compiledump.record_step("h", torch.randn(2, 5))
    with pytest.raises(ValueError, match="first captured with record"):
        compiledump.record_ids("h_0", torch.randint(0, 3, (2, 2)))
    with np.load(compiledump.flush()) as data:
        assert sorted(data.files) == ["h_0", "logits", "logits_0"]


def test_bad_tag_under_compile(dump_dir):
    fn = torch.compile(lambda x: compiledump.record("bad tag", x), fullgraph=True)
    with pytest.raises(Exception, match="invalid tag"):
        fn(torch.randn(2, 3))


def test_bad_settings():
    with pytest.raises(ValueError, match="COMPILEDUMP_TOKENS must be an integer"):
        compiledump.config.from_env({"COMPILEDUMP_TOKENS": "seven"})
    with pytest.raises(ValueError, match="max_steps must be positive"):
        compiledump.config.from_env({"COMPILEDUMP_MAX_STEPS": "0"})
    with pytest.raises(TypeError, match="unknown setting"):
        compiledump.configure(token=3)


# --- files and manifest ----------------------------------------------------------------------


def test_file_names_and_manifest(dump_dir, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    x = torch.randn(5, 4, 6, dtype=torch.bfloat16)
    compiledump.record("layer0", x)
    compiledump.record_step("logits", torch.randn(2, 9))
    compiledump.record_ids("layer0_topk", torch.randint(0, 8, (5, 2)))
    path = Path(compiledump.flush())
    assert path == dump_dir / f"compiledump_rank3_pid{os.getpid()}.npz"
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["format"] == "compiledump-dump" and manifest["format_version"] == 1
    assert manifest["rank"] == "3" and manifest["pid"] == os.getpid()
    assert manifest["torch_version"] == torch.__version__
    assert manifest["compiledump_version"] == compiledump.__version__
    assert manifest["config"]["dir"] == str(dump_dir)
    assert manifest["keys"]["layer0"] == {
        "tag": "layer0", "kind": "record", "step": None, "order": 0, "source_dtype": "bfloat16",
        "source_shape": [5, 4, 6], "dtype": "float32", "shape": [6], "tokens": 5, "phase": "prefill",
    }
    assert manifest["prompt_tokens"] == 5  # COMPILEDUMP_TOKENS=auto: the first capture's token count
    assert manifest["keys"]["logits_0"]["kind"] == "step" and manifest["keys"]["logits_0"]["step"] == 0
    assert manifest["keys"]["logits_0"]["tokens"] is None and manifest["keys"]["logits_0"]["phase"] is None
    assert manifest["keys"]["layer0_topk"]["dtype"] == "int32"
    assert (manifest["keys"]["layer0_topk"]["tokens"], manifest["keys"]["layer0_topk"]["phase"]) == (5, "prefill")
    assert [manifest["keys"][k]["order"] for k in ("layer0", "logits_0", "layer0_topk")] == [0, 1, 2]
    # Readable with numpy alone, no pickles.
    with np.load(path, allow_pickle=False) as data:
        assert data["layer0"].dtype == np.float32 and data["layer0_topk"].dtype == np.int32


def test_rank_x_without_distributed(dump_dir, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    compiledump.record("t", torch.randn(2, 2))
    assert Path(compiledump.flush()).name == f"compiledump_rank{'x'}_pid{os.getpid()}.npz"


def test_flush_without_captures_returns_none(dump_dir):
    assert compiledump.flush() is None
    compiledump.configure(dir=None)
    compiledump.record("t", torch.randn(2, 2))
    assert compiledump.flush() is None
    assert STATE.runtime is None


def test_flush_is_cumulative(dump_dir):
    compiledump.record_step("s", torch.randn(1, 3))
    first = compiledump.flush()
    compiledump.record_step("s", torch.randn(1, 3))
    second = compiledump.flush()
    assert first == second
    with np.load(second) as data:
        assert sorted(data.files) == ["s_0", "s_1"]


def test_crash_while_writing_leaves_no_truncated_file(dump_dir, monkeypatch):
    compiledump.record("a", torch.randn(2, 3))
    good = compiledump.flush()
    before = Path(good).read_bytes()
    compiledump.record("b", torch.randn(2, 3))

    def crash(*_args, **_kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(np.lib.format, "write_array", crash)
    with pytest.raises(OSError, match="disk on fire"):
        compiledump.flush()
    assert Path(good).read_bytes() == before  # the previous complete file is untouched
    # (and the process's crash-proof files, `<stem>.live/`, which its exit removes)
    names = sorted(p.name for p in dump_dir.iterdir() if not p.name.endswith((".live", ".claim")))
    assert names == sorted([Path(good).name, Path(good).with_suffix(".json").name])


def test_writer_accepts_keys_numpy_savez_reserves(tmp_path):
    arrays = {"file": np.arange(3, dtype=np.float32), "allow_pickle": np.ones(2, dtype=np.int32)}
    path = writer.write_dump(tmp_path, "x", arrays, {"keys": {}})
    with np.load(path) as data:
        np.testing.assert_array_equal(data["file"], arrays["file"])
        np.testing.assert_array_equal(data["allow_pickle"], arrays["allow_pickle"])


def test_flush_at_exit(tmp_path):
    script = textwrap.dedent(
        """
        import torch, compiledump
        compiledump.record("layer0", torch.arange(12.0).reshape(3, 4))
        """
    )
    env = dict(os.environ, COMPILEDUMP_DIR=str(tmp_path), RANK="0")
    # A process of its own (the exit flush is what is checked), forked from one that imported torch.
    forked.run(["-c", script], env=env, check=True, timeout=120)
    (path,) = tmp_path.glob("compiledump_rank0_pid*.npz")
    with np.load(path) as data:
        np.testing.assert_array_equal(data["layer0"], np.arange(8.0, 12.0, dtype=np.float32))


@pytest.mark.parametrize("after", ["nothing", "capture", "clear_capture", "configure_dir", "nothing_sigterm",
                                   "capture_sigterm"])
def test_exit_flush_rewrites_only_what_changed(tmp_path, after):
    """The exit flush (and a SIGTERM's) writes when something was captured since the last flush
    (or the settings changed); a dump already complete is not written again, so one moved away
    stays away. Nor is it written into a directory capture was switched to with nothing captured
    since (before, that directory got a copy of what was captured for the first)."""
    script = textwrap.dedent(
        f"""
        import os, pathlib, signal, sys, torch, compiledump
        out, moved, other = map(pathlib.Path, sys.argv[1:4])
        compiledump.configure(dir=str(out))
        torch.manual_seed(0)
        compiledump.record("layer0", torch.randn(3, 5))
        npz = pathlib.Path(compiledump.flush())
        for path in (npz, npz.with_suffix(".json")):
            path.replace(moved / path.name)
        after = {after!r}
        if after == "clear_capture":
            compiledump.clear()  # the same capture again: the same counters, new values
        if after == "configure_dir":
            compiledump.configure(dir=str(other))
        else:
            torch.manual_seed(1)
        if after.startswith(("capture", "clear_capture")):
            compiledump.record("layer0", torch.randn(3, 5))
        if after.endswith("sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)
        """
    )
    out, moved, other = (tmp_path / name for name in ("out", "moved", "other"))
    for d in (out, moved, other):
        d.mkdir()
    env = dict(os.environ, RANK="0")
    env.pop("COMPILEDUMP_DIR", None)
    # A process per case (what its exit or SIGTERM writes is checked), forked from one that imported torch.
    done = forked.run(["-c", script, str(out), str(moved), str(other)], env=env, timeout=120)
    assert done.returncode == (-signal.SIGTERM if after.endswith("sigterm") else 0)
    torch.manual_seed(0)
    first = torch.randn(3, 5)[-1].numpy()
    torch.manual_seed(1)
    second = torch.randn(3, 5)[-1].numpy()
    (kept,) = moved.glob("*.npz")
    with np.load(kept) as data:
        np.testing.assert_array_equal(data["layer0"], first)
    written = {"nothing": None, "capture": out, "clear_capture": out, "configure_dir": None, "nothing_sigterm": None,
               "capture_sigterm": out}[after]
    for d in (out, other):
        files = sorted(p.name for p in d.iterdir())
        if d != written:
            assert files == [], (d, files)
    if written is not None:
        (path,) = written.glob("*.npz")
        with np.load(path) as data:
            np.testing.assert_array_equal(data["layer0"], first if after == "configure_dir" else second)
    assert not list(out.glob("*.live"))  # the crash-proof files go either way


# --- lifecycle, profiling, rows ---------------------------------------------------------------


def test_profiling_nests(dump_dir):
    assert compiledump.enabled()
    with compiledump.profiling():
        with compiledump.profiling():
            compiledump.record("a", torch.randn(2, 3))
        assert not compiledump.enabled()
        compiledump.record("a", torch.randn(2, 3))
    assert compiledump.enabled()
    x = torch.randn(2, 3)
    compiledump.record("a", x)
    with np.load(compiledump.flush()) as data:
        np.testing.assert_array_equal(data["a"], x[-1].numpy())


def test_profiling_before_the_arena_exists(dump_dir):
    with compiledump.profiling():
        compiledump.record("a", torch.randn(2, 3))  # creates the arena while suspended
    with np.load(compiledump.flush()) as data:
        assert data.files == []


def test_gather_rows(dump_dir):
    compiledump.set_gather_rows(record=2, step=1)
    h = torch.randn(5, 4, 7)
    s = torch.randn(3, 4, 7)
    compiledump.record("h", h)
    compiledump.record_step("s", s)
    compiledump.set_gather_rows(record=-2, step=0)
    compiledump.record_step("s", s)
    compiledump.record("h2", h[:, 0])
    with np.load(compiledump.flush()) as data:
        np.testing.assert_allclose(data["h"], h.mean(1)[2].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(data["s_0"], s[1].numpy())
        np.testing.assert_array_equal(data["s_1"], s[0].numpy())
        np.testing.assert_array_equal(data["h2"], h[-2, 0].numpy())


@pytest.mark.parametrize("value", [None, 1.5, "3", True, torch.tensor(2)], ids=repr)
def test_row_setters_refuse_what_is_not_an_int_at_the_call(dump_dir, value):
    """set_rows(None) used to fail at the next record_step, far from the cause; 1.5 was truncated
    (1.5 rows > max_rows 1 kept the step) and set_gather_rows(step=2.7) read row 2. (None is
    set_gather_rows' "leave it as it is".)"""
    calls = [lambda: compiledump.set_rows(value)]
    if value is not None:
        calls += [lambda: compiledump.set_gather_rows(record=value), lambda: compiledump.set_gather_rows(step=value)]
    for call in calls:
        with pytest.raises(TypeError, match=r"compiledump\.set_(gather_)?rows: expected an int"):
            call()


def test_row_setters_take_numpy_ints_and_a_graphs_shape(dump_dir):
    compiledump.set_gather_rows(step=np.int64(1))
    compiledump.record_step("s", s := torch.randn(3, 5))
    compiledump.set_gather_rows(step=0)

    @torch.compile(fullgraph=True, dynamic=True)
    def step(x):
        compiledump.set_rows(x.shape[0])  # a SymInt while tracing
        compiledump.record_step("t", x)

    step(torch.randn(1, 5))
    step(torch.randn(2, 5))  # 2 rows > max_rows 1: skipped
    with np.load(compiledump.flush()) as data:
        np.testing.assert_array_equal(data["s_0"], s[1].numpy())
        assert [key for key in data.files if key.startswith("t_")] == ["t_0"]


def test_once_keeps_first_write_even_compiled(dump_dir):
    fn = torch.compile(lambda x: compiledump.record("logits", x, once=True), fullgraph=True)
    first = torch.randn(3, 5)
    fn(first)
    fn(torch.randn(3, 5))
    fn(torch.randn(3, 5))
    with np.load(compiledump.flush()) as data:
        np.testing.assert_array_equal(data["logits"], first[-1].numpy())


def test_wrong_device_is_a_clear_error(dump_dir):
    compiledump.init("cpu")
    with pytest.raises(RuntimeError, match="arena lives on cpu"):
        compiledump.record("t", torch.randn(2, 3, device="meta"))
    with pytest.raises(RuntimeError, match="already lives on cpu"):
        compiledump.init("meta")


def test_capacity_is_fixed_once_allocated(dump_dir):
    compiledump.record("t", torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="cannot change after the arena was created"):
        compiledump.configure(max_steps=3)
    compiledump.configure(tokens=4, max_rows=2)  # filters may change
    assert STATE.runtime.ctrl[2] == 2


def test_inference_mode_first_capture(dump_dir):
    with torch.inference_mode():
        compiledump.record("t", torch.randn(2, 3))
    with compiledump.profiling():  # host writes outside inference mode still work
        pass
    assert compiledump.flush() is not None

