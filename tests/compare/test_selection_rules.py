"""A declared router's selection rules without a model: closed-form and infinite gaps, and the declarations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from compiledump.compare import selection
from compiledump.format.routers import RouterInfo, declared_router, router_from_json


def test_a_router_that_routes_by_token_id_makes_every_difference_far_from_a_tie():
    """DeepSeek-V4's hash routers take their experts from the token id: its logits explain nothing
    (no REF row is 'unexplained') and no rounding moves them (any differing row is far)."""
    info = RouterInfo(top_k=2, score="token")
    logits = np.array([0.3, 0.2, 0.1, 0.0])
    gap, reason = selection.row_gap(logits, np.array([2, 3]), np.array([2, 1]), info)
    assert gap == math.inf and "token id" in reason
    assert selection.first_unexplained({0: logits}, np.array([[2, 3]]), info) is None
    assert selection.first_unexplained({0: logits}, np.array([[2, 3]]), None) == 0  # not the top-k of its logits
    with pytest.raises(ValueError, match="no bias and no groups"):
        RouterInfo(top_k=2, score="token", bias=(0.0, 0.0, 0.0, 0.0))


def test_a_softmax_router_with_a_bias_in_groups_is_not_judged_by_logit_moves():
    info = RouterInfo(top_k=2, score="softmax", bias=(0.1, 0.0, -0.1, 0.0), n_group=2, topk_group=1)
    assert "softmax router with a bias" in selection.judgeable(info)
    gap, reason = selection.row_gap(np.array([1.0, 0.9, 0.2, 0.1]), np.array([0, 1]), np.array([0, 2]), info)
    assert gap is None and "softmax router with a bias" in reason


def test_for_a_plain_top_k_the_gap_is_the_plain_rule_s():
    """One group, no bias: the bisection's gap equals max(displaced) - min(instead) of the logits,
    what compare/routing.py has always used."""
    rng = np.random.default_rng(5)
    for score in ("softmax", "sigmoid"):
        info = RouterInfo(top_k=3, score=score)
        for _ in range(200):
            logits = rng.standard_normal(11) * rng.uniform(0.1, 4)
            ref = np.argsort(-logits, kind="stable")[:3]
            run = rng.choice(11, 3, replace=False)
            displaced = [i for i in ref if i not in run]
            instead = [i for i in run if i not in ref]
            expected = max(logits[displaced]) - min(logits[instead]) if displaced else 0.0
            assert selection.selection_gap(info, logits, run) == pytest.approx(max(expected, 0.0), rel=1e-7,
                                                                                 abs=1e-9)


def test_a_selection_out_of_reach_has_an_infinite_gap():
    """A bias far larger than any sigmoid score keeps an expert chosen whatever the logits do."""
    info = RouterInfo(top_k=1, score="sigmoid", bias=(5.0, 0.0, 0.0, 0.0))
    assert selection.selection_gap(info, np.array([-3.0, 2.0, 1.0, 0.0]), [1]) == math.inf
    assert selection.selection_gap(info, np.array([-3.0, 2.0, 1.0, 0.0]), [0]) == 0.0
    assert selection.selection_gap(info, np.zeros(4), [0, 1]) == math.inf  # two ids for a top-1


@pytest.mark.parametrize("bad, message", [
    (dict(top_k=0), "top_k must be a positive int"),
    (dict(top_k=2, score="relu"), "score must be one of"),
    (dict(top_k=2, n_group=2, topk_group=3), "topk_group (3) is more than n_group (2)"),
    (dict(top_k=2, bias=(0.1, float("nan"))), "finite floats"),
    (dict(top_k=2, bias=(0.1, 0.2, 0.3), n_group=2), "do not form 2 equal groups"),
    (dict(top_k=2, rounded=1), "rounded must be a bool"),
])
def test_a_declaration_that_cannot_describe_a_router_is_refused(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RouterInfo(**bad)


def test_manifest_entries_round_trip_and_malformed_ones_read_as_none():
    info = RouterInfo(top_k=4, score="sigmoid", bias=(0.25, -0.5, 0.0, 1.0, 0.5, 0.125), n_group=3, topk_group=2)
    assert router_from_json(info.to_json()) == info and "rounded" not in info.to_json()  # manifests as before
    rounded = RouterInfo(top_k=2, score="sqrtsoftplus", bias=(0.5, 0.25, 0.0), rounded=True)
    assert router_from_json(rounded.to_json()) == rounded and rounded.to_json()["rounded"] is True
    routers = {"layer3_router": info.to_json(), "layer4_router": {"top_k": "two"}}
    assert declared_router(routers, "layer3_router") == info
    assert declared_router(routers, "layer3_step_router") == info  # a decode step follows its layer's
    assert declared_router(routers, "layer4_router") is None
    assert declared_router(routers, "layer5_router") is None and declared_router(None, "layer3_router") is None
    assert info.fits(6) is None and "bias holds 6 experts" in info.fits(8)
    assert "does not fit in 2 groups of 1" in RouterInfo(top_k=3, n_group=3, topk_group=2).fits(3)


def test_the_score_rounding_epsilon_is_bounded_by_the_flattest_swapped_pair():
    """Two experts whose scores are tau apart swap when each logit moves tau / (slope_a +
    slope_b): the allowance is twice that for the flattest pair, written out here with
    sqrt(softplus) and its slope sigma(x) / (2 sqrt(softplus(x))); an expert far down the scores
    (logit -6, slope 0.025) does not make it the tau / 0.025 of that expert alone."""
    def score(x):
        return math.sqrt(math.log1p(math.exp(x)))

    def slope(x):
        return 1.0 / (1.0 + math.exp(-x)) / (2.0 * score(x))

    info = RouterInfo(top_k=2, score="sqrtsoftplus", bias=(0.01, -0.02, 0.0, 0.03), rounded=True)
    logits = np.array([0.4, 0.3, 0.25, -6.0])
    got = selection.score_rounding_epsilon(info, logits, [0, 1], [0, 3], 4.0)
    tau = 4.0 * 2.0 ** -8  # the largest swapped score, 0.9 + bias, lies in [0.5, 1)
    assert got == pytest.approx(2.0 * tau / (slope(0.3) + slope(-6.0)), rel=1e-12)
    assert got < tau / slope(-6.0) / 1.5
    assert selection.selection_gap(info, logits, np.array([0, 3])) > got  # far from a rounding
    assert selection.score_rounding_epsilon(info, logits, [0, 1], [1, 0], 4.0) is None  # a reorder
