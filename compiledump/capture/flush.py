"""Flush: one copy of the arena and the control block to the host, sliced into the dump's
arrays and manifest (format/writer.py writes them).

Also the two automatic flushes: at interpreter exit, and from the SIGTERM/SIGINT handler
(capture/signals.py), which must never block on a lock the interrupted frame may hold.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import torch

from .. import config as _config
from ..format import spec, writer
from ..format.files import name_taken
from ..ops import layout as L
from ..ops.register import KERNEL_LOCK
from ..version import __version__
from . import collect, mixers, parallel, routers
from .arena import Runtime
from .state import STATE, warn_once

_flush_depth = 0  # flushes in progress that hold STATE.flush_lock (changed only by its owner)


def _rank() -> str:
    """`RANK`, else the torch.distributed rank (remembered once seen, so that a flush at exit
    after `destroy_process_group()` keeps the file name), else `x`."""
    rank = os.getenv("RANK")
    if rank:
        return rank
    dist_rank, _ = parallel.observe_distributed()
    return str(dist_rank) if dist_rank is not None else "x"


def _world_size() -> int | None:
    _, world = parallel.observe_distributed()
    if world is not None:
        return world
    world = os.getenv("WORLD_SIZE")
    return int(world) if world and world.isdigit() else None


def process_fields() -> dict:
    """Who writes: the manifest's first fields, also journaled by crash-proof capture."""
    return {"compiledump_version": __version__, "torch_version": torch.__version__, "rank": _rank(),
            "pid": os.getpid(), "world_size": _world_size()}


# (directory, rank, pid) -> the stem this process writes there: chosen once, kept across reset().
_CLAIMED: dict[tuple[str, str, int], str] = {}


def dump_stem() -> str:
    """File stem of this process's dump: `compiledump_rank<R>_pid<P>`, or `..._pid<P>_<n>` where the
    dump directory already holds files of that name that another process left (a container's
    process restarted with the same pid, or a replica with the same rank and pid in another pid
    namespace): its dump, or its crash-proof files awaiting `compiledump recover`, are never
    overwritten or removed. The first call for a directory reserves the name there: a hidden
    `.<stem>.claim` file, removed at exit."""
    return stem_in(STATE.config.dir)


def stem_in(directory: str | None) -> str:
    """`dump_stem()` for `directory` (a flush reads the directory once: configure() may switch it)."""
    rank, pid = _rank(), os.getpid()
    if not directory:
        return spec.dump_stem(rank, pid)
    key = (os.path.realpath(directory), rank, pid)  # one name however the directory is spelled
    stem = _CLAIMED.get(key)
    if stem is None:
        copy = 1
        while True:
            stem = spec.dump_stem(rank, pid, copy)
            if not name_taken(directory, stem) and _claim(directory, stem):
                break
            copy += 1
        _CLAIMED[key] = stem
    return stem


def _claim(directory: str, stem: str) -> bool:
    """Reserve `stem` in `directory` for this process: a hidden `.<stem>.claim` file created
    exclusively, so that of two processes choosing a name at the same moment one moves on. Removed
    by the exit flush (its dump files then keep the name taken). True where no file can be made:
    the name's own files are the only check then."""
    try:
        os.makedirs(directory, exist_ok=True)
        os.close(os.open(os.path.join(directory, f".{stem}{spec.CLAIM_SUFFIX}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        pass
    return True


def release_claims() -> None:
    """Remove this process's name reservations (at exit, after its dump is written)."""
    for (directory, _rank, pid), stem in list(_CLAIMED.items()):
        if pid == os.getpid():
            try:
                os.unlink(os.path.join(directory, f".{stem}{spec.CLAIM_SUFFIX}"))
            except OSError:
                pass


def flush() -> str | None:
    """Write everything captured so far; return the npz path, or None if nothing was captured.

    One device-to-host copy of the used arena and the control block, then slicing on the host.
    The files are rewritten whole on every flush (the dump is cumulative: flushing again after
    more captures writes a superset; flushing twice with nothing new writes the same content),
    atomically (temporary file + rename, npz first). Callable from any thread: concurrent
    flushes are serialized, and a capture running in another thread at the same moment lands in
    this flush or the next. Also runs on SIGTERM/SIGINT, and at interpreter exit unless nothing
    was captured since the last flush.
    """
    return _flush(wait_for_captures=True)


def _flush(wait_for_captures: bool, unless_unchanged: bool = False) -> str | None:
    # From a signal handler (wait_for_captures=False) the interrupted frame may hold STATE.lock
    # (a capture planning a new tag) or the flush lock of a flush in another thread that waits
    # for STATE.lock: never block on either. The registry is then read from copies of its dicts,
    # which the GIL makes atomic; a tag being registered at that moment has captured nothing yet.
    global _flush_depth
    got_flush_lock = STATE.flush_lock.acquire(timeout=-1 if wait_for_captures else 5.0)
    # The snapshot's shared host buffers belong to the outermost flush holding the flush lock
    # (which keeps it until the writer is done with their views). A flush nested in it (a signal
    # handler on the same thread: the lock is reentrant) or one without the lock copies into
    # buffers of its own, so as not to overwrite what the other flush is slicing or writing.
    private = not got_flush_lock or _flush_depth > 0
    if got_flush_lock:
        _flush_depth += 1
    try:
        st = STATE
        rt = STATE.runtime
        if not st.config.active or rt is None or not rt.slots:
            return None
        directory = st.config.dir  # read once: configure() may switch it meanwhile
        locked = st.lock.acquire(blocking=wait_for_captures)
        # CPU captures run on the calling thread: the kernel lock keeps a capture of another
        # thread from being half-written in the snapshot. (CUDA: the snapshot synchronizes.)
        cpu_lock = KERNEL_LOCK if rt.device.type == "cpu" else None
        cpu_locked = cpu_lock is not None and cpu_lock.acquire(blocking=wait_for_captures)
        try:
            # Views of host buffers (capture/arena.py Runtime.snapshot): used only below, and
            # by the writer, before the flush lock is released.
            arena, ctrl = rt.snapshot(private=private)
            # Every capture claims a counter in the control block: an unchanged one (and no
            # clear() or configure() since) means the last dump written holds everything, unless
            # its file name changed (the rank became known) or the host-side declarations the
            # manifest carries did (a filtered tag, set_parallel, declare_shard, declare_router).
            stem = stem_in(directory)
            written = (stem, ctrl.tobytes(), _declarations(rt))
            # Unchanged: the last dump holds it all; rewritten only to say the process is dying
            # (ended_by), where that dump is this directory's and still there (one the program
            # moved away stays away).
            here = os.path.realpath(directory)
            unchanged = written == rt.flushed_ctrl and not (
                st.ended_by and rt.flushed_dir == here and os.path.isfile(os.path.join(here, f"{stem}.npz")))
            # Nothing kept since a clear() after this runtime wrote a dump: an empty dump would
            # replace it (or appear where the program moved it away).
            if unless_unchanged and (unchanged or (rt.cleared_since_dump and not L.kept_any(ctrl))):
                return None
            arrays, manifest = _collect(rt, arena, ctrl)
        finally:
            if cpu_locked:
                cpu_lock.release()
            if locked:
                st.lock.release()
        _warn_drops(manifest)
        path = writer.write_dump(directory, stem, arrays, manifest)
        if rt.live is not None:
            rt.live.note_flush(directory, stem, collect.ctrl_digest(np.frombuffer(written[1], dtype=np.int32)))
        rt.flushed_ctrl, rt.flushed_dir, rt.cleared_since_dump = written, here, False
        st.dumps_written += 1
        return str(path)
    finally:
        if got_flush_lock:
            _flush_depth -= 1
            STATE.flush_lock.release()


def _declarations(rt: Runtime) -> str:
    """What the manifest says that no capture counts: compared by the flushes that skip an
    unchanged dump."""
    st = STATE
    return repr((sorted(st.filtered_tags.items()), sorted(st.parallel_groups.items()), st.shards,
                 sorted(st.routers.items()), st.mixers, st.routing, st.exclude, rt.prompt_tokens))


def _collect(rt: Runtime, arena: np.ndarray, ctrl: np.ndarray) -> tuple[dict, dict]:
    got = collect.collect(list(rt.slots.values()), list(rt.overflow_tags), arena, ctrl, rt.prompt_tokens)
    declared = routers.manifest_routers(got.tags)
    manifest = writer.build_manifest(
        **process_fields(),
        device=str(rt.device),
        capture_path=rt.capture_path,
        config=_config.settings(rt.config),
        filtered_tags=dict(STATE.filtered_tags),
        arena_words_used=rt.used_words,
        prompt_tokens=rt.prompt_tokens,
        parallel=parallel.manifest_fields(got.keys, lambda message: warn_once(message, stacklevel=4)),
        first_nonfinite=got.first_nonfinite,
        keys=got.keys,
        tags=got.tags,
        drops=got.drops,
        # Only when some captured router was declared (readers that predate it ignore it).
        **({"routers": declared} if declared else {}),
        **mixers.manifest_layers(),  # instrument()'s
        **({"ended_by": STATE.ended_by} if STATE.ended_by else {}),  # the process is dying of it
    )
    return got.arrays, manifest


# What to change so that a loss does not happen again, per drop reason (the warning names it).
DROP_FIXES = {
    "arena_full": "raise COMPILEDUMP_ARENA_MB (now {arena_mb}), or keep fewer rows: rows=\"one\" for all-rows "
                  "records, instrument(..., router_rows=\"one\") for its router logits, fewer decode steps of each "
                  "layer's states (COMPILEDUMP_LAYER_STEPS, now {layer_steps})",
    "shape_changed": "later calls had another shape than the first kept one; give each shape its own tag (a "
                     "step tag numbers its keys by its kept calls: the later ones hold later forwards' values)",
    "step_capacity": "raise COMPILEDUMP_MAX_STEPS (now {max_steps})",
    "tag_table_full": "raise COMPILEDUMP_MAX_TAGS (now {max_tags})",
    "row_out_of_range": "the row set_gather_rows names does not exist in those batches",
}


def _warn_drops(manifest: dict) -> None:
    """One warning per tag and reason for captures that were lost, one line for the filters."""
    deliberate: dict[str, int] = {}
    for name, info in manifest["tags"].items():
        for reason, count in info["drops"].items():
            if reason in spec.DELIBERATE_REASONS:
                deliberate[reason] = deliberate.get(reason, 0) + count
                continue
            if (name, reason) in STATE.warned:
                continue
            STATE.warned.add((name, reason))
            how_many = f"{count} capture(s)" if count is not None else "all captures"
            fix = DROP_FIXES.get(reason)
            fix = f": {fix.format(**vars(STATE.config))}" if fix else ""
            warnings.warn(
                f"compiledump: tag {info['tag']!r}: {how_many} dropped ({reason}){fix}; "
                "see the manifest's 'drops'",
                RuntimeWarning,
                stacklevel=4,
            )
    if deliberate and ("*", "filters") not in STATE.warned:
        STATE.warned.add(("*", "filters"))
        summary = ", ".join(f"{reason}: {count}" for reason, count in sorted(deliberate.items()))
        warnings.warn(f"compiledump: captures skipped by filters ({summary})", RuntimeWarning, stacklevel=4)
    _warn_never_kept(manifest)


def _warn_never_kept(manifest: dict) -> None:
    """One warning naming the tags the token gate skipped every time: the gate is deliberate, but
    a tag with nothing kept is almost always a tensor whose first dim is not its tokens (or a
    decode-only value recorded with `record`), and one summary line would hide it."""
    gated = sorted(info["tag"] for info in manifest["tags"].values()
                   if info.get("kept") == 0 and info["drops"].get("token_gate"))
    fresh = [tag for tag in gated if (tag, "never_kept") not in STATE.warned]
    if not fresh:
        return
    STATE.warned.update((tag, "never_kept") for tag in fresh)
    warnings.warn(
        f"compiledump: nothing kept of tag(s) {', '.join(map(repr, fresh))}: the token gate (COMPILEDUMP_TOKENS) "
        f"skipped every capture, whose first dim was never the prompt's {manifest.get('prompt_tokens')} token "
        "rows. Record a decode-only value with record_step, a value without a tokens dim (a 1-D tensor) with "
        "record(..., once=True), pass tensors with their tokens first (layout= for a 3-D one), or set "
        "COMPILEDUMP_TOKENS=0 to keep the last write whatever its size",
        RuntimeWarning, stacklevel=4)


def _counted(rt: Runtime) -> bool:
    """Whether the control block counts any call of any tag (nothing since a clear() otherwise).
    Read from the control block alone (at exit: no copy of the arena)."""
    return bool(rt.ctrl[L.HEADER_WORDS :].any())


def flush_if_changed() -> str | None:
    """Flush unless nothing was captured or declared since the last flush: its dump is complete,
    and rewriting it would bring back files the program moved or removed (nor after a clear():
    `_flush`)."""
    return _flush(wait_for_captures=True, unless_unchanged=True)


def flush_at_exit() -> None:
    """The atexit hook: flush, say on stderr when nothing (or not everything instrumented) was
    captured, and never turn interpreter exit into a traceback storm."""
    try:
        flush_if_changed()
        rt = STATE.runtime
        if STATE.config.active or rt is None or rt.flushed_ctrl is not None or not _counted(rt):
            remove_live_files()  # the dump is complete (or nothing was captured: a clear() since)
        else:  # capture was switched off and no flush wrote what it had: its crash-proof files keep it
            where = (f"kept in {rt.live.path} (`compiledump recover {rt.live.path.parent}` writes the dump)"
                     if rt.live is not None else "lost (they were in memory only)")
            print(f"[compiledump] captures made before capture was switched off were never flushed: {where}",
                  file=sys.stderr, flush=True)
        note = silence_note()
        if note is not None:
            print(f"[compiledump] {note}", file=sys.stderr, flush=True)
    except Exception as error:  # noqa: BLE001
        print(f"[compiledump] flush at exit failed: {error!r}", file=sys.stderr, flush=True)
        rt = STATE.runtime
        if rt is not None and rt.live is not None:  # recover names the cause (the files stay)
            rt.live.write({"event": "exit_flush_failed", "error": repr(error)})


def silence_note() -> str | None:
    """Why the dump is empty or lacks what `instrument()` asked for, with the likely cause; None
    when capture is off or everything instrumented ran."""
    st = STATE
    if not st.config.active:
        return None
    unfired = [handle for handle in st.instruments if not handle.fired]
    if unfired:
        names = ", ".join(sorted({type(handle.model).__name__ for handle in unfired}))
        return (f"instrument({names}): its capture hooks never ran with capture on: the model did not run after "
                "instrument(), or it ran code compiled before instrument() (dynamo does not re-trace for new "
                "hooks); call instrument() before torch.compile")
    rt = st.runtime
    if (rt is not None and rt.slots) or st.dumps_written:
        return None  # captured, or a dump was written before reset()/clear()
    filtered = f"; {len(st.filtered_tags)} tag(s) were filtered by COMPILEDUMP_MOE_LAYERS" if st.filtered_tags else ""
    return (f"COMPILEDUMP_DIR is {st.config.dir!r} but nothing was captured: no record/record_step/record_ids call "
            f"ran with capture on{filtered} (compiledump.instrument(model) adds them to a model without editing it)")


def flush_on_signal(dying_of: str | None = None) -> None:
    """The signal handler's flush: on the main thread, possibly inside a capture or a flush of
    that same thread, so it waits for no lock (capture/signals.py). As the exit flush, it does not
    rewrite a dump nothing was captured into since the last flush (one moved away stays away).
    `dying_of`: the signal's name where its default action ends the process next (the manifest's
    `ended_by` says so: compare does not read a run a job's timeout or a sibling rank's failure
    ended as a whole one)."""
    if dying_of is not None and STATE.ended_by is None:  # (an exception's exit flush it interrupts: kept)
        STATE.ended_by = {"signal": dying_of}
    path = _flush(wait_for_captures=False, unless_unchanged=True)
    rt = STATE.runtime
    if rt is not None and rt.live is not None:
        rt.live.write({"event": "signal", "flushed": path})  # recover: the dump was complete then
    if path is not None:
        print(f"[compiledump] flushed {path} on signal", file=sys.stderr, flush=True)


def remove_live_files() -> None:
    """Remove the crash-proof files and the name reservation once a complete dump holds what they
    hold: after the exit flush, and after the signal handler's flush when the signal's default
    action is about to end the process (no atexit hook runs then)."""
    rt = STATE.runtime
    if rt is not None and rt.live is not None:
        rt.live.remove()
    release_claims()  # the dump's files keep its name taken from now on
