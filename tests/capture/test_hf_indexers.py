"""Sparse-attention indexers (transformers' DeepSeek-V3.2) recorded as the attention's own routing:
`layer<i>_index_router` (index scores) and `layer<i>_index_topk` (the keys picked), so that an honest
low-precision swap of near-tie keys is judged a near tie instead of read as a divergence, while a
bug still is one (docs/compare.md, "Sparse-attention indexers")."""

from __future__ import annotations

import dataclasses
import glob
import json
import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("transformers")

import compiledump  # noqa: E402
from compiledump import config as cd_config  # noqa: E402
from compiledump.compare import format_report  # noqa: E402
from helpers.engine_flow import honest_and_broken  # noqa: E402
from helpers.hf_dump import compare_bf16_prefill, dump_prefill  # noqa: E402
from helpers.hf_models import deepseek_v32, glm5_next_text, minimax_m3_vl_text  # noqa: E402


def _arrays(directory):
    return np.load(glob.glob(str(directory / "*.npz"))[0])


def _manifest(directory):
    return json.loads(open(glob.glob(str(directory / "*.npz"))[0].replace(".npz", ".json")).read())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recorded_picks_are_the_indexers_own(tmp_path, dtype):
    """Every layer's recorded picks equal what the indexer returned (hooked independently), with -1
    where the recorded score is -inf (a masked key: fewer visible keys than index_topk), and are
    the top-k of the recorded scores; the scores' -inf is never the dump's first non-finite."""
    model = deepseek_v32(index_topk=4, seed=3).to(dtype)
    returned = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda _m, _a, out, i=i: returned.__setitem__(i, out[0].clone())) for i, layer in enumerate(model.model.layers)]
    ids = torch.randint(3, 211, (1, 11), generator=torch.Generator().manual_seed(5))
    dump_prefill(model, tmp_path, ids, "all")
    for hook in hooks:
        hook.remove()
    arrays = _arrays(tmp_path)
    for i in range(4):
        scores, picked = arrays[f"layer{i}_index_router"], arrays[f"layer{i}_index_topk"]
        assert scores.shape == (11, 11) and picked.shape == (11, 4)
        own = returned[i].numpy()
        masked = np.take_along_axis(scores, own.astype(np.int64), axis=-1) == -np.inf
        assert masked.any() and not masked.all()  # rows 0-2 see fewer than 4 keys
        np.testing.assert_array_equal(picked, np.where(masked, -1, own))
        for row in range(11):
            finite = np.flatnonzero(np.isfinite(scores[row]))
            expected = finite[np.argsort(-scores[row][finite], kind="stable")][:4]
            assert set(picked[row][picked[row] >= 0].tolist()) == set(expected.tolist())
            assert np.all(np.isneginf(scores[row][row + 1:]))  # causal: later keys masked
    manifest = _manifest(tmp_path)
    assert manifest["tags"]["layer0_index_router"]["nonfinite"]["count"] > 0
    assert (manifest.get("first_nonfinite") or {}).get("tag") is None


def test_instrument_removes_its_indexer_wrapper():
    model = deepseek_v32(index_topk=4)
    handle = compiledump.instrument(model)
    assert "layer2_index_topk" in handle.taps and "forward" in vars(model.model.layers[2].self_attn.indexer)
    handle.remove()
    assert "forward" not in vars(model.model.layers[2].self_attn.indexer)
    compiledump.reset()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The float32 reference's dump of each (seed, rows) pair, made once: the honest all-rows pairs,
    the expert bug's and the wrong indexer's (seeds 0-2 of each) prefill the same model on the same
    ids; each test still dumps and compares its own bf16 engine."""
    return tmp_path_factory.mktemp("references"), {}


def _pair(references, tmp_path, seed, rows, bug=None, init=0.1):
    root, made = references
    ids = torch.randint(3, 211, (1, 64), generator=torch.Generator().manual_seed(seed + 1))
    reference = made.get((seed, rows, init))
    directory = root / f"{seed}_{rows}_{init}" if reference is None else tmp_path / f"{seed}_{rows}"
    report = compare_bf16_prefill(deepseek_v32(index_topk=32, seed=seed, init=init), directory, ids, rows, bug, reference)
    made.setdefault((seed, rows, init), root / f"{seed}_{rows}_{init}" / "ref")
    return report


@pytest.mark.parametrize("rows", ["one", "all"])
def test_honest_bf16_pairs_past_index_topk_exit_0(references, tmp_path, rows):
    """64-token prompts, index_topk 32: bf16 swaps near-tie keys in every pair (the picks differ),
    which without the indexer's scores read as a divergence in 19 of 20 such pairs."""
    hinted = []
    for seed in range(3):
        report = _pair(references, tmp_path, seed, rows)
        keys = {record.key: record for record in report.pairs[0].keys}
        assert any(record.ids_differ for key, record in keys.items() if key.endswith("_index_topk"))
        assert keys["layer1_index_router"].status == "shown"
        assert report.exit_status == 0, report.first_divergence
        # One-row keys left unjudged by earlier tokens' swaps: the verdict names the mode that judges them
        one_row_excused = any(r.excused_rows and len(r.shape_ref) == 1 for r in report.pairs[0].keys)
        assert ("COMPILEDUMP_ROWS=all" in format_report(report)[-1]) == one_row_excused
        assert not (one_row_excused and rows == "all")
        hinted.append(one_row_excused)
    assert any(hinted) == (rows == "one")  # some one-row pair leaves its last token's later keys to a swap


def test_a_bug_behind_swapped_keys_is_still_found(references, tmp_path):
    """x1.05 on layer 1's experts (all-rows mode judges every token no swap reaches): named at layer 1."""
    def scale(engine):
        with torch.no_grad():
            for parameter in engine.model.layers[1].mlp.experts.parameters():
                parameter.mul_(1.05)

    for seed in range(3):
        report = _pair(references, tmp_path, seed, "all", bug=scale)
        assert report.exit_status == 1 and report.first_divergence.layer == 1, report.first_divergence


def test_a_wrong_indexer_is_found_where_its_picks_change_attention(references, tmp_path):
    """An engine whose layer-1 indexer drops one of its 4 heads: its scores are shown, not judged, and
    the run's score error widens the near-tie epsilon (as a router's noise does), so the bug is found
    where the keys it swapped change attention's output, `layer1_mixer`, at tokens no other swap
    reaches: 4 of these 5 seeds (seed 1 exits 0; docs/compare.md says so)."""
    def drop_head(engine):
        with torch.no_grad():
            engine.model.layers[1].self_attn.indexer.weights_proj.weight[0] = 0

    found = [_pair(references, tmp_path, seed, "all", bug=drop_head) for seed in range(5)]
    named = [report.exit_status == 1 and report.first_divergence.key == "layer1_mixer" for report in found]
    assert sum(named) >= 4 and all(report.exit_status in (0, 1) for report in found), named


def test_compiled_indexer_records_what_eager_does(tmp_path):
    """torch.compile(fullgraph=True) traces the indexer's wrapper (no graph break): the same picks
    (a dense and an MoE layer, each with its indexer).

    Dynamo's trace is what this checks, so the graph runs on the aot_eager backend: AOT autograd's
    functionalized graph with the capture ops in it, without Inductor's codegen (26 CPU kernels, each
    a g++ run, cold). The same indexers in Inductor-compiled graphs (a bf16 engine's prefill and decode
    steps) are test_engine_flow_static_cache_against_dynamic_cache's; the capture op in Inductor's
    float32 graphs, held to float32 thresholds, test_hf_models.py's.

    A 1 MiB arena (the dump is 30 KB, nothing dropped): without Inductor's reinplacing, each
    functionalized capture op copies the whole arena it writes to, about 200 of them per forward,
    and the default 256 MiB made that 10 of this test's CPU seconds."""
    model = deepseek_v32(index_topk=4, layers=2)
    ids = torch.randint(3, 211, (1, 9), generator=torch.Generator().manual_seed(1))
    dump_prefill(model, tmp_path / "eager", ids, "all", arena_mb=1)
    counters.clear()
    dump_prefill(model, tmp_path / "compiled", ids, "all", arena_mb=1,
                 wrap=lambda m: torch.compile(m, fullgraph=True, backend="aot_eager"))
    assert counters["stats"]["unique_graphs"] == 1  # traced and compiled, not skipped to eager
    torch._dynamo.reset()
    eager, compiled = _arrays(tmp_path / "eager"), _arrays(tmp_path / "compiled")
    for i in range(2):
        np.testing.assert_array_equal(compiled[f"layer{i}_index_topk"], eager[f"layer{i}_index_topk"])
        np.testing.assert_allclose(compiled[f"layer{i}_index_router"], eager[f"layer{i}_index_router"], rtol=1e-5, atol=1e-6)


def test_an_indexer_of_another_shape_is_warned_about_once(tmp_path):
    """MiniMax-M3-VL's block-sparse indexer picks per head: not recorded, one warning for both of
    its layers, and its tags leave handle.taps."""
    model = minimax_m3_vl_text(sparse_layers=(0, 2))
    compiledump.reset()
    previous = compiledump.get_config()
    # every other setting at its default (capture on): an earlier test may have changed one
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path))))
    handle = compiledump.instrument(model)
    assert "layer0_index_topk" in handle.taps
    with pytest.warns(RuntimeWarning, match="MiniMaxM3VLIndexer") as caught, torch.no_grad():
        model(input_ids=torch.randint(3, 211, (1, 30), generator=torch.Generator().manual_seed(0)), use_cache=False)
    assert sum("sparse-attention indexer" in str(w.message) for w in caught) == 1
    assert not any(tag.endswith(("_index_router", "_index_topk")) for tag in handle.taps)
    handle.remove()
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(previous))


def test_engine_flow_static_cache_against_dynamic_cache(tmp_path):
    """examples/hf_reference_vs_compiled.py's flow on a 2-layer DeepSeek-V3.2 (a dense layer and an
    MoE one, each with its indexer, index_topk 4; 7-token prompt, 6 decode steps; two layers keep
    the cold compile of the suite's largest engine near a minute): the float32 eager reference with a DynamicCache (one more key per step) against the
    bf16 engine compiled with fullgraph, a StaticCache (every key, later ones masked) and a padded batch
    of 4. Every step's index scores are kept on both sides (the reference's padded to one width) and
    compared over the keys both have: no problem, no graph break, exit 0; x1.05 on layer 1's experts
    (the same compiled graphs) is named at layer 1."""
    honest, broken, graphs, breaks = honest_and_broken(lambda: deepseek_v32(index_topk=4, max_positions=64, layers=2), tmp_path)
    assert graphs == 2 and breaks == 0
    keys = {record.key: record for record in honest.pairs[0].keys}
    for i in range(2):  # COMPILEDUMP_MOE_LAYERS: layers 0 and 1 keep step tags
        for n in range(7):
            assert keys[f"layer{i}_index_step_router_{n}"].status == "shown"
            assert keys[f"layer{i}_index_step_topk_{n}"].status in ("ok", "near_tie")
    assert honest.problems == [] and honest.exit_status == 0, format_report(honest)[-1]
    assert broken.exit_status == 1 and broken.first_divergence.layer == 1, format_report(broken)[-1]


def test_a_prompt_too_large_for_the_arena_keeps_the_step_rows_and_says_so(tmp_path):
    """A 4 MiB arena and a 400-token prompt: one layer's scores and picks (400 x 400 and 400 x 4,
    631 KiB) are over an eighth of it, so only the step rows are recorded, with one warning naming
    the size to set; every other tag is kept (nothing crowded out)."""
    model = deepseek_v32(index_topk=4, max_positions=512)
    ids = torch.randint(3, 211, (1, 400), generator=torch.Generator().manual_seed(2))
    previous = compiledump.get_config()
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path), arena_mb=4)))
    handle = compiledump.instrument(model)
    with pytest.warns(RuntimeWarning, match=r"400 tokens x 400 keys .* COMPILEDUMP_ARENA_MB=5 or more") as caught, \
            torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert sum("sparse-attention indexer" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        path = compiledump.flush()
    handle.remove()
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(previous))
    kept = set(np.load(path).files)
    assert {"layer0_index_step_router_0", "layer0_index_step_topk_0", "layer0_attn", "layer1_mlp", "logits_0"} <= kept
    assert not kept & {"layer0_index_router", "layer0_index_topk", "layer1_index_router", "layer1_index_topk"}
    assert "arena_full" not in _manifest(tmp_path)["drops"]


def _scale_layer1_experts(engine):
    with torch.no_grad():
        for parameter in engine.layers[1].mlp.experts.parameters():
            parameter.mul_(1.05)


def test_a_pooled_indexer_is_recorded_at_its_pools(tmp_path):
    """GLM-5-Next's indexer scores pools of 2 keys, takes the top index_topk // 2 pools and returns their
    keys (plus the query's own tail). Its pools are recorded: every picked pool's keys are among the
    keys the model's own indexer returned, the picks are the top-k of the recorded pool scores, and a
    masked pool (the model fills its score with float32's lowest value) is recorded as -inf, picked -1."""
    model = glm5_next_text(seed=0)
    returned = {}
    model.layers[3].self_attn.indexer.register_forward_hook(lambda module, args, out: returned.setdefault("keys", out))
    ids = torch.randint(3, 211, (1, 48), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dump_prefill(model, tmp_path, ids, "all")
    assert not [w for w in caught if "sparse-attention indexer" in str(w.message)]
    (path,) = glob.glob(str(tmp_path / "*.npz"))
    with np.load(path) as dump:
        picks, scores = dump["layer3_index_topk"], dump["layer3_index_router"]
    keys = returned["keys"][0].numpy()
    assert picks.shape == (48, 4) and scores.shape == (48, 24)
    assert not np.any(np.isfinite(scores) & (scores < -1e30))  # no finite floor left
    for row in range(48):
        chosen = [int(p) for p in picks[row] if p >= 0]
        assert {2 * p + i for p in chosen for i in (0, 1)} <= set(keys[row].tolist()), row
        finite = np.flatnonzero(np.isfinite(scores[row]))
        assert len(chosen) == len(set(chosen)) == min(4, len(finite)), row
        # The top-k of what was recorded, by score: ReLU'd index scores are often exactly 0 at this
        # size, and between pools of equal score the model's top-k picks as it likes.
        best = np.sort(scores[row, finite])[::-1][:len(chosen)]
        np.testing.assert_array_equal(np.sort(scores[row, chosen])[::-1], best, err_msg=f"row {row}")


@pytest.mark.parametrize("rows", ["one", "all"])
def test_honest_bf16_pooled_indexer_pairs_exit_0(tmp_path, rows):
    """GLM-5-Next, 48-token prompts (24 pools, 4 kept): a seed whose honest bf16 pair exited 1 at the
    indexed layer before its pools were recorded (12 of 20 such pairs did; with glm5_next_text's linear
    attention cut to 4 heads of 16, 7 of seeds 0-11, this one among them, in both modes, and 0 of
    seeds 0-5 since) exits 0; x1.05 on layer 1's experts is named at layer 1."""
    for seed in (1,):
        reference = glm5_next_text(seed=seed)
        ids = torch.randint(3, 211, (1, 48), generator=torch.Generator().manual_seed(seed + 1))
        for bug in (False, True):  # the reference's dump of the honest pair serves the buggy one
            report = compare_bf16_prefill(reference, tmp_path / f"{seed}_{bug}", ids, rows, _scale_layer1_experts
                                          if bug else None, tmp_path / f"{seed}_False" / "ref" if bug else None)
            if bug:
                assert report.exit_status == 1 and report.first_divergence.layer == 1, format_report(report)[-1]
            else:
                assert report.exit_status == 0, format_report(report)[-1]
