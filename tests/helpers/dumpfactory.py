"""Synthetic dumps for the comparator tests.

Files are written exactly as docs/format.md describes (a plain ``numpy.savez`` archive plus a
``compiledump-dump`` manifest with the same stem), or as debug_dump.py wrote them (the npz alone,
members in capture order, named ``deepinfer_layers_rank<R>_pid<P>.npz``), without going through the
capture runtime. Data is random, never zeros.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Capture:
    """One dumped key as the runtime would have produced it."""

    key: str
    array: np.ndarray
    kind: str  # record | record_once | step | ids
    tag: str
    step: int | None = None


def model_captures(rng: np.random.Generator, layers: int = 6, dim: int = 48, steps: int = 5, vocab: int = 300,
                   topk: int = 4, experts: int = 16, tokens: int = 3, step_hidden: bool = True) -> list[Capture]:
    """Captures of one prefill and ``steps`` decode steps of a toy MoE model, in capture order.

    Prefill: ``embed``, then per layer ``layer<i>_topk`` (int32 expert ids ``[tokens, topk]``),
    ``layer<i>_moe_out`` and ``layer<i>``, then ``final_norm`` and the prefill ``logits``.
    Decode step n: ``final_hidden_<n>`` (when ``step_hidden``) then ``logits_<n>``.
    """
    captures = [Capture("embed", _vector(rng, dim), "record", "embed")]
    for layer in range(layers):
        ids = np.stack([rng.choice(experts, size=topk, replace=False) for _ in range(tokens)]).astype(np.int32)
        captures.append(Capture(f"layer{layer}_topk", ids, "ids", f"layer{layer}_topk"))
        captures.append(Capture(f"layer{layer}_moe_out", _vector(rng, dim), "record", f"layer{layer}_moe_out"))
        captures.append(Capture(f"layer{layer}", _vector(rng, dim), "record", f"layer{layer}"))
    captures.append(Capture("final_norm", _vector(rng, dim), "record", "final_norm"))
    captures.append(Capture("logits", _logits(rng, vocab), "record_once", "logits"))
    for step in range(steps):
        if step_hidden:
            captures.append(Capture(f"final_hidden_{step}", _vector(rng, dim), "step", "final_hidden", step))
        captures.append(Capture(f"logits_{step}", _logits(rng, vocab), "step", "logits", step))
    return captures


def _vector(rng: np.random.Generator, dim: int) -> np.ndarray:
    return (rng.standard_normal(dim) * 2.0 + 0.5).astype(np.float32)


def _logits(rng: np.random.Generator, vocab: int) -> np.ndarray:
    logits = rng.standard_normal(vocab) * 3.0
    # A clear winner, so that small noise never flips the argmax unless a test wants it to.
    logits[rng.integers(vocab)] = logits.max() + 4.0
    return logits.astype(np.float32)


def perturb(captures: list[Capture], rng: np.random.Generator, noise: float = 1e-4,
            from_layer: int | None = None, from_step: int | None = None, large: float = 0.3,
            ids_layer: int | None = None) -> list[Capture]:
    """A RUN side for ``captures``: every float array gets relative noise ``noise`` (rel_diff
    about noise²/2, far below any threshold); keys of layers >= ``from_layer`` (and the prefill
    keys after the last layer) and step keys with step >= ``from_step`` get relative noise
    ``large`` (rel_diff about large²/2); ``layer<ids_layer>_topk`` gets one expert id replaced."""
    out = []
    after_layers = False
    for capture in captures:
        array = capture.array
        layer = _layer(capture.tag)
        if layer is None and capture.kind != "step" and any(_layer(c.tag) is not None for c in out):
            after_layers = True
        if np.issubdtype(array.dtype, np.integer):
            if ids_layer is not None and capture.key == f"layer{ids_layer}_topk":
                array = array.copy()
                used = set(array[0].tolist())
                array[0, -1] = next(value for value in range(10_000) if value not in used)
        else:
            relative = noise
            if capture.kind != "step" and from_layer is not None and (
                    (layer is not None and layer >= from_layer) or after_layers):
                relative = large
            if capture.kind == "step" and from_step is not None and capture.step >= from_step:
                relative = large
            scale = np.linalg.norm(array) / np.sqrt(array.size)
            array = (array + rng.standard_normal(array.shape) * relative * scale).astype(array.dtype)
        out.append(replace(capture, array=array))
    return out


def scaled(captures: list[Capture], key: str, factor: float, row: int | None = None) -> list[Capture]:
    """``captures`` with ``key``'s array (or only its row ``row``) multiplied by ``factor``: the
    scale error that rel_diff nearly misses and norm_diff names."""
    out = []
    for capture in captures:
        if capture.key == key:
            array = capture.array.astype(np.float64).copy()
            if row is None:
                array *= factor
            else:
                array[row] *= factor
            capture = replace(capture, array=array.astype(np.float32))
        out.append(capture)
    return out


def _layer(tag: str) -> int | None:
    if tag.startswith("layer"):
        digits = tag[5:].split("_", 1)[0]
        if digits.isdigit():
            return int(digits)
    return None


def manifest_for(captures: list[Capture], rank: int | str = 0, pid: int = 1000, drops: dict | None = None,
                 filtered_tags: dict | None = None, source_dtype: str = "bfloat16",
                 key_fields: dict[str, dict] | None = None, prompt_tokens: int | None = None) -> dict:
    """The manifest docs/format.md specifies for these captures. ``order`` is the first-capture
    order of the tag's slot; like the runtime, a step tag has its own slot, separate from a record
    of the same name (``logits`` once at prefill and ``logits_<n>`` per step).

    ``source_dtype`` is every float key's (ids say int64); ``key_fields[key]`` adds or replaces
    fields of one key's entry (``tokens``, ``phase``, ``rows``, ...); ``prompt_tokens`` is written
    at the top level when given (older manifests do not have it)."""
    slot_order: dict[tuple[str, bool], int] = {}
    for capture in captures:
        slot_order.setdefault((capture.tag, capture.kind == "step"), len(slot_order))
    keys = {}
    tags: dict[str, dict] = {}
    for capture in captures:
        order = slot_order[(capture.tag, capture.kind == "step")]
        keys[capture.key] = {
            "tag": capture.tag, "kind": capture.kind, "step": capture.step, "order": order,
            "source_dtype": source_dtype if capture.kind != "ids" else "int64",
            "source_shape": list(capture.array.shape), "dtype": str(capture.array.dtype),
            "shape": list(capture.array.shape),
        }
        name = f"{capture.tag}_<n>" if capture.kind == "step" else capture.tag
        entry = tags.setdefault(name, {"tag": capture.tag, "kind": capture.kind, "order": order, "calls": 0,
                                       "written": 0, "drops": {}})
        entry["calls"] += 1
        entry["written"] += 1
    for key, extra in (key_fields or {}).items():
        keys[key].update(extra)
    manifest = {
        "format": "compiledump-dump", "format_version": 1, "compiledump_version": "0.1.0",
        "torch_version": "2.13.0+cpu", "created_unix": 1764480000.0, "rank": str(rank), "pid": pid,
        "world_size": None, "device": "cpu",
        "config": {"dir": "/tmp/dumps", "tokens": 0, "moe_layers": 2, "max_rows": 1, "max_steps": 256,
                   "arena_mb": 64, "max_tags": 4096},
        "keys": keys, "tags": tags, "drops": drops or {}, "filtered_tags": filtered_tags or {},
    }
    if prompt_tokens is not None:
        manifest["prompt_tokens"] = prompt_tokens
    return manifest


def call_fields(captures: list[Capture], record_tokens: int, ids_tokens: int, prompt: int | None) -> dict[str, dict]:
    """``keys[k].tokens``/``phase`` as the runtime writes them when every record key kept a call
    of ``record_tokens`` tokens and every ids key (and record_once key: the first write) one of
    ``ids_tokens``: the phase is prefill when the count is the prompt length, decode otherwise,
    None when the prompt length is unknown (the token gate off). Steps carry neither."""
    fields = {}
    for capture in captures:
        if capture.kind == "step":
            continue
        tokens = record_tokens if capture.kind == "record" else ids_tokens
        phase = None if prompt is None else ("prefill" if tokens == prompt else "decode")
        fields[capture.key] = {"tokens": tokens, "phase": phase}
    return fields


def write_compiledump(directory: Path, captures: list[Capture], rank: int | str = 0, pid: int = 1000,
                      shuffle_with: np.random.Generator | None = None, manifest: dict | None = None) -> Path:
    """Write ``compiledump_rank<rank>_pid<pid>.npz`` and its manifest; return the npz path.

    ``shuffle_with`` writes the npz members in a random order, so that only the manifest can
    give the capture order back.
    """
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"compiledump_rank{rank}_pid{pid}"
    members = list(captures)
    if shuffle_with is not None:
        members = [members[index] for index in shuffle_with.permutation(len(members))]
    np.savez(stem.with_suffix(".npz"), **{capture.key: capture.array for capture in members})
    stem.with_suffix(".json").write_text(json.dumps(manifest or manifest_for(captures, rank, pid), indent=1))
    return stem.with_suffix(".npz")


def write_legacy(directory: Path, captures: list[Capture], rank: int | str = 0, pid: int = 1000) -> Path:
    """Write ``deepinfer_layers_rank<rank>_pid<pid>.npz`` as debug_dump.py does: members in capture
    order, no manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"deepinfer_layers_rank{rank}_pid{pid}.npz"
    np.savez(path, **{capture.key: capture.array for capture in captures})
    return path


def write_pair(directory: Path, ref: list[Capture], run: list[Capture], ref_dtype: str | None = "float32",
               run_dtype: str | None = "float32", ref_manifest: dict | None = None,
               run_manifest: dict | None = None, key_fields: dict[str, dict] | None = None) -> tuple[Path, Path]:
    """REF and RUN written under ``directory``/ref and /run, each with ``manifest_for``'s manifest
    of its source dtype (and ``key_fields``, on both sides) unless a manifest is given; a dtype of
    None (and no manifest) writes that side as a legacy file."""
    paths = []
    for side, captures, dtype, manifest in (("ref", ref, ref_dtype, ref_manifest),
                                            ("run", run, run_dtype, run_manifest)):
        if dtype is None and manifest is None:
            paths.append(write_legacy(directory / side, captures))
        else:
            manifest = manifest or manifest_for(captures, source_dtype=dtype, key_fields=key_fields)
            paths.append(write_compiledump(directory / side, captures, manifest=manifest))
    return paths[0], paths[1]
