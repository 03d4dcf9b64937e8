"""Step 0 of the routing steps of an engine with flat tokens, against a Hugging Face reference.

An engine's own router that returns its logits as a plain tensor (a linear layer, not vLLM's
`(logits, None)`) gets step routing recorded; on flat `[tokens, experts]` rows its step 0 (the
prefill) holds the row `set_gather_rows(step=...)` names, row 0 (the prompt's first token), where
the reference's holds the prompt's last position. Before, an honest engine of this shape was
"first divergence: layer0_step_router_0 (step 0)"; now those keys are left out with one note
(compare/flat_steps.py), and two flat sides still compare them. examples/vllm_style_engine.py
(a Qwen3-MoE from config, random weights, eager) with its gates made plain linear layers.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from compiledump.cli import main  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_style_engine.py"


@pytest.fixture(scope="module")
def engines():
    """A copy of the example whose gates return their logits alone, as a plain linear layer does."""
    spec = importlib.util.spec_from_file_location("vllm_style_engine_linear_gate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.Gate.forward = lambda self, x: F.linear(x, self.weight)
    module.SparseMoeBlock.forward = lambda self, hidden_states: self.experts(
        hidden_states=hidden_states, router_logits=self.gate(hidden_states))
    return module


def _compare(ref: Path, run: Path, tmp_path, capsys):
    code = main(["compare", str(ref), str(run), "--json", str(tmp_path / "r.json")])
    return code, capsys.readouterr().out.splitlines(), json.loads((tmp_path / "r.json").read_text())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_honest_flat_engine_s_step_zero_routing_is_left_out_with_a_note(tmp_path, capsys, engines, dtype):
    engines.run_pair(tmp_path, dtype=dtype)
    code, lines, report = _compare(tmp_path / "ref", tmp_path / "run", tmp_path, capsys)
    assert code == 0 and report["first_divergence"] is None, lines
    (note,) = [line for line in lines if line.startswith("note: step 0 of the routing steps is not compared")]
    assert "(layer0_step_router_0, layer1_step_router_0): RUN's routers ran on flat [tokens, ...] rows" in note, note
    assert "where REF's holds the prompt's last position" in note
    statuses = {record["key"]: record["status"] for record in report["keys"]}
    assert "layer0_step_router_0" not in statuses and "layer1_step_router_0" not in statuses, sorted(statuses)
    # the decode steps' routing (one token per forward on both sides) and the prefill's are compared
    assert statuses["layer0_step_router_1"] == statuses["layer1_step_router_4"] == "ok", statuses
    assert statuses["layer0_router"] in ("ok", "near_tie") and statuses["logits_0"] == "ok", statuses


def test_two_flat_sides_compare_their_step_zero(tmp_path, capsys, engines):
    """Both sides flat (the engine against itself in bfloat16): the same row at step 0 on both."""
    hf, engine, prompt = engines.run_pair(tmp_path / "a")
    bf16 = engines.ForCausalLM(hf, None, False).eval().to(torch.bfloat16)
    decode = torch.randint(0, hf.config.vocab_size, (4,), generator=torch.Generator().manual_seed(100)).tolist()
    engines.dump(engine, tmp_path / "fp32", lambda: engine.generate(prompt, decode))
    engines.dump(bf16, tmp_path / "bf16", lambda: bf16.generate(prompt, decode))
    code, lines, report = _compare(tmp_path / "fp32", tmp_path / "bf16", tmp_path, capsys)
    assert not any("step 0 of the routing steps" in line for line in lines), lines
    statuses = {record["key"]: record["status"] for record in report["keys"]}
    assert statuses["layer0_step_router_0"] == "ok", statuses
    assert code == 0, lines


def test_a_bug_in_a_flat_engine_is_still_named(tmp_path, capsys, engines):
    engines.run_pair(tmp_path, bug="norm_eps")  # layer 1's post-attention norm
    code, lines, report = _compare(tmp_path / "ref", tmp_path / "run", tmp_path, capsys)
    assert code == 1, lines
    assert report["first_divergence"]["layer"] == 1 and report["first_divergence"]["step"] is None, lines
