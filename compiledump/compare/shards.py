"""Merging the ranks of a sharded run (tensor/expert parallel), or the stages of a pipeline-parallel
one, into one side before comparing."""

from __future__ import annotations

from pathlib import Path

from ..format.keys import KeyInfo
from ..format.reader import Dump, DumpFile, KeyProblem, Member, Replica, ShardInfo, rank_sort_key


class MergedDump(Dump):
    """The files of one side of a sharded multi-rank run, seen as one dump.

    A key declared as a shard (manifest ``keys[k].shard``) is merged across the ranks of its
    group (ordered by ``<group>_rank``); ranks that differ in another declared group (e.g. the
    expert-parallel rank for a tensor-parallel key) hold separate replicas, each compared. A key
    without a declaration is compared on every rank that holds it (one replica per rank). With
    ``stages`` the ranks are pipeline stages, each holding its own layers' keys: a key one stage
    holds is not missing on the others.
    """

    def __init__(self, ranked: list[tuple[str, DumpFile]], label: str, declared: set[str], stages: bool = False) -> None:
        self.label = label
        self.stages = stages
        self.ranked = ranked
        self.merged_ranks = [rank for rank, _ in ranked]
        directory = ranked[0][1].path.parent
        self.path = f"{directory} [ranks {'+'.join(self.merged_ranks)} merged]"
        self.notes = [f"rank {rank}: {note}" for rank, dump in ranked for note in dump.notes]
        self.bad_members = {key: f"rank {rank}: {why}" for rank, dump in ranked for key, why in dump.bad_members.items()}
        self.problems = []
        self.excluded = set()
        self.members: dict[str, Member] = {}
        self._replicas: dict[str, list[Replica]] = {}
        self._declared = declared
        self._coords = {rank: dump.parallel_coords(rank) for rank, dump in ranked}
        infos: dict[str, KeyInfo] = {}
        for _, dump in ranked:
            for key, info in dump.infos.items():
                infos.setdefault(key, info)
        for key in infos:
            if key not in self.bad_members:
                self._plan(key)
        self.infos = {key: info for key, info in infos.items() if key in self.members}
        self.manifest = self._manifest()

    def replicas(self, key: str) -> list[Replica]:
        return self._replicas[key]

    def _exclude(self, kind: str, key: str, detail: str) -> None:
        self.excluded.add(key)
        self.problems.append(KeyProblem(kind, key, detail))

    def _plan(self, key: str) -> None:
        holders = [(rank, dump) for rank, dump in self.ranked if key in dump.members]
        specs = {dump.shard(key) for _, dump in holders}
        if len(specs) > 1:
            self._exclude("shard_mismatch", key, "ranks declare different shards for this key: "
                          + ", ".join(sorted(spec.describe() if spec else "none" for spec in specs)))
            return
        spec = specs.pop()
        members = [dump.members[key] for _, dump in holders]
        if len({member.is_integer for member in members}) > 1:
            self._exclude("shard_mismatch", key, "integer on some ranks, float on others")
            return
        if spec is None:
            if len({member.shape for member in members}) > 1:
                self._exclude("shard_mismatch", key, "unsharded key with different shapes on different ranks: "
                              + ", ".join(f"rank {rank} {list(m.shape)}" for (rank, _), m in zip(holders, members)))
                return
            held = {rank for rank, _ in holders}
            missing = [rank for rank in self.merged_ranks if rank not in held]
            if missing and not self.stages:
                self.problems.append(KeyProblem(
                    "missing_on_rank", key, f"unsharded key present on ranks {'+'.join(r for r, _ in holders)} only, "
                                            f"not on {'+'.join(missing)}; compared where present"))
            self._replicas[key] = [Replica(key, None, [holder]) for holder in holders]
            self.members[key] = members[0]
            return
        replicas = self._shard_replicas(key, spec, holders)
        if replicas is None:
            return
        shapes = [[list(dump.members[key].shape) for _, dump in replica.parts] for replica in replicas]
        merged_shape = self._merged_shape(key, spec, shapes)
        if merged_shape is None:
            return
        self._replicas[key] = replicas
        first = members[0]
        self.members[key] = Member(key, first.dtype, tuple(merged_shape), False, "", None, first.ids_in_floats)

    def _shard_replicas(self, key: str, spec: ShardInfo, holders) -> list[Replica] | None:
        rank_name = "world_rank" if spec.group == "world" else f"{spec.group}_rank"
        size_name = _size_name(spec.group)
        unordered = [rank for rank, _ in holders if rank_name not in self._coords[rank]]
        if unordered:
            self._exclude("shard_incomplete", key,
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
                self._exclude("shard_incomplete", key,
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
                self._exclude("shard_mismatch", key, f"{spec.describe()}: shard shapes {replica_shapes} do not merge")
                return None
            merged = shape
        return merged

    def rank_manifests(self) -> list[dict]:
        return [dump.manifest for _, dump in self.ranked if dump.manifest is not None]

    def _manifest(self) -> dict | None:
        manifests = self.rank_manifests()
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
        # The first NaN/Inf of any rank, by phase and step, then rank order (within one forward of
        # a pipeline an earlier stage's comes first; a tensor-parallel rank's shard may hold the
        # only one).
        firsts = [manifest["first_nonfinite"] for manifest in manifests if isinstance(manifest.get("first_nonfinite"), dict)]
        merged = dict(manifests[0], keys=keys, drops=drops, merged_ranks=self.merged_ranks,
                      first_nonfinite=min(firsts, key=_when, default=None))
        # Any rank recovered from a dead process: the merged side ends where that rank stopped.
        recovered = [(rank, dump.manifest["recovered"]) for rank, dump in self.ranked
                     if isinstance((dump.manifest or {}).get("recovered"), dict)]
        if recovered:
            merged["recovered"] = dict(recovered[0][1], cause="; ".join(
                f"rank {rank}: {entry.get('cause')}" for rank, entry in recovered))
        # Any rank an exception or a signal ended, the exception first (it is what the others'
        # signals followed: torchrun stops the ranks after one failed).
        ended = sorted(((rank, dump.manifest["ended_by"]) for rank, dump in self.ranked
                        if isinstance((dump.manifest or {}).get("ended_by"), dict)),
                       key=lambda item: "exception" not in item[1])
        if ended:
            merged["ended_by"] = dict(ended[0][1], rank=ended[0][0])
        if self.stages:  # each stage declared its own layers' mixers and routing: the model's are their union
            merged["mixers"] = {i: kind for manifest in manifests for i, kind in (manifest.get("mixers") or {}).items()}
            routings = [manifest.get("routing") or {} for manifest in manifests]
            merged["routing"] = {"routed": sorted(i for routing in routings for i in routing.get("routed", [])),
                                 "complete": all(routing.get("complete", False) for routing in routings),
                                 "moe_outputs": sorted(i for routing in routings
                                                       for i in routing.get("moe_outputs", []))}
            merged["tags"] = {tag: entry for manifest in manifests for tag, entry in (manifest.get("tags") or {}).items()}
            merged["filtered_tags"] = {tag: entry for manifest in manifests
                                       for tag, entry in (manifest.get("filtered_tags") or {}).items()}
        return merged


def _when(first: dict) -> tuple[int, int]:
    """A manifest `first_nonfinite`'s place in the run: the prompt's phase first, then by step."""
    step = first.get("step")
    return (0 if first.get("phase") == "prefill" else 1, step if isinstance(step, int) else 0)


def pipeline_stages(dumps: list[tuple[str, DumpFile]]) -> bool:
    """Whether the files are the ranks of one pipeline-parallel run: each manifest declares the
    decoder layers `instrument` tapped there (`mixers`), and they form two or more stages that
    share no layer (the ranks of one stage, its tensor-parallel ones, tap the same layers; data
    parallel ranks each tap every layer: one stage, not merged)."""
    stages = {frozenset((dump.manifest or {}).get("mixers") or {}) for _, dump in dumps}
    return len(stages) > 1 and all(stages) and sum(map(len, stages)) == len(frozenset().union(*stages))


def holds_a_part(dump: DumpFile, rank: str) -> bool:
    """Whether ``dump`` declares a shard of a group whose size, as its manifest states it, is
    over 1: some of its keys are one rank's part, not the whole value."""
    coords = dump.parallel_coords(rank)
    for key in dump.members:
        spec = dump.shard(key)
        if spec is not None and coords.get(_size_name(spec.group), 1) > 1:
            return True
    return False


def _size_name(group: str) -> str:
    return "world_size" if group == "world" else f"{group}_size"


def _missing_members(ranked: list[tuple[str, DumpFile]], declared: set[str]) -> bool:
    """Whether a set of ranks holds fewer ranks of a declared group than its manifests' size says."""
    for group in declared - {"world"}:
        sizes = {dump.parallel_coords(rank).get(f"{group}_size") for rank, dump in ranked} - {None}
        if sizes and max(sizes) > len(ranked):
            return True
    return False


def merge_side(files: dict[str, Path], label: str) -> list[MergedDump] | None:
    """The merged shard sets of one side's per-rank files, or None when no manifest declares a
    shard. Files whose ``parallel`` coordinates differ in anything but the declared groups'
    ranks (e.g. ``dp_rank``) form separate sets."""
    dumps = [(rank, DumpFile(files[rank], label)) for rank in sorted(files, key=rank_sort_key)]
    declared: set[str] = set()
    for _, dump in dumps:
        declared |= {spec.group for spec in (dump.shard(key) for key in dump.members) if spec is not None}
    if not declared:
        # Pipeline stages (of tensor-parallel ranks, as the case may be) merge; data-parallel
        # replicas, told apart by their other `parallel` coordinates (dp_rank), form separate sides
        model_parallel = ("world_", "tp_", "pp_", "ep_")
        replicas: dict[tuple, list[tuple[str, DumpFile]]] = {}
        for rank, dump in dumps:
            coords = dump.parallel_coords(rank)
            replicas.setdefault(tuple(sorted((n, v) for n, v in coords.items() if not n.startswith(model_parallel))),
                                []).append((rank, dump))
        staged = [ranked for ranked in replicas.values() if pipeline_stages(ranked)]
        return [MergedDump(ranked, label, declared, stages=True) for ranked in staged] if staged else None
    ignore = {"world_rank", "world_size"} | {f"{group}_rank" for group in declared}
    sets: dict[tuple, list[tuple[str, DumpFile]]] = {}
    undeclared = []  # ranks whose manifest has no coordinate at all (its declarations were lost)
    for rank, dump in dumps:
        coords = {n: v for n, v in dump.parallel_coords(rank).items() if not n.startswith("world_")}
        if not coords:
            undeclared.append((rank, dump))
            continue
        sets.setdefault(tuple(sorted((n, v) for n, v in coords.items() if n not in ignore)), []).append((rank, dump))
    if len(sets) == 1 and _missing_members(next(iter(sets.values())), declared):
        # Into the one set of the others, which lacks ranks: its keys are shard mismatches there,
        # rather than its part compared as the whole in a set of its own (a rank recovered without
        # its declarations). Beside a complete set it is a copy of its own (a TP=1 replica, a
        # reference file collected with the ranks), compared as one.
        (ranked,) = sets.values()
        ranked.extend(undeclared)
        ranked.sort(key=lambda item: rank_sort_key(item[0]))
    elif undeclared:
        sets.setdefault((), []).extend(undeclared)
    return [MergedDump(ranked, label, declared, stages=pipeline_stages(ranked)) for ranked in sets.values()]
