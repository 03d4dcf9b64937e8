"""The capture API: settings and lifecycle, and the capture calls (the host-side registers they
read are set in capture/registers.py).

What happens where, and why:

- `record*` run as ordinary Python in eager mode and are traced by dynamo under torch.compile.
  Everything they decide on the host is fixed per call site and shape (is capture on, token
  gate, which slot and arena region a tag owns), so a compiled graph contains exactly one
  `compiledump::capture_v1` call per capture point, with constant integer arguments.
- The tag registry (capture/arena.py) is reached through `_plan`, marked
  `assume_constant_result`: dynamo calls it once per call site while tracing and bakes the
  returned integers into the graph, instead of tracing (and guarding on) the registry dict. It also creates the arena on first use, so the first
  capture may happen while tracing.
- Everything that can change between two runs of one graph (profiling suspension, rows gate,
  step counters, keep-first flags, the row to gather) lives in the control block on the device
  and is read by the kernel. The host only ever writes it through small kernels, outside any
  graph, and reads it in `flush()`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import sys

import torch

from .. import config as _config
from ..format import spec
from ..ops import layout as L
from ..ops import register, schemas
from . import dispatch, layouts, mixers, parallel, persist, routers, signals
from .arena import Runtime
from .flush import dump_stem, flush, flush_at_exit, flush_if_changed, flush_on_signal, process_fields, remove_live_files
from .state import STATE, warn_once

__all__ = ["clear", "configure", "dump_stem", "flush", "get_config", "init", "prepare_kernels", "record", "record_ids",
           "record_step", "reset"]

_TAG_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


# --------------------------------------------------------------------------------------------
# Configuration and lifecycle


def configure(**settings) -> _config.Config:
    """Change settings (the same names as `Config`'s fields); return the new config.

    `configure(dir="dumps")` enables capture from Python instead of `COMPILEDUMP_DIR`. Capacity
    settings (`max_steps`, `arena_mb`, `max_tags`) size the device allocations, and `persist`
    decides where they live: none of them can change once the arena exists. `layer_steps` applies
    to the step tags not captured yet. Switching capture off or to another directory first writes
    what was captured since the last flush into the directory it was captured for (the arena is
    not cleared: call `clear()` to start the new directory's dump empty). Compiled functions that
    captured under the old settings recompile.
    """
    unknown = set(settings) - {f.name for f in dataclasses.fields(_config.Config)}
    if unknown:
        raise TypeError(f"compiledump.configure: unknown setting(s) {sorted(unknown)}")
    new = dataclasses.replace(STATE.config, **settings)
    rt = STATE.runtime
    if rt is not None:
        changed = {f for f in _config.ARENA_FIELDS if getattr(new, f) != getattr(rt.config, f)}
        if changed:
            raise RuntimeError(
                f"compiledump.configure: {sorted(changed)} cannot change after the arena was created"
            )
        # A switch of directory holds the flush lock until the new settings are in force: a flush
        # of another thread writes into one directory, under that directory's name, before or
        # after it. (Other settings take no lock: configure() may run in a signal handler.)
        switching = new.dir != STATE.config.dir or new.active != STATE.config.active
        with STATE.flush_lock if switching else contextlib.nullcontext():
            _switch(rt, new)
            STATE.config = new
    else:
        STATE.config = new
    STATE.plans.clear()
    register_exit_flush()
    return new


def _switch(rt: Runtime, new: _config.Config) -> None:
    """Bring the runtime to the settings `new` (configure(), with the flush lock held)."""
    old = STATE.config
    if old.active and (not new.active or new.dir != old.dir):
        # Capture ends here, or goes on elsewhere: what it captured since the last flush goes to
        # the directory it was captured for now (at exit capture is off, or its dump would be
        # written into the other directory alone).
        try:
            flush_if_changed()
        except Exception as error:  # noqa: BLE001 - a full or vanished directory is why one switches
            rt.flushed_ctrl = None  # what it held goes into the new directory's dump
            warn_once(f"configure(dir={new.dir!r}): could not write the dump of {old.dir!r} first ({error}); "
                      "its captures stay in the arena and are written with the new directory's dump")
    elif new.active:
        rt.flushed_ctrl = None  # switched on, or other settings: a dump at exit whatever was captured
    rt.config = new
    if rt.live is not None and new.dir != old.dir:  # recover tells a switch by the directory's real path
        rt.live.write({"event": "dir", "dir_real": os.path.realpath(new.dir) if new.dir else None})
    rt.step_budget.layer_steps = new.layer_steps  # for the step tags whose regions are not claimed yet
    if new.fixed_tokens:
        rt.prompt_tokens = new.fixed_tokens
    if new.max_rows != old.max_rows:
        rt.set_register(L.REG_MAX_ROWS, new.max_rows)


def get_config() -> _config.Config:
    """The settings in force."""
    return STATE.config


def init(device: str | torch.device | None = None) -> torch.device | None:
    """Create the arena on `device` now (default: the current CUDA device, else CPU).

    Engines that pick their GPU after importing compiledump call this once, after
    `torch.cuda.set_device`, and before any compile or CUDA graph capture. Without it the arena is
    created on the device of the first captured tensor. A no-op when capture is disabled.
    Returns the arena's device, or None when disabled.
    """
    if not STATE.config.active:
        return None
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = _normalize_device(torch.device(device))
    with STATE.lock:
        rt = STATE.runtime
        if rt is not None:
            if rt.device != device:
                raise RuntimeError(
                    f"compiledump.init({device}): the arena already lives on {rt.device}; "
                    "call init() before the first capture"
                )
            return device
        STATE.device = device
        _create_runtime(device)
    return device


def prepare_kernels(device: str | torch.device | None = None, dtypes=(torch.bfloat16, torch.float16, torch.float32,
                                                                  torch.int64)) -> None:
    """Compile and load the CUDA capture kernels for tensors of `dtypes` on `device` now.

    Not needed when the captured code runs once outside any CUDA graph before it is captured
    (an engine's warm-up under `profiling()` does): the first launch of each dtype and layout
    prepares them. Call it before capturing code whose captures never ran outside a graph; a
    capture that needs an unprepared kernel raises `VariantNotPrepared` instead of failing
    inside CUDA. A no-op without a CUDA device, except in the tests' Triton-on-CPU mode, and
    when the native library serves CUDA captures (COMPILEDUMP_CUDA_KERNEL=native: its kernel is
    compiled ahead of time).
    """
    device = _normalize_device(torch.device(device if device is not None else init() or "cpu"))
    if device.type != "cuda" and _config.env("COMPILEDUMP_CPU_KERNEL") != "triton":
        return
    if device.type == "cuda" and register.native_owns_capture("cuda"):
        return
    from ..ops.triton_kernel import prepare

    prepare(device, dtypes)


def _normalize_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _create_runtime(device: torch.device) -> Runtime:
    rt = Runtime(device, STATE.config, STATE.profiling_depth, STATE.lock, stem=dump_stem(), start=process_fields())
    persist.install_excepthook(_note_exception)
    if rt.live is not None:
        routers.journal_routers(rt.live)  # declared before the arena existed
        mixers.journal_mixers(rt.live)
        parallel.journal_parallel(rt.live)
        rt.live.note_filtered(STATE.filtered_tags)
    for index, value in STATE.pending_registers.items():
        rt.set_register(index, value)
    STATE.pending_registers.clear()
    STATE.runtime = rt
    return rt


def _note_exception(exc_type, exc) -> None:
    """The process is ending with an unhandled exception: the dump written at exit says so (its
    manifest's `ended_by`), so that compare does not read a run cut short as a whole one; the
    crash-proof journal too, for a process that cannot flush."""
    if hasattr(sys, "ps1") or sys.flags.interactive:  # a REPL prints it and goes on
        return
    name, message = getattr(exc_type, "__name__", str(exc_type)), str(exc)[:2000]
    STATE.ended_by = {"exception": name, "message": message}
    persist.note_exception(getattr(STATE.runtime, "live", None), {"type": name, "message": message})


def reset() -> None:
    """Forget every capture, the arena, `set_parallel` groups, `declare_shard` and `declare_router` declarations
    (tests, notebooks). Re-trace compiled functions after this (`torch._dynamo.reset()`): their
    graphs hold the old arena."""
    STATE.reset()


def clear() -> None:
    """Start a new dump in the same arena: forget what was captured (counters, kept values, the
    learned prompt length) but keep the tags and their regions, so compiled code and captured
    CUDA graphs stay valid. The next flush holds only what ran after this. Call it outside
    graphs (between requests, say), with no capture running."""
    rt = STATE.runtime
    if rt is not None:
        with STATE.lock:
            rt.clear()


def register_exit_flush() -> None:
    """Once capture is active: flush at interpreter exit, and on SIGTERM/SIGINT (signals.py)."""
    if STATE.config.active and not STATE.atexit_registered:
        atexit.register(flush_at_exit)
        STATE.atexit_registered = True
    if STATE.config.active:
        signals.install(flush_on_signal, remove_live_files)


# --------------------------------------------------------------------------------------------
# Capture calls (traced by dynamo: keep them free of anything it cannot constant-fold)


def record(tag: str, tensor: torch.Tensor, once: bool = False, *, rows: str | None = None,
           layout: str | None = None) -> None:
    """Store one row of `tensor` (or every row, with `rows="all"`) under `tag` as float32.

    A 3-D tensor is read as `[tokens, hc_mult, dim]` and averaged over hc_mult (fp32
    accumulation) unless `layout="batch_seq_dim"` says it is `[batch, seq, hidden]` (flattened to
    `[batch * seq, hidden]` tokens); a 3-D tensor that does not look like hc_mult is warned about
    once per tag (`layout="tokens_hc_dim"` confirms the reading). A 2-D tensor is `[tokens, dim]`;
    any other rank is stored whole, flattened. `rows` (default `COMPILEDUMP_ROWS`, "one"; "one" with `once`): the
    last row, or the one `set_gather_rows(record=...)` names; "all": every row, stored as
    `[tokens, dim]`. Without `once` the last write wins and the token gate (COMPILEDUMP_TOKENS,
    default auto: the prompt length) skips other token counts (counted); with `once=True` the
    first write wins and the token gate does not apply.
    """
    _record(tag, tensor, once, rows, layout, moe_filtered=True)


def record_unfiltered(tag: str, tensor: torch.Tensor, *, layout: str | None = None) -> None:
    """`record` outside the MoE layer filter: `instrument`'s taps of a layer's attention and of a
    dense MLP, kept at every layer (the filter limits MoE layers' internals; on a dense model it
    left an MLP's bug only the layer's output, diluted by the residual stream, to show)."""
    _record(tag, tensor, False, None, layout, moe_filtered=False)


def _record(tag, tensor, once, rows, layout, moe_filtered: bool) -> None:
    if not STATE.config.active:
        return
    _check_tensor(tensor, "record")
    # COMPILEDUMP_ROWS=all applies to last-write records; an explicit rows="all" with once raises.
    rows = rows or ("one" if once else STATE.config.rows)
    tensor, kind, declared = layouts.record_kind(tag, tensor, once, rows, layout)
    _capture(tag, tensor, kind, moe_filtered, declared)


def record_step(tag: str, tensor: torch.Tensor, *, moe_filtered: bool = False) -> None:
    """Append row 0 of `tensor` (the whole tensor if it has < 2 dims) as `<tag>_<n>`.

    n counts this tag's kept captures from 0. Skipped (counted) while the last `set_rows`
    value exceeds `max_rows`. The row is chosen by `set_gather_rows(step=...)` (default 0: the
    first real request of a padded decode batch). Stored as float32, shape `tensor.shape[1:]`;
    an integer tensor (a step's expert ids) is read back as int32 ids. With `moe_filtered` the
    tag is subject to the MoE layer filter, as `record_ids` is (instrument's per-step routing).
    """
    if not STATE.config.active:
        return
    _check_tensor(tensor, "record_step")
    _capture(tag, tensor, L.KIND_STEP, moe_filtered, False)


def record_ids(tag: str, tensor: torch.Tensor) -> None:
    """Store an integer tensor (e.g. top-k expert ids) whole, as int32; last write wins.

    Token-gated like `record` and subject to the MoE layer filter.
    """
    if not STATE.config.active:
        return
    _check_tensor(tensor, "record_ids")
    if tensor.is_floating_point():
        raise TypeError(f"compiledump.record_ids({tag!r}): expected an integer tensor, got {tensor.dtype}")
    _capture(tag, tensor, L.KIND_IDS, True, False)


def _check_tensor(tensor, call: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compiledump.{call}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_complex():
        raise TypeError(f"compiledump.{call}: complex tensors are not supported ({tensor.dtype})")
    if tensor.numel() == 0:
        raise ValueError(f"compiledump.{call}: empty tensor of shape {tuple(tensor.shape)}")


def _capture(tag: str, tensor: torch.Tensor, kind: int, moe_filtered: bool, layout_declared: bool) -> None:
    slot, reason = _plan(tag, kind, moe_filtered, layout_declared, str(tensor.device))
    if slot < 0:
        return
    rt = STATE.runtime
    if _exporting():
        dispatch.emit_export(rt, slot, kind, reason, tensor)
    elif torch.compiler.is_compiling():
        schemas.capture(tensor, rt.arena, rt.ctrl, slot, kind, reason)
    else:
        dispatch.capture_eager(tensor, rt.arena, rt.ctrl, slot, kind, reason)


def _exporting() -> bool:
    """True while torch.export traces the model.

    Not `torch.compiler.is_exporting()`: Dynamo in torch 2.11 folds that to True under a plain
    torch.compile too (2.13 reads the flag below instead), which would send every compiled
    capture to the export path. The flag torch.export sets while it traces is a module attribute,
    which Dynamo reads (and guards) at trace time and plain Python reads as it is.
    """
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


@torch.compiler.assume_constant_result
def _plan(tag: str, kind: int, moe_filtered: bool, layout_declared: bool, device: str) -> tuple[int, int]:
    """Host decisions for one capture site: (slot, drop reason decided on the host).

    Returns slot -1 when the tag is filtered out (MoE layer filter): no op is emitted at all.
    Pure in its arguments once the registry has seen them (the registry only grows), which is
    what makes it safe for dynamo to treat the result as a constant. Shapes are deliberately
    not arguments: the token gate and the arena region are decided when the op runs, from the
    real tensor, so a dynamic token dim is never guarded or specialized.
    """
    key = (tag, kind, moe_filtered, layout_declared, device)
    plan = STATE.plans.get(key)
    if plan is None:
        with STATE.lock:
            plan = STATE.plans.get(key) or _make_plan(*key)
            STATE.plans[key] = plan
    return plan


def _make_plan(tag, kind, moe_filtered, layout_declared, device):
    if not isinstance(tag, str) or not _TAG_PATTERN.fullmatch(tag):
        raise ValueError(
            f"compiledump: invalid tag {tag!r}: use 1-200 characters from [A-Za-z0-9_.-] "
            "(it becomes an npz key and a file name inside the archive)"
        )
    if moe_filtered and not _wants_moe(tag, STATE.config.moe_layers):
        STATE.filtered_tags[tag] = "moe_layers"
        if (live := getattr(STATE.runtime, "live", None)) is not None:
            live.note_filtered({tag: "moe_layers"})
        return (-1, 0)
    rt = _runtime_or_create(torch.device(device), tag)
    slot = rt.slot_for(tag, kind)
    if layout_declared:
        rt.layout_declared.add(tag)
    if slot.index == 0:
        return (0, L.CNT_TAG_TABLE_FULL)
    return (slot.index, 0)


def _runtime_or_create(device: torch.device, tag: str) -> Runtime:
    rt = STATE.runtime
    if rt is None:
        rt = _create_runtime(STATE.device or _normalize_device(device))
    if rt.device != device:
        raise RuntimeError(
            f"compiledump: tag {tag!r} got a tensor on {device} but the arena lives on {rt.device}; "
            "call compiledump.init(device) with the model's device before the first capture"
        )
    return rt


def moe_filter_keeps(tag: str) -> bool:
    """Whether the MoE layer filter (COMPILEDUMP_MOE_LAYERS) keeps `tag`, as `record` would."""
    return _wants_moe(tag, STATE.config.moe_layers)


def _wants_moe(tag: str, moe_layers: int) -> bool:
    """The MoE layer filter: tags `layer<N>_<x>` are kept only for N < moe_layers (a bare
    `layer<N>` always)."""
    layer = spec.layer_of(tag)
    return layer is None or "_" not in tag or layer < moe_layers


if STATE.config.active:
    register_exit_flush()
