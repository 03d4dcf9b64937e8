"""An fp32 divergence whose first crossing comes after the key where its values jump: the verdict
says where they jump (compare/jumps.py). A 1 % attention bug diluted into the stream after
attention passed the fp32 threshold there and was named at the router, the MLP or a later layer
with `last good: layer1_attn` (a bug-injection audit of 44 transformers models)."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import transformers

from compiledump.compare import compare, format_report
from compiledump.compare.jumps import JUMP
from helpers import dumpfactory as factory
from helpers import hf_dump
from helpers.reference_metrics import rel_diff

CAUTION = "the values jump at {}, before it (see the note)"


def _chain(rng, sizes, dtype="float32", tmp_path=None):
    """Keys `layer0`, `layer1_attn`, `layer1_mlp`, `layer1`, `layer2_attn` (64 wide) whose RUN side
    differs from REF by relative L2 errors ``sizes`` orthogonal to REF (rel_diff about size²/2)."""
    tags = ["layer0", "layer1_attn", "layer1_mlp", "layer1", "layer2_attn"]
    ref = [factory.Capture(tag, rng.standard_normal(64).astype(np.float32), "record", tag) for tag in tags]
    run = []
    for capture, size in zip(ref, sizes):
        noise = rng.standard_normal(64)
        noise -= capture.array * (noise @ capture.array) / (capture.array @ capture.array)  # a turn, not a scale:
        noise *= size * np.linalg.norm(capture.array) / np.linalg.norm(noise)  # rel_diff alone crosses
        run.append(factory.Capture(capture.key, (capture.array + noise).astype(np.float32), "record", capture.tag))
    ref_path, run_path = factory.write_pair(tmp_path, ref, run, dtype, dtype)
    return compare(ref_path, run_path), [(capture.array, other.array) for capture, other in zip(ref, run)]


@pytest.mark.parametrize("sizes, jump", [
    ([1e-7, 2e-7, 9e-5, 8e-5, 6e-4], "layer1"),        # a jump of x1e5 in the stream, crossing at layer2_attn
    ([0.0, 0.0, 9e-5, 8e-5, 6e-4], "layer1"),          # bitwise equal before it: the first stream key that differs
    ([1e-7, 3e-5, 4e-5, 2e-5, 6e-4], "layer1_attn"),   # the last jump before the crossing
    ([1e-7, 2e-7, 3e-7, 2e-7, 6e-4], None),            # the crossing is the jump: nothing to add
    ([1e-7, 9e-5, 2e-7, 2e-7, 6e-4], None),            # back to the noise after it: no trail, no jump
    ([0.0, 1e-7, 2e-7, 2e-7, 6e-4], None),             # rounding's onset after equal keys is no jump
    ([1e-7, 2e-7, 1e-5, 1e-5, 6e-4], None),            # a jump too far below the threshold (1e-8 / 100)
])
def test_the_verdict_says_where_fp32_values_jump_before_the_first_crossing(tmp_path, sizes, jump):
    report, arrays = _chain(np.random.default_rng(3), sizes, tmp_path=tmp_path)
    first, lines = report.first_divergence, format_report(report)
    assert report.exit_status == 1 and first.key == "layer2_attn", lines[-1]
    values = [rel_diff(x, y) for x, y in arrays]
    assert values[-1] > 1e-8 > max(values[:-1])  # (the chain's own premise)
    if jump is None:
        assert first.caution is None and not any("fp32 rounding grows gradually" in line for line in lines)
        return
    assert first.caution == CAUTION.format(jump) and lines[-1].endswith(f"caution: {CAUTION.format(jump)}")
    index = ["layer0", "layer1_attn", "layer1_mlp", "layer1", "layer2_attn"].index(jump)
    (note,) = [line for line in lines if line.startswith(f"note: {jump} is within its thresholds")]
    before = max(value for i, value in enumerate(values[:index]) if i != 2)  # the stream's (not layer1_mlp)
    assert values[index] >= JUMP * before and all(value > JUMP * before for value in values[index:])
    assert values[index] >= 1e-8 / JUMP
    assert (f"{values[index] / before:.0f} times the largest before it" if before else "comes after keys equal on both sides") \
        in note


def test_a_router_that_nearly_cancels_right_before_a_named_bug_is_no_jump(tmp_path):
    """Only the stream's keys can be where the values jump: one token's 8 router logits that
    nearly cancel read far above the keys before them honestly (a review: the caution blamed the
    router right before a correctly named MLP bug)."""
    rng = np.random.default_rng(5)
    tags = ["layer0", "layer1_attn", "layer1_router", "layer1_mlp"]
    ref = [factory.Capture(tag, rng.standard_normal(8 if "router" in tag else 64).astype(np.float32), "record", tag)
           for tag in tags]
    run = [factory.Capture(c.key, (c.array * (1 + 1e-7 * rng.standard_normal(c.array.shape))).astype(np.float32),
                           "record", c.tag) for c in ref]
    run[2] = factory.Capture("layer1_router", (ref[2].array + 2e-5 * rng.standard_normal(8)).astype(np.float32),
                             "record", "layer1_router")  # 1e-10 and more: far above the stream's 1e-14
    run[3] = factory.Capture("layer1_mlp", (ref[3].array * 1.01).astype(np.float32), "record", "layer1_mlp")
    report = compare(*factory.write_pair(tmp_path, ref, run, "float32", "float32"))
    values = {record.key: record.floats.rel_diff for record in report.keys}
    assert 1e-10 < values["layer1_router"] < 1e-8 and values["layer1_attn"] < 1e-12
    assert report.first_divergence.key == "layer1_mlp" and report.first_divergence.caution is None


def test_a_low_precision_pair_gets_no_jump_note(tmp_path):
    """bf16 rounding does not grow gradually enough to read a jump: no note there."""
    report, _ = _chain(np.random.default_rng(4), [1e-4, 2e-4, 3e-2, 3e-2, 9e-2], "bfloat16", tmp_path)
    assert report.exit_status == 1 and report.first_divergence.key == "layer2_attn"
    assert report.first_divergence.caution is None


def _mixtral() -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("module, jump", [("self_attn.q_proj", "layer1_attn"), ("mlp.experts", None)])
def test_a_diluted_attention_bug_in_a_noisy_fp32_engine_is_placed_at_the_stream_after_attention(tmp_path, module,
                                                                                                 jump):
    """Mixtral in fp32, the engine's weights each off by about 1e-7 relative (fp32-like noise in
    every key), layer 1's query projection scaled by 1.01: the stream after attention moves by
    about 1e-4 (relative L2), under the fp32 threshold, and the first crossing is the router; the
    verdict says the values jump at `layer1_attn`. An expert bug is named where it is, no note.
    (Without attention's own output, `layer<i>_mixer`, which names this bug itself: as a model
    whose mixer beside an MLP has no such tap, a Mamba or linear-attention one.)"""
    reference = _mixtral()
    ids = torch.randint(3, 160, (1, 8), generator=torch.Generator().manual_seed(1))
    run = lambda model: lambda: model(input_ids=ids, use_cache=False)  # noqa: E731
    dump_run = functools.partial(hf_dump.dump_run, exclude=("layer{i}_mixer",))
    dump_run(reference, tmp_path / "ref", run(reference))
    engine = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in engine.parameters():
            parameter.mul_(1 + 1e-7 * torch.randn(parameter.shape, generator=generator))
    engine.model.layers[1].get_submodule(module).register_forward_hook(
        lambda _m, _a, out: (out[0] * 1.01, *out[1:]) if isinstance(out, tuple) else out * 1.01)
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", run(engine)))
    first, lines = report.first_divergence, format_report(report)
    assert report.exit_status == 1 and first.layer == 1, lines[-1]
    values = {record.key: record.floats.rel_diff for record in report.keys if record.floats is not None}
    assert 0 < values["layer0"] < 1e-10  # the noise is there
    if jump is None:
        assert first.key == "layer1_mlp" and first.caution is None, lines[-1]
    else:
        assert first.key != "layer1_attn" and values["layer1_attn"] < 1e-8, lines[-1]
        assert first.caution == CAUTION.format(jump), lines[-1]
