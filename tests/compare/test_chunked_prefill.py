"""A prompt run in several forwards (chunked prefill, as vLLM and SGLang run a prompt longer than
their chunk) against the same prompt in one forward.

The chunked side's token gate learns the first chunk's length, so its prompt keys hold the first
chunk, and every chunk's forward is a step of its logits, so its steps start earlier than the
reference's. Before, such a pair read as "compare runs of the same prompt" and "the sides fed
different tokens from step 0", two fixes that do not apply, with a problem per extra step. Now one
line says the prompt came in chunks and how to run it in one forward. A Hugging Face model built
from config (random weights, eager), teacher-forced decode steps on both sides.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import DynamicCache

import compiledump
from compiledump import config as cd_config
from helpers.cli import compare_json
from helpers.hf_example import ex

STEPS = 3


@pytest.fixture(scope="module")
def model():
    return ex.build_model("qwen3_moe")


def _run(model, directory, prompt, decode, chunks) -> str:
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    handle = compiledump.instrument(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        start = 0
        for size in chunks:
            model(input_ids=prompt[:, start:start + size], **ex.cache_kwargs(model, cache))
            start += size
        for token in decode:
            model(input_ids=token.view(1, 1), **ex.cache_kwargs(model, cache))
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return compiledump.flush()


def _tokens(length: int, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 500, (1, length), generator=g), torch.randint(1, 500, (STEPS,), generator=g)


@pytest.mark.parametrize("chunks", [(4, 3), (3, 4), (2, 2, 3), (4, 4)])
def test_a_chunked_prompt_is_named_with_its_fix(tmp_path, capsys, model, chunks):
    prompt, decode = _tokens(sum(chunks))
    ref = _run(model, tmp_path / "ref", prompt, decode, [sum(chunks)])
    run = _run(model, tmp_path / "run", prompt, decode, chunks)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3, lines
    (line,) = [line for line in lines if line.startswith("not comparable:")]
    assert f"RUN ran the prompt in {len(chunks)} forwards (chunked prefill): its prompt keys hold its first " \
           f"forward's {chunks[0]} tokens of the other side's {sum(chunks)}, and its step n is the other side's " \
           f"step n - {len(chunks) - 1}" in line, line
    assert "max_num_batched_tokens at least the prompt length" in line and "--chunked-prefill-size -1" in line
    assert not report["problems"], report["problems"]  # RUN's extra steps: one note
    assert any(line.startswith(f"note: RUN holds {9 * (len(chunks) - 1)} step keys more") for line in lines), lines
    assert report["pairs"][0]["fed_tokens_differ"] is None
    statuses = {record["status"] for record in report["keys"]}
    assert statuses == {"not_comparable"}, statuses


def test_another_prompt_is_not_taken_for_chunks(tmp_path, capsys, model):
    """A shorter, different prompt with as many steps: still 'compare runs of the same prompt'."""
    prompt, decode = _tokens(7)
    other, _ = _tokens(4, seed=5)
    ref = _run(model, tmp_path / "ref", prompt, decode, [7])
    run = _run(model, tmp_path / "run", other, decode, [4])
    code, lines, _ = compare_json(capsys, ref, run)
    assert code in (1, 3), lines
    assert not any("chunked prefill" in line for line in lines), lines
    assert any("fix: compare runs of the same prompt (REF's has 7 tokens, RUN's 4 tokens)" in line for line in lines), lines
