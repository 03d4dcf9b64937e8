"""A step tag whose numbering a dropped call shifted is not compared (compare/step_drops.py).

`record_step` numbers a tag's keys by its kept calls: a call dropped as `shape_changed` (a step's
expert ids of a top-1 forward among top-2 ones) claims no index, so the tag's later keys hold later
forwards' values. A helper's audit: an engine using top-1 at decode step 3 only had its
`layer1_step_topk_3` hold step 4's ids, and a bf16 verdict named step 4."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch

import compiledump
from compiledump import config as cd_config
from compiledump.compare import compare, format_report
from helpers.hf_dump import change_call, dump_run, load_dump, prompt_then_steps
from helpers.hf_example import ex

STEPS = 6
IDS = [[3, 7], [7, 3], [5, 2], [6, 1], [7, 1], [4, 3]]  # a step's top-2 expert ids


def _session(directory, top1_at: int | None, seed: int = 0) -> str:
    """record_step of a [1, 2] ids row and of 1-D logits per decode step; at step `top1_at` the
    ids row is [1, 1] (a top-1 forward: dropped as shape_changed)."""
    rng = np.random.default_rng(seed)
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    for step in range(STEPS):
        ids = IDS[step][:1] if step == top1_at else IDS[step]
        compiledump.record_step("layer1_step_topk", torch.tensor([ids], dtype=torch.int32))
        compiledump.record_step("logits", torch.from_numpy(rng.standard_normal(50).astype(np.float32)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        path = compiledump.flush()
    compiledump.reset()
    return path


def test_the_dump_itself_numbers_a_step_tag_by_its_kept_calls(tmp_path):
    """What the comparator reads: the drop is counted, and the keys after it hold later steps (the
    behaviour record_step documents; the seed numbered every call it kept alike)."""
    arrays, manifest = load_dump(_session(tmp_path, top1_at=3))
    assert manifest["tags"]["layer1_step_topk_<n>"]["drops"] == {"shape_changed": 1}
    assert arrays["layer1_step_topk_3"].tolist() == IDS[4] and "layer1_step_topk_5" not in arrays


@pytest.mark.parametrize("side", ["run", "ref"])
def test_a_step_tag_with_a_dropped_call_is_not_compared_and_says_why(tmp_path, side):
    dropped, other = _session(tmp_path / side, top1_at=3), _session(tmp_path / "other", top1_at=None)
    ref, run = (other, dropped) if side == "run" else (dropped, other)
    report = compare(ref, run)
    lines = format_report(report)
    refused = [record.key for record in report.not_comparable]
    assert refused == [f"layer1_step_topk_{n}" for n in range(5)], refused
    (line,) = [line for line in lines if line.startswith("not comparable: the 5 step keys of layer1_step_topk: "
                                                         "step numbering shifted")]
    assert f"{side.upper()} dropped 1 call(s) of the step tag layer1_step_topk (shape_changed=1)" in line
    assert "give each shape its own tag" in line
    # No divergence is made of the shifted ids, and the missing layer1_step_topk_5 is no problem of its own.
    assert report.first_divergence is None and report.exit_status == 3, lines[-1]
    assert not any(problem.key == "layer1_step_topk_5" for problem in report.problems)
    assert {record.key for record in report.keys if record.status == "ok"} >= {f"logits_{n}" for n in range(STEPS)}


def test_a_top1_decode_step_in_a_moe_engine_is_named_at_its_step(tmp_path):
    """Qwen3-MoE from config; the engine's layer-1 router keeps one expert at decode step 3 (its
    step ids [1, 1]: dropped). The verdict names step 3's MoE output, not the shifted ids' step 4."""
    reference = ex.build_model("qwen3_moe")
    engine = copy.deepcopy(reference)
    change_call(engine.model.layers[1].mlp.gate, 4,  # the prompt's forward, then decode steps 1, 2, 3
                lambda logits, weights, ids: (logits, weights[:, :1], ids[:, :1]))
    prompt = torch.randint(0, reference.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    report = compare(*(dump_run(model, tmp_path / name, prompt_then_steps(model, prompt, (11, 40, 3, 77, 5)))
                       for name, model in (("ref", reference), ("run", engine))))
    lines = format_report(report)
    first = report.first_divergence
    assert (first.key, first.step) == ("layer1_mlp_step_3", 3), lines[-1]
    assert any(line.startswith("not comparable: the 5 step keys of layer1_step_topk: step numbering shifted: RUN")
               for line in lines), lines


def test_a_renamed_step_tag_with_a_dropped_call_is_not_compared(tmp_path):
    """A review: with `--map` the drop was sought under RUN's own tag name, and the renamed tag's
    shifted keys were compared (exit 1)."""
    from compiledump.compare import CompareOptions

    ref = _session(tmp_path / "ref", top1_at=None)
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path / "run"))))
    for step in range(STEPS):
        ids = IDS[step][:1] if step == 3 else IDS[step]
        compiledump.record_step("blk1_step_topk", torch.tensor([ids], dtype=torch.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run = compiledump.flush()
    compiledump.reset()
    report = compare(ref, run, CompareOptions(maps=[(r"^blk(\d+)_step_topk$", r"layer\1_step_topk")]))
    assert [record.key for record in report.not_comparable] == [f"layer1_step_topk_{n}" for n in range(5)]
    assert report.first_divergence is None, format_report(report)[-1]



def _rows_gated(directory, wide_steps: tuple[int, ...], seed: int = 1) -> str:
    """An engine's decode loop: set_rows before each step, the batch `2` wide (another request
    beside the compared one) at `wide_steps`; each step's values the same whatever the batch."""
    rng = np.random.default_rng(seed)
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    for step in range(STEPS):
        compiledump.set_rows(2 if step in wide_steps else 1)
        hidden = torch.from_numpy(rng.standard_normal((2, 33)).astype(np.float32))
        compiledump.record_step("layer0_step", hidden)
        compiledump.record_step("logits", hidden[:, :17] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        path = compiledump.flush()
    compiledump.reset()
    return path


@pytest.mark.parametrize("wide_steps", [(4, 5), tuple(range(1, STEPS))])
def test_steps_the_rows_gate_skipped_at_the_end_are_one_note_naming_the_fix(tmp_path, wide_steps):
    """Another request joins the compared one's batch and stays (or shares it from step 1 with the
    default COMPILEDUMP_MAX_ROWS=1): RUN's later steps were skipped. One note says why and what to
    change, instead of a missing_in_run problem per key (119 lines in a helper's audit)."""
    report = compare(_rows_gated(tmp_path / "ref", ()), _rows_gated(tmp_path / "run", wide_steps))
    text = "\n".join(format_report(report))
    assert report.exit_status == 0 and not report.problems and not report.not_comparable, text
    (note,) = [note for note in report.pairs[0].notes if "skipped while its batch was wider" in note]
    assert note.startswith(f"REF holds {2 * len(wide_steps)} decode-step keys that RUN skipped"), note
    assert "raise RUN's COMPILEDUMP_MAX_ROWS" in note


@pytest.mark.parametrize("drops, noted", [({"rows_gate": 3}, True), ({"rows_gate": 1, "step_capacity": 3}, False),
                                          ({"rows_gate": 1}, False)])
def test_the_rows_gate_note_explains_only_the_steps_the_gate_skipped(tmp_path, drops, noted):
    """A warm-up's one skipped call beside steps lost to step_capacity (or never run) is no reason
    to call the missing steps rows-gated: they stay problems, with the drop counts (a review)."""
    from helpers import dumpfactory as factory

    rng = np.random.default_rng(4)
    ref = [factory.Capture(f"logits_{n}", rng.standard_normal(11).astype(np.float32), "step", "logits", n)
           for n in range(6)]
    run = ref[:3]
    manifest = factory.manifest_for(run, source_dtype="float32")
    manifest["tags"]["logits_<n>"]["drops"] = drops
    report = compare(*factory.write_pair(tmp_path, ref, run, run_manifest=manifest))
    missing = [problem for problem in report.problems if problem.kind == "missing_in_run"]
    assert any("skipped while its batch was wider" in note for note in report.pairs[0].notes) == noted
    assert [problem.key for problem in missing] == ([] if noted else ["logits_3", "logits_4", "logits_5"])
    assert all("RUN dropped its calls: " in problem.detail for problem in missing)
