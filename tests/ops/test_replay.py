"""Acceptance 3: the property CUDA graph replay needs, checked without a GPU.

A CUDA graph records the kernel launches of one call and re-issues them later without running
any Python. Here the Triton kernel (interpreted on CPU) is recorded from one call without being
executed (as during stream capture), then re-issued N times while the inputs, the suspension,
the rows gate and the gather rows change in between, exactly as a replayed graph would see them.
The arena and the control block must equal those of N ordinary eager calls.
"""

import functools

import numpy as np
import pytest
import torch

import compiledump
from compiledump.capture.state import STATE
from compiledump.ops import register
from compiledump.ops import layout as L
from compiledump.ops.triton_kernel import launch

N = 12


class LaunchRecorder:
    """Stands in for the kernel launcher: records every launch, optionally runs it."""

    def __init__(self, launch, execute):
        self.launch = launch
        self.execute = execute
        self.launches = []

    def __call__(self, *args):
        self.launches.append(args)
        if self.execute:
            self.launch(*args)

    def replay(self):
        for args in self.launches:
            self.launch(*args)


def _buffers():
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(6, 4, 37, generator=g).to(torch.bfloat16),
        "out": torch.randn(33, 5, generator=g).t(),  # non-contiguous [5, 33]
        "logits": torch.randn(4, 50, generator=g).to(torch.float16),
        "ids": torch.randint(0, 64, (6, 2), generator=g),
        # Wide enough that the Triton kernel splits its step into a claim and a copy launch.
        "wide_logits": torch.randn(4, 5 * 2048 + 3, generator=g).to(torch.bfloat16),
    }


def _forward(b):
    compiledump.record("layer0", b["hidden"])
    compiledump.record("layer0_out", b["out"])
    compiledump.record("logits", b["logits"], once=True)
    compiledump.record_step("logits", b["logits"])
    compiledump.record_ids("layer0_topk", b["ids"])
    compiledump.record_step("wide_logits", b["wide_logits"])


def _change(b, i):
    """What differs between replays: input values (in place), suspension, rows, gather rows."""
    g = torch.Generator().manual_seed(100 + i)
    for key, buf in b.items():
        if buf.is_floating_point():
            buf.copy_(torch.randn(buf.shape, generator=g))
        else:
            buf.copy_(torch.randint(0, 64, buf.shape, generator=g))
    compiledump.set_rows([1, 1, 3, 1][i % 4])  # every 4th call is a wide warm-up batch
    compiledump.set_gather_rows(record=[-1, 2, -3, 9][i % 4], step=[0, 1, 3][i % 3])
    return compiledump.profiling() if i % 5 == 2 else _NoSuspend()


class _NoSuspend:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _snapshot():
    rt = STATE.runtime
    return rt.arena[: rt.used_words].clone(), rt.ctrl.clone()


@functools.cache  # the eager calls' result, the same for both parametrizations: run once
def _eager_reference():
    compiledump.reset()
    b = _buffers()
    for i in range(N):
        with _change(b, i):
            _forward(b)
    return _snapshot()


@pytest.mark.parametrize("recorded_from", ["eager", "compiled"])
def test_replayed_launches_equal_eager_calls(dump_dir, monkeypatch, recorded_from):
    monkeypatch.setenv("COMPILEDUMP_CPU_KERNEL", "triton")
    want_arena, want_ctrl = _eager_reference()

    compiledump.reset()
    torch._dynamo.reset()
    b = _buffers()
    recorder = LaunchRecorder(launch, execute=False)
    monkeypatch.setattr(register, "_triton_launch", recorder)
    forward = torch.compile(_forward, fullgraph=True) if recorded_from == "compiled" else _forward
    forward(b)  # "capture": records the launches, runs nothing
    assert len(recorder.launches) == 6
    assert int(STATE.runtime.ctrl[L.HEADER_WORDS :].abs().sum()) == 0  # nothing ran yet
    for i in range(N):
        with _change(b, i):
            recorder.replay()
    got_arena, got_ctrl = _snapshot()
    assert torch.equal(got_ctrl, want_ctrl)
    assert torch.equal(got_arena.view(torch.int32), want_arena.view(torch.int32))
    # The run exercised every path: suspension, rows gate, out-of-range row, keep-first.
    counters = got_ctrl[L.HEADER_WORDS :].view(-1, L.SLOT_WORDS).sum(0)
    for counter in (L.CNT_WRITTEN, L.CNT_SUSPENDED, L.CNT_ROWS_GATE, L.CNT_ROW_OUT_OF_RANGE):
        assert counters[counter] > 0, counter
    flushed = np.load(compiledump.flush())
    assert "logits" in flushed.files and "logits_0" in flushed.files and "wide_logits_0" in flushed.files
