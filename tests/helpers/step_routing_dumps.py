"""Decode steps of a small MoE, built with numpy, for the step-routing tests
(tests/compare/test_step_routing.py, test_step_router_logits.py): per step the token's router
logits, its top-k ids (float32 values with an integer source dtype, as the runtime stores
`record_step` of an integer tensor) and layer outputs, then the logits; the RUN side as noise on
REF's floats with chosen ids replaced; and the definitions the tests compute their expected gaps
and epsilons from, independently of compiledump.compare."""

from __future__ import annotations

import math

import numpy as np

from helpers import dumpfactory as factory

EXPERTS, TOPK, DIM, VOCAB, LAYERS, STEPS = 8, 2, 32, 50, 3, 3


def epsilon_of(logits: np.ndarray, ulps: float = 4.0) -> float:
    """ulps bf16 spacings (8-bit significand) of the largest absolute logit."""
    top = float(np.max(np.abs(logits)))
    return ulps * 2.0 ** (math.floor(math.log2(top)) - 7)


def top_k(logits: np.ndarray) -> np.ndarray:
    return np.argsort(-logits.astype(np.float64), kind="stable")[:TOPK]


def step_captures(rng: np.random.Generator, prefill_router_rows: int = 0) -> list[factory.Capture]:
    """Decode steps of a 3-layer MoE as instrument records them: per step and layer the step
    token's router logits, its top-k ids (float32 values) and the layer output, then the logits.
    With ``prefill_router_rows``, a prefill first: every row's router logits and ids per layer."""
    captures = []
    for layer in range(LAYERS if prefill_router_rows else 0):
        logits = rng.standard_normal((prefill_router_rows, EXPERTS)).astype(np.float32)
        captures += [factory.Capture(f"layer{layer}_router", logits, "record", f"layer{layer}_router"),
                     factory.Capture(f"layer{layer}_topk", np.stack([top_k(row) for row in logits]).astype(np.int32),
                                     "ids", f"layer{layer}_topk")]
    for step in range(STEPS):
        for layer in range(LAYERS):
            logits = rng.standard_normal(EXPERTS).astype(np.float32)
            captures += [
                factory.Capture(f"layer{layer}_step_router_{step}", logits, "step", f"layer{layer}_step_router", step),
                factory.Capture(f"layer{layer}_step_topk_{step}", top_k(logits).astype(np.float32), "step",
                                f"layer{layer}_step_topk", step),
                factory.Capture(f"layer{layer}_out_{step}", rng.standard_normal(DIM).astype(np.float32), "step",
                                f"layer{layer}_out", step),
            ]
        logits = rng.standard_normal(VOCAB).astype(np.float32)
        logits[step] += 6.0  # a confident reference: an argmax flip is no near tie
        captures.append(factory.Capture(f"logits_{step}", logits, "step", "logits", step))
    return captures


def with_tie(ref: list, layer: int, step: int, gap: float) -> tuple[list, np.ndarray]:
    """REF with the k-th and (k+1)-th logits of that step's router ``gap`` apart (its ids
    recomputed); and the RUN ids that swap them."""
    out = [factory.replace(c, array=c.array.copy()) for c in ref]
    by_key = {c.key: c for c in out}
    logits = by_key[f"layer{layer}_step_router_{step}"].array
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    logits[order[TOPK]] = logits[order[TOPK - 1]] - np.float32(gap)
    ids = top_k(logits)
    by_key[f"layer{layer}_step_topk_{step}"].array[:] = ids
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    swapped = ids.copy()
    swapped[list(ids).index(order[TOPK - 1])] = order[TOPK]
    return out, swapped.astype(np.float32)


def run_side(ref: list, rng: np.random.Generator, ids: dict[str, np.ndarray], large: set[str] = frozenset(),
             noise: float = 1e-5) -> list:
    """RUN: floats with relative noise ``noise`` (unrelated values for the keys in ``large``: far
    beyond any threshold), ids replaced."""
    out = []
    for capture in ref:
        array = capture.array.copy()
        if capture.key in ids:
            array = ids[capture.key]
        elif capture.key in large:
            array = rng.standard_normal(array.shape).astype(np.float32)
        elif capture.kind != "ids" and "topk" not in capture.key:
            array = (array + rng.standard_normal(array.shape) * noise * np.abs(array).mean()).astype(np.float32)
        out.append(factory.replace(capture, array=array))
    return out


def write(tmp_path, ref: list, run: list, dtype: str, all_rows: bool = False):
    """REF (float32) and RUN (``dtype``), each with the manifest the runtime writes: step ids
    with an integer source dtype, prefill router logits of every row with ``all_rows``."""
    paths = []
    for side, captures, source in (("ref", ref, "float32"), ("run", run, dtype)):
        keys = {c.key for c in captures}
        fields = {key: {"source_dtype": "int64"} for key in keys if "_step_topk_" in key}
        if all_rows:
            fields.update({f"layer{layer}_router": {"rows": "all"} for layer in range(LAYERS)
                           if f"layer{layer}_router" in keys})
        manifest = factory.manifest_for(captures, source_dtype=source, key_fields=fields)
        paths.append(factory.write_compiledump(tmp_path / side, captures, manifest=manifest))
    return paths[0], paths[1]


def gap_of(logits: np.ndarray, ref_row: np.ndarray, run_row: np.ndarray) -> float:
    displaced = [int(i) for i in ref_row if i not in set(run_row.tolist())]
    instead = [int(i) for i in run_row if i not in set(ref_row.tolist())]
    return float(max(logits[displaced].astype(np.float64)) - min(logits[instead].astype(np.float64)))
