"""Atomic writing of one dump: `<stem>.npz` plus its JSON manifest `<stem>.json`.

Each file is written to a temporary name in the target directory, flushed to disk and renamed
over the final name, so a crash at any moment leaves either the previous complete file or the new
complete file, never a truncated one. The npz goes first, so a manifest never describes an npz
that is not there yet.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from . import spec


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600: readable by its writer alone, so a dump a container's root
        # or a service account wrote could not be compared by its user. As open() would make it
        # (where the filesystem takes modes at all).
        try:
            os.fchmod(fd, 0o666 & ~_umask())
        except OSError:
            pass
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (/proc, Linux 4.7 and
    later); elsewhere os.umask's set-and-restore, during which a file another thread creates gets
    the mode 022 gives."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_npz(handle, arrays: dict[str, np.ndarray]) -> None:
    # The same container numpy.savez writes (stored zip of .npy members), built by hand so that
    # any valid tag is a valid key (np.savez reserves names such as "file").
    with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, array in arrays.items():
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                # np.require, not np.ascontiguousarray: the latter turns a 0-d array into shape (1,).
                np.lib.format.write_array(member, np.require(array, requirements="C"), allow_pickle=False)


# The fields every manifest Python writes has besides the counts (docs/format.md): a live
# process's flush (capture/flush.py) or `compiledump recover` (capture/recover.py). A field one of
# them gains and the other forgets is an error here, not a dump that silently lacks it. (Readers
# require none of them: the C++ flush writes no capture_path, older dumps lack later fields.)
REQUIRED_FIELDS = frozenset({"compiledump_version", "torch_version", "rank", "pid", "world_size", "device",
                             "capture_path", "config", "filtered_tags", "arena_words_used", "prompt_tokens",
                             "parallel", "first_nonfinite"})


def build_manifest(*, keys: dict, tags: dict, drops: dict, **fields) -> dict:
    """The manifest of one dump (docs/format.md): the format's name and version, `fields` (who
    wrote it: versions, rank, pid, device, config, ...: every one of REQUIRED_FIELDS, and optional
    ones such as `routers` or `recovered`), and the per-key, per-tag and total counts.
    `created_unix` is added when not given."""
    missing = REQUIRED_FIELDS - fields.keys()
    if missing:
        raise TypeError(f"build_manifest: missing manifest field(s) {sorted(missing)}")
    manifest = {"format": spec.FORMAT_NAME, "format_version": spec.FORMAT_VERSION}
    manifest.update(fields)
    manifest.setdefault("created_unix", time.time())
    manifest.update(keys=keys, tags=tags, drops=drops)
    return manifest


def write_dump(directory: str | os.PathLike, stem: str, arrays: dict[str, np.ndarray], manifest: dict) -> Path:
    """Write `<directory>/<stem>.npz` and `<directory>/<stem>.json` atomically; return the npz path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    npz_path = out / f"{stem}.npz"
    _atomic_write(npz_path, lambda handle: _write_npz(handle, arrays))
    # Compact: only then does json use its C encoder (a 2000-key manifest: 10 ms, not 100 ms).
    text = json.dumps(manifest, separators=(",", ":")).encode()
    _atomic_write(out / f"{stem}.json", lambda handle: handle.write(text))
    return npz_path
