"""A request row of a padded batch: the comparator keeps the prompt's real positions.

Each side is captured through the library (`record_ids("prompt_mask", ...)` as `instrument`
records a Hugging Face model's attention mask, then records of one row and of every row, ids and
steps), flushed, and compared by the CLI. The padded side holds the reference's values at its real
positions and random values at its padding, so a padding position that reached a comparison
would show; a bug in one real position must still be named. tests/capture/test_hf_generate.py
runs Hugging Face's `generate` on a left-padded batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import compiledump
from compiledump import config as cd_config
from helpers import dumpfactory as factory
from helpers.cli import compare_json

PROMPT, DIM, EXPERTS, TOPK, STEPS = 7, 37, 9, 3, 3


def _values(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(PROMPT, DIM, generator=g)
    router = torch.randn(PROMPT, EXPERTS, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(PROMPT)])
    steps = torch.randn(STEPS, 2 * DIM, generator=g)
    return hidden, router, ids, steps


def _padded(tensor: torch.Tensor, left: int, right: int, seed: int) -> torch.Tensor:
    """`tensor`'s rows with `left` and `right` rows of other values around them."""
    g = torch.Generator().manual_seed(seed)
    if tensor.is_floating_point():
        pad = lambda n: torch.randn(n, *tensor.shape[1:], generator=g)  # noqa: E731
    else:
        pad = lambda n: torch.randint(0, EXPERTS, (n, *tensor.shape[1:]), generator=g)  # noqa: E731
    return torch.cat([pad(left), tensor, pad(right)])


def _side(directory, hidden, router, ids, steps, mask=None, dtype=torch.float32) -> str:
    """One side's dump: the prompt's call (its mask first, as instrument's hook runs before the
    layers), then a decode step per row of `steps` (step 0: the prompt's last position)."""
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    if mask is not None:
        compiledump.record_ids("prompt_mask", mask)
    compiledump.record("layer0", hidden.to(dtype))  # one row: the prompt's last position
    compiledump.record("layer0_router", router.to(dtype), rows="all")
    compiledump.record_ids("layer0_topk", ids)
    for row in steps:
        compiledump.record_step("layer0_step", row[None, :DIM].to(dtype))  # step 0: never compared
        compiledump.record_step("logits", row[None].to(dtype))
    return compiledump.flush()


def _mask(left: int, right: int) -> torch.Tensor:
    return torch.cat([torch.zeros(left), torch.ones(PROMPT), torch.zeros(right)]).to(torch.int64)


def _padded_side(directory, values, left, right, dtype=torch.float32, hidden=None, router=None):
    base_hidden, base_router, ids, steps = values
    return _side(directory, _padded(base_hidden if hidden is None else hidden, left, right, 1),
                 _padded(base_router if router is None else router, left, right, 2), _padded(ids, left, right, 3),
                 steps, _mask(left, right), dtype)


def _statuses(report) -> dict[str, str]:
    return {record["key"]: record["status"] for record in report["keys"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_padded_run_compares_on_its_real_positions(tmp_path, capsys, dtype):
    values = _values()
    ref = _side(tmp_path / "ref", *values)
    run = _padded_side(tmp_path / "run", values, 3, 0, dtype)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 0, lines
    assert any("RUN: its request row is left-padded (3 of its prompt's 10 positions" in line for line in lines), lines
    statuses = _statuses(report)
    assert statuses["layer0_router"] == statuses["layer0_topk"] == statuses["layer0"] == "ok"
    assert "prompt_mask" not in statuses and not report["problems"]


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1.01), (torch.bfloat16, 1.05)])
def test_a_bug_in_a_real_position_is_named_and_padding_is_not_compared(tmp_path, capsys, dtype, scale):
    values = _values()
    hidden, router, ids, steps = values
    ref = _side(tmp_path / "ref", *values)
    bugged = router.clone()
    bugged[2] *= scale  # the prompt's third token
    code, lines, report = compare_json(capsys, ref, _padded_side(tmp_path / "run", values, 4, 0, dtype,
                                                                 router=bugged))
    assert code == 1, lines
    assert report["first_divergence"]["key"] == "layer0_router", lines
    # the same values with other padding: nothing to see
    code, lines, _ = compare_json(capsys, ref, _side(tmp_path / "again", _padded(hidden, 4, 0, 7),
                                                     _padded(router, 4, 0, 8), _padded(ids, 4, 0, 9), steps,
                                                     _mask(4, 0), dtype))
    assert code == 0, lines


def test_both_sides_masked_and_the_mask_on_one_side_only(tmp_path, capsys):
    values = _values()
    ref = _side(tmp_path / "ref", *values, mask=torch.ones(PROMPT, dtype=torch.int64))
    code, lines, report = compare_json(capsys, ref, _padded_side(tmp_path / "run", values, 2, 0))
    assert code == 0, lines
    assert "prompt_mask" not in _statuses(report)
    # an unpadded mask on REF, none on RUN: not a key one side lacks
    code, lines, report = compare_json(capsys, ref, _side(tmp_path / "plain", *values))
    assert code == 0 and not report["problems"], lines
    assert not any("padded" in line for line in lines), lines


def test_right_padding_refuses_the_last_position_and_names_the_fix(tmp_path, capsys):
    """One-row keys and step 0 hold a padding position: not compared (exit 3); every-row keys
    and ids are compared on the real positions."""
    values = _values()
    ref = _side(tmp_path / "ref", *values)
    code, lines, report = compare_json(capsys, ref, _padded_side(tmp_path / "run", values, 1, 2))
    assert code == 3, lines
    problems = {problem["key"]: problem for problem in report["problems"]}
    assert set(problems) == {"layer0", "logits_0"}, problems  # not layer0_step_0, which is never compared
    assert all(problem["kind"] == "padded_row" and "padding_side='left'" in problem["detail"]
               for problem in problems.values())
    statuses = _statuses(report)
    assert statuses["layer0_router"] == statuses["layer0_topk"] == statuses["logits_1"] == "ok", statuses
    assert statuses["layer0_step_1"] == "ok"
    assert any("padded (1 on the left and 2 on the right of its prompt's 10 positions" in line for line in lines), lines


def test_a_mask_with_gaps_changes_nothing(tmp_path, capsys):
    """Positions masked inside the prompt (not a padded row): the keys stay as recorded, and
    those of other token counts are not comparable, as without a mask."""
    values = _values()
    hidden, router, ids, steps = values
    ref = _side(tmp_path / "ref", *values)
    mask = _mask(2, 0)
    mask[5] = 0
    run = _side(tmp_path / "run", _padded(hidden, 2, 0, 1), _padded(router, 2, 0, 2), _padded(ids, 2, 0, 3), steps,
                mask)
    code, lines, report = compare_json(capsys, ref, run)
    assert code == 3, lines
    assert _statuses(report)["layer0_router"] == "not_comparable"
    # neither the note nor a problem of a padded request row (padding.py)
    assert not any("positions masked by attention_mask" in line or "request row is padded" in line
                   for line in lines), lines


def test_a_mask_of_another_call_than_the_prompts_is_not_applied(tmp_path, capsys):
    """A mask kept from a later call (its phase decode, its length not the prompt's): the side is
    compared as recorded, with no padding note."""
    rng = np.random.default_rng(5)
    ref = factory.model_captures(rng, tokens=3)
    run = ref + [factory.Capture("prompt_mask", np.array([0, 1, 1, 1], np.int32), "ids", "prompt_mask")]
    fields = factory.call_fields(run, 3, 3, 3) | {"prompt_mask": {"tokens": 4, "phase": "decode"}}
    ref_path = factory.write_compiledump(tmp_path / "ref", ref,
                                         manifest=factory.manifest_for(ref, key_fields=factory.call_fields(ref, 3, 3, 3),
                                                                       prompt_tokens=3))
    run_path = factory.write_compiledump(tmp_path / "run", run,
                                         manifest=factory.manifest_for(run, key_fields=fields, prompt_tokens=3))
    code, lines, report = compare_json(capsys, ref_path, run_path)
    assert code == 0 and not report["problems"], lines
    assert not any("padded" in line for line in lines), lines
    assert "prompt_mask" not in _statuses(report)


def test_map_renames_after_the_padding_is_gone(tmp_path, capsys):
    """--map renames RUN's keys after its padding is taken out: a pattern that also matches the
    mask's key does not turn the unpadding off."""
    values = _values()
    ref = _side(tmp_path / "ref", *values)
    code, lines, _ = compare_json(capsys, ref, _padded_side(tmp_path / "run", values, 3, 0), "--map", "^prompt_=engine_")
    assert code == 0, lines
    assert any("left-padded" in line for line in lines), lines


def test_with_the_gate_off_the_fix_names_the_padded_width(tmp_path, capsys):
    """COMPILEDUMP_TOKENS=0 on the padded side: its records keep the last (decode) call, its ids
    the prompt's; the mixed-phase fix names the width its gate must keep, the padded 10, not 7."""
    hidden, router, ids, steps = _values()
    ref = _side(tmp_path / "ref", hidden, router, ids, steps)
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path / "run"), tokens=0)))
    compiledump.record_ids("prompt_mask", _mask(3, 0))
    compiledump.record_ids("layer0_topk", _padded(ids, 3, 0, 3))
    compiledump.record("layer0", _padded(hidden, 3, 0, 1))
    compiledump.record("layer0", hidden[-1:])  # a decode step's call: the last write wins
    code, lines, report = compare_json(capsys, ref, compiledump.flush())
    (problem,) = [problem for problem in report["problems"] if problem["kind"] == "mixed_phases"]
    assert "COMPILEDUMP_TOKENS=10 (the prompt length)" in problem["detail"], problem
    assert _statuses(report)["layer0_topk"] == "ok"


def test_inspect_says_how_a_padded_row_is_read(tmp_path, capsys):
    from helpers.cli import run_cli

    run = _padded_side(tmp_path / "run", _values(), 3, 0)
    code, out, _ = run_cli(capsys, "inspect", run)
    assert code == 0
    assert "note: its request row is left-padded (3 of its prompt's 10 positions masked by attention_mask, as " \
           "generate pads a batch): its prompt keys are compared on its 7 real tokens" in out, out
