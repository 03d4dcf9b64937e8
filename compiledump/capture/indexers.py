"""Sparse-attention indexers recorded as routers: their flips are then judged, not read as bugs.

A DeepSeek Sparse Attention indexer (DeepSeek-V3.2, GLM-MoE-DSA, Hunyuan V4, dots3, A.X-K2,
Mistral Large 4) scores every key for each query and lets attention read only the top
`index_topk` of them. Once a prompt is longer than `index_topk`, a low-precision engine swaps
near-tie keys honestly, and the token's attention output jumps; without the indexer's scores the
comparator reads that as a divergence at `layer<i>_attn` or later (docs/compare.md). Recorded as
`layer<i>_index_router` (the index scores, one row of keys per token) and `layer<i>_index_topk` (the
keys picked), a swap is judged like an expert flip: a near tie, or a divergence.

The indexer returns only the picked keys; its scores are the input of the top-k inside its
forward, which a torch function mode sees while the wrapped forward runs (eager or traced by
dynamo, which inlines the mode: no graph break).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .state import STATE, warn_once


class _TopkInputs(TorchFunctionMode):
    """Appends (input, k, indices) of each top-k over the last dimension taken while it is active to
    `seen` (None for the indices of a top-k over another dimension). Made once per indexer, outside
    any traced code: dynamo traces entering an existing mode, not building one."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.topk or func is torch.Tensor.topk:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            last = dim in (-1, args[0].dim() - 1)
            self.seen.append((args[0], args[1] if len(args) > 1 else kwargs.get("k"), result[1] if last else None))
        return result


class _Unwrap:
    """The handle `Instrumented.remove()` calls: puts the indexer's own forward back."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def tap_indexer(handle, name: str, path: str, indexer: torch.nn.Module, capture) -> None:
    """Record `indexer`'s scores and picks under `<name>_router` / `<name>_topk` (and their steps)
    through `capture`, a router capture of `handle` that takes `(scores, None, ids)`.

    Only an indexer whose last top-k takes `[batch, seq, k]` picks of `[batch, seq, keys]` scores is
    recorded: those picks, whatever it returns (GLM-5-Next's pooled indexer picks pools of keys and
    returns their keys; its pools are recorded). Another (per-head or per-query picks, masks from
    thresholds) is warned about once.
    A pick of a masked key (score -inf or the lowest finite value: fewer visible keys than k) is
    recorded as -1 on both sides, so the arbitrary order of equal masked scores is no flip."""
    original = indexer.forward
    seen: list = []
    mode = _TopkInputs(seen)
    step_width: dict[str, int] = {}  # the keys every step row is padded to, set by the first call

    def forward(*args, **kwargs):
        if not STATE.config.active:  # off: nothing at all reaches the graph
            return original(*args, **kwargs)
        seen.clear()
        with mode:
            picked = original(*args, **kwargs)
        scores, k, took = seen[-1] if seen else (None, None, None)
        seen.clear()  # no tensor kept past the call
        if (isinstance(scores, torch.Tensor) and scores.is_floating_point() and scores.dim() == 3
                and isinstance(took, torch.Tensor) and tuple(took.shape) == (*scores.shape[:2], k)):
            # masked keys: -inf, or the dtype's lowest value (GLM-5-Next's masked_fill with finfo.min),
            # recorded as -inf: a finite floor would set the near-tie epsilon's scale (compare/routing.py)
            floor = torch.finfo(scores.dtype).min
            masked = torch.gather(scores, -1, took) <= floor
            ids = torch.where(masked, torch.full_like(took, -1), took)
            if isinstance(picked, torch.Tensor) and not picked.is_floating_point() and picked.shape == ids.shape:
                ids = ids.to(picked.dtype)  # the dtype the indexer returns its picks in (int32 in Hunyuan V4)
            # A growing cache adds a key per decode step, and a step tag keeps one shape: each step's
            # row is padded with masked keys to the first call's keys + COMPILEDUMP_MAX_STEPS (a row
            # past that is dropped as shape_changed, counted and warned about). Traced code has a
            # cache of one size (each size is a graph of its own): no state, which dynamo would guard
            # on and re-trace for when the first call set it.
            row = handle._step_row(handle._rows(scores))
            row = row.masked_fill(row <= floor, float("-inf"))
            width = row.shape[-1] + STATE.config.max_steps
            if not torch.compiler.is_compiling():
                width = step_width.setdefault("keys", width)
            if row.shape[-1] < width:
                row = torch.nn.functional.pad(row, (0, width - row.shape[-1]), value=float("-inf"))
            whole = _fits(indexer, scores, k, handle.router_rows)
            if whole:  # out of place: the indexer's own scores stay as they are
                scores = scores.masked_fill(scores <= floor, float("-inf"))
            capture((scores, None, ids), step_logits=row, whole=whole)
        elif not torch.compiler.is_compiling():  # shapes and types: constants while tracing
            handle._unlist_routing(name)
            warn_once(f"instrument: {type(indexer).__name__} (a sparse-attention indexer) does not take the "
                      "[batch, seq, k] top-k of [batch, seq, keys] scores, so its picks are not recorded (no "
                      "layer<i>_index_router/_index_topk, nor listed in handle.taps): a swap of near-tie keys there "
                      "reads as a divergence in attention. Compare prompts no longer than its key budget (where it "
                      "keeps every key), or the same precision on both sides")
        return picked

    indexer.forward = forward
    handle._handles.append(_Unwrap(indexer))
    handle._list_routing(name, path)


def _fits(indexer: torch.nn.Module, scores: torch.Tensor, k: int, router_rows: str | None) -> bool:
    """Whether the prompt's scores and picks of one indexer take at most an eighth of the arena.
    A long prompt's `[tokens, keys]` scores would crowd every later tag out of it (8192 tokens: 256
    MiB a layer); then only the step tags (one row each) are recorded, with one warning naming the
    size to set. Shapes and settings only: constants while tracing."""
    tokens, keys = scores.shape[1], scores.shape[2]
    nbytes = 4 * ((tokens if router_rows == "all" else 1) * keys + tokens * k)
    budget = STATE.config.arena_mb * 2**20 // 8
    if nbytes <= budget:
        return True
    if not torch.compiler.is_compiling():
        warn_once(f"instrument: {type(indexer).__name__} (a sparse-attention indexer): its scores and picks of "
                  f"{tokens} tokens x {keys} keys take {nbytes / 2**20:.0f} MiB a layer, over an eighth of the "
                  f"arena (COMPILEDUMP_ARENA_MB={STATE.config.arena_mb}): only each step's row is recorded, so a "
                  "swap of the prompt's keys is not judged and may read as a divergence. Set COMPILEDUMP_ARENA_MB="
                  f"{-(-8 * nbytes // 2**20)} or more to record every row (or instrument(router_rows='one'))")
    return False
