"""A declared router's selection (compare/selection.py) against Hugging Face's own routers.

The references are transformers' DeepSeek-V3 router (top-k of sigmoid(logits) + bias in the best
expert groups, a group scored by its two best), DeepSeek-V2's group-limited greedy router
(softmax, a group scored by its best) and MiniMax-M2's (sigmoid + bias, one group), built from a config with the identity as their weight so
that the hidden state fed in is the logits row (random data; nothing is downloaded). What must
hold: the selection replays theirs; an honest perturbation of the logits by at most e that flips
the routing has a gap of at most 2e; the witness at the reported gap makes their router pick the
run's experts. The rules without a model (closed forms, declarations): test_selection_rules.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from compiledump.compare import selection
from compiledump.format.routers import RouterInfo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (experts, groups, groups kept, top-k): DeepSeek-V3's shape scaled down, odd group sizes, one group.
SHAPES = [(32, 8, 3, 6), (24, 4, 2, 5), (15, 3, 1, 4), (16, 1, 1, 3)]


def v3_router(experts: int, groups: int, kept: int, k: int, bias: np.ndarray):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = transformers.DeepseekV3Config(hidden_size=experts, num_attention_heads=1, num_key_value_heads=1,
                                           n_routed_experts=experts, num_experts_per_tok=k,
                                           n_group=groups, topk_group=kept)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
    return router


def v2_router(experts: int, groups: int, kept: int, k: int):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    config = transformers.DeepseekV2Config(hidden_size=experts, num_attention_heads=1, num_key_value_heads=1,
                                           n_routed_experts=experts, num_experts_per_tok=k,
                                           n_group=groups, topk_group=kept, topk_method="group_limited_greedy")
    router = DeepseekV2TopkRouter(config)
    assert router.num_experts == experts
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
    return router


class MiniMaxM2Router(torch.nn.Module):
    """transformers' MiniMax-M2 router (sigmoid + bias, one group), with its block's bias."""

    def __init__(self, experts: int, k: int, bias: np.ndarray):
        super().__init__()
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
        config = transformers.MiniMaxM2Config(hidden_size=experts, num_local_experts=experts, num_experts_per_tok=k)
        self.router = MiniMaxM2TopKRouter(config)
        with torch.no_grad():
            self.router.weight.copy_(torch.eye(experts))
        self.bias = torch.from_numpy(bias)

    def forward(self, hidden):
        return self.router(hidden, self.bias)


def v4_router(experts: int, k: int, bias: np.ndarray):
    """transformers' DeepSeek-V4 router with the identity as its weight (the hidden state fed in
    is the logits row) and ``bias`` as its e_score_correction_bias."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
    router = DeepseekV4TopKRouter(transformers.DeepseekV4Config(hidden_size=experts, num_local_experts=experts,
                                                                num_experts_per_tok=k))
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
    return router


def picks(router, logits: np.ndarray) -> np.ndarray:
    """The experts Hugging Face's router picks for each row of ``logits``, sorted."""
    with torch.no_grad():
        return np.sort(router(torch.from_numpy(np.ascontiguousarray(logits, np.float32)))[2].numpy(), axis=-1)


def assert_the_witness_at_the_gap_reaches_run(info, router, row: np.ndarray, run: np.ndarray, gap: float) -> None:
    """The witness just above `gap` makes their router pick `run`, within the move the gap allows
    (their router computes in float32: 1 % above the gap, with the other experts kept below the
    chosen ones as at the gap, leaves room for its rounding); a thousandth below the gap none
    exists (the bisection's resolution)."""
    reached = selection.witness(info, row, run, gap / 2 * 1.01, cap_epsilon=gap / 2)
    assert reached is not None and np.max(np.abs(reached - row)) <= gap / 2 * 1.01 * (1 + 1e-12)
    assert np.array_equal(picks(router, reached[None])[0], run)
    assert selection.witness(info, row, run, gap / 2 * (1 - 1e-3)) is None


def assert_honest_flips_have_the_smallest_gap(info, router, logits: np.ndarray, rng) -> None:
    """Each row of `logits` moved by a random honest perturbation of at most e: where their router
    picks the same experts the gap is 0, where it flips the gap is at most 2e, and the witness at
    the gap reaches the flipped selection. At least 20 rows must flip."""
    flips = 0
    # Every row's move drawn first (the same draws, in the same order, as row by row), so that their
    # router picks for all rows in one call each: a call per row cost more than the checks.
    movements = []
    for row in logits:
        e = 10 ** rng.uniform(-3, 0)
        movements.append(row + rng.uniform(-e, e, row.shape).astype(np.float32))
    for row, moved, ref, run in zip(logits, movements, picks(router, logits), picks(router, np.stack(movements))):
        gap = selection.selection_gap(info, row, run)
        if set(ref) == set(run):
            assert gap == 0.0
            continue
        flips += 1
        assert gap <= 2 * float(np.max(np.abs(moved.astype(np.float64) - row))) * (1 + 1e-6) + 1e-9
        if gap >= 1e-3:
            assert_the_witness_at_the_gap_reaches_run(info, router, row, run, gap)
    assert flips >= 20


def cases(rng, shape, bias_std: float = 0.05):
    """(RouterInfo, Hugging Face router) of the V3 kind with a random bias, and of the V2 kind."""
    experts, groups, kept, k = shape
    bias = (rng.standard_normal(experts) * bias_std).astype(np.float32)
    yield (RouterInfo(top_k=k, score="sigmoid", bias=tuple(float(b) for b in bias), n_group=groups, topk_group=kept),
           v3_router(experts, groups, kept, k, bias))
    if groups > 1:
        yield (RouterInfo(top_k=k, score="softmax", n_group=groups, topk_group=kept, group_topk=1),
               v2_router(experts, groups, kept, k))
    else:
        yield (RouterInfo(top_k=k, score="sigmoid", bias=tuple(float(b) for b in bias)),
               MiniMaxM2Router(experts, k, bias))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_selection_replays_hugging_faces_routers(shape):
    rng = np.random.default_rng(sum(shape))
    for info, router in cases(rng, shape):
        logits = rng.standard_normal((400, shape[0])).astype(np.float32)
        ids = picks(router, logits)
        assert np.array_equal(selection.select(info, selection.choice_scores(info, logits)), ids)
        assert selection.unexplained_row(info, logits, ids) is None
        # One expert replaced by another that the router did not pick: no longer its selection.
        wrong = ids.copy()
        wrong[7, 0] = next(e for e in range(shape[0]) if e not in ids[7])
        assert selection.unexplained_row(info, logits, wrong) == 7


@pytest.mark.parametrize("shape, bias_std, logit_std", [(shape, 0.05, 1.0) for shape in SHAPES]
                         + [((64, 8, 4, 8), 0.2, 2.5), ((24, 4, 2, 5), 0.3, 3.0)])
def test_an_honest_perturbation_of_at_most_e_has_a_gap_of_at_most_2e(shape, bias_std, logit_std):
    """The gap is the smallest move (exact for these routers), so no honest move is smaller;
    large biases and logits make a kept group's score hang on an expert the run did not choose."""
    rng = np.random.default_rng(100 + sum(shape))
    for info, router in cases(rng, shape, bias_std):
        flips = 0
        # 400 rows drawn as one at a time (the same draws in the same order), picked by their router
        # in one call per side instead of 800 calls.
        rows, movements = [], []
        for _ in range(400):
            logits = (rng.standard_normal((1, shape[0])) * logit_std).astype(np.float32)
            e = 10 ** rng.uniform(-3, 0)
            rows.append(logits[0])
            movements.append((logits + rng.uniform(-e, e, logits.shape).astype(np.float32))[0])
        for row, moved, ref, run in zip(rows, movements, picks(router, np.stack(rows)), picks(router, np.stack(movements))):
            if set(ref) == set(run):
                continue
            flips += 1
            actual = float(np.max(np.abs(moved.astype(np.float64) - row)))
            assert selection.selection_gap(info, row, run) <= 2 * actual * (1 + 1e-6) + 1e-9
        assert flips >= 20  # the check ran on flips, not only on agreeing rows


@pytest.mark.parametrize("shape", SHAPES)
def test_the_witness_at_the_gap_makes_their_router_pick_the_run_s_experts(shape):
    rng = np.random.default_rng(200 + sum(shape))
    experts, k = shape[0], shape[3]
    for info, router in cases(rng, shape):
        checked = 0
        for _ in range(150):
            logits = rng.standard_normal(experts) * rng.uniform(0.3, 1.5)
            # k experts inside `kept` random groups: a set a grouped router can select.
            size = experts // shape[1]
            groups = rng.choice(shape[1], shape[2], replace=False)
            run = np.sort(rng.choice(np.concatenate([np.arange(g * size, (g + 1) * size) for g in groups]), k,
                                     replace=False))
            gap = selection.selection_gap(info, logits, run)
            if not math.isfinite(gap) or gap < 1e-3:
                continue
            checked += 1
            assert_the_witness_at_the_gap_reaches_run(info, router, logits, run, gap)
        assert checked >= 30


def test_a_group_kept_by_an_expert_the_run_did_not_choose():
    """Top-1 in the best of 2 groups of 2, a group scored by its two best: the reference picks
    expert 2; lifting expert 1 (not chosen by the run) by 0.01 lifts group 0 above group 1, and
    Hugging Face's router then picks expert 0. So the gap is at most 0.02 (a review found 4.8
    with moves that only raise the run's experts)."""
    bias = np.array([0.0, 0.0, 0.0, -0.499], np.float32)
    info = RouterInfo(top_k=1, score="sigmoid", bias=tuple(float(b) for b in bias), n_group=2, topk_group=1)
    router = v3_router(4, 2, 1, 1, bias)
    logits = np.array([10.0, 0.0, 10.0, 10.0])
    moved = logits + np.array([0.0, 0.01, 0.0, 0.0])
    assert picks(router, logits[None])[0].tolist() == [2] and picks(router, moved[None])[0].tolist() == [0]
    assert 0 < selection.selection_gap(info, logits, [0]) <= 0.02


@pytest.mark.parametrize("model", ["hy_v3", "step3p7"])
def test_the_other_sigmoid_and_bias_routers_instrument_declares_select_the_same(model):
    """Hunyuan V3's and Step 3.7's routers (hf_routers.SIGMOID_BIAS_ROUTERS besides MiniMax-M2):
    the top-k of sigmoid(logits) + bias over every expert, as their own code picks."""
    experts, k = 12, 3
    rng = np.random.default_rng(9)
    bias = (rng.standard_normal(experts) * 0.1).astype(np.float32)
    if model == "hy_v3":
        from transformers.models.hy_v3.modeling_hy_v3 import HYV3TopKRouter
        router = HYV3TopKRouter(transformers.HYV3Config(hidden_size=experts, num_local_experts=experts,
                                                        num_experts_per_tok=k))
        forward = lambda hidden: router(hidden, torch.from_numpy(bias))  # noqa: E731 - its block passes the bias
    else:
        from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TopKRouter
        router = Step3p7TopKRouter(Step3p7TextConfig(hidden_size=experts, n_routed_experts=experts,
                                                     num_experts_per_tok=k))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        forward = router
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
        logits = rng.standard_normal((300, experts)).astype(np.float32)
        ids = np.sort(forward(torch.from_numpy(logits))[2].numpy(), axis=-1)
    info = RouterInfo(top_k=k, score="sigmoid", bias=tuple(float(b) for b in bias))
    assert np.array_equal(selection.select(info, selection.choice_scores(info, logits)), ids)
    assert not np.array_equal(np.sort(np.argsort(-logits, axis=1)[:, :k], axis=1), ids)  # the bias matters


class SoftmaxBiasRouter(torch.nn.Module):
    """transformers' Ernie 4.5 or LongCat-Flash router (the top-k of softmax(logits) + bias), with
    the identity as its weight, returning (logits, weights, ids) as theirs do."""

    def __init__(self, model: str, experts: int, k: int, bias: np.ndarray):
        super().__init__()
        if model == "ernie4_5_moe":
            from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
            self.router = Ernie4_5_MoeTopKRouter(transformers.Ernie4_5_MoeConfig(
                hidden_size=experts, num_experts=experts, num_experts_per_tok=k))
            held, weight = self.router.moe_statics.e_score_correction_bias, self.router.weight
        else:
            from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashTopkRouter
            self.router = LongcatFlashTopkRouter(transformers.LongcatFlashConfig(
                hidden_size=experts, n_routed_experts=experts, zero_expert_num=0, moe_topk=k))
            held, weight = self.router.e_score_correction_bias, self.router.classifier.weight
        with torch.no_grad():
            weight.copy_(torch.eye(experts))
            held.copy_(torch.from_numpy(bias).reshape(held.shape))

    def forward(self, hidden):
        return self.router(hidden)


SOFTMAX_BIAS = [("ernie4_5_moe", 8, 2, 0.05), ("longcat_flash", 13, 3, 0.08), ("ernie4_5_moe", 64, 6, 0.01)]


@pytest.mark.parametrize("model, experts, k, bias_std", SOFTMAX_BIAS)
def test_softmax_plus_bias_routers_replay_and_their_gap_is_the_smallest_move(model, experts, k, bias_std):
    """Ernie 4.5's and LongCat-Flash's routers, which add the bias to softmax scores: the
    selection replays theirs; an honest move of at most e that flips them has a gap of at most 2e;
    the witness just above the gap makes their router pick the run's experts, and a thousandth
    below it none exists (compare/softmax_bias.py)."""
    rng = np.random.default_rng(300 + experts)
    bias = (rng.standard_normal(experts) * bias_std).astype(np.float32)
    router = SoftmaxBiasRouter(model, experts, k, bias)
    info = RouterInfo(top_k=k, score="softmax", bias=tuple(float(b) for b in bias))
    assert selection.judgeable(info) is None
    logits = (rng.standard_normal((300, experts)) * rng.uniform(0.3, 3.0, (300, 1))).astype(np.float32)
    ids = picks(router, logits)
    assert np.array_equal(selection.select(info, selection.choice_scores(info, logits)), ids)
    assert selection.unexplained_row(info, logits, ids) is None
    assert not np.array_equal(np.sort(np.argsort(-logits, axis=1)[:, :k], axis=1), ids)  # the bias matters
    assert_honest_flips_have_the_smallest_gap(info, router, logits, rng)


def test_deepseek_v4_s_sqrt_softplus_router_replays_and_its_gap_is_the_smallest_move():
    """DeepSeek-V4's router: the top-k of sqrt(softplus(logits)) + bias, against its transformers
    code; the per-score rule (each score moves with its own logit) with that score and its inverse."""
    experts, k = 11, 3
    rng = np.random.default_rng(41)
    bias = (rng.standard_normal(experts) * 0.05).astype(np.float32)
    router = v4_router(experts, k, bias)
    info = RouterInfo(top_k=k, score="sqrtsoftplus", bias=tuple(float(b) for b in bias))
    logits = (rng.standard_normal((300, experts)) * rng.uniform(0.3, 3.0, (300, 1))).astype(np.float32)
    ids = picks(router, logits)
    assert np.array_equal(selection.select(info, selection.choice_scores(info, logits)), ids)
    assert not np.array_equal(np.sort(np.argsort(-logits, axis=1)[:, :k], axis=1), ids)  # the bias matters
    assert_honest_flips_have_the_smallest_gap(info, router, logits, rng)


def test_deepseek_v4_s_bf16_score_rounding_stays_within_its_epsilon():
    """DeepSeek-V4 computes sqrt(softplus(logits)) + bias in the logits' dtype. With the small
    logits of a router at transformers' default init its scores sit near 0.83, where a bf16
    rounding moves the selection as a logit move several times the logits' own bf16 spacing:
    transformers' router in bf16 against the same (bf16-exact) logits in float32 flips rows whose
    gap exceeds the logit-ulps epsilon, and every such flip is within the epsilon its `rounded`
    declaration adds (none without it)."""
    experts, k = 8, 2
    rng = np.random.default_rng(43)
    bias = (rng.standard_normal(experts) * 0.02).astype(np.float32)
    router = v4_router(experts, k, bias)
    info = RouterInfo(top_k=k, score="sqrtsoftplus", bias=tuple(float(b) for b in bias), rounded=True)
    plain_info = RouterInfo(top_k=k, score="sqrtsoftplus", bias=info.bias)
    logits = torch.from_numpy(rng.standard_normal((3000, experts)).astype(np.float32) * 0.3).bfloat16().float()
    exact = picks(router, logits.numpy())
    with torch.no_grad():
        rounded = np.sort(router.bfloat16()(logits.bfloat16())[2].numpy(), axis=-1)
    assert_flips_within_rounding(info, plain_info, logits, exact, rounded, beyond=5)


def assert_flips_within_rounding(info, plain_info, logits, exact, rounded, beyond: int) -> None:
    """Every row where the rounded selection `rounded` differs from the exact one `exact` has a gap
    within the epsilon `info`'s `rounded` declaration allows (none without it, `plain_info`); at
    least 20 rows flip, and at least `beyond` of them past the logits' own ulps epsilon."""
    from compiledump.compare.routing import routing_epsilon
    flipped = [row for row in range(len(logits)) if set(exact[row]) != set(rounded[row])]
    beyond_logit_rule = 0
    for row in flipped:
        x = logits[row].double().numpy()
        gap = selection.selection_gap(info, x, rounded[row])
        allowed = selection.score_rounding_epsilon(info, x, exact[row], rounded[row], 4.0)
        assert selection.score_rounding_epsilon(plain_info, x, exact[row], rounded[row], 4.0) is None
        assert gap <= allowed, (row, gap, allowed)
        beyond_logit_rule += gap > routing_epsilon(x, None, 4.0)
    assert len(flipped) >= 20 and beyond_logit_rule >= beyond, (len(flipped), beyond_logit_rule)


def test_dbrx_s_bf16_softmax_rounding_stays_within_its_epsilon():
    """DBRX's MoE block picks the top-k of softmax(logits) computed in the logits' dtype
    (transformers' `DbrxFFN.route_tokens_to_experts`). In bf16, probabilities about 0.14 apart by less
    than a spacing (2^-10) round to one value and the pick goes by expert order, so rows flip whose
    logit gap is several logit spacings: torch's own bf16 softmax and top-k, against the float32
    top-k of the same (bf16-exact) logits, flips rows beyond the logit-ulps epsilon, and every flip
    is within the epsilon its `rounded` declaration adds (none without it)."""
    import torch

    experts, k = 8, 2
    info = RouterInfo(top_k=k, score="softmax", rounded=True)
    logits = torch.from_numpy(np.random.default_rng(47).standard_normal((3000, experts)).astype(np.float32) * 0.05)
    logits = logits.bfloat16()
    exact = np.sort(torch.topk(logits.float(), k, dim=-1).indices.numpy(), axis=-1)
    probabilities = torch.nn.functional.softmax(logits, dim=1, dtype=logits.dtype)
    rounded = np.sort(torch.topk(probabilities, k, dim=-1).indices.numpy(), axis=-1)
    assert_flips_within_rounding(info, RouterInfo(top_k=k, score="softmax"), logits, exact, rounded, beyond=10)


def test_the_softmax_rounding_epsilon_is_the_logit_gap_that_parts_two_probabilities_by_tau():
    """For a softmax, the allowance is the logit gap at which the two swapped probabilities lie tau
    apart: found here by bisection on the softmax itself (both logits moved apart from their mean)."""
    info = RouterInfo(top_k=2, score="softmax", rounded=True)
    logits = np.array([0.31, 0.2, 0.2004, -0.4, 0.05])
    got = selection.score_rounding_epsilon(info, logits, [0, 1], [0, 2], 4.0)
    p = np.exp(logits) / np.exp(logits).sum()
    tau = 4.0 * 2.0 ** -10  # the swapped probabilities lie in [0.125, 0.25)
    assert 0.125 <= p[1] < 0.25 and 0.125 <= p[2] < 0.25

    def spread(gap):
        x = logits.copy()
        mid = (x[1] + x[2]) / 2
        x[1], x[2] = mid + gap / 2, mid - gap / 2
        q = np.exp(x) / np.exp(x).sum()
        return q[1] - q[2]

    low, high = 0.0, 1.0
    for _ in range(60):
        low, high = ((low + high) / 2, high) if spread((low + high) / 2) < tau else (low, (low + high) / 2)
    assert got == pytest.approx(low, rel=0.02)
