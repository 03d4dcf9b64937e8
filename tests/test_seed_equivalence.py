"""Acceptance 2: the same keys, dtypes, shapes and values as the seed, eager and compiled."""

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import compiledump
from compiledump import arena
from compiledump.model import ModelConfig, TinyMoE, make_session, run_session

from seed_reference import load_seed, seed_dump

CFG = ModelConfig(layers=4, captures_per_layer=3)
PROMPT = 7


def _assert_same_dump(expected: dict, got: dict, rtol: float) -> None:
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        have = got[key]
        assert have.dtype == want.dtype, key
        assert have.shape == want.shape, key
        if want.dtype.kind == "f":
            atol = rtol * float(np.abs(want).max())
            np.testing.assert_allclose(have, want, rtol=rtol, atol=atol, err_msg=key)
        else:
            np.testing.assert_array_equal(have, want, err_msg=key)


@pytest.fixture(scope="module")
def seed_reference(tmp_path_factory):
    """The seed's dump of the scenario (eager, fp32), computed once."""
    session = make_session(CFG, prompt_len=PROMPT, steps=32, pad_rows=3)
    seed = load_seed(tmp_path_factory.mktemp("seed"), tokens=PROMPT)
    run_session(TinyMoE(CFG, dump=seed), seed, session)
    return session, seed_dump(seed)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_same_dump_as_seed(dump_dir, seed_reference, mode):
    session, expected = seed_reference
    compiledump.configure(tokens=PROMPT)
    model = TinyMoE(CFG, dump=compiledump)
    forward = torch.compile(model, fullgraph=True) if mode == "compiled" else model
    counters.clear()
    assert arena.ACTIVE is None  # the first capture happens inside the forward (while tracing)
    graphs_after_first_decode = []

    def on_step(step):
        if step == 0:
            graphs_after_first_decode.append(counters["stats"]["unique_graphs"])

    run_session(forward, compiledump, session, on_step=on_step)
    path = compiledump.flush()
    with np.load(path) as data:
        got = {key: data[key] for key in data.files}

    # Sanity of the reference itself: it has every kind of key we claim to match.
    assert {"layer0", "layer3", "layer0_topk", "layer1_moe_out", "logits", "logits_31"} <= set(expected)
    assert "layer2_topk" not in expected  # MoE filter (default 2 layers)
    _assert_same_dump(expected, got, rtol=1e-5 if mode == "eager" else 1e-4)
    if mode == "compiled":
        assert counters["stats"]["unique_graphs"] == graphs_after_first_decode[0]
