"""Multi-rank metadata: this process's place in the parallel layout and shard declarations.

Everything here is host-side bookkeeping written into the manifest at flush. None of it is read
by a capture call, so it adds nothing to a compiled graph and may be set at any time before
the flush (it is read when the manifest is written).

- `set_parallel(tp_rank=1, tp_size=2, dp_rank=0)` records the caller's parallel groups under
  the manifest's top-level `"parallel"` field.
- `declare_shard("layer\\d+_up", dim=-1)` says that the keys of matching tags hold one rank's
  slice of a tensor split along `dim` across a group (`how="concat"`), or one rank's partial
  sum (`how="sum"`); the manifest marks each such key with `"shard": {dim, how, group}` and
  `compiledump compare` merges the ranks of a sharded run before comparing it with a
  single-process reference.

The rank and world size in the file name and manifest come from `RANK`, else torch.distributed;
the torch.distributed values are remembered once seen, so a flush at interpreter exit after
`destroy_process_group()` still writes under the same name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..format.spec import stream_step_tag
from .state import STATE

_GROUP_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_GROUP_KEY = re.compile(r"(?P<group>[A-Za-z][A-Za-z0-9]*)_(?P<what>rank|size)")
SHARD_HOWS = ("concat", "sum")
# The group every process belongs to: its rank and size are the manifest's rank and world_size.
WORLD = "world"


@dataclass(frozen=True)
class ShardSpec:
    """One `declare_shard` call."""

    pattern: str
    dim: int | None
    how: str
    group: str


def set_parallel(**groups: int) -> dict[str, int]:
    """Record this process's parallel groups for the manifest; returns what is recorded.

    Keyword names are `<group>_rank` and `<group>_size`, e.g.
    `set_parallel(tp_rank=1, tp_size=2, dp_rank=0, dp_size=2)`. Values are non-negative ints and
    a rank must be below its group's size when both are given. Each call replaces the previous
    groups (`set_parallel()` clears them). `declare_shard(..., group="tp")` needs `tp_rank`
    here: it orders the shards when `compiledump compare` merges them. Also remembers the
    torch.distributed rank and world size if a process group is initialized.
    """
    for name, value in groups.items():
        if not _GROUP_KEY.fullmatch(name):
            raise ValueError(
                f"compiledump.set_parallel: {name!r} is not of the form <group>_rank or <group>_size "
                "(e.g. tp_rank=1, tp_size=2)"
            )
        if _GROUP_KEY.fullmatch(name).group("group") == WORLD:
            raise ValueError(
                "compiledump.set_parallel: the world rank and size come from RANK/torch.distributed; "
                f"{name!r} cannot be set"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"compiledump.set_parallel: {name} must be a non-negative int, got {value!r}")
    for name, value in groups.items():
        group, what = name.rsplit("_", 1)
        size = groups.get(f"{group}_size")
        if what == "rank" and size is not None and value >= size:
            raise ValueError(f"compiledump.set_parallel: {name}={value} is not below {group}_size={size}")
        if what == "size" and value == 0:
            raise ValueError(f"compiledump.set_parallel: {name} must be positive")
    with STATE.lock:
        STATE.parallel_groups = dict(groups)
        _journal_change()
    observe_distributed()
    return dict(groups)


def get_parallel() -> dict[str, int]:
    """The groups given to `set_parallel` (a copy)."""
    with STATE.lock:
        return dict(STATE.parallel_groups)


def declare_shard(tags: str, dim: int | None = None, how: str = "concat", group: str = "tp") -> ShardSpec:
    """Declare that the keys of the tags matching `tags` are shards across the ranks of `group`.

    `tags` is a regular expression matched against the whole tag (`re.fullmatch`), so a plain
    tag name matches itself and `"layer\\d+_up"` matches every layer's. `how="concat"`: each
    rank stored its slice of a tensor split along `dim` of the *stored* array (e.g. `-1` or `0`
    for the hidden dim of a `record`, which stores one row); `compiledump compare` concatenates
    the slices in `<group>_rank` order. `how="sum"`: each rank stored a partial sum (e.g. the
    output of a row-parallel matmul before its all-reduce); they are added (`dim` must be None).
    `group` names a group given to `set_parallel` (`"tp"` needs `tp_rank`), or `"world"` for
    all ranks of the job (ordered by the process rank). A key matched by several declarations
    takes the last one. Returns the declaration.
    """
    if not isinstance(tags, str) or not tags:
        raise TypeError(f"compiledump.declare_shard: tags must be a non-empty regex string, got {tags!r}")
    try:
        compiled = re.compile(tags)
    except re.error as error:
        raise ValueError(f"compiledump.declare_shard: bad regex {tags!r}: {error}") from None
    if how not in SHARD_HOWS:
        raise ValueError(f"compiledump.declare_shard: how must be one of {SHARD_HOWS}, got {how!r}")
    if how == "concat" and (not isinstance(dim, int) or isinstance(dim, bool)):
        raise ValueError(f"compiledump.declare_shard({tags!r}): how='concat' needs an int dim, got {dim!r}")
    if how == "sum" and dim is not None:
        raise ValueError(f"compiledump.declare_shard({tags!r}): how='sum' takes no dim (got {dim!r})")
    if not isinstance(group, str) or not _GROUP_NAME.fullmatch(group):
        raise ValueError(f"compiledump.declare_shard: group must be a name like 'tp', got {group!r}")
    spec = ShardSpec(tags, dim, how, group)
    with STATE.lock:
        STATE.shards.append((compiled, spec))
        _journal_change()
    return spec


def withdraw_shard(tags: str) -> None:
    """Drop the declarations whose pattern is `tags` (instrument's own, of a model instrumented
    before: its tags may mean other values in this one)."""
    with STATE.lock:
        STATE.shards[:] = [(compiled, spec) for compiled, spec in STATE.shards if spec.pattern != tags]
        _journal_change()


def journal_parallel(live) -> None:
    """Journal the groups and shard declarations into crash-proof capture's `live` files: a rank
    killed before any flush is recovered with them (`compiledump recover`), so compare can still
    merge its shards with the other ranks'. Called with or without the registry lock held (the
    runtime is created under it): reads copies, which the GIL makes atomic."""
    groups, shards = dict(STATE.parallel_groups), [list(vars(spec).values()) for _, spec in list(STATE.shards)]
    live.write({"event": "parallel", "groups": groups, "shards": shards})


def _journal_change() -> None:
    """Journal the declarations as they are now (called with the registry lock held: of two
    threads' declarations, the journal's last event holds both)."""
    live = getattr(STATE.runtime, "live", None)
    if live is not None:
        journal_parallel(live)


def journaled_shards(shards: list) -> list:
    """The `shards` of a `parallel` journal event as `STATE.shards` holds them (pattern, spec)."""
    return [(re.compile(pattern), ShardSpec(pattern, dim, how, group)) for pattern, dim, how, group in shards]


def shard_for(tag: str) -> ShardSpec | None:
    """The last declaration whose pattern matches `tag` (or its prompt tag: `_match`), or None."""
    with STATE.lock:
        return _match(tag, list(STATE.shards))


def _match(tag: str, shards: list) -> ShardSpec | None:
    # A layer's step state (`layer<N>_step`, `layer<N>_mlp_step`, ...: instrument's) holds a row of
    # what its prompt tag holds, so a declaration of that tag covers it: a partial sum's row is a
    # partial sum (before, `declare_shard(r"layer\d+_mlp", how="sum")` left the steps' partial sums
    # to be compared as whole values: a false divergence at `layer0_mlp_step_1`).
    # Otherwise the last declaration matching either wins, except that one matching the step tag
    # and not its prompt tag (`layer\d+_mlp_step`: said of the steps alone) comes first.
    base = tag[: -len("_step")] if stream_step_tag(tag) else None
    if base is not None:
        for compiled, spec in reversed(shards):
            if compiled.fullmatch(tag) and not compiled.fullmatch(base):
                return spec
    for compiled, spec in reversed(shards):
        if compiled.fullmatch(tag) or (base is not None and compiled.fullmatch(base)):
            return spec
    return None


def observe_distributed() -> tuple[int | None, int | None]:
    """The torch.distributed rank and world size: current if a process group is initialized,
    else the last ones seen (None if never)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            STATE.dist_seen["rank"] = dist.get_rank()
            STATE.dist_seen["world_size"] = dist.get_world_size()
    except Exception:  # noqa: BLE001 - torch.distributed may be unusable at exit
        pass
    return STATE.dist_seen["rank"], STATE.dist_seen["world_size"]


def manifest_fields(keys: dict[str, dict], warn, declared: tuple[dict, list] | None = None) -> dict[str, int]:
    """Add `"shard"` to the manifest entries of declared keys (in place); return the groups.

    `warn(message)` is called for declarations that cannot apply: a dim outside the stored
    array's dimensions, or a group whose rank `set_parallel` was not given. Called by flush,
    which may already hold the registry lock (or, from a signal handler, must not wait for it):
    it reads copies of the declarations, which the GIL makes atomic. `declared`: (groups, shards)
    instead of this process's (recover: a dead process's, from its journal).
    """
    groups, shards = declared if declared is not None else (dict(STATE.parallel_groups), list(STATE.shards))
    for key, entry in keys.items():
        spec = _match(entry["tag"], shards)
        if spec is None:
            continue
        dim = spec.dim
        if dim is not None:
            ndim = len(entry["shape"])
            if not -ndim <= dim < ndim:
                warn(f"declare_shard({spec.pattern!r}, dim={dim}): key {key!r} has {ndim} dimension(s); "
                     "not marked as a shard")
                continue
            dim %= ndim
        if spec.group != WORLD and f"{spec.group}_rank" not in groups:
            warn(f"declare_shard({spec.pattern!r}, group={spec.group!r}): set_parallel() was not given "
                 f"{spec.group}_rank, so compare cannot order the shards")
        entry["shard"] = {"dim": dim, "how": spec.how, "group": spec.group}
    return groups
