"""Settings, read from the environment once and changeable with `compiledump.configure()`."""

from __future__ import annotations

import dataclasses
import os

# Variable name -> (field, default). The README documents each one.
ENV_VARS = {
    "COMPILEDUMP_DIR": ("dir", None),
    "COMPILEDUMP_TOKENS": ("tokens", 0),
    "COMPILEDUMP_MOE_LAYERS": ("moe_layers", 2),
    "COMPILEDUMP_MAX_ROWS": ("max_rows", 1),
    "COMPILEDUMP_MAX_STEPS": ("max_steps", 256),
    "COMPILEDUMP_ARENA_MB": ("arena_mb", 256),
    "COMPILEDUMP_MAX_TAGS": ("max_tags", 1024),
}

# Settings that size device allocations: fixed once the arena exists.
CAPACITY_FIELDS = frozenset({"max_steps", "arena_mb", "max_tags"})


@dataclasses.dataclass(frozen=True)
class Config:
    """compiledump settings.

    dir: dump directory; None disables capture entirely (every capture call is a no-op that
        adds nothing to a compiled graph).
    tokens: if > 0, `record` (without once) and `record_ids` keep only tensors whose
        `shape[0]` equals it (filters an engine's dummy/profile forwards by prompt length).
    moe_layers: tags `layer<N>_<x>` are kept only for N < moe_layers.
    max_rows: `record_step` is skipped while the last `set_rows()` value exceeds it.
    max_steps: steps kept per `record_step` tag; later steps are counted as dropped.
    arena_mb: size of the device arena that holds every capture (MiB).
    max_tags: number of distinct tags; further tags are counted as dropped.
    """

    dir: str | None = None
    tokens: int = 0
    moe_layers: int = 2
    max_rows: int = 1
    max_steps: int = 256
    arena_mb: int = 256
    max_tags: int = 1024

    def __post_init__(self):
        for field in ("tokens", "moe_layers", "max_rows", "max_steps", "arena_mb", "max_tags"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"compiledump: {field} must be a non-negative int, got {value!r}")
        for field in ("max_steps", "arena_mb", "max_tags"):
            if getattr(self, field) == 0:
                raise ValueError(f"compiledump: {field} must be positive")

    @property
    def active(self) -> bool:
        return bool(self.dir)

    @property
    def arena_words(self) -> int:
        return self.arena_mb * (1 << 20) // 4


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"compiledump: {name} must be an integer, got {raw!r}") from None


def from_env(environ=os.environ) -> Config:
    """Build a Config from the COMPILEDUMP_* environment variables (empty means default)."""
    values = {}
    for name, (field, default) in ENV_VARS.items():
        raw = environ.get(name, "")
        if raw == "":
            values[field] = default
        elif field == "dir":
            values[field] = raw
        else:
            values[field] = _parse_int(name, raw)
    return Config(**values)
