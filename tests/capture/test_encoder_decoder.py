"""Encoder-decoders (Bart, mBART, Marian, Pegasus, Whisper) under `instrument()`'s defaults.
Before 2026-12-06 the first layer list beside a token embedding was tapped, in Bart's family the
encoder's: its layers run once per request, so no decode step was recorded and a decoder bug read
as nothing at all; an encoder bug in Whisper (whose decoder was found) read as the decoder's first
layer. Now the decoder's layers are tapped, with the stream after self- and cross-attention
(`layer<i>_attn`: the input of the norm the layer's forward calls after its cross-attention, in pre-
and post-norm layers alike), and the encoder's output is recorded once (`encoder_output`, its last
source row). An explicit tap inside the encoder records once too: a
plain record there taught the token gate the source's length, and every decoder prompt tag was
dropped. Each tag is checked against this test's own hooks on the model."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import transformers as T

import compiledump
from helpers.hf_dump import compare_run, dump_run, load_dump, scale_output

VOCAB, SOURCE, PROMPT, STEPS = 160, 12, 4, 3
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
SIZES = dict(vocab_size=VOCAB, d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
             decoder_ffn_dim=96, **IDS)
CONFIGS = {"bart": T.BartConfig, "mbart": T.MBartConfig, "marian": T.MarianConfig, "pegasus": T.PegasusConfig,
           "whisper": T.WhisperConfig}
# The norm that reads the stream after self- and cross-attention: pre-norm layers' final_layer_norm;
# post-norm layers (Bart, Marian) normalise that sum in encoder_attn_layer_norm
AFTER_ATTENTION = {"bart": "encoder_attn_layer_norm", "marian": "encoder_attn_layer_norm"}

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def build(name: str, seed: int = 0, scale: float = 0.1, encoder_layers: int = 3, decoder_layers: int = 2):
    extra = dict(num_mel_bins=16, max_source_positions=16, max_target_positions=32) if name == "whisper" else {}
    config = CONFIGS[name](encoder_layers=encoder_layers, decoder_layers=decoder_layers, init_std=scale, **SIZES, **extra)
    torch.manual_seed(seed)
    model = T.WhisperForConditionalGeneration(config) if name == "whisper" else T.AutoModelForSeq2SeqLM.from_config(config)
    return model.eval()


def source(name: str, model, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    if name == "whisper":  # 16 mel bins, 32 frames: 16 source positions after its stride-2 conv
        return {"input_features": torch.randn(1, 16, 32, generator=generator).to(model.dtype)}
    return {"input_ids": torch.randint(3, VOCAB, (1, SOURCE), generator=generator)}


def session(name: str, model, seed: int = 0):
    """The source, a 4-token decoder prompt and STEPS cached decode steps, teacher-forced."""
    generator = torch.Generator().manual_seed(seed + 100)
    prompt, steps = torch.randint(3, VOCAB, (1, PROMPT), generator=generator), torch.randint(3, VOCAB, (STEPS,),
                                                                                              generator=generator)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (transformers' past_key_values renaming note)
            out = model(**source(name, model, seed), decoder_input_ids=prompt, use_cache=True)
            encoded = (out.encoder_last_hidden_state,)
            for token in steps:
                out = model(encoder_outputs=encoded, decoder_input_ids=token.view(1, 1),
                            past_key_values=out.past_key_values, use_cache=True)
    return run


def own_reading(name, model):
    """The first source row of the encoder's output and of each encoder layer's; the last prompt row
    of each decoder layer's output and of its fc2 (the MLP's output); the head's output. (The first
    call's of each: the hooks return None, since a hook's value would replace the module's output.)"""
    got = {"encoder": {}, "decoder": {}, "mlp": {}, "attn": {}, "model": {}}

    def keep(kind, key, out) -> None:
        tensor = getattr(out, "last_hidden_state", None)
        tensor = tensor if tensor is not None else out[0] if isinstance(out, tuple) else out
        row = 0 if kind == "encoder" or key == "encoder_output" else -1
        got[kind].setdefault(key, tensor[0, row].float().numpy().copy())
    hooks = [model.model.encoder.register_forward_hook(lambda _m, _a, out: keep("model", "encoder_output", out)),
             model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: keep("model", "logits", out))]
    for i, layer in enumerate(model.model.encoder.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: keep("encoder", i, out)))
    for i, layer in enumerate(model.model.decoder.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: keep("decoder", i, out)))
        hooks.append(layer.fc2.register_forward_hook(lambda _m, _a, out, i=i: keep("mlp", i, out)))
        hooks.append(getattr(layer, AFTER_ATTENTION.get(name, "final_layer_norm")).register_forward_pre_hook(
            lambda _m, args, i=i: keep("attn", i, args[0])))
    with torch.no_grad():
        session(name, model)()
    for hook in hooks:
        hook.remove()
    return got


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_decoder_is_tapped_and_the_encoder_output_recorded_once(tmp_path, name):
    model = build(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays, manifest = load_dump(dump_run(model, tmp_path, session(name, model),
                                              taps={"encoder{i}": "model.encoder.layers.{i}"}))
    said = [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    handle = compiledump.instrument(model)
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    assert taps["layer0"] == "model.decoder.layers.0" and taps["encoder_output"] == "model.encoder"
    assert taps["input_token"] == "model.decoder.embed_tokens:input"
    assert taps["layer1_attn"] == f"model.decoder.layers.1.{AFTER_ATTENTION.get(name, 'final_layer_norm')}:input"
    if name != "whisper":  # (Whisper's encoder has no token embedding: its decoder was found before)
        assert any("decoder's layers at model.decoder.layers" in s and "model.encoder.layers" in s for s in said), said
    assert manifest["prompt_tokens"] == PROMPT  # the decoder's prompt, not the source's length
    got = own_reading(name, model)
    np.testing.assert_array_equal(arrays["encoder_output"], got["model"]["encoder_output"])
    for i in range(3):  # every encoder layer (3), though the decoder has 2
        np.testing.assert_array_equal(arrays[f"encoder{i}"], got["encoder"][i])
    for i in range(2):
        np.testing.assert_array_equal(arrays[f"layer{i}"], got["decoder"][i])
        np.testing.assert_array_equal(arrays[f"layer{i}_mlp"], got["mlp"][i])
        np.testing.assert_array_equal(arrays[f"layer{i}_attn"], got["attn"][i])
        if name not in AFTER_ATTENTION:  # pre-norm: the layer adds the MLP's output to that stream
            np.testing.assert_allclose(arrays[f"layer{i}_attn"] + arrays[f"layer{i}_mlp"], arrays[f"layer{i}"],
                                       rtol=1e-6, atol=1e-6 * float(np.abs(arrays[f"layer{i}"]).max()))
        assert {f"layer{i}_step_{n}" for n in range(STEPS + 1)} <= set(arrays)
    np.testing.assert_array_equal(arrays["logits_0"], got["model"]["logits"])


@pytest.mark.parametrize("name", ["bart", "pegasus", "whisper"])
def test_an_honest_pair_exits_0_and_bugs_are_named_where_they_start(tmp_path, name):
    reference = build(name, seed=1)
    ref = dump_run(reference, tmp_path / "ref", session(name, reference, seed=1))
    honest = copy.deepcopy(reference).to(torch.bfloat16)
    report, last = compare_run(ref, honest, tmp_path / "honest", session(name, honest, seed=1))
    assert report.exit_status == 0, last
    for where, module, key in (("encoder", "fc2", "encoder_output"), ("decoder", "fc2", "layer1_mlp"),
                               ("decoder", "encoder_attn", "layer1_attn")):
        engine = copy.deepcopy(reference)
        scale_output(getattr(getattr(engine.model, where).layers[1], module))
        report, last = compare_run(ref, engine, tmp_path / where, session(name, engine, seed=1))
        assert report.exit_status == 1 and report.first_divergence.key == key, last


def test_florence2_s_decoder_is_tapped_and_its_image_side_is_the_encoder_output():
    """Florence-2 (a Bart text model under a vision tower): its image features enter the encoder, so
    the decoder is tapped, `encoder_output` records the encoder's result and no `input_embeds` is
    recorded at the decoder's first layer (whose input is text only). Before: the encoder's layers
    were tapped (taps only: not audited with images)."""
    text = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, **IDS)
    vision = T.AutoConfig.for_model("florence2").vision_config.to_dict()
    vision.update(embed_dim=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4], num_groups=[1, 2, 2, 4],
                  projection_dim=64)
    config = T.AutoConfig.for_model("florence2", text_config=text, vision_config=vision, image_token_id=150)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = compiledump.instrument(T.AutoModelForImageTextToText.from_config(config).eval())
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    assert taps["layer0"] == "model.language_model.decoder.layers.0"
    assert taps["encoder_output"] == "model.language_model.encoder" and "input_embeds" not in taps
    assert taps["layer0_attn"] == "model.language_model.decoder.layers.0.encoder_attn_layer_norm:input"


def generate(model, inputs: dict, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, **options)


def test_generate_s_one_token_decoder_prompt_is_told_and_compared_forward_by_forward(tmp_path):
    """`generate()` feeds the decoder its start token alone, as every decode step: the prompt keys
    hold the last forward's values. A note says so, they are not compared, and `layer<i>_step_0`
    (the prompt's forward) is: a bug of an MLP in the first forward only is named there (at its own
    output, `layer1_mlp_step_0`), a bug from the second forward on at `layer1_mlp_step_1`, in the decode phase (before: no note, the prompt keys compared as
    the prompt's, so the decode-only bug read as a prefill divergence at `layer1_mlp`)."""
    model = build("bart", seed=2)
    inputs = source("bart", model, seed=2)
    ref = dump_run(model, tmp_path / "ref", lambda: generate(model, inputs))
    report, last = compare_run(ref, model, tmp_path / "same", lambda: generate(model, inputs))
    assert report.exit_status == 0, last
    (pair,) = report.pairs
    assert any("the prompt's call had 1 token" in note for note in pair.notes), pair.notes
    assert {"layer0_step_0", "layer1_step_0", "layer1_mlp_step_0", "layer1_attn_step_0"} <= \
        {record.key for record in pair.keys if record.status == "ok"}
    engine = copy.deepcopy(model)
    calls = [0]

    def first_forward_only(_m, _a, out):
        calls[0] += 1
        return out * 1.01 if calls[0] == 1 else None
    engine.model.decoder.layers[1].fc2.register_forward_hook(first_forward_only)
    report, last = compare_run(ref, engine, tmp_path / "bug", lambda: generate(engine, inputs))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_mlp_step_0", last
    assert "layer1_mlp" not in {record.key for record in report.pairs[0].keys}  # the last forward's: not compared
    engine = copy.deepcopy(model)
    calls[0] = 0

    def decode_only(_m, _a, out):
        calls[0] += 1
        return out * 1.001 if calls[0] > 1 else None
    engine.model.decoder.layers[1].fc2.register_forward_hook(decode_only)
    report, last = compare_run(ref, engine, tmp_path / "decode", lambda: generate(engine, inputs))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_mlp_step_1", last
    assert report.first_divergence.phase == "decode"


def test_a_reference_without_a_kv_cache_runs_its_encoder_at_every_forward(tmp_path):
    """A teacher-forced reference without a cache re-runs the encoder on the same source at each
    forward; `encoder_output` keeps the first run's and is compared with the cached run's (the
    review's first mend refused it: 'REF ran its encoder 4 times')."""
    model = build("bart", seed=1)
    inputs = source("bart", model, seed=1)
    generator = torch.Generator().manual_seed(101)
    prompt, steps = torch.randint(3, VOCAB, (1, PROMPT), generator=generator), torch.randint(3, VOCAB, (STEPS,),
                                                                                              generator=generator)

    def uncached():
        ids = prompt
        for token in [None, *steps]:
            ids = ids if token is None else torch.cat([ids, token.view(1, 1)], 1)
            model(**inputs, decoder_input_ids=ids, use_cache=False)

    def cached():
        out = model(**inputs, decoder_input_ids=prompt, use_cache=True)
        for token in steps:
            out = model(encoder_outputs=(out.encoder_last_hidden_state,), decoder_input_ids=token.view(1, 1),
                        past_key_values=out.past_key_values, use_cache=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref = dump_run(model, tmp_path / "ref", uncached)
        report, last = compare_run(ref, model, tmp_path / "run", cached)
    assert report.exit_status == 0, last
    assert [record.status for record in report.pairs[0].keys if record.key == "encoder_output"] == ["ok"]


def test_a_right_padded_source_batch_compares_with_its_row_alone(tmp_path):
    """`encoder_output` is the first source row, a real token of every right-padded row (before: the
    last row, a pad position of the shorter source: exit 1 on an honest pair)."""
    model = build("bart", seed=3)
    generator = torch.Generator().manual_seed(3)
    long, short = torch.randint(3, VOCAB, (12,), generator=generator), torch.randint(3, VOCAB, (8,), generator=generator)
    batch = torch.zeros(2, 12, dtype=torch.long)
    batch[0], batch[1, :8] = long, short
    padded = {"input_ids": batch, "attention_mask": (batch != 0).long()}
    ref = dump_run(model, tmp_path / "ref", lambda: generate(model, padded), batch_row=1)
    report, last = compare_run(ref, model, tmp_path / "run", lambda: generate(model, {"input_ids": short[None]}))
    assert report.exit_status == 0, last


def test_a_run_of_two_requests_does_not_compare_its_first_encoder_output(tmp_path):
    """`encoder_output` keeps the first encoder run's: a side that ran two requests holds the first's,
    not comparable (exit 3; before: exit 1 at encoder_output)."""
    model = build("bart", seed=4)
    first, second = source("bart", model, seed=5), source("bart", model, seed=6)
    ref = dump_run(model, tmp_path / "ref", lambda: generate(model, second, decoder_input_ids=torch.tensor([[1, 7]])))
    report, last = compare_run(ref, model, tmp_path / "run", lambda: (
        generate(model, first, decoder_input_ids=torch.tensor([[1, 9]])),
        generate(model, second, decoder_input_ids=torch.tensor([[1, 7]]))))
    assert report.exit_status == 3 and report.first_divergence is None, last
    (record,) = [record for record in report.pairs[0].keys if record.key == "encoder_output"]
    assert record.status == "not_comparable" and "ran its encoder 2 times" in record.reason


def test_t5_tapped_by_hand_keeps_the_decoder_s_prompt(tmp_path):
    """T5 tapped by hand (the defaults find it since the twenty-seventh session: test_t5_family.py); a
    tap of its encoder's blocks records once (its encoder from `get_encoder()`), so the token gate
    learns the decoder's prompt (before: the source's 12 tokens, and every decoder prompt tag was skipped)."""
    config = T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=2,
                        num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = T.T5ForConditionalGeneration(config).eval()
    inputs = source("t5", model)
    taps = {"layer{i}": "decoder.block.{i}", "logits": "lm_head", "input_token": "decoder.embed_tokens:input",
            "encoder{i}": "encoder.block.{i}"}
    arrays, manifest = load_dump(dump_run(model, tmp_path, lambda: generate(
        model, inputs, decoder_input_ids=torch.tensor([[0, 5, 6, 7]])), taps=taps, defaults=False))
    assert manifest["prompt_tokens"] == PROMPT
    assert {"layer0", "layer1", "encoder0", "encoder1", "encoder2"} <= set(arrays)


def test_a_standalone_decoder_with_an_unused_cross_attention_is_warned(tmp_path):
    """BartForCausalLM runs its decoder layers without an encoder: their cross-attention and its norm
    never run, so no `layer<i>_attn` is tapped there (it would record nothing) and the layers are
    warned about; an integer tap inside an encoder is warned about, not recorded."""
    config = T.BartConfig(**SIZES, decoder_layers=2, encoder_layers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = compiledump.instrument(T.BartForCausalLM(config).eval())
    assert "layer0_attn" not in handle.taps
    assert any("no layer<i>_attn" in str(w.message) for w in caught)
    handle.remove()
    compiledump.reset()
    model = build("bart")
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with pytest.warns(RuntimeWarning, match="holds integers: not recorded"):
        arrays, _ = load_dump(dump_run(model, tmp_path, lambda: model(**source("bart", model), decoder_input_ids=prompt),
                                       taps={"source_ids": "model.encoder.embed_tokens:input"}))
    assert "source_ids" not in arrays and "encoder_output" in arrays


def test_one_token_prompts_keep_their_refusals_and_their_layers(tmp_path):
    """The third review's cases, on Bart's one-token `generate()`: a RUN that ran the request twice
    (the second time broken) writes its prompt keys more often: refused (exit 3), not skipped into
    "no divergence"; a RUN that ran its encoder on another source first (a warm-up outside
    profiling()) keeps that run's `encoder_output`: not comparable; without layer step states the
    prompt keys are the only layer keys, so they are compared and the bug is named at its layer."""
    model = build("bart", seed=2)
    inputs, other = source("bart", model, seed=2), source("bart", model, seed=7)
    ref = dump_run(model, tmp_path / "ref", lambda: generate(model, inputs))
    engine = copy.deepcopy(model)
    broken = [False]
    engine.model.decoder.layers[1].fc2.register_forward_hook(lambda _m, _a, out: out * 1.01 if broken[0] else None)

    def twice():
        generate(engine, inputs)
        broken[0] = True
        generate(engine, inputs)
    report, last = compare_run(ref, engine, tmp_path / "twice", twice)
    refused = [record for record in report.pairs[0].keys if (record.reason or "").startswith("written again")]
    assert report.exit_status == 3 and {"layer1_mlp", "layer1"} <= {record.key for record in refused}, last
    report, last = compare_run(ref, model, tmp_path / "warm", lambda: (model.get_encoder()(**other),
                                                                      generate(model, inputs)))
    (record,) = [record for record in report.pairs[0].keys if record.key == "encoder_output"]
    assert report.exit_status == 3 and record.status == "not_comparable", last
    ref = dump_run(model, tmp_path / "ref_nosteps", lambda: generate(model, inputs), step_states=False)
    broken[0] = True
    report, last = compare_run(ref, engine, tmp_path / "nosteps", lambda: generate(engine, inputs))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_mlp", last
