"""Reading dump files: one ``.npz`` and its manifest (docs/format.md), lazily and memory-mapped.

Also reads files without a manifest (debug_dump.py's ``deepinfer_layers_rank*_pid*.npz``): their
key meanings are inferred from names and dtypes (:mod:`.keys`). numpy and the standard library only.

Memory: arrays are never loaded as a whole file. Each ``.npy`` member stored uncompressed (what
``numpy.savez`` and the compiledump writer produce) is memory-mapped at its byte offset inside the
zip; compressed members are decompressed one at a time.
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import spec
from .keys import KeyInfo, infer_key_infos, info_from_manifest
from .routers import RouterInfo, declared_router

# Members smaller than this are read with one read() instead of an mmap (two syscalls fewer each).
_SMALL_READ_BYTES = 1 << 16


class DumpError(Exception):
    """Input that cannot be read or compared at all; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class Member:
    """One ``.npy`` member of an npz, located without reading its data."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    zip_name: str
    # Byte offset of the raw array data inside the npz when the member is stored uncompressed;
    # None for compressed members, which must be decompressed through zipfile.
    data_offset: int | None
    # A `record_step` of an integer tensor (expert ids of each decode step): stored as float32,
    # exact below 2**24, and read back as int32 ids (the manifest's integer `source_dtype` says so).
    ids_in_floats: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.dtype.itemsize * math.prod(self.shape))

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))

    @property
    def read_dtype(self) -> np.dtype:
        """The dtype readers give back: int32 for a step of ids stored as float32."""
        return np.dtype(np.int32) if self.ids_in_floats else self.dtype

    @property
    def is_integer(self) -> bool:
        return self.ids_in_floats or bool(np.issubdtype(self.dtype, np.integer) or self.dtype == np.bool_)


@dataclass(frozen=True)
class ShardInfo:
    """A key's ``shard`` entry in the manifest (``compiledump.declare_shard``)."""

    dim: int | None
    how: str  # concat | sum
    group: str

    def describe(self) -> str:
        return f"concat {self.group} dim {self.dim}" if self.how == "concat" else f"sum {self.group}"


@dataclass(frozen=True)
class KeyProblem:
    """A key of a dump that is present but cannot be compared, and why."""

    kind: str
    key: str
    detail: str


@dataclass
class Replica:
    """One whole copy of a key: the (rank, file) pairs holding its parts, in shard order. A key
    of a single file, or an unsharded key of a merged side, has one part."""

    key: str
    shard: ShardInfo | None
    parts: list[tuple[str, DumpFile]]

    @property
    def ranks(self) -> list[str]:
        return [rank for rank, _ in self.parts]

    def arrays(self) -> list[np.ndarray]:
        return [dump.array(self.key) for _, dump in self.parts]

    def whole(self) -> np.ndarray:
        """The key's whole array (:meth:`combine` of :meth:`arrays`)."""
        return self.combine(self.arrays())

    def combine(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The whole array: the shards concatenated along the shard dim, or added in float64
        (int64 for integers)."""
        if self.shard is None:
            return arrays[0]
        if self.shard.how == "concat":
            return np.concatenate(arrays, axis=self.shard.dim)
        total = np.zeros(arrays[0].shape, np.int64 if np.issubdtype(arrays[0].dtype, np.integer) else np.float64)
        for array in arrays:
            total += array
        return total


class Dump:
    """What the comparator needs of one side of a pair: a single file (:class:`DumpFile`) or
    several ranks' files merged into one (``compiledump.compare.shards.MergedDump``)."""

    path: Path | str
    label: str
    members: dict[str, Member]
    infos: dict[str, KeyInfo]
    manifest: dict | None
    notes: list[str]
    bad_members: dict[str, str]  # key -> why its member is unreadable
    problems: list[KeyProblem]  # keys held but not comparable (e.g. shards that do not merge)
    excluded: set[str]  # the keys of those problems: not compared, and not "missing" either
    merged_ranks: list[str] | None  # the ranks merged into this side; None for a single file

    def replicas(self, key: str) -> list[Replica]:
        """The whole copies of ``key`` this side holds (one for a single file)."""
        raise NotImplementedError

    def router(self, key: str) -> RouterInfo | None:
        """How the router whose logits ``key`` holds selects its experts, as declared
        (``compiledump.declare_router``; the manifest's ``routers``), or None."""
        info = self.infos.get(key)
        return declared_router((self.manifest or {}).get("routers"), info.tag if info is not None else key)

    def seen_as(self, tag: str) -> str:
        """This side's own tag `tag` as the comparator names it (``--map`` renames RUN's)."""
        return tag

    def rank_manifests(self) -> list[dict]:
        """The manifest of each file this side was read from (a merged side's keeps rank 0's tags)."""
        return [self.manifest] if self.manifest is not None else []

    def tag_entries(self):
        """(tag as the comparator names it, entry) for each well-formed entry of the `tags` table of
        every manifest of this side (every rank's, on a merged side)."""
        for manifest in self.rank_manifests():
            tags = manifest.get("tags")
            for entry in tags.values() if isinstance(tags, dict) else ():
                if isinstance(entry, dict) and isinstance(entry.get("tag"), str):
                    yield self.seen_as(entry["tag"]), entry

    def left_out_by(self, tag: str, patterns: list[str]) -> str | None:
        """The first of ``patterns`` (this side's ``instrument(exclude=...)``) that left ``tag`` out,
        ``tag`` named as the comparator sees this side (``--map`` renames RUN's); or None."""
        return spec.excluded_by(tag, patterns)


def _read_npy_header(handle) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(handle)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(handle)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(handle)
    # Version 3.0 only differs by a UTF-8 header; numpy exposes no public reader for it.
    return np.lib.format._read_array_header(handle, version)  # noqa: SLF001


def _local_data_start(handle, info: zipfile.ZipInfo) -> int:
    """Offset of a member's data: after its local header, whose extra field can differ in size
    from the central directory's (zip64), so it has to be read from the local header itself."""
    handle.seek(info.header_offset)
    header = handle.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"member {info.filename!r} has a corrupt local header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def _locate(handle, archive: zipfile.ZipFile, info: zipfile.ZipInfo, file_size: int) -> Member:
    key = info.filename[: -len(".npy")]
    if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
        handle.seek(_local_data_start(handle, info))
        shape, fortran, dtype = _read_npy_header(handle)
        offset = handle.tell()
    else:
        with archive.open(info) as member_handle:
            shape, fortran, dtype = _read_npy_header(member_handle)
        offset = None
    if dtype.hasobject:
        raise ValueError(f"dtype {dtype} holds Python objects; only numeric arrays are compared")
    member = Member(key, dtype, tuple(int(n) for n in shape), bool(fortran), info.filename, offset)
    if offset is not None and offset + member.nbytes > file_size:
        raise ValueError(f"data runs past the end of the file ({offset + member.nbytes} > {file_size} bytes)")
    return member


class DumpFile(Dump):
    """One dump file: its members (located lazily), manifest and key meanings.

    Construction reads only the zip directory, each member's ``.npy`` header and the manifest.
    Array data is read by :meth:`array`, one key at a time.
    """

    def __init__(self, path: str | Path, label: str = "dump") -> None:
        self.path = Path(path)
        self.label = label
        match = spec.DUMP_NAME.match(self.path.name)
        self.rank = match.group("rank") if match else "?"
        self.members = {}
        self.notes = []
        self.bad_members = {}
        self.problems = []
        self.excluded = set()
        self.merged_ranks = None
        self.keys_inferred = False  # a manifest without a keys table: kinds from names, as without one
        self._read_members()
        self.manifest = self._read_manifest()
        self.infos = self._key_infos()
        for key, info in self.infos.items():
            member = self.members[key]
            if info.kind == "step" and spec.is_integer_source(info.source_dtype) and member.dtype == np.float32:
                self.members[key] = replace(member, ids_in_floats=True)

    def _read_members(self) -> None:
        if not self.path.exists():
            raise DumpError(f"{self.label} {self.path}: no such file or directory")
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as handle:
                try:
                    archive = zipfile.ZipFile(handle)
                except (zipfile.BadZipFile, EOFError, ValueError) as exc:
                    raise DumpError(f"{self.label} {self.path}: not a readable .npz archive "
                                    f"(truncated or not a zip file: {exc})") from None
                with archive:
                    infos = archive.infolist()
                    npy_members = [info for info in infos if info.filename.endswith(".npy")]
                    if infos and not npy_members:
                        raise DumpError(f"{self.label} {self.path}: zip archive holds no .npy arrays, not an .npz dump")
                    for info in npy_members:
                        key = info.filename[: -len(".npy")]
                        try:
                            self.members[key] = _locate(handle, archive, info, size)
                        except (ValueError, OSError, EOFError, zipfile.BadZipFile, struct.error) as exc:
                            self.bad_members[key] = f"unreadable member: {exc}"
        except PermissionError as exc:
            raise DumpError(f"{self.label} {self.path}: {exc.strerror}") from None
        except IsADirectoryError:
            raise DumpError(f"{self.label} {self.path}: is a directory") from None

    def _read_manifest(self) -> dict | None:
        path = self.path.with_suffix(".json")
        if not path.is_file():
            if self.path.name.startswith(f"{spec.STEM_PREFIX}_"):
                # compiledump writes the npz, then its manifest: a kill between the two leaves this.
                # Read as a manifest-less legacy file, its keys would get the legacy thresholds,
                # up to thousands of times looser than its dtype's, and a bug could pass.
                raise DumpError(
                    f"{self.label} {self.path}: its manifest {path.name} is missing: the flush that wrote it was "
                    "cut between the two files (or the .json was removed), so its keys' meanings and dtypes are "
                    "unknown and it is not compared. If the process left a .live directory beside it, "
                    f"`compiledump recover {self.path.parent}` writes a complete dump; otherwise rerun")
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            self.notes.append(f"manifest {path.name} unreadable ({exc}); key kinds inferred from names")
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != spec.FORMAT_NAME:
            self.notes.append(f"{path.name} is not a compiledump manifest; key kinds inferred from names")
            return None
        version = manifest.get("format_version")
        if isinstance(version, int) and version > spec.FORMAT_VERSION:
            self.notes.append(f"manifest format_version {version} is newer than this reader "
                              f"({spec.FORMAT_VERSION}); reading it anyway")
        if not isinstance(manifest.get("keys"), dict):
            self.notes.append(f"manifest {path.name} has no 'keys' table; key kinds inferred from names")
            manifest["keys"] = {}
            self.keys_inferred = True
        return manifest

    def _key_infos(self) -> dict[str, KeyInfo]:
        if self.manifest is None or self.keys_inferred:
            return infer_key_infos(list(self.members.values()))
        infos: dict[str, KeyInfo] = {}
        table = self.manifest["keys"]
        unlisted = []
        inferred, unread = None, []
        for key in self.members:
            info = info_from_manifest(key, table.get(key))
            if info is not None:
                infos[key] = info
            elif key not in table:
                unlisted.append(key)
            else:  # listed in a form this reader does not know (a newer format's kind): from its name
                inferred = inferred or infer_key_infos(list(self.members.values()))
                infos[key] = inferred[key]
                unread.append(key)
        if unread:
            self.notes.append(f"{len(unread)} manifest entries this reader cannot read (a newer format's?), kinds "
                              f"inferred from the names: {preview(unread)}")
        # A key the manifest does not list: the npz of a flush whose manifest was never written (a
        # kill between the two files leaves the npz one flush ahead). Its meaning and dtype are
        # unknown, and none of the manifest's counts cover it: not compared (an "unreadable"
        # problem), never judged with inferred kinds and loose thresholds.
        for key in unlisted:
            del self.members[key]
            self.bad_members[key] = ("not listed in the manifest (written by a later flush whose manifest was "
                                     "not: the process was killed between the two files); not compared")
        phantom = [key for key in table if key not in self.members and key not in self.bad_members]
        if phantom:
            self.notes.append(f"manifest lists {len(phantom)} keys absent from the npz: {preview(phantom)}")
        return infos

    def array(self, key: str) -> np.ndarray:
        """The array stored under ``key``: a read-only memory map for large stored members, an
        in-memory copy for small or compressed ones; int32 for a step of ids stored as floats."""
        member = self.members[key]
        if member.ids_in_floats:
            return self._stored(key, member).astype(np.int32)
        return self._stored(key, member)

    def _stored(self, key: str, member: Member) -> np.ndarray:
        order = "F" if member.fortran_order else "C"
        if member.data_offset is None:
            with zipfile.ZipFile(self.path) as archive, archive.open(member.zip_name) as handle:
                return np.lib.format.read_array(handle, allow_pickle=False)
        if member.nbytes < _SMALL_READ_BYTES:
            with open(self.path, "rb") as handle:
                handle.seek(member.data_offset)
                data = handle.read(member.nbytes)
            if len(data) != member.nbytes:
                raise ValueError(f"{key}: file ends inside the array data")
            return np.frombuffer(data, dtype=member.dtype).reshape(member.shape, order=order)
        return np.memmap(self.path, dtype=member.dtype, mode="r", offset=member.data_offset,
                         shape=member.shape, order=order)

    def replicas(self, key: str) -> list[Replica]:
        return [Replica(key, None, [(self.rank, self)])]

    def shard(self, key: str) -> ShardInfo | None:
        """The shard declaration of ``key`` in the manifest, or None (also for a malformed one)."""
        entry = ((self.manifest or {}).get("keys") or {}).get(key)
        shard = entry.get("shard") if isinstance(entry, dict) else None
        if not isinstance(shard, dict) or shard.get("how") not in ("concat", "sum") \
                or not isinstance(shard.get("group"), str):
            return None
        dim = shard.get("dim")
        if shard["how"] == "concat" and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 0):
            return None
        return ShardInfo(dim if shard["how"] == "concat" else None, shard["how"], shard["group"])

    def parallel_coords(self, file_rank: str) -> dict[str, int]:
        """The manifest's ``parallel`` groups plus ``world_rank``/``world_size`` (from its rank and
        world_size, else the file name's rank ``file_rank``)."""
        manifest = self.manifest or {}
        parallel = manifest.get("parallel")
        coords = {name: value for name, value in (parallel.items() if isinstance(parallel, dict) else ())
                  if isinstance(name, str) and isinstance(value, int) and not isinstance(value, bool)}
        rank = str(manifest.get("rank", file_rank))
        if rank.isdigit():
            coords["world_rank"] = int(rank)
        elif file_rank.isdigit():
            coords["world_rank"] = int(file_rank)
        if isinstance(manifest.get("world_size"), int):
            coords["world_size"] = manifest["world_size"]
        return coords


def preview(items: list[str], limit: int = 8) -> str:
    """The first ``limit`` items, comma-separated, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def rank_sort_key(rank: str) -> tuple:
    """Orders rank labels: numbers numerically, then other labels (``x``, ``?``) by name."""
    return (0, int(rank), "") if rank.isdigit() else (1, 0, rank)
