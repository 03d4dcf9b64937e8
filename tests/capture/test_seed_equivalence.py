"""The same keys, dtypes, shapes and values as the seed (debug_dump.py), eager and compiled, and
per tag the same calls, kept captures and filter decisions as the seed made them."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import compiledump
from compiledump.capture.state import STATE
from compiledump.demo.model import ModelConfig, TinyMoE, make_session, run_session

from helpers.seed import load_seed, seed_dump

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


class SeedLedger:
    """The seed module behind its own API, noting per tag what it did with each call: calls,
    writes, and why it skipped the others (seen from its state, not re-derived). compiledump's
    manifest must tell the same story: calls, kept, and drops by reason."""

    def __init__(self, seed):
        self.seed = seed
        self.calls, self.passed, self.kept = Counter(), Counter(), Counter()
        self.drops: dict[str, Counter] = {}
        self.filtered: set[str] = set()

    def _note(self, name: str, reason: str | None) -> None:
        self.calls[name] += 1
        if reason is None:
            self.passed[name] += 1
        else:
            self.drops.setdefault(name, Counter())[reason] += 1

    def record(self, tag, tensor, once=False):
        if not self.seed._want_moe(tag):
            self.filtered.add(tag)
            return self.seed.record(tag, tensor, once)
        before = self.seed._CAPTURED.get(tag)
        suspended = self.seed._SUSPENDED  # the seed's record ignores profiling(); compiledump does not
        self.seed.record(tag, tensor, once)
        wrote = self.seed._CAPTURED.get(tag) is not before
        # A once-record that found its tag already written passes every gate and keeps the first.
        self._note(tag, "suspended" if suspended else None if wrote or once else "token_gate")
        self.kept[tag] = 1 if tag in self.seed._CAPTURED else 0

    def record_ids(self, tag, tensor):
        if not self.seed._want_moe(tag):
            self.filtered.add(tag)
            return self.seed.record_ids(tag, tensor)
        before, suspended = self.seed._CAPTURED.get(tag), self.seed._SUSPENDED
        self.seed.record_ids(tag, tensor)
        self._note(tag, "suspended" if suspended else None if self.seed._CAPTURED.get(tag) is not before else "token_gate")
        self.kept[tag] = 1 if tag in self.seed._CAPTURED else 0

    def record_step(self, tag, tensor):
        name, before, suspended = f"{tag}_<n>", self.seed._STEPS.get(tag, 0), self.seed._SUSPENDED
        self.seed.record_step(tag, tensor)
        wrote = self.seed._STEPS.get(tag, 0) > before
        self._note(name, "suspended" if suspended else None if wrote else "rows_gate")
        self.kept[name] = self.seed._STEPS.get(tag, 0)  # every write is kept (fewer than max_steps)

    def set_rows(self, rows):
        self.seed.set_rows(rows)

    def profiling(self):
        return self.seed.profiling()


@pytest.fixture(scope="module")
def seed_reference(tmp_path_factory):
    """The seed's dump of the scenario (eager, fp32) and its ledger, computed once."""
    session = make_session(CFG, prompt_len=PROMPT, steps=32, pad_rows=3)
    ledger = SeedLedger(load_seed(tmp_path_factory.mktemp("seed"), tokens=PROMPT))
    run_session(TinyMoE(CFG, dump=ledger), ledger, session)
    return session, seed_dump(ledger.seed), ledger


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_same_dump_as_seed(dump_dir, seed_reference, mode):
    session, expected, ledger = seed_reference
    compiledump.configure(tokens=PROMPT)
    model = TinyMoE(CFG, dump=compiledump)
    forward = torch.compile(model, fullgraph=True) if mode == "compiled" else model
    counters.clear()
    assert STATE.runtime is None  # the first capture happens inside the forward (while tracing)
    graphs_after_first_decode = []

    def on_step(step):
        if step == 0:
            graphs_after_first_decode.append(counters["stats"]["unique_graphs"])

    run_session(forward, compiledump, session, on_step=on_step)
    path = compiledump.flush()
    with np.load(path) as data:
        got = {key: data[key] for key in data.files}
    manifest = json.loads(Path(path).with_suffix(".json").read_text())

    # Sanity of the reference itself: it has every kind of key we claim to match.
    assert {"layer0", "layer3", "layer0_topk", "layer1_moe_out", "logits", "logits_31"} <= set(expected)
    assert "layer2_topk" not in expected  # MoE filter (default 2 layers)
    _assert_same_dump(expected, got, rtol=1e-5 if mode == "eager" else 1e-4)
    # Per tag: the seed's calls, writes and skips, as the manifest counts them.
    assert set(manifest["tags"]) == set(ledger.calls)
    for name, tag in manifest["tags"].items():
        assert (tag["calls"], tag["passed"], tag["kept"]) == (ledger.calls[name], ledger.passed[name],
                                                               ledger.kept[name]), name
        assert tag["drops"] == dict(ledger.drops.get(name, {})), name
    assert set(manifest["filtered_tags"]) == ledger.filtered
    assert sum(ledger.drops.get(name, Counter())["suspended"] for name in ledger.calls) > 0  # the scenario has all
    assert sum(ledger.drops.get(name, Counter())["token_gate"] for name in ledger.calls) > 0
    assert sum(ledger.drops.get(name, Counter())["rows_gate"] for name in ledger.calls) > 0
    if mode == "compiled":
        assert counters["stats"]["unique_graphs"] == graphs_after_first_decode[0]
