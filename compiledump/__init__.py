"""compiledump: layer dumps that survive torch.compile and CUDA graphs.

Capture calls (`record`, `record_step`, `record_ids`) are no-ops unless `COMPILEDUMP_DIR` is set
(or `configure(dir=...)` is called). docs/api.md describes the API and the settings;
docs/architecture.md the layout of this package.

The capture API is imported on first use, so `compiledump compare` and `compiledump inspect`
(numpy only) start without importing torch.
"""

from .version import __version__

# Public name -> the module that defines it (imported when the name is first used).
_LAZY = {
    **{name: "capture.api" for name in (
        "clear", "configure", "dump_stem", "flush", "get_config", "init", "prepare_kernels", "record", "record_ids",
        "record_step", "reset")},
    **{name: "capture.registers" for name in ("enabled", "profiling", "set_gather_rows", "set_rows")},
    **{name: "capture.parallel" for name in ("declare_shard", "get_parallel", "set_parallel")},
    "declare_router": "capture.routers",
    "instrument": "capture.instrument",
    "native_available": "ops.native",
    "VariantNotPrepared": "ops.variants",
    "KernelUnavailable": "ops.variants",
    "Config": "config",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    # Resolved once, then stored as a plain module attribute (also when first reached while
    # dynamo traces a model: it resolves module attributes by running this).
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'compiledump' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{module_name}", __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
