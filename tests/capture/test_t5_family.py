"""T5's family (T5, mT5, UMT5, LongT5, Pop2Piano, and Switch Transformers, an MoE) under
`instrument()`'s defaults. Before 2026-12-06 (twenty-seventh session) it raised "no decoder layers
found": a T5 stack keeps its layers in `block`, and each block its parts in a list of sublayers
(`layer.0.SelfAttention`, `layer.1.EncDecAttention`, `layer.2.DenseReluDense`, Switch's
`layer.2.mlp` with its `router`), each of which adds its own residual. Now the decoder's blocks are
tapped: `layer<i>_attn` is the feed-forward sublayer's input (the stream after self- and
cross-attention), `layer<i>_mlp` its MLP's output, and Switch's router gives the experts its tokens
are routed to (where an expert's capacity dropped one, the expert it was routed to), its router
declared `capacity`, so that a flip reaches the later tokens of its own layer. Each tag is checked against this
test's own hooks on the model."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import transformers as T

import compiledump
from helpers.hf_dump import compare_run, dump_run, load_dump, scale_output

VOCAB, SOURCE, PROMPT, STEPS, LAYERS = 160, 12, 4, 3, 4
FAMILY = {"t5": (T.T5Config, T.T5ForConditionalGeneration), "mt5": (T.MT5Config, T.MT5ForConditionalGeneration),
          "umt5": (T.UMT5Config, T.UMT5ForConditionalGeneration),
          "longt5": (T.LongT5Config, T.LongT5ForConditionalGeneration),
          "pop2piano": (T.Pop2PianoConfig, T.Pop2PianoForConditionalGeneration),
          "switch": (T.SwitchTransformersConfig, T.SwitchTransformersForConditionalGeneration)}
# Switch Transformers: 8 experts in decoder layers 1 and 3 (every second layer), each encoder layer
SWITCH = dict(num_experts=8, num_sparse_decoder_layers=2, num_sparse_encoder_layers=3)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def build(name: str, seed: int = 0, factor: float = 1.0, dtype=torch.float32, **extra):
    """`factor`: transformers' `initializer_factor` (its router's weights have std `factor`: router
    logits of std about 8 at 1.0, sharper than the other MoE audits' 0.1)."""
    config_class, model_class = FAMILY[name]
    config = config_class(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=LAYERS,
                          num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0,
                          initializer_factor=factor, **{**(SWITCH if name == "switch" else {}), **extra})
    torch.manual_seed(seed)
    return model_class(config).eval().to(dtype)


def session(model, seed: int = 0, prompt_tokens: int = PROMPT):
    """The source through the encoder once, a decoder prompt and STEPS cached decode steps, teacher-forced."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(3, VOCAB, (1, SOURCE), generator=generator)
    prompt = torch.randint(3, VOCAB, (1, prompt_tokens), generator=generator)
    steps = torch.randint(3, VOCAB, (STEPS,), generator=generator)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (transformers' cache renaming note)
            encoded = model.get_encoder()(input_ids=source)  # (Switch's forward needs its own output class)
            out = model(encoder_outputs=encoded, decoder_input_ids=prompt, use_cache=True)
            for token in steps:
                out = model(encoder_outputs=encoded, decoder_input_ids=token.view(1, 1), cache=out.cache,
                            use_cache=True)
    return run


def own_reading(model, run) -> dict:
    """What `run`'s first call of each module gives, read by this test's own hooks: the encoder's
    first source row; per decoder block its feed-forward sublayer's input and its MLP's output (last
    prompt row), its output; Switch's experts ([rows, 1]: the one each token is dispatched to, or where
    capacity dropped it the argmax of the router's probabilities in its input's dtype), which rows it
    dropped, and its router logits (every prompt row); the head's output."""
    got = {"attn": {}, "mlp": {}, "layer": {}, "ids": {}, "dropped": {}, "router": {}}

    def keep(kind, key, value) -> None:  # (a hook that returns a value replaces the module's output)
        (got if key is None else got[kind]).setdefault(kind if key is None else key, value.float().numpy().copy())
    hooks = [model.get_encoder().register_forward_hook(lambda _m, _a, out: keep("encoder", None, out[0][0, 0])),
             model.lm_head.register_forward_hook(lambda _m, _a, out: keep("logits", None, out[0, -1]))]
    for i, block in enumerate(model.decoder.block):
        feed_forward = block.layer[-1]
        mlp = getattr(feed_forward, "mlp", None) or feed_forward.DenseReluDense
        hooks += [feed_forward.register_forward_pre_hook(lambda _m, args, i=i: keep("attn", i, args[0][0, -1])),
                  mlp.register_forward_hook(lambda _m, _a, out, i=i: keep("mlp", i, out[0, -1])),
                  block.register_forward_hook(  # (a tuple, UMT5's a tensor)
                      lambda _m, _a, out, i=i: keep("layer", i, (out[0] if isinstance(out, tuple) else out)[0, -1]))]
        if hasattr(mlp, "router"):
            def routed(router, args, out, i=i):
                mask, _, logits = out
                choice = torch.softmax(logits.float(), -1).to(args[0].dtype).argmax(-1)
                keep("ids", i, torch.where(mask.any(-1), mask.argmax(-1), choice)[0, :, None])
                keep("dropped", i, ~mask.any(-1)[0])
                keep("router", i, logits[0])
            hooks.append(mlp.router.register_forward_hook(routed))
    with torch.no_grad():
        run()
    for hook in hooks:
        hook.remove()
    return got


@pytest.mark.parametrize("name", list(FAMILY))
def test_the_decoder_s_blocks_are_tapped_through_their_sublayers(tmp_path, name):
    model = build(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays, manifest = load_dump(dump_run(model, tmp_path, session(model)))
    said = [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    assert len(said) == 1 and "encoder's layers at encoder.block" in said[0], said  # (nothing else warned)
    handle = compiledump.instrument(model)
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    mlp = "mlp" if name == "switch" else "DenseReluDense"
    assert (taps["layer1"], taps["layer1_attn"], taps["layer1_mlp"]) == \
        ("decoder.block.1", "decoder.block.1.layer.2:input", f"decoder.block.1.layer.2.{mlp}")
    assert (taps["encoder_output"], taps["final_norm"], taps["input_token"], taps["logits"]) == \
        ("encoder", "decoder.final_layer_norm", "decoder.embed_tokens:input", "lm_head")
    assert manifest["prompt_tokens"] == PROMPT and set(manifest["mixers"].values()) == {"attention"}
    got = own_reading(model, session(model))
    np.testing.assert_array_equal(arrays["encoder_output"], got["encoder"])
    np.testing.assert_array_equal(arrays["logits_0"], got["logits"])
    for i in range(LAYERS):
        np.testing.assert_array_equal(arrays[f"layer{i}"], got["layer"][i])
        np.testing.assert_array_equal(arrays[f"layer{i}_attn"], got["attn"][i])
        if f"layer{i}_mlp" in arrays:  # (Switch: COMPILEDUMP_MOE_LAYERS keeps layer 1's, not layer 3's)
            np.testing.assert_array_equal(arrays[f"layer{i}_mlp"], got["mlp"][i])
            # The feed-forward sublayer adds its MLP's output to the stream after attention
            np.testing.assert_allclose(arrays[f"layer{i}_attn"] + arrays[f"layer{i}_mlp"], arrays[f"layer{i}"],
                                       rtol=1e-6, atol=1e-6 * float(np.abs(arrays[f"layer{i}"]).max()))
        assert {f"layer{i}_step_{n}" for n in range(STEPS + 1)} <= set(arrays)
    if name == "switch":
        assert "layer0_router" not in arrays and "layer3_mlp" not in arrays  # dense; past COMPILEDUMP_MOE_LAYERS
        np.testing.assert_array_equal(arrays["layer1_topk"], got["ids"][1])
        np.testing.assert_array_equal(arrays["layer1_router"], got["router"][1])
        assert {f"layer1_step_topk_{n}" for n in range(STEPS + 1)} <= set(arrays)
        router = manifest["routers"]["layer1_router"]
        assert (router["score"], router["top_k"], router.get("rounded")) == ("softmax", 1, True), router


@pytest.mark.parametrize("name, factor", [("t5", 1.0), ("umt5", 1.0), ("switch", 0.3)])
def test_an_honest_pair_exits_0_and_bugs_are_named_where_they_start(tmp_path, name, factor):
    """A float32 reference and its bfloat16 copy exit 0; a x1.01 scale of decoder layer 1's MLP, of its
    cross-attention, or of encoder layer 1 is named at `layer1_mlp`, `layer1_attn`, `encoder_output`."""
    reference = build(name, seed=1, factor=factor)
    ref = dump_run(reference, tmp_path / "ref", session(reference, seed=1))
    honest = copy.deepcopy(reference).to(torch.bfloat16)
    report, last = compare_run(ref, honest, tmp_path / "honest", session(honest, seed=1))
    assert report.exit_status == 0, last
    for where, key in (("decoder MLP", "layer1_mlp"), ("cross-attention", "layer1_attn"),
                       ("encoder", "encoder_output")):
        engine = copy.deepcopy(reference)
        module = {"decoder MLP": engine.decoder.block[1].layer[2], "cross-attention": engine.decoder.block[1].layer[1],
                  "encoder": engine.encoder.block[1]}[where]
        module = getattr(module, "mlp", None) or getattr(module, "DenseReluDense", None) \
            or getattr(module, "EncDecAttention", None) or module
        scale_output(module)
        report, last = compare_run(ref, engine, tmp_path / where.replace(" ", "_"), session(engine, seed=1))
        assert report.exit_status == 1 and report.first_divergence.key == key, (where, last)


@pytest.mark.parametrize("name", ["umt5", "pop2piano"])
def test_a_decode_only_mlp_bug_that_adds_little_to_the_stream_is_named_at_its_mlp(tmp_path, name):
    """At `initializer_factor` 0.3 a gated-GELU decoder block's MLP adds under 1e-3 of the stream: a
    x1.01 bug of decoder block 2's MLP in decode steps only moved the block's state at the step by
    under the float32 threshold, and was missed or named late (before the twenty-eighth session,
    `--factors 0.3` of sweep_seq2seq.py: 0 of 3 for both); the MLP's own output at each step
    (`layer2_mlp_step_<n>`) names it where it starts."""
    reference = build(name, seed=0, factor=0.3)
    ref = dump_run(reference, tmp_path / "ref", session(reference))
    engine = copy.deepcopy(reference)
    scale_output(engine.decoder.block[2].layer[2].DenseReluDense, unless=lambda args: args[0].shape[1] != 1)
    report, last = compare_run(ref, engine, tmp_path / "run", session(engine))
    first = report.first_divergence
    assert report.exit_status == 1 and (first.key, first.layer, first.step) == ("layer2_mlp_step_1", 2, 1), last
    # What it read was right: the stream after the block's attention at that step
    assert next(record for record in report.pairs[0].keys if record.key == "layer2_attn_step_1").status == "ok"


def test_switch_s_dropped_tokens_are_read_from_the_flips_that_drop_them(tmp_path):
    """A token its expert's capacity drops (its dispatch row all zeros) is recorded with the expert it was
    routed to, so that its router logits judge it. An honest pair whose drops are equal exits 0; an
    engine whose experts take more tokens (dropless, as inference engines are) is named at the MoE
    output, in bf16 too (before: -1 ids, "not judged", exit 3); a router whose weights favour another
    expert is named at its logits."""
    reference = build("switch", seed=2, factor=0.3, expert_capacity=1)
    run = session(reference, seed=2, prompt_tokens=8)
    ref = dump_run(reference, tmp_path / "ref", run)
    arrays, _ = load_dump(ref)
    got = own_reading(reference, run)
    assert got["dropped"][1].any() and not got["dropped"][1].all()  # what this test is about
    np.testing.assert_array_equal(arrays["layer1_topk"], got["ids"][1])
    for dtype, more_room in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)):
        engine = copy.deepcopy(reference).to(dtype)
        if more_room:
            for block in engine.decoder.block:
                if hasattr(block.layer[2].mlp, "router"):
                    block.layer[2].mlp.router.expert_capacity = 64
        report, last = compare_run(ref, engine, tmp_path / f"{dtype}{more_room}",
                                   session(engine, seed=2, prompt_tokens=8))
        if more_room:
            assert report.exit_status == 1 and report.first_divergence.key == "layer1_mlp", (dtype, last)
        else:
            assert report.exit_status == 0, last
    engine = copy.deepcopy(reference)
    with torch.no_grad():
        engine.decoder.block[1].layer[2].mlp.router.classifier.weight[5] += 1.0
    report, last = compare_run(ref, engine, tmp_path / "flip", session(engine, seed=2, prompt_tokens=8))
    assert report.exit_status == 1 and report.first_divergence.key == "layer1_router", last


def test_a_flip_that_drops_a_later_token_of_its_sequence_is_no_divergence(tmp_path):
    """The review's case (4 experts taking 3 tokens each, router logits of std about 8): in the bf16
    copy a near tie sends prompt token 3 to expert 2 instead of 3, which fills expert 2, so token 6 is
    dropped there and kept in the reference. The flip reaches the later tokens of its own layer (the
    router declared `capacity`): exit 0 (before: token 6 "not judged", exit 3)."""
    reference = build("switch", seed=8, factor=1.0, num_experts=4, expert_capacity=3)
    honest = copy.deepcopy(reference).to(torch.bfloat16)
    ref_run, run = session(reference, seed=8, prompt_tokens=12), session(honest, seed=8, prompt_tokens=12)
    ref_got, run_got = own_reading(reference, ref_run), own_reading(honest, run)
    flipped = np.flatnonzero(ref_got["ids"][1][:, 0] != run_got["ids"][1][:, 0])
    dropped = np.flatnonzero(ref_got["dropped"][1] != run_got["dropped"][1])
    assert len(flipped) and len(dropped) and flipped.min() < dropped.min()  # what this test is about
    report, last = compare_run(dump_run(reference, tmp_path / "ref", ref_run), honest, tmp_path / "run", run)
    assert report.exit_status == 0, last
    (topk,) = [record for record in report.pairs[0].keys if record.key == "layer1_topk"]
    assert topk.status == "near_tie", topk


def test_t5_decoders_inside_other_models_are_found():
    """BLIP-2 over Flan-T5 (before: its vision encoder's layers were tapped) and Pix2Struct, whose text
    blocks keep T5's sublayers as `self_attention`, `encoder_decoder_attention`, `mlp` (before: "no
    decoder layers found"): `layer<i>_attn` the feed-forward sublayer's input, `layer<i>_mlp` its
    DenseReluDense's output."""
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=16)
    text = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blip2 = T.Blip2ForConditionalGeneration(T.Blip2Config(
            vision_config=vision, text_config=T.T5Config(**text).to_dict(), num_query_tokens=4,
            qformer_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                encoder_hidden_size=32, vocab_size=VOCAB)))
        pix2struct = T.Pix2StructForConditionalGeneration(T.Pix2StructConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4),
            vision_config=dict(hidden_size=32, d_kv=16, d_ff=64, num_hidden_layers=2, num_attention_heads=2,
                               patch_embed_hidden_size=32)))
    found = []
    for model in (blip2, pix2struct):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = compiledump.instrument(model.eval())
        found.append(dict(handle.taps))
        handle.remove()
        compiledump.reset()
    assert (found[0]["layer1"], found[0]["layer1_attn"], found[0]["encoder_output"]) == \
        ("language_model.decoder.block.1", "language_model.decoder.block.1.layer.2:input", "language_model.encoder")
    assert (found[1]["layer1_attn"], found[1]["layer1_mlp"], found[1]["encoder_output"], found[1]["logits"]) == \
        ("decoder.layer.1.mlp:input", "decoder.layer.1.mlp.DenseReluDense", "encoder", "decoder.lm_head")


class _Tied(torch.nn.Module):
    """A router's classifier with prompt row 1's two best logits `delta` apart (a forced near tie);
    with `far`, each decode step's token routed to its lowest-scored expert (a real router bug)."""

    def __init__(self, inner, delta: float, far: bool = False):
        super().__init__()
        self.inner, self.delta, self.far = inner, delta, far

    def forward(self, x):
        out = self.inner(x)
        if out.shape[1] > 1:
            top = out[0, 1].topk(2)
            out = out.clone()
            out[0, 1, top.indices[1]] = top.values[0] + self.delta
        elif self.far:
            out = out.clone()
            out[0, 0, out[0, 0].argmin()] = out[0, 0].max() + 5.0
        return out


@pytest.mark.parametrize("bug, key, cause", [(None, None, None), ("experts x1.05", "layer1_mlp", "layer1_topk"),
                                             ("decode steps routed far from a tie", "layer1_mlp_step_1",
                                              "layer1_step_topk_1")])
def test_a_capacity_flip_excuses_only_the_tokens_whose_queue_it_moved(tmp_path, bug, key, cause):
    """The second review's cases: a forced near tie at prompt token 1 of decoder layer 1 (its router
    declared `capacity`) excused the whole layer, so a x1.05 bug of its experts at the last token
    (routed to another expert) exited 0, and so did decode steps each routed far from any tie (a
    decode step routes its own token alone). Now the flip reaches only later tokens routed to an
    expert it left or took: the honest pair exits 0, each bug is named. A decode step's MoE output
    moved by its own far flip names that flip as the cause, not the prompt's earlier near tie."""
    reference = build("switch", seed=0, factor=0.3, num_experts=4, expert_capacity=4)
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    for model, delta in ((reference, -0.01), (engine, 0.01)):
        router = model.decoder.block[1].layer[2].mlp.router
        router.classifier = _Tied(router.classifier, delta, far=model is engine and bug is not None
                                  and bug.startswith("decode"))
    if bug == "experts x1.05":
        with torch.no_grad():
            for expert in engine.decoder.block[1].layer[2].mlp.experts.values():
                expert.wo.weight *= 1.05
    ref = dump_run(reference, tmp_path / "ref", session(reference, seed=1, prompt_tokens=6))
    report, last = compare_run(ref, engine, tmp_path / "run", session(engine, seed=1, prompt_tokens=6))
    (topk,) = [record for record in report.pairs[0].keys if record.key == "layer1_topk"]
    assert topk.status == "near_tie", topk  # what this test is about
    if key is None:
        assert report.exit_status == 0, last
    else:
        assert report.exit_status == 1 and report.first_divergence.key == key, last
        assert report.pairs[0].root_cause.key == cause, last
