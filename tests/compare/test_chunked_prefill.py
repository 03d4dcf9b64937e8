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

import pytest
import torch

from helpers.chunked_runs import run_in_chunks
from helpers.cli import compare_json
from helpers.hf_example import ex

STEPS = 3


@pytest.fixture(scope="module")
def model():
    return ex.build_model("qwen3_moe")


def _run(model, directory, prompt, decode, chunks, before=None, fed=True, logits=True) -> str:
    """One side (helpers.chunked_runs). `fed=False`: no input_token keys (an engine whose flat ids
    instrument does not record); `logits=False`: no logits keys."""
    exclude = (() if fed else ("input_token",)) + (() if logits else ("logits",))
    return run_in_chunks(model, directory, prompt, decode, chunks, before, exclude)


def _tokens(length: int, seed: int = 4, steps: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 500, (1, length), generator=g), torch.randint(1, 500, (steps,), generator=g)


def _line(lines: list[str]) -> str:
    (line,) = [line for line in lines if line.startswith("not comparable:")]
    return line


@pytest.mark.parametrize("chunks", [(4, 3), (3, 4), (2, 2, 3), (4, 4)])
def test_a_chunked_prompt_is_named_with_its_fix(tmp_path, capsys, model, chunks):
    prompt, decode = _tokens(sum(chunks))
    ref = _run(model, tmp_path / "ref", prompt, decode, [sum(chunks)])
    run = _run(model, tmp_path / "run", prompt, decode, chunks)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3, lines
    line = _line(lines)
    k = len(chunks) - 1
    assert f"RUN's prompt keys hold a call of {chunks[0]} tokens, not the other side's prompt of {sum(chunks)}, and " \
           f"its step n is the other side's step n - {k} (its fed token at step {k} is the other side's at step 0): " \
           f"it ran the prompt in {k + 1} forwards (chunked prefill), or a shorter request before" in line, line
    assert "--max-num-batched-tokens at least the prompt length" in line and "--chunked-prefill-size -1" in line
    assert not report["problems"], report["problems"]  # RUN's extra steps: one note
    # 18 per step: logits, input_token, each of 4 layers' state and stream after attention, and the
    # two MoE layers COMPILEDUMP_MOE_LAYERS keeps: router logits, ids, MoE output, attention's output
    assert any(line.startswith(f"note: RUN holds {18 * k} step keys past the other side's last step") for line in lines)
    assert report["pairs"][0]["fed_tokens_differ"] is None
    assert {record["status"] for record in report["keys"]} == {"not_comparable"}


@pytest.mark.parametrize("case", ["more_decode_steps", "fewer_decode_steps", "greedy_flip", "ref_chunked", "no_fed_tokens"])
def test_chunks_are_found_whatever_follows_them(tmp_path, capsys, model, case):
    """Decode counts that differ, a fed token that differs after the prompt (greedy decoding after
    a flip), the chunked side being REF, and an engine whose fed tokens are not recorded (its
    logits tell): the shift is still found."""
    prompt, decode = _tokens(7, steps=5)
    ref_decode, run_decode = decode[:3], decode
    if case == "fewer_decode_steps":
        ref_decode, run_decode = decode, decode[:2]
    if case == "greedy_flip":
        ref_decode, run_decode = decode[:3], torch.cat([decode[:1], decode[3:5]])
    chunked, whole = (4, 3), [7]
    fed = case != "no_fed_tokens"
    ref = _run(model, tmp_path / "ref", prompt, ref_decode, chunked if case == "ref_chunked" else whole, fed=fed)
    run = _run(model, tmp_path / "run", prompt, run_decode, whole if case == "ref_chunked" else chunked, fed=fed)
    code, lines, _ = compare_json(capsys, ref, run)
    assert code == 3, lines
    side = "REF" if case == "ref_chunked" else "RUN"
    evidence = "its logits_1 matches the other side's logits_0" if not fed else "its fed token at step 1"
    assert f"{side}'s prompt keys hold a call of 4 tokens" in _line(lines) and evidence in _line(lines), lines


def test_a_first_chunk_ending_on_the_prompt_s_last_token_is_still_a_chunk(tmp_path, capsys, model):
    """Both sides then feed the same token at step 0; the chunked side feeds it again at step 1,
    where the other feeds its first decoded token: its logits_1 is the other side's logits_0."""
    prompt, decode = _tokens(20)
    prompt[0, 11] = prompt[0, -1]
    ref = _run(model, tmp_path / "ref", prompt, decode, [20])
    run = _run(model, tmp_path / "run", prompt, decode, (12, 8))
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3 and report["first_divergence"] is None, lines
    assert "RUN's prompt keys hold a call of 12 tokens, not the other side's prompt of 20, and its step n is the " \
           "other side's step n - 1 (its fed token at step 1 is the other side's at step 0 and its logits_1 matches " \
           "the other side's logits_0)" in _line(lines)


@pytest.mark.parametrize("decode_steps", [0, 2])
def test_a_chunk_ending_alike_is_found_by_its_logits_whatever_the_decode_tokens(tmp_path, capsys, model, decode_steps):
    """No decode step at all (only the prefill compared), or a first decoded token that is the
    prompt's last token again: the fed tokens cannot tell step 0 from step 1, the logits can."""
    prompt, decode = _tokens(20)
    prompt[0, 11] = prompt[0, -1]
    decode = decode[:decode_steps]
    if decode_steps:
        decode[0] = prompt[0, -1]
    ref = _run(model, tmp_path / "ref", prompt, decode, [20])
    run = _run(model, tmp_path / "run", prompt, decode, (12, 8))
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3 and report["first_divergence"] is None, lines
    assert "its step n is the other side's step n - 1 (its fed token at step 1 is the other side's at step 0 and its " \
           "logits_1 matches the other side's logits_0)" in _line(lines)
    assert not any("prefix cache" in line for line in lines), lines


@pytest.mark.parametrize("logits", [True, False])
def test_a_middle_chunk_ending_alike_is_found_with_or_without_logits(tmp_path, capsys, model, logits):
    """Three chunks, the second ending on the prompt's last token: steps 1 and 2 both feed it; the
    logits (step 2's is the other side's step 0's), or without them the fed tokens in a row from
    step 2 (the prompt's last token, then the first decoded one), tell the shift of 2."""
    prompt, decode = _tokens(20)
    prompt[0, 11] = prompt[0, -1]
    ref = _run(model, tmp_path / "ref", prompt, decode, [20], logits=logits)
    run = _run(model, tmp_path / "run", prompt, decode, (5, 7, 8), logits=logits)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3 and report["first_divergence"] is None, lines
    evidence = ("its fed token at step 2 is the other side's at step 0 and its logits_2 matches the other side's "
                "logits_0" if logits else "its fed tokens from step 2 are the other side's from step 0")
    assert f"its step n is the other side's step n - 2 ({evidence}): it ran the prompt in 3 forwards" in _line(lines)


def test_a_shorter_request_before_reads_the_same_and_is_named_with_both_fixes(tmp_path, capsys, model):
    prompt, decode = _tokens(7)
    other, _ = _tokens(4, seed=5)
    ref = _run(model, tmp_path / "ref", prompt, decode, [7])
    run = _run(model, tmp_path / "run", prompt, decode, [7], before=other)
    code, lines, _ = compare_json(capsys, ref, run)
    assert code == 3, lines
    line = _line(lines)
    assert "or a shorter request before the compared one outside profiling()" in line
    assert "or a warm-up inside compiledump.profiling()" in line


def test_a_step_tag_the_other_side_lacks_stays_a_problem(tmp_path, capsys, model):
    """Only the steps of tags both sides hold, past the other side's last, are explained by the
    shift: a step tag renamed by --map on RUN only is still a problem each."""
    prompt, decode = _tokens(7)
    ref = _run(model, tmp_path / "ref", prompt, decode, [7])
    run = _run(model, tmp_path / "run", prompt, decode, (4, 3))
    code, lines, report = compare_json(capsys, ref, run, "--map", "^layer3_step$=layer9_step")
    kinds = {(problem["kind"], problem["key"]) for problem in report["problems"]}
    assert ("extra_in_run", "layer9_step_1") in kinds and ("missing_in_run", "layer3_step_1") in kinds, kinds


def test_another_prompt_is_not_taken_for_chunks(tmp_path, capsys, model):
    """A shorter, different prompt, with as many steps or more: still 'compare runs of the same prompt'."""
    prompt, decode = _tokens(7)
    other, more = _tokens(4, seed=5, steps=STEPS + 2)
    ref = _run(model, tmp_path / "ref", prompt, decode, [7])
    for name, steps in (("same", more[:STEPS]), ("more", more)):
        run = _run(model, tmp_path / name, other, steps, [4])
        code, lines, _ = compare_json(capsys, ref, run)
        assert code in (1, 3), lines
        assert not any("chunked prefill" in line for line in lines), lines
        # (their last tokens differ: nothing is comparable, the prompt's keys included)
        assert any(line.startswith("not comparable: every key") and "the sides were fed different prompts" in line
                   and "fix: compare runs of the same request" in line for line in lines), lines
