"""``compiledump inspect``: list a dump's keys in model order with their statistics and the
manifest's configuration and drop counts. numpy only, like the comparator."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..format.keys import order_key_infos
from ..format.files import collect_dumps
from ..format.reader import DumpError, DumpFile, ShardInfo, preview, rank_sort_key
from ..format.routers import router_from_json
from .metrics import CHUNK_ELEMENTS
from .padding import unpadded
from .phases import exclude_patterns
from .table import fmt_value
from .text import nonfinite_text


def array_stats(array: np.ndarray, chunk: int = CHUNK_ELEMENTS) -> dict:
    """min, max and mean over the finite elements, and the NaN and Inf counts, read in chunks."""
    flat = np.ravel(array)
    low, high, total, finite = math.inf, -math.inf, 0.0, 0
    nan = inf = 0
    for start in range(0, flat.size, chunk):
        values = np.asarray(flat[start:start + chunk], dtype=np.float64)
        mask = np.isfinite(values)
        if not mask.all():
            nan += int(np.isnan(values).sum())
            inf += int((~mask).sum()) - int(np.isnan(values).sum())
            values = values[mask]
        if values.size:
            low = min(low, float(values.min()))
            high = max(high, float(values.max()))
            total += float(values.sum())
            finite += values.size
    return {
        "min": low if finite else None,
        "max": high if finite else None,
        "mean": total / finite if finite else None,
        "nan": nan,
        "inf": inf,
    }


def inspect_dump(dump: DumpFile) -> dict:
    """Everything ``inspect`` shows for one file, as a JSON-ready dict."""
    keys = []
    for info in order_key_infos(list(dump.infos.values())):
        member = dump.members[info.key]
        entry: dict[str, Any] = {
            "key": info.key, "kind": info.kind, "tag": info.tag, "layer": info.layer, "step": info.step,
            "shape": list(member.shape), "from_manifest": info.from_manifest,
            "dtype": str(member.read_dtype),  # a step of ids: stored as float32, read back as int32
        }
        shard = dump.shard(info.key)
        if shard is not None:
            entry["shard"] = {"dim": shard.dim, "how": shard.how, "group": shard.group}
        array = None
        try:
            array = dump.array(info.key)
            entry.update(array_stats(array))
        except (OSError, ValueError) as exc:
            entry["error"] = str(exc)
        finally:
            del array
        keys.append(entry)
    manifest = dump.manifest
    summary: dict[str, Any] = {"file": str(dump.path), "manifest": manifest is not None, "keys": keys,
                               "notes": list(unpadded(dump).notes),  # with how a padded request row is read
                               "unreadable": [{"key": key, "detail": why} for key, why in dump.bad_members.items()]}
    if manifest is not None:
        for name in ("format_version", "compiledump_version", "torch_version", "rank", "pid", "world_size",
                     "parallel", "device", "capture_path", "created_unix", "config", "drops", "filtered_tags",
                     "recovered", "ended_by"):
            summary[name] = manifest.get(name)
        routers = manifest.get("routers") if isinstance(manifest.get("routers"), dict) else {}
        summary["routers"] = {tag: (info.describe() if info is not None else "malformed: not used")
                              for tag, info in ((tag, router_from_json(entry)) for tag, entry in routers.items())}
        summary["exclude"] = exclude_patterns(manifest)  # instrument(exclude=...): tags never hooked
        if "first_nonfinite" in manifest:  # absent from dumps older than the non-finite counters
            summary["first_nonfinite"] = manifest["first_nonfinite"]
        summary["nonfinite_tags"] = {tag: entry["nonfinite"] for tag, entry in (manifest.get("tags") or {}).items()
                                     if isinstance(entry, dict) and isinstance(entry.get("nonfinite"), dict)}
        summary["tag_drops"] = {tag: entry.get("drops") for tag, entry in (manifest.get("tags") or {}).items()
                                if isinstance(entry, dict) and entry.get("drops")}
    return summary


def inspect_path(path: str | Path) -> list[dict]:
    """Inspect an npz file, or every dump file of a directory (by rank)."""
    files, _ = collect_dumps(path, "FILE")
    return [inspect_dump(DumpFile(files[rank], "FILE")) for rank in sorted(files, key=rank_sort_key)]


def format_inspection(summary: dict) -> list[str]:
    """Terminal lines for one inspected file."""
    lines = [f"== {summary['file']}"]
    if summary["manifest"]:
        lines.append(
            f"manifest: format_version {summary.get('format_version')}, compiledump "
            f"{summary.get('compiledump_version')}, torch {summary.get('torch_version')}, rank {summary.get('rank')}, "
            f"pid {summary.get('pid')}, world_size {summary.get('world_size')}, device {summary.get('device')}"
            + (f", capture path {summary['capture_path']}" if summary.get("capture_path") else "")
        )
        parallel = summary.get("parallel") or {}
        if parallel:
            lines.append("parallel: " + " ".join(f"{name}={value}" for name, value in parallel.items()))
        shards = [entry for entry in summary["keys"] if entry.get("shard")]
        if shards:
            described = [f"{entry['key']} ({ShardInfo(**entry['shard']).describe()})" for entry in shards]
            lines.append(f"shards: {len(shards)} keys: " + preview(described))
        routers = summary.get("routers") or {}
        if routers:  # declare_router: how the comparator judges these routers' expert ids
            lines.append(f"routers: {len(routers)} declared: "
                         + preview([f"{tag} ({described})" for tag, described in routers.items()], limit=4))
        config = summary.get("config") or {}
        lines.append("config: " + (" ".join(f"{name}={value}" for name, value in config.items()) or "-"))
        drops = summary.get("drops") or {}
        lines.append("drops: " + (", ".join(f"{reason}={count}" for reason, count in drops.items()) or "none"))
        for tag, tag_drops in (summary.get("tag_drops") or {}).items():
            lines.append(f"  {tag}: " + ", ".join(f"{reason}={count}" for reason, count in tag_drops.items()))
        if summary.get("exclude"):
            lines.append("instrument(exclude=...): " + ", ".join(summary["exclude"]) + " (those tags were never hooked)")
        filtered = summary.get("filtered_tags") or {}
        if filtered:
            lines.append("filtered tags: " + ", ".join(f"{tag} ({why})" for tag, why in filtered.items()))
        recovered = summary.get("recovered")
        if isinstance(recovered, dict):
            lines.append(f"recovered: by `compiledump recover` from {recovered.get('from')}; cause: "
                         f"{recovered.get('cause')}")
        ended = summary.get("ended_by")
        if isinstance(ended, dict):  # written as the process died (docs/format.md `ended_by`)
            lines.append("ended by: " + (f"an unhandled {ended.get('exception')}: {ended.get('message')}"
                                         if ended.get("exception") else f"signal {ended.get('signal')}"))
        if "first_nonfinite" in summary:
            first = summary["first_nonfinite"]
            mode = (summary.get("config") or {}).get("nonfinite", "read")
            lines.append("first non-finite: " + (nonfinite_text(first) if isinstance(first, dict) else
                                                 f"none seen by the capture kernels (COMPILEDUMP_NONFINITE={mode})"))
    else:
        lines.append("no manifest (legacy deepinfer_layers file): kinds, steps and order inferred from key "
                     "names and dtypes")
    for note in summary["notes"]:
        lines.append(f"note: {note}")
    for bad in summary["unreadable"]:
        lines.append(f"unreadable: {bad['key']}: {bad['detail']}")
    keys = summary["keys"]
    width = min(max([len(entry["key"]) for entry in keys] + [3]), 48)
    lines.append(f"  {'key':<{width}} {'kind':<11} {'layer':>5} {'step':>5} {'shape':<14} {'dtype':<8} "
                 f"{'min':>11} {'max':>11} {'mean':>11} {'nan':>6} {'inf':>6}")
    for entry in keys:
        shape = "x".join(str(n) for n in entry["shape"]) or "scalar"
        if "error" in entry:
            lines.append(f"  {entry['key']:<{width}} {entry['kind']:<11} unreadable: {entry['error']}")
            continue
        layer, step = fmt_value(entry["layer"], "d"), fmt_value(entry["step"], "d")
        low, high, mean = (fmt_value(entry[name], ".4g") for name in ("min", "max", "mean"))
        lines.append(
            f"  {entry['key']:<{width}} {entry['kind']:<11} {layer:>5} {step:>5} {shape:<14} {entry['dtype']:<8} "
            f"{low:>11} {high:>11} {mean:>11} {entry['nan']:>6} {entry['inf']:>6}"
        )
    counts: dict[str, int] = {}
    for entry in keys:
        counts[entry["kind"]] = counts.get(entry["kind"], 0) + 1
    steps = {entry["step"] for entry in keys if entry["step"] is not None}
    lines.append(f"{len(keys)} keys: " + ", ".join(f"{count} {kind}" for kind, count in counts.items())
                 + (f"; decode steps {min(steps)}..{max(steps)}" if steps else ""))
    return lines


__all__ = ["DumpError", "array_stats", "format_inspection", "inspect_dump", "inspect_path"]
