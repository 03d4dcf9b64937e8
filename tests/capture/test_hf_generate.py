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
import json
import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import compiledump
from compiledump import config as cd_config
from helpers.cli import compare_json
from helpers.hf_example import ex
from helpers.hf_models import deepseek_v32

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


def _pair(tmp_path, name, dtype=torch.float32, bug=None, model=None):
    """REF: the prompt alone; RUN: the prompt in row 1 of a batch whose row 0 is longer, so
    that generate pads it with PAD positions on the left."""
    model = ex.build_model(name) if model is None else model
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
    assert any(f"RUN: its request row is left-padded ({PAD} of its prompt's {PROMPT + PAD} positions" in line
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


def test_an_indexers_keys_span_the_padding_and_are_not_compared(tmp_path, capsys):
    """DeepSeek-V3.2's sparse-attention indexer scores every cached position, the padding among
    them, at every step: its keys are not compared (exit 3, a padded_row problem each), never a
    divergence; the rest is compared on the real tokens."""
    ref, run, _, _ = _pair(tmp_path, "deepseek_v32", model=deepseek_v32(index_topk=4, layers=2))
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3, lines
    refused = {problem["key"] for problem in report["problems"] if problem["kind"] == "padded_row"}
    assert {"layer0_index_router", "layer0_index_topk", "layer1_index_step_router_1"} <= refused, refused
    assert all("_index_" in key for key in refused), refused
    compared = {record["key"] for record in report["keys"] if record["status"] == "ok"}
    assert {"layer0_attn", "layer1_router", "layer1_topk", "logits_1"} <= compared, compared


def test_a_mask_wider_than_the_call_is_not_recorded(tmp_path):
    """The first call after clear() continues cached context: its mask covers the cache too, so
    it is not the call's padding; the token gate learns the call's own 4 tokens, as without a mask."""
    model = ex.build_model("llama")
    g = torch.Generator().manual_seed(6)
    first, second = torch.randint(1, 500, (1, 5), generator=g), torch.randint(1, 500, (1, 4), generator=g)
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path))))
    handle = compiledump.instrument(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=first, attention_mask=torch.ones_like(first), **ex.cache_kwargs(model, cache))
        compiledump.clear()
        model(input_ids=second, attention_mask=torch.ones(1, 9, dtype=torch.long), **ex.cache_kwargs(model, cache))
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        path = compiledump.flush()
    manifest = json.loads(open(path.replace(".npz", ".json")).read())
    assert manifest["prompt_tokens"] == 4
    with np.load(path) as data:
        assert "prompt_mask" not in data.files and data["layer1"].shape == (64,)
