"""Capture runtime: the public capture calls, the device arena and the tag registry.

What happens where, and why:

- `record*` run as ordinary Python in eager mode and are traced by dynamo under torch.compile.
  Everything they decide on the host is fixed per call site and shape (is capture on, token
  gate, which slot and arena region a tag owns), so a compiled graph contains exactly one
  `compiledump::capture_v1` call per capture point, with constant integer arguments.
- The tag registry lives in `_plan`, marked `assume_constant_result`: dynamo calls it once per
  call site while tracing and bakes the returned integers into the graph, instead of tracing
  (and guarding on) the registry dict. It also creates the arena on first use, so the first
  capture may happen while tracing.
- Everything that can change between two runs of one graph (profiling suspension, rows gate,
  step counters, keep-first flags, the row to gather) lives in the control block on the device
  and is read by the kernel. The host only ever writes it through small kernels, outside any
  graph, and reads it in `flush()`.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from . import arena as _arena
from . import config as _config
from . import layout as L
from . import ops, writer
from . import parallel as _parallel
from . import signals as _signals
from .arena import Runtime

_TAG_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


@dataclass
class _State:
    config: _config.Config
    device: torch.device | None = None  # set by init(); else the first capture's device
    profiling_depth: int = 0
    pending_registers: dict[int, int] = field(default_factory=dict)  # set before the arena exists
    plans: dict = field(default_factory=dict)  # _plan's memo: eager calls skip the registry work
    filtered_tags: dict[str, str] = field(default_factory=dict)
    warned: set = field(default_factory=set)
    atexit_registered: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State(config=_config.from_env())


# --------------------------------------------------------------------------------------------
# Configuration and lifecycle


def configure(**settings) -> _config.Config:
    """Change settings (the same names as `Config`'s fields); return the new config.

    `configure(dir="dumps")` enables capture from Python instead of `COMPILEDUMP_DIR`. Capacity
    settings (`max_steps`, `arena_mb`, `max_tags`) size the device allocations and cannot change
    once the arena exists. Compiled functions that captured under the old settings recompile.
    """
    unknown = set(settings) - {f.name for f in _config.dataclasses.fields(_config.Config)}
    if unknown:
        raise TypeError(f"compiledump.configure: unknown setting(s) {sorted(unknown)}")
    new = _config.dataclasses.replace(_STATE.config, **settings)
    rt = _arena.ACTIVE
    if rt is not None:
        changed = {f for f in _config.CAPACITY_FIELDS if getattr(new, f) != getattr(rt.config, f)}
        if changed:
            raise RuntimeError(
                f"compiledump.configure: {sorted(changed)} cannot change after the arena was created"
            )
        rt.config = new
        if new.max_rows != _STATE.config.max_rows:
            rt.set_register(L.REG_MAX_ROWS, new.max_rows)
    _STATE.config = new
    _STATE.plans.clear()
    _register_atexit()
    return new


def get_config() -> _config.Config:
    """The settings in force."""
    return _STATE.config


def init(device: str | torch.device | None = None) -> torch.device | None:
    """Create the arena on `device` now (default: the current CUDA device, else CPU).

    Engines that pick their GPU after importing compiledump call this once, after
    `torch.cuda.set_device`, and before any compile or CUDA graph capture. Without it the arena is
    created on the device of the first captured tensor. A no-op when capture is disabled.
    Returns the arena's device, or None when disabled.
    """
    if not _STATE.config.active:
        return None
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = _normalize_device(torch.device(device))
    with _STATE.lock:
        rt = _arena.ACTIVE
        if rt is not None:
            if rt.device != device:
                raise RuntimeError(
                    f"compiledump.init({device}): the arena already lives on {rt.device}; "
                    "call init() before the first capture"
                )
            return device
        _STATE.device = device
        _create_runtime(device)
    return device


def _normalize_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _create_runtime(device: torch.device) -> Runtime:
    rt = Runtime(device, _STATE.config, _STATE.profiling_depth)
    for index, value in _STATE.pending_registers.items():
        rt.set_register(index, value)
    _STATE.pending_registers.clear()
    _arena.ACTIVE = rt
    return rt


def reset() -> None:
    """Forget every capture, the arena, `set_parallel` groups and `declare_shard` declarations
    (tests, notebooks). Re-trace compiled functions after this (`torch._dynamo.reset()`): their
    graphs hold the old arena."""
    global _STATE
    old = _STATE
    _STATE = _State(config=old.config, atexit_registered=old.atexit_registered)
    _arena.ACTIVE = None
    _parallel.clear()


def _register_atexit() -> None:
    """Once capture is active: flush at interpreter exit, and on SIGTERM/SIGINT (signals.py)."""
    if _STATE.config.active and not _STATE.atexit_registered:
        atexit.register(_flush_at_exit)
        _STATE.atexit_registered = True
    if _STATE.config.active:
        _signals.install(_flush_on_signal)


def _flush_at_exit() -> None:
    try:
        flush()
    except Exception as error:  # noqa: BLE001 - never turn interpreter exit into a traceback storm
        print(f"[compiledump] flush at exit failed: {error!r}", flush=True)


def _flush_on_signal() -> None:
    # On the main thread, possibly inside a capture or a flush of that same thread.
    path = _flush(wait_for_captures=False)
    if path is not None:
        print(f"[compiledump] flushed {path} on signal", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Host-side state the kernels read


def enabled() -> bool:
    """True when capture is configured and not suspended by `profiling()`."""
    return _STATE.config.active and _STATE.profiling_depth == 0


def _write_register(index: int, value: int) -> None:
    rt = _arena.ACTIVE
    if rt is None:
        _STATE.pending_registers[index] = value
    else:
        rt.set_register(index, value)


class profiling:
    """Suspend every capture while an engine runs its dummy/profile or graph-capture forwards.

    Works inside compiled and CUDA-graph-captured code: it clears a device flag that every
    capture kernel reads, so graphs recorded now replay correctly later. Nestable. Enter and
    exit it outside graph capture.
    """

    def __enter__(self) -> "profiling":
        _STATE.profiling_depth += 1
        if _STATE.profiling_depth == 1:
            _write_register(L.REG_ENABLED, 0)
        return self

    def __exit__(self, *_exc: object) -> None:
        _STATE.profiling_depth -= 1
        if _STATE.profiling_depth == 0:
            _write_register(L.REG_ENABLED, 1)


def set_rows(rows: int) -> None:
    """Tell the dump how many rows the sampler just produced; `record_step` is skipped while
    this exceeds `max_rows` (warm-up batches). Call it outside graphs, or inside with a value
    fixed by the graph's shape."""
    if not _STATE.config.active:
        return
    rt = _arena.ACTIVE
    if rt is None:
        _STATE.pending_registers[L.REG_ROWS] = rows
    else:
        ops.set_register(rt.ctrl, L.REG_ROWS, rows)


def set_gather_rows(*, record: int | None = None, step: int | None = None) -> None:
    """Choose which row `record` and `record_step` keep (defaults: record -1 = last, step 0).

    For padded batches: e.g. a captured prefill whose real last token is not the last row.
    Negative values count from the end. The kernels read these at run time, so set them outside
    graphs and replay: no recompilation, no re-capture.
    """
    if not _STATE.config.active:
        return
    if record is not None:
        _write_register(L.REG_RECORD_ROW, int(record))
    if step is not None:
        _write_register(L.REG_STEP_ROW, int(step))


# --------------------------------------------------------------------------------------------
# Capture calls (traced by dynamo: keep them free of anything it cannot constant-fold)


def record(tag: str, tensor: torch.Tensor, once: bool = False) -> None:
    """Store the last row of `tensor` under `tag` as float32.

    A 3-D tensor is `[tokens, hc_mult, dim]` and is averaged over hc_mult (fp32 accumulation);
    a 2-D tensor keeps one row; any other rank is stored whole, flattened. The row is the last
    one unless `set_gather_rows(record=...)` says otherwise. Without `once` the last write wins
    and, if `COMPILEDUMP_TOKENS` is set, tensors whose `shape[0]` differs are skipped (counted).
    With `once=True` the first write wins and the token gate does not apply.
    """
    if not _STATE.config.active:
        return
    _check_tensor(tensor, "record")
    _capture(tag, tensor, L.KIND_RECORD_ONCE if once else L.KIND_RECORD, True)


def record_step(tag: str, tensor: torch.Tensor) -> None:
    """Append row 0 of `tensor` (the whole tensor if it has < 2 dims) as `<tag>_<n>`.

    n counts this tag's kept captures from 0. Skipped (counted) while the last `set_rows`
    value exceeds `max_rows`. The row is chosen by `set_gather_rows(step=...)` (default 0: the
    first real request of a padded decode batch). Stored as float32, shape `tensor.shape[1:]`.
    """
    if not _STATE.config.active:
        return
    _check_tensor(tensor, "record_step")
    _capture(tag, tensor, L.KIND_STEP, False)


def record_ids(tag: str, tensor: torch.Tensor) -> None:
    """Store an integer tensor (e.g. top-k expert ids) whole, as int32; last write wins.

    Token-gated like `record` and subject to the MoE layer filter.
    """
    if not _STATE.config.active:
        return
    _check_tensor(tensor, "record_ids")
    if tensor.is_floating_point():
        raise TypeError(f"compiledump.record_ids({tag!r}): expected an integer tensor, got {tensor.dtype}")
    _capture(tag, tensor, L.KIND_IDS, True)


def _check_tensor(tensor, call: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compiledump.{call}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_complex():
        raise TypeError(f"compiledump.{call}: complex tensors are not supported ({tensor.dtype})")
    if tensor.numel() == 0:
        raise ValueError(f"compiledump.{call}: empty tensor of shape {tuple(tensor.shape)}")


def _capture(tag: str, tensor: torch.Tensor, kind: int, moe_filtered: bool) -> None:
    slot, reason = _plan(tag, kind, moe_filtered, str(tensor.device))
    if slot < 0:
        return
    rt = _arena.ACTIVE
    if torch.compiler.is_exporting():
        from . import aot

        aot.emit_capture(rt, slot, kind, reason, tensor)
    elif torch.compiler.is_compiling():
        ops.capture(tensor, rt.arena, rt.ctrl, slot, kind, reason)
    else:
        ops.capture_eager(tensor, rt.arena, rt.ctrl, slot, kind, reason)


@torch.compiler.assume_constant_result
def _plan(tag: str, kind: int, moe_filtered: bool, device: str) -> tuple[int, int]:
    """Host decisions for one capture site: (slot, drop reason decided on the host).

    Returns slot -1 when the tag is filtered out (MoE layer filter): no op is emitted at all.
    Pure in its arguments once the registry has seen them (the registry only grows), which is
    what makes it safe for dynamo to treat the result as a constant. Shapes are deliberately
    not arguments: the token gate and the arena region are decided when the op runs, from the
    real tensor, so a dynamic token dim is never guarded or specialized.
    """
    key = (tag, kind, moe_filtered, device)
    plan = _STATE.plans.get(key)
    if plan is None:
        with _STATE.lock:
            plan = _STATE.plans.get(key) or _make_plan(*key)
            _STATE.plans[key] = plan
    return plan


def _make_plan(tag, kind, moe_filtered, device):
    if not isinstance(tag, str) or not _TAG_PATTERN.fullmatch(tag):
        raise ValueError(
            f"compiledump: invalid tag {tag!r}: use 1-200 characters from [A-Za-z0-9_.-] "
            "(it becomes an npz key and a file name inside the archive)"
        )
    if moe_filtered and not _wants_moe(tag, _STATE.config.moe_layers):
        _STATE.filtered_tags[tag] = "moe_layers"
        return (-1, 0)
    slot = _runtime_for(torch.device(device), tag).slot_for(tag, kind)
    if slot.index == 0:
        return (0, L.CNT_TAG_TABLE_FULL)
    return (slot.index, 0)


def _runtime_for(device: torch.device, tag: str) -> Runtime:
    rt = _arena.ACTIVE
    if rt is None:
        rt = _create_runtime(_STATE.device or _normalize_device(device))
    if rt.device != device:
        raise RuntimeError(
            f"compiledump: tag {tag!r} got a tensor on {device} but the arena lives on {rt.device}; "
            "call compiledump.init(device) with the model's device before the first capture"
        )
    return rt


def _wants_moe(tag: str, moe_layers: int) -> bool:
    """The seed's filter: tags `layer<N>_<x>` are kept only for N < moe_layers."""
    if "_" not in tag:
        return True
    head = tag.split("_", 1)[0]
    if not head.startswith("layer"):
        return True
    try:
        return int(head[5:]) < moe_layers
    except ValueError:
        return True


# --------------------------------------------------------------------------------------------
# Flush


def _rank() -> str:
    """`RANK`, else the torch.distributed rank (remembered once seen, so that a flush at exit
    after `destroy_process_group()` keeps the file name), else `x`."""
    rank = os.getenv("RANK")
    if rank:
        return rank
    dist_rank, _ = _parallel.observe_distributed()
    return str(dist_rank) if dist_rank is not None else "x"


def _world_size() -> int | None:
    _, world = _parallel.observe_distributed()
    if world is not None:
        return world
    world = os.getenv("WORLD_SIZE")
    return int(world) if world and world.isdigit() else None


def dump_stem() -> str:
    """File stem of this process's dump: `compiledump_rank<R>_pid<P>`."""
    return f"compiledump_rank{_rank()}_pid{os.getpid()}"


# One flush at a time, so that the npz and the manifest on disk always come from one snapshot.
# Reentrant: a signal handler may flush on the main thread while that thread is flushing.
_FLUSH_LOCK = threading.RLock()


def flush() -> str | None:
    """Write everything captured so far; return the npz path, or None if nothing was captured.

    One device-to-host copy of the used arena and the control block, then slicing on the host.
    The files are rewritten whole on every flush (the dump is cumulative: flushing again after
    more captures writes a superset; flushing twice with nothing new writes the same content),
    atomically (temporary file + rename, npz first). Callable from any thread: concurrent
    flushes are serialized, and a capture running in another thread at the same moment lands in
    this flush or the next. Also runs at interpreter exit and on SIGTERM/SIGINT.
    """
    return _flush(wait_for_captures=True)


def _flush(wait_for_captures: bool) -> str | None:
    # From a signal handler (wait_for_captures=False) the interrupted frame may hold _STATE.lock
    # (a capture planning a new tag) or the flush lock of a flush in another thread that waits
    # for _STATE.lock: never block on either. The registry is then read from copies of its dicts,
    # which the GIL makes atomic; a tag being registered at that moment has captured nothing yet.
    got_flush_lock = _FLUSH_LOCK.acquire(timeout=-1 if wait_for_captures else 5.0)
    try:
        st = _STATE
        rt = _arena.ACTIVE
        if not st.config.active or rt is None or not rt.slots:
            return None
        locked = st.lock.acquire(blocking=wait_for_captures)
        # CPU captures run on the calling thread: the kernel lock keeps a capture of another
        # thread from being half-written in the snapshot. (CUDA: the snapshot synchronizes.)
        cpu_lock = ops.CPU_LOCK if rt.device.type == "cpu" else None
        cpu_locked = cpu_lock is not None and cpu_lock.acquire(blocking=wait_for_captures)
        try:
            arena, ctrl = rt.snapshot()
            arrays, manifest = _collect(rt, arena, ctrl)
        finally:
            if cpu_locked:
                cpu_lock.release()
            if locked:
                st.lock.release()
        _warn_drops(manifest)
        path = writer.write_dump(st.config.dir, dump_stem(), arrays, manifest)
        return str(path)
    finally:
        if got_flush_lock:
            _FLUSH_LOCK.release()


def _collect(rt: Runtime, arena: np.ndarray, ctrl: np.ndarray) -> tuple[dict, dict]:
    arrays: dict[str, np.ndarray] = {}
    keys: dict[str, dict] = {}
    tags: dict[str, dict] = {}
    totals: dict[str, int] = {}
    for slot in sorted(list(rt.slots.values()), key=lambda s: s.order):
        base = L.slot_base(slot.index)
        counts = ctrl[base : base + L.SLOT_WORDS].astype(np.int64)
        if slot.index == 0:
            continue  # shared overflow slot: reported once below
        written = int(counts[L.CNT_WRITTEN])
        drops = {name: int(counts[c]) for c, name in L.DROP_REASONS.items() if counts[c]}
        kept = 0
        if slot.offset >= 0 and written:
            kept = min(written, slot.capacity)
            if slot.kind == L.KIND_STEP and written > slot.capacity:
                drops["step_capacity"] = written - slot.capacity
            # Views of the snapshot, which is this flush's private host copy: no per-key copies.
            region = arena[slot.offset : slot.offset + slot.words * kept]
            if slot.kind == L.KIND_IDS:
                region = region.view(np.int32)
            meta = {
                "tag": slot.tag,
                "kind": L.KIND_NAMES[slot.kind],
                "step": None,
                "order": slot.order,
                "source_dtype": slot.source_dtype,
                "source_shape": slot.source_shape,
                "dtype": str(region.dtype),
                "shape": list(slot.payload_shape),
            }
            steps = region.reshape(kept, *slot.payload_shape)
            for n in range(kept):
                is_step = slot.kind == L.KIND_STEP
                key = f"{slot.tag}_{n}" if is_step else slot.tag
                keys[key] = {**meta, "step": n} if is_step else meta
                arrays[key] = steps[n]
        tags[f"{slot.tag}_<n>" if slot.kind == L.KIND_STEP else slot.tag] = {
            "tag": slot.tag,
            "kind": L.KIND_NAMES[slot.kind],
            "order": slot.order,
            "calls": int(counts.sum()),
            "passed": written,
            "kept": kept,
            "drops": drops,
        }
        for name, count in drops.items():
            totals[name] = totals.get(name, 0) + count
    if rt.overflow_tags:
        # Tags past the table share slot 0: their calls are counted there, tag_table_full or,
        # inside profiling(), suspended; only the totals can report them.
        shared = ctrl[L.slot_base(0) : L.slot_base(0) + L.SLOT_WORDS].astype(np.int64)
        for counter, name in L.DROP_REASONS.items():
            if shared[counter]:
                totals[name] = totals.get(name, 0) + int(shared[counter])
        for tag in list(rt.overflow_tags):
            tags[tag] = {"tag": tag, "kind": None, "order": None, "calls": None, "passed": 0,
                         "kept": 0, "drops": {"tag_table_full": None}}
    manifest = {
        "format": "compiledump-dump",
        "format_version": 1,
        "compiledump_version": _version(),
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        "rank": _rank(),
        "pid": os.getpid(),
        "world_size": _world_size(),
        "device": str(rt.device),
        "config": _config.dataclasses.asdict(rt.config),
        "keys": keys,
        "tags": tags,
        "drops": totals,
        "filtered_tags": dict(_STATE.filtered_tags),
        "arena_words_used": rt.used_words,
        "parallel": _parallel.manifest_fields(keys, _warn_once),
    }
    return arrays, manifest


def _warn_once(message: str) -> None:
    if ("*", message) not in _STATE.warned:
        _STATE.warned.add(("*", message))
        warnings.warn(f"compiledump: {message}", RuntimeWarning, stacklevel=4)


def _version() -> str:
    from . import __version__

    return __version__


def _warn_drops(manifest: dict) -> None:
    """One warning per tag and reason for captures that were lost, one line for the filters."""
    deliberate: dict[str, int] = {}
    for name, info in manifest["tags"].items():
        for reason, count in info["drops"].items():
            if reason in L.DELIBERATE_REASONS:
                deliberate[reason] = deliberate.get(reason, 0) + count
                continue
            if (name, reason) in _STATE.warned:
                continue
            _STATE.warned.add((name, reason))
            how_many = f"{count} capture(s)" if count is not None else "all captures"
            warnings.warn(
                f"compiledump: tag {info['tag']!r}: {how_many} dropped ({reason}); "
                "see the manifest's 'drops'",
                RuntimeWarning,
                stacklevel=3,
            )
    if deliberate and ("*", "filters") not in _STATE.warned:
        _STATE.warned.add(("*", "filters"))
        summary = ", ".join(f"{reason}: {count}" for reason, count in sorted(deliberate.items()))
        warnings.warn(f"compiledump: captures skipped by filters ({summary})", RuntimeWarning, stacklevel=3)


if _STATE.config.active:
    _register_atexit()
