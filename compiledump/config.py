"""Settings: the one table of every `COMPILEDUMP_*` variable, and the capture `Config`.

`ENV_VARS` lists every environment variable the project reads, wherever it is read; code reads
them through `env()`, which refuses a name missing from the table, and docs/api.md's variable
table is generated from it (tests/repo/test_docs.py keeps both in step). Variables with a
`field` become `Config` fields: read once at import, changeable with `compiledump.configure()`.
CMake options share the prefix but are not environment variables: `CMAKE_OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, default (as text), meaning and where it is read."""

    name: str
    default: str
    meaning: str
    field: str | None = None  # the Config field it sets, if any
    scope: str = "capture"  # capture | native | build | tests


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("COMPILEDUMP_DIR", "", "dump directory; unset disables capture entirely (every capture call is a "
           "no-op that adds nothing to a compiled graph)", "dir"),
    EnvVar("COMPILEDUMP_TOKENS", "auto", "token gate of `record` (without `once`) and `record_ids`: keep only "
           "tensors whose `shape[0]` is the prompt length, others are counted as `token_gate`. `auto`: the prompt "
           "length is the token count of the first capture outside `profiling()`; a number fixes it; `0` turns "
           "the gate off (every call overwrites: debug_dump.py's behaviour)", "tokens"),
    EnvVar("COMPILEDUMP_ROWS", "one", "which rows `record` keeps of a `[tokens, dim]` or `[tokens, hc_mult, dim]` "
           "tensor: `one` (the last, or the one `set_gather_rows` names) or `all` (every token of the gated "
           "prompt, stored as `[tokens, dim]`); `record(..., rows=...)` overrides it per call", "rows"),
    EnvVar("COMPILEDUMP_MOE_LAYERS", "2", "keep `layer<N>_<x>` tags of `record`, `record_ids` and "
           "`record_step(..., moe_filtered=True)` only for N below this (a bare `layer<N>` always; of `instrument`'s "
           "tags an MoE layer's `_router`, `_topk`, step routing, MoE block `_mlp` and shared expert `_shared_mlp`, "
           "and in a model with MoE layers every layer's attention `_mixer`; not `_attn` or a dense layer's `_mlp`). A layer index, as debug_dump.py's: where a model's first MoE "
           "layer is at or past it (DeepSeek-V3's and GLM-4.5's first three layers are dense) `instrument` warns, "
           "naming the value that keeps its first MoE layers (`5` for DeepSeek-V3 at the default)", "moe_layers"),
    EnvVar("COMPILEDUMP_MAX_ROWS", "1", "`record_step` is skipped (counted as `rows_gate`) while the last "
           "`set_rows` value exceeds this", "max_rows"),
    EnvVar("COMPILEDUMP_MAX_STEPS", "256", "steps kept per `record_step` tag; later ones are counted as "
           "`step_capacity` drops (a tag named as a layer's step state keeps `COMPILEDUMP_LAYER_STEPS`)", "max_steps"),
    EnvVar("COMPILEDUMP_LAYER_STEPS", "16", "forwards (decode steps) of which each decoder layer's output, "
           "the stream after its attention and its MLP's output are kept for the token of that forward's logits "
           "(`layer<N>_step_<n>`, `layer<N>_attn_step_<n>`, `layer<N>_mlp_step_<n>` or `_mixer_step_<n>`, which "
           "`instrument` records, so "
           "that a decode-only bug is named at its layer and sublayer); later ones are counted as `layer_steps` (a "
           "filter). The same limit holds for a hand-written `record_step` tag of these names (and `_shared_mlp_step`), whoever "
           "records it; the sublayers' states also share an eighth of the arena. `0`: `instrument` records none (a "
           "hand-written one then keeps `COMPILEDUMP_MAX_STEPS`). "
           "Capped by `COMPILEDUMP_MAX_STEPS`. Set by `configure()` after the arena exists, it applies to the step "
           "tags not captured yet", "layer_steps"),
    EnvVar("COMPILEDUMP_ARENA_MB", "256", "device arena size in MiB (all captures of a run); a tag that does "
           "not fit is counted as `arena_full`", "arena_mb"),
    EnvVar("COMPILEDUMP_MAX_TAGS", "1024", "distinct tags; more are counted as `tag_table_full`", "max_tags"),
    EnvVar("COMPILEDUMP_PERSIST", "auto", "crash-proof capture (docs/crashes.md): the arena, control block and "
           "a journal of the tags live in files under `<dir>/<stem>.live/`, so a killed or crashed process loses "
           "nothing captured (`compiledump recover DIR` turns them into a dump; a normal exit removes them). "
           "`auto`: on for CPU, off for CUDA; `1`: on, and on CUDA a host-mapped arena the kernels write over "
           "PCIe (on Linux 6.5 and later the directory must be on a tmpfs such as /dev/shm, else it falls back "
           "with a warning); `0`: off (the arena lives in process or device memory only)", "persist"),
    EnvVar("COMPILEDUMP_NONFINITE", "read", "NaN/Inf detection (the manifest's `first_nonfinite`): `read` "
           "counts them in what each kept capture reads; `all` in the whole input of every call outside "
           "`profiling()`, kept or not (one more pass over each captured tensor)", "nonfinite"),
    EnvVar("COMPILEDUMP_SIGNALS", "1", "`0`: install no SIGTERM/SIGINT handlers (the dump is then written at "
           "normal exit or by `flush()`)"),
    EnvVar("COMPILEDUMP_NATIVE", "", "the optional native op library: unset = use it if it was built into the "
           "package, `0` = never, `1` = required (an error if it cannot be loaded), or a path to the `.so`",
           scope="native"),
    EnvVar("COMPILEDUMP_CUDA_KERNEL", "triton", "the kernel of CUDA captures, read at import: `triton` (the "
           "Triton kernel, launched by Python after the tag registry's decision) or `native` (needs the native "
           "library built with CUDA: its region table decides in C++ and its CUDA kernel runs, no Python per call; "
           "not the default until compiled code has run it on a GPU, docs/compiling.md)", scope="native"),
    EnvVar("COMPILEDUMP_CPU_KERNEL", "", "tests only: `triton` runs the Triton kernel on CPU tensors (needs "
           "`TRITON_INTERPRET=1`) instead of the reference or native CPU kernel", scope="tests"),
    EnvVar("COMPILEDUMP_BUILD_NATIVE", "auto", "install time only (setup.py): `auto` builds the native library "
           "with CMake and ships it in the package where cmake, a C++ compiler and the installed torch are found, "
           "else installs pure Python with a note; `1` fails the install if it cannot be built; `0` never runs "
           "cmake", scope="build"),
    EnvVar("COMPILEDUMP_BUILD_DIR", "", "tests only: an already built CMake build directory (library + "
           "`compiledump_aoti_driver`) for the native and C++-driver tests, instead of the checkout's "
           "`build/native-<hash of torch's CMake prefix>`, the directory an editable install builds the library in, "
           "which they otherwise bring up to date once per run", scope="tests"),
    EnvVar("COMPILEDUMP_FUZZ_SCALE", "1", "tests only: multiplies the number of hypothesis examples of the fuzz "
           "tests", scope="tests"),
)
_BY_NAME = {var.name: var for var in ENV_VARS}

# CMake cache options (`cmake -D<NAME>=...`), documented in docs/export.md.
CMAKE_OPTIONS = ("COMPILEDUMP_INSTALL_DIR", "COMPILEDUMP_BUILD_DRIVER")

# COMPILEDUMP_TOKENS=auto: the prompt length is learned from the first capture outside profiling().
TOKENS_AUTO = "auto"

# Settings that size device allocations: fixed once the arena exists.
CAPACITY_FIELDS = frozenset({"max_steps", "arena_mb", "max_tags"})
# Settings that decide how the arena is allocated: also fixed once it exists.
ARENA_FIELDS = CAPACITY_FIELDS | {"persist"}


def env(name: str, environ=os.environ) -> str:
    """The value of a `COMPILEDUMP_*` variable (its default when unset or empty)."""
    var = _BY_NAME.get(name)
    if var is None:
        raise KeyError(f"compiledump: {name} is not in compiledump.config.ENV_VARS")
    return environ.get(name, "") or var.default


@dataclasses.dataclass(frozen=True)
class Config:
    """compiledump settings (see `ENV_VARS` for each field's variable and meaning).

    dir: dump directory; None disables capture entirely.
    tokens: the token gate of `record` (without once) and `record_ids`: "auto" (learn the prompt
        length from the first capture outside profiling()), a prompt length, or 0 (off).
    rows: which rows `record` keeps: "one" (the gathered row) or "all" (every prompt token).
    moe_layers: tags `layer<N>_<x>` are kept only for N < moe_layers (record, record_ids, and
        record_step with moe_filtered; a bare `layer<N>` always; instrument's MoE internals only).
    max_rows: `record_step` is skipped while the last `set_rows()` value exceeds it.
    max_steps: steps kept per `record_step` tag.
    layer_steps: steps kept of each layer's step states (`layer<N>_step`, `_attn_step`, `_mlp_step`); 0: none.
    arena_mb: size of the device arena that holds every capture (MiB).
    max_tags: number of distinct tags.
    persist: "auto" (file-backed arena on CPU), "1" (also on CUDA: host-mapped) or "0" (never);
        True and False are taken as "1" and "0".
    nonfinite: "read" (NaN/Inf counted in what kept captures read) or "all" (in every whole input).
    """

    dir: str | None = None
    tokens: int | str = TOKENS_AUTO
    rows: str = "one"
    moe_layers: int = 2
    max_rows: int = 1
    max_steps: int = 256
    layer_steps: int = 16
    arena_mb: int = 256
    max_tags: int = 1024
    persist: str = "auto"
    nonfinite: str = "read"

    def __post_init__(self):
        if isinstance(self.persist, bool):  # configure(persist=True): what the environment spells "1"
            object.__setattr__(self, "persist", "1" if self.persist else "0")
        if self.persist not in ("auto", "0", "1"):
            raise ValueError(f"compiledump: persist must be 'auto', '0' or '1' (or a bool), got {self.persist!r}")
        if self.nonfinite not in ("read", "all"):
            raise ValueError(f"compiledump: nonfinite must be 'read' or 'all', got {self.nonfinite!r}")
        if self.tokens != TOKENS_AUTO and (not isinstance(self.tokens, int) or isinstance(self.tokens, bool)
                                           or self.tokens < 0):
            raise ValueError(f"compiledump: tokens must be 'auto' or a non-negative int, got {self.tokens!r}")
        if self.rows not in ("one", "all"):
            raise ValueError(f"compiledump: rows must be 'one' or 'all', got {self.rows!r}")
        for field in ("moe_layers", "max_rows", "max_steps", "layer_steps", "arena_mb", "max_tags"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"compiledump: {field} must be a non-negative int, got {value!r}")
        for field in CAPACITY_FIELDS:
            if getattr(self, field) == 0:
                raise ValueError(f"compiledump: {field} must be positive")

    @property
    def active(self) -> bool:
        return bool(self.dir)

    @property
    def fixed_tokens(self) -> int:
        """The prompt length the token gate uses when it is fixed; 0 when off or "auto"."""
        return 0 if self.tokens == TOKENS_AUTO else self.tokens

    def persists(self, device) -> bool:
        """Whether the arena of `device` is file-backed (COMPILEDUMP_PERSIST)."""
        return self.persist == "1" or (self.persist == "auto" and device.type == "cpu")

    @property
    def arena_words(self) -> int:
        return self.arena_mb * (1 << 20) // 4


def from_env(environ=os.environ) -> Config:
    """Build a Config from the COMPILEDUMP_* environment variables (empty means default)."""
    values = {}
    for var in ENV_VARS:
        if var.field is None:
            continue
        raw = env(var.name, environ)
        if var.field == "dir":
            values["dir"] = raw or None
        elif var.field in ("rows", "persist", "nonfinite"):
            values[var.field] = raw.strip().lower()
        elif var.field == "tokens" and raw.strip().lower() == TOKENS_AUTO:
            values["tokens"] = TOKENS_AUTO
        else:
            try:
                values[var.field] = int(raw)
            except ValueError:
                hint = " or 'auto'" if var.field == "tokens" else ""
                raise ValueError(f"compiledump: {var.name} must be an integer{hint}, got {raw!r}") from None
    return Config(**values)


def env_table() -> str:
    """The markdown table of `ENV_VARS` that docs/api.md holds between its env-table markers
    (`python scripts/write_docs_tables.py` writes it; a test checks it is current)."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in ENV_VARS:
        default = f"`{var.default}`" if var.default else "unset"
        rows.append(f"| `{var.name}` | {default} | {var.meaning} |")
    return "\n".join(rows) + "\n"


def settings(config: Config) -> dict:
    """`config` as a plain dict (the manifest's "config")."""
    return dataclasses.asdict(config)
