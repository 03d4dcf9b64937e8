"""Each decoder layer's state at every decode step (`layer<N>_step_<n>`, recorded by `instrument`):
a decode-only bug is named at the layer and step where it starts, not only at the step's logits.
Hugging Face Llama built from config (random weights), eager, against an fp32 reference; the
values checked against the model's own `output_hidden_states`, an independent path."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import compiledump
from compiledump import config as cd_config
from compiledump.capture.recover import recover_directory
from compiledump.cli import main
from compiledump.compare import compare
from compiledump.compare.options import CompareOptions, DECODE_NO_FLIP
from helpers.hf_example import ex


PROMPT = 7
TOKENS = [11, 40, 3, 77]  # teacher-forced decode tokens


def _decode_only_bug(model, layer: int, scale: float, part: str = "self_attn"):
    """Layer `layer`'s attention (or `part`'s) output scaled by `scale` in decode forwards only (one
    token): a bug in a decode-only path (a paged KV cache, a decode attention kernel, a GEMM for one
    row). Returns the hook."""
    def hook(_module, _args, output):
        out, *rest = output if isinstance(output, tuple) else (output,)
        if out.shape[1] != 1:
            return None  # None: the output stays
        return (out * scale, *rest) if isinstance(output, tuple) else out * scale
    return getattr(model.model.layers[layer], part).register_forward_hook(hook)


def _run(model, directory: Path, step_states: bool = True, **settings) -> list:
    """Prefill a 7-token prompt and decode TOKENS under `instrument`; the hidden states of every
    forward (output_hidden_states), read independently of the dump."""
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory), **settings)))
    handle = compiledump.instrument(model, step_states=step_states)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=model.config)
    states = []
    with torch.no_grad():
        out = model(input_ids=prompt, cache=cache, use_cache=True, output_hidden_states=True)
        states.append(out.hidden_states)
        for token in TOKENS:
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, output_hidden_states=True)
            states.append(out.hidden_states)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiledump.flush()
    handle.remove()
    compiledump.reset()
    states.append([str(w.message) for w in caught])
    return states


def _dump(directory: Path):
    path = next(directory.glob("*.npz"))
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    return arrays, json.loads(path.with_suffix(".json").read_text())


@pytest.mark.parametrize("dtype, scale, part, key", [(torch.float32, 1.01, "self_attn", "layer2_mixer_step_1"),
                                                    (torch.bfloat16, 1.5, "self_attn", "layer2_mixer_step_1"),
                                                    (torch.float32, 1.01, "mlp", "layer2_mlp_step_1"),
                                                    (torch.bfloat16, 1.5, "mlp", "layer2_mlp_step_1")])
def test_a_decode_only_bug_in_one_layer_is_named_at_that_layer_and_step(tmp_path, capsys, dtype, scale, part, key):
    """A decode-only bug is named at its layer, step and sublayer: attention's own output for an
    attention bug (before the thirtieth session: the stream after attention), the MLP's own output
    for an MLP bug (before: at the layer's state, `layer2_step_1`, for both; before that, "first
    divergence: logits_1")."""
    reference = ex.build_model("llama")  # 4 layers, dense
    engine = copy.deepcopy(reference).to(dtype)
    hook = _decode_only_bug(engine, 2, scale, part)
    _run(reference, tmp_path / "ref")
    _run(engine, tmp_path / "run")
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    lines, report = capsys.readouterr().out.splitlines(), json.loads((tmp_path / "r.json").read_text())
    first = report["first_divergence"]
    assert code == 1 and (first["key"], first["layer"], first["step"]) == (key, 2, 1), lines[-1]
    records = {record["key"]: record for record in report["keys"]}
    assert records["layer1_step_1"]["status"] == "ok" and records["layer3"]["status"] == "ok"  # the prompt is right
    if part == "mlp":  # what its MLP read was right
        assert records["layer2_attn_step_1"]["status"] == "ok"
    assert "layer0_step_0" not in records and "layer0_mlp_step_0" not in records  # the prompt's layer0 holds it
    # Without the bug: no divergence, every layer's state of every step compared.
    hook.remove()
    _run(engine, tmp_path / "run")
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    lines, report = capsys.readouterr().out.splitlines(), json.loads((tmp_path / "r.json").read_text())
    compared = {record["key"] for record in report["keys"] if record["status"] == "ok"}
    assert code == 0 and {f"layer{i}{part}_step_{n}" for i in range(4) for n in range(1, 5)
                          for part in ("", "_mixer", "_attn", "_mlp")} <= compared, lines[-1]


def test_layer_steps_keeps_the_first_forwards_and_counts_the_rest_as_a_filter(tmp_path):
    model = ex.build_model("llama")
    states = _run(model, tmp_path / "two", layer_steps=2)
    arrays, manifest = _dump(tmp_path / "two")
    for i in range(4):
        if i < 3:  # hidden_states[i + 1]: layer i's output (the last one is normed); step 0 the
            # prompt's last position, step 1 the first decode token
            for n in (0, 1):
                np.testing.assert_allclose(arrays[f"layer{i}_step_{n}"], states[n][i + 1][0, -1].numpy(), rtol=1e-6,
                                           atol=1e-6)
        for part in ("", "_mixer", "_attn", "_mlp"):  # the sublayers' states are kept as many steps
            assert f"layer{i}{part}_step_1" in arrays and f"layer{i}{part}_step_2" not in arrays
            assert manifest["tags"][f"layer{i}{part}_step_<n>"]["drops"] == {"layer_steps": 3}
    assert [f"logits_{n}" in arrays for n in range(5)] == [True] * 5  # other steps keep COMPILEDUMP_MAX_STEPS
    warned = states[-1]
    assert not any("layer_steps" in message and "dropped" in message for message in warned), warned  # a filter
    assert any(message.startswith("compiledump: captures skipped by filters (") and "layer_steps: 48" in message
               for message in warned), warned
    # Compared with a run that kept every step: the steps past 2 are one note, not a problem each.
    _run(model, tmp_path / "all")
    for ref, run, side in (("all", "two", "REF"), ("two", "all", "RUN")):
        report = compare(tmp_path / ref, tmp_path / run)
        (pair,) = report.pairs
        assert report.exit_status == 0 and pair.problems == [], pair.problems
        (note,) = [note for note in pair.notes if "COMPILEDUMP_LAYER_STEPS (" in note]
        default = cd_config.Config().layer_steps  # (more than the 5 forwards)
        caps = f"REF {default}, RUN 2" if ref == "all" else f"REF 2, RUN {default}"
        assert note.startswith(f"{side} has 48 layer-state keys at steps past {'RUN' if side == 'REF' else 'REF'}'s "
                               f"COMPILEDUMP_LAYER_STEPS ({caps}): not compared"), note
        assert {f"layer{i}{part}_step_{n}" for i in range(4) for n in (2, 3, 4)
                for part in ("", "_mixer", "_attn", "_mlp")}.isdisjoint(r.key for r in pair.keys)
    # 0, or instrument(..., step_states=False): none recorded
    _run(model, tmp_path / "none", layer_steps=0)
    _run(model, tmp_path / "off", step_states=False)
    for name in ("none", "off"):
        arrays, _ = _dump(tmp_path / name)
        assert not any(key.startswith("layer0_step") for key in arrays) and {"layer0", "logits_4"} <= arrays.keys()


def test_a_hand_written_layer_state_obeys_the_limit_and_survives_recovery(dump_dir):
    compiledump.configure(layer_steps=3)
    values = [torch.randn(2, 9, dtype=torch.bfloat16)[:, ::2] for _ in range(5)]  # non-contiguous rows
    for value in values:
        compiledump.record_step("layer4_step", value)
        compiledump.record_step("other_step", value)
    flushed = compiledump.flush()
    with np.load(flushed) as data:
        got = {key: data[key] for key in data.files}
    for n in range(3):
        np.testing.assert_array_equal(got[f"layer4_step_{n}"], values[n][0].float().numpy())
    assert "layer4_step_3" not in got and "other_step_4" in got
    manifest = json.loads(Path(flushed).with_suffix(".json").read_text())
    assert manifest["tags"]["layer4_step_<n>"]["drops"] == {"layer_steps": 2}
    # The crash-proof journal keeps why the region is smaller: a recovered dump says the same
    # (without the flushed files: a complete dump is left as it is).
    Path(flushed).with_suffix(".json").unlink()
    results, errors = recover_directory(dump_dir, force=True, keep=True)
    assert errors == [] and results[0].npz == Path(flushed)
    assert json.loads(Path(flushed).with_suffix(".json").read_text())["tags"]["layer4_step_<n>"]["drops"] == \
        {"layer_steps": 2}


def test_a_layer_state_after_a_possible_routing_flip_has_twice_the_logits_norm_allowance():
    options = CompareOptions()
    layer = options.thresholds_for("layer3_step_2", "float32", "bfloat16", phase="decode")
    logits = options.thresholds_for("logits_2", "float32", "bfloat16", phase="decode")
    assert (layer.rel_diff, layer.norm_diff) == (logits.rel_diff, 2 * logits.norm_diff) == (2e-1, 1e-1)
    assert layer.norm_source == "calibrated decode, layer state"
    # Where no flip can reach the step, and in fp32, the same thresholds as every key.
    quiet = options.thresholds_for("layer3_step_2", "float32", "bfloat16", phase=DECODE_NO_FLIP)
    assert (quiet.rel_diff, quiet.norm_diff) == (2e-3, 3e-2)
    exact = options.thresholds_for("layer3_step_2", "float32", "float32", phase="decode")
    assert (exact.rel_diff, exact.norm_diff) == (1e-8, 1e-5)


@pytest.mark.parametrize("phase, rel, norm", [("decode", 4e-1, 2e-1), (DECODE_NO_FLIP, 4e-3, 6e-2)])
def test_an_moe_block_s_output_at_a_step_has_twice_its_phase_s_thresholds(phase, rel, norm):
    """Its gate weights move with the router logits and nothing dilutes them: in the calibration it
    came closest to every allowance (bf16/fp16 after a flip: rel_diff 1.7e-1 against 2e-1, norm_diff
    9.6e-2 against 1e-1)."""
    options = CompareOptions()
    moe = options.thresholds_for("layer3_mlp_step_2", "float32", "bfloat16", phase=phase, moe_output=True)
    dense = options.thresholds_for("layer3_mlp_step_2", "float32", "bfloat16", phase=phase)
    assert (moe.rel_diff, moe.norm_diff) == (rel, norm) == (2 * dense.rel_diff, 2 * dense.norm_diff)
    assert moe.norm_source == dense.norm_source + ", MoE output"
    # float32 (no rounding flips a gate) and the prompt's MoE output keep theirs
    exact = options.thresholds_for("layer3_mlp_step_2", "float32", "float32", phase=phase, moe_output=True)
    prompt = options.thresholds_for("layer3_mlp", "float32", "bfloat16", moe_output=True)
    assert (exact.norm_diff, prompt.norm_diff) == (1e-5, 3e-2)


def test_the_moe_output_allowance_follows_the_manifest_s_routed_layers(tmp_path):
    """Qwen3-MoE (every layer routed) beside Llama (none): only the MoE blocks' step outputs get it."""
    for name in ("qwen3_moe", "llama"):
        reference = ex.build_model(name)
        engine = copy.deepcopy(reference).to(torch.bfloat16)
        _run(reference, tmp_path / name / "ref", moe_layers=4)
        _run(engine, tmp_path / name / "run", moe_layers=4)
        (pair,) = compare(tmp_path / name / "ref", tmp_path / name / "run").pairs
        sources = {record.key: record.limits.norm_source for record in pair.keys if record.limits is not None}
        moe = name == "qwen3_moe"
        assert sources["layer2_mlp_step_3"].endswith(", MoE output") is moe, sources["layer2_mlp_step_3"]
        assert not sources["layer2_step_3"].endswith("MoE output") and not sources["layer2_mlp"].endswith("MoE output")


def test_a_step_past_the_kept_layer_states_says_how_to_name_its_layer(tmp_path, capsys):
    """COMPILEDUMP_LAYER_STEPS=2 keeps steps 0-1; a bug from decode step 3 on is named at logits_3,
    with a note that names the setting (before, nothing said the layers' states had stopped)."""
    reference = ex.build_model("llama")
    engine = copy.deepcopy(reference)
    forwards = []

    def hook(_module, _args, output):  # decode forwards from the third on (step 3 on)
        forwards.append(1)
        out, *rest = output
        return (out * 1.01, *rest) if out.shape[1] == 1 and len(forwards) >= 4 else None
    engine.model.layers[2].self_attn.register_forward_hook(hook)
    _run(reference, tmp_path / "ref", layer_steps=2)
    _run(engine, tmp_path / "run", layer_steps=2)
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "run")])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1 and lines[-1].startswith("first divergence: logits_3 (step 3)"), lines[-1]
    assert any(line.startswith("note: each layer's state at a decode step is kept for the first 2 forwards "
                               "(COMPILEDUMP_LAYER_STEPS=2, steps 0-1); step 3 is past them") for line in lines), lines


def test_the_sublayers_step_states_leave_the_logits_their_room(tmp_path):
    """The sublayers' step states take at most an eighth of the arena (capture/step_budget.py):
    past it later layers keep none, warned once and counted as `layer_steps`, and the logits, whose
    region is claimed last, are kept. Before, this Llama (hidden 1024, a 1 MiB arena) lost every
    `logits_<n>` to `arena_full` (an 80-layer, 8192-wide model with the default arena did too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with warnings.catch_warnings(record=True) as caught:  # (the flush's own are in states[-1])
        warnings.simplefilter("always")
        states = _run(model, tmp_path / "small", arena_mb=1, max_steps=64)
    arrays, manifest = _dump(tmp_path / "small")
    assert {f"logits_{n}" for n in range(5)} <= arrays.keys()  # kept
    # (room for two sublayer tags of 16 steps: layer 0's attention output and stream after it)
    assert {f"layer0_{part}_step_{n}" for part in ("mixer", "attn") for n in range(5)} <= arrays.keys()
    assert not any(key.startswith(("layer0_mlp_step", "layer1_mixer_step", "layer3_attn_step")) for key in arrays)
    assert {f"layer{i}_step_4" for i in range(4)} <= arrays.keys()  # each layer's state names its layer
    assert manifest["tags"]["layer3_mlp_step_<n>"]["drops"] == {"layer_steps": 5}
    (warned,) = [str(w.message) for w in caught if "fill their share of the arena" in str(w.message)]
    assert "from 'layer0_mlp_step' on" in warned and "COMPILEDUMP_ARENA_MB=1" in warned
    np.testing.assert_allclose(arrays["layer0_step_2"], states[2][1][0, -1].numpy(), rtol=1e-6, atol=1e-6)


def test_a_dump_from_before_the_sublayer_steps_is_one_note_not_a_problem_per_key(tmp_path):
    """A reference recorded before the sublayers' step states existed (simulated: those members
    and their manifest entries removed, attention's own output too, which came later) against a new
    run: one note, no problems (a review found 32 `extra_in_run` problems for a 4-layer model and 4
    steps)."""
    model = ex.build_model("llama")
    _run(model, tmp_path / "old")
    _run(model, tmp_path / "new")
    npz = next((tmp_path / "old").glob("*.npz"))
    sublayer = lambda key: "_attn_step" in key or "_mlp_step" in key or "_mixer" in key  # noqa: E731
    with np.load(npz) as data:
        kept = {key: data[key] for key in data.files if not sublayer(key)}
    np.savez(npz, **kept)
    manifest = json.loads(npz.with_suffix(".json").read_text())
    for field in ("keys", "tags"):
        manifest[field] = {key: entry for key, entry in manifest[field].items() if not sublayer(key)}
    npz.with_suffix(".json").write_text(json.dumps(manifest))
    report = compare(tmp_path / "old", tmp_path / "new")
    (pair,) = report.pairs
    assert report.exit_status == 0 and pair.problems == [], pair.problems
    (note,) = [note for note in pair.notes if "sublayer decode-step keys" in note]
    # 4 layers x 4 steps x (the stream after attention, the MLP's and attention's own output)
    assert note.startswith("RUN holds 48 sublayer decode-step keys (") and "REF none" in note, note
