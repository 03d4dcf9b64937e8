"""A prompt partly served from a prefix cache (vLLM's automatic prefix caching, SGLang's radix
cache) against the same prompt run whole.

The cached side ran the prompt's first positions before (here: a warm-up of them inside
`profiling()`, as an earlier request leaves them in an engine's cache), so its prefill forward
holds only the prompt's last positions and its token gate learns that many: its prompt keys stay
not comparable (nothing in a dump tells that apart from another prompt that ends on the same
token), and one note says what the pair is consistent with and how to compare them. A Hugging
Face model built from config (random weights, eager), teacher-forced decode steps on both sides.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, StaticCache

import compiledump
from helpers.chunked_runs import run_in_chunks
from helpers.cli import compare_json
from helpers.hf_dump import dump_run
from helpers.hf_example import ex

STEPS = 3


@pytest.fixture(scope="module")
def model():
    return ex.build_model("qwen3_moe")


def _run(model, directory, prompt, decode, cached=0, dtype=torch.float32, others=None, fed="ids") -> str:
    """One side: the prompt's first `cached` positions inside profiling() (what a prefix cache holds
    from an earlier request), then the rest, then a forward per `decode` token. `others`: more rows
    of a padded batch (a StaticCache, as an engine has). No input_token keys with `fed="excluded"`
    (instrument's exclude) or `fed="embeds"` (the model called with its embeddings, which
    instrument records no fed token of, as it records none of an engine's flat ids)."""
    model = copy.deepcopy(model).to(dtype)
    length = prompt.shape[1]
    if others is None:
        cache, rows = DynamicCache(config=model.config), lambda ids, start, end: ids
    else:
        cache = StaticCache(config=model.config, max_cache_len=length + len(decode) + 1)
        rows = lambda ids, start, end: torch.cat([ids, others[:, start:end]])  # noqa: E731

    def forward(ids, start):
        end = start + ids.shape[1]
        extra = {} if others is None else {"cache_position": torch.arange(start, end)}
        ids = rows(ids, start, end)
        given = {"inputs_embeds": F.embedding(ids, model.get_input_embeddings().weight)} if fed == "embeds" \
            else {"input_ids": ids}  # (F.embedding: the embedding module's hook does not fire)
        model(**given, **ex.cache_kwargs(model, cache), **extra)

    def run():
        if cached:
            with compiledump.profiling():
                forward(prompt[:, :cached], 0)
        forward(prompt[:, cached:], cached)
        for n, token in enumerate(decode):
            forward(token.view(1, 1), length + n)

    return dump_run(model, directory, run, exclude=("input_token",) if fed == "excluded" else ())


def _tokens(length: int, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 500, (1, length), generator=g), torch.randint(1, 500, (STEPS,), generator=g)


def _note(lines: list[str], side: str) -> str:
    (note,) = [line for line in lines if line.startswith(f"note: {side}: its prompt keys hold a call of")]
    return note


@pytest.mark.parametrize("length, cached", [(20, 16), (11, 7), (9, 1), (16, 15)])
def test_a_prompt_served_partly_from_a_prefix_cache_is_noted_with_how_to_compare_it(tmp_path, capsys, model,
                                                                                    length, cached):
    prompt, decode = _tokens(length)
    ref = _run(model, tmp_path / "ref", prompt, decode)
    run = _run(model, tmp_path / "run", prompt, decode, cached)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3, lines  # the prompt keys: not comparable, never a divergence
    tail = length - cached
    tokens = "1 token" if tail == 1 else f"{tail} tokens"
    positions = "its first position" if cached == 1 else f"its first {cached} positions"
    # vLLM's prefix cache holds whole blocks of 16 tokens: only SGLang's radix cache serves 7, 1 or 15
    caches = "vLLM's automatic prefix caching or SGLang's radix cache" if cached == 16 else \
        "SGLang's radix cache; vLLM's caches whole blocks, of 16 tokens by default"
    assert _note(lines, "RUN") == (
        f"note: RUN: its prompt keys hold a call of {tokens} that ends on the token REF's prompt of {length} ends on "
        f"(both fed token {int(prompt[0, -1])} at step 0): either another prompt, or the same one with {positions} "
        f"served from a prefix cache after a warm-up or an earlier request with the same prompt ({caches}); to "
        f"compare its prompt keys, run RUN with the cache off (vLLM --no-enable-prefix-caching, SGLang "
        f"--disable-radix-cache)")
    statuses = {record["key"]: record["status"] for record in report["keys"]}
    # every decode step after the prefill compares (the same context on both sides)
    assert statuses["logits_1"] == statuses["layer1_step_1"] == statuses["layer3_step_3"] == "ok", statuses
    assert statuses["layer0_router"] == "not_comparable" and report["first_divergence"] is None


def test_the_reference_served_from_the_cache_is_told_on_its_side(tmp_path, capsys, model):
    prompt, decode = _tokens(20)
    ref = _run(model, tmp_path / "ref", prompt, decode, 16)
    run = _run(model, tmp_path / "run", prompt, decode)
    code, lines, _ = compare_json(capsys, ref, run)
    assert code == 3, lines
    note = _note(lines, "REF")
    assert "ends on the token RUN's prompt of 20 ends on" in note and "run REF with the cache off" in note


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_engine_batch_with_a_static_cache(tmp_path, capsys, model, dtype):
    """The request is row 0 of a padded batch of 3 with a StaticCache, as an engine runs it, in
    float32 and bfloat16 (against the float32 reference run whole): the note, and the decode steps
    compared at their thresholds."""
    prompt, decode = _tokens(13)
    others = torch.randint(1, 500, (2, 13 + STEPS), generator=torch.Generator().manual_seed(9))
    ref = _run(model, tmp_path / "ref", prompt, decode)
    run = _run(model, tmp_path / "run", prompt, decode, 8, dtype=dtype, others=others)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3 and report["first_divergence"] is None, lines
    assert "a call of 5 tokens that ends on the token REF's prompt of 13 ends on" in _note(lines, "RUN")
    steps = [record for record in report["keys"] if record.get("step") and record["status"] != "shown"]
    assert len(steps) >= 20 and {record["status"] for record in steps} <= {"ok", "near_tie"}, steps


def test_another_prompt_that_ends_alike_is_not_compared_either(tmp_path, capsys, model):
    """Another prompt ending on the same token (chat templates end most prompts alike): the same
    note, which names both readings, and its prompt keys are not compared (comparing them on the
    last positions would report a divergence at layer 0 that is none)."""
    prompt, decode = _tokens(20)
    other, _ = _tokens(6, seed=5)
    other[0, -1] = prompt[0, -1]
    ref = _run(model, tmp_path / "ref", prompt, decode)
    run = _run(model, tmp_path / "run", other, decode)
    code, lines, report = compare_json(capsys, ref, run)
    assert "either another prompt, or the same one with its first 14 positions served" in _note(lines, "RUN")
    first = report["first_divergence"]
    assert first is None or first["step"] is not None, first  # the prompt keys are never the divergence
    assert code in (1, 3) and {report_key["status"] for report_key in report["keys"]
                               if report_key["key"] in ("layer0_attn", "layer0_router", "layer1")} == {"not_comparable"}


def test_a_cached_tail_that_feeds_the_prompt_s_last_token_again_after_a_flip_is_not_a_chunk(tmp_path, capsys,
                                                                                          model):
    """RUN's prompt call is the cached prompt's tail; at step 1 it feeds another token (a flip), then
    the prompt's last token and REF's step-1 token: its steps 2 and 3 read like REF's 0 and 1, but
    its logits_0 is REF's, so it is not a chunked prompt (the note, and fed tokens differing from step 1)."""
    prompt, decode = _tokens(20)
    ref = _run(model, tmp_path / "ref", prompt, decode[:1])
    flipped = torch.tensor([int(decode[0]) % 499 + 1, int(prompt[0, -1]), int(decode[0])])
    run = _run(model, tmp_path / "run", prompt, flipped, 16)
    code, lines, report = compare_json(capsys, ref, run)
    assert not any("chunked prefill" in line for line in lines), lines
    _note(lines, "RUN")
    assert report["pairs"][0]["fed_tokens_differ"]["step"] == 1, report["pairs"][0]["fed_tokens_differ"]


@pytest.mark.parametrize("case", ["another_prompt", "chunked_ending_alike"])
def test_no_note_where_step_0_or_1_does_not_line_up(tmp_path, capsys, model, case):
    """A shorter prompt ending on another token, and a prompt in two chunks whose first ends on the
    prompt's last token (its step 1 feeds that token again): no note."""
    prompt, decode = _tokens(20)
    ref = _run(model, tmp_path / "ref", prompt, decode)
    if case == "another_prompt":
        other, _ = _tokens(4, seed=5)
        assert other[0, -1] != prompt[0, -1]
        run = _run(model, tmp_path / "run", other, decode)
    else:
        prompt[0, 11] = prompt[0, -1]
        ref = _run(model, tmp_path / "ref2", prompt, decode)
        run = run_in_chunks(model, tmp_path / "run", prompt, decode, (12, prompt.shape[1] - 12))
    code, lines, _ = compare_json(capsys, ref, run)
    assert code in (1, 3), lines
    assert not any("prefix cache" in line for line in lines), lines
    if case == "chunked_ending_alike":  # told as what it is (tests/compare/test_chunked_prefill.py)
        assert code == 3 and any("it ran the prompt in 2 forwards (chunked prefill)" in line for line in lines)


def _readings(lines: list[str]) -> str:
    (note,) = [line for line in lines if line.startswith("note: the prompt calls differ in length")]
    return note


CACHE_OFF = "vLLM --no-enable-prefix-caching, SGLang --disable-radix-cache"


WHY = {"excluded": "{side}'s instrument(exclude=...) left it out ('input_token')",
       "embeds": "{side} recorded none (`instrument` records it only of [batch, seq] input ids, not of an engine's "
                 "flat ids or of embeddings)"}


@pytest.mark.parametrize("fed", ["excluded", "embeds"])
@pytest.mark.parametrize("side", ["RUN", "REF"])
def test_without_fed_tokens_the_note_names_what_the_same_prompt_would_mean(tmp_path, capsys, model, side, fed):
    """A side with no fed tokens (left out by `exclude`, or a model called with its embeddings, as
    an engine's flat ids record none): nothing tells another prompt from the same one, so the note
    says what the shorter call would be if the prompts were the same (a prefix cache's tail; 20 is
    no CUDA-graph size a prefill of 4 is padded to, and the logits are there to tell a chunk), and
    why the fed token is missing."""
    prompt, decode = _tokens(20)
    whole = _run(model, tmp_path / "whole", prompt, decode)
    cached = _run(model, tmp_path / "cached", prompt, decode, 16, fed=fed)
    ref, run = (whole, cached) if side == "RUN" else (cached, whole)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3 and report["first_divergence"] is None, lines
    lengths = "REF's 20 tokens, RUN's 4" if side == "RUN" else "REF's 4 tokens, RUN's 20"
    assert _readings(lines) == (
        f"note: the prompt calls differ in length ({lengths}) and no fed tokens tell whether the two sides ran the "
        f"same prompt (input_token_0: {WHY[fed].format(side=side)}); if they did, {side}'s call of 4 tokens is "
        f"the part of it a prefix cache left to run (its first 16 positions served from vLLM's automatic prefix "
        f"caching or SGLang's radix cache): run {side} with the cache off, {CACHE_OFF}")
    assert not any(line.startswith(f"note: {side}: its prompt keys") for line in lines), lines


def _padded_prefill(model, directory, prompt, decode, rows) -> str:
    """An engine side as vLLM runs a short prompt under CUDA graphs: its prefill forward padded at
    the end to `rows` tokens (the padding's positions write no KV: here the real prompt fills the
    cache inside profiling()), flat-id style (no fed tokens), its logits read at the real last
    token (vLLM's logits indices) and recorded by hand; no step routing (vLLM's gates return their
    logits alone; its flat rows would give the prefill's first token, not its last)."""
    cache = DynamicCache(config=model.config)
    padded = torch.cat([prompt, torch.zeros((1, rows - prompt.shape[1]), dtype=prompt.dtype)], dim=1)

    def run():
        with compiledump.profiling():
            model(input_ids=prompt, **ex.cache_kwargs(model, cache))
        out = model(input_ids=padded, use_cache=False)
        compiledump.record_step("logits", out.logits[0, prompt.shape[1] - 1])
        for token in decode:
            out = model(input_ids=token.view(1, 1), **ex.cache_kwargs(model, cache))
            compiledump.record_step("logits", out.logits[0, -1])

    return dump_run(model, directory, run, exclude=("input_token", "logits"), step_routing=False)


@pytest.mark.parametrize("length, rows, engines", [
    (7, 8, "vLLM and SGLang"), (13, 16, "vLLM and SGLang"), (3, 4, "vLLM and SGLang"),
    (10, 12, "SGLang"), (9, 16, "vLLM"), (20, 24, "vLLM"),  # vLLM pads 10 to 16, SGLang 9 to 12 and 20 not at all
    (8, 16, None), (3, 8, None), (9, 24, None), (5, 7, None), (16, 40, None)])  # no default pads these
@pytest.mark.parametrize("padded_side", ["RUN", "REF"])
def test_a_prefill_padded_to_a_cuda_graph_size_is_one_reading(tmp_path, capsys, model, length, rows, engines,
                                                             padded_side):
    """The engine's prefill padded at the end to `rows`: where `rows` is the size vLLM's capture
    sizes or SGLang's token buckets pad `length` to by default, the note names that reading first,
    with a prompt of that size as the fix; elsewhere only the prefix-cache reading (of the other
    side). The decode steps compare (the same context on both sides) and nothing diverges."""
    prompt, decode = _tokens(length)
    whole = _run(model, tmp_path / "whole", prompt, decode)
    padded = _padded_prefill(model, tmp_path / "padded", prompt, decode, rows)
    ref, run = (whole, padded) if padded_side == "RUN" else (padded, whole)
    other = "REF" if padded_side == "RUN" else "RUN"
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3 and report["first_divergence"] is None, lines
    note = _readings(lines)
    pad = "pad" if engines and " and " in engines else "pads"
    reading = (f"{padded_side}'s call of {rows} tokens is its prefill padded to a CUDA-graph size ({engines} {pad} a "
               f"prefill of {length} tokens to {rows} by default: rerun both sides with a prompt of {rows} tokens, "
               f"and COMPILEDUMP_TOKENS={rows} where it is set)")
    assert (reading in note) == (engines is not None), note
    cached = rows - length
    positions = "its first position" if cached == 1 else f"its first {cached} positions"
    caches = "vLLM's automatic prefix caching or SGLang's radix cache" if cached % 16 == 0 else \
        "SGLang's radix cache; vLLM's caches whole blocks, of 16 tokens by default"
    assert note.endswith(f"{other}'s call of {length} tokens is the part of it a prefix cache left to run ({positions} "
                         f"served from {caches}): run {other} with the cache off, {CACHE_OFF}"), note
    assert f"(input_token_0: {padded_side}'s instrument(exclude=...) left it out ('input_token'))" in note
    assert "chunked" not in note  # both sides have logits to tell a chunk by
    statuses = {record["key"]: record["status"] for record in report["keys"]}
    assert statuses["logits_0"] == statuses["logits_3"] == statuses["layer2_step_3"] == "ok", statuses
    assert statuses["layer0_attn"] == statuses["layer3"] == "not_comparable", statuses


def test_the_padded_reading_is_not_given_to_a_side_with_fed_tokens(tmp_path, capsys, model):
    """The longer call is a capture size above the shorter, but its side recorded fed tokens ([batch,
    seq] ids: no engine padded them): only the prefix-cache reading, of the side without them."""
    prompt, decode = _tokens(8)
    ref = _run(model, tmp_path / "ref", prompt, decode)
    run = _run(model, tmp_path / "run", prompt[:, 1:], decode, fed="embeds")
    code, lines, _ = compare_json(capsys, ref, run)
    note = _readings(lines)
    assert "padded" not in note and "if they did, RUN's call of 7 tokens is the part of it a prefix cache" in note, note


@pytest.mark.parametrize("without_logits", ["chunked", "whole", "neither"])
def test_a_chunked_prompt_the_logits_cannot_tell_is_one_reading(tmp_path, capsys, model, without_logits):
    """No fed tokens on either side, and no logits on the chunked side or on the whole one: the
    chunked check has nothing to go by, so the first chunk is also read as the first of several
    forwards, with how to let the comparator tell; with the logits on both sides it is told as a
    chunked prompt and no note is given."""
    prompt, decode = _tokens(20)
    exclude = {side: ("input_token", "logits") if without_logits == side else ("input_token",)
               for side in ("chunked", "whole")}
    ref = run_in_chunks(model, tmp_path / "ref", prompt, decode, (20,), exclude=exclude["whole"])
    run = run_in_chunks(model, tmp_path / "run", prompt, decode, (12, 8), exclude=exclude["chunked"])
    _, lines, _ = compare_json(capsys, ref, run)
    if without_logits == "neither":
        assert any("it ran the prompt in 2 forwards (chunked prefill)" in line for line in lines), lines
        assert not any(line.startswith("note: the prompt calls differ") for line in lines), lines
        return
    note = _readings(lines)
    assert "(input_token_0: REF and RUN's instrument(exclude=...)" not in note
    assert "(input_token_0: REF's and RUN's instrument(exclude=...) left it out ('input_token'))" in note, note
    assert ("either RUN's call of 12 tokens is the first of several forwards (the prompt in chunks, or a shorter "
            "request run before it outside profiling()): record the logits on both sides so that the comparator can "
            "tell, or RUN's call of 12 tokens is the part of it a prefix cache left to run") in note, note
