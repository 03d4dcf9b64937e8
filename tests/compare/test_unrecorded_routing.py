"""A first divergence after MoE layers whose expert ids the MoE layer filter left out
(COMPILEDUMP_MOE_LAYERS, default 2) carries a caution and a note naming the setting that judges
them. Hugging Face Qwen3-MoE built from config (random weights of scale 0.1, 4 MoE layers), a bf16
copy against the float32 model: in this seed a near tie in layer 2 flips one prompt token's expert,
which moves `layer2` just past the bf16 threshold. Before the twenty-eighth session the verdict read
as a plain divergence; with the layer's routing recorded the flip is judged a near tie (exit 0)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import transformers as T

import compiledump
from compiledump import config as cd_config
from compiledump.compare import compare, format_report

CONFIG = dict(vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _dump(model, directory, moe_layers: int) -> str:
    """An 8-token prompt and 4 teacher-forced steps; a Hugging Face model, or an engine of
    examples/vllm_style_engine.py (flat tokens, gates that return their logits alone)."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 160, (1, 8), generator=generator)
    steps = torch.randint(3, 160, (4, 1, 1), generator=generator)
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory), moe_layers=moe_layers)))
    handle = compiledump.instrument(model)
    with torch.no_grad():
        if hasattr(model, "generate") and not hasattr(model, "config"):
            model.generate(prompt[0], [int(token) for token in steps.flatten()])
        else:
            out = model(input_ids=prompt, use_cache=True)
            for token in steps:
                out = model(input_ids=token, cache=out.cache, use_cache=True)
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        path = compiledump.flush()
    compiledump.reset()
    return path


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    reference = T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model("qwen3_moe", **CONFIG)).eval()
    return reference, copy.deepcopy(reference).to(torch.bfloat16)


def test_a_divergence_after_unrecorded_routing_says_so_and_how_to_judge_it(tmp_path, models):
    reference, engine = models
    report = compare(_dump(reference, tmp_path / "ref", 2), _dump(engine, tmp_path / "run", 2))
    first, (pair,) = report.first_divergence, report.pairs
    assert report.exit_status == 1 and (first.key, first.layer) == ("layer2", 2), format_report(report)[-1]
    assert first.caution == "after MoE layers whose routing is not recorded (see the note)"
    (note,) = [note for note in pair.notes if "whose expert ids are not recorded" in note]
    assert note.startswith("the first divergence (layer 2) is at or after MoE layer(s) 2 whose ") and \
        note.endswith("set COMPILEDUMP_MOE_LAYERS=4 on both sides to judge their routing"), note
    assert "caution: after MoE layers whose routing is not recorded" in format_report(report)[-1]
    # Recorded, the flip is a near tie, and what it reaches is not judged
    report = compare(_dump(reference, tmp_path / "ref4", 4), _dump(engine, tmp_path / "run4", 4))
    assert report.exit_status == 0 and report.pairs[0].first_id_mismatch.key == "layer2_topk", \
        format_report(report)[-1]


def test_an_engine_whose_gates_record_no_ids_gets_the_caution_from_the_reference(tmp_path, models):
    """A vLLM-style engine's gates return their logits alone: its manifest cannot say which
    routing is recorded, the reference's can (a review found no caution there)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "vllm_style_engine.py"
    spec = importlib.util.spec_from_file_location("vllm_style_engine_unrecorded", example)
    engines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engines)
    reference, _ = models
    engine = engines.ForCausalLM(reference).eval().to(torch.bfloat16)
    report = compare(_dump(reference, tmp_path / "ref", 2), _dump(engine, tmp_path / "run", 2))
    first = report.first_divergence
    assert report.exit_status == 1 and first.key == "layer2", format_report(report)[-1]
    assert first.caution == "after MoE layers whose routing is not recorded (see the note)"


def test_a_float32_divergence_after_unrecorded_routing_has_no_caution(tmp_path, models):
    """In float32 no rounding flips a route: a divergence is one, filter or not."""
    reference, _ = models
    engine = copy.deepcopy(reference)
    with torch.no_grad():
        engine.model.layers[3].self_attn.o_proj.weight.mul_(1.01)
    report = compare(_dump(reference, tmp_path / "ref", 2), _dump(engine, tmp_path / "run", 2))
    first = report.first_divergence
    assert report.exit_status == 1 and first.key == "layer3_attn" and first.caution is None, \
        format_report(report)[-1]
    assert not any("whose expert ids are not recorded" in note for note in report.pairs[0].notes)
