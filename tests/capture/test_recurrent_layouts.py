"""`instrument`'s defaults on state-space and recurrent causal LMs and on heads under other names,
which before 2026-12-06 lost tags without a word: RWKV had no `logits`, `final_norm` or
`input_token` (a 5 % bug in its head or final norm read "no divergence"), BioGPT no `logits`,
Mamba's family no `input_token` (a step fed another token read as a divergence); Falcon-H1's
layers, which sum a Mamba mixer and attention, were declared attention (no hybrid caution);
RecurrentGemma, xLSTM and Zamba raised "no decoder layers found". Each tag is checked against this test's
own reading of the model (forward hooks, the residual identity)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import transformers as T

import compiledump
from compiledump.compare import compare, format_report
from helpers.hf_dump import compare_run, dump_run, load_dump

VOCAB, STEPS = 160, 3
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=96, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
CONFIGS = {
    "rwkv": dict(attention_hidden_size=64, context_length=64),
    "mamba": dict(state_size=8, expand=2, conv_kernel=4),
    "falcon_h1": dict(num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                      mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, mamba_d_conv=4, mamba_expand=2),
    "recurrent_gemma": dict(lru_width=64, attention_window_size=16, conv1d_width=4, head_dim=16, num_key_value_heads=1,
                            block_types=["recurrent", "recurrent", "attention"]),
    "xlstm": dict(embedding_dim=64, num_heads=4, num_blocks=4, qk_dim_factor=1.0, v_dim_factor=1.0, chunk_size=16,
                  mode="inference"),
    "biogpt": dict(),
    "modernbert-decoder": dict(num_key_value_heads=None, global_attn_every_n_layers=1),
    "zamba2": dict(mamba_d_state=8, mamba_headdim=16, mamba_ngroups=1, n_mamba_heads=8, chunk_size=16,
                   num_mem_blocks=1, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                   use_shared_attention_adapter=False, attention_head_dim=32),
}
# Where each keeps what the defaults look for: (head, final norm, token embedding, layers)
PLACES = {
    "rwkv": ("head", "rwkv.ln_out", "rwkv.embeddings", "rwkv.blocks"),
    "mamba": ("lm_head", "backbone.norm_f", "backbone.embeddings", "backbone.layers"),
    "falcon_h1": ("lm_head", "model.final_layernorm", "model.embed_tokens", "model.layers"),
    "recurrent_gemma": ("lm_head", "model.final_norm", "model.embed_tokens", "model.layers"),
    "xlstm": ("lm_head", "backbone.out_norm", "backbone.embeddings", "backbone.blocks"),
    "biogpt": ("output_projection", "biogpt.layer_norm", "biogpt.embed_tokens", "biogpt.layers"),
    "zamba2": ("lm_head", "model.final_layernorm", "model.embed_tokens", "model.layers"),
    # its lm_head is a prediction head (dense, activation, norm) before the `decoder` that gives the logits
    "modernbert-decoder": ("decoder", "model.final_norm", "model.embeddings.tok_embeddings", "model.layers"),
}
# Sequential layers whose stream after the mixer is a norm's input: layer<i> = layer<i>_attn + layer<i>_mlp
SEQUENTIAL = ("rwkv", "falcon_h1", "recurrent_gemma", "xlstm", "modernbert-decoder")
# The layers whose softmax attention sits beside an MLP, and its child (its own output is
# `layer<i>_mixer`); not RWKV's time mixing, xLSTM's or Falcon-H1's (attention summed with Mamba)
ATTENTION_BESIDE_MLP = {"recurrent_gemma": {2: "temporal_block"}, "biogpt": dict.fromkeys(range(4), "self_attn"),
                        "modernbert-decoder": dict.fromkeys(range(4), "attn")}

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def build(name: str, seed: int = 0):
    config = T.AutoConfig.for_model(name, **{**COMMON, **CONFIGS[name]})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference kernels' fallback notes
        return T.AutoModelForCausalLM.from_config(config).eval()


def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))


def forward(name, model, ids, cache):
    if name == "rwkv":
        out = model(input_ids=ids, state=cache, use_cache=True)
        return out.logits, out.state
    out = model(input_ids=ids, cache=cache, use_cache=True)  # (RecurrentGemma keeps its state itself)
    return out.logits, getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def session(name, model, feed: list | None = None):
    """The prompt and STEPS cached decode steps, greedy or fed `feed`; returns (run, tokens fed)."""
    fed = []

    def run():
        logits, cache = forward(name, model, prompt(), None)
        for n in range(STEPS):
            token = feed[n] if feed is not None else logits[:, -1:].argmax(-1)
            fed.append(token)
            logits, cache = forward(name, model, token, cache)
    return run, fed


def own_reading(model, name):
    """The last prompt row of each layer's output, of its MLP's output, of the head's input and
    output, read by this test's hooks."""
    head, _, _, layers_path = PLACES[name]
    layers = model.get_submodule(layers_path)
    got = {"layer": [], "mlp": [], "mixer": {}}

    def last(out):
        return (out[0] if isinstance(out, tuple) else out)[0, -1].float().numpy().copy()
    hooks = [layer.register_forward_hook(lambda _m, _a, out: got["layer"].append(last(out))) for layer in layers]
    def keep_first(i, out) -> None:  # (a hook that returns a value replaces the module's output)
        got["mixer"].setdefault(i, last(out))
    for i, layer in enumerate(layers):  # a layer of one mixer: the mixer's own output (Zamba's hybrid: its Mamba's)
        mixer = getattr(getattr(layer, "mamba_decoder", None), "mamba", None) or getattr(layer, "mamba", None) \
            or getattr(layer, "mixer", None)
        if mixer is not None and not any(hasattr(layer, n) for n in ("mlp", "feed_forward")):
            hooks.append(mixer.register_forward_hook(lambda _m, _a, out, i=i: keep_first(i, out)))
        elif (attention := ATTENTION_BESIDE_MLP.get(name, {}).get(i)) is not None:  # softmax attention's own output
            hooks.append(layer.get_submodule(attention).register_forward_hook(
                lambda _m, _a, out, i=i: keep_first(i, out)))
    for layer in layers:
        mlp = next((getattr(layer, n) for n in ("mlp", "feed_forward", "mlp_block", "ffn", "fc2") if hasattr(layer, n)),
                   None)
        if mlp is not None:
            hooks.append(mlp.register_forward_hook(lambda _m, _a, out: got["mlp"].append(last(out))))
    hooks.append(model.get_submodule(head).register_forward_hook(
        lambda _m, args, out: got.update(head_in=last(args[0]), logits=last(out))))
    with torch.no_grad():
        forward(name, model, prompt(), None)
    for hook in hooks:
        hook.remove()
    return got


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_defaults_find_head_norm_embedding_and_layers(tmp_path, name):
    model = build(name)
    head, norm, embedding, layers_path = PLACES[name]
    run, _ = session(name, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays, manifest = load_dump(dump_run(model, tmp_path, run))
    said = [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    handle_taps = compiledump.instrument(model).taps
    compiledump.reset()
    assert (handle_taps["logits"], handle_taps["final_norm"], handle_taps["input_token"], handle_taps["layer0"]) == \
        (head, norm, f"{embedding}:input", f"{layers_path}.0")
    assert not [s for s in said if "not recorded beside" in s or "no token embedding" in s], said
    got = own_reading(model, name)
    for i in range(4):
        np.testing.assert_array_equal(arrays[f"layer{i}"], got["layer"][i])
        if got["mlp"]:
            np.testing.assert_array_equal(arrays[f"layer{i}_mlp"], got["mlp"][i])
        if name in SEQUENTIAL:
            np.testing.assert_allclose(arrays[f"layer{i}_attn"] + arrays[f"layer{i}_mlp"], got["layer"][i],
                                       rtol=1e-5, atol=1e-5 * float(np.abs(got["layer"][i]).max()))
    assert {key for key in arrays if key.endswith("_mixer")} == {f"layer{i}_mixer" for i in got["mixer"]}
    for i, value in got["mixer"].items():
        np.testing.assert_array_equal(arrays[f"layer{i}_mixer"], value)
    if name != "modernbert-decoder":  # (its prediction head sits between)
        np.testing.assert_array_equal(arrays["final_norm"], got["head_in"])
    np.testing.assert_array_equal(arrays["logits_0"], got["logits"])
    assert {f"input_token_{n}" for n in range(1, STEPS + 1)} <= set(arrays)
    # A layer of one mixer (Mamba's) has no MLP: its output is the stream after the mixer, nothing to warn
    # about; BioGPT's norm before the MLP is named as OPT's, whose place depends on a flag BioGPT lacks
    assert bool([s for s in said if "no layer<i>_attn" in s]) == (name == "biogpt"), said
    kinds = set(manifest["mixers"].values())
    assert kinds == {"falcon_h1": {"mamba"}, "mamba": {"mamba"}, "rwkv": {"RwkvSelfAttention"},
                     "recurrent_gemma": {"RecurrentGemmaRecurrentBlock", "attention"}, "xlstm": {"mlstm_layer"},
                     "biogpt": {"attention"}, "zamba2": {"mamba", "mamba_decoder"},
                     "modernbert-decoder": {"attention"}}[name]


@pytest.mark.parametrize("name, weight", [("rwkv", "head"), ("rwkv", "rwkv.ln_out"), ("biogpt", "output_projection"),
                                          ("mamba", "backbone.layers.2.mixer.out_proj"),
                                          ("zamba2", "model.layers.1.mamba_decoder.mamba.out_proj")])
def test_a_bug_in_the_head_or_final_norm_is_named(tmp_path, name, weight):
    """Before: no tag after the layers, and "no divergence". A layer of one mixer records the
    mixer's own output, where its bug is not diluted by the stream."""
    reference = build(name, seed=1)
    run, fed = session(name, reference)
    ref = dump_run(reference, tmp_path / "ref", run)
    engine = copy.deepcopy(reference)
    with torch.no_grad():
        engine.get_submodule(weight).weight.mul_(1.05)
    run, _ = session(name, engine, feed=fed)
    report, last = compare_run(ref, engine, tmp_path / "run", run)
    expected = ("final_norm" if weight.endswith("ln_out") else f"layer{weight.split('.')[2]}_mixer" if "layers" in weight
                else "logits_0")
    assert report.exit_status == 1 and report.first_divergence.key == expected, last


def test_a_step_fed_another_token_is_not_read_as_a_divergence(tmp_path):
    """Mamba's `embeddings` is its token embedding: the comparator sees the sides fed different
    tokens (exit 3, the steps after it not comparable). Before: `layer0_step_2`, exit 1."""
    model = build("mamba")
    run, fed = session("mamba", model)
    ref = dump_run(model, tmp_path / "ref", run)
    other = [token.clone() for token in fed]
    other[1] = (other[1] + 1) % VOCAB
    run, _ = session("mamba", model, feed=other)
    report, last = compare_run(ref, model, tmp_path / "run", run)
    assert report.exit_status == 3 and report.first_divergence is None, last


def toy(head: bool = False):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Linear(4, 4)
    model.embed_tokens = torch.nn.Embedding(8, 4)
    if head:
        model.lm_head = torch.nn.Linear(4, 8)
    return model


def test_the_model_level_tags_not_found_are_named_in_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiledump.instrument(toy()).remove()
    said = [str(w.message) for w in caught if "not recorded beside" in str(w.message)]
    assert len(said) == 1 and "`logits`" in said[0] and "'logits': '<logits module>'" in said[0], said
    assert "`input_token`" not in said[0] and "final_norm" not in said[0]  # post-norm decoders have none
    with warnings.catch_warnings(record=True) as caught:  # tapped by name: not unfound
        warnings.simplefilter("always")
        compiledump.instrument(toy(), taps={"logits": "layers.0.self_attn"}).remove()
    assert not [w for w in caught if "not recorded beside" in str(w.message)]


def test_an_explicit_tap_of_a_default_tag_elsewhere_is_refused_and_the_same_one_is_ignored():
    handle = compiledump.instrument(toy(head=True), taps={"logits": "lm_head", "input_token": "embed_tokens:input"})
    assert (handle.taps["logits"], handle.taps["input_token"]) == ("lm_head", "embed_tokens:input")
    assert len(handle._handles) == len(compiledump.instrument(toy(head=True))._handles)  # no hook twice
    compiledump.reset()
    with pytest.raises(ValueError, match=r"the defaults already record 'logits' at 'lm_head'.*exclude=\('logits',\)"):
        compiledump.instrument(toy(head=True), taps={"logits": "layers.0.self_attn"})


@pytest.mark.parametrize("bad", [{"taps": {"x": "layers.9"}}, {"taps": {"logits": "layers.0.self_attn"}},
                                 {"exclude": ("nothing_{i}",)}])
def test_a_failed_instrument_leaves_no_hook_attached(bad):
    """A retry after a typo recorded every default tag twice (six logits steps for three forwards)."""
    model = toy(head=True)
    with pytest.raises(ValueError):
        compiledump.instrument(model, **bad)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class _Mixer(torch.nn.Module):
    """A Mamba-like mixer that returns its output, or (vLLM's) writes it into `output`."""

    def __init__(self, writes: bool, scale: float = 1.0):
        super().__init__()
        self.in_proj, self.out_proj = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.writes, self.scale = writes, scale

    def forward(self, hidden_states, output=None):
        y = self.out_proj(torch.nn.functional.silu(self.in_proj(hidden_states)).cumsum(1) / 4) * self.scale
        if self.writes:
            output.copy_(y)
            return None
        return y


class _MixerLayer(torch.nn.Module):
    def __init__(self, writes: bool, scale: float):
        super().__init__()
        self.input_layernorm, self.mamba = torch.nn.LayerNorm(16), _Mixer(writes, scale)

    def forward(self, hidden_states):
        h = self.input_layernorm(hidden_states)
        if self.mamba.writes:
            out = torch.empty_like(h)
            self.mamba(h, out)
        else:
            out = self.mamba(h)
        return hidden_states + out


class _MixerStack(torch.nn.Module):
    def __init__(self, writes: bool = False, scale: float = 1.0):
        super().__init__()
        self.config = {"model_type": "custom"}  # a config without __dict__: has_tower raised on it
        self.embed_tokens = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(_MixerLayer(writes, scale if i == 1 else 1.0) for i in range(3))
        self.norm, self.lm_head = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def test_a_mixer_that_writes_into_an_output_argument_is_recorded_and_its_bug_named(tmp_path):
    """vLLM's Mamba mixers return None and write `output`: their `layer<i>_mixer` recorded nothing
    (a bug in one was named only at `layer<i>`, diluted)."""
    torch.manual_seed(0)
    reference = _MixerStack()
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = dump_run(reference, tmp_path / "ref", lambda: reference(ids))
    for label, scale in (("same", 1.0), ("bug", 1.01)):
        engine = _MixerStack(writes=True, scale=scale)
        engine.load_state_dict(reference.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            run = dump_run(engine, tmp_path / label, lambda engine=engine: engine(ids))
            report = compare(ref, run)
        if label == "same":
            arrays, reference_arrays = load_dump(run)[0], load_dump(ref)[0]
            for i in range(3):
                np.testing.assert_array_equal(arrays[f"layer{i}_mixer"], reference_arrays[f"layer{i}_mixer"])
            assert report.exit_status == 0, format_report(report)[-1]
        else:
            assert report.exit_status == 1 and report.first_divergence.key == "layer1_mixer", format_report(report)[-1]
