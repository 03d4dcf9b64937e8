"""Load debug_dump.py (`../shared/seed/debug_dump.py`, the module compiledump replaces) as an independent reference.

The seed reads its settings from the environment at import time and imports
`deepinfer.utils.allow_cuda_sync`, so each load gets a fresh module instance, the given settings
and a stand-in for that one import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import sys
import types
from pathlib import Path

# The checkout's sibling folder `shared/` holds it (../shared/seed/debug_dump.py from the repo root).
SEED_PATH = Path(__file__).resolve().parents[3] / "shared" / "seed" / "debug_dump.py"
_COUNTER = itertools.count()


def load_seed(dump_dir, tokens: int = 0, moe_layers: int = 2, max_rows: int = 1):
    """A fresh seed module writing into `dump_dir`.

    Fails (never skips) when the seed is absent: the tests that use it are the evidence that
    compiledump's output stays compatible with it, and a skip would let a run pass without them.
    """
    if not SEED_PATH.exists():
        import pytest

        pytest.fail(f"the reference debug_dump.py is missing: expected at {SEED_PATH} (../shared/seed/ "
                    "next to the checkout)", pytrace=False)
    return load_debug_dump(SEED_PATH, dump_dir, tokens, moe_layers, max_rows)


def load_debug_dump(path, dump_dir, tokens: int = 0, moe_layers: int = 2, max_rows: int = 1):
    """A fresh instance of the debug_dump.py at `path` writing into `dump_dir` (also what the
    benchmarks time as the baseline: benchmarks/harness.py; no pytest needed)."""
    if "deepinfer.utils" not in sys.modules:
        package = types.ModuleType("deepinfer")
        utils = types.ModuleType("deepinfer.utils")
        utils.allow_cuda_sync = contextlib.nullcontext
        package.utils = utils
        sys.modules["deepinfer"] = package
        sys.modules["deepinfer.utils"] = utils
    env = {
        "DEEPINFER_DUMP_LAYERS": str(dump_dir),
        "DEEPINFER_DUMP_TOKENS": str(tokens),
        "DEEPINFER_DUMP_MOE_LAYERS": str(moe_layers),
        "DEEPINFER_DUMP_MAX_ROWS": str(max_rows),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        name = f"seed_debug_dump_{next(_COUNTER)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # torch.compile looks traced functions' modules up by name
        spec.loader.exec_module(module)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return module


def seed_dump(module) -> dict:
    """Flush the seed and load what it wrote, as {key: array}."""
    import numpy as np

    module.flush()
    files = sorted(Path(module._DUMP_DIR).glob("deepinfer_layers*.npz"))
    assert len(files) == 1, files
    with np.load(files[0]) as data:
        return {key: data[key] for key in data.files}
