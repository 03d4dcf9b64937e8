"""Crash-proof capture: the arena, the control block and a journal of the tag registry in files.

With `COMPILEDUMP_PERSIST` on (the default on CPU), a process's arena and control block are
memory-mapped files in `<dir>/<stem>.live/`, so everything a kernel has written is in the page
cache the moment it is written: a SIGKILL, a segfault or `os._exit` loses nothing of it (power
loss may: nothing is synced to disk). Next to them a journal records, before a tag's first
capture is stored, what is needed to read its region. `compiledump recover DIR`
(capture/journal.py reads the journal, capture/recover.py) turns what a dead process left into an ordinary
dump; the flush at normal exit removes them.

`<stem>.live/`:
- `arena.f32`: the arena, float32 words (a sparse file: only claimed regions take disk space);
- `ctrl.i32`: the control block (ops/layout.py);
- `journal.jsonl`: one JSON object per line, appended with single `write` calls: `start` (who
  writes: pid, rank, device, config, sizes), then `slot`, `region`, `prompt` and `overflow`
  events as the registry changes, `clear`, `flushed` after each flush (its directory, file stem
  and a digest of the capture counters it read), `exception`/`signal` when the process is dying of one, and
  `exit_flush_failed` when the flush at exit raised;
- `fault.txt`: Python's faulthandler report, if the process crashed in native code (only when
  no faulthandler was enabled before: compiledump does not take over one the user set up).

CUDA (`COMPILEDUMP_PERSIST=1`): the same files, registered as mapped pinned memory; the kernels
write them over PCIe, so they survive a dead CUDA context, and a flush needs no device copy.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import socket
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from ..ops import layout as L
from ..ops import variants
from ..format.spec import (
    JOURNAL_VERSION,
    LIVE_ARENA,
    LIVE_CTRL,
    LIVE_FAULT,
    LIVE_JOURNAL,
    LIVE_SUFFIX,
)
from .journal import process_start_time
from .state import warn_once


def _own(live: Path) -> bool:
    """Whether `live` is this process's own directory (its journal starts with this host, pid and
    process start time: pids and start ticks can repeat across pid namespaces and hosts)."""
    try:
        first = (live / LIVE_JOURNAL).read_bytes().split(b"\n", 1)[0]
        start = json.loads(first)
    except (OSError, ValueError):
        return False  # no journal yet: another process may be creating it
    return (start.get("host") == socket.gethostname() and start.get("pid") == os.getpid()
            and start.get("start_time") == process_start_time(os.getpid()))


def open_live(directory: str, stem: str, device: torch.device, arena_words: int, ctrl_words: int,
              start: dict) -> LiveFiles | None:
    """The process's crash-proof files, or None (with one warning) where they cannot be made:
    capture then goes on with the arena in memory, as with COMPILEDUMP_PERSIST=0."""
    try:
        return LiveFiles(directory, stem, device, arena_words, ctrl_words, start)
    except FileExistsError as error:
        warn_once(f"crash-proof capture is off: {error}, left as they are for `compiledump recover`; a crash will "
                  "lose what was not flushed")
        return None
    except (OSError, RuntimeError, ValueError) as error:
        warn_once(f"crash-proof capture is off: cannot map the arena in {directory} ({error}); a crash will "
                  "lose what was not flushed. Set COMPILEDUMP_PERSIST=0 to silence this")
        return None


class LiveFiles:
    """One process's `<stem>.live/` directory: the mapped arena and control block, the journal."""

    def __init__(self, directory: str, stem: str, device: torch.device, arena_words: int, ctrl_words: int,
                 start: dict):
        self.path = Path(directory) / f"{stem}{LIVE_SUFFIX}"
        if self.path.exists():
            if not _own(self.path):  # capture/flush.py dump_stem chose a free stem: another process's now
                raise FileExistsError(f"{self.path} holds another process's crash-proof files")
            shutil.rmtree(self.path)  # this process's own, of a runtime created again: replaced
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir()  # not exist_ok: of two processes racing for one stem, one gets an error here
        try:
            self._open(device, arena_words, ctrl_words, start)
        except BaseException:
            # What _open made before it failed: the CUDA registrations (pinned pages the driver
            # would keep), the descriptors, the fault report's file.
            self.unmap()
            self.close()
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    _fault = _journal = _arena_fd = None  # until _open makes them (close() after a failed _open)
    arena = host_arena = ctrl = host_ctrl = None

    def _open(self, device: torch.device, arena_words: int, ctrl_words: int, start: dict) -> None:
        self.device = device
        # A child forked after this shares the mapping (MAP_SHARED) but not the files' ownership:
        # only this process journals into them or removes them.
        self.owner = os.getpid()
        # Sparse files read as zeros: the control block starts zeroed, the arena is touched
        # region by region as tags claim them (Runtime._allocate), never inside a step.
        # One shared mapping per file, made by numpy and aliased by torch: `touch` writes through
        # the numpy side, never through a torch op (a region may be claimed while a program is
        # being traced or exported).
        self._arena_words = _mapped(self.path / LIVE_ARENA, np.float32, arena_words)
        self.host_arena = torch.from_numpy(self._arena_words)
        self.host_ctrl = torch.from_numpy(_mapped(self.path / LIVE_CTRL, np.int32, ctrl_words))
        # Disk blocks are reserved before a mapped page is first written: a full disk is then an
        # error here (ENOSPC), never a SIGBUS inside a step.
        _reserve(self.path / LIVE_CTRL, 0, ctrl_words * 4)
        if device.type == "cuda":
            self.arena = _map_to_device(self.host_arena, device)
            self.ctrl = _map_to_device(self.host_ctrl, device)  # refused: __init__ unmaps the arena
        else:
            self.arena, self.ctrl = self.host_arena, self.host_ctrl
        self._arena_fd = os.open(self.path / LIVE_ARENA, os.O_RDWR)  # touch() reserves regions through it
        self._journal = os.open(self.path / LIVE_JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fault = None
        if not faulthandler.is_enabled():
            self._fault = open(self.path / LIVE_FAULT, "w")  # noqa: SIM115 - open for the process's life
            faulthandler.enable(file=self._fault, all_threads=True)
        self._append({"event": "start", "journal_version": JOURNAL_VERSION, "pid": os.getpid(),
                    "start_time": process_start_time(os.getpid()), "host": socket.gethostname(),
                    "device": str(device), "arena_words": arena_words, "ctrl_words": ctrl_words,
                    "control_layout": L.CONTROL_LAYOUT,
                    "created_unix": time.time(), **start})

    def touch(self, start: int, words: int) -> None:
        """Reserve a newly claimed region's disk blocks and fault in its pages (zeros, as the
        sparse file reads), so that no capture inside a step pays for either. Raises OSError when
        the disk is full."""
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self._arena_fd, start * 4, words * 4)
        self._arena_words[start : start + words] = 0

    def write(self, event: dict) -> None:
        """Append one event: a single `write` call, so a kill leaves it whole or absent (a torn
        last line is ignored by recover)."""
        if self._journal is not None and os.getpid() == self.owner:
            try:
                self._append(event)
            except OSError as error:  # a full disk (the mapped files' blocks are reserved): never the model's error
                warn_once(f"cannot append to the crash-proof journal {self.path / LIVE_JOURNAL} ({error.strerror}): "
                          "after a crash, `compiledump recover` may miss what was registered from now on; flush() and "
                          "the flush at exit still write everything")

    def _append(self, event: dict) -> None:
        os.write(self._journal, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def note_flush(self, directory: str, stem: str, ctrl_digest: str) -> None:
        """Journal a flush: the stem it wrote under (the rank may have become known since the files
        were made) and a digest of the control block it read. recover writes that name, replacing
        the flushed dump, and leaves the dump alone when the control block has not changed since:
        it is complete, with what only the flush knew (set_parallel, declare_shard)."""
        self.write({"event": "flushed", "dir": os.path.realpath(directory), "stem": stem, "ctrl": ctrl_digest})

    def note_filtered(self, filtered: dict[str, str]) -> None:
        """Journal tags the MoE layer filter dropped ({tag: reason}): only the manifest says so, and
        recover writes it."""
        for tag, reason in list(filtered.items()):
            self.write({"event": "filtered", "tag": tag, "reason": reason})

    def remove(self) -> None:
        """Close and delete the directory (after a complete flush at exit); in a forked child,
        whose parent still owns them, only close."""
        self.close()
        if os.getpid() == self.owner:
            shutil.rmtree(self.path, ignore_errors=True)

    def unmap(self) -> None:
        """Undo the CUDA registration of the mapped files (reset(), or a failed open): the driver
        keeps their pages pinned until then, and a runtime created again maps new files, maybe at
        the same address (registered twice, refused). Waits for the device first: captures still
        queued write through the mapping. The arena in use afterwards would be the host's own."""
        if os.getpid() != getattr(self, "owner", os.getpid()):
            return  # a forked child: the registration is its parent's (and CUDA is unusable here)
        for host, name in ((self.host_arena, "arena"), (self.host_ctrl, "ctrl")):
            mapped = getattr(self, name)
            if mapped is None or host is None or mapped is host:
                continue
            try:
                torch.cuda.synchronize(mapped.device)
            except Exception:  # noqa: BLE001 - a sticky error (a device-side assert): nothing runs any more
                _clear_cuda_error()
            _unmap_from_device(host, mapped)
            setattr(self, name, host)

    def close(self) -> None:
        if self._fault is not None:
            faulthandler.disable()
            self._fault.close()
            self._fault = None
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
        if self._arena_fd is not None:
            os.close(self._arena_fd)
            self._arena_fd = None


def _mapped(path: Path, dtype, words: int) -> np.ndarray:
    """A new sparse file of `words` zero words, mapped shared (stores land in the page cache)."""
    with open(path, "wb") as handle:
        handle.truncate(words * np.dtype(dtype).itemsize)
    return np.memmap(path, dtype=dtype, mode="r+", shape=(words,))


def _reserve(path: Path, offset: int, length: int) -> None:
    if hasattr(os, "posix_fallocate"):
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, offset, length)
        finally:
            os.close(fd)


def slot_event(slot) -> dict:
    """A registry slot (capture/collect.py `Slot`) as the journal holds it: journal.py `registry`
    reads it back."""
    return {"event": "slot", "tag": slot.tag, "kind": slot.kind, "index": slot.index, "order": slot.order}


def region_event(slot, payload: tuple) -> dict:
    """A slot's arena region as the journal holds it, written before the kernel stores anything
    in the region."""
    return {"event": "region", "index": slot.index, "kind": slot.kind, "payload": list(payload), "offset": slot.offset,
            "capacity": slot.capacity, "overflow": slot.overflow, "source_dtype": slot.source_dtype,
            "source_shape": slot.source_shape}


class CudaErrorNotCleared(Exception):
    """A failed CUDA call left the runtime's last error set and it could not be reset: the next
    kernel launch in this process would raise it (not a RuntimeError, so open_live does not
    fall back past it)."""


def _map_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing the mapped file `host`: registered as mapped pinned memory, so the
    kernels read and write it over PCIe (with unified addressing its device address is its host
    address). The host tensor must outlive the result.

    Raises RuntimeError (open_live then falls back to a device arena) where the registration is
    refused: Linux 6.5 and later refuse the long-term pin the NVIDIA driver takes for a writable
    file mapping unless the file is on tmpfs or hugetlbfs (mm/gup.c writable_file_mapping_allowed)."""
    cudart = torch.cuda.cudart()
    nbytes = host.numel() * host.element_size()
    flags = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = cudart.cudaHostRegister(host.data_ptr(), nbytes, flags)
    if int(err) != 0:
        # torch's binding returns the error without resetting the runtime's last error, which
        # torch's next kernel-launch check would raise as its own.
        if not _clear_cuda_error():
            raise CudaErrorNotCleared(
                f"compiledump: COMPILEDUMP_PERSIST=1: cudaHostRegister failed ({int(err)}) and the CUDA runtime's "
                "error could not be reset (libcudart not found among the loaded libraries); set "
                "COMPILEDUMP_PERSIST=0, or put COMPILEDUMP_DIR on a tmpfs such as /dev/shm")
        raise RuntimeError(f"compiledump: COMPILEDUMP_PERSIST=1: cudaHostRegister of {nbytes} bytes failed "
                           f"(cudaError {int(err)}); Linux 6.5 and later pin writable file mappings only on tmpfs or "
                           "hugetlbfs: put COMPILEDUMP_DIR on a tmpfs such as /dev/shm, or set COMPILEDUMP_PERSIST=0 "
                           "to keep the arena in device memory")
    typestr = {torch.float32: "<f4", torch.int32: "<i4"}[host.dtype]

    # The CUDA array interface: how torch wraps device memory it did not allocate.
    interface = types.SimpleNamespace(__cuda_array_interface__={
        "shape": (host.numel(),), "typestr": typestr, "data": (host.data_ptr(), False), "version": 3,
        "strides": None})
    with torch.cuda.device(device):
        mapped = torch.as_tensor(interface, device=device)
    variants.MAPPED_ARENAS.add(mapped.data_ptr())
    return mapped


def _unmap_from_device(host: torch.Tensor, mapped: torch.Tensor) -> None:
    """Undo _map_to_device (the files could not all be mapped)."""
    variants.MAPPED_ARENAS.discard(mapped.data_ptr())
    if int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr())) != 0:
        _clear_cuda_error()


def _clear_cuda_error() -> bool:
    """Reset the CUDA runtime's last error (cudaGetLastError) in every libcudart this process
    loaded (torch's, found in /proc/self/maps); False where none is found."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
    except OSError:
        return False
    for path in paths:
        ctypes.CDLL(path).cudaGetLastError()  # the library already loaded: the same handle
    return bool(paths)


def note_exception(live: LiveFiles | None, exception: dict) -> None:
    """Journal an unhandled exception, `{"type", "message"}` (the flush at exit normally follows
    and removes the files; after a sticky CUDA error it cannot, and recover names the exception as
    the cause)."""
    if live is not None:
        try:
            live.write({"event": "exception", **exception})
        except OSError:
            pass


def install_excepthook(on_exception) -> None:
    """Chain a `sys.excepthook` that passes an unhandled exception to `on_exception(exc_type,
    exc)` before the previous hook prints it, once per process."""
    previous = sys.excepthook
    if getattr(previous, "_compiledump", False):
        return

    def hook(exc_type, exc, tb):
        try:
            on_exception(exc_type, exc)
        except Exception:  # (never hide the user's traceback behind ours)
            pass
        previous(exc_type, exc, tb)

    hook._compiledump = True
    sys.excepthook = hook
