"""A prompt partly served from a prefix cache (vLLM's automatic prefix caching, SGLang's radix
cache) against the same prompt run whole.

The cached side ran the prompt's first positions before (here: a warm-up of them inside
`profiling()`, as an earlier request leaves them in an engine's cache), so its prefill forward
holds only the prompt's last positions and its token gate learns that many. Before, its prompt
keys were "not comparable" with "fix: compare runs of the same prompt", which the user had done.
Now the other side is seen on the same last positions and compared, with a note. A Hugging Face
model built from config (random weights, eager), teacher-forced decode steps on both sides; the
raw arrays are checked with numpy against what the comparator says.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache, StaticCache

import compiledump
from compiledump import config as cd_config
from helpers.cli import compare_json
from helpers.hf_example import ex

STEPS = 3


@pytest.fixture(scope="module")
def model():
    return ex.build_model("qwen3_moe")


def _run(model, directory, prompt, decode, cached=0, dtype=torch.float32, others=None, fed=True) -> str:
    """One side: the prompt's first `cached` positions inside profiling() (what a prefix cache holds
    from an earlier request), then the rest, then a forward per `decode` token. `others`: more rows
    of a padded batch (a StaticCache, as an engine has); `fed=False`: no input_token keys."""
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    model = copy.deepcopy(model).to(dtype)
    handle = compiledump.instrument(model, exclude=() if fed else ("input_token",))
    length = prompt.shape[1]
    if others is None:
        cache, rows = DynamicCache(config=model.config), lambda ids, start, end: ids
    else:
        cache = StaticCache(config=model.config, max_cache_len=length + len(decode) + 1)
        rows = lambda ids, start, end: torch.cat([ids, others[:, start:end]])  # noqa: E731

    def forward(ids, start):
        end = start + ids.shape[1]
        extra = {} if others is None else {"cache_position": torch.arange(start, end)}
        model(input_ids=rows(ids, start, end), **ex.cache_kwargs(model, cache), **extra)

    with torch.no_grad():
        if cached:
            with compiledump.profiling():
                forward(prompt[:, :cached], 0)
        forward(prompt[:, cached:], cached)
        for n, token in enumerate(decode):
            forward(token.view(1, 1), length + n)
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return compiledump.flush()


def _tokens(length: int, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 500, (1, length), generator=g), torch.randint(1, 500, (STEPS,), generator=g)


def _note(lines: list[str], side: str) -> str:
    (note,) = [line for line in lines if line.startswith(f"note: {side}: its prompt keys are compared on the last")]
    return note


@pytest.mark.parametrize("length, cached", [(20, 16), (11, 7), (9, 1)])
def test_a_prompt_served_partly_from_a_prefix_cache_is_compared_on_its_last_positions(tmp_path, capsys, model,
                                                                                     length, cached):
    prompt, decode = _tokens(length)
    ref = _run(model, tmp_path / "ref", prompt, decode)
    run = _run(model, tmp_path / "run", prompt, decode, cached)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 0, lines
    tail = length - cached
    note = _note(lines, "REF")
    assert f"compared on the last {tail} tokens of its prompt of {length}: RUN's prompt keys hold a call of {tail} " \
           f"tokens ending where this side's does (both fed token {int(prompt[0, -1])} at step 0), its first " \
           f"{cached} positions served from a prefix cache" in note, note
    assert "(vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache)" in note
    statuses = {record["key"]: record["status"] for record in report["keys"]}
    assert "not_comparable" not in statuses.values() and not report["problems"], (statuses, report["problems"])
    # The router logits of every prompt row: REF's last rows are RUN's rows, by numpy on the raw dumps.
    with np.load(ref) as whole, np.load(run) as part:
        assert whole["layer0_router"].shape == (length, 8) and part["layer0_router"].shape == (tail, 8)
        np.testing.assert_allclose(part["layer0_router"], whole["layer0_router"][-tail:], rtol=1e-5, atol=1e-6)
        assert not np.allclose(part["layer0_router"], whole["layer0_router"][:tail], rtol=1e-2)
    assert statuses["layer0_router"] == statuses["layer1_topk"] == statuses["layer1"] == "ok"


def test_a_bug_after_the_cached_prefix_is_named_at_its_layer(tmp_path, capsys, model):
    prompt, decode = _tokens(20)
    ref = _run(model, tmp_path / "ref", prompt, decode)
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[1].post_attention_layernorm.weight.mul_(1.01)
    run = _run(broken, tmp_path / "run", prompt, decode, 16)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 1, lines
    assert report["first_divergence"]["layer"] == 1 and report["first_divergence"]["key"] == "layer1_router", \
        report["first_divergence"]
    _note(lines, "REF")


def test_the_reference_served_from_the_cache_is_told_on_the_other_side(tmp_path, capsys, model):
    prompt, decode = _tokens(20)
    ref = _run(model, tmp_path / "ref", prompt, decode, 16)
    run = _run(model, tmp_path / "run", prompt, decode)
    code, lines, _ = compare_json(capsys, ref, run)
    assert code == 0, lines
    assert "REF's prompt keys hold a call of 4 tokens" in _note(lines, "RUN") and "run REF without it" in _note(lines, "RUN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_engine_batch_with_a_static_cache(tmp_path, capsys, model, dtype):
    """The request is row 0 of a padded batch of 3 with a StaticCache, as an engine runs it, in
    float32 and bfloat16 (against the float32 reference run whole)."""
    prompt, decode = _tokens(13)
    others = torch.randint(1, 500, (2, 13 + STEPS), generator=torch.Generator().manual_seed(9))
    ref = _run(model, tmp_path / "ref", prompt, decode)
    run = _run(model, tmp_path / "run", prompt, decode, 8, dtype=dtype, others=others)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 0, lines
    assert "compared on the last 5 tokens of its prompt of 13" in _note(lines, "REF")
    assert sum(record["status"] in ("ok", "near_tie") for record in report["keys"]) >= 40


def test_one_token_left_to_run_says_later_steps_may_overwrite_it(tmp_path, capsys, model):
    """The whole prompt cached but its last token (vLLM runs at least one): a call of one token,
    which each decode step of a batch of one makes too, so the gate keeps their writes as well and
    the prompt keys are refused as written again; the note says why and how to turn the cache off."""
    prompt, decode = _tokens(16)
    ref = _run(model, tmp_path / "ref", prompt, decode)
    run = _run(model, tmp_path / "run", prompt, decode, 15)
    code, lines, _ = compare_json(capsys, ref, run)
    assert code == 3, lines
    assert "one token is also what each decode step of a batch of one runs, so later steps may overwrite those " \
           "keys; to compare every position, run RUN without it" in _note(lines, "REF")
    assert any(line.startswith("not comparable:") and "prompt keys were written again" in line for line in lines)


@pytest.mark.parametrize("case", ["another_prompt", "no_fed_tokens"])
def test_nothing_is_assumed_without_step_0_lining_up(tmp_path, capsys, model, case):
    """A shorter, different prompt (its last token another), or a side without the fed tokens that
    tell where its prompt call ended: left as recorded, 'compare runs of the same prompt'."""
    prompt, decode = _tokens(20)
    ref = _run(model, tmp_path / "ref", prompt, decode)
    if case == "another_prompt":
        other, _ = _tokens(4, seed=5)
        assert other[0, -1] != prompt[0, -1]
        run = _run(model, tmp_path / "run", other, decode)
    else:
        run = _run(model, tmp_path / "run", prompt, decode, 16, fed=False)
    code, lines, _ = compare_json(capsys, ref, run)
    assert code in (1, 3), lines
    assert not any("prefix cache" in line for line in lines), lines
    assert any("fix: compare runs of the same prompt (REF's has 20 tokens, RUN's 4 tokens)" in line for line in lines)
