"""compiledump: layer dumps that survive torch.compile and CUDA graphs.

Capture calls (`record`, `record_step`, `record_ids`) are no-ops unless `COMPILEDUMP_DIR` is set
(or `configure(dir=...)` is called). See the README for the settings and the file format.
"""

__version__ = "0.1.0"

from .config import Config
from .runtime import (
    configure,
    dump_stem,
    enabled,
    flush,
    get_config,
    init,
    profiling,
    record,
    record_ids,
    record_step,
    reset,
    set_gather_rows,
    set_rows,
)

__all__ = [
    "Config",
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
]
