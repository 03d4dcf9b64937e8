"""Decode steps run on different tokens: greedy decoding after an argmax flip.

A Hugging Face model (built from config, random weights, eager) is instrumented on both sides;
the engine side's decode loop is fed a token of its own choosing from one step on, as greedy
decoding does after an argmax flip. The comparator reads the fed tokens (`input_token_<n>`,
recorded by instrument from the embedding's input) and must not judge those steps: before, an
honest bf16 engine decoding greedily after a near tie exited 1 naming a layer of a later step.
The tokens each side fed are known here, so the expected step is too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import compiledump
from compiledump import config as cd_config
from compiledump.cli import main
from helpers.hf_example import ex

PROMPT, STEPS = 7, 5


def run_side(model, directory, fed, bug_at_step=None, width=1, prompt_seed=3):
    """Prefill a 7-token prompt, then decode feeding `fed[n]` at step n+1 (the tokens are given,
    not decoded, so each test says where the sides' inputs part). `bug_at_step`: from that
    decode step on, the last layer's MLP output is scaled by 1.01 (a decode-only bug). `width`:
    tokens fed per decode forward (speculative decoding's verification of drafts)."""
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory), moe_layers=2)))
    handle = compiledump.instrument(model)
    step = [0]
    hook = model.model.layers[-1].mlp.register_forward_hook(
        lambda _m, _a, out: out * 1.01 if bug_at_step is not None and step[0] >= bug_at_step else out)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(prompt_seed))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
        for start in range(0, len(fed), width):
            step[0] += 1
            model(input_ids=torch.tensor([fed[start:start + width]]), cache=cache, use_cache=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        compiledump.flush()
    hook.remove()
    handle.remove()
    compiledump.reset()


@pytest.fixture(scope="module")
def model():
    return ex.build_model("qwen3_moe")


def compare(tmp_path, capsys):
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    return code, capsys.readouterr().out.splitlines(), json.loads((tmp_path / "r.json").read_text())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_fed_other_tokens_are_not_comparable(model, tmp_path, capsys, dtype):
    tokens = torch.randint(0, model.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(4)).tolist()
    other = list(tokens)
    other[2] = (tokens[2] + 1) % model.config.vocab_size  # the run decoded another token at step 3
    other[3] = (tokens[3] + 5) % model.config.vocab_size
    run_side(model, tmp_path / "ref", tokens)
    run_side(copy.deepcopy(model).to(dtype), tmp_path / "run", other)
    code, out, report = compare(tmp_path, capsys)
    (pair,) = report["pairs"]
    # Step n's logits come from the token fed at step n: input_token_3 is fed[2].
    assert pair["fed_tokens_differ"] == {"step": 3, "ref": tokens[2], "run": other[2],
                                         "prompts_differ": False}
    refused = {record["key"] for record in report["keys"] if record["status"] == "not_comparable"}
    steps = {record["key"]: record["step"] for record in report["keys"] if record["step"] is not None}
    assert refused == {key for key, step in steps.items() if step >= 3} and "logits_5" in refused
    assert all(record["status"] in ("ok", "shown") for record in report["keys"] if record["key"] not in refused)
    # No divergence among what was compared; the steps after the inputs parted are not called clean.
    assert code == 3 and report["first_divergence"] is None
    line = next(text for text in out if text.startswith("not comparable: decode steps 3-5"))
    assert f"fed different tokens from step 3 (REF {tokens[2]}, RUN {other[2]})" in line and "teacher forcing" in line
    if dtype == torch.float32:  # no flip parted them (the tokens were given): a set-up to check first
        assert "with no argmax flip right before it" in line and "set_gather_rows(step=...)" in line, line
    assert out[-1].startswith("no divergence") and f"{len(refused)} keys NOT COMPARABLE" in out[-1]


def test_sides_that_ran_different_prompts_compare_nothing(model, tmp_path, capsys):
    """A data-parallel engine's rank that served another request, compared with the reference:
    the prompts' last tokens (step 0's fed token) differ, so no key is comparable (before: its
    prompt keys were compared, a false divergence at layer 0, exit 1; an EP/DP bring-up)."""
    tokens = torch.randint(0, model.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(6)).tolist()
    run_side(model, tmp_path / "ref", tokens)
    run_side(copy.deepcopy(model), tmp_path / "run", tokens, prompt_seed=8)
    code, out, report = compare(tmp_path, capsys)
    fed = report["pairs"][0]["fed_tokens_differ"]
    assert fed["step"] == 0 and fed["prompts_differ"] is True and fed["ref"] != fed["run"]
    assert code == 3 and report["first_divergence"] is None and report["compared"] == 0
    assert {record["status"] for record in report["keys"]} == {"not_comparable"}
    (line,) = [text for text in out if text.startswith("not comparable:")]  # one line, not a phases line too
    assert line.startswith(f"not comparable: every key ({len(report['keys'])} keys): the sides were fed different "
                           f"prompts (their last tokens: REF {fed['ref']}, RUN {fed['run']}); fix: compare runs of "
                           "the same request"), line


def test_the_same_tokens_are_compared_and_a_bug_before_the_parting_is_found(model, tmp_path, capsys):
    tokens = torch.randint(0, model.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(5)).tolist()
    # Teacher forcing: the same tokens, every step compared.
    run_side(model, tmp_path / "ref", tokens)
    run_side(copy.deepcopy(model), tmp_path / "run", tokens)
    code, _, report = compare(tmp_path, capsys)
    assert code == 0 and report["pairs"][0]["fed_tokens_differ"] is None
    assert {f"input_token_{n}" for n in range(STEPS + 1)} <= {record["key"] for record in report["keys"]}
    # A decode-only bug from step 2, and the run's tokens parting at step 4 (as its flip would make
    # them): the bug is named at step 2; steps 4-5 are not judged.
    other = list(tokens)
    other[3] = (tokens[3] + 1) % model.config.vocab_size
    run_side(copy.deepcopy(model), tmp_path / "run", other, bug_at_step=2)
    code, _, report = compare(tmp_path, capsys)
    assert code == 1 and report["first_divergence"]["step"] == 2
    assert report["pairs"][0]["fed_tokens_differ"]["step"] == 4


def test_decode_forwards_of_several_tokens_are_not_paired_with_one_token_steps(model, tmp_path, capsys):
    """Speculative decoding's verification feeds several tokens per decode forward, whose step tags
    hold the last: RUN's step n is not REF's step n. The same tokens, teacher-forced, 3 per forward:
    not comparable from step 1 (docs/compare.md, "Speculative decoding"), never a divergence."""
    tokens = torch.randint(0, model.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(6)).tolist()
    assert tokens[0] != tokens[2]
    run_side(model, tmp_path / "ref", tokens)
    run_side(model, tmp_path / "run", tokens, width=3)
    code, out, report = compare(tmp_path, capsys)
    assert code == 3 and report["first_divergence"] is None, out[-1]
    assert report["pairs"][0]["fed_tokens_differ"] == {"step": 1, "ref": tokens[0], "run": tokens[2],
                                                           "prompts_differ": False}
    compared = [record for record in report["keys"] if record["step"] is None]
    assert compared and all(record["status"] == "ok" for record in compared)  # the prompt's keys


def test_a_flip_steps_before_the_tokens_part_is_not_what_parted_them(tmp_path, capsys):
    """A flip at decode step 0, then steps 1-2 fed the same tokens (teacher-forced) and step 3 on
    different ones: the flip did not part them, so the set-up to check is named (a review: the
    line blamed any earlier flip)."""
    import numpy as np

    from helpers import dumpfactory as factory

    rng = np.random.default_rng(1)
    ref = factory.model_captures(rng, layers=2, steps=5)
    ref += [factory.Capture(f"input_token_{n}", np.array([11 + n], np.int32), "step", "input_token", n)
            for n in range(5)]
    run = []
    for capture in ref:
        array = capture.array.copy()
        if capture.key == "logits_0":  # a clear flip of step 0's argmax
            array[(int(array.argmax()) + 1) % array.size] = array.max() + 5.0
        if capture.key in ("input_token_3", "input_token_4"):
            array = array + 80
        run.append(factory.replace(capture, array=array))
    main(["compare", *map(str, factory.write_pair(tmp_path, ref, run))])
    line = next(text for text in capsys.readouterr().out.splitlines() if text.startswith("not comparable: decode"))
    assert "from step 3 (REF 14, RUN 94), with no argmax flip right before it" in line, line


def test_hand_written_steps_that_start_at_the_first_decode_do_not_hide_a_prefill_bug(tmp_path):
    """Steps recorded by hand (no `instrument`: no `mixers` in the manifests) may start at the first
    decode step: a prefill bug that changes the first generated token makes `input_token_0`
    differ, which is then no sign of different prompts, and the prefill's divergence is named."""
    from compiledump.compare import compare as compare_dumps
    from helpers import dumpfactory as factory
    from helpers.dumpfactory import Capture

    rng = np.random.default_rng(12)
    layers = [rng.standard_normal(16).astype(np.float32) for _ in range(3)]
    paths = []
    for side, first_token, scale in (("ref", 5, 1.0), ("run", 9, 1.05)):  # RUN: a 5 % bug from layer 1 on
        caps = [Capture(f"layer{i}", layers[i] * (scale if i >= 1 else 1.0), "record", f"layer{i}") for i in range(3)]
        caps += [Capture(f"input_token_{n}", np.array([token], np.float32), "step", "input_token", n)
                 for n, token in enumerate((first_token, 17))]
        caps += [Capture(f"logits_{n}", rng.standard_normal(11).astype(np.float32), "step", "logits", n) for n in range(2)]
        paths.append(factory.write_compiledump(tmp_path / side, caps, rank="x", pid=1))
    report = compare_dumps(*paths)
    assert report.first_divergence is not None and report.first_divergence.key == "layer1"  # before: exit 3, nothing
    assert report.pairs[0].fed_tokens.step == 0 and not report.pairs[0].fed_tokens.prompts_differ
