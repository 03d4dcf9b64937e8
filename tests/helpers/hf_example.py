"""`examples/hf_reference_vs_compiled.py`, imported once as `ex`: the tests build their Hugging
Face models, inputs and engines with the example's own code, as its users do."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "hf_example", Path(__file__).resolve().parents[2] / "examples" / "hf_reference_vs_compiled.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)
