"""Dumps of a small MoE prefill, built with numpy, for the expert-id tests (tests/compare/test_routing*.py):
router logits, top-k ids, MoE and layer outputs per layer, decode-step logits; the RUN side as
noise on REF's floats with chosen ids rows replaced; and the definitions the tests compute their
expected gaps and epsilons from, independently of compiledump.compare."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from helpers import dumpfactory as factory

EXPERTS, TOPK, TOKENS, DIM, LAYERS = 8, 2, 6, 32, 3


def epsilon_of(logits: np.ndarray, ulps: float = 4.0) -> float:
    """ulps bf16 spacings (8-bit significand) of the largest absolute logit."""
    top = float(np.max(np.abs(logits)))
    return ulps * 2.0 ** (math.floor(math.log2(top)) - 7)


def top_k(logits: np.ndarray) -> np.ndarray:
    """Experts by descending logit (first index on ties), as torch.topk returns them."""
    return np.argsort(-logits, kind="stable")[:TOPK].astype(np.int32)


def moe_captures(rng: np.random.Generator, all_rows: bool) -> list[factory.Capture]:
    """A prefill of a 3-layer MoE as compiledump.instrument records it: per layer the router
    logits (the last row, or every row), the top-k ids of every row (the top-k of the logits),
    the MoE output and the layer output; then 3 decode steps of logits."""
    captures = [factory.Capture("embed", rng.standard_normal(DIM).astype(np.float32), "record", "embed")]
    for layer in range(LAYERS):
        logits = rng.standard_normal((TOKENS, EXPERTS)).astype(np.float32)
        ids = np.stack([top_k(row.astype(np.float64)) for row in logits])
        router = logits if all_rows else logits[-1]
        captures += [
            factory.Capture(f"layer{layer}_router", router, "record", f"layer{layer}_router"),
            factory.Capture(f"layer{layer}_topk", ids, "ids", f"layer{layer}_topk"),
            factory.Capture(f"layer{layer}_mlp", rng.standard_normal(DIM).astype(np.float32), "record",
                            f"layer{layer}_mlp"),
            factory.Capture(f"layer{layer}", rng.standard_normal(DIM).astype(np.float32), "record", f"layer{layer}"),
        ]
    for step in range(3):
        logits = rng.standard_normal(50).astype(np.float32)
        logits[step] += 6.0
        captures.append(factory.Capture(f"logits_{step}", logits, "step", "logits", step))
    return captures


def with_near_tie(captures: list, layer: int, row: int, gap: float, all_rows: bool) -> list:
    """Make REF's top-1 and the best unchosen expert of ``row`` in ``layer`` differ by ``gap``
    (the other logits unchanged), recomputing that row's ids."""
    out = [factory.replace(c, array=c.array.copy()) for c in captures]
    by_key = {c.key: c for c in out}
    router, ids = by_key[f"layer{layer}_router"].array, by_key[f"layer{layer}_topk"].array
    logits = router[row] if all_rows else router
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    logits[order[TOPK]] = logits[order[TOPK - 1]] - np.float32(gap)
    ids[row] = top_k(logits.astype(np.float64))
    return out


def run_side(ref: list, rng: np.random.Generator, ids_rows: dict, large_from_layer: int | None = None) -> list:
    """RUN: floats with relative noise 1e-5 (large noise 0.3 in layers >= ``large_from_layer``),
    ``ids_rows[(layer, row)] = new ids row``."""
    out = []
    for capture in ref:
        array = capture.array.copy()
        if capture.kind == "ids":
            layer = int(capture.tag[5:].split("_")[0])
            for (at_layer, row), new in ids_rows.items():
                if at_layer == layer:
                    array[row] = new
        else:
            layer = int(capture.tag[5:].split("_")[0]) if capture.tag.startswith("layer") else None
            relative = 0.3 if large_from_layer is not None and layer is not None and layer >= large_from_layer \
                else 1e-5
            array = (array + rng.standard_normal(array.shape) * relative * np.abs(array).mean()).astype(np.float32)
        out.append(factory.replace(capture, array=array))
    return out


def write_pair(tmp_path: Path, ref: list, run: list, dtype: str, all_rows: bool) -> tuple[Path, Path]:
    fields = {f"layer{layer}_router": {"rows": "all"} for layer in range(LAYERS)} if all_rows else None
    return factory.write_pair(tmp_path, ref, run, "float32", dtype, key_fields=fields)


def gap_of(logits: np.ndarray, ref_row: np.ndarray, run_row: np.ndarray) -> float:
    """The largest logit by which an expert REF chose and RUN did not beats one RUN chose instead."""
    displaced = [int(i) for i in ref_row if i not in set(run_row.tolist())]
    instead = [int(i) for i in run_row if i not in set(ref_row.tolist())]
    return float(max(logits[displaced].astype(np.float64)) - min(logits[instead].astype(np.float64)))


def swap_runner_up(ref: list, layer: int, row: int, all_rows: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """REF's logits and ids of ``row``, and a RUN ids row with REF's k-th expert replaced by the
    best unchosen one."""
    by_key = {c.key: c for c in ref}
    router = by_key[f"layer{layer}_router"].array
    logits = (router[row] if all_rows else router).astype(np.float64)
    ids = by_key[f"layer{layer}_topk"].array[row]
    order = np.argsort(-logits, kind="stable")
    new = ids.copy()
    new[list(ids).index(order[TOPK - 1])] = order[TOPK]
    return logits, ids, new
