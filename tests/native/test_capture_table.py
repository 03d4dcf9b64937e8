"""The native `capture_v1` (kernels/capture_table.cpp): calls its region table can decide never
reach Python, and its decisions equal Python's registry on random call sequences.

Runs where the library was loaded at import (CI's first lane): only then does Python's registry
fill the table. The Python side of each comparison is the same process with the table emptied
and left unfilled, so every call goes through `capture_resolve_v1` (the registry, then the same
native kernel): what differs is only who decided.
"""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump.capture.arena import Runtime
from compiledump.capture.state import STATE
from compiledump.ops import layout as L
from compiledump.ops import register, schemas

pytestmark = pytest.mark.skipif(not register.native_owns_capture(),
                                reason="the native library was not loaded at import (pure-Python lane)")


@pytest.fixture
def resolve_calls(monkeypatch):
    """How many calls reached Python's registry (Runtime.resolve)."""
    calls = []
    original = Runtime.resolve

    def counting(self, *args):
        calls.append(args[:2])
        return original(self, *args)

    monkeypatch.setattr(Runtime, "resolve", counting)
    return calls


def _python_decides() -> None:
    """Empty the table and stop filling it: every call of this arena goes through Python."""
    rt = STATE.runtime
    schemas.table_gate(rt.ctrl, -1, False, True)
    rt.native_table = False


def test_eager_calls_after_the_first_skip_python(dump_dir, resolve_calls):
    x = torch.randn(5, 4, 24)
    compiledump.record("h", x)
    assert STATE.runtime.capture_path == "native"
    for _ in range(9):
        compiledump.record("h", x)  # decided in C++
    assert len(resolve_calls) == 1
    compiledump.record("h", torch.randn(3, 4, 24))  # token-gated: decided in C++ too
    compiledump.record("h", torch.randn(5, 4, 8))  # shape changed: in C++
    assert len(resolve_calls) == 1
    manifest = json.loads(Path(compiledump.flush()).with_suffix(".json").read_text())
    assert manifest["capture_path"] == "native"
    assert manifest["tags"]["h"]["calls"] == 12
    assert manifest["tags"]["h"]["drops"] == {"token_gate": 1, "shape_changed": 1}


def test_compiled_calls_after_the_first_step_skip_python(dump_dir, resolve_calls):
    def step(x):
        y = x * 2
        compiledump.record("a", y)
        compiledump.record_step("s", y[:, 0])
        compiledump.record_ids("ids", x.argmax(-1))
        return y

    compiled = torch.compile(step, fullgraph=True)
    xs = [torch.randn(6, 4, 16) for _ in range(5)]
    for x in xs:
        compiled(x)
    assert len(resolve_calls) == 3  # the first step's three captures
    with np.load(compiledump.flush()) as data:
        np.testing.assert_array_equal(data["a"], (xs[-1] * 2)[-1].mean(0).numpy())
        for n, x in enumerate(xs):
            np.testing.assert_array_equal(data[f"s_{n}"], (x * 2)[0, 0].numpy())
        np.testing.assert_array_equal(data["ids"], xs[-1].argmax(-1).numpy())


def test_only_the_bound_arena_is_decided_in_cpp(dump_dir, resolve_calls):
    compiledump.record("a", torch.randn(3, 8))
    compiledump.record("a", torch.randn(3, 8))
    assert len(resolve_calls) == 1
    old_ctrl, old_arena = STATE.runtime.ctrl, STATE.runtime.arena
    # Another control block (opcheck's clones, a reset arena's): Python decides.
    schemas.capture(torch.randn(3, 8), old_arena.clone(), old_ctrl.clone(), 1, L.KIND_RECORD, 0)
    assert len(resolve_calls) == 2
    # A new arena rebinds the table: the old one's regions are gone with it.
    compiledump.reset()
    compiledump.configure(dir=str(dump_dir))
    compiledump.record("b", torch.randn(3, 8))
    assert len(resolve_calls) == 3
    schemas.capture(torch.randn(3, 8), old_arena, old_ctrl, 1, L.KIND_RECORD, 0)
    assert len(resolve_calls) == 4


def _random_session(seed: int) -> list:
    """Calls that exercise every decision: token gate (auto), shape changes, arena full, steps
    past capacity, once, all rows, ids, 3-D layouts (doubtful ones warn), clear(), profiling(),
    set_rows / set_gather_rows."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    pick = lambda n: int(torch.randint(0, n, (1,), generator=g))  # noqa: E731
    calls = []
    for _ in range(60):
        tokens = (7, 7, 7, 1, 3)[pick(5)]
        what = pick(11)
        if what == 0:
            calls.append(("record", f"r{pick(3)}", rnd(tokens, 16 + 8 * pick(2)), {}))
        elif what == 1:
            calls.append(("record", f"h{pick(2)}", rnd(tokens, 4, 12), {}))
        elif what == 2:
            calls.append(("record", "odd", rnd(tokens, 20, 6), {}))  # doubtful [tokens, hc, dim]
        elif what == 3:
            calls.append(("record", "seq", rnd(2, tokens, 6), {"layout": "batch_seq_dim"}))
        elif what == 4:
            calls.append(("record", "all", rnd(tokens, 8), {"rows": "all"}))
        elif what == 5:
            calls.append(("record", "once", rnd(tokens, 8), {"once": True}))
        elif what == 6:
            calls.append(("step", f"s{pick(2)}", rnd(tokens, 8 + pick(2)), {}))
        elif what == 7:
            calls.append(("ids", "ids", torch.randint(0, 9, (tokens, 2), generator=g), {}))
        elif what == 8:
            calls.append(("record", "big", rnd(tokens, 300_000), {}))  # past the 1 MiB arena: arena_full
        elif what == 9:
            calls.append(("control", ("clear", "set_rows", "gather", "profiling")[pick(4)], pick(3), {}))
        else:
            calls.append(("record", "whole", rnd(tokens, 2, 3, 2), {}))
    return calls


def _run(calls, python: bool, directory: Path, tokens) -> tuple[dict, dict]:
    compiledump.reset()
    compiledump.configure(dir=str(directory), arena_mb=1, max_steps=3, tokens=tokens)
    compiledump.init("cpu")
    if python:
        _python_decides()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind, tag, value, kwargs in calls:
            if kind == "record":
                compiledump.record(tag, value, **kwargs)
            elif kind == "step":
                compiledump.record_step(tag, value)
            elif kind == "ids":
                compiledump.record_ids(tag, value)
            elif tag == "clear":
                compiledump.clear()
            elif tag == "set_rows":
                compiledump.set_rows(value)
            elif tag == "gather":
                compiledump.set_gather_rows(record=value - 1)
            else:
                with compiledump.profiling():
                    compiledump.record("r0", torch.randn(7, 16))
        path = compiledump.flush()
    assert STATE.runtime.capture_path == ("python" if python else "native")
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    manifest = json.loads(Path(path).with_suffix(".json").read_text())
    layout_warnings = sorted(str(w.message) for w in caught if "read as [tokens, hc_mult, dim]" in str(w.message))
    return arrays, {part: manifest[part] for part in ("keys", "tags", "drops", "prompt_tokens")} | {
        "layout_warnings": layout_warnings}


@pytest.mark.parametrize("tokens", ["auto", 0, 7])
@pytest.mark.parametrize("seed", range(6))
def test_native_decisions_equal_pythons(dump_dir, tmp_path, seed, tokens):
    calls = _random_session(seed)
    native_arrays, native_manifest = _run(calls, False, tmp_path / "native", tokens)
    python_arrays, python_manifest = _run(calls, True, tmp_path / "python", tokens)
    assert sorted(native_arrays) == sorted(python_arrays)
    for key in native_arrays:
        np.testing.assert_array_equal(native_arrays[key], python_arrays[key], err_msg=key)
    assert native_manifest == python_manifest


def test_inductor_cpp_wrapper_calls_the_native_op(dump_dir, resolve_calls):
    """Inductor's C++ wrapper (no Python between the compiled graph's kernels) runs the captures."""
    import torch._inductor.config as inductor_config

    def step(x):
        y = x * 2
        compiledump.record("a", y)
        compiledump.record_step("s", y[:, 0])
        return y + 1

    compiled = torch.compile(step, fullgraph=True)
    xs = [torch.randn(5, 4, 16) for _ in range(3)]
    with inductor_config.patch(cpp_wrapper=True):
        for x in xs:
            torch.testing.assert_close(compiled(x), x * 2 + 1)
    assert len(resolve_calls) == 2
    with np.load(compiledump.flush()) as data:
        np.testing.assert_array_equal(data["a"], (xs[-1] * 2)[-1].mean(0).numpy())
        for n, x in enumerate(xs):
            np.testing.assert_array_equal(data[f"s_{n}"], (x * 2)[0, 0].numpy())
