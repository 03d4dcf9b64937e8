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

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import compiledump  # noqa: E402
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


def _note(lines: list[str], side: str) -> str:
    (note,) = [line for line in lines if line.startswith(f"note: step 0 of {side}'s routing steps is not compared")]
    return note


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flat_side", ["RUN", "REF"])
def test_an_honest_flat_engine_s_step_zero_routing_is_left_out_with_a_note(tmp_path, capsys, engines, dtype,
                                                                            flat_side):
    engines.run_pair(tmp_path, dtype=dtype)
    ref, run = (tmp_path / "ref", tmp_path / "run") if flat_side == "RUN" else (tmp_path / "run", tmp_path / "ref")
    code, lines, report = _compare(ref, run, tmp_path, capsys)
    assert code == 0 and report["first_divergence"] is None, lines
    other = "REF" if flat_side == "RUN" else "RUN"
    assert _note(lines, flat_side) == (
        f"note: step 0 of {flat_side}'s routing steps is not compared (layer0_step_router_0, layer1_step_router_0): "
        f"its routers ran on flat [tokens, ...] rows, so its step 0 (the prefill) holds row 0 of the prompt, which "
        f"its prompt keys show, where {other}'s holds the prompt's last position; the prefill's routing is compared "
        f"in the prompt keys (layer0_router, layer0_topk, layer1_router, layer1_topk)")
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


def test_a_flat_step_zero_that_is_the_prompt_s_last_row_is_compared(tmp_path, capsys, engines):
    """`set_gather_rows(step=-1)` on the engine side: its step 0 is the prompt's last row, as its
    prompt keys show, so it is compared (and agrees) and no note is given."""
    hf, engine, prompt = engines.run_pair(tmp_path)
    g = torch.Generator().manual_seed(100)  # run_pair's prompt, then its decode tokens
    assert torch.equal(torch.randint(0, hf.config.vocab_size, (7,), generator=g), prompt)
    decode = torch.randint(0, hf.config.vocab_size, (4,), generator=g).tolist()

    def last_row():
        compiledump.set_gather_rows(step=-1)
        engine.generate(prompt, decode)

    engines.dump(engine, tmp_path / "last", last_row)
    code, lines, report = _compare(tmp_path / "ref", tmp_path / "last", tmp_path, capsys)
    assert code == 0 and not any("routing steps is not compared" in line for line in lines), lines
    statuses = {record["key"]: record["status"] for record in report["keys"]}
    assert statuses["layer0_step_router_0"] == statuses["layer1_step_router_0"] == "ok", statuses


def _renamed_copy(source: Path, target: Path, old: str, new: str) -> None:
    """The dump in `source` with every key and tag starting `old` renamed to start `new` (an engine
    whose own tags --map turns into the reference's)."""
    (npz,) = source.glob("*.npz")
    target.mkdir()
    with np.load(npz) as data:
        np.savez(target / npz.name, **{key.replace(old, new, 1) if key.startswith(old) else key: data[key]
                                       for key in data.files})
    manifest = json.loads(npz.with_suffix(".json").read_text())
    keys = {}
    for key, entry in manifest["keys"].items():
        if key.startswith(old):
            key, entry = key.replace(old, new, 1), {**entry, "tag": entry["tag"].replace(old, new, 1)}
        keys[key] = entry
    manifest["keys"] = keys
    (target / npz.name).with_suffix(".json").write_text(json.dumps(manifest))


def test_a_run_side_renamed_by_map_is_read_under_its_old_names(tmp_path, capsys, engines):
    """RUN's step routing under its own tag names, which --map turns into REF's: its manifest
    entries are found under the old names, so its flat step 0 is still left out."""
    engines.run_pair(tmp_path)
    _renamed_copy(tmp_path / "run", tmp_path / "renamed", "layer0_step_router", "blk0_step_router")
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "renamed"), "--map",
                 r"^blk(\d+)_step_router=layer\1_step_router"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0, lines
    assert "(layer0_step_router_0, layer1_step_router_0)" in _note(lines, "RUN"), lines
