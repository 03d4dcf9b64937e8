"""`instrument`'s defaults on the GPT-2 family's layouts (`transformer.h.<i>` with `attn`, `ln_2`,
`mlp`, `ln_f`, `wte`; MPT's `blocks`, GPT-NeoX's `attention`, Falcon's and Bloom's
`self_attention`, OPT's fc2), on which `instrument` raised "no decoder layers found" before
2026-12-06, and where the only way left, `defaults=False` with `taps`, records no decode step (and
Apertus, whose norm before the MLP, `feedforward_layernorm`, gave it no `layer<i>_attn`). Each tag is
checked against this test's own reading of the model: the residual identity (a sequential layer's
output is the stream after attention plus its MLP's output) or the module's own output."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import transformers as T

import compiledump
from helpers.hf_dump import compare_run, dump_run, load_dump

VOCAB, LAYERS = 160, 4
CONFIGS = {
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, initializer_range=0.1, vocab_size=VOCAB),
    "gpt_neo": lambda: T.GPTNeoConfig(hidden_size=64, num_layers=LAYERS, num_heads=4, vocab_size=VOCAB,
                                      attention_types=[[["global", "local"], LAYERS // 2]], initializer_range=0.1),
    "gpt_bigcode": lambda: T.GPTBigCodeConfig(n_embd=64, n_layer=LAYERS, n_head=4, initializer_range=0.1,
                                              vocab_size=VOCAB),
    "gpt_neox_sequential": lambda: T.GPTNeoXConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                                   intermediate_size=96, use_parallel_residual=False,
                                                   initializer_range=0.1, vocab_size=VOCAB),
    "falcon_sequential": lambda: T.FalconConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                                parallel_attn=False, initializer_range=0.1, vocab_size=VOCAB),
    "opt": lambda: T.OPTConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, ffn_dim=96,
                               word_embed_proj_dim=64, init_std=0.1, vocab_size=VOCAB),
    # Not of the family, but of its kind: the norm before the MLP under another name
    "apertus": lambda: T.ApertusConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                                       vocab_size=VOCAB),
    # Their MLP adds the residual itself: `layer<i>_mlp` is its last projection's output
    "bloom": lambda: T.BloomConfig(hidden_size=64, n_layer=LAYERS, n_head=4, initializer_range=0.1, vocab_size=VOCAB),
    "mpt": lambda: T.MptConfig(d_model=64, n_layers=LAYERS, n_heads=4, vocab_size=VOCAB),
    # Attention and MLP read the same input: no stream after attention to record (warned)
    "gptj": lambda: T.GPTJConfig(n_embd=64, n_layer=LAYERS, n_head=4, rotary_dim=8, initializer_range=0.1,
                                 vocab_size=VOCAB),
    "codegen": lambda: T.CodeGenConfig(n_embd=64, n_layer=LAYERS, n_head=4, rotary_dim=8, initializer_range=0.1,
                                       vocab_size=VOCAB),
    "falcon_parallel": lambda: T.FalconConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                              new_decoder_architecture=True, num_kv_heads=2, initializer_range=0.1,
                                              vocab_size=VOCAB),
    "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                        intermediate_size=96, initializer_range=0.1, vocab_size=VOCAB),
}
SEQUENTIAL = ("gpt2", "gpt_neo", "gpt_bigcode", "gpt_neox_sequential", "falcon_sequential", "opt", "bloom", "mpt",
              "apertus")
PARALLEL = ("gptj", "codegen", "falcon_parallel", "gpt_neox")
STEPS = 3

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' past_key_values rename


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's default bos/eos ids lie outside the tiny vocabulary
        return T.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(11))


def session(model, feed: list[int] | None = None, after_prefill=None):
    """A prompt forward and STEPS cached decode steps: greedy, or fed `feed` (teacher forcing);
    `after_prefill()` runs between the prompt and the first step. Returns the tokens fed."""
    fed = []

    def run():
        out = model(input_ids=prompt(), use_cache=True)
        if after_prefill is not None:
            after_prefill()
        for n in range(STEPS):
            token = feed[n] if feed is not None else int(out.logits[0, -1].argmax())
            fed.append(token)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return run, fed


def layer_outputs(model) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The last prompt row of each layer's output and of its MLP's own output (without the residual
    Bloom's and MPT's MLP adds), read by hooks of this test (copies: Falcon adds attention's output
    into its MLP's in place)."""
    layers = next(m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
    outputs, mlps, handles = [], [], []

    def last(out):
        return (out[0] if isinstance(out, tuple) else out).reshape(-1, 64)[-1].float().numpy().copy()
    for layer in layers:
        mlp = getattr(layer, "mlp", None) or getattr(layer, "ffn", None) or layer.fc2
        mlp = {"BloomMLP": getattr(mlp, "dense_4h_to_h", None), "MptMLP": getattr(mlp, "down_proj", None)}.get(
            type(mlp).__name__, mlp)
        handles.append(layer.register_forward_hook(lambda _m, _a, out: outputs.append(last(out))))
        handles.append(mlp.register_forward_hook(lambda _m, _a, out: mlps.append(last(out))))
    with torch.no_grad():
        model(input_ids=prompt(), use_cache=False)
    for handle in handles:
        handle.remove()
    return outputs, mlps


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_defaults_record_every_layer_and_each_decode_step(tmp_path, name):
    model = build(name)
    run, _ = session(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays, manifest = load_dump(dump_run(model, tmp_path, run))
    said = " ".join(str(w.message) for w in caught if "compiledump.instrument" in str(w.message))
    outputs, mlps = layer_outputs(model)
    for i in range(LAYERS):
        np.testing.assert_array_equal(arrays[f"layer{i}"], outputs[i])
        np.testing.assert_array_equal(arrays[f"layer{i}_mlp"], mlps[i])
        if name in SEQUENTIAL:
            np.testing.assert_allclose(arrays[f"layer{i}_attn"] + arrays[f"layer{i}_mlp"], outputs[i],
                                       rtol=1e-5, atol=1e-5 * float(np.abs(outputs[i]).max()))
    if name in PARALLEL:
        assert not any(key.endswith("_attn") for key in arrays)
        assert "no layer<i>_attn tags" in said
    else:
        assert "no layer<i>_attn tags" not in said
    steps = {key for key in arrays if key.startswith(("logits_", "input_token_", "layer2_step_"))}
    assert steps == {f"{tag}_{n}" for tag in ("logits", "input_token", "layer2_step") for n in range(STEPS + 1)}
    assert "final_norm" in arrays and manifest["mixers"] == {str(i): "attention" for i in range(LAYERS)}


def mlp_out_weight(model, layer: int) -> torch.nn.Parameter:
    block = next(m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))[layer]
    mlp = getattr(block, "mlp", None) or getattr(block, "ffn", None)
    names = ("c_proj", "dense_4h_to_h", "fc_out", "down_proj")  # GPT-2, Bloom and GPT-NeoX, GPT-J, MPT
    return next(m for n, m in mlp.named_modules() if n in names).weight if mlp is not None else block.fc2.weight


@pytest.mark.parametrize("name", ["gpt2", "falcon_sequential", "gptj", "mpt"])
def test_a_decode_only_bug_is_named_at_its_layer_and_step(tmp_path, name):
    """x1.01 on layer 2's MLP after the prompt: only decode steps see it, named at the MLP's own
    output at the step (before the twenty-eighth session, at the layer's state `layer2_step_1`)."""
    reference = build(name)
    run, fed = session(reference)
    ref = dump_run(reference, tmp_path / "ref", run)
    engine = copy.deepcopy(reference)

    def bug():
        with torch.no_grad():
            mlp_out_weight(engine, 2).mul_(1.01)
    run, _ = session(engine, feed=fed, after_prefill=bug)
    report, last = compare_run(ref, engine, tmp_path / "run", run)
    first = report.first_divergence
    # (GPT-J's attention and MLP read the same input, in parallel: no stream after attention)
    good = "layer2_mixer_step_1" if name == "gptj" else "layer2_attn_step_1"
    assert report.exit_status == 1 and (first.key, first.step, first.last_good) == ("layer2_mlp_step_1", 1, good), last


@pytest.mark.parametrize("name", ["gpt2", "bloom", "gpt_neox"])
def test_an_honest_bf16_engine_is_clean_and_an_mlp_bug_named(tmp_path, name):
    reference = build(name, seed=2)
    run, fed = session(reference)
    ref = dump_run(reference, tmp_path / "ref", run)
    for label, factor in (("honest", 1.0), ("bug", 1.10)):
        engine = copy.deepcopy(reference)
        with torch.no_grad():
            mlp_out_weight(engine, 3).mul_(factor)
        engine = engine.to(torch.bfloat16)
        run, _ = session(engine, feed=fed)
        report, last = compare_run(ref, engine, tmp_path / label, run)
        if label == "honest":
            assert report.exit_status == 0, last
        else:
            assert report.exit_status == 1 and report.first_divergence.key == "layer3_mlp", last


def test_a_stack_instrument_cannot_find_names_its_list_names_and_the_taps_to_pass():
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(ValueError, match=r"named 'layers' or 'h' or 'blocks'.*taps=\{'layer\{i\}'"):
        compiledump.instrument(model)


def test_gpt1s_post_norm_block_records_the_stream_after_attention(tmp_path):
    """GPT-1 names its norms as GPT-2 does, in another place: ln_1 normalises x + attn(x), ln_2 the
    sum after the MLP. `layer<i>_attn` is x + attn(x), read here from the layer's input and its
    attention's output."""
    torch.manual_seed(0)
    model = T.OpenAIGPTLMHeadModel(T.OpenAIGPTConfig(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=32,
                                                     vocab_size=VOCAB)).eval()

    def run():  # no KV cache in GPT-1: each step runs the whole sequence
        ids = prompt()
        for _ in range(STEPS + 1):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    arrays, _ = load_dump(dump_run(model, tmp_path, run))
    seen, handles = {}, []
    for i, block in enumerate(model.transformer.h):
        handles.append(block.register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(("x", i), args[0])))
        handles.append(block.attn.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(("a", i), out[0])))
    with torch.no_grad():
        model(input_ids=prompt(), use_cache=False)
    for handle in handles:
        handle.remove()
    for i in range(LAYERS):
        expected = (seen["x", i] + seen["a", i])[0, -1].numpy()
        np.testing.assert_allclose(arrays[f"layer{i}_attn"], expected, rtol=1e-6, atol=1e-6)
    assert {"input_token_0", "logits_0", "layer2_step_1"} <= arrays.keys()
