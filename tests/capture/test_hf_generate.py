"""Hugging Face `generate` on a batch, against the same prompt alone.

`generate` pads a batch's shorter prompts on the left; the request's row then has more prefill
positions than the reference's, and before `instrument` recorded the attention mask its prefill
keys were "not comparable" (exit 3) with a fix that asked for the same prompt, which it was. Now
the comparator keeps the real positions (compare/padding.py): an honest batch exits 0, a bug of
1 % in the batch's model is named at its layer. Models built from config (random weights, eager).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

import compiledump
from compiledump import config as cd_config
from helpers.cli import compare_json
from helpers.hf_example import ex

PROMPT, NEW, PAD = 7, 4, 3


def _generate(model, directory, ids, mask=None, batch_row=0):
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    handle = compiledump.instrument(model, batch_row=batch_row)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=NEW,
                             do_sample=False)
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the drops: the comparison lists them
        return compiledump.flush(), out


def _pair(tmp_path, name, dtype=torch.float32, bug=None):
    """REF: the prompt alone; RUN: the prompt in row 1 of a batch whose row 0 is longer, so
    that generate pads it with PAD positions on the left."""
    model = ex.build_model(name)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, model.config.vocab_size, (1, PROMPT), generator=g)
    ref, ref_tokens = _generate(model, tmp_path / "ref", prompt, torch.ones_like(prompt))
    engine = copy.deepcopy(model).to(dtype)
    if bug is not None:
        ex.inject(engine, bug, 1, 1.01)
    longer = torch.randint(1, model.config.vocab_size, (1, PROMPT + PAD), generator=g)
    ids = torch.cat([longer, torch.cat([torch.zeros(1, PAD, dtype=torch.long), prompt], 1)])
    mask = (ids != 0).long()
    mask[0] = 1
    run, run_tokens = _generate(engine, tmp_path / "run", ids, mask, batch_row=1)
    return ref, run, ref_tokens, run_tokens


@pytest.mark.parametrize("name", ["qwen3_moe", "llama"])
def test_left_padded_batch_against_the_prompt_alone(tmp_path, capsys, name):
    ref, run, ref_tokens, run_tokens = _pair(tmp_path, name)
    assert run_tokens[1, :PAD].tolist() == [0] * PAD  # the request's row was padded
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 0, lines
    assert any(f"RUN's request row is left-padded ({PAD} of its prompt's {PROMPT + PAD} positions" in line
               for line in lines), lines
    compared = {record["key"] for record in report["keys"] if record["status"] == "ok"}
    assert {"layer0_attn", "layer1", "final_norm", "logits_0", f"logits_{NEW - 1}"} <= compared, compared
    if name == "qwen3_moe":
        assert {"layer0_router", "layer0_topk", "layer1_topk"} <= compared  # every prompt row, real ones only


def test_a_bug_in_the_padded_batch_is_named_at_its_layer(tmp_path, capsys):
    ref, run, _, _ = _pair(tmp_path, "qwen3_moe", bug="experts")
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 1, lines
    first = report["first_divergence"]
    assert first["layer"] == 1 and first["phase"] == "prefill", lines


def test_bf16_padded_batch_no_false_divergence(tmp_path, capsys):
    ref, run, _, _ = _pair(tmp_path, "qwen3_moe", torch.bfloat16)
    code, lines, _ = compare_json(capsys, ref, run)
    assert code == 0, lines
