"""examples/hf_reference_vs_compiled.py's flow, as the tests of real models run it: the float32 eager
reference against the same model as a bf16 engine compiled with fullgraph (a static cache, a padded
batch of 4, 6 decode steps), honest and then with x1.05 on layer 1's experts in the same graphs."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import compiledump
from compiledump.compare import compare
from helpers.hf_example import ex as example


def honest_and_broken(build, tmp_path: Path):
    """(honest report, broken report, the engine's compiled graphs, graph breaks it added) for two
    models ``build()`` makes with the same weights; compiledump and dynamo are reset afterwards."""
    from torch._dynamo.utils import counters

    inputs = example.Inputs(211, steps=6, batch=4)
    reference = example.run_reference(build(), inputs, tmp_path / "ref", rows="all")
    engine = example.Engine(build(), inputs, dtype=torch.bfloat16, rows="all")
    breaks = sum(counters["graph_break"].values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        honest = compare(reference, engine.run(tmp_path / "honest"))
        example.inject(engine.model, "experts", layer=1, scale=1.05)
        broken = compare(reference, engine.run(tmp_path / "broken"))
    engine.handle.remove()
    compiledump.reset()
    torch._dynamo.reset()
    return honest, broken, engine.graphs, sum(counters["graph_break"].values()) - breaks
