"""Property-based tests: random call sequences against a plain model of the semantics.

`Model` (tests/helpers/capture_model.py) restates, in plain Python and numpy, what docs/api.md and docs/format.md say the
capture calls do (keys, rows, hc mean in fp32, gates, filters, drop counters, capacities, tag
rules). It does not import or call anything from compiledump. Hypothesis draws settings, tags,
shapes, dtypes, strides and call sequences (captures, set_rows, set_gather_rows, profiling,
flushes); every flush of the real runtime must equal the model's dump exactly: the same keys,
bit-identical arrays, the same manifest counts. A second property runs each sequence through
the Triton kernel (TRITON_INTERPRET=1) and the CPU kernel and requires identical dumps.

Example counts are bounded so the file runs in well under a minute and a half on a 2-core box;
`COMPILEDUMP_FUZZ_SCALE=20 python -m pytest tests/ops/test_fuzz.py` runs 20 times as many.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import compiledump
from compiledump import config as cd_config
from helpers.capture_model import Model

# ----------------------------------------------------------------------------------------------
# Drawing call sequences
# ----------------------------------------------------------------------------------------------

TAGS = ["a", "b", "a_0", "a_1", "layer0_x", "layer2_x", "layer1", "x.y", "layerq_z", "bad tag"]
# Half of the draws reuse a few plain tags, so that tags see many calls (steps pile up past small
# capacities, regions sit next to each other); the rest exercise the tag rules and filters.
tags = st.one_of(st.sampled_from(["a", "b", "c"]), st.sampled_from(TAGS))
FLOATS = ["float32", "float16", "bfloat16", "float64"]
INTS = ["int64", "int32", "int16", "uint8", "bool"]


# A small pool, so that a tag often sees the same shape again (steps accumulate, shapes change
# now and then); 1100 is wider than the Triton kernel's block.
SHAPES = [(), (3,), (1, 4), (2, 4), (3, 4), (4, 4), (2, 3, 4), (3, 2, 4), (1, 4, 5), (2, 2, 1, 3)]
BIG_SHAPES = [(2, 1100), (1, 2, 9)]


# Each tag has a usual shape for the example (drawn once), used by 3 captures in 4: steps pile
# up past small capacities and keep their region; the others draw from the pool.
USUAL_SHAPES = [(1, 4), (2, 4), (3, 4), (2, 3, 4), (3, 2, 4), (4,)]
usual_shapes = st.fixed_dictionaries({tag: st.sampled_from(USUAL_SHAPES) for tag in TAGS + ["c"]})


# The strategies are built once, at import, and drawn from many times: a strategy built inside a
# draw is a new object, validated again on every draw (half of the data generation's time).
LAYOUTS = st.sampled_from(["contiguous", "transposed", "strided", "broadcast"])
SEEDS = st.integers(0, 2**31 - 1)


def tensors(dtypes, big: bool = False):
    """The spec (make_tensor) of a tensor: one of `dtypes`, of the tag's usual shape in 3 draws of
    4, else one of SHAPES (and BIG_SHAPES if `big`)."""
    shapes = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(SHAPES + (BIG_SHAPES if big else [])))
    return _tensor_specs(shapes, st.sampled_from(dtypes))


@st.composite
def _tensor_specs(draw, shapes, dtypes):
    shape = draw(shapes)
    layout = draw(LAYOUTS)
    return {"shape": shape, "dtype": draw(dtypes), "layout": layout,
            "seed": draw(SEEDS), "special": draw(st.booleans()) and draw(st.booleans())}


def make_tensor(spec: dict, usual: tuple) -> torch.Tensor:
    """A tensor of spec's shape (or the tag's `usual` one) and dtype whose memory layout may be
    non-contiguous."""
    shape, dtype = spec["shape"] or usual, getattr(torch, spec["dtype"])
    gen = torch.Generator().manual_seed(spec["seed"])
    layout = spec["layout"] if len(shape) >= 2 else "contiguous"

    def values(size):
        if dtype == torch.bool:
            return torch.randint(0, 2, size, generator=gen).bool()
        if not dtype.is_floating_point:
            return torch.randint(0, 200, size, generator=gen).to(dtype)
        v = torch.randn(size, generator=gen, dtype=torch.float64) * 3
        if spec["special"] and v.numel() > 2:
            v.view(-1)[0], v.view(-1)[-1] = float("inf"), float("nan")
        return v.to(dtype)

    if layout == "transposed":
        return values(shape[::-1]).permute(*reversed(range(len(shape))))
    if layout == "strided":
        return values(shape[:-1] + (shape[-1] * 2,))[..., ::2]
    if layout == "broadcast":  # a stride-0 dimension
        return values(shape[:1] + (1,) + shape[2:]).expand(shape)
    return values(shape)


# Operation kinds, weighted by repetition: mostly captures, short profiling() spans.
OP_KINDS = ["record"] * 4 + ["step"] * 4 + ["ids"] * 2 + ["set_rows", "gather", "enter", "exit", "exit", "flush",
                                                       "configure"]


def call_sequences(record_dtypes=FLOATS + ["int64", "bool"]):
    """One operation of a call sequence, as a tuple (kind, arguments...)."""
    kinds = st.sampled_from(OP_KINDS)
    rows = st.one_of(st.none(), st.integers(-4, 4))
    arguments = {  # what follows each kind in its tuple (the kinds not here have nothing)
        "record": st.tuples(tags, tensors(record_dtypes), st.booleans()),
        "step": st.tuples(tags, tensors(FLOATS, big=True)),
        "ids": st.tuples(tags, tensors(INTS + ["float32"])),
        "set_rows": st.tuples(st.integers(0, 3)),
        "gather": st.tuples(rows, rows),
        "configure": st.tuples(st.sampled_from([0, 2, 3, "auto"]), st.integers(0, 2)),
    }

    @st.composite
    def operation(draw):
        kind = draw(kinds)
        return (kind, *draw(arguments[kind])) if kind in arguments else (kind,)

    return operation()


ops = call_sequences()

configs = st.fixed_dictionaries({
    "tokens": st.sampled_from([0, 0, 2, 3, "auto", "auto"]),
    "moe_layers": st.integers(0, 3),
    "max_rows": st.integers(0, 2),
    "max_steps": st.sampled_from([1, 2, 3, 256, 65536]),
    "max_tags": st.sampled_from([1, 3, 6, 1024, 1024]),
    "arena_mb": st.just(1),
})


@contextlib.contextmanager
def fresh_runtime(cfg: dict, kernel: str = "reference"):
    """A fresh, enabled compiledump state in a temporary directory, with `kernel` on CPU."""
    previous = compiledump.get_config()
    old_kernel = os.environ.get("COMPILEDUMP_CPU_KERNEL")
    os.environ["COMPILEDUMP_CPU_KERNEL"] = kernel
    with tempfile.TemporaryDirectory() as directory:
        compiledump.reset()
        compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=directory, **cfg)))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield directory
        finally:
            compiledump.reset()
            compiledump.configure(**dataclasses.asdict(previous))
            if old_kernel is None:
                os.environ.pop("COMPILEDUMP_CPU_KERNEL", None)
            else:
                os.environ["COMPILEDUMP_CPU_KERNEL"] = old_kernel


EMPTY = ({}, {"keys": {}, "tags": {}, "drops": {}, "filtered_tags": {}, "prompt_tokens": None})


def read_flush(path: str | None) -> tuple[dict, dict]:
    if path is None:
        return EMPTY
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    manifest = json.loads(Path(path).with_suffix(".json").read_text())
    return arrays, manifest


def run_sequence(sequence, usual: dict, model: Model | None) -> list[tuple[tuple, tuple | None]]:
    """Run `sequence` on the real runtime and, if given, the model (checking that both raise
    the same errors); return (real dump, model dump) for every flush, the last one taken after
    the sequence. A flush before any tag was registered writes nothing."""
    flushes = []
    stack = []

    def flush():
        want = None if model is None else (model.dump() if model.slots else EMPTY)
        flushes.append((read_flush(compiledump.flush()), want))

    for op in sequence:
        name = op[0]
        if name in ("record", "step", "ids"):
            tag, spec = op[1], op[2]
            x = make_tensor(spec, usual[tag if tag in usual else "a"])
            call = {"record": "record_once" if name == "record" and op[3] else "record", "step": "step",
                    "ids": "ids"}[name]
            expected = None
            if model is not None:
                exact = x.to(torch.float64 if x.dtype.is_floating_point else torch.int64).numpy()
                try:
                    model.capture(call, tag, exact, spec["dtype"])
                except (ValueError, TypeError) as error:
                    expected = error
            try:
                if name == "record":
                    compiledump.record(tag, x, once=op[3])
                elif name == "step":
                    compiledump.record_step(tag, x)
                else:
                    compiledump.record_ids(tag, x)
            except (ValueError, TypeError) as error:
                assert model is None or (type(error) is type(expected) and str(expected) in str(error)), \
                    f"{name}({tag!r}) raised {error!r}, the model expected {expected!r}"
            else:
                assert expected is None, f"{name}({tag!r}) did not raise; the model expected {expected!r}"
        elif name == "set_rows":
            compiledump.set_rows(op[1])
            if model is not None:
                model.rows = op[1]
        elif name == "gather":
            compiledump.set_gather_rows(record=op[1], step=op[2])
            if model is not None:
                model.record_row = op[1] if op[1] is not None else model.record_row
                model.step_row = op[2] if op[2] is not None else model.step_row
        elif name == "enter":
            stack.append(compiledump.profiling())
            stack[-1].__enter__()
            if model is not None:
                model.profiling += 1
        elif name == "exit" and stack:
            stack.pop().__exit__(None, None, None)
            if model is not None:
                model.profiling -= 1
        elif name == "configure":  # the gates may change at any time
            compiledump.configure(tokens=op[1], max_rows=op[2])
            if model is not None:
                model.cfg = dict(model.cfg, tokens=op[1], max_rows=op[2])
                if op[1] not in (0, "auto") and model.arena:
                    model.prompt = op[1]
        elif name == "flush":
            flush()
    flush()
    while stack:
        stack.pop().__exit__(None, None, None)
    return flushes


def assert_same_dump(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    arrays, manifest = got
    want_arrays, want_manifest = want
    assert sorted(arrays) == sorted(want_arrays)
    for key, value in want_arrays.items():
        assert arrays[key].dtype == value.dtype and arrays[key].shape == value.shape, key
        np.testing.assert_array_equal(arrays[key], value, err_msg=key)
    for key, entry in want_manifest["keys"].items():
        assert {name: manifest["keys"][key][name] for name in entry} == entry, key
    assert set(manifest["tags"]) == set(want_manifest["tags"])
    for name, entry in want_manifest["tags"].items():
        assert {field: manifest["tags"][name][field] for field in entry} == entry, name
    assert manifest["drops"] == want_manifest["drops"]
    assert manifest["filtered_tags"] == want_manifest["filtered_tags"]
    assert manifest["prompt_tokens"] == want_manifest["prompt_tokens"]


SCALE = int(os.environ.get("COMPILEDUMP_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=500 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                print_blob=True)


def _spec(shape, seed=1, dtype="float32"):
    return {"shape": shape, "dtype": dtype, "layout": "contiguous", "seed": seed, "special": False}


_USUAL = {tag: (2, 4) for tag in TAGS + ["c"]}
_CFG = {"tokens": 2, "moe_layers": 2, "max_rows": 0, "max_steps": 3, "max_tags": 1024, "arena_mb": 1}
# Gate precedence: suspended over the rows gate and over once; the rows gate over a bad row;
# once ignores the token gate; the token gate for plain records.
_PRECEDENCE = [("set_rows", 3), ("enter",), ("step", "a", _spec((3, 4))), ("record", "b", _spec((3, 4)), True),
               ("exit",), ("step", "a", _spec((3, 4), 2)), ("gather", 9, 9), ("step", "a", _spec((3, 4), 3)),
               ("set_rows", 0), ("step", "a", _spec((3, 4), 4)), ("record", "b", _spec((3, 4), 5), True),
               ("record", "c", _spec((3, 4), 6), False), ("flush",)]
# The arena's last word: 3 words at 0, the next region at 4 ends exactly at 262144; then full.
_BOUNDARY = [("record", "a", _spec((1, 3)), False), ("record", "b", _spec((1, 262140), 2), False),
             ("record", "c", _spec((1, 1), 3), False)]


@FUZZ
@given(cfg=configs, usual=usual_shapes, sequence=st.lists(ops, min_size=5, max_size=40))
@example(cfg=_CFG, usual=_USUAL, sequence=_PRECEDENCE)
@example(cfg=dict(_CFG, tokens=0), usual=_USUAL, sequence=_BOUNDARY)
def test_cpu_kernel_matches_the_model(cfg, usual, sequence):
    """Every flush of a random call sequence equals the model's dump at that point."""
    with fresh_runtime(cfg):
        flushes = run_sequence(sequence, usual, Model(cfg))
    for got, want in flushes:
        assert_same_dump(got, want)


@settings(max_examples=200 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(cfg=configs, usual=usual_shapes,
       sequence=st.lists(call_sequences().filter(lambda op: op[0] != "flush"), max_size=12))
def test_triton_kernel_matches_the_cpu_kernel(cfg, usual, sequence):
    """The Triton kernel (interpreted on CPU) and the CPU kernel write identical dumps."""
    results = []
    for kernel in ("reference", "triton"):
        with fresh_runtime(cfg, kernel):
            results.append(run_sequence(sequence, usual, None)[-1][0])
    (cpu_arrays, cpu_manifest), (tri_arrays, tri_manifest) = results
    assert sorted(cpu_arrays) == sorted(tri_arrays)
    for key in cpu_arrays:
        assert cpu_arrays[key].dtype == tri_arrays[key].dtype, key
        np.testing.assert_array_equal(tri_arrays[key], cpu_arrays[key], err_msg=key)
    for part in ("keys", "tags", "drops", "filtered_tags"):
        assert tri_manifest[part] == cpu_manifest[part], part


# Found by the fuzzer: the Triton launch chose int32 storage from the input dtype, so record() and
# record_step() of an integer or bool tensor stored int32 bits (44 read back as 6e-44).
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_record_of_an_integer_tensor_is_stored_as_float_values_by_the_triton_kernel(dtype):
    x = torch.arange(6).reshape(2, 3).to(dtype)
    results = []
    for kernel in ("reference", "triton"):
        with fresh_runtime({}, kernel):
            compiledump.record("r", x)
            compiledump.record_step("s", x)
            results.append(read_flush(compiledump.flush())[0])
    expected = x.to(torch.float32).numpy()
    for arrays in results:
        np.testing.assert_array_equal(arrays["r"], expected[-1])
        np.testing.assert_array_equal(arrays["s_0"], expected[0])
