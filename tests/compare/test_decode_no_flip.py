"""Decode steps no routing flip can have reached are judged at the prefill thresholds.

The decode-step defaults of the low-precision classes (rel_diff 2e-1) allow for routing flips,
which move a step's logits up to 1e-1; they let a decode-only bug through (positions off by one:
rel_diff ~6e-3 in a bf16 engine, "no divergence" before). `instrument` writes in the manifest
whether it recorded every routing decision (`routing`); with every routed layer's ids kept
(COMPILEDUMP_MOE_LAYERS covering them) and every ids key agreeing so far, nothing can have flipped
a route, and a step is judged at the prefill thresholds (docs/compare.md, "Default thresholds").
A Hugging Face model built from config (random weights, eager) on both sides; the engine's
decode-only bug is known, so is the step it must be named at.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import warnings

import pytest
import torch
from transformers import DynamicCache

import compiledump
from compiledump import config as cd_config
from compiledump.cli import main
from helpers.hf_dump import change_call
from helpers.hf_example import ex


PROMPT, STEPS = 7, 4


def run_side(model, directory, tokens, moe_layers, position_offset=0, step_routing=True):
    """Prefill a 7-token prompt and decode the given `tokens` (teacher forcing); decode positions
    shifted by `position_offset` (the bug: the prefill is right)."""
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory), moe_layers=moe_layers)))
    handle = compiledump.instrument(model, step_routing=step_routing)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
        for n, token in enumerate(tokens):
            position = torch.tensor([[PROMPT + n + position_offset]])
            model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, position_ids=position)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        compiledump.flush()
    handle.remove()
    compiledump.reset()


@pytest.fixture(scope="module")
def model():
    return ex.build_model("qwen3_moe")  # 4 layers, every one MoE


def compare(tmp_path, capsys):
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    return code, capsys.readouterr().out.splitlines(), json.loads((tmp_path / "r.json").read_text())


def sources(report) -> dict[str, str]:
    return {record["key"]: record["threshold_source"] for record in report["keys"] if record.get("threshold_source")}


def test_the_manifest_says_whether_every_route_is_recorded(model, tmp_path):
    run_side(model, tmp_path / "moe", [5], moe_layers=2)
    run_side(ex.build_model("llama"), tmp_path / "dense", [5], moe_layers=2)
    run_side(model, tmp_path / "nosteps", [5], moe_layers=4, step_routing=False)
    facts = {name: json.loads(next((tmp_path / name).glob("*.json")).read_text())["routing"]
             for name in ("moe", "dense", "nosteps")}
    # moe_outputs: the layers whose layer<i>_mlp is an MoE block's (the filter keeps layers 0-1's)
    assert facts == {"moe": {"routed": [0, 1, 2, 3], "complete": True, "moe_outputs": [0, 1, 2, 3]},
                     "dense": {"routed": [], "complete": True, "moe_outputs": []},  # nothing routes: nothing can flip
                     "nosteps": {"routed": [0, 1, 2, 3], "complete": False,  # a step's own routing unseen
                                 "moe_outputs": [0, 1, 2, 3]}}


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_a_decode_only_bug_in_a_bf16_engine_is_named_at_its_step(model, tmp_path, capsys, name):
    # Llama routes nothing, so nothing can flip: before, its decode steps were judged with the
    # routing-flip allowance all the same and this bug exited 0. In Qwen3-MoE the step's router
    # logits are judged too where no route has flipped, so the bug is named at its first layer
    # (before, its own routing change at step 1 could widen the near-tie epsilon and excuse it).
    reference = model if name == "qwen3_moe" else ex.build_model(name)
    tokens = torch.randint(0, reference.config.vocab_size, (STEPS,),
                           generator=torch.Generator().manual_seed(4)).tolist()
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    run_side(reference, tmp_path / "ref", tokens, moe_layers=4)
    run_side(engine, tmp_path / "run", tokens, moe_layers=4, position_offset=1)
    code, out, report = compare(tmp_path, capsys)
    first = report["first_divergence"]
    assert code == 1 and (first["phase"], first["step"]) == ("decode", 1), out[-1]
    # Named at layer 0, at the stream after its attention at the step, where a position bug starts
    # (before the twenty-eighth session at the layer's state; before that at the step's logits
    # alone; Qwen3-MoE's at the step's router logits, which came first in the layer).
    named = "layer0_mixer_step_1"  # attention's own output
    assert (first["key"], first["threshold"]) == (named, 2e-3)  # bf16's prefill default
    if name == "llama":
        assert any(line.startswith("thresholds: float32 vs bfloat16 -> rel_diff <= 2e-03") and
                   "decode steps no routing flip reaches" in line for line in out)
    # The same engine without the bug: no divergence; decode steps are judged at the prefill
    # thresholds until some token's experts change, and with the allowance after.
    run_side(engine, tmp_path / "run", tokens, moe_layers=4)
    code, out, report = compare(tmp_path, capsys)
    assert code == 0, out[-1]
    flipped = False
    for record in report["keys"]:
        if record["phase"] == "decode" and record.get("threshold_source"):
            # A layer's state (layer<N>_step_<n>) has its own allowance (twice the logits' norm_diff)
            layer_state = re.fullmatch(r"layer\d+(_attn|_mlp)?_step_\d+", record["key"]) is not None
            allowance = "calibrated decode, layer state" if layer_state else "calibrated decode"
            # an MoE block's output (every layer of Qwen3-MoE's) has twice the thresholds of its phase
            moe_output = name == "qwen3_moe" and re.fullmatch(r"layer\d+_mlp_step_\d+", record["key"])
            moe = ", MoE output" if moe_output else ""
            assert record["threshold_source"] == (allowance if flipped else
                                                  "calibrated decode, no routing flip") + moe, record["key"]
        routing = record.get("routing") or {}
        flipped = flipped or bool(record.get("ids_equal") is False and [
            row for row in routing.get("rows", ()) if row["overlap"] < row["k"]])


def test_unrecorded_routing_keeps_the_allowance_from_its_layer_on_and_says_what_to_set(model, tmp_path, capsys):
    """A decode step's key of a layer before the first one whose routing is filtered out needs no
    allowance: its state depends on the fed token and on its own and earlier layers' caches only.
    Before, every decode key kept it (a helper's audit: a decode-only MoE bug in layer 1 exited 0
    under the default COMPILEDUMP_MOE_LAYERS=2)."""
    tokens = torch.randint(0, model.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(4)).tolist()
    engine = copy.deepcopy(model).to(torch.bfloat16)
    run_side(model, tmp_path / "ref", tokens, moe_layers=2)  # layers 2-3's routing filtered out
    run_side(engine, tmp_path / "run", tokens, moe_layers=2)
    code, out, report = compare(tmp_path, capsys)
    assert code == 0, out[-1]
    decode = {record["key"]: record for record in report["keys"]
              if record["phase"] == "decode" and record.get("threshold_source")}
    early = {key for key, record in decode.items() if record["layer"] is not None and record["layer"] < 2}
    assert {"layer0_step_1", "layer1_mlp_step_3", "layer1_step_router_2"} <= early
    assert {"layer2_step_1", "layer3_attn_step_3", "logits_2"} <= decode.keys() - early
    for key, record in decode.items():
        assert ("no routing flip" in record["threshold_source"]) == (key in early), (key, record["threshold_source"])
    note = next(line for line in out if line.startswith("note: decode steps' keys from layer 2 on (and their logits) "
                                                         "are judged with the routing-flip"))
    assert "layer(s) 2, 3 is not recorded" in note and "COMPILEDUMP_MOE_LAYERS=4 on both sides" in note


def test_a_decode_only_moe_bug_before_the_filtered_layers_is_named_under_the_defaults(model, tmp_path, capsys):
    """Layer 1's MoE block weighs its second expert 30 % low at decode step 3 (a top-k kernel's
    weights wrong for a single row), bf16, COMPILEDUMP_MOE_LAYERS=2 (the default). Before, exit 0:
    layer1_mlp_step_3 was judged with the routing-flip allowance (norm_diff 2e-1), which no flip
    in layers 2-3 can need."""
    tokens = torch.randint(0, model.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(4)).tolist()
    engine = copy.deepcopy(model).to(torch.bfloat16)
    change_call(engine.model.layers[1].mlp.gate, 4,  # the prompt's forward, then decode steps 1, 2, 3
                lambda logits, weights, ids: (logits, torch.stack([weights[:, 0], weights[:, 1] * 0.7], -1), ids))
    run_side(model, tmp_path / "ref", tokens, moe_layers=2)
    run_side(engine, tmp_path / "run", tokens, moe_layers=2)
    code, out, report = compare(tmp_path, capsys)
    first = report["first_divergence"]
    assert code == 1 and (first["key"], first["step"]) == ("layer1_mlp_step_3", 3), out[-1]


def test_no_allowance_note_where_no_key_is_judged_with_it(model, tmp_path, capsys):
    # fp32 against fp32, layers 2-3's routing filtered: decode steps are judged at fp32's defaults,
    # which have no routing-flip allowance, so the note would be false (a trial saw it there).
    tokens = torch.randint(0, model.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(4)).tolist()
    run_side(model, tmp_path / "ref", tokens, moe_layers=2)
    run_side(copy.deepcopy(model), tmp_path / "run", tokens, moe_layers=2)
    code, out, _ = compare(tmp_path, capsys)
    assert code == 0 and not any("routing-flip allowance" in line for line in out)
