"""flush() semantics and threads within one live process, on the CPU kernel: flushing twice and
after more captures, flushes from other threads while this one captures, capture calls racing on
several threads. Every dump is checked against values the test itself put in (random or
distinct per call, never zeros). Failures that end the process: test_faults.py.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import torch

import compiledump


# ----------------------------------------------------------------------------------------------
# flush() semantics
# ----------------------------------------------------------------------------------------------


def read(path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def test_flush_twice_and_after_more_captures(dump_dir):
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    compiledump.record("r", x)
    compiledump.record_step("s", x)
    first = compiledump.flush()
    again = compiledump.flush()
    assert first == again
    a = read(first)
    assert sorted(a) == ["r", "s_0"]
    np.testing.assert_array_equal(a["r"], x[-1].numpy())
    compiledump.record("r", y)  # last write wins
    compiledump.record_step("s", y)
    compiledump.record("new", y)
    b = read(compiledump.flush())
    assert sorted(b) == ["new", "r", "s_0", "s_1"]  # a superset, rewritten whole
    np.testing.assert_array_equal(b["s_0"], x[0].numpy())
    np.testing.assert_array_equal(b["s_1"], y[0].numpy())
    np.testing.assert_array_equal(b["r"], y[-1].numpy())
    manifest = json.loads(Path(first).with_suffix(".json").read_text())
    assert manifest["tags"]["s_<n>"]["calls"] == 2 and set(manifest["keys"]) == set(b)
    names = sorted(p.name for p in dump_dir.iterdir() if not p.name.endswith((".live", ".claim")))  # crash-proof files, name reservation aside
    assert names == sorted([Path(first).name, Path(first).with_suffix(".json").name])


def test_flush_from_other_threads_while_capturing(dump_dir):
    """Flushes from several threads, concurrent with captures on this thread: each one writes
    a consistent pair of files, and the last flush holds every capture."""
    errors: list[BaseException] = []
    stop = threading.Event()
    paths = set()

    def flusher():
        try:
            while not stop.is_set():
                path = compiledump.flush()
                if path is not None:
                    paths.add(path)
                    data = read(path)
                    manifest = json.loads(Path(path).with_suffix(".json").read_text())
                    # The pair on disk may be replaced between the two reads, but each file is whole.
                    assert all(key.startswith(("s_", "r")) for key in data)
                    assert all(entry["shape"] == [16] for entry in manifest["keys"].values())
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=flusher) for _ in range(3)]
    for thread in threads:
        thread.start()
    rows = [torch.randn(2, 16) for _ in range(150)]
    for n, row in enumerate(rows):
        compiledump.record_step("s", row)
        compiledump.record(f"r{n % 7}", row)
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(paths) == 1
    final = read(compiledump.flush())
    for n, row in enumerate(rows):
        np.testing.assert_array_equal(final[f"s_{n}"], row[0].numpy())
    for r in range(7):
        last = max(n for n in range(150) if n % 7 == r)
        np.testing.assert_array_equal(final[f"r{r}"], rows[last][-1].numpy())


# ----------------------------------------------------------------------------------------------
# Capture calls from several threads
# ----------------------------------------------------------------------------------------------


def test_capture_calls_from_many_threads_are_exact(dump_dir):
    """Threads hammering record_step/record/record_ids, on their own tags and on shared ones,
    with a tiny switch interval to force interleavings inside the capture path: every count is
    exact, every stored value is one that was captured, none is lost or written twice."""
    threads_n, calls = 4, 150
    compiledump.configure(max_steps=threads_n * calls)
    values = {t: torch.arange(calls, dtype=torch.float32)[:, None].repeat(1, 6) + 1000 * t for t in range(threads_n)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n)

    def worker(t):
        try:
            barrier.wait()
            for n in range(calls):
                row = values[t][n : n + 1]
                compiledump.record_step(f"own{t}", row)  # a new tag per thread: registration races
                compiledump.record_step("shared", row)
                compiledump.record("shared_last", row)
                compiledump.record_ids(f"ids{t}", torch.tensor([[t, n]]))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(previous)
    assert not errors, errors
    path = compiledump.flush()
    data = read(path)
    manifest = json.loads(Path(path).with_suffix(".json").read_text())
    tags = manifest["tags"]
    for t in range(threads_n):
        assert tags[f"own{t}_<n>"]["calls"] == tags[f"own{t}_<n>"]["kept"] == calls
        for n in range(calls):  # one thread per tag: steps in call order
            np.testing.assert_array_equal(data[f"own{t}_{n}"], values[t][n].numpy())
        np.testing.assert_array_equal(data[f"ids{t}"], [[t, calls - 1]])
        assert tags[f"ids{t}"]["calls"] == calls
    assert tags["shared_<n>"]["calls"] == tags["shared_<n>"]["kept"] == threads_n * calls
    stored = sorted(float(data[f"shared_{n}"][0]) for n in range(threads_n * calls))
    assert stored == sorted(float(v[n, 0]) for v in values.values() for n in range(calls))
    for n in range(threads_n * calls):  # each stored row whole, never a mix of two captures
        row = data[f"shared_{n}"]
        assert (row == row[0]).all()
    assert tags["shared_last"]["calls"] == threads_n * calls
    assert float(data["shared_last"][0]) in {float(v[calls - 1, 0]) for v in values.values()}
    assert manifest["drops"] == {}
