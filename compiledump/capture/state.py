"""The capture side's process state: one object, `STATE`, and the two locks that guard it.

Everything `compiledump.reset()` forgets lives here, so reset is one call (`STATE.reset()`).
What outlives a reset is process-wide by nature and says so below: the settings, the atexit
registration, the torch.distributed rank once seen, the locks. (Two other process-wide facts
live with their owners: the loaded native library in ops/native.py and the installed signal
handlers in capture/signals.py; a reset cannot undo either.)

Locks:
- `STATE.lock` guards the tag registry (plans, slots, arena regions), the parallel metadata
  and the creation of the arena. Held only for host bookkeeping, never across a kernel.
- `STATE.flush_lock` (reentrant) makes one flush at a time, so the npz and the manifest on disk
  come from one snapshot; a signal handler may flush on the main thread while it is flushing.
The kernel lock (ops/register.py KERNEL_LOCK) is the device layer's: a CPU capture of the Python
kernels holds it while it counts and writes; one the native library serves (capture_v1 from its
region table) holds the library's C++ lock instead (kernels/capture.h `capture_mutex()`), which
the native snapshot takes too.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

from .. import config as _config


@dataclass
class State:
    """The capture side's state (module docstring). Fields marked "kept" survive `reset()`."""

    config: _config.Config  # kept: the settings in force
    runtime: object = None  # capture.arena.Runtime once created (init() or the first capture)
    device: object = None  # torch.device chosen by init(), else the first capture's device
    profiling_depth: int = 0
    pending_registers: dict[int, int] = field(default_factory=dict)  # set before the arena exists
    plans: dict = field(default_factory=dict)  # the capture-site memo of capture/api.py _plan
    filtered_tags: dict[str, str] = field(default_factory=dict)  # tag -> filter (moe_layers)
    warned: set = field(default_factory=set)  # (tag or "*", reason) already warned about
    parallel_groups: dict[str, int] = field(default_factory=dict)  # set_parallel()
    shards: list = field(default_factory=list)  # declare_shard(): [(compiled regex, ShardSpec)]
    routers: dict = field(default_factory=dict)  # declare_router(): {tag: format.routers.RouterInfo}
    mixers: dict = field(default_factory=dict)  # instrument(): {layer index (str): token mixer kind}
    routing: dict = field(default_factory=dict)  # instrument(): {"routed": [layers], "complete": bool, ...}
    exclude: list = field(default_factory=list)  # instrument(exclude=...)'s patterns
    export_binding: tuple | None = None  # (arena, ctrl) inputs of a program being exported
    instruments: list = field(default_factory=list)  # instrument() handles not removed
    # How the process is ending, when not normally: {"exception", "message"} (an unhandled
    # exception) or {"signal"} (SIGTERM/SIGINT whose default action ends it); the manifest's `ended_by`
    ended_by: dict | None = None
    dist_seen: dict = field(default_factory=lambda: {"rank": None, "world_size": None})  # kept
    atexit_registered: bool = False  # kept
    dumps_written: int = 0  # kept: flushes that wrote a dump (the exit note is for runs with none)
    lock: threading.Lock = field(default_factory=threading.Lock)  # kept
    flush_lock: threading.RLock = field(default_factory=threading.RLock)  # kept

    def reset(self) -> None:
        """Forget every capture, the arena, parallel groups, shard, router and mixer declarations."""
        live = getattr(self.runtime, "live", None)
        if live is not None:
            live.remove()  # its crash-proof files: what they hold is being forgotten
            live.unmap()  # and their CUDA registration (not at exit: the process's end releases it)
        kept = {name: getattr(self, name)
                for name in ("config", "dist_seen", "atexit_registered", "dumps_written", "lock", "flush_lock")}
        self.__dict__.update(State(**kept).__dict__)


STATE = State(config=_config.from_env())


def warn_once(message: str, stacklevel: int = 2) -> None:
    """A RuntimeWarning `compiledump: <message>`, once per process (until `reset()`)."""
    if ("*", message) not in STATE.warned:
        STATE.warned.add(("*", message))
        warnings.warn(f"compiledump: {message}", RuntimeWarning, stacklevel=stacklevel + 1)
