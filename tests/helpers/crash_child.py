"""A process that runs the built-in model's decode loop with crash-proof capture and reports each
finished decode step through a pipe; tests/capture/test_crash.py kills, stops or crashes it.

    python crash_child.py MODE DUMP_DIR REPORT_FD [STEPS] [COMPILED] [NONFINITE_STEP]

MODE: `run` (to the end, normal exit), `reference` (also saves every record's value after the
prefill and after each decode step, to `<DUMP_DIR>/per_step.npz`: an array per record key, row 0
after the prefill, row 1 + s after decode step s), `exit` (os._exit after step 2), `segfault`
(reads address 0 after step 2), `raise` (an unhandled exception after step 2), `nan` (NaN in
layer 1's input at decode step NONFINITE_STEP). COMPILED `1`: the decode steps run through
torch.compile; the prefill and the profile forward stay eager (every stop, kill and crash the
tests make comes after decode step 0 is reported, in the decode loop; compiling them as well was
two more graphs, 17 of the 32 C++ kernels of a cold Inductor compile). Every call of the capture
API is the public one; the environment (COMPILEDUMP_*) is set by the test.
"""

import ctypes
import os
import sys

import numpy as np
import torch

import compiledump
from compiledump.demo.model import ModelConfig, TinyMoE, make_session

CONFIG = ModelConfig(layers=3, dim=96, captures_per_layer=5)
CRASH_AFTER = 2


class NanAt(torch.nn.Module):
    """The built-in model with NaN written into layer 1's mixer state at one decode step (the
    decode step count is a tensor, so compiled code does not recompile per step; so is the chosen
    step, so `step=-1`, no NaN, compiles the very graph a NaN run compiles)."""

    def __init__(self, model: TinyMoE, step: int):
        super().__init__()
        self.model = model
        self.register_buffer("step", torch.tensor(step, dtype=torch.long))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, tokens, state=None):
        if state is None:
            return self.model(tokens)
        bad = (self.calls == self.step).to(state.dtype)
        self.calls += 1
        # nan * 0 is nan: a NaN at the chosen step only, in layer 1's row of the state.
        poison = torch.where(bad > 0, torch.tensor(float("nan")), torch.tensor(0.0))
        state = state.clone()
        state[1] = state[1] + poison
        return self.model(tokens, state)


def main() -> None:
    mode, directory, report_fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    compiled = len(sys.argv) > 5 and sys.argv[5] == "1"
    nan_step = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    torch.set_num_threads(1)  # bit-identical runs
    compiledump.configure(dir=directory)
    model = TinyMoE(CONFIG, dump=compiledump)
    if mode == "nan":
        model = NanAt(model, nan_step)
    forward = torch.compile(model, fullgraph=True) if compiled else model
    session = make_session(CONFIG, prompt_len=7, steps=steps, pad_rows=2)
    per_step = {}  # record key -> its values, after the prefill and after each decode step
    with torch.no_grad():
        compiledump.set_rows(1)
        _, state = model(session.prompt)  # eager, as the profile forward: see COMPILED above
        with compiledump.profiling():
            model(session.profile_tokens)
        state = torch.cat([state, session.pad_state.to(state.dtype)], 1)
        if mode == "reference":
            _append_records(per_step)
        os.write(report_fd, b"ready\n")
        for step in range(steps):
            tokens = torch.cat([session.decode_tokens[step : step + 1], session.pad_tokens[step]])
            compiledump.set_rows(1)
            _, state = forward(tokens, state)
            os.write(report_fd, f"{step}\n".encode())
            if mode == "reference":
                _append_records(per_step)
            if step == CRASH_AFTER:
                if mode == "exit":
                    os._exit(3)
                if mode == "segfault":
                    ctypes.string_at(0)
                if mode == "raise":
                    raise RuntimeError("the model blew up")
    if mode == "reference":
        # One array per key, not one per key and step (25 000 members took seconds to write).
        np.savez(os.path.join(directory, "per_step.npz"), **{k: np.stack(v) for k, v in per_step.items()})


def _append_records(per_step: dict) -> None:
    values = _records()
    assert not per_step or values.keys() == per_step.keys(), "every record is kept from the prefill on"
    for key, value in values.items():
        per_step.setdefault(key, []).append(value)


def _records() -> dict:
    """Every record key's value now (a test-only look at the live arena, without flushing)."""
    from compiledump.capture.collect import collect
    from compiledump.capture.state import STATE
    from compiledump.ops import layout as L

    rt = STATE.runtime
    records = [slot for slot in rt.slots.values() if slot.kind != L.KIND_STEP]
    # Read in place, not through rt.snapshot() (a copy of the 3 MB arena per step: half of what
    # the reference run's per-step values cost): between two decode steps nothing writes them
    # (one thread; a CPU capture has finished when its call returns). The values are copied below.
    got = collect(records, [], rt.arena.numpy(), rt.ctrl.numpy(), rt.prompt_tokens)
    return {key: value.copy() for key, value in got.arrays.items()}


if __name__ == "__main__":
    main()
