"""A decode step that diverges at an earlier layer than the prompt's first divergence is named
first (compare/verdict.py `decode_before_prompt_layer`): a layer's decode state depends on the prompt
only through its own and earlier layers' caches, so the prompt's later divergence cannot explain
it. A helper's audit found the prompt's named instead (Gemma 2, layer 1's attention scale wrong in
bf16: the verdict said layer 3's MLP while decode step 1 read 2.7 times the threshold at layer 1).

The bug here is Llama's layer-1 MLP wrong for one token id only (an expert only some tokens reach,
a bad row of a quantized table): the prompt holds that token before its last position, so in
one-row mode the prompt shows it only where the last row reads it, from layer 2 on; decode step
1 feeds it, and its own row diverges at layer 1. Hugging Face Llama from config, fp32, eager."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from compiledump.compare import compare, format_report
from helpers.hf_dump import dump_run, load_dump, prompt_then_steps
from helpers.hf_models import from_config

BROKEN = 17  # the token id layer 1's MLP is wrong for
IDS = torch.tensor([[5, 40, BROKEN, 63, 8, 29, 71]])  # BROKEN before the last position
STEPS = (BROKEN, 42, 11)  # decode step 1 feeds it


def _llama():
    return from_config("llama", 0, vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       initializer_range=0.1)


def _broken_for_one_token(model, layer: int = 1, scale: float = 1.05):
    """Layer `layer`'s MLP output scaled by `scale` at the rows whose input token is BROKEN."""
    fed = {}
    model.register_forward_pre_hook(lambda _m, _args, kwargs: fed.update(ids=kwargs["input_ids"]), with_kwargs=True)

    def hook(_module, _args, out):
        return torch.where((fed["ids"] == BROKEN).reshape(*out.shape[:-1], 1), out * scale, out)
    model.model.layers[layer].mlp.register_forward_hook(hook)


def test_a_decode_step_diverging_at_an_earlier_layer_than_the_prompt_is_named_first(tmp_path):
    reference = _llama()
    engine = copy.deepcopy(reference)
    _broken_for_one_token(engine)
    ref = dump_run(reference, tmp_path / "ref", prompt_then_steps(reference, IDS, STEPS))
    run = dump_run(engine, tmp_path / "run", prompt_then_steps(engine, IDS, STEPS))
    report = compare(ref, run)
    lines = format_report(report)
    first, prefill, decode = report.first_divergence, report.prefill_divergence, report.decode_divergence
    # The independent reading of the dumps: the prompt's last row first differs at layer 2, the
    # first decode step's at layer 1 (rows that equal at layer 1 and before).
    arrays_ref, _ = load_dump(ref)
    arrays_run, _ = load_dump(run)
    assert all(np.array_equal(arrays_ref[key], arrays_run[key]) for key in ("layer0", "layer1_attn", "layer1_mlp", "layer1"))
    assert not np.allclose(arrays_ref["layer1_mlp_step_1"], arrays_run["layer1_mlp_step_1"], rtol=1e-3)
    assert prefill.layer == 2 and decode.key == "logits_0", lines  # (step 0: the prompt's last row)
    assert (first.key, first.layer, first.step, first.phase) == ("layer1_mlp_step_1", 1, 1, "decode")
    assert report.exit_status == 1
    assert lines[-1].startswith("first divergence: layer1_mlp_step_1 (layer 1, step 1)"), lines[-1]
    assert "one-row mode" not in lines[-1]  # the prompt's blind-spot caution is the prompt's, not this one's
    (note,) = [line for line in lines if "the first divergence named is the decode step's" in line]
    assert f"the prompt's keys first diverge at {prefill.key} (layer 2)" in note


def test_a_decode_step_diverging_at_a_later_layer_leaves_the_prompt_first(tmp_path):
    """The prompt's divergence stays first where no decode step diverges before its layer: here
    the bug is in every row from layer 1 on (each token's), the prompt's last row included."""
    reference = _llama()
    engine = copy.deepcopy(reference)
    engine.model.layers[1].mlp.register_forward_hook(lambda _m, _a, out: out * 1.05)
    ref = dump_run(reference, tmp_path / "ref", prompt_then_steps(reference, IDS, STEPS))
    run = dump_run(engine, tmp_path / "run", prompt_then_steps(engine, IDS, STEPS))
    report = compare(ref, run)
    lines = format_report(report)
    assert report.first_divergence.key == "layer1_mlp", lines
    assert {record.key for record in report.pairs[0].keys if record.divergent} >= {"layer1_mlp_step_1", "layer2_step_2"}
    assert not any("the first divergence named is the decode step's" in line for line in lines)


def test_a_prompt_routing_flip_after_the_named_layer_is_no_root_cause(tmp_path):
    """Expert ids that differ in the prompt at layer 2 cannot cause a decode step's divergence at
    layer 1: no root cause is named (before, any ids mismatch earlier in key order was one).
    Synthetic dumps (tests/helpers/dumpfactory.py), fp32."""
    from helpers.dumpfactory import Capture, scaled, write_pair

    rng = np.random.default_rng(7)
    ref = []
    for layer in range(4):
        ref.append(Capture(f"layer{layer}_topk", rng.permutation(8)[:2][None].astype(np.int32), "ids",
                           f"layer{layer}_topk"))
        ref.append(Capture(f"layer{layer}", rng.standard_normal(32).astype(np.float32) + 0.5, "record", f"layer{layer}"))
    for step in range(1, 3):
        for layer in range(4):
            ref.append(Capture(f"layer{layer}_step_{step}", rng.standard_normal(32).astype(np.float32) + 0.5, "step",
                               f"layer{layer}_step", step))
    run = scaled(scaled(scaled(ref, "layer2", 1.05), "layer3", 1.05), "layer1_step_1", 1.05)
    flipped = [capture.array.copy() for capture in run if capture.key == "layer2_topk"][0]
    flipped[0, 0] = next(e for e in range(8) if e not in flipped[0])
    run = [Capture(c.key, flipped, c.kind, c.tag) if c.key == "layer2_topk" else c for c in run]
    report = compare(*map(str, write_pair(tmp_path, ref, run)))
    lines = format_report(report)
    assert report.prefill_divergence.layer == 2 and report.first_id_mismatch.key == "layer2_topk", lines
    assert report.first_divergence.key == "layer1_step_1", lines
    assert report.root_cause is None, lines



def test_greedy_decoding_without_the_fed_tokens_is_read_up_to_the_first_argmax_flip(tmp_path):
    """A review: where neither side records the tokens it fed (exclude=("input_token",): an engine
    instrumented by hand), a prompt bug at layer 3 that flips the next token makes every layer of
    the greedy steps after it differ; those steps say nothing of where the bug is, and before the
    fix `layer0_mixer_step_3` was named. Steps after the first argmax flip are not read."""
    reference = _llama()
    engine = copy.deepcopy(reference)
    engine.model.layers[3].mlp.register_forward_hook(lambda _m, _a, out: out * 3.0)

    def greedy(model):
        def run():
            out = model(input_ids=IDS, use_cache=True)
            for _ in range(3):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                            use_cache=True)
        return run
    ref = dump_run(reference, tmp_path / "ref", greedy(reference), exclude=("input_token",))
    run = dump_run(engine, tmp_path / "run", greedy(engine), exclude=("input_token",))
    report = compare(ref, run)
    lines = format_report(report)
    assert report.first_argmax_flip is not None and report.first_argmax_flip.kind == "divergence", lines
    assert any(record.divergent and record.layer == 0 and record.step > report.first_argmax_flip.step
               for record in report.pairs[0].keys), "the steps after the flip differ from layer 0 on"
    assert report.first_divergence.key == "layer3_mlp", lines[-1]


def _synthetic(prompt_bug: str) -> tuple[list, list]:
    """fp32 dumps of 4 layers, `final_norm` and 2 steps of each layer's state; RUN with `prompt_bug`'s
    key and `layer1_step_1` scaled by 1.05."""
    from helpers.dumpfactory import Capture, scaled

    rng = np.random.default_rng(2)
    ref = [Capture(f"layer{i}", rng.standard_normal(32).astype(np.float32) + 0.5, "record", f"layer{i}")
           for i in range(4)]
    ref.append(Capture("final_norm", rng.standard_normal(32).astype(np.float32) + 0.5, "record", "final_norm"))
    for step in (1, 2):
        ref += [Capture(f"layer{i}_step_{step}", rng.standard_normal(32).astype(np.float32) + 0.5, "step",
                        f"layer{i}_step", step) for i in range(4)]
    return ref, scaled(scaled(ref, prompt_bug, 1.05), "layer1_step_1", 1.05)


@pytest.mark.parametrize("prompt_bug", ["layer3", "final_norm"])
def test_a_prompt_divergence_after_the_layers_counts_as_after_every_layer(tmp_path, prompt_bug):
    """A review: a prompt that first diverges at `final_norm` (no layer) kept its place before a
    decode step diverging at layer 1."""
    from helpers.dumpfactory import write_pair

    report = compare(*map(str, write_pair(tmp_path, *_synthetic(prompt_bug))))
    assert report.prefill_divergence.key == prompt_bug
    assert report.first_divergence.key == "layer1_step_1", format_report(report)[-1]


@pytest.mark.parametrize("prompt_bug", ["layer3", "final_norm"])
def test_steps_fed_by_a_flipped_prompt_argmax_are_not_read(tmp_path, prompt_bug):
    """A review: where steps count from the first decode forward (a hand-instrumented engine that
    records no input_token), the prompt's own logits feed step 0; their argmax flipped, so every
    layer of every step differs, and `layer0_hidden_0` was named before the prompt's bug.
    Synthetic fp32 dumps."""
    from helpers.dumpfactory import Capture, write_pair

    rng = np.random.default_rng(3)

    def vec():
        return (rng.standard_normal(32) + 0.5).astype(np.float32)

    def logits():
        values = rng.standard_normal(50).astype(np.float32)
        values[7] = values.max() + 4
        return values
    ref, run = [], []
    for name, kind, step in [(f"layer{i}", "record", None) for i in range(4)] + [("final_norm", "record", None)]:
        value = vec()
        ref.append(Capture(name, value, kind, name))
        broken = name == prompt_bug or (prompt_bug == "layer3" and name == "final_norm")
        run.append(Capture(name, value * (1.5 if broken else 1.0), kind, name))
    prompt_logits = logits()
    flipped = prompt_logits.copy()
    flipped[9] = prompt_logits.max() + 2  # RUN's prompt picks another token
    ref.append(Capture("logits", prompt_logits, "record_once", "logits"))
    run.append(Capture("logits", flipped, "record_once", "logits"))
    for step in range(3):  # fed another token from step 0 on: every layer differs
        for i in range(4):
            value = vec()
            ref.append(Capture(f"layer{i}_hidden_{step}", value, "step", f"layer{i}_hidden", step))
            run.append(Capture(f"layer{i}_hidden_{step}", value + rng.standard_normal(32).astype(np.float32), "step",
                               f"layer{i}_hidden", step))
    report = compare(*map(str, write_pair(tmp_path, ref, run)))
    assert report.first_divergence.key == prompt_bug, format_report(report)[-1]


def test_recorded_fed_tokens_count_only_up_to_the_first_step_not_seen_equal(tmp_path):
    """A review: one equal `input_token` key switched the guard off even where the later ones
    differed without refusing anything (two ids per step: no one token to read); a prompt bug at
    layer 3 had `layer0_mlp_step_1` named. Synthetic fp32 dumps."""
    from helpers.dumpfactory import Capture, write_pair

    rng = np.random.default_rng(3)
    ref, run = [], []
    for i in range(4):
        value = (rng.standard_normal(32) + 0.5).astype(np.float32)
        ref.append(Capture(f"layer{i}", value, "record", f"layer{i}"))
        run.append(Capture(f"layer{i}", value * (1.5 if i == 3 else 1.0), "record", f"layer{i}"))
    for step in range(4):
        tokens = np.array([3, 4], np.int32)
        ref.append(Capture(f"input_token_{step}", tokens, "step", "input_token", step))
        run.append(Capture(f"input_token_{step}", np.array([3, 9 if step else 4], np.int32), "step", "input_token",
                           step))
        for i in range(4):
            value = (rng.standard_normal(32) + 0.5).astype(np.float32)
            other = value + (rng.standard_normal(32).astype(np.float32) if step else 0) * (1.5 if i == 3 else 1.0)
            ref.append(Capture(f"layer{i}_mlp_step_{step}", value, "step", f"layer{i}_mlp_step", step))
            run.append(Capture(f"layer{i}_mlp_step_{step}", other, "step", f"layer{i}_mlp_step", step))
    report = compare(*map(str, write_pair(tmp_path, ref, run)))
    assert report.first_divergence.key == "layer3", format_report(report)[-1]
