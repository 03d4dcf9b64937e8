"""BERT's family as decoders (BERT, RoBERTa, ELECTRA, MegatronBERT, XLM-RoBERTa-XL, RoBERTa-
PreLayerNorm as causal LMs; the decoder of a BERT-style `EncoderDecoderModel`) and CTRL under
`instrument()`'s defaults. Before 2026-12-06 (twenty-seventh session) each raised "no decoder layers
found": BERT's layers sit in `<model>.encoder.layer`, its token embedding in
`<model>.embeddings.word_embeddings` beside the `encoder`, and its MLP is split into `intermediate`
and an `output` that adds the residual (and, post-norm, normalises the sum); CTRL's token mixer is
`multi_head_attention`. Now `layer<i>_attn` is the stream after attention (`intermediate`'s input;
MegatronBERT's and XLM-RoBERTa-XL's pre-MLP norm's), `layer<i>_mlp` the down projection
`output.dense`. Each tag is checked against this test's own hooks on the model."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import transformers as T

import compiledump
from helpers.hf_dump import compare_run, dump_run, load_dump, scale_output

VOCAB, PROMPT, STEPS, LAYERS = 160, 6, 3, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=96,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64, is_decoder=True)
CTRL = dict(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, dff=96, n_positions=64)
MODELS = ("bert", "roberta", "electra", "megatron-bert", "xlm-roberta-xl", "roberta-prelayernorm", "ctrl")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def build(model_type: str, seed: int = 0, init: float = 0.02):
    sizes = CTRL if model_type == "ctrl" else SMALL
    config = T.AutoConfig.for_model(model_type, **sizes, initializer_range=init)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (BERT's "add is_decoder=True" note)
        return T.AutoModelForCausalLM.from_config(config).eval()


def session(model, seed: int = 0):
    """A prompt, then STEPS teacher-forced tokens, each forward over the whole sequence (no cache):
    `layer<i>_step_<n>` and `logits_<n>` hold each forward's last position."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, PROMPT + STEPS), generator=generator)

    def run():
        for end in range(PROMPT, PROMPT + STEPS + 1):
            model(input_ids=ids[:, :end], use_cache=False)
    return run


def layers_of(model):
    return model.transformer.h if hasattr(model, "transformer") else model.base_model.encoder.layer


def parts(layer):
    """(the module whose output is the stream after attention, the MLP's own output module)."""
    if hasattr(layer, "multi_head_attention"):  # CTRL: the stream after attention is layernorm2's input
        return None, layer.ffn
    return getattr(layer, "crossattention", layer.attention), layer.output.dense


def own_reading(model, run) -> dict:
    """The first call's last row of each layer's stream after attention, MLP output and output, the
    token embedding's input ids and the head's output."""
    got = {"attn": {}, "mlp": {}, "layer": {}}

    def keep(kind, i, value) -> None:  # (a hook that returns a value replaces the module's output)
        tensor = value[0] if isinstance(value, tuple) else value
        row = tensor[0, -1].float().numpy().copy()
        (got[kind] if i is not None else got).setdefault(i if i is not None else kind, row)
    hooks = [model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: keep("logits", None, out))]
    for i, layer in enumerate(layers_of(model)):
        attention, mlp = parts(layer)
        if attention is None:
            hooks.append(layer.layernorm2.register_forward_pre_hook(lambda _m, args, i=i: keep("attn", i, args[0])))
        else:
            hooks.append(attention.register_forward_hook(lambda _m, _a, out, i=i: keep("attn", i, out)))
        hooks += [mlp.register_forward_hook(lambda _m, _a, out, i=i: keep("mlp", i, out)),
                  layer.register_forward_hook(lambda _m, _a, out, i=i: keep("layer", i, out))]
    with torch.no_grad():
        run()
    for hook in hooks:
        hook.remove()
    return got


@pytest.mark.parametrize("model_type", MODELS)
def test_the_layers_are_found_and_each_tag_is_what_it_names(tmp_path, model_type):
    model = build(model_type)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays, manifest = load_dump(dump_run(model, tmp_path, session(model)))
    said = [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    assert not said, said
    handle = compiledump.instrument(model)
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    base = model.base_model_prefix
    if model_type != "ctrl":
        assert taps["input_token"] == f"{base}.embeddings.word_embeddings:input"
        assert taps["layer1_mlp"] == f"{base}.encoder.layer.1.output.dense"
    assert manifest["prompt_tokens"] == PROMPT and set(manifest["mixers"].values()) == {"attention"}
    got = own_reading(model, session(model))
    np.testing.assert_array_equal(arrays["logits_0"], got["logits"])
    for i, layer in enumerate(layers_of(model)):
        for kind, key in (("attn", f"layer{i}_attn"), ("mlp", f"layer{i}_mlp"), ("layer", f"layer{i}")):
            np.testing.assert_array_equal(arrays[key], got[kind][i], err_msg=key)
        attn_plus_mlp = torch.from_numpy(arrays[f"layer{i}_attn"] + arrays[f"layer{i}_mlp"])
        post_norm = getattr(getattr(layer, "output", None), "LayerNorm", None)  # BERT's output normalises the sum
        expected = (post_norm(attn_plus_mlp) if post_norm is not None else attn_plus_mlp).detach().numpy()
        np.testing.assert_allclose(expected, arrays[f"layer{i}"], rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))
        assert {f"layer{i}_step_{n}" for n in range(STEPS + 1)} <= set(arrays)


@pytest.mark.parametrize("model_type", ["bert", "megatron-bert", "ctrl"])
def test_an_honest_pair_exits_0_and_bugs_are_named_where_they_start(tmp_path, model_type):
    """A float32 reference and its bfloat16 copy exit 0; a x1.01 scale of layer 1's MLP or of its
    attention is named at `layer1_mlp` or at attention's own output, `layer1_mixer`."""
    reference = build(model_type, seed=1, init=0.1)
    ref = dump_run(reference, tmp_path / "ref", session(reference, seed=1))
    honest = copy.deepcopy(reference).to(torch.bfloat16)
    report, last = compare_run(ref, honest, tmp_path / "honest", session(honest, seed=1))
    assert report.exit_status == 0, last
    for where, key in (("mlp", "layer1_mlp"), ("attention", "layer1_mixer")):
        engine = copy.deepcopy(reference)
        layer = layers_of(engine)[1]
        attention = getattr(layer, "multi_head_attention", None) or layer.attention.self
        scale_output(parts(layer)[1] if where == "mlp" else attention)
        report, last = compare_run(ref, engine, tmp_path / where, session(engine, seed=1))
        assert report.exit_status == 1 and report.first_divergence.key == key, (where, last)


def test_a_bert_style_encoder_decoder_taps_its_decoder_after_cross_attention(tmp_path):
    """`EncoderDecoderModel` of two BERTs: the decoder's layers (`decoder.bert.encoder.layer`), the stream
    after self- and cross-attention (the cross-attention's output, `intermediate`'s input), the
    encoder's output once; an honest bf16 pair exits 0 and a cross-attention bug is named there."""
    sizes = {k: v for k, v in SMALL.items() if k != "is_decoder"}
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.EncoderDecoderModel(
            encoder=T.BertModel(T.BertConfig(**sizes, initializer_range=0.1), add_pooling_layer=False),
            decoder=T.BertLMHeadModel(T.BertConfig(**sizes, initializer_range=0.1, is_decoder=True,
                                                   add_cross_attention=True))).eval()
    model.config.decoder_start_token_id, model.config.pad_token_id = 1, 0
    generator = torch.Generator().manual_seed(2)
    source, target = torch.randint(3, VOCAB, (1, 11), generator=generator), torch.randint(3, VOCAB, (1, PROMPT + 2),
                                                                                       generator=generator)

    def run_on(engine):
        def run():
            for end in (PROMPT, PROMPT + 1, PROMPT + 2):
                engine(input_ids=source, decoder_input_ids=target[:, :end], use_cache=False)
        return run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = compiledump.instrument(model)
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    said = [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    assert len(said) == 1 and "the encoder's layers at encoder.encoder.layer" in said[0], said
    assert (taps["layer1"], taps["layer1_attn"], taps["encoder_output"], taps["input_token"]) == \
        ("decoder.bert.encoder.layer.1", "decoder.bert.encoder.layer.1.intermediate:input", "encoder",
         "decoder.bert.embeddings.word_embeddings:input")
    ref = dump_run(model, tmp_path / "ref", run_on(model))
    arrays, manifest = load_dump(ref)
    got = own_reading(model.decoder, run_on(model))
    for i in range(LAYERS):
        np.testing.assert_array_equal(arrays[f"layer{i}_attn"], got["attn"][i])  # the cross-attention's output
    assert manifest["prompt_tokens"] == PROMPT
    honest = copy.deepcopy(model).to(torch.bfloat16)
    report, last = compare_run(ref, honest, tmp_path / "honest", run_on(honest))
    assert report.exit_status == 0, last
    engine = copy.deepcopy(model)
    scale_output(engine.decoder.bert.encoder.layer[1].crossattention.self)
    report, last = compare_run(ref, engine, tmp_path / "bug", run_on(engine))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_attn", last


VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=16)
TEXT = {k: v for k, v in SMALL.items() if k != "is_decoder"}


@pytest.mark.parametrize("name, expected", [
    # ViT + BERT: before, the ViT encoder's layers were tapped as the decoder's
    ("vit_bert", {"layer1_attn": "decoder.bert.encoder.layer.1.intermediate:input", "encoder_output": "encoder",
                  "logits": "decoder.cls.predictions.decoder"}),
    # BLIP's BERT-style text decoder, its head named by the text decoder alone (before: the vision encoder's layers)
    ("blip", {"layer1_attn": "text_decoder.bert.encoder.layer.1.intermediate:input",
              "logits": "text_decoder.cls.predictions.decoder"}),
    # GIT: image tokens concatenated into its BERT-style stack (before: the vision encoder's layers)
    ("git", {"layer1_attn": "git.encoder.layer.1.intermediate:input", "input_embeds": "git.encoder.layer.0:input",
             "logits": "output"}),
    # InstructBLIP over OPT: its BERT-style Q-Former is no stack to compare instead of OPT's (a review
    # found it named in a warning as one)
    ("instructblip", {"layer1": "language_model.model.decoder.layers.1"}),
    # BLIP's question answering: its text decoder (generation runs it at every step), not the text
    # encoder first in module order (a review found the encoder tapped)
    ("blip_qa", {"layer1": "text_decoder.bert.encoder.layer.1", "logits": "text_decoder.cls.predictions.decoder"}),
])
def test_composite_models_tap_their_bert_style_text_decoder(name, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "vit_bert":
            model = T.VisionEncoderDecoderModel(
                encoder=T.ViTModel(T.ViTConfig(**VISION)),
                decoder=T.BertLMHeadModel(T.BertConfig(**TEXT, is_decoder=True, add_cross_attention=True)))
        elif name.startswith("blip"):
            blip = T.BlipForQuestionAnswering if name == "blip_qa" else T.BlipForConditionalGeneration
            model = blip(T.BlipConfig(text_config=dict(TEXT, encoder_hidden_size=32), vision_config=VISION))
        elif name == "git":
            model = T.GitForCausalLM(T.GitConfig(vision_config=dict(VISION, num_channels=3), **TEXT))
        else:
            opt = T.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
                              word_embed_proj_dim=64)
            model = T.InstructBlipForConditionalGeneration(T.InstructBlipConfig(
                vision_config=VISION, text_config=opt.to_dict(), num_query_tokens=4,
                qformer_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    encoder_hidden_size=32, vocab_size=VOCAB)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = compiledump.instrument(model.eval())
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    assert not [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    assert {tag: taps.get(tag) for tag in expected} == expected, taps
