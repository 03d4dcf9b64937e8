"""Compare two dumps and name the first divergent layer and decode step.

This module reads the dump file format (``docs/FORMAT.md``: a plain ``.npz`` of float32/int32
arrays plus an optional JSON manifest with the same stem) and the seed's
``deepinfer_layers_rank*_pid*.npz`` files (no manifest). It imports numpy and the standard library
only, so it runs on a machine without torch or a GPU.

Memory: arrays are never loaded as a whole file. Each ``.npy`` member stored uncompressed (what
``numpy.savez`` and the compiledump writer produce) is memory-mapped at its byte offset inside the
zip; the comparison walks one key at a time and converts at most ``CHUNK_ELEMENTS`` elements per
side to float64 at once, so a side never holds more than its mapped array and one chunk.
"""

from __future__ import annotations

import json
import math
import re
import struct
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# rel_diff above this is a divergence. 1e-3 is the convention of DeepGEMM's `calc_diff` tests and
# SGLang's dump comparator; the README ("Comparing dumps") has the measurements behind it for bf16 vs fp32.
DEFAULT_THRESHOLD = 1e-3
# An argmax flip is a near-tie when the reference top-1/top-2 margin is below this many bf16
# spacings of the reference top-1 logit (bf16 output rounding alone moves a margin by up to one).
DEFAULT_NEAR_TIE_ULPS = 4.0
# Elements converted to float64 at once per side; bounds memory for arbitrarily large keys.
CHUNK_ELEMENTS = 1 << 20
# Members smaller than this are read with one read() instead of an mmap (two syscalls fewer each).
_SMALL_READ_BYTES = 1 << 16

DUMP_GLOBS = ("compiledump_rank*_pid*.npz", "deepinfer_layers_rank*_pid*.npz")
_DUMP_NAME_RE = re.compile(r"^(?:compiledump|deepinfer_layers)_rank(?P<rank>.+?)_pid(?P<pid>\d+)\.npz$")
_LAYER_TAG_RE = re.compile(r"^layer(\d+)(?:_|$)")
_LAYER_ONLY_RE = re.compile(r"^layer\d+$")
# `<prefix>_<n>` without leading zeros: record_step numbers 0, 1, 2, ...
_STEP_KEY_RE = re.compile(r"^(?P<prefix>.+)_(?P<step>0|[1-9][0-9]*)$")
_KINDS = ("record", "record_once", "step", "ids")
MANIFEST_FORMAT = "compiledump-dump"
MANIFEST_VERSION = 1
REPORT_FORMAT = "compiledump-compare"


class DumpError(Exception):
    """Input that cannot be compared at all; the CLI prints it as one line and exits 2."""


class NoCommonKeys(DumpError):
    """A REF/RUN pair shares no key, so nothing can be compared."""


class PlotUnavailable(Exception):
    """``--plot`` was asked for but matplotlib is not installed."""


# --------------------------------------------------------------------------------------------
# Reading one dump file
# --------------------------------------------------------------------------------------------


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

    @property
    def nbytes(self) -> int:
        return int(self.dtype.itemsize * math.prod(self.shape))

    @property
    def is_integer(self) -> bool:
        return bool(np.issubdtype(self.dtype, np.integer) or self.dtype == np.bool_)


@dataclass(frozen=True)
class KeyInfo:
    """What a key is: its capture kind, tag, step, layer and capture order."""

    key: str
    kind: str  # record | record_once | step | ids
    tag: str
    step: int | None
    layer: int | None
    order: float  # tag's first-capture order (manifest) or member position (inferred)
    from_manifest: bool

    @property
    def phase(self) -> str:
        """``decode`` for step keys, ``prefill`` for everything else."""
        return "decode" if self.kind == "step" else "prefill"


def layer_of(tag: str) -> int | None:
    """Layer number of a tag ``layer<N>`` or ``layer<N>_<x>``, else None."""
    match = _LAYER_TAG_RE.match(tag)
    return int(match.group(1)) if match else None


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


class DumpFile:
    """One dump file: its members (located lazily), manifest and inferred key meanings.

    Construction reads only the zip directory, each member's ``.npy`` header and the manifest.
    Array data is read by :meth:`array`, one key at a time.
    """

    def __init__(self, path: str | Path, label: str = "dump") -> None:
        self.path = Path(path)
        self.label = label
        self.members: dict[str, Member] = {}
        self.notes: list[str] = []
        self.bad_members: dict[str, str] = {}
        self._read_members()
        self.manifest = self._read_manifest()
        self.infos = self._key_infos()

    # -- structure ---------------------------------------------------------------------------

    def _read_members(self) -> None:
        if not self.path.exists():
            raise DumpError(f"{self.label} {self.path}: no such file or directory")
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as handle:
                try:
                    archive = zipfile.ZipFile(handle)
                except (zipfile.BadZipFile, EOFError, ValueError) as exc:
                    raise DumpError(
                        f"{self.label} {self.path}: not a readable .npz archive "
                        f"(truncated or not a zip file: {exc})"
                    ) from None
                with archive:
                    infos = archive.infolist()
                    npy_members = [info for info in infos if info.filename.endswith(".npy")]
                    if infos and not npy_members:
                        raise DumpError(f"{self.label} {self.path}: zip archive holds no .npy arrays, not an .npz dump")
                    for info in npy_members:
                        key = info.filename[: -len(".npy")]
                        try:
                            self.members[key] = self._locate(handle, archive, info, size)
                        except (ValueError, OSError, EOFError, zipfile.BadZipFile, struct.error) as exc:
                            self.bad_members[key] = f"unreadable member: {exc}"
        except PermissionError as exc:
            raise DumpError(f"{self.label} {self.path}: {exc.strerror}") from None
        except IsADirectoryError:
            raise DumpError(f"{self.label} {self.path}: is a directory") from None

    @staticmethod
    def _locate(handle, archive: zipfile.ZipFile, info: zipfile.ZipInfo, file_size: int) -> Member:
        key = info.filename[: -len(".npy")]
        stored = info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1
        if stored:
            start = _local_data_start(handle, info)
            handle.seek(start)
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

    def _read_manifest(self) -> dict | None:
        path = self.path.with_suffix(".json")
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            self.notes.append(f"manifest {path.name} unreadable ({exc}); key kinds inferred from names")
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            self.notes.append(f"{path.name} is not a compiledump manifest; key kinds inferred from names")
            return None
        version = manifest.get("format_version")
        if isinstance(version, int) and version > MANIFEST_VERSION:
            self.notes.append(
                f"manifest format_version {version} is newer than this reader ({MANIFEST_VERSION}); reading it anyway"
            )
        if not isinstance(manifest.get("keys"), dict):
            self.notes.append(f"manifest {path.name} has no 'keys' table; key kinds inferred from names")
            manifest["keys"] = {}
        return manifest

    def _key_infos(self) -> dict[str, KeyInfo]:
        inferred = infer_key_infos(list(self.members.values()))
        if self.manifest is None:
            return inferred
        infos: dict[str, KeyInfo] = {}
        table = self.manifest["keys"]
        unlisted = []
        for key in self.members:
            entry = table.get(key)
            info = _info_from_manifest(key, entry)
            if info is None:
                unlisted.append(key)
                info = inferred[key]
            infos[key] = info
        if unlisted:
            self.notes.append(f"{len(unlisted)} keys missing from the manifest, kinds inferred: {_preview(unlisted)}")
        phantom = [key for key in table if key not in self.members and key not in self.bad_members]
        if phantom:
            self.notes.append(f"manifest lists {len(phantom)} keys absent from the npz: {_preview(phantom)}")
        return infos

    # -- data --------------------------------------------------------------------------------

    def array(self, key: str) -> np.ndarray:
        """The array stored under ``key``: a read-only memory map for large stored members, an
        in-memory copy for small or compressed ones."""
        member = self.members[key]
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


def _info_from_manifest(key: str, entry: Any) -> KeyInfo | None:
    if not isinstance(entry, dict) or entry.get("kind") not in _KINDS:
        return None
    tag = entry.get("tag") if isinstance(entry.get("tag"), str) else key
    step = entry.get("step") if isinstance(entry.get("step"), int) else None
    order = entry.get("order")
    order = float(order) if isinstance(order, (int, float)) else math.inf
    kind = entry["kind"]
    if kind == "step" and step is None:
        return None
    return KeyInfo(key, kind, tag, step if kind == "step" else None, layer_of(tag), order, True)


def infer_key_infos(members: list[Member]) -> dict[str, KeyInfo]:
    """Key meanings for a file without a manifest (seed files), from names and dtypes.

    Rules (documented in the README, "Comparing dumps"):

    * ``<prefix>_<n>`` (n without leading zeros) is decode step n of tag ``<prefix>`` when the
      file also holds ``<prefix>_0`` (record_step numbers every tag from 0) and, if the prefix is
      itself ``layer<N>``, the family has at least two members (a lone ``layer3_0`` is more
      likely a record tag than a one-step decode).
    * otherwise an integer array is ``ids`` and a float array is a ``record``.
    * the order is the member's position in the npz: the seed's dict keeps first-insertion order
      and ``np.savez`` writes it as is, so position is first-capture order. A step family takes
      the position of its first member.
    """
    position = {member.key: index for index, member in enumerate(members)}
    families: dict[str, list[tuple[int, str]]] = {}
    for member in members:
        match = _STEP_KEY_RE.match(member.key)
        if match:
            families.setdefault(match.group("prefix"), []).append((int(match.group("step")), member.key))
    step_of: dict[str, tuple[str, int]] = {}
    family_order: dict[str, int] = {}
    for prefix, entries in families.items():
        if 0 not in {step for step, _ in entries}:
            continue
        if _LAYER_ONLY_RE.match(prefix) and len(entries) < 2:
            continue
        family_order[prefix] = min(position[key] for _, key in entries)
        for step, key in entries:
            step_of[key] = (prefix, step)
    infos: dict[str, KeyInfo] = {}
    for member in members:
        if member.key in step_of:
            tag, step = step_of[member.key]
            infos[member.key] = KeyInfo(member.key, "step", tag, step, layer_of(tag), float(family_order[tag]), False)
        else:
            kind = "ids" if member.is_integer else "record"
            infos[member.key] = KeyInfo(member.key, kind, member.key, None, layer_of(member.key),
                                        float(position[member.key]), False)
    return infos


def order_key_infos(infos: list[KeyInfo]) -> list[KeyInfo]:
    """Keys in comparison order: prefill keys first, then decode steps.

    Prefill: tags captured before the first ``layer<N>`` tag (e.g. ``embed``), then layer keys by
    layer number and capture order within the layer, then the remaining non-layer tags (e.g.
    ``final_norm``, ``logits``) in capture order. Decode: by step, then tag capture order.
    """
    prefill = [info for info in infos if info.kind != "step"]
    steps = [info for info in infos if info.kind == "step"]
    layer_orders = [info.order for info in prefill if info.layer is not None]
    first_layer_order = min(layer_orders) if layer_orders else math.inf

    def prefill_rank(info: KeyInfo):
        if info.layer is not None:
            return (1, info.layer, info.order, info.key)
        return (0 if info.order < first_layer_order else 2, 0, info.order, info.key)

    prefill.sort(key=prefill_rank)
    steps.sort(key=lambda info: (info.step, info.order, info.key))
    return prefill + steps


def _preview(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# --------------------------------------------------------------------------------------------
# Finding and pairing files
# --------------------------------------------------------------------------------------------


def _rank_sort_key(rank: str) -> tuple:
    return (0, int(rank), "") if rank.isdigit() else (1, 0, rank)


def collect_dumps(path: str | Path, label: str) -> tuple[dict[str, Path], list[dict]]:
    """Dump files of one side, by rank label, and the problems met finding them.

    ``path`` is an npz file or a directory of ``compiledump_rank<R>_pid<P>.npz`` /
    ``deepinfer_layers_rank<R>_pid<P>.npz`` files. A file whose name carries no rank gets the label
    ``?``. When a directory holds several files of one rank (data-parallel engines all report
    RANK=0 and differ by pid), the newest is used and the others are reported.
    """
    path = Path(path)
    problems: list[dict] = []
    if path.is_dir():
        files = sorted({found for pattern in DUMP_GLOBS for found in path.glob(pattern) if found.is_file()})
        if not files:
            raise DumpError(
                f"{label} {path}: directory holds no dumps (compiledump_rank*_pid*.npz or "
                f"deepinfer_layers_rank*_pid*.npz)"
            )
        by_rank: dict[str, list[Path]] = {}
        for found in files:
            by_rank.setdefault(_DUMP_NAME_RE.match(found.name).group("rank"), []).append(found)
        chosen: dict[str, Path] = {}
        for rank, candidates in by_rank.items():
            candidates.sort(key=lambda candidate: (candidate.stat().st_mtime, candidate.name))
            chosen[rank] = candidates[-1]
            for ignored in candidates[:-1]:
                problems.append({
                    "kind": "duplicate_rank", "side": label, "rank": rank, "file": str(ignored),
                    "detail": f"{label} has several files for rank {rank}; using the newest, {candidates[-1].name}",
                })
        return chosen, problems
    if not path.exists():
        raise DumpError(f"{label} {path}: no such file or directory")
    match = _DUMP_NAME_RE.match(path.name)
    return {match.group("rank") if match else "?": path}, problems


def pair_dumps(ref: dict[str, Path], run: dict[str, Path]) -> tuple[list[tuple[str, Path, Path]], list[dict]]:
    """Pair the two sides' files by rank; a side with one file pairs with the other's single file."""
    if len(ref) == 1 and len(run) == 1:
        (ref_rank, ref_path), (run_rank, run_path) = next(iter(ref.items())), next(iter(run.items()))
        label = ref_rank if ref_rank == run_rank else (ref_rank if ref_rank != "?" else run_rank)
        return [(label, ref_path, run_path)], []
    pairs = [(rank, ref[rank], run[rank]) for rank in sorted(ref.keys() & run.keys(), key=_rank_sort_key)]
    problems = []
    for side, mine, other in (("REF", ref, run), ("RUN", run, ref)):
        for rank in sorted(mine.keys() - other.keys(), key=_rank_sort_key):
            problems.append({
                "kind": "unpaired_rank", "side": side, "rank": rank, "file": str(mine[rank]),
                "detail": f"rank {rank} exists only in {side} ({mine[rank].name})",
            })
    if not pairs:
        raise DumpError(
            f"no rank in common: REF has ranks {sorted(ref, key=_rank_sort_key)}, "
            f"RUN has ranks {sorted(run, key=_rank_sort_key)}"
        )
    return pairs, problems


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


class _Top2:
    """Running top-1 (first index on ties, like np.argmax) and top-2 values over chunks.
    NaN never wins: a NaN logit cannot be sampled, so it is treated as -inf."""

    def __init__(self) -> None:
        self.best = -math.inf
        self.best_index = -1
        self.second = -math.inf
        self.seen = 0

    def update(self, chunk: np.ndarray, start: int, may_have_nan: bool = True) -> None:
        if chunk.size == 0:
            return
        values = np.where(np.isnan(chunk), -np.inf, chunk) if may_have_nan else chunk
        index = int(np.argmax(values))
        top = float(values[index])
        # Hide the winner to find the runner-up, then put it back (values may be the caller's data).
        values[index] = -np.inf
        runner_up = float(values.max()) if values.size > 1 else -math.inf
        values[index] = top
        if self.best_index < 0 or top > self.best:
            self.second = max(self.best, runner_up)
            self.best, self.best_index = top, start + index
        else:
            self.second = max(self.second, top)
        self.seen += chunk.size

    def result(self) -> dict:
        margin = self.best - self.second if self.seen >= 2 else math.nan
        return {"argmax": self.best_index if self.seen else None, "top1": self.best, "margin": margin}


class Workspace:
    """Reusable float64 and mask buffers for :func:`compare_float_arrays`.

    Converting each chunk into the same buffers instead of fresh arrays avoids a malloc/free and
    page-fault cycle per key: with fresh ~1 MB arrays glibc returns the memory to the OS after
    every key, and the benchmark measured 0.8 s instead of 0.33 s for that churn alone.
    """

    def __init__(self, size: int) -> None:
        self.size = max(int(size), 1)
        self.ref = np.empty(self.size, np.float64)
        self.run = np.empty(self.size, np.float64)
        self.diff = np.empty(self.size, np.float64)
        self.finite_ref = np.empty(self.size, np.bool_)
        self.finite_run = np.empty(self.size, np.bool_)
        self.finite_both = np.empty(self.size, np.bool_)


def compare_float_arrays(ref: np.ndarray, run: np.ndarray, margins: bool = False,
                         chunk: int = CHUNK_ELEMENTS, workspace: Workspace | None = None) -> dict:
    """Metrics between two float arrays of equal size, accumulated in float64 chunk by chunk.

    ``rel_diff`` = 1 − 2⟨x,y⟩/(‖x‖²+‖y‖²), computed as ‖x−y‖²/(‖x‖²+‖y‖²) (the same quantity
    without the cancellation). ``cosine`` = ⟨x,y⟩/(‖x‖‖y‖). ``max_abs``/``mean_abs`` of x−y,
    ``rel_l2`` = ‖x−y‖/‖x‖ (x is the reference). All of them use the positions finite on both
    sides; ``nonfinite_mismatch`` counts positions where the sides are not the same non-finite
    value (NaN vs NaN and equal infinities agree, e.g. masked logits). With ``margins``, also the
    argmax and top-1 minus top-2 margin of each side (for 1-D logits).
    """
    x = np.ravel(ref)
    y = np.ravel(run)
    if x.size != y.size:
        raise ValueError(f"sizes differ: {x.size} vs {y.size}")
    chunk = max(1, min(chunk, x.size))
    if workspace is None or workspace.size < chunk:
        workspace = Workspace(chunk)
    dot = xx = yy = dd = abs_sum = 0.0
    max_abs = 0.0
    compared = 0
    nan_ref = nan_run = inf_ref = inf_run = mismatch = 0
    top_ref, top_run = _Top2(), _Top2()
    for start in range(0, x.size, chunk):
        n = min(chunk, x.size - start)
        a, b = workspace.ref[:n], workspace.run[:n]
        np.copyto(a, x[start:start + n])
        np.copyto(b, y[start:start + n])
        finite_a = np.isfinite(a, out=workspace.finite_ref[:n])
        finite_b = np.isfinite(b, out=workspace.finite_run[:n])
        both = np.logical_and(finite_a, finite_b, out=workspace.finite_both[:n])
        all_finite = bool(both.all())
        if margins:
            top_ref.update(a, start, may_have_nan=not all_finite)
            top_run.update(b, start, may_have_nan=not all_finite)
        if not all_finite:
            nan_a, nan_b = np.isnan(a), np.isnan(b)
            nan_ref += int(nan_a.sum())
            nan_run += int(nan_b.sum())
            inf_ref += int((~finite_a & ~nan_a).sum())
            inf_run += int((~finite_b & ~nan_b).sum())
            odd = ~both
            same = (nan_a[odd] & nan_b[odd]) | (a[odd] == b[odd])
            mismatch += int((~same).sum())
            a, b = a[both], b[both]
        if a.size == 0:
            continue
        d = np.subtract(a, b, out=workspace.diff[:a.size])
        dot += _dot(a, b)
        xx += _dot(a, a)
        yy += _dot(b, b)
        dd += _dot(d, d)
        np.abs(d, out=d)
        abs_sum += float(d.sum())
        max_abs = max(max_abs, float(d.max()))
        compared += a.size
    denominator = xx + yy
    result = {
        "rel_diff": dd / denominator if denominator > 0 else 0.0,
        "cosine": _cosine(dot, xx, yy),
        "max_abs": max_abs if compared else None,
        "mean_abs": abs_sum / compared if compared else None,
        "rel_l2": math.sqrt(dd / xx) if xx > 0 else (0.0 if dd == 0 else None),
        "nan_ref": nan_ref, "nan_run": nan_run, "inf_ref": inf_ref, "inf_run": inf_run,
        "nonfinite_mismatch": mismatch,
        "compared_elements": compared,
    }
    if margins:
        ref_top, run_top = top_ref.result(), top_run.result()
        result.update({
            "argmax_ref": ref_top["argmax"], "argmax_run": run_top["argmax"],
            "margin_ref": ref_top["margin"], "margin_run": run_top["margin"],
            "top1_ref": ref_top["top1"], "top1_run": run_top["top1"],
        })
    return result


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    # einsum's own loop rather than BLAS: multi-threaded OpenBLAS dot products measured 1-6 s
    # instead of 0.8 s for the benchmark on a loaded 2-core box, and a single-threaded loop sums in
    # a fixed order, so the report is reproducible bit for bit.
    return float(np.einsum("i,i->", a, b))


def _cosine(dot: float, xx: float, yy: float) -> float | None:
    if xx > 0 and yy > 0:
        return dot / math.sqrt(xx * yy)
    return 1.0 if xx == 0 and yy == 0 else None


def compare_id_arrays(ref: np.ndarray, run: np.ndarray) -> dict:
    """Exact comparison of two integer arrays of equal shape.

    On a mismatch: the first mismatching row (axis 0 for arrays of rank ≥ 2, whose rows are
    top-k id sets; the whole array counts as one row for rank ≤ 1), the first mismatching flat
    index, the number of mismatching rows, and for the first mismatching row the overlap
    ``|set(ref row) ∩ set(run row)|`` out of ``k`` = the number of distinct reference ids.
    """
    a = np.asarray(ref)
    b = np.asarray(run)
    differs = a != b
    mismatched = int(differs.sum())
    result: dict[str, Any] = {"ids_equal": mismatched == 0, "mismatched_elements": mismatched,
                              "total_elements": int(a.size)}
    if mismatched == 0:
        return result
    rows_a = a.reshape(a.shape[0], -1) if a.ndim >= 2 else a.reshape(1, -1)
    rows_b = b.reshape(rows_a.shape)
    row_differs = np.any(rows_a != rows_b, axis=1)
    row = int(np.argmax(row_differs))
    ref_set = set(rows_a[row].tolist())
    run_set = set(rows_b[row].tolist())
    result.update({
        "first_mismatch_row": row if a.ndim >= 2 else None,
        "first_mismatch_index": int(np.argmax(differs.reshape(-1))),
        "mismatched_rows": int(row_differs.sum()),
        "rows": int(rows_a.shape[0]),
        "overlap": len(ref_set & run_set),
        "k": len(ref_set),
        "same_set": ref_set == run_set,
        "ref_ids": sorted(ref_set)[:64],
        "run_ids": sorted(run_set)[:64],
    })
    return result


def bf16_spacing(value: float) -> float:
    """Distance between adjacent bfloat16 numbers (8-bit significand) at ``value``."""
    if not math.isfinite(value) or value == 0:
        return 0.0
    return math.ldexp(1.0, math.frexp(abs(value))[1] - 8)


# --------------------------------------------------------------------------------------------
# Comparing a pair of files
# --------------------------------------------------------------------------------------------


@dataclass
class CompareOptions:
    """Thresholds and classification settings for a comparison."""

    threshold: float = DEFAULT_THRESHOLD
    # (regex, threshold) from --threshold-for; the last pattern that matches a key wins.
    overrides: list[tuple[str, float]] = field(default_factory=list)
    # Fixed near-tie epsilon in logit units; None means near_tie_ulps bf16 spacings of the top-1.
    near_tie: float | None = None
    near_tie_ulps: float = DEFAULT_NEAR_TIE_ULPS
    chunk_elements: int = CHUNK_ELEMENTS

    def threshold_for(self, key: str) -> float:
        """The rel_diff threshold that applies to ``key``."""
        value = self.threshold
        for pattern, override in self.overrides:
            if re.search(pattern, key):
                value = override
        return value

    def near_tie_epsilon(self, top1_ref: float) -> float:
        """Reference margin below which an argmax flip is a near-tie."""
        if self.near_tie is not None:
            return self.near_tie
        return self.near_tie_ulps * bf16_spacing(top1_ref)


def _logits_tags(infos: list[KeyInfo], members: dict[str, Member]) -> set[str]:
    """Step tags analysed for margins: those whose name contains ``logits`` if any, else every
    step tag whose arrays are 1-D floats."""
    step_infos = [info for info in infos if info.kind == "step"]
    named = {info.tag for info in step_infos if "logits" in info.tag}
    if named:
        return named
    return {info.tag for info in step_infos
            if info.key in members and len(members[info.key].shape) == 1 and not members[info.key].is_integer}


def _problem(kind: str, rank: str, detail: str, key: str | None = None, **extra) -> dict:
    problem = {"kind": kind, "rank": rank, "key": key, "detail": detail}
    problem.update(extra)
    return problem


def compare_pair(ref: DumpFile, run: DumpFile, options: CompareOptions, rank: str) -> dict:
    """Compare two dump files key by key, in model order; return this pair's part of the report.

    Arrays are read one key at a time and released before the next, so each side holds at most
    one mapped array and one float64 chunk.
    """
    problems: list[dict] = []
    notes = [f"REF: {note}" for note in ref.notes] + [f"RUN: {note}" for note in run.notes]
    for side, dump in (("REF", ref), ("RUN", run)):
        for key, why in dump.bad_members.items():
            problems.append(_problem("unreadable", rank, f"{side} {why}", key, side=side))
        for kind, key, why in getattr(dump, "merge_problems", ()):
            problems.append(_problem(kind, rank, f"{side} {why}", key, side=side))
    # Key meanings come from a manifest when one side has it (authoritative), else from REF.
    authority, other = (ref, run) if ref.manifest is not None or run.manifest is None else (run, ref)
    merged = dict(authority.infos)
    for key, info in other.infos.items():
        merged.setdefault(key, info)
    ordered = order_key_infos(list(merged.values()))
    logits_tags = _logits_tags(ordered, authority.members | other.members)
    common = ref.members.keys() & run.members.keys()
    if not common:
        raise NoCommonKeys(
            f"no keys in common between REF {ref.path} ({len(ref.members)} keys) and "
            f"RUN {run.path} ({len(run.members)} keys)"
        )
    float_sizes = [member.nbytes // member.dtype.itemsize for key, member in ref.members.items()
                   if key in common and not member.is_integer]
    workspace = Workspace(min(options.chunk_elements, max(float_sizes, default=1)))
    records: list[dict] = []
    for info in ordered:
        key = info.key
        if key not in run.members:
            if key not in run.bad_members and key not in getattr(run, "unmerged", ()):
                problems.append(_problem("missing_in_run", rank, "present in REF only", key))
            continue
        if key not in ref.members:
            if key not in ref.bad_members and key not in getattr(ref, "unmerged", ()):
                problems.append(_problem("extra_in_run", rank, "present in RUN only", key))
            continue
        records.append(_compare_key(ref, run, info, options, rank, logits_tags, problems, workspace))
    for position, record in enumerate(records):
        record["position"] = position
    return _analyse_pair(records, problems, notes, options, rank, ref, run)


def _compare_key(ref: DumpFile, run: DumpFile, info: KeyInfo, options: CompareOptions, rank: str,
                 logits_tags: set[str], problems: list[dict], workspace: Workspace) -> dict:
    key = info.key
    ref_member, run_member = ref.members[key], run.members[key]
    record: dict[str, Any] = {
        "key": key, "rank": rank, "kind": info.kind, "tag": info.tag, "layer": info.layer,
        "step": info.step, "phase": info.phase,
        "shape_ref": list(ref_member.shape), "shape_run": list(run_member.shape),
        "dtype_ref": str(ref_member.dtype), "dtype_run": str(run_member.dtype),
        "status": "ok", "divergent": False,
    }
    if ref_member.is_integer != run_member.is_integer:
        problems.append(_problem("dtype_mismatch", rank,
                                 f"{ref_member.dtype} vs {run_member.dtype}: integer ids vs floats, not compared", key))
        record["status"] = "skipped"
        return record
    if ref_member.dtype != run_member.dtype:
        problems.append(_problem("dtype_mismatch", rank, f"{ref_member.dtype} vs {run_member.dtype}: compared in float64"
                                 if not ref_member.is_integer else
                                 f"{ref_member.dtype} vs {run_member.dtype}: compared as integers", key))
    if ref_member.shape != run_member.shape:
        squeezed_equal = tuple(n for n in ref_member.shape if n != 1) == tuple(n for n in run_member.shape if n != 1)
        if not squeezed_equal:
            problems.append(_problem("shape_mismatch", rank,
                                     f"{list(ref_member.shape)} vs {list(run_member.shape)}: not compared", key))
            record["status"] = "skipped"
            return record
        problems.append(_problem("shape_mismatch", rank,
                                 f"{list(ref_member.shape)} vs {list(run_member.shape)}: differ only by size-1 "
                                 f"dimensions, compared flattened", key))
    try:
        if isinstance(ref, MergedDump) or isinstance(run, MergedDump):
            _compare_merged_key(record, ref, run, info, options, logits_tags, workspace)
        else:
            _fill_metrics(record, ref.array(key), run.array(key), info, options, logits_tags, workspace)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        problems.append(_problem("unreadable", rank, f"could not read the arrays: {exc}", key))
        record["status"] = "skipped"
    return record


def _fill_metrics(record: dict, x: np.ndarray, y: np.ndarray, info: KeyInfo, options: CompareOptions,
                  logits_tags: set[str], workspace: Workspace, margins: bool = True) -> None:
    """Compare REF array ``x`` with RUN array ``y`` of one key into ``record``: the id or float
    metrics, and ``status``/``divergent``/``metric``/``value`` when the key diverges."""
    if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        if x.shape != y.shape:
            x, y = x.reshape(-1), y.reshape(-1)
        record["metric_kind"] = "ids"
        record.update(compare_id_arrays(x, y))
        if not record["ids_equal"]:
            record["status"] = "mismatch"
            record["divergent"] = True
        return
    # Decode logits drive the argmax-flip analysis; the prefill logits (a 1-D `logits`
    # record) get the same margin columns for reading, but no flip classification.
    step_logits = margins and info.kind == "step" and info.tag in logits_tags
    prefill_logits = margins and info.kind != "step" and "logits" in info.tag and x.ndim == 1
    want_margins = step_logits or prefill_logits
    threshold = options.threshold_for(info.key)
    record["metric_kind"] = "float"
    record["threshold"] = threshold
    record.update(compare_float_arrays(x, y, margins=want_margins, chunk=options.chunk_elements,
                                       workspace=workspace))
    record["logits"] = want_margins
    record["margin_analysis"] = step_logits
    if record["nonfinite_mismatch"] > 0:
        record.update(status="divergent", divergent=True, metric="nonfinite",
                      value=record["nonfinite_mismatch"])
    elif record["rel_diff"] > threshold:
        record.update(status="divergent", divergent=True, metric="rel_diff", value=record["rel_diff"])
    if want_margins and record["argmax_ref"] is not None:
        record["argmax_equal"] = record["argmax_ref"] == record["argmax_run"]
        record["near_tie_epsilon"] = options.near_tie_epsilon(record["top1_ref"])


def _divergence_summary(record: dict, last_good: dict | None, rank: str) -> dict:
    summary = {
        "key": record["key"], "layer": record["layer"], "step": record["step"], "phase": record["phase"],
        "rank": rank, "position": record["position"],
        "last_good": last_good["key"] if last_good else None,
        "last_good_step": last_good["step"] if last_good else None,
    }
    if record.get("metric_kind") == "ids":
        summary.update(metric="ids", value=record["mismatched_elements"], threshold=None,
                       row=record.get("first_mismatch_row"), overlap=record.get("overlap"), k=record.get("k"))
    else:
        summary.update(metric=record["metric"], value=record["value"], threshold=record["threshold"])
    if "merge" in record:
        summary.update(merge=record["merge"], worst_rank=record["worst_rank"],
                       worst_rank_value=record.get("worst_rank_value"), merged_ranks=record["merged_ranks"],
                       divergent_ranks=record["divergent_ranks"])
    return summary


def _analyse_pair(records: list[dict], problems: list[dict], notes: list[str], options: CompareOptions,
                  rank: str, ref: DumpFile, run: DumpFile) -> dict:
    floats = [record for record in records if record.get("metric_kind") == "float"]
    phase_divergence: dict[str, dict | None] = {}
    for phase in ("prefill", "decode"):
        last_good = None
        phase_divergence[phase] = None
        for record in floats:
            if record["phase"] != phase:
                continue
            if record["divergent"]:
                phase_divergence[phase] = _divergence_summary(record, last_good, rank)
                break
            last_good = record
    id_mismatches = [record for record in records if record.get("metric_kind") == "ids" and record["divergent"]]
    first_ids = _divergence_summary(id_mismatches[0], None, rank) if id_mismatches else None
    flips = [record for record in records if record.get("margin_analysis") and record.get("argmax_equal") is False]
    first_flip = None
    if flips:
        flip = flips[0]
        epsilon = flip["near_tie_epsilon"]
        first_flip = {
            "step": flip["step"], "key": flip["key"], "tag": flip["tag"], "rank": rank,
            "kind": "near-tie" if flip["margin_ref"] < epsilon else "divergence",
            "margin_ref": flip["margin_ref"], "margin_run": flip["margin_run"],
            "argmax_ref": flip["argmax_ref"], "argmax_run": flip["argmax_run"], "epsilon": epsilon,
            "position": flip["position"],
        }
    float_first = phase_divergence["prefill"] or phase_divergence["decode"]
    root_cause = None
    if float_first is not None and first_ids is not None and first_ids["position"] < float_first["position"]:
        root_cause = dict(first_ids, reason="integer ids differ before the first float divergence")
    first = float_first or first_ids
    if first is None and first_flip is not None and first_flip["kind"] == "divergence":
        flip_record = records[first_flip["position"]]
        first = {
            "key": flip_record["key"], "layer": flip_record["layer"], "step": flip_record["step"],
            "phase": "decode", "rank": rank, "position": flip_record["position"], "metric": "argmax",
            "value": flip_record["margin_ref"], "threshold": first_flip["epsilon"],
            "last_good": None, "last_good_step": None,
        }
    margin_records = [record for record in records if record.get("margin_analysis") and record.get("argmax_ref") is not None]
    decode_margins = None
    if margin_records:
        smallest = min(margin_records, key=lambda record: _nan_last(record["margin_ref"]))
        decode_margins = {
            "tags": sorted({record["tag"] for record in margin_records}),
            "steps": len({record["step"] for record in margin_records}),
            "argmax_agree": sum(1 for record in margin_records if record["argmax_equal"]),
            "compared": len(margin_records),
            "flips": [record["step"] for record in flips],
            "smallest_ref_margin": {"step": smallest["step"], "key": smallest["key"], "value": smallest["margin_ref"]},
        }
    for side, dump in (("REF", ref), ("RUN", run)):
        drops = (dump.manifest or {}).get("drops") or {}
        if isinstance(drops, dict) and drops:
            notes.append(f"{side} manifest drops: " + ", ".join(f"{reason}={count}" for reason, count in drops.items()))
    return {
        "rank": rank, "ref": str(ref.path), "run": str(run.path),
        "ref_manifest": ref.manifest is not None, "run_manifest": run.manifest is not None,
        "compared": len(records), "divergent_keys": sum(1 for record in records if record["divergent"]),
        "first_divergence": first, "prefill_divergence": phase_divergence["prefill"],
        "decode_divergence": phase_divergence["decode"], "first_id_mismatch": first_ids,
        "root_cause": root_cause, "first_argmax_flip": first_flip, "decode_margins": decode_margins,
        "keys": records, "problems": problems, "notes": notes,
    }


def _nan_last(value: float) -> float:
    return math.inf if value is None or math.isnan(value) else value


# --------------------------------------------------------------------------------------------
# Merging the ranks of a sharded run (tensor/expert parallel) before comparing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """A key's ``shard`` entry in the manifest (``compiledump.declare_shard``)."""

    dim: int | None
    how: str  # concat | sum
    group: str

    def describe(self) -> str:
        return f"concat {self.group} dim {self.dim}" if self.how == "concat" else f"sum {self.group}"


def shard_of(dump: DumpFile, key: str) -> ShardInfo | None:
    """The shard declaration of ``key`` in ``dump``'s manifest, or None (also for a malformed one)."""
    entry = ((dump.manifest or {}).get("keys") or {}).get(key)
    shard = entry.get("shard") if isinstance(entry, dict) else None
    if not isinstance(shard, dict) or shard.get("how") not in ("concat", "sum") or not isinstance(shard.get("group"), str):
        return None
    dim = shard.get("dim")
    if shard["how"] == "concat" and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 0):
        return None
    return ShardInfo(dim if shard["how"] == "concat" else None, shard["how"], shard["group"])


def parallel_coords(dump: DumpFile, file_rank: str) -> dict[str, int]:
    """The manifest's ``parallel`` groups plus ``world_rank``/``world_size`` (from its rank and
    world_size, else the file name's rank)."""
    manifest = dump.manifest or {}
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


def _declared_groups(dump: DumpFile) -> set[str]:
    return {spec.group for spec in (shard_of(dump, key) for key in dump.members) if spec is not None}


@dataclass
class Replica:
    """One whole copy of a key on the merged side: the (rank, file) pairs holding it, in shard
    order. Unsharded keys have one replica per rank (one part each)."""

    key: str
    shard: ShardInfo | None
    parts: list[tuple[str, DumpFile]]

    @property
    def ranks(self) -> list[str]:
        return [rank for rank, _ in self.parts]

    def arrays(self) -> list[np.ndarray]:
        return [dump.array(self.key) for _, dump in self.parts]

    def combine(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The merged array: the shards concatenated along the shard dim, or added in float64
        (int64 for integers)."""
        if self.shard is None:
            return arrays[0]
        if self.shard.how == "concat":
            return np.concatenate(arrays, axis=self.shard.dim)
        total = np.zeros(arrays[0].shape, np.int64 if np.issubdtype(arrays[0].dtype, np.integer) else np.float64)
        for array in arrays:
            total += array
        return total


class MergedDump:
    """The files of one side of a sharded multi-rank run, seen as one dump.

    A key declared as a shard (manifest ``keys[k].shard``) is merged across the ranks of its
    group (ordered by ``<group>_rank``); ranks that differ in another declared group (e.g. the
    expert-parallel rank for a tensor-parallel key) hold separate replicas, each compared. A key
    without a declaration is compared on every rank that holds it. Offers what
    :func:`compare_pair` needs of a :class:`DumpFile`: ``members``, ``infos``, ``manifest``,
    ``notes``, ``bad_members``, ``path``; ``replicas[key]`` replaces ``array(key)``.
    """

    def __init__(self, ranked: list[tuple[str, DumpFile]], label: str, declared: set[str]) -> None:
        self.label = label
        self.ranked = ranked
        self.ranks = [rank for rank, _ in ranked]
        directory = ranked[0][1].path.parent
        self.path = f"{directory} [ranks {'+'.join(self.ranks)} merged]"
        self.notes = [f"rank {rank}: {note}" for rank, dump in ranked for note in dump.notes]
        self.bad_members = {key: f"rank {rank}: {why}" for rank, dump in ranked for key, why in dump.bad_members.items()}
        self.merge_problems: list[tuple[str, str, str]] = []  # (kind, key, detail)
        self.unmerged: dict[str, str] = {}
        self.members: dict[str, Member] = {}
        self.replicas: dict[str, list[Replica]] = {}
        self.shards: dict[str, ShardInfo] = {}
        self._declared = declared
        self._coords = {rank: parallel_coords(dump, rank) for rank, dump in ranked}
        infos: dict[str, KeyInfo] = {}
        for _, dump in ranked:
            for key, info in dump.infos.items():
                infos.setdefault(key, info)
        for key in infos:
            if key not in self.bad_members:
                self._plan(key)
        self.infos = {key: info for key, info in infos.items() if key in self.members}
        self.manifest = self._manifest()

    def _unmerged(self, kind: str, key: str, detail: str) -> None:
        self.unmerged[key] = detail
        self.merge_problems.append((kind, key, detail))

    def _plan(self, key: str) -> None:
        holders = [(rank, dump) for rank, dump in self.ranked if key in dump.members]
        specs = {shard_of(dump, key) for _, dump in holders}
        if len(specs) > 1:
            self._unmerged("shard_mismatch", key, "ranks declare different shards for this key: "
                           + ", ".join(sorted(spec.describe() if spec else "none" for spec in specs)))
            return
        spec = specs.pop()
        members = [dump.members[key] for _, dump in holders]
        if len({member.is_integer for member in members}) > 1:
            self._unmerged("shard_mismatch", key, "integer on some ranks, float on others")
            return
        if spec is None:
            if len({member.shape for member in members}) > 1:
                self._unmerged("shard_mismatch", key, "unsharded key with different shapes on different ranks: "
                               + ", ".join(f"rank {rank} {list(m.shape)}" for (rank, _), m in zip(holders, members)))
                return
            missing = [rank for rank in self.ranks if rank not in {rank for rank, _ in holders}]
            if missing:
                self.merge_problems.append(("missing_on_rank", key,
                                            f"unsharded key present on ranks {'+'.join(r for r, _ in holders)} only, "
                                            f"not on {'+'.join(missing)}; compared where present"))
            self.replicas[key] = [Replica(key, None, [holder]) for holder in holders]
            self.members[key] = members[0]
            return
        replicas = self._shard_replicas(key, spec, holders)
        if replicas is None:
            return
        shapes = [[list(dump.members[key].shape) for _, dump in replica.parts] for replica in replicas]
        merged_shape = self._merged_shape(key, spec, shapes)
        if merged_shape is None:
            return
        self.replicas[key] = replicas
        self.shards[key] = spec
        first = members[0]
        self.members[key] = Member(key, first.dtype, tuple(merged_shape), False, "", None)

    def _shard_replicas(self, key: str, spec: ShardInfo, holders) -> list[Replica] | None:
        rank_name = "world_rank" if spec.group == "world" else f"{spec.group}_rank"
        size_name = "world_size" if spec.group == "world" else f"{spec.group}_size"
        unordered = [rank for rank, _ in holders if rank_name not in self._coords[rank]]
        if unordered:
            self._unmerged("shard_incomplete", key,
                           f"{spec.describe()}: the manifest of rank(s) {'+'.join(unordered)} has no {rank_name} "
                           f"(compiledump.set_parallel({rank_name}=...)); not merged")
            return None
        # Ranks that differ in another declared group hold separate copies of this key.
        ignore = {"world_rank", "world_size", rank_name} | ({f"{g}_rank" for g in self._declared}
                                                             if spec.group == "world" else set())
        by_copy: dict[tuple, list[tuple[str, DumpFile]]] = {}
        for rank, dump in holders:
            copy = tuple(sorted((n, v) for n, v in self._coords[rank].items() if n not in ignore))
            by_copy.setdefault(copy, []).append((rank, dump))
        replicas = []
        for parts in by_copy.values():
            parts.sort(key=lambda part: self._coords[part[0]][rank_name])
            positions = [self._coords[rank][rank_name] for rank, _ in parts]
            sizes = {self._coords[rank].get(size_name) for rank, _ in parts} - {None}
            size = sizes.pop() if len(sizes) == 1 else len(parts)
            if positions != list(range(size)):
                self._unmerged("shard_incomplete", key,
                               f"{spec.describe()}: {rank_name} {positions} present (ranks {'+'.join(r for r, _ in parts)}), "
                               f"expected 0..{size - 1}; not merged")
                return None
            replicas.append(Replica(key, spec, parts))
        return replicas

    def _merged_shape(self, key: str, spec: ShardInfo, shapes: list[list[list[int]]]) -> list[int] | None:
        merged = None
        for replica_shapes in shapes:
            first = replica_shapes[0]
            if spec.how == "sum":
                ok = all(shape == first for shape in replica_shapes)
                shape = first
            else:
                ok = spec.dim < len(first) and all(
                    len(shape) == len(first) and all(a == b for i, (a, b) in enumerate(zip(shape, first)) if i != spec.dim)
                    for shape in replica_shapes)
                shape = list(first)
                if ok:
                    shape[spec.dim] = sum(s[spec.dim] for s in replica_shapes)
            if not ok or (merged is not None and shape != merged):
                self._unmerged("shard_mismatch", key, f"{spec.describe()}: shard shapes {replica_shapes} do not merge")
                return None
            merged = shape
        return merged

    def _manifest(self) -> dict | None:
        manifests = [dump.manifest for _, dump in self.ranked if dump.manifest is not None]
        if not manifests:
            return None
        drops: dict[str, int] = {}
        for manifest in manifests:
            for reason, count in (manifest.get("drops") or {}).items():
                if isinstance(count, int):
                    drops[reason] = drops.get(reason, 0) + count
        keys: dict = {}
        for manifest in manifests:
            for key, entry in manifest["keys"].items():
                keys.setdefault(key, entry)
        return dict(manifests[0], keys=keys, drops=drops, merged_ranks=self.ranks)


def merge_side(files: dict[str, Path], label: str) -> list[MergedDump] | None:
    """The merged shard sets of one side's per-rank files, or None when no manifest declares a
    shard. Files whose ``parallel`` coordinates differ in anything but the declared groups'
    ranks (e.g. ``dp_rank``) form separate sets."""
    dumps = [(rank, DumpFile(files[rank], label)) for rank in sorted(files, key=_rank_sort_key)]
    declared: set[str] = set()
    for _, dump in dumps:
        declared |= _declared_groups(dump)
    if not declared:
        return None
    ignore = {"world_rank", "world_size"} | {f"{group}_rank" for group in declared}
    sets: dict[tuple, list[tuple[str, DumpFile]]] = {}
    for rank, dump in dumps:
        coords = parallel_coords(dump, rank)
        sets.setdefault(tuple(sorted((n, v) for n, v in coords.items() if n not in ignore)), []).append((rank, dump))
    return [MergedDump(ranked, label, declared) for ranked in sets.values()]


def _badness(record: dict) -> tuple:
    """Orders comparison results from best to worst (for picking the worst replica or rank)."""
    if "mismatched_elements" in record:
        return (record["divergent"], record["mismatched_elements"], 0.0)
    return (record["divergent"], record.get("nonfinite_mismatch") or 0, record.get("rel_diff") or 0.0)


def _rank_entry(rank: str, result: dict, part: list[int] | None = None) -> dict:
    entry = {"rank": rank, "divergent": result["divergent"]}
    if part is not None:
        entry["slice"] = part
    for name in ("rel_diff", "max_abs", "nonfinite_mismatch", "mismatched_elements"):
        if name in result:
            entry[name] = result[name]
    return entry


def _compare_merged_key(record: dict, ref, run, info: KeyInfo, options: CompareOptions, logits_tags: set[str],
                        workspace: Workspace) -> None:
    """Compare one key when one side is a :class:`MergedDump`: every replica of the merged side
    against the single side (the record keeps the worst), and, for concatenated shards, each
    rank's shard against the matching slice of the single side, so the worst rank can be named.
    Partial sums cannot be attributed to one rank: their ``worst_rank`` is None."""
    merged_is_ref = isinstance(ref, MergedDump)
    merged, single = (ref, run) if merged_is_ref else (run, ref)
    key = info.key
    other = np.asarray(single.array(key))
    base = dict(record)
    trials = []
    for replica in merged.replicas[key]:
        arrays = replica.arrays()
        whole = replica.combine(arrays)
        flat_other = other.reshape(whole.shape)
        trial = dict(base)
        _fill_metrics(trial, *((whole, flat_other) if merged_is_ref else (flat_other, whole)), info, options,
                      logits_tags, workspace)
        ranks = []
        if replica.shard is None:
            ranks.append(_rank_entry(replica.ranks[0], trial))
        elif replica.shard.how == "concat":
            start = 0
            for rank, part in zip(replica.ranks, arrays):
                stop = start + part.shape[replica.shard.dim]
                piece = np.take(flat_other, np.arange(start, stop), axis=replica.shard.dim)
                result = dict(base)
                _fill_metrics(result, *((part, piece) if merged_is_ref else (piece, part)), info, options,
                              logits_tags, workspace, margins=False)
                ranks.append(_rank_entry(rank, result, [start, stop]))
                start = stop
        else:
            ranks.extend({"rank": rank, "partial_sum": True} for rank in replica.ranks)
        trials.append((trial, ranks))
        del arrays, whole
    worst, _ = max(trials, key=lambda item: _badness(item[0]))
    record.clear()
    record.update(worst)
    shard = merged.shards.get(key)
    record["merge"] = shard.describe() if shard is not None else "each rank"
    record["merged_ranks"] = merged.ranks
    record["ranks"] = [entry for _, ranks in trials for entry in ranks]
    rated = [entry for entry in record["ranks"] if "divergent" in entry]
    record["divergent_ranks"] = [entry["rank"] for entry in rated if entry["divergent"]]
    record["worst_rank"] = None
    if record["divergent"] and rated:
        worst_entry = max(rated, key=_badness)
        record["worst_rank"] = worst_entry["rank"]
        record["worst_rank_value"] = worst_entry.get("rel_diff", worst_entry.get("mismatched_elements"))


# --------------------------------------------------------------------------------------------
# The whole comparison
# --------------------------------------------------------------------------------------------


def compare(ref_path: str | Path, run_path: str | Path, options: CompareOptions | None = None) -> dict:
    """Compare REF and RUN (npz files or directories of per-rank files); return the report.

    Raises :class:`DumpError` for unusable input (missing path, not an npz, no dumps in a
    directory, no common rank or keys). The report is JSON-ready; see the README, "Comparing dumps".
    """
    options = options or CompareOptions()
    started = time.perf_counter()
    ref_files, ref_problems = collect_dumps(ref_path, "REF")
    run_files, run_problems = collect_dumps(run_path, "RUN")
    pairs, pair_problems = _merged_pairs(ref_files, run_files)
    if pairs is None:
        pairs, pair_problems = pair_dumps(ref_files, run_files)
    results = []
    empty: list[str] = []
    for rank, ref_file, run_file in pairs:
        try:
            ref_dump = ref_file if isinstance(ref_file, MergedDump) else DumpFile(ref_file, "REF")
            run_dump = run_file if isinstance(run_file, MergedDump) else DumpFile(run_file, "RUN")
            results.append(compare_pair(ref_dump, run_dump, options, rank))
        except NoCommonKeys as exc:
            # One rank without common keys is a problem to list; all of them is unusable input.
            empty.append(str(exc))
            pair_problems.append(_problem("no_common_keys", rank, str(exc)))
    if not results:
        raise DumpError(empty[0] if len(empty) == 1 else f"no keys in common for any of {len(empty)} rank pairs")
    return build_report(str(ref_path), str(run_path), options, results,
                        ref_problems + run_problems + pair_problems, time.perf_counter() - started)


def _merged_pairs(ref: dict[str, Path], run: dict[str, Path]) -> tuple[list | None, list[dict]]:
    """When one side is a single file and the other several per-rank files whose manifests
    declare shards, pair each merged shard set of the several with the single file (labelled
    by its ranks, e.g. ``0+1``). Returns (None, []) otherwise: files are paired by rank."""
    for single, several, label in ((ref, run, "RUN"), (run, ref, "REF")):
        if len(single) != 1 or len(several) < 2:
            continue
        merged = merge_side(several, label)
        if merged is None:
            continue
        (only,) = single.values()
        pairs = []
        for dump in merged:
            name = "+".join(dump.ranks)
            pairs.append((name, dump, only) if label == "REF" else (name, only, dump))
        return pairs, []
    return None, []


def build_report(ref: str, run: str, options: CompareOptions, pairs: list[dict], side_problems: list[dict],
                 elapsed: float) -> dict:
    """Combine per-rank results into the report: earliest divergence across ranks (by position in
    model order, then rank), earliest argmax flip (by step, then rank)."""

    def earliest(field_name: str, order) -> dict | None:
        found = [pair[field_name] for pair in pairs if pair[field_name] is not None]
        return min(found, key=order) if found else None

    by_position = lambda item: (item["position"], _rank_sort_key(item["rank"]))  # noqa: E731
    first = earliest("first_divergence", by_position)
    root_cause = None
    if first is not None:
        owner = next(pair for pair in pairs if pair["rank"] == first["rank"])
        root_cause = owner["root_cause"]
    report = {
        "format": REPORT_FORMAT,
        "format_version": 1,
        "ref": ref,
        "run": run,
        "threshold": options.threshold,
        "threshold_for": [[pattern, value] for pattern, value in options.overrides],
        "near_tie": ({"epsilon": options.near_tie} if options.near_tie is not None
                     else {"ulps_of_ref_top1": options.near_tie_ulps}),
        "first_divergence": first,
        "prefill_divergence": earliest("prefill_divergence", by_position),
        "decode_divergence": earliest("decode_divergence", by_position),
        "first_id_mismatch": earliest("first_id_mismatch", by_position),
        "root_cause": root_cause,
        "first_argmax_flip": earliest("first_argmax_flip", lambda item: (item["step"], _rank_sort_key(item["rank"]))),
        "keys": [record for pair in pairs for record in pair["keys"]],
        "problems": side_problems + [problem for pair in pairs for problem in pair["problems"]],
        "notes": [note for pair in pairs for note in pair["notes"]],
        "pairs": [{name: pair[name] for name in ("rank", "ref", "run", "ref_manifest", "run_manifest", "compared",
                                                 "divergent_keys", "first_divergence", "first_argmax_flip",
                                                 "decode_margins")} for pair in pairs],
        "elapsed_s": round(elapsed, 4),
    }
    report["exit_status"] = 1 if first is not None else 0
    return report


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None, so the report is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, np.generic):
        return json_safe(value.item())
    return value


def write_json_report(report: dict, path: str | Path) -> None:
    """Write the report as strict JSON (NaN/inf become null)."""
    Path(path).write_text(json.dumps(json_safe(report), indent=1, allow_nan=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Terminal output
# --------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _where(item: dict) -> str:
    parts = []
    if item.get("layer") is not None:
        parts.append(f"layer {item['layer']}")
    if item.get("step") is not None:
        parts.append(f"step {item['step']}")
    return f" ({', '.join(parts)})" if parts else ""


def describe_divergence(item: dict) -> str:
    """One phrase for a divergence summary: key, place and the metric that crossed."""
    text = f"{item['key']}{_where(item)}"
    metric = item["metric"]
    if metric == "rel_diff":
        text += f": rel_diff {item['value']:.3e} > threshold {item['threshold']:.1e}"
    elif metric == "nonfinite":
        text += f": {item['value']} positions NaN/Inf on one side only"
    elif metric == "ids":
        row = f"row {item['row']}" if item.get("row") is not None else "the ids"
        text += f": integer ids differ ({row}, overlap {item['overlap']}/{item['k']})"
    elif metric == "argmax":
        text += f": argmax flip with reference margin {item['value']:.4g} >= near-tie epsilon {item['threshold']:.3g}"
    if item.get("merge") is not None:
        text += f" [{_worst_rank_text(item)}]"
    return text


def _worst_rank_text(item: dict) -> str:
    """Which rank of a merged side a divergence comes from, as far as it can be told."""
    rank = item.get("worst_rank")
    if rank is None:
        if item["merge"].startswith("sum"):
            return f"merged {item['merge']}: partial sums, no single rank can be named"
        return f"merged {item['merge']}"
    value = item.get("worst_rank_value")
    if isinstance(value, float):
        detail = f" (rel_diff {value:.3e})"
    else:
        detail = f" ({value} ids differ)" if value is not None else ""
    divergent = item.get("divergent_ranks") or [rank]
    if item["merge"] == "each rank":
        if len(divergent) > 1 and len(divergent) == len(item.get("merged_ranks") or ()):
            return f"on every rank, worst rank {rank}{detail}"
        return f"on rank {'+'.join(divergent)} only, worst rank {rank}{detail}"
    others = f"; parts of ranks {'+'.join(divergent)} diverge" if len(divergent) > 1 else ""
    return f"worst rank {rank}: its part{detail}{others}"


def _note_for(record: dict) -> str:
    if record["status"] == "skipped":
        return "not compared (see problems)"
    parts = []
    if record.get("metric_kind") == "ids":
        if record["ids_equal"]:
            parts.append("ids equal")
        else:
            where = f"row {record['first_mismatch_row']}" if record.get("first_mismatch_row") is not None \
                else f"index {record['first_mismatch_index']}"
            parts.append(f"IDS DIFFER at {where}: overlap {record['overlap']}/{record['k']}, "
                         f"{record['mismatched_rows']}/{record['rows']} rows differ")
    if record.get("logits") and record.get("argmax_ref") is not None:
        flag = "" if record["argmax_equal"] else " FLIP"
        parts.append(f"argmax {record['argmax_ref']}|{record['argmax_run']}{flag} "
                     f"margin {_fmt(record['margin_ref'], '.3g')}|{_fmt(record['margin_run'], '.3g')}")
    if record.get("nonfinite_mismatch"):
        parts.append(f"{record['nonfinite_mismatch']} NaN/Inf mismatches")
    if record.get("merge") is not None:
        merged = f"ranks {'+'.join(record['merged_ranks'])}: {record['merge']}"
        if record["divergent"]:
            merged += f"; {_worst_rank_text(record)}"
        parts.append(merged)
    return "; ".join(parts)


def format_table(records: list[dict]) -> list[str]:
    """One line per key in order: ``!`` marks divergent rows, ``>`` the first divergence."""
    width = max([len(record["key"]) for record in records] + [3])
    width = min(width, 48)
    header = (f"  {'key':<{width}} {'layer':>5} {'step':>5} {'shape':<14} {'rel_diff':>10} {'cosine':>10} "
              f"{'max_abs':>10} {'mean_abs':>10} {'rel_l2':>9} {'nan':>7} {'inf':>7}  note")
    lines = [header]
    for record in records:
        mark = "!" if record["divergent"] else ("?" if record["status"] == "skipped" else " ")
        shape = "x".join(str(n) for n in record["shape_ref"]) or "scalar"
        floaty = record.get("metric_kind") == "float"
        nan = f"{record['nan_ref']}/{record['nan_run']}" if floaty else "-"
        inf = f"{record['inf_ref']}/{record['inf_run']}" if floaty else "-"
        lines.append(
            f"{mark} {record['key']:<{width}} {_fmt(record['layer'], 'd'):>5} {_fmt(record['step'], 'd'):>5} "
            f"{shape:<14} {_fmt(record.get('rel_diff'), '.3e'):>10} {_fmt(record.get('cosine'), '.6f'):>10} "
            f"{_fmt(record.get('max_abs'), '.3e'):>10} {_fmt(record.get('mean_abs'), '.3e'):>10} "
            f"{_fmt(record.get('rel_l2'), '.2e'):>9} {nan:>7} {inf:>7}  {_note_for(record)}".rstrip()
        )
    return lines


def format_report(report: dict, table: str = "all") -> list[str]:
    """The terminal report: per-rank tables, problems, the summary, and a last line that starts
    with ``first divergence:`` or ``no divergence``. ``table`` is all, divergent or none."""
    lines: list[str] = []
    many = len(report["pairs"]) > 1
    for pair in report["pairs"]:
        rank = f"rank {pair['rank']}: " if pair["rank"] != "?" else ""
        lines.append(f"== {rank}REF {pair['ref']}  vs  RUN {pair['run']}  (threshold {report['threshold']:.1e})")
        records = [record for record in report["keys"] if record["rank"] == pair["rank"]]
        if table == "divergent":
            records = [record for record in records if record["divergent"] or record["status"] == "skipped"]
        if table != "none" and records:
            lines.extend(format_table(records))
    for note in report["notes"]:
        lines.append(f"note: {note}")
    if report["problems"]:
        lines.append(f"problems: {len(report['problems'])}")
        for problem in report["problems"]:
            where = f" [rank {problem['rank']}]" if many and problem.get("rank") is not None else ""
            key = f"{problem['key']}: " if problem.get("key") else ""
            lines.append(f"  {problem['kind']}{where}: {key}{problem['detail']}")
    for pair in report["pairs"]:
        margins = pair["decode_margins"]
        if margins:
            smallest = margins["smallest_ref_margin"]
            prefix = f"rank {pair['rank']} " if many else ""
            lines.append(
                f"{prefix}decode margins ({', '.join(margins['tags'])}): argmax agrees at "
                f"{margins['argmax_agree']}/{margins['compared']} steps; smallest reference margin "
                f"{_fmt(smallest['value'], '.4g')} at step {smallest['step']}"
            )
    flip = report["first_argmax_flip"]
    if flip is not None:
        relation = "<" if flip["kind"] == "near-tie" else ">="
        lines.append(
            f"first argmax flip: step {flip['step']} ({flip['key']}): {flip['kind']} -- reference margin "
            f"{_fmt(flip['margin_ref'], '.4g')} {relation} epsilon {flip['epsilon']:.3g} "
            f"(argmax REF {flip['argmax_ref']}, RUN {flip['argmax_run']})"
        )
    prefill, decode = report["prefill_divergence"], report["decode_divergence"]
    if prefill is not None:
        what = f"layer {prefill['layer']}" if prefill["layer"] is not None else "key"
        lines.append(f"prefill: first divergent {what}: {describe_divergence(prefill)}; "
                     f"last good: {prefill['last_good'] or 'none (first prefill key)'}")
    if decode is not None:
        lines.append(f"decode: first divergent step {decode['step']}: {describe_divergence(decode)}; "
                     f"last good: {decode['last_good'] or 'none (first decode key)'}")
    if report["first_id_mismatch"] is not None and report["root_cause"] is None:
        lines.append(f"ids: first mismatch {describe_divergence(report['first_id_mismatch'])}")
    if report["root_cause"] is not None:
        lines.append(f"likely root cause: {describe_divergence(report['root_cause'])}, "
                     f"before the first float divergence")
    lines.append(final_line(report))
    return lines


def final_line(report: dict) -> str:
    """The report's last line: ``first divergence: ...`` or ``no divergence: ...``."""
    first = report["first_divergence"]
    rank = f" [rank {first['rank']}]" if first is not None and len(report["pairs"]) > 1 else ""
    if first is None:
        compared = sum(pair["compared"] for pair in report["pairs"])
        extra = f"; {len(report['problems'])} problems listed above" if report["problems"] else ""
        flip = report["first_argmax_flip"]
        tie = f"; near-tie argmax flip at step {flip['step']}" if flip is not None else ""
        return f"no divergence: {compared} keys compared, all within threshold{tie}{extra}"
    last = f"; last good: {first['last_good']}" if first.get("last_good") else ""
    cause = report["root_cause"]
    why = f"; likely root cause: {cause['key']}{_where(cause)} ids differ" if cause is not None else ""
    return f"first divergence: {describe_divergence(first)}{rank}{last}{why}"


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------


def write_plot(report: dict, path: str | Path) -> None:
    """Draw rel_diff per prefill key (log scale, threshold line) and the reference and run
    top-1/top-2 margins per decode step, argmax flips marked. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib (or compiledump[plot])") from None
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(12, 8))
    for pair in report["pairs"]:
        rank = pair["rank"]
        records = [record for record in report["keys"] if record["rank"] == rank
                   and record.get("metric_kind") == "float" and record["phase"] == "prefill"]
        if records:
            values = [max(record["rel_diff"], 1e-18) for record in records]
            top.semilogy(range(len(records)), values, marker=".", label=f"rank {rank}")
            bad = [(index, value) for index, (record, value) in enumerate(zip(records, values)) if record["divergent"]]
            if bad:
                top.scatter(*zip(*bad), color="red", zorder=3)
            first_bad = next((index for index, record in enumerate(records) if record["divergent"]), None)
            if first_bad is not None:
                top.axvline(first_bad, color="red", linestyle="--", linewidth=0.8)
            ticks = [(index, str(record["layer"])) for index, record in enumerate(records)
                     if record["layer"] is not None and (index == 0 or records[index - 1]["layer"] != record["layer"])]
            if ticks and len(report["pairs"]) == 1:
                stride = max(1, len(ticks) // 40)
                top.set_xticks([tick for tick, _ in ticks[::stride]], [label for _, label in ticks[::stride]])
        steps = [record for record in report["keys"] if record["rank"] == rank and record.get("margin_analysis")
                 and record.get("argmax_ref") is not None]
        if steps:
            tags = sorted({record["tag"] for record in steps})
            for tag in tags:
                tagged = [record for record in steps if record["tag"] == tag]
                xs = [record["step"] for record in tagged]
                bottom.plot(xs, [record["margin_ref"] for record in tagged], label=f"REF {tag} rank {rank}")
                bottom.plot(xs, [record["margin_run"] for record in tagged], linestyle="--",
                            label=f"RUN {tag} rank {rank}")
                diverged = next((record["step"] for record in tagged if record["divergent"]), None)
                if diverged is not None:
                    bottom.axvline(diverged, color="red", linestyle="--", linewidth=0.8)
                flips = [(record["step"], record["margin_ref"]) for record in tagged if not record["argmax_equal"]]
                if flips:
                    bottom.scatter(*zip(*flips), color="red", marker="x", zorder=3, label="argmax flip")
    top.axhline(report["threshold"], color="gray", linestyle=":", label=f"threshold {report['threshold']:.0e}")
    top.set_title("prefill: rel_diff per key (x ticks: layer)")
    top.set_ylabel("rel_diff")
    top.legend(loc="upper left", fontsize="small")
    bottom.set_title("decode: top-1 minus top-2 logit per step")
    bottom.set_xlabel("decode step")
    bottom.set_ylabel("margin")
    if bottom.lines:
        bottom.legend(loc="upper right", fontsize="small")
    first, cause = report["first_divergence"], report["root_cause"]
    title = "no divergence" if first is None else f"first divergence: {first['key']}{_where(first)}"
    if cause is not None:
        title += f"; likely root cause: {cause['key']} ids differ"
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(path, dpi=100)
    plt.close(figure)
