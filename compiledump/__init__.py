"""compiledump: layer dumps that survive torch.compile and CUDA graphs.

Capture calls (`record`, `record_step`, `record_ids`) are no-ops unless `COMPILEDUMP_DIR` is set
(or `configure(dir=...)` is called). See the README for the settings and the file format.

The capture API is imported on first use, so `compiledump compare` and `compiledump inspect`
(numpy only) start without importing torch.
"""

__version__ = "0.1.0"

_RUNTIME_API = (
    "configure",
    "dump_stem",
    "enabled",
    "flush",
    "get_config",
    "init",
    "profiling",
    "record",
    "record_ids",
    "record_step",
    "reset",
    "set_gather_rows",
    "set_rows",
)
# Multi-rank metadata (compiledump/parallel.py), imported lazily in the same way.
_PARALLEL_API = (
    "declare_shard",
    "get_parallel",
    "set_parallel",
)
__all__ = ["Config", "native_available", *_RUNTIME_API, *_PARALLEL_API]


def __getattr__(name):
    # Resolved once, then stored as a plain module attribute (also when first reached while
    # dynamo traces a model: it resolves module attributes by running this).
    if name in _RUNTIME_API:
        from . import runtime

        globals().update({api: getattr(runtime, api) for api in _RUNTIME_API})
        return globals()[name]
    if name in _PARALLEL_API:
        from . import parallel

        globals().update({api: getattr(parallel, api) for api in _PARALLEL_API})
        return globals()[name]
    if name == "native_available":
        from .native import native_available

        globals()["native_available"] = native_available
        return native_available
    if name == "Config":
        from .config import Config

        globals()["Config"] = Config
        return Config
    raise AttributeError(f"module 'compiledump' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
