"""The device arena, the control block and the tag registry of one process.

`Runtime` owns two preallocated device tensors (separate allocations, marked static so CUDA
graph trees accept graphs that mutate them) and the host-side registry that maps tags to slots
and arena regions. A tag gets its slot when a capture site is planned (eager call or dynamo
trace) and its arena region when its first capture actually runs (`resolve`), from the real
tensor's shape: that keeps symbolic (dynamic) sizes out of the compiled graph's arguments.
With crash-proof capture (capture/persist.py) the two tensors are mapped files, and every change
of the registry a reader needs is journaled before a capture depends on it.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .. import config as _config
from ..format import spec
from ..ops import layout as L
from ..ops import register, schemas, variants
from ..ops.geometry import TOKEN_GATED_KINDS, payload_shape, token_gated
from . import layouts, persist
from .collect import Slot
from .step_budget import StepBudget
from .state import warn_once


class Runtime:
    """The device state of one process: arena, control block and the tag registry."""

    def __init__(self, device: torch.device, cfg: _config.Config, profiling_depth: int, lock: threading.Lock,
                 stem: str = "compiledump", start: dict | None = None):
        """`stem` names the crash-proof files (`<dir>/<stem>.live/`, capture/persist.py) and
        `start` is what their journal says of the process (rank, versions)."""
        if variants.stream_capturing(device):
            raise RuntimeError(
                "compiledump: the arena cannot be created during CUDA graph capture; call "
                "compiledump.init(device) (or run one eager step) before capturing"
            )
        self.device = device
        self._config = cfg  # `config` is a property: its setter pushes the token gate (below)
        # The native library's region table serves the arena's captures when it owns `capture_v1`
        # for its device (kernels/capture_table.cpp; on CUDA only with COMPILEDUMP_CUDA_KERNEL=
        # native); every decision it needs is pushed to it from here. Bound to this arena
        # (dropping the last one's regions) whenever the library owns the op; no region is pushed
        # (every call decided by Python) when tests run the Triton kernel on CPU.
        self.table_bound = register.native_owns_capture(device.type)
        self.native_table = self.table_bound and not (device.type == "cpu" and register.use_triton_on_cpu())
        self.live: persist.LiveFiles | None = None
        # The file stem, control block and declarations the last flush wrote (into flushed_dir),
        # None since a clear(): capture/flush.py's exit flush does not rewrite a dump nothing was
        # captured into since (one moved away stays away), nor write an empty one after a clear()
        # that followed a dump of this runtime's.
        self.flushed_ctrl: tuple[str, bytes, str] | None = None
        self.flushed_dir: str | None = None  # None until this runtime wrote a dump
        self.cleared_since_dump = False
        # Plain (non-inference) tensors even if the first capture runs under inference_mode:
        # the host must be able to update them later outside it.
        with torch.inference_mode(False), torch.no_grad():
            # Not for an arena created while a fake mode is active (a program exported without
            # compiledump.aot: its tensors are fake, and an error follows).
            if cfg.dir and cfg.persists(device) and not _fake_mode_active():
                self.live = persist.open_live(cfg.dir, stem, device, cfg.arena_words, L.control_words(cfg.max_tags),
                                              {**(start or {}), "capture_path": self.capture_path,
                                               "config": _config.settings(cfg)})
            if self.live is not None:
                self.arena, self.ctrl = self.live.arena, self.live.ctrl
            else:
                # CPU: zeroed, so every page is touched once here and never faults inside a step.
                alloc = torch.zeros if device.type == "cpu" else torch.empty
                self.arena = alloc(cfg.arena_words, dtype=torch.float32, device=device)
                self.ctrl = torch.zeros(L.control_words(cfg.max_tags), dtype=torch.int32, device=device)
            # fill_ with a host scalar is a kernel argument, not a host-to-device copy.
            self.ctrl[L.REG_ENABLED].fill_(0 if profiling_depth else 1)
            self.ctrl[L.REG_MAX_ROWS].fill_(cfg.max_rows)
            self.ctrl[L.REG_RECORD_ROW].fill_(-1)
            self.ctrl[L.REG_STEP_ROW].fill_(0)
            self.ctrl[L.REG_CHECK_ALL].fill_(int(cfg.nonfinite == "all"))
        # Static addresses: CUDA graph trees may then replay graphs that mutate them.
        torch._dynamo.mark_static_address(self.arena)
        torch._dynamo.mark_static_address(self.ctrl)
        self.slots: dict[tuple[str, bool], Slot] = {}  # (tag, is_step) -> slot
        self.by_index: dict[int, Slot] = {}
        self.lock = lock  # the registry lock (capture/state.py)
        self.next_slot = 1  # slot 0 collects captures of tags that found the table full
        self.used_words = 0
        self.step_budget = StepBudget(cfg.max_steps, cfg.layer_steps, cfg.arena_words, cfg.arena_mb)
        self.overflow_tags: list[str] = []
        self.layout_declared: set[str] = set()  # tags whose call site said how to read a 3-D tensor
        self.host_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.host_enabled = not profiling_depth  # the host's copy of REG_ENABLED
        # The prompt length of the token gate: fixed by COMPILEDUMP_TOKENS, else learned from the
        # first capture outside profiling() (also with the gate off: it labels the dump's phases).
        self._prompt_tokens: int | None = cfg.fixed_tokens or None
        if self._prompt_tokens is not None:
            self._journal({"event": "prompt", "tokens": self._prompt_tokens})
        if self.table_bound:
            self._push_gate(bind=True)

    @property
    def capture_path(self) -> str:
        """What ran this arena's captures (the manifest's `capture_path`): "native" (the native
        library's region table and its CPU or CUDA kernel: no Python per call), "python"
        (Python's registry, then the reference kernel or the native kernel) or "triton" (CUDA
        unless COMPILEDUMP_CUDA_KERNEL=native, or CPU tensors under COMPILEDUMP_CPU_KERNEL=triton)."""
        if self.native_table:
            return "native"
        if self.device.type == "cuda" or register.use_triton_on_cpu():
            return "triton"
        return "python"

    # The token gate's inputs (`config.tokens`, `prompt_tokens`) are properties so that every
    # change reaches the native table.
    @property
    def config(self) -> _config.Config:
        return self._config

    @config.setter
    def config(self, cfg: _config.Config) -> None:
        if cfg.nonfinite != self._config.nonfinite:
            self.set_register(L.REG_CHECK_ALL, int(cfg.nonfinite == "all"))
        self._config = cfg
        self._push_gate()
        self._journal({"event": "config", "config": _config.settings(cfg)})

    @property
    def prompt_tokens(self) -> int | None:
        return self._prompt_tokens

    @prompt_tokens.setter
    def prompt_tokens(self, tokens: int | None) -> None:
        changed = tokens != self._prompt_tokens
        self._prompt_tokens = tokens
        self._push_gate()
        if changed:
            self._journal({"event": "prompt", "tokens": tokens})

    def _journal(self, event: dict) -> None:
        # A registry change recover needs, in the crash-proof journal (nothing without one).
        if self.live is not None:
            self.live.write(event)

    def _push_gate(self, bind: bool = False) -> None:
        if self.table_bound:
            prompt = -1 if self._prompt_tokens is None else self._prompt_tokens
            schemas.table_gate(self.ctrl, prompt, bool(self._config.tokens), bind)

    def _push_region(self, slot: Slot) -> None:
        # A 3-D record that may still need its layout warning stays with Python for doubtful shapes.
        check_layout = (slot.kind in (L.KIND_RECORD, L.KIND_RECORD_ONCE) and slot.tag not in self.layout_declared
                        and not layouts.warned(slot.tag))
        schemas.table_region(self.ctrl, slot.index, slot.kind, slot.offset, slot.capacity,
                             list(slot.payload_shape), check_layout)

    def set_register(self, index: int, value: int) -> None:
        """Host write of one register: a one-word fill kernel, never a copy or a sync."""
        with torch.inference_mode(False), torch.no_grad():
            self.ctrl[index].fill_(value)
        if index == L.REG_ENABLED:
            self.host_enabled = bool(value)

    def clear(self) -> None:
        """Zero every slot's counters and kept-token word (a fill kernel, no sync) and forget a
        learned prompt length; the tags, regions and registers stay, so graphs remain valid."""
        with torch.inference_mode(False), torch.no_grad():
            self.ctrl[L.HEADER_WORDS :].zero_()
            self.ctrl[L.REG_STEPS].fill_(0)
        self.prompt_tokens = self.config.fixed_tokens or None
        self.flushed_ctrl = None
        self.cleared_since_dump = self.flushed_dir is not None
        self._journal({"event": "clear"})  # recover: a control block equal to a flushed one is not that flush's

    def slot_for(self, tag: str, kind: int) -> Slot:
        """The tag's slot, created on first sight; raises on a tag/kind conflict."""
        is_step = kind == L.KIND_STEP
        slot = self.slots.get((tag, is_step))
        if slot is not None:
            if slot.kind != kind:
                raise ValueError(
                    f"compiledump: tag {tag!r} was first captured with "
                    f"{_CALL_NAMES[slot.kind]} and now with {_CALL_NAMES[kind]}; use separate tags"
                )
            return slot
        self._check_key_collision(tag, is_step)
        index = self.next_slot
        if index > self.config.max_tags:
            index = 0
            self.overflow_tags.append(tag)
        else:
            self.next_slot += 1
        slot = Slot(tag=tag, kind=kind, index=index, order=len(self.slots))
        self._journal(persist.slot_event(slot))
        self.slots[(tag, is_step)] = slot
        self.by_index.setdefault(index, slot)
        return slot

    def _check_key_collision(self, tag: str, is_step: bool) -> None:
        # `record_step("x")` writes keys x_0, x_1, ...; a plain tag "x_3" would collide.
        if is_step:
            clash = [t for (t, step), _ in self.slots.items() if not step and _step_prefix(t) == tag]
        else:
            prefix = _step_prefix(tag)
            clash = [prefix] if prefix is not None and (prefix, True) in self.slots else []
        if clash:
            raise ValueError(
                f"compiledump: tag {tag!r} collides with the step keys of {clash[0]!r}; rename one"
            )

    def resolve(self, index: int, kind: int, x: torch.Tensor, reason: int) -> tuple[int, int, int, int]:
        """Kernel arguments for one capture: (ctrl base, arena offset, capacity, drop reason).

        Runs in the op's implementation, on the real tensor: the first capture of a tag that
        passes the host-side gates (token gate, tag table, not inside `profiling()` unless a
        CUDA graph is being captured) fixes its payload shape and claims its arena region; a
        later capture of another shape is counted as `shape_changed`. Host metadata only: no
        device access.
        """
        slot = self.by_index.get(index)
        if slot is None:
            raise RuntimeError(
                f"compiledump: unknown slot {index}: the graph was traced against an arena that was "
                "reset; re-trace compiled functions (torch._dynamo.reset())"
            )
        if reason or index == 0:
            return L.slot_base(index), -1, 0, reason
        if self.token_gated(x, kind, slot.tag):
            # Shape-derived, so fixed for a captured graph: decided here rather than while
            # tracing, where comparing a dynamic token dim would specialize the graph on it.
            return L.slot_base(index), -1, 0, L.CNT_TOKEN_GATE
        payload = payload_shape(tuple(x.shape), kind)
        if slot.payload_shape is None:
            if not self.host_enabled and not variants.stream_capturing(x.device):
                # Suspended (an engine's profile run): don't let its dummy shapes claim the
                # region; the kernel counts the call as suspended. During graph capture the
                # region must be claimed now: the replays that follow cannot change it.
                return L.slot_base(index), -1, 0, L.CNT_SUSPENDED
            with self.lock:
                if slot.payload_shape is None:
                    self._allocate(slot, payload, x)
        if x.dim() == 3 and kind in (L.KIND_RECORD, L.KIND_RECORD_ONCE) and slot.tag not in self.layout_declared \
                and slot.payload_shape == payload and slot.offset >= 0:
            layouts.check_hc_reading(slot.tag, tuple(x.shape), self.prompt_tokens)
        if self.native_table:
            self._push_region(slot)  # later calls of this tag are decided in C++
        if slot.payload_shape != payload:
            return L.slot_base(index), -1, 0, L.CNT_SHAPE_CHANGED
        if slot.offset < 0:
            return L.slot_base(index), -1, 0, L.CNT_ARENA_FULL
        return L.slot_base(index), slot.offset, slot.capacity, 0

    def token_gated(self, x: torch.Tensor, kind: int, tag: str) -> bool:
        """True when the token gate skips this capture: a gated kind whose `shape[0]` is not the
        prompt length. With COMPILEDUMP_TOKENS=auto the first capture of a gated kind outside
        profiling() (and outside CUDA graph capture, whose inputs are dummies) names the prompt
        length, unless it is a 3-D record whose first dim may not be tokens (capture/layouts.py);
        a graph captured before that records its captures ungated."""
        if kind not in TOKEN_GATED_KINDS or x.dim() == 0:
            return False
        tokens = x.shape[0]
        if self.prompt_tokens is None and self.host_enabled and not variants.stream_capturing(x.device) and not (
                x.dim() == 3 and kind == L.KIND_RECORD and tag not in self.layout_declared
                and layouts.doubtful_hc_reading(tuple(x.shape), None)):
            self.prompt_tokens = tokens
        # COMPILEDUMP_TOKENS=0 (or no prompt length yet): the gate is off
        return token_gated(x.shape, kind, (self.prompt_tokens or 0) if self.config.tokens else 0)

    def place(self, index: int, kind: int, x: torch.Tensor) -> tuple[int, list, int]:
        """Claim the tag's region while a program is exported: (offset, payload shape, capacity).

        `x` is the traced tensor, whose dimensions may be symbolic. Unlike `resolve`, a capture
        that the token gate would skip claims the region too (the program has no later chance):
        with COMPILEDUMP_TOKENS set to a number, a gated kind's token dim is sized by it, the only
        size such a capture keeps (`auto` cannot learn a prompt length while exporting: exported
        programs gate only on a number). Any other dynamic dimension of a stored payload is an error.
        """
        slot = self.by_index[index]
        shape = list(x.shape)
        if self.config.fixed_tokens and kind in TOKEN_GATED_KINDS and shape:
            shape[0] = self.config.fixed_tokens
        payload = payload_shape(tuple(shape), kind)
        if not all(isinstance(d, int) for d in payload):
            raise ValueError(
                f"compiledump: tag {slot.tag!r} would store a payload of dynamic shape {payload} in an "
                "exported program; capture a tensor whose stored dims are static (or set "
                "COMPILEDUMP_TOKENS for record_ids of a dynamic token dim)"
            )
        if slot.payload_shape is None:
            with self.lock:
                if slot.payload_shape is None:
                    # A dimension left dynamic in the program has no single size: None.
                    self._allocate(slot, payload, x, [d if isinstance(d, int) else None for d in shape])
        return slot.offset, list(slot.payload_shape), slot.capacity

    def _allocate(self, slot: Slot, payload: tuple, x: torch.Tensor, source_shape: list | None = None) -> None:
        capacity = 1
        if slot.kind == L.KIND_STEP:  # (a layer's step states keep fewer: capture/step_budget.py)
            capacity, slot.overflow = self.step_budget.capacity(slot.tag, math.prod(payload))
        words = math.prod(payload) * capacity
        start = -(-self.used_words // L.REGION_ALIGN_WORDS) * L.REGION_ALIGN_WORDS
        slot.source_dtype = str(x.dtype).removeprefix("torch.")
        slot.source_shape = list(x.shape) if source_shape is None else source_shape
        slot.capacity = capacity
        capped = slot.tag == spec.INPUT_EMBEDS_TAG and words > self.arena.numel() // 8  # (spec.py)
        if start + words <= self.arena.numel() and not capped:
            slot.offset = start
            self.used_words = start + words
        if self.live is not None:
            if slot.offset >= 0 and words:  # (a region of no steps: nothing to place, step_budget.py)
                try:
                    self.live.touch(start, words)
                except OSError as error:  # the disk is full: the tag gets no region (arena_full)
                    self.used_words = start
                    slot.offset = -1
                    warn_once(f"no disk space for tag {slot.tag!r}'s region in {self.live.path} "
                              f"({error.strerror}): its captures are counted as arena_full")
            # Journaled before the kernel stores anything in the region: recover can read it.
            self.live.write(persist.region_event(slot, payload))
        # Set last: another thread may read payload_shape without the lock.
        slot.payload_shape = payload

    def snapshot(self, private: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One device-to-host copy each of the control block and the used arena: (arena, ctrl).

        Everything issued before the flush has finished (the device is synchronized first). For
        replays another thread issues meanwhile, the control block is copied first, then the
        arena: a capture counted in the copied control block claimed its counter before that
        copy and writes its payload right after, so it has almost always landed when the arena
        copy starts; copying the arena first would count every capture claimed between the two
        copies without its payload. (Flush with no replay running for an exact dump.)

        CPU: the two clones are the snapshot. CUDA: everything runs on the arena's device (its
        stream, its event), whatever the calling thread's current device is, into pinned host
        buffers kept by the runtime; the arrays returned are numpy views of those buffers, with
        no further host copy, valid until the next snapshot: the caller must hold the flush lock
        (STATE.flush_lock) until it is done with them. `private=True` copies into fresh buffers
        instead, for a flush that cannot own the shared ones (a signal handler's flush nested in
        an interrupted flush, or one that could not take the flush lock).
        """
        arena = self.arena[: self.used_words]
        ctrl = self.ctrl
        if self.device.type != "cuda":
            if self.native_table:
                # The native kernel's own lock: its captures never hold the Python kernel lock.
                host_arena, host_ctrl = schemas.snapshot(self.arena, ctrl, arena.numel())
                return host_arena.numpy(), host_ctrl.numpy()
            host_ctrl = ctrl.clone()
            return arena.clone().numpy(), host_ctrl.numpy()
        with torch.cuda.device(self.device):
            if variants.stream_capturing(self.device):
                raise RuntimeError("compiledump.flush() cannot run during CUDA graph capture")
            if self.live is not None:
                # A host-mapped arena: the kernels wrote host memory; no device copy. (After a
                # sticky CUDA error the synchronize raises; `compiledump recover` reads the files.)
                torch.cuda.synchronize(self.device)
                host_ctrl = self.live.host_ctrl.numpy().copy()  # the control block first (see above)
                return self.live.host_arena[: arena.numel()].numpy().copy(), host_ctrl
            if private:
                host_arena = torch.empty(arena.numel(), dtype=torch.float32, pin_memory=True)
                host_ctrl = torch.empty(ctrl.numel(), dtype=torch.int32, pin_memory=True)
            else:
                if self.host_buffers is None or self.host_buffers[0].numel() < arena.numel():
                    self.host_buffers = (
                        torch.empty(self.arena.numel(), dtype=torch.float32, pin_memory=True),
                        torch.empty(ctrl.numel(), dtype=torch.int32, pin_memory=True),
                    )
                host_arena, host_ctrl = self.host_buffers
                host_arena = host_arena[: arena.numel()]
            # Captures may have been issued on any stream of the device: wait for all of them.
            torch.cuda.synchronize(self.device)
            stream = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                host_ctrl.copy_(ctrl, non_blocking=True)
                host_arena.copy_(arena, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()
        return host_arena.numpy(), host_ctrl.numpy()


def _fake_mode_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


_CALL_NAMES = {
    L.KIND_RECORD: "record()",
    L.KIND_RECORD_ONCE: "record(once=True)",
    L.KIND_RECORD_ROWS: "record(rows='all')",
    L.KIND_STEP: "record_step()",
    L.KIND_IDS: "record_ids()",
}


def _step_prefix(tag: str) -> str | None:
    parts = spec.split_step_key(tag)
    return parts[0] if parts else None

