"""Gemma 3n passes an AltUp stack `[altup_num_inputs, batch, seq, hidden]` from layer to layer.
Read as it is, it looked like `[batch, seq, hc_mult, hidden]` of one token, and the token gate
dropped every call: `layer<i>` and `layer<i>_step_<n>` were never recorded (a bug-injection
audit: a bug after the MLP, in `post_feedforward_layernorm`, was named a layer late). Each layer's
state is now its active stream (`altup_active_idx`), checked against the test's own hooks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

from compiledump.compare import compare, format_report
from helpers.hf_dump import dump_run, load_dump


def gemma3n() -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(
        "gemma3n_text", vocab_size=160, hidden_size=64, intermediate_size=[128] * 4, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=4,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=160, laurel_rank=8, altup_num_inputs=4,
        num_kv_shared_layers=0, activation_sparsity_pattern=[0.0] * 4,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


IDS = torch.randint(3, 160, (1, 8), generator=torch.Generator().manual_seed(1))


def session(model):
    def run():
        out = model(input_ids=IDS, use_cache=True)
        for token in (7, 9):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return run


def test_each_layer_state_is_its_active_altup_stream(tmp_path):
    model = gemma3n()
    active = model.config.altup_active_idx
    got: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.register_forward_hook(
        lambda _m, _a, out, i=i: got.setdefault(i, []).append(out[active, 0, -1].detach().clone()))
        for i, layer in enumerate(model.model.layers)]
    arrays, manifest = load_dump(dump_run(model, tmp_path, session(model)))
    for hook in hooks:
        hook.remove()
    # the prompt's call kept (before: calls 3, passed 0, every one dropped by the token gate)
    assert got[0][0].shape == (64,) and manifest["tags"]["layer1"]["passed"] == 1
    for i in range(4):
        np.testing.assert_array_equal(arrays[f"layer{i}"], got[i][0].numpy())
        for step in (1, 2):
            np.testing.assert_array_equal(arrays[f"layer{i}_step_{step}"], got[i][step].numpy())


@pytest.mark.parametrize("module", ["post_feedforward_layernorm", "mlp"])
def test_a_bug_after_the_mlp_is_named_in_its_layer(tmp_path, module):
    reference = gemma3n()
    dump_run(reference, tmp_path / "ref", session(reference))
    engine = copy.deepcopy(reference)
    engine.model.layers[1].get_submodule(module).register_forward_hook(lambda _m, _a, out: out * 1.01)
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", session(engine)))
    first = report.first_divergence
    assert report.exit_status == 1 and first.layer == 1, format_report(report)[-1]
    assert first.key == ("layer1" if module == "post_feedforward_layernorm" else "layer1_mlp"), format_report(report)[-1]
