"""Decoders written the way Meta's reference code, gpt-fast and torchtitan write them, under
`instrument()`'s defaults: `tok_embeddings`, `layers` (torchtitan's a `ModuleDict` keyed by layer
index, whose pipeline stages drop the other stages' keys and set their `tok_embeddings`, `norm` and
head to None), blocks of `attention`, `attention_norm`, `feed_forward`, `ffn_norm`, then `norm` and an
`output` (torchtitan 0.3's `lm_head`). Before 2026-12-06 (twenty-seventh session) a `ModuleDict`
of layers raised "no decoder layers found", and a `ModuleList` got no `input_token` and no `logits`
(warned). The model below is this test's own, written after those code bases (not imported: none
of them is a dependency); benchmarks/RESULTS.md holds the run on torchtitan's own Llama 3."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import compiledump
from helpers.hf_dump import compare_run, dump_run, load_dump, scale_output

VOCAB, DIM, HEADS, LAYERS, PROMPT, STEPS = 160, 64, 4, 4, 7, 3


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, DIM))


class FeedForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(DIM, 96, bias=False), torch.nn.Linear(DIM, 96, bias=False)
        self.w2 = torch.nn.Linear(96, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(torch.nn.Module):
    """`dict_layers`: torchtitan's `ModuleDict`; `head`: the head's name (`output`, or torchtitan 0.3's
    `lm_head`); `stage`: the layer indices a pipeline stage keeps (its ends dropped where it has none)."""

    def __init__(self, dict_layers: bool = False, head: str = "output", stage: range | None = None):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        blocks = {str(i): TransformerBlock() for i in range(LAYERS)}
        self.layers = torch.nn.ModuleDict(blocks) if dict_layers else torch.nn.ModuleList(blocks.values())
        self.norm = torch.nn.RMSNorm(DIM)
        setattr(self, head, torch.nn.Linear(DIM, VOCAB, bias=False))
        self.head_name = head
        if stage is not None:  # pruned as torchtitan's pipeline splits a model
            for i in set(range(LAYERS)) - set(stage):
                del self.layers[str(i)]
            if 0 not in stage:
                self.tok_embeddings = None
            if LAYERS - 1 not in stage:
                self.norm = None
                setattr(self, head, None)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in (self.layers.values() if isinstance(self.layers, torch.nn.ModuleDict) else self.layers):
            h = layer(h)
        head = getattr(self, self.head_name)
        return head(self.norm(h)) if head is not None else h


def build(seed: int = 0, **options) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(**options).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 1.0 if "tok_embeddings" in name else 0.15)
    return model


def session(model, seed: int = 0):
    """A prompt, then STEPS teacher-forced tokens, each forward over the whole sequence (no cache)."""
    ids = torch.randint(0, VOCAB, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(seed))

    def run():
        for end in range(PROMPT, PROMPT + STEPS + 1):
            model(ids[:, :end])
    return run


@pytest.mark.parametrize("dict_layers, head", [(False, "output"), (True, "lm_head"), (True, "output")])
def test_a_reference_style_decoder_gets_every_default_tag(tmp_path, dict_layers, head):
    model = build(dict_layers=dict_layers, head=head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays, manifest = load_dump(dump_run(model, tmp_path, session(model)))
    assert not [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    handle = compiledump.instrument(model)
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    assert (taps["layer1_attn"], taps["layer1_mlp"], taps["final_norm"], taps["input_token"], taps["logits"]) == \
        ("layers.1.ffn_norm:input", "layers.1.feed_forward", "norm", "tok_embeddings:input", head)
    got = {}

    def keep(key, tensor) -> None:  # (a hook that returns a value replaces the module's output)
        got.setdefault(key, tensor[0, -1])
    hooks = [model.get_submodule(head).register_forward_hook(lambda _m, _a, out: keep("logits", out))]
    for i in range(LAYERS):
        layer = model.layers[str(i) if dict_layers else i]
        hooks += [layer.ffn_norm.register_forward_pre_hook(lambda _m, args, i=i: keep(f"attn{i}", args[0])),
                  layer.feed_forward.register_forward_hook(lambda _m, _a, out, i=i: keep(f"mlp{i}", out)),
                  layer.register_forward_hook(lambda _m, _a, out, i=i: keep(f"layer{i}", out))]
    with torch.no_grad():
        session(model)()
    for hook in hooks:
        hook.remove()
    np.testing.assert_array_equal(arrays["logits_0"], got["logits"].numpy())
    for i in range(LAYERS):
        for key, own in ((f"layer{i}_attn", f"attn{i}"), (f"layer{i}_mlp", f"mlp{i}"), (f"layer{i}", f"layer{i}")):
            np.testing.assert_array_equal(arrays[key], got[own].numpy(), err_msg=key)
    assert manifest["prompt_tokens"] == PROMPT and {f"input_token_{n}" for n in range(STEPS + 1)} <= set(arrays)


def test_an_honest_pair_exits_0_and_a_bug_is_named_at_its_mlp(tmp_path):
    reference = build(seed=1, dict_layers=True)
    ref = dump_run(reference, tmp_path / "ref", session(reference, seed=1))
    honest = copy.deepcopy(reference).to(torch.bfloat16)
    report, last = compare_run(ref, honest, tmp_path / "honest", session(honest, seed=1))
    assert report.exit_status == 0, last
    engine = copy.deepcopy(reference)
    scale_output(engine.layers["2"].feed_forward)
    report, last = compare_run(ref, engine, tmp_path / "bug", session(engine, seed=1))
    assert report.exit_status == 1 and report.first_divergence.key == "layer2_mlp", last


def test_torchtitan_style_pipeline_stages_tap_their_own_layers_under_their_global_index(tmp_path):
    """The first stage keeps layers 0-1 and the embedding, the second layers 2-3, the norm and the
    head (the others set to None, the other stage's keys gone): each stage taps its own layers as
    `layer<i>` with i the layer's index in the whole model, and neither warns about the tags the
    other stage holds."""
    first = build(seed=2, dict_layers=True, head="lm_head", stage=range(0, 2))
    second = build(seed=2, dict_layers=True, head="lm_head", stage=range(2, 4))
    found = []
    for stage in (first, second):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = compiledump.instrument(stage)
        found.append(dict(handle.taps))
        handle.remove()
        compiledump.reset()
        assert not [str(w.message) for w in caught if "compiledump.instrument" in str(w.message)]
    assert {tag for tag in found[0] if tag.startswith("layer") and tag[5:].isdigit()} == {"layer0", "layer1"}
    assert {tag for tag in found[1] if tag.startswith("layer") and tag[5:].isdigit()} == {"layer2", "layer3"}
    assert "input_token" in found[0] and "logits" not in found[0]
    assert "logits" in found[1] and "input_token" not in found[1] and found[1]["layer2"] == "layers.2"


def test_modules_under_these_names_that_are_no_embedding_or_head_are_not_taken_for_one():
    """The second review's cases: a vision tower first in module order whose patch projection is a
    Conv2d named `embed` (Xcodec2's acoustic decoder has a Conv1d `embed`) is no token embedding, so
    the language model's layers stay tapped; a gpt-fast-style reward model whose `head` is a
    `Linear(dim, 1)` value head (its language-model head a function of `tok_embeddings`) has no
    logits tapped, and the warning says so."""
    import transformers as T

    config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2)
    model = torch.nn.Module()
    model.vision = torch.nn.Module()
    model.vision.embed = torch.nn.Conv2d(3, 32, 4, 4)
    model.vision.layers = T.LlamaModel(config).layers  # blocks of `self_attn` and `mlp`, as a tower's
    model.lm = T.LlamaForCausalLM(config)
    handle = compiledump.instrument(model)
    taps = dict(handle.taps)
    handle.remove()
    compiledump.reset()
    assert (taps["layer0"], taps["input_token"], taps["logits"]) == ("lm.model.layers.0", "lm.model.embed_tokens:input",
                                                                      "lm.lm_head")
    reward = build()
    del reward.output  # (its language-model head: a function of tok_embeddings, no module)
    reward.head = torch.nn.Linear(DIM, 1)
    with pytest.warns(RuntimeWarning, match="`logits`: no head"):
        handle = compiledump.instrument(reward)
    assert "logits" not in handle.taps and handle.taps["input_token"] == "tok_embeddings:input"
    handle.remove()
    compiledump.reset()


def test_a_torchtitan_style_moe_block_is_warned_about_with_the_tap_to_add():
    """torchtitan names its MoE block `moe`, whose router returns top scores and ids, not logits: no
    MLP, router or ids tag is attached there, and one warning names the blocks and the tap that
    records their output (before: nothing said). Checked on torchtitan 0.3's Qwen3 MoE too."""
    model = build()
    for layer in model.layers:
        layer.moe = layer.feed_forward  # (the name is what matters here)
        del layer.feed_forward
    blocks = r"4 MoE block\(s\) \(layers.0.moe, layers.1.moe, layers.2.moe, \.\.\.\)"
    with pytest.warns(RuntimeWarning, match=blocks) as caught:
        handle = compiledump.instrument(model)
    assert "taps={'layer{i}_mlp': 'layers.{i}.moe'}" in str(caught[-1].message)
    assert "layer0_mlp" not in handle.taps and handle.taps["layer0_attn"] == "layers.0.ffn_norm:input"
    # nor attention's own output, which COMPILEDUMP_MOE_LAYERS could not filter in a model whose MoE
    # blocks are not seen as such (a review found it recorded at every layer)
    assert not [tag for tag in handle.taps if tag.endswith("_mixer")]
    handle.remove()
    compiledump.reset()
