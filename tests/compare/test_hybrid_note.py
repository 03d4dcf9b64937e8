"""Hybrid models: `instrument` writes each decoder layer's token mixer into the manifest
(`mixers`, also in a recovered dump), and a low-precision pair that first diverges at or after a
linear-attention or state-space layer gets a note and a caution on its verdict line (their
honest bf16 rounding can exceed the defaults: docs/compare.md, "Hybrid models")."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

import compiledump
from helpers.hf_dump import dump_prefill
from compiledump.capture.recover import recover_directory
from compiledump.compare import compare, format_report
from compiledump.compare.cautions import hybrid_note, hyper_connection_note

transformers = pytest.importorskip("transformers")


def _qwen3_next(seed: int) -> torch.nn.Module:
    """Qwen3-Next: Gated DeltaNet layers 0 and 2, full attention 1 and 3 (random weights)."""
    config = transformers.AutoConfig.for_model(
        "qwen3_next", vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=64, initializer_range=0.1, intermediate_size=96,
        moe_intermediate_size=48, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _mixers(directory: Path) -> dict:
    (manifest,) = directory.glob("*.json")
    return json.loads(manifest.read_text())["mixers"]


def _routing(directory: Path) -> dict:
    (manifest,) = directory.glob("*.json")
    return json.loads(manifest.read_text())["routing"]


def test_the_manifest_names_each_layer_s_mixer_and_routing_and_a_recovered_dump_keeps_them(dump_dir):
    """Captured here rather than with dump_prefill, whose reset would remove the crash-proof files
    that recover reads. So are instrument's exclude patterns."""
    model, ids = _qwen3_next(0), torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(1))
    handle = compiledump.instrument(model, exclude=["layer{i}_mlp"])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, use_cache=False)
        path = Path(compiledump.flush())
    handle.remove()
    want = {"0": "linear_attn", "1": "attention", "2": "linear_attn", "3": "attention"}
    assert _mixers(dump_dir) == want
    # Qwen3-Next's MoE layers are routed (its router tapped), nothing else selects per token.
    # (no MoE output recorded: exclude left out every layer<i>_mlp)
    routing = {"routed": [0, 1, 2, 3], "complete": True, "moe_outputs": []}
    assert _routing(dump_dir) == routing
    (manifest,) = dump_dir.glob("*.json")
    assert json.loads(manifest.read_text())["exclude"] == ["layer{i}_mlp"]
    manifest.unlink()  # recover writes it again from the journal
    results, errors = recover_directory(dump_dir, force=True, keep=True)
    assert errors == [] and results[0].npz == path and _mixers(dump_dir) == want and _routing(dump_dir) == routing
    assert json.loads(manifest.read_text())["exclude"] == ["layer{i}_mlp"]


def test_an_attention_model_has_no_caution(dump_dir):
    from helpers.hf_example import ex
    dump_prefill(ex.build_model("qwen3_moe"), dump_dir, torch.randint(3, 200, (1, 7)), "all")
    mixers = _mixers(dump_dir)
    assert set(mixers.values()) == {"attention"} and hybrid_note([{"mixers": mixers}], 3, "bf16") is None


@pytest.mark.parametrize("layers, expected", [
    ([("self_attn", "Qwen3MoeAttention")] * 2, ["attention"] * 2),
    # Kimi-Linear, MiniMax, Bailing: their linear layers are `self_attn` too; the model's name
    # ("KimiLinear") is the prefix their classes share, so its "Linear" says nothing.
    ([("self_attn", "KimiLinearDeltaAttention"), ("self_attn", "KimiLinearAttention")],
     ["KimiLinearDeltaAttention", "attention"]),
    ([("self_attn", "MiniMaxAttention"), ("self_attn", "MiniMaxLightningAttention")],
     ["attention", "MiniMaxLightningAttention"]),
    ([("self_attn", "Glm5NextTextLinearAttention"), ("self_attn", "Glm5NextTextAttention")],
     ["Glm5NextTextLinearAttention", "attention"]),
    ([("linear_attn", "Qwen3NextGatedDeltaNet"), ("self_attn", "Qwen3NextAttention")], ["linear_attn", "attention"]),
    ([("mamba", "JambaMambaMixer"), ("self_attn", "JambaAttention")], ["mamba", "attention"]),
    ([("mixer", "NemotronHMamba2Mixer"), ("mixer", "NemotronHMoE"), ("mixer", "NemotronHAttention"),
      ("mixer", "NemotronHMLP")], ["mamba", "mlp", "attention", "mlp"]),
    ([("conv", "Lfm2MoeShortConv"), ("self_attn", "Lfm2MoeAttention"), (None, None)], ["conv", "attention", "mlp"]),
])
def test_a_layer_s_mixer_kind_comes_from_its_class_as_well_as_its_name(layers, expected):
    from compiledump.capture.mixers import kinds_of
    modules = []
    for child, kind in layers:
        layer = torch.nn.Module()
        if child is not None:
            setattr(layer, child, type(kind, (torch.nn.Module,), {})())
        modules.append(layer)
    assert kinds_of(modules, [child for child, _ in layers]) == dict(enumerate(expected))


@pytest.mark.parametrize("layer, klass, expected", [
    (2, "bf16", "at or after 2 layer(s) whose token mixer is not attention (linear_attn, mamba; first: layer 0)"),
    (0, "fp16", "at or after 1 layer(s)"),
    (3, "fp32", None),  # fp32 defaults are not calibrated against bf16 rounding
    (None, "bf16", None),  # no layer (logits)
])
def test_the_note_names_the_recurrent_layers_at_or_before_the_divergence(layer, klass, expected):
    manifest = {"mixers": {"0": "linear_attn", "1": "attention", "2": "mamba", "3": "mlp"}}
    note = hybrid_note([None, manifest], layer, klass)  # RUN's manifest when REF has none (or no mixers)
    assert (note is None) if expected is None else expected in note
    assert hybrid_note([{"mixers": {"0": "attention", "1": "mlp"}}], 1, "bf16") is None
    assert hybrid_note([{}, None], 1, "bf16") is None


def _broken(reference, ids, root: Path, plant, dtypes=(torch.bfloat16, torch.float32)):
    """(dtype, report, report lines) of `reference` (dumped once, every row) against its copy in
    each of `dtypes` broken by `plant(engine)`."""
    dump_prefill(reference, root / "ref", ids, "all")
    for dtype in dtypes:
        engine = copy.deepcopy(reference).to(dtype)
        with torch.no_grad():
            plant(engine)
        dump_prefill(engine, root / str(dtype), ids, "all")
        report = compare(root / "ref", root / str(dtype))
        yield dtype, report, format_report(report)


def test_a_bf16_divergence_in_a_hybrid_model_carries_the_caution(dump_dir, tmp_path):
    """An engine with a bug in layer 2 (a Gated DeltaNet layer): exit 1 there, with the caution on
    the verdict line and the note; the fp32 engine with the same bug has neither."""
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(4))
    for dtype, report, lines in _broken(_qwen3_next(3), ids, tmp_path,
                                        lambda engine: engine.model.layers[2].linear_attn.out_proj.weight.mul_(1.3)):
        assert report.exit_status == 1 and report.first_divergence.layer == 2, lines[-1]
        cautioned = "caution: after layers whose bf16 rounding can exceed the defaults" in lines[-1]
        assert cautioned == (dtype == torch.bfloat16)
        assert any("(linear_attn; first: layer 0)" in line for line in lines) == (dtype == torch.bfloat16)


def _deepseek_v4(seed: int) -> torch.nn.Module:
    """DeepSeek-V4: a residual of 4 hyper-connection streams (mHC), two hash-routed MoE layers,
    then two routed by sqrt(softplus) scores (random weights)."""
    config = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        num_hash_layers=2, head_dim=32, q_lora_rank=32, o_lora_rank=32, index_n_heads=4, index_head_dim=16,
        qk_rope_head_dim=16, moe_intermediate_size=48, initializer_range=0.1)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("layer, klass, expected", [
    (2, "bf16", "at or after 3 layer(s) whose residual is 4 hyper-connection streams (first: layer 0;"),
    (0, "fp16", "at or after 1 layer(s)"),
    (3, "fp32", None),
    (None, "bf16", None),
])
def test_the_hyper_connection_note_names_the_layers_stored_as_a_mean_of_streams(layer, klass, expected):
    """A layer state read from `[tokens, hc_mult, hidden]` (its manifest source_shape; stored as the
    mean over hc_mult) marks a hyper-connection layer; a `[batch, seq, hidden]` model's 2-D
    sources, a 3-D one whose middle dim cannot be hc_mult, or keys other than `layer<N>` do not."""
    keys = {f"layer{i}": {"source_shape": [7, 4, 64], "shape": [7, 64]} for i in range(4)}
    keys.update(layer0_mlp={"source_shape": [7, 4, 64], "shape": [7, 64]})
    note = hyper_connection_note([None, {"keys": keys}], layer, klass)
    assert (note is None) if expected is None else expected in note
    for plain in ({"source_shape": [7, 64], "shape": [7, 64]}, {"source_shape": [7, 40, 64], "shape": [64]},
                  {"source_shape": [1, 7, 64], "shape": [1, 7, 64]}):
        assert hyper_connection_note([{"keys": {"layer1": plain}}], 3, "bf16") is None


def test_a_bf16_divergence_in_a_hyper_connection_model_carries_the_caution(tmp_path):
    """DeepSeek-V4 with layer 1's experts scaled by 1.05: exit 1 at layer 1 with the caution (its
    honest bf16 pairs crossed the defaults in 5 of 200 random models in sweep_routing, the six other
    MoE models' in none of 1200: benchmarks/RESULTS.md); the fp32 engine with the same bug has
    none, nor has an attention model's bf16 divergence."""
    def experts_x105(engine):
        for parameter in engine.model.layers[1].mlp.experts.parameters():
            parameter.mul_(1.05)
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(4))
    for dtype, report, lines in _broken(_deepseek_v4(3), ids, tmp_path, experts_x105):
        assert report.exit_status == 1 and report.first_divergence.layer == 1, lines[-1]
        cautioned = "caution: after layers whose bf16 rounding can exceed the defaults" in lines[-1]
        assert cautioned == (dtype == torch.bfloat16), lines[-1]
        assert any("whose residual is 4 hyper-connection streams (first: layer 0" in line for line in lines) == (
            dtype == torch.bfloat16)
    from helpers.hf_example import ex
    ((_, report, lines),) = _broken(ex.build_model("llama"), ids % 200, tmp_path / "llama",
                                    lambda engine: engine.model.layers[1].mlp.down_proj.weight.mul_(1.3),
                                    dtypes=(torch.bfloat16,))
    assert report.exit_status == 1 and "caution" not in lines[-1]


def test_the_verdict_line_carries_the_caution_a_setting_can_remove_first():
    """A hybrid model (Granite-MoE hybrid's Mamba layers) whose layer-2 routing the MoE layer filter
    left out: both notes, and the verdict line's one caution is the unrecorded routing's, which
    COMPILEDUMP_MOE_LAYERS removes (a new user's audit: the line blamed the Mamba layers while the
    honest pair's crossing came from an unrecorded near tie, exit 0 with the setting)."""
    from types import SimpleNamespace
    from compiledump.compare.cautions import first_cautions

    manifest = {"mixers": {"0": "mamba", "1": "attention", "2": "mamba", "3": "attention"},
                "routing": {"routed": [0, 1, 2, 3], "complete": True},
                "filtered_tags": {"layer2_topk": "moe_layers", "layer3_topk": "moe_layers"}}
    dump = SimpleNamespace(manifest=manifest, members={"layer0_topk": 0, "layer1_topk": 0})
    found = first_cautions(dump, dump, "layer2", 2, "bf16")
    assert [caution for _, caution in found] == [
        "after MoE layers whose routing is not recorded (see the note)",
        "after layers whose bf16 rounding can exceed the defaults (see the note)"]
    assert "COMPILEDUMP_MOE_LAYERS=4" in found[0][0] and "mamba" in found[1][0]


@pytest.mark.parametrize("key", ["final_norm", "logits_3", "logits"])
def test_a_divergence_after_every_layer_gets_the_models_caution_too(key):
    """The final norm and the logits come after every layer: a hybrid model's or a hyper-connection
    model's caution applies there as the unrecorded routing's does (a review: they had none; the
    prompt's `logits`, which the built-in model records, had none until a later review)."""
    from types import SimpleNamespace
    from compiledump.compare.cautions import first_cautions

    hybrid = SimpleNamespace(manifest={"mixers": {"0": "mamba", "1": "attention"}}, members={})
    found = first_cautions(hybrid, hybrid, key, None, "bf16")
    assert [caution for _, caution in found] == ["after layers whose bf16 rounding can exceed the defaults (see the note)"]
    assert found[0][0].startswith("the first divergence (after the layers) is at or after 1 layer(s)")
    streams = SimpleNamespace(manifest={"keys": {"layer0": {"source_shape": [7, 4, 64], "shape": [64]}}}, members={})
    (found,) = first_cautions(streams, streams, key, None, "bf16")
    assert "4 hyper-connection streams" in found[0]
    assert first_cautions(streams, streams, key, None, "fp32") == []
    assert first_cautions(streams, streams, "input_token_0", None, "bf16") == []  # before the layers
