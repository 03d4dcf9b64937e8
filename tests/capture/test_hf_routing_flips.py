"""An honest routing flip reaches later tokens through attention (real Hugging Face models).

A bf16 engine against its fp32 reference: in these random Qwen3-MoE and Mixtral models (seeds
found by a sweep of 30 each, of which about one in ten does this), rounding flips one token's
experts by a near tie in some layer; from the next layer on, every later token attends to that
token, and some of their values cross the bf16 thresholds. Judged as they were, the pair
"diverged" (exit 1) although nothing is wrong. The comparator excuses exactly the rows the flip
reaches (compare/flips.py); the crossings are found here again with numpy from the dumped
arrays, and each must be reached: the flipped token, or a later one in a later layer. A flip of
the last prompt token reaches its logits (DeepSeek-V3: step 0, whose routing is recorded beside
them).
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

from helpers.hf_dump import dump_prefill
from helpers.reference_metrics import row_metrics
from compiledump.compare import compare, format_report

transformers = pytest.importorskip("transformers")

BF16 = dict(rel_diff=2e-3, norm_diff=3e-2)  # docs/compare.md, the bf16 class


def _model(arch: str, seed: int):
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, initializer_range=0.1, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        config = transformers.AutoConfig.for_model("qwen3_moe", moe_intermediate_size=48, num_experts=8, head_dim=16,
                                                   **common)
    elif arch == "deepseek_v3":  # one expert group: plain top-k of sigmoid scores, so flips can be judged
        config = transformers.AutoConfig.for_model(
            "deepseek_v3", moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, head_dim=8, **common)
    elif arch == "deepseek_v3_grouped":  # its own routing: 16 experts in 4 groups, top-4 in the best 2
        config = transformers.AutoConfig.for_model(
            "deepseek_v3", moe_intermediate_size=48, n_routed_experts=16, n_shared_experts=1, first_k_dense_replace=1,
            n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, head_dim=8, **{**common, "num_experts_per_tok": 4})
    elif arch == "ernie4_5_moe":  # softmax scores plus a bias, one shared expert
        config = transformers.AutoConfig.for_model(
            "ernie4_5_moe", moe_intermediate_size=48, moe_num_experts=8, moe_k=2, moe_layer_start_index=0,
            moe_num_shared_experts=1, head_dim=16, **common)
    else:
        config = transformers.AutoConfig.for_model("mixtral", num_local_experts=8, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a trained model's bias is not zero (benchmarks/sweep_routing.py's draw)
        for bias in _biases(model) if arch in ("deepseek_v3_grouped", "ernie4_5_moe") else ():
            bias.normal_(0.0, 0.02)
    return model


def _biases(model) -> list[torch.Tensor]:
    """Every router's e_score_correction_bias (DeepSeek-V3's on its gate, Ernie 4.5's in the
    gate's moe_statics)."""
    return [m.e_score_correction_bias for m in model.modules()
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]


def _the_selection_matters(ref: dict[str, np.ndarray], k: int) -> bool:
    """REF's layer-1 ids are somewhere not the top-k of its router logits (the bias, the groups)."""
    top_k = np.sort(np.argsort(-ref["layer1_router"], axis=1, kind="stable")[:, :k], axis=1)
    return bool((top_k != np.sort(ref["layer1_topk"], axis=1)).any())


def _compare_without_the_bias(engine, ids, rows: str, tmp_path):
    """The report of `engine` with every router's bias forgotten (zeroed), against tmp_path/ref."""
    forgetful = copy.deepcopy(engine)
    with torch.no_grad():
        for bias in _biases(forgetful):
            bias.zero_()
    dump_prefill(forgetful, tmp_path / "bug", ids, rows)
    return compare(tmp_path / "ref", tmp_path / "bug")


def _arrays(directory) -> dict[str, np.ndarray]:
    (path,) = directory.glob("*.npz")
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def _layer(key: str) -> int | None:
    match = re.match(r"layer(\d+)", key)
    return int(match.group(1)) if match else None


def _crossing_rows(ref: np.ndarray, run: np.ndarray) -> list[int]:
    """Token rows whose rel_diff or norm_diff (docs/compare.md's per-row formulas, at the key's
    scale) crosses bf16's."""
    rel, norm = row_metrics(ref, run)
    return [row for row, (r, n) in enumerate(zip(rel, norm)) if r > BF16["rel_diff"] or n > BF16["norm_diff"]]


@pytest.mark.parametrize("arch,seed", [("qwen3_moe", 22), ("mixtral", 19)])
def test_an_honest_near_tie_reaches_later_tokens_through_attention(arch, seed, tmp_path):
    reference = _model(arch, seed)
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(seed + 1))
    for side, model in (("ref", reference), ("run", engine)):
        dump_prefill(model, tmp_path / side, ids, "all")
    report = compare(tmp_path / "ref", tmp_path / "run")
    ref, run = _arrays(tmp_path / "ref"), _arrays(tmp_path / "run")

    # Where rounding flipped experts, found from the arrays: (layer, token) of the first flip.
    flips = [(_layer(key), row) for key in ref if key.endswith("_topk")
             for row in np.flatnonzero((ref[key] != run[key]).any(1))]
    assert flips, "no routing flip: the sweep's seed no longer flips (re-pick it)"
    first_layer, first_token = min(flips)
    records = {record.key: record for record in report.keys}
    assert records[f"layer{first_layer}_topk"].routing.verdict == "near_tie"

    # Every crossing, found with numpy, is a flipped token, or a later token in a later layer
    # (attention carried it there); the comparator excuses exactly those rows.
    reached_only = {}
    for key, array in ref.items():
        layer = _layer(key)
        if array.dtype.kind != "f" or array.ndim != 2:
            continue
        rows = _crossing_rows(array, run[key])
        earlier = [(flip_layer, token) for flip_layer, token in flips if layer is None or flip_layer <= layer]
        for row in rows:
            assert any(row == token or (row > token and (layer is None or layer > flip_layer))
                       for flip_layer, token in earlier), (key, row, flips)
        if rows:
            assert not records[key].divergent and set(rows) <= set(records[key].excused_rows), key
        if set(rows) - {token for _, token in earlier}:
            reached_only[key] = rows
    assert reached_only, "no crossing in a token the flip reaches only through attention"
    assert report.exit_status == 0 and report.first_divergence is None

    # One-row mode: instrument still records every row's router logits, so the same flips are
    # judged near ties, and what they reach in the last row is not judged: exit 0, not 3.
    for side, model in (("ref1", reference), ("run1", engine)):
        dump_prefill(model, tmp_path / side, ids, "one")
    one_row = compare(tmp_path / "ref1", tmp_path / "run1")
    assert one_row.exit_status == 0 and one_row.first_divergence is None
    one_row_records = {record.key: record for record in one_row.keys}
    assert one_row_records[f"layer{first_layer}_topk"].routing.verdict == "near_tie"
    assert not any(record.status == "after_unjudged" for record in one_row.keys)
    # With the router's last row only (instrument(router_rows="one")), nothing judges the
    # earlier rows' flips: it could not tell (exit 3), unless only the last row flipped.
    for side, model in (("ref2", reference), ("run2", engine)):
        dump_prefill(model, tmp_path / side, ids, "one", router_rows="one")
    last_row_only = compare(tmp_path / "ref2", tmp_path / "run2")
    assert last_row_only.first_divergence is None
    assert last_row_only.exit_status == (3 if first_token < ids.shape[1] - 1 else 0)


def test_a_swap_within_the_runs_router_noise_is_a_near_tie(tmp_path):
    """Qwen3-MoE random seed 24 (found by the sweep), bf16 against fp32, all rows: rounding swaps
    token 1's second expert at layer 0 although the reference logits are 1.2 x the 4-ulp epsilon
    apart. The run's layer-0 router logits are off by as much in the other tokens (numpy, from
    the dumped arrays), so two of them can swap that pair: a near tie, not a routing bug."""
    reference = _model("qwen3_moe", 24)
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(25))
    for side, model in (("ref", reference), ("run", engine)):
        dump_prefill(model, tmp_path / side, ids, "all")
    ref, run = _arrays(tmp_path / "ref"), _arrays(tmp_path / "run")
    flipped = np.flatnonzero((ref["layer0_topk"] != run["layer0_topk"]).any(1)).tolist()
    assert flipped == [1], "the sweep's seed no longer flips token 1 alone at layer 0 (re-pick it)"
    logits = ref["layer0_router"][1].astype(np.float64)
    displaced = set(ref["layer0_topk"][1].tolist()) - set(run["layer0_topk"][1].tolist())
    instead = set(run["layer0_topk"][1].tolist()) - set(ref["layer0_topk"][1].tolist())
    gap = max(logits[list(displaced)]) - min(logits[list(instead)])
    ulps = 4 * 2.0 ** (np.floor(np.log2(np.abs(logits).max())) - 7)
    errors = np.abs(ref["layer0_router"].astype(np.float64) - run["layer0_router"])
    noise = np.delete(errors, 1, axis=0).max()  # the tokens whose ids agree
    assert ulps < gap <= 2 * noise
    report = compare(tmp_path / "ref", tmp_path / "run")
    record = next(r for r in report.keys if r.key == "layer0_topk")
    assert record.routing.logit_noise == pytest.approx(noise, rel=1e-6)
    assert record.routing.verdict == "near_tie" and report.exit_status == 0


@pytest.mark.parametrize("rows", ["all", "one"])
def test_a_near_tie_of_the_last_prompt_token_reaches_its_logits(rows, tmp_path):
    """DeepSeek-V3 random seed 92 (found by benchmarks/sweep_routing.py), bf16 against fp32:
    rounding flips the last prompt token's experts at layer 2 by a near tie, and its logits
    (`logits_0`, the prompt's last position as step 0) then cross even the decode-step
    thresholds (numpy, from the dumped arrays). The prompt's ids show the flip of that token,
    and so does step 0's own routing, recorded beside the logits (`layer2_step_topk_0`): the
    comparator does not judge those logits, in either mode (before it did, the pair 'diverged'
    at logits_0); step 0 being that token (instrument's steps count forwards), the prompt's flip
    is the one that excuses them."""
    reference = _model("deepseek_v3", 92)
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(93))
    for side, model in (("ref", reference), ("run", engine)):
        dump_prefill(model, tmp_path / side, ids, rows)
    ref, run = _arrays(tmp_path / "ref"), _arrays(tmp_path / "run")
    flipped = np.flatnonzero((ref["layer2_topk"] != run["layer2_topk"]).any(1)).tolist()
    assert flipped == [6], "the sweep's seed no longer flips the last token at layer 2 (re-pick it)"
    # Step 0 holds the last prompt token's routing: the same ids as the prefill's row 6.
    np.testing.assert_array_equal(ref["layer2_step_topk_0"], ref["layer2_topk"][6])
    np.testing.assert_array_equal(run["layer2_step_topk_0"], run["layer2_topk"][6])
    x, y = ref["logits_0"].astype(np.float64), run["logits_0"].astype(np.float64)
    rel = ((x - y) ** 2).sum() / ((x ** 2).sum() + (y ** 2).sum())
    assert rel > 0.2  # above the bf16 decode-step rel_diff default
    report = compare(tmp_path / "ref", tmp_path / "run")
    records = {record.key: record for record in report.keys}
    assert records["layer2_step_topk_0"].status == "near_tie"
    assert records["logits_0"].status == "after_near_tie"
    assert records["logits_0"].excused_by == ["layer2_topk"]
    assert report.first_divergence is None and report.exit_status == 0 and not report.problems


def _honest_flips_are_near_ties(reference, ids: torch.Tensor, rows: str, tmp_path):
    """Dump ``reference`` (float32) and its bfloat16 copy on ``ids``; rounding must flip some
    expert ids, each flip be judged a near tie, and the pair exit 0. Returns (the bfloat16
    engine, REF's arrays)."""
    engine = copy.deepcopy(reference).to(torch.bfloat16)
    for side, model in (("ref", reference), ("run", engine)):
        dump_prefill(model, tmp_path / side, ids, rows)
    ref, run = _arrays(tmp_path / "ref"), _arrays(tmp_path / "run")
    flipped = [key for key in ref if key.endswith("_topk") and
               any(set(a) != set(b) for a, b in zip(ref[key].tolist(), run[key].tolist()))]
    assert flipped, "no routing flip: the seed no longer flips (re-pick it)"
    report = compare(tmp_path / "ref", tmp_path / "run")
    records = {record.key: record for record in report.keys}
    assert all(records[key].routing.verdict == "near_tie" for key in flipped)
    assert report.exit_status == 0 and report.first_divergence is None, format_report(report)[-1]
    return engine, ref


def test_deepseek_v3_s_own_routing_is_judged_by_the_selection_instrument_declares(tmp_path):
    """DeepSeek-V3 with expert groups and a bias (random seed 4 of benchmarks/sweep_routing.py's
    deepseek_v3_grouped), bf16 against fp32, all rows: its ids are not the top-k of its router
    logits, so logit gaps cannot judge them; instrument() declares the selection (sigmoid + bias,
    best 2 of 4 groups) and rounding's flips are near ties (before: 'could not tell', exit 3).
    An engine that forgets the bias diverges at its first flip (before: exit 3 as well)."""
    reference = _model("deepseek_v3_grouped", 4)
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(5))
    engine, ref = _honest_flips_are_near_ties(reference, ids, "all", tmp_path)
    assert _the_selection_matters(ref, 4), "the bias and groups no longer matter here"

    report = _compare_without_the_bias(engine, ids, "all", tmp_path)  # layers 1-3 (layer 0 is dense)
    assert report.exit_status == 1
    assert report.root_cause is not None and report.root_cause.key == "layer1_topk"


def test_ernie_4_5_s_softmax_plus_bias_routing_is_judged_in_the_default_mode(tmp_path):
    """Ernie 4.5 (random seed 3 of benchmarks/sweep_routing.py's ernie4_5_moe: the top-k of
    softmax(logits) plus a bias), bf16 against fp32, one-row mode: its ids are not the top-k of
    its logits; instrument() declares the selection, the router logits of every prompt row judge
    rounding's flips as near ties (before: 'could not tell', exit 3), and an engine that forgets
    the bias diverges with a routing flip as the likely root cause (before: exit 3 as well)."""
    reference = _model("ernie4_5_moe", 3)
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(4))
    engine, ref = _honest_flips_are_near_ties(reference, ids, "one", tmp_path)
    assert _the_selection_matters(ref, 2), "the bias no longer matters here"

    report = _compare_without_the_bias(engine, ids, "one", tmp_path)
    assert report.exit_status == 1
    assert report.root_cause is not None and report.root_cause.key.endswith("_topk")
    assert any(record.routing is not None and record.routing.verdict == "divergence" for record in report.keys)


def _deepseek_v4(seed: int, init: float = 0.1):
    """DeepSeek-V4 from a config: two hash-routed layers (a random token -> experts table), then two
    routed by sqrt(softplus(logits)) + a random bias; weights of scale ``init``."""
    config = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        num_hash_layers=2, head_dim=32, q_lora_rank=32, o_lora_rank=32, index_n_heads=4, index_head_dim=16,
        qk_rope_head_dim=16, moe_intermediate_size=48, initializer_range=init)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for bias in _biases(model):
            bias.normal_(0.0, 0.02)
        for layer in model.model.layers[:2]:
            table = layer.mlp.gate.tid2eid
            table.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(table.shape[0])]))
    return model


@pytest.mark.parametrize("rows", ["one", "all"])
def test_deepseek_v4_s_rounded_scores_flip_honestly_at_the_default_init(tmp_path, rows):
    """DeepSeek-V4 with transformers' default weight scale (0.02; random seed 2): its bf16 router
    rounds sqrt(softplus(logits)) + bias near 0.83 while its logits sit near 0, so rounding flips
    a row by more than the logits' own bf16 spacing allows; `instrument` declares its scores
    `rounded`, and the flip is a near tie (before: exit 1, in 26 of 100 random models of
    benchmarks/sweep_routing.py at this scale)."""
    from compiledump.compare.routing import routing_epsilon
    reference = _deepseek_v4(2, init=0.02)
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    _, ref = _honest_flips_are_near_ties(reference, ids, rows, tmp_path)
    report = compare(tmp_path / "ref", tmp_path / "run")
    widened = [(record.key, row) for record in report.keys if record.routing is not None
               for row in record.routing.rows if row.score_rounding]
    assert widened, "no flip needed the scores' rounding (re-pick the seed)"
    key, row = widened[0]
    logits = ref[key.replace("topk", "router")]
    assert row.gap > routing_epsilon(logits[row.row] if logits.ndim == 2 else logits, None, 4.0)
    assert any("the rounding of its choice scores in the run's precision" in line for line in format_report(report))


def test_deepseek_v4_s_routing_is_judged_and_a_wrong_hash_table_is_a_divergence(tmp_path):
    """DeepSeek-V4 (random seed 10), bf16 against fp32, one-row mode: flips of its sqrt-softplus
    routers are near ties (before: its hash layers' ids, not the top-k of their logits, left every
    flip not judged, exit 3 in 14 of 40 random models). An engine whose hash table differs for
    one token diverges at that hash layer, named as the likely root cause."""
    reference = _deepseek_v4(10)
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(11))
    engine, ref = _honest_flips_are_near_ties(reference, ids, "one", tmp_path)

    wrong = copy.deepcopy(engine)
    with torch.no_grad():
        table = wrong.model.layers[1].mlp.gate.tid2eid
        table[ids[0, 2]] = (table[ids[0, 2]] + 1) % 8
    dump_prefill(wrong, tmp_path / "bug", ids, "one")
    report = compare(tmp_path / "ref", tmp_path / "bug")
    assert report.exit_status == 1 and report.root_cause.key == "layer1_topk"
    assert "token id" in report.root_cause.routing.rows[0].reason
