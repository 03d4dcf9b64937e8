"""Granite-MoE (shared, hybrid, SWA) adds a dense MLP beside each layer's MoE block:
`block_sparse_moe(x) + shared_mlp(x)`. `instrument` records the block as `layer<i>_mlp` and the
dense MLP as `layer<i>_shared_mlp` (and its step rows): before, nothing recorded the shared MLP,
and a bf16 x1.05 bug there exited 0 (a new user's audit, 6 of 6 seeds) or was named with
`last good: layer1_mlp`. A hybrid model's dense layers (no MoE block) have their shared MLP as
`layer<i>_mlp`. Values are checked against this test's own hooks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

from compiledump.compare import compare, format_report
from helpers.hf_dump import dump_run, load_dump, prompt_then_steps
from helpers.hf_models import from_config

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, num_local_experts=8, num_experts_per_tok=2,
             shared_intermediate_size=96)


def granite(kind: str, seed: int, init: float = 0.02) -> transformers.PreTrainedModel:
    extra = dict(layer_types=["mamba", "attention"] * 2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                 mamba_n_groups=1) if kind == "granitemoehybrid" else {}
    return from_config(kind, seed, **SMALL, **extra, initializer_range=init)


session = prompt_then_steps


IDS = torch.randint(3, 160, (1, 9), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["granitemoeshared", "granitemoehybrid"])
def test_the_shared_mlp_is_recorded_beside_the_moe_block(tmp_path, kind):
    model = granite(kind, 0)
    got: dict[str, list[torch.Tensor]] = {}
    hooks = [layer.shared_mlp.register_forward_hook(
        lambda _m, _a, out, i=i: got.setdefault(f"layer{i}", []).append(out[0, -1].detach().clone()))
        for i, layer in enumerate(model.model.layers)]
    path = dump_run(model, tmp_path, session(model, IDS))
    for hook in hooks:
        hook.remove()
    arrays, manifest = load_dump(path)
    for i in range(4):
        np.testing.assert_array_equal(arrays[f"layer{i}_shared_mlp"], got[f"layer{i}"][0].numpy())
        for step in (1, 2, 3):  # the step rows (step 0 is the prompt's last row)
            np.testing.assert_array_equal(arrays[f"layer{i}_shared_mlp_step_{step}"], got[f"layer{i}"][step].numpy())
        if i < 2:  # (an MoE block's output past COMPILEDUMP_MOE_LAYERS=2 is not recorded)
            assert manifest["keys"][f"layer{i}_shared_mlp"]["order"] > manifest["keys"][f"layer{i}_mlp"]["order"]
    assert manifest["routing"]["moe_outputs"] == [0, 1, 2, 3]  # the blocks, not the shared MLPs (dense)


def test_a_hybrid_models_dense_layer_has_its_shared_mlp_as_its_mlp(tmp_path):
    model = from_config("granitemoehybrid", 0, **{**SMALL, "num_local_experts": 0},
                        layer_types=["mamba", "attention"] * 2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                        mamba_n_groups=1)
    assert model.model.layers[1].block_sparse_moe is None
    got = []
    hook = model.model.layers[1].shared_mlp.register_forward_hook(lambda _m, _a, out: got.append(out[0, -1].clone()))
    arrays, _ = load_dump(dump_run(model, tmp_path, lambda: model(input_ids=IDS, use_cache=False)))
    hook.remove()
    np.testing.assert_array_equal(arrays["layer1_mlp"], got[0].detach().numpy())
    assert "layer1_shared_mlp" not in arrays


@pytest.mark.parametrize("kind, dtype, scale, decode_only", [
    ("granitemoeshared", torch.float32, 1.01, False), ("granitemoeshared", torch.bfloat16, 1.05, False),
    ("granitemoehybrid", torch.bfloat16, 1.05, False), ("granitemoehybrid", torch.float32, 1.01, True)])
def test_a_bug_in_the_shared_mlp_is_named_there(tmp_path, kind, dtype, scale, decode_only):
    reference = granite(kind, 1)
    dump_run(reference, tmp_path / "ref", session(reference, IDS))
    engine = copy.deepcopy(reference).to(dtype)

    def bug(_module, args, out):
        return out if decode_only and args[0].shape[1] != 1 else out * scale
    engine.model.layers[1].shared_mlp.register_forward_hook(bug)
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", session(engine, IDS)))
    first = report.first_divergence
    want = "layer1_shared_mlp_step_1" if decode_only else "layer1_shared_mlp"
    assert report.exit_status == 1 and first.key == want, format_report(report)[-1]
    assert first.last_good in ("layer1_mlp", "layer1_mlp_step_1"), format_report(report)[-1]


def test_the_shared_mlp_at_a_step_has_a_dense_mlps_thresholds(tmp_path):
    """A decode step's MoE block output gets twice its phase's thresholds in bf16 (its gate weights
    move with the router logits); the dense shared MLP beside it does not."""
    reference = granite("granitemoeshared", 2)
    dump_run(reference, tmp_path / "ref", session(reference, IDS))
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    report = compare(tmp_path / "ref", dump_run(engine, tmp_path / "run", session(engine, IDS)))
    limits = {record.key: record.limits for record in report.keys if record.limits is not None}
    assert "MoE output" in limits["layer1_mlp_step_1"].rel_source
    assert "MoE output" not in limits["layer1_shared_mlp_step_1"].rel_source
    assert limits["layer1_shared_mlp_step_1"].rel_diff * 2 == limits["layer1_mlp_step_1"].rel_diff


def test_an_older_dump_without_the_shared_mlp_gets_one_note(tmp_path):
    """A reference recorded before `layer<i>_shared_mlp` existed against a new run: one note, no
    problem per key (a review: 12 `extra_in_run` problems for 4 layers)."""
    from helpers import dumpfactory as factory

    rng = np.random.default_rng(0)
    common = [factory.Capture(f"layer{i}_mlp", rng.standard_normal(16).astype(np.float32), "record", f"layer{i}_mlp")
              for i in range(2)]
    common += [factory.Capture(f"layer{i}_mlp_step_{n}", rng.standard_normal(16).astype(np.float32), "step",
                               f"layer{i}_mlp_step", n) for i in range(2) for n in range(2)]  # (an older one had these)
    shared = [factory.Capture(f"layer{i}_shared_mlp", rng.standard_normal(16).astype(np.float32), "record",
                              f"layer{i}_shared_mlp") for i in range(2)]
    shared += [factory.Capture(f"layer{i}_shared_mlp_step_{n}", rng.standard_normal(16).astype(np.float32), "step",
                               f"layer{i}_shared_mlp_step", n) for i in range(2) for n in range(2)]
    report = compare(*factory.write_pair(tmp_path, common, common + shared))
    lines = format_report(report)
    assert report.exit_status == 0 and not [p for p in report.problems if p.kind == "extra_in_run"], lines
    (note,) = [line for line in lines if "shared MLP or expert of an MoE layer" in line]
    # (step 0 of a stream step is never compared: the prompt's last row)
    assert note.startswith("note: RUN holds 4 keys of a shared MLP or expert of an MoE layer") and "REF none" in note
