"""Runtime.snapshot: the control block is copied before the arena, the CUDA branch works on the
arena's device (not the caller's current one) into pinned buffers it returns views of, and a
flush nested in another (a signal handler's) does not overwrite the buffers of the outer one.

No GPU here: the CUDA branch runs on a CPU runtime whose device is relabelled cuda:1, with the
torch.cuda calls it makes replaced by fakes that record which device and stream each one used.
"""

import contextlib
import threading

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import compiledump
from compiledump import config as cd_config
from compiledump.capture import flush as flush_mod
from compiledump.capture.arena import Runtime
from compiledump.ops import layout as L
from compiledump.ops import register


class _CopyLog(TorchFunctionMode):
    """Records which storage each clone/copy_ read from, in call order."""

    def __init__(self):
        super().__init__()
        self.sources = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.clone:
            self.sources.append(args[0].untyped_storage().data_ptr())
        elif func is torch.Tensor.copy_:
            self.sources.append(args[1].untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _runtime():
    cfg = cd_config.Config(dir="unused", arena_mb=1, max_tags=4, persist="0")  # no files
    rt = Runtime(torch.device("cpu"), cfg, 0, threading.Lock())
    rt.used_words = 8
    rt.arena[:8] = torch.arange(8.0)
    rt.ctrl[L.slot_base(1) + L.CNT_WRITTEN] = 3
    return rt


def _names(rt, sources):
    ptrs = {rt.ctrl.untyped_storage().data_ptr(): "ctrl", rt.arena.untyped_storage().data_ptr(): "arena"}
    return [ptrs.get(p, "?") for p in sources]


def test_cpu_snapshot_copies_the_control_block_first():
    rt = _runtime()
    rt.native_table = False  # the Python copy (the native one copies under the kernel's lock)
    with _CopyLog() as log:
        arena, ctrl = rt.snapshot()
    assert _names(rt, log.sources) == ["ctrl", "arena"]
    np.testing.assert_array_equal(arena, np.arange(8.0, dtype=np.float32))
    assert ctrl[L.slot_base(1) + L.CNT_WRITTEN] == 3
    # On CPU the clones are the snapshot: later captures do not change it.
    rt.arena[0] = 99.0
    rt.ctrl[L.slot_base(1) + L.CNT_WRITTEN] = 4
    assert arena[0] == 0.0 and ctrl[L.slot_base(1) + L.CNT_WRITTEN] == 3


@pytest.mark.skipif(not register.native_owns_capture(), reason="the native library does not serve capture_v1")
def test_native_cpu_snapshot_is_a_private_copy():
    rt = _runtime()
    assert rt.native_table
    arena, ctrl = rt.snapshot()
    np.testing.assert_array_equal(arena, np.arange(8.0, dtype=np.float32))
    np.testing.assert_array_equal(ctrl, rt.ctrl.numpy())
    rt.arena[0] = 99.0
    rt.ctrl[L.slot_base(1) + L.CNT_WRITTEN] = 4
    assert arena[0] == 0.0 and ctrl[L.slot_base(1) + L.CNT_WRITTEN] == 3


class _FakeCuda:
    """The torch.cuda calls of the snapshot, recording the current device at each call."""

    def __init__(self, monkeypatch):
        self.current = 0  # the calling thread's current device: not the arena's
        self.calls = []
        self.sources = []  # storage each copy_ read from, in order
        self.active_stream = None
        fake = self

        @contextlib.contextmanager
        def device(dev):
            previous, fake.current = fake.current, torch.device(dev).index
            try:
                yield
            finally:
                fake.current = previous

        class Stream:
            def __init__(self, index):
                self.device_index = index

        @contextlib.contextmanager
        def stream(s):
            previous, fake.active_stream = fake.active_stream, s
            try:
                yield
            finally:
                fake.active_stream = previous

        def current_stream(dev=None):
            index = fake.current if dev is None else torch.device(dev).index
            fake.calls.append(("current_stream", index, fake.current))
            return Stream(index)

        class Event:
            def record(self, s=None):
                s = s if s is not None else Stream(fake.current)
                fake.calls.append(("event.record", s.device_index, fake.current))

            def synchronize(self):
                fake.calls.append(("event.synchronize", None, fake.current))

        def synchronize(dev=None):
            index = fake.current if dev is None else torch.device(dev).index
            fake.calls.append(("synchronize", index, fake.current))

        def capturing():
            fake.calls.append(("is_current_stream_capturing", fake.current, fake.current))
            return False

        real_empty = torch.empty

        def empty(*args, pin_memory=False, **kwargs):
            fake.calls.append(("empty", "pinned" if pin_memory else "pageable", fake.current))
            return real_empty(*args, **kwargs)  # a CPU-only build cannot pin

        real_copy = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            on = fake.active_stream.device_index if fake.active_stream is not None else None
            fake.calls.append(("copy_", on, fake.current))
            fake.sources.append(src.untyped_storage().data_ptr())
            return real_copy(dst, src, non_blocking=non_blocking)

        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


@pytest.mark.parametrize("private", [False, True])
def test_cuda_snapshot_runs_on_the_arena_device_and_returns_views(monkeypatch, private):
    rt = _runtime()
    rt.device = torch.device("cuda", 1)
    fake = _FakeCuda(monkeypatch)
    arena, ctrl = rt.snapshot(private=private)
    again = rt.snapshot(private=private)
    monkeypatch.undo()

    # Every CUDA call ran with cuda:1 current, and the event guarding the copies was recorded on
    # cuda:1's stream, the one the copies were issued on.
    assert fake.calls and all(current == 1 for *_, current in fake.calls), fake.calls
    kinds = [name for name, *_ in fake.calls]
    assert ("event.record", 1, 1) in fake.calls and ("synchronize", 1, 1) in fake.calls
    first = kinds.index("synchronize")
    assert kinds[first + 1 : first + 6] == ["current_stream", "copy_", "copy_", "event.record", "event.synchronize"]
    assert all(on == 1 for name, on, _ in fake.calls if name == "copy_")
    # Control block first, then the arena.
    assert _names(rt, fake.sources) == ["ctrl", "arena"] * 2
    np.testing.assert_array_equal(arena, np.arange(8.0, dtype=np.float32))
    assert ctrl[L.slot_base(1) + L.CNT_WRITTEN] == 3
    assert arena.shape == (8,) and ctrl.shape == (rt.ctrl.numel(),)
    if private:
        # Fresh buffers each time, sized to what is copied, never the shared ones.
        assert rt.host_buffers is None
        assert not np.shares_memory(arena, again[0]) and not np.shares_memory(ctrl, again[1])
    else:
        # No host copy beyond the pinned buffers: the arrays are views of them, allocated once.
        host_arena, host_ctrl = rt.host_buffers
        assert np.shares_memory(arena, host_arena.numpy()) and np.shares_memory(ctrl, host_ctrl.numpy())
        assert np.shares_memory(arena, again[0])
        assert kinds.count("empty") == 2
    assert all(kind == "pinned" for name, kind, _ in fake.calls if name == "empty")


def test_a_flush_nested_in_a_flush_does_not_reuse_its_buffers(dump_dir, monkeypatch):
    """A signal handler flushing on the main thread while it was flushing (the flush lock is
    reentrant) must not overwrite the host buffers the interrupted flush is still writing."""
    compiledump.record("a", torch.arange(6.0).reshape(2, 3))
    rt = flush_mod.STATE.runtime
    seen = []
    real_snapshot, real_write = Runtime.snapshot, flush_mod.writer.write_dump

    def snapshot(self, private=False):
        seen.append(private)
        return real_snapshot(self, private=private)

    def write_dump(*args, **kwargs):
        if len(seen) == 1:
            flush_mod._flush(wait_for_captures=False)  # the handler, mid-write of the outer flush
        return real_write(*args, **kwargs)

    monkeypatch.setattr(Runtime, "snapshot", snapshot)
    monkeypatch.setattr(flush_mod.writer, "write_dump", write_dump)
    assert compiledump.flush() is not None
    assert seen == [False, True]
    assert flush_mod._flush_depth == 0
    assert rt is flush_mod.STATE.runtime
    assert compiledump.flush() is not None and seen[-1] is False
