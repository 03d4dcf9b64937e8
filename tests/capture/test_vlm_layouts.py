"""`instrument`'s defaults on vision-language models whose language model it did not find before
2026-12-06: Mllama (Llama 3.2 Vision), whose cross-attention layers have `cross_attn`, so its
decoder's `layers` were passed over and the vision encoder's were tapped without a word (a
language-model bug then read as `logits_0`); a model where only an encoder's layers are found
(BLIP, GIT: a BERT-style decoder), now warned; Kosmos-2's final norm (`layer_norm`). Each tag is
checked against this test's own reading of the model."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch
import transformers as T

import compiledump
from compiledump import config as cd_config
from helpers.hf_dump import compare_run, dump_run, load_dump

VOCAB, IMAGE, LAYERS, CROSS = 160, 150, 4, 1  # layer 1 attends to the image

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def mllama(seed: int = 0) -> T.MllamaForConditionalGeneration:
    config = T.MllamaConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, cross_attention_layers=[CROSS], pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=2, image_size=32, patch_size=8, vision_output_dim=64,
                           intermediate_layers_indices=[0], max_num_tiles=1, supported_aspect_ratios=[[1, 1]]),
        image_token_index=IMAGE)
    torch.manual_seed(seed)
    model = T.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():  # initialised to 0, which makes the cross-attention layer the identity
        cross = model.model.language_model.layers[CROSS]
        cross.cross_attn_attn_gate.fill_(0.7)
        cross.cross_attn_mlp_gate.fill_(-0.4)
    return model


def inputs(image: bool) -> dict:
    ids = torch.randint(3, VOCAB - 20, (1, 9), generator=torch.Generator().manual_seed(5))
    if not image:
        return {"input_ids": ids}
    ids[0, 0] = IMAGE
    pixels = torch.randn(1, 1, 1, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    return {"input_ids": ids, "pixel_values": pixels, "aspect_ratio_ids": torch.tensor([[1]]),
            "aspect_ratio_mask": torch.ones(1, 1, 1, dtype=torch.long),
            "cross_attention_mask": torch.ones(1, ids.shape[1], 1, 1, dtype=torch.long)}


def generate(model, image: bool):
    def run():
        model.generate(**inputs(image), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    return run


def prompt_rows(model) -> tuple[list[np.ndarray], np.ndarray]:
    """This test's reading of a prompt forward with the image: each layer's output and the
    cross-attention layer's stream after its gated attention (its input + tanh(gate) x attention),
    last prompt row."""
    layers = model.model.language_model.layers
    outputs, seen = [], {}

    def last(tensor):
        return (tensor[0] if isinstance(tensor, tuple) else tensor)[0, -1].float().numpy().copy()
    hooks = [layer.register_forward_hook(lambda _m, _a, out: outputs.append(last(out))) for layer in layers]
    hooks.append(layers[CROSS].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.update(input=last(kwargs.get("hidden_states", args[0] if args else None))),
        with_kwargs=True))
    hooks.append(layers[CROSS].cross_attn.register_forward_hook(lambda _m, _a, out: seen.update(attn=last(out))))
    with torch.no_grad():
        model(**inputs(image=True))
    for hook in hooks:
        hook.remove()
    gate = float(layers[CROSS].cross_attn_attn_gate.tanh())
    return outputs, seen["input"] + gate * seen["attn"]


def test_mllama_records_its_language_model_with_the_cross_attention_layer(tmp_path):
    model = mllama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = compiledump.instrument(model)
    handle.remove()
    assert handle.taps["layer0"] == "model.language_model.layers.0"
    assert handle.taps["final_norm"] == "model.language_model.norm"
    assert handle.taps["input_token"] == "model.language_model.embed_tokens:input"
    assert not [w for w in caught if "compiledump.instrument" in str(w.message)]
    arrays, manifest = load_dump(dump_run(model, tmp_path, generate(model, image=True)))
    outputs, after_cross_attn = prompt_rows(model)
    for i in range(LAYERS):
        np.testing.assert_array_equal(arrays[f"layer{i}"], outputs[i])
    np.testing.assert_allclose(arrays[f"layer{CROSS}_attn"], after_cross_attn, rtol=1e-5, atol=1e-6)
    assert manifest["mixers"] == {str(i): "attention" for i in range(LAYERS)}
    assert {f"logits_{n}" for n in range(3)} <= set(arrays)  # the prompt and two decode steps


@pytest.mark.parametrize("image", [True, False])
def test_an_mlp_bug_in_mllamas_language_model_is_named_at_its_layer(tmp_path, image):
    """With the image, in the cross-attention layer; without it (the cross-attention layer does not
    run, so it records nothing), in a self-attention layer after it. Before: `logits_0`."""
    layer = CROSS if image else 2
    reference = mllama(seed=1)
    ref = dump_run(reference, tmp_path / "ref", generate(reference, image))
    engine = copy.deepcopy(reference)
    with torch.no_grad():
        engine.model.language_model.layers[layer].mlp.down_proj.weight.mul_(1.01)
    report, last = compare_run(ref, engine, tmp_path / "run", generate(engine, image))
    assert report.exit_status == 1 and report.first_divergence.key == f"layer{layer}_mlp", last


def test_an_encoders_layers_taken_for_lack_of_a_decoders_are_warned():
    """A model whose text decoder `instrument` does not recognise (its layers under names of its own)
    beside a vision encoder's `layers`: the only list found has no token embedding beside it. (GIT
    was this case until its BERT-style decoder was recognised: test_bert_family.py.)"""
    model = torch.nn.Module()
    model.vision = torch.nn.Module()
    model.vision.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for layer in model.vision.layers:
        layer.self_attn = torch.nn.Linear(4, 4)
    model.text = torch.nn.Module()
    model.text.word_lookup = torch.nn.Embedding(8, 4)
    model.text.stack = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = compiledump.instrument(model)
    handle.remove()
    said = [str(w.message) for w in caught if "which have no token embedding" in str(w.message)]
    assert handle.taps["layer0"] == "vision.layers.0"
    assert len(said) == 1 and "vision.layers" in said[0], said
    assert "defaults=False" in said[0] and "taps=" in said[0]


def test_a_decoders_layers_beside_their_embedding_are_not_warned_about():
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(8, 4)
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiledump.instrument(model).remove()
    assert not [w for w in caught if "no token embedding" in str(w.message)]


def test_kosmos2s_final_norm_is_its_text_decoders_layer_norm():
    config = T.Kosmos2Config(text_config=dict(embed_dim=64, layers=2, attention_heads=4, ffn_dim=96,
                                              vocab_size=VOCAB),
                             vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=2, image_size=32, patch_size=8))
    model = T.Kosmos2ForConditionalGeneration(config).eval()
    handle = compiledump.instrument(model)
    handle.remove()
    assert handle.taps["layer0"] == "text_model.model.layers.0"
    assert handle.taps["final_norm"] == "text_model.model.layer_norm"


# --- input_embeds: where a tower's features enter --------------------------------------------------

PRE, IMAGE_ROWS, POST = [5, 6, 7], 16, [8, 9, 10]  # 16 patches of a 32x32 image (CLIP's class token dropped)


def llava(seed: int = 0) -> T.LlavaForConditionalGeneration:
    config = T.LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, initializer_range=0.1,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8),
        image_token_index=IMAGE, image_seq_length=IMAGE_ROWS)
    torch.manual_seed(seed)
    return T.LlavaForConditionalGeneration(config).eval()


def llava_session(model, feed: list | None = None):
    """The image prompt and STEPS cached decode steps, greedy or fed `feed`."""
    fed = []

    def run():
        ids = torch.tensor([PRE + [IMAGE] * IMAGE_ROWS + POST])
        pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(6)).to(model.dtype)
        out = model(input_ids=ids, pixel_values=pixels, use_cache=True)
        for n in range(3):
            token = feed[n] if feed is not None else out.logits[:, -1:].argmax(-1)
            fed.append(token)
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return run, fed


def test_input_embeds_holds_every_prompt_row_of_the_first_layers_input(tmp_path):
    """A vision-language model merges its tower's features into the first layer's input, rows the
    one-row tags never see (the prompt's last row is text): `input_embeds` keeps them all."""
    model = llava()
    seen = []
    hook = model.model.language_model.layers[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs.get("hidden_states", args[0] if args else None)[0].clone()),
        with_kwargs=True)
    run, _ = llava_session(model)
    arrays, manifest = load_dump(dump_run(model, tmp_path, run))
    hook.remove()
    np.testing.assert_array_equal(arrays["input_embeds"], seen[0].numpy())
    assert arrays["input_embeds"].shape == (len(PRE) + IMAGE_ROWS + len(POST), 64)
    assert manifest["keys"]["input_embeds"]["rows"] == "all"
    text_only = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=96))
    handle = compiledump.instrument(text_only)
    handle.remove()
    assert "input_embeds" not in handle.taps and "input_embeds" in compiledump.instrument(model).taps


def test_a_projector_bug_is_named_at_the_image_rows_of_input_embeds_and_an_honest_bf16_pair_is_clean(tmp_path):
    reference = llava(seed=1)
    run, fed = llava_session(reference)
    ref = dump_run(reference, tmp_path / "ref", run)
    for label, factor in (("honest", 1.0), ("bug", 1.01)):
        engine = copy.deepcopy(reference)
        with torch.no_grad():
            engine.model.multi_modal_projector.linear_2.weight.mul_(factor)
        engine = engine.to(torch.bfloat16) if label == "honest" else engine
        run, _ = llava_session(engine, feed=fed)
        report, last = compare_run(ref, engine, tmp_path / label, run)
        if label == "honest":
            assert report.exit_status == 0, last
        else:
            first = report.first_divergence
            assert report.exit_status == 1 and first.key == "input_embeds", last
            assert first.divergent_rows == list(range(len(PRE), len(PRE) + IMAGE_ROWS)), last
            assert last.startswith("first divergence: input_embeds (the first layer's input, token embeddings "
                                   "plus any tower features merged in): "), last


class _ToyVLM(torch.nn.Module):
    """A decoder whose config names a vision tower, fed embeddings of any length."""

    def __init__(self):
        super().__init__()
        self.config = T.PretrainedConfig()
        self.config.vision_config = {"model_type": "tower"}
        self.embed_tokens = torch.nn.Embedding(8, 64)
        self.layers = torch.nn.ModuleList([_Block()])
        self.lm_head = torch.nn.Linear(64, 8)

    def forward(self, input_ids):
        return self.lm_head(self.layers[0](self.embed_tokens(input_ids)))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.Linear(64, 64)

    def forward(self, hidden_states):
        return hidden_states + self.self_attn(hidden_states)


def test_input_embeds_over_an_eighth_of_the_arena_is_counted_as_arena_full(tmp_path):
    """600 rows x 64 x 4 bytes: 150 KiB, over an eighth of a 1 MiB arena: counted and warned at the
    flush (decided when the kernel runs, so no shape is tested while tracing); the other tags keep
    their room."""
    previous = compiledump.get_config()
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path), arena_mb=1)))
    try:
        model = _ToyVLM().eval()
        handle = compiledump.instrument(model)
        with torch.no_grad():
            model(torch.randint(0, 8, (1, 600), generator=torch.Generator().manual_seed(0)))
        handle.remove()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            arrays, manifest = load_dump(compiledump.flush())
        said = [str(w.message) for w in caught if "input_embeds" in str(w.message)]
        assert len(said) == 1 and "(arena_full)" in said[0] and "COMPILEDUMP_ARENA_MB" in said[0], said
        assert manifest["tags"]["input_embeds"]["drops"] == {"arena_full": 1}
        assert "input_embeds" not in arrays and {"layer0", "logits_0"} <= set(arrays)
    finally:
        compiledump.reset()
        compiledump.configure(**dataclasses.asdict(previous))


@pytest.mark.parametrize("model_type, tower", [
    ("llava", True), ("qwen2_audio", True), ("gemma3", True),
    ("granite_speech", True),  # its audio tower is its `encoder_config`, beside a `text_config`
    ("qwen2_5_omni", True),  # the towers sit in its thinker's config
    ("llama", False), ("qwen3_moe", False), ("blt", False), ("hrm_text", False)])  # text stacks, no tower
def test_which_configs_name_a_tower_whose_features_enter_the_embeddings(model_type, tower):
    from compiledump.capture import hf_configs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        holder = torch.nn.Module()
        holder.config = T.AutoConfig.for_model(model_type)
    assert hf_configs.has_tower(holder) is tower
