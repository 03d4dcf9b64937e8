"""`compiledump demo` and the built-in model it runs.

    model.py  a small deterministic hc_mult MoE model with capture points, and engine-style
              sessions (prefill, profile run, warm-up, padded decode; CUDA graph; export)
    run.py    the demo: reference vs engine run of that model, dumped and compared
"""

from .run import DemoError, run_demo

__all__ = ["DemoError", "run_demo"]
