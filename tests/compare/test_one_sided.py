"""Keys only one side holds (compiledump/compare/one_sided.py): a difference in how the sides were
captured (the other side's `instrument(exclude=...)`, its COMPILEDUMP_LAYER_STEPS) is one note per
reason, naming it; anything else is a problem per key. Dumps are built with numpy here, each side's
manifest saying what its capture settings were, as the runtime writes them (docs/format.md)."""

from __future__ import annotations

import numpy as np
import pytest

from compiledump.compare import compare, format_report
from helpers import dumpfactory as factory
from helpers.dumpfactory import Capture

DIM = 37


def _captures(rng, steps: int, mlp: bool, extra: bool) -> list[Capture]:
    """Layer 0's output, MoE output (`mlp`) and state at decode steps 1..`steps`; the logits of
    steps 0..4; with `extra`, a hand-written record named like a layer state and a plain tag."""
    vector = lambda: (rng.standard_normal(DIM) + 0.5).astype(np.float32)  # noqa: E731
    captures = [Capture("layer0", vector(), "record", "layer0")]
    if mlp:
        captures.append(Capture("layer0_mlp", vector(), "record", "layer0_mlp"))
    if extra:
        captures += [Capture("layer3_step", vector(), "record", "layer3_step"), Capture("foo", vector(), "record", "foo")]
    captures += [Capture(f"layer0_step_{n}", vector(), "step", "layer0_step", n) for n in range(1, steps + 1)]
    captures += [Capture(f"logits_{n}", vector(), "step", "logits", n) for n in range(5)]
    return captures


def _write(directory, captures, layer_steps: int, exclude=None, dropped: int = 0):
    manifest = factory.manifest_for(captures, source_dtype="float32")
    manifest["config"]["layer_steps"] = layer_steps
    if exclude is not None:
        manifest["exclude"] = exclude
    if dropped:
        manifest["tags"]["layer0_step_<n>"]["drops"] = {"layer_steps": dropped}
    return factory.write_compiledump(directory, captures, manifest=manifest)


@pytest.mark.parametrize("exclude, dropped, excluded_keys, past_keys, problems", [
    # RUN left layer<i>_mlp out and kept 2 layer states (steps 3-4 counted dropped)
    (["layer{i}_mlp"], 2, ["layer0_mlp"], ["layer0_step_3", "layer0_step_4"], ["layer3_step", "foo"]),
    # ... and layer 0 too: its states go with it (the first reason that applies wins)
    (["layer{i}_mlp", "layer0"], 2, ["layer0_mlp", "layer0_step_3", "layer0_step_4"], [], ["layer3_step", "foo"]),
    # No exclude; RUN ran 2 decode steps only (nothing dropped): its missing states are problems
    (None, 0, [], [], ["layer0_mlp", "layer3_step", "foo", "layer0_step_3", "layer0_step_4"]),
])
def test_one_note_per_reason_and_a_problem_for_the_rest(tmp_path, exclude, dropped, excluded_keys, past_keys,
                                                         problems):
    rng = np.random.default_rng(3)
    ref_captures = _captures(rng, steps=4, mlp=True, extra=True)
    by_key = {c.key: c for c in ref_captures}
    run_captures = [by_key[c.key] for c in _captures(rng, steps=2, mlp=False, extra=False)]  # same values
    ref = _write(tmp_path / "ref", ref_captures, layer_steps=16)
    run = _write(tmp_path / "run", run_captures, layer_steps=2 if dropped else 16, exclude=exclude, dropped=dropped)
    for swapped in (False, True):
        report = compare(run, ref) if swapped else compare(ref, run)
        (pair,) = report.pairs
        holder, other = ("RUN", "REF") if swapped else ("REF", "RUN")
        kind = "extra_in_run" if swapped else "missing_in_run"
        assert sorted((p.kind, p.key) for p in pair.problems) == sorted((kind, key) for key in problems)
        excluded = [n for n in pair.notes if "instrument(exclude=" in n]
        past = [n for n in pair.notes if "COMPILEDUMP_LAYER_STEPS (" in n]
        if excluded_keys:
            assert excluded == [f"{holder} has {len(excluded_keys)} keys whose tags {other}'s instrument(exclude="
                                f"{tuple(exclude)!r}) left out: not compared ({', '.join(excluded_keys)}); a bug inside "
                                "those modules is seen only where it moves later keys past their thresholds"]
        else:
            assert excluded == []
        if past_keys:
            caps = "REF 2, RUN 16" if swapped else "REF 16, RUN 2"
            assert past == [f"{holder} has 2 layer-state keys at steps past {other}'s COMPILEDUMP_LAYER_STEPS "
                            f"({caps}): not compared; set the same COMPILEDUMP_LAYER_STEPS on both sides to compare "
                            f"them ({', '.join(past_keys)})"]
        else:
            assert past == []
        # What both hold is compared, equal.
        compared = {record.key for record in pair.keys}
        assert compared == {"layer0", "layer0_step_1", "layer0_step_2", *(f"logits_{n}" for n in range(5))}
        assert report.first_divergence is None


@pytest.mark.parametrize("ref_setting", [2, 3])
def test_tags_an_older_reference_filtered_at_the_same_setting_are_one_note(tmp_path, ref_setting):
    """A reference recorded before 2026-12-06 filtered a dense layer's `_mlp` past layer 1 (its
    manifest's `filtered_tags` says so); a run recorded now holds it. Not a problem per key."""
    rng = np.random.default_rng(7)
    run = _captures(rng, steps=2, mlp=True, extra=False)
    run = [*run, *(Capture(f"layer{i}_mlp", c.array.copy(), "record", f"layer{i}_mlp")
                   for i, c in zip((2, 3), run[:2]))]
    ref = [c for c in run if c.tag not in ("layer2_mlp", "layer3_mlp")]
    ref_manifest = factory.manifest_for(ref, source_dtype="float32")
    ref_manifest["filtered_tags"] = {"layer2_mlp": "moe_layers", "layer3_mlp": "moe_layers"}
    ref_manifest["config"]["moe_layers"] = ref_setting
    ref_path = factory.write_compiledump(tmp_path / "ref", ref, manifest=ref_manifest)
    run_manifest = factory.manifest_for(run, source_dtype="float32")
    run_path = factory.write_compiledump(tmp_path / "run", run, manifest=run_manifest)
    report = compare(ref_path, run_path)
    assert report.exit_status == 0 and report.problems == []
    (note,) = [note for note in report.pairs[0].notes if "filter" in note and "RUN has 2 keys" in note]
    same = ref_setting == 2
    assert ("RUN's filter did not drop them" in note) == same
    assert ("(REF 3, RUN 2) filtered" in note) == (not same)


def test_ids_a_side_recorded_and_lost_are_a_loss_not_a_gate_without_ids(tmp_path):
    """RUN's gate gave its expert ids, but they were lost (arena_full): the comparator used to take
    the missing key for a gate returning logits alone, derive RUN's ids from its logits and list
    no problem. The manifest counts the loss: a problem says so, and nothing is derived."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 8)).astype(np.float32)
    ids = np.argsort(-logits, axis=1)[:, :2].astype(np.int32)
    hidden = rng.standard_normal(17).astype(np.float32)
    ref = [Capture("layer0_router", logits, "record", "layer0_router"), Capture("layer0_topk", ids, "ids", "layer0_topk"),
           Capture("layer0", hidden, "record", "layer0")]
    run = [ref[0], ref[2]]
    run_manifest = factory.manifest_for(run, source_dtype="float32", key_fields={"layer0_router": {"rows": "all"}})
    run_manifest["tags"]["layer0_topk"] = {"tag": "layer0_topk", "kind": "ids", "order": 1, "calls": 1, "passed": 1,
                                           "kept": 0, "drops": {"arena_full": 1}}
    paths = factory.write_pair(tmp_path, ref, run, run_manifest=run_manifest,
                               key_fields={"layer0_router": {"rows": "all"}})
    pair = compare(*paths).pairs[0]
    assert not any("no expert ids" in note for note in pair.notes)
    (problem,) = [p for p in pair.problems if p.key == "layer0_topk"]
    assert problem.kind == "missing_in_run" and "RUN dropped its calls: arena_full=1" in problem.detail
    # A gate that never recorded ids (no entry for the tag): its ids are derived, as before.
    del run_manifest["tags"]["layer0_topk"]
    paths = factory.write_pair(tmp_path / "gate", ref, run, run_manifest=run_manifest,
                               key_fields={"layer0_router": {"rows": "all"}})
    pair = compare(*paths).pairs[0]
    assert any("RUN recorded router logits but no expert ids for layer0_topk" in note for note in pair.notes)
    assert not [p for p in pair.problems if p.key == "layer0_topk"]


@pytest.mark.parametrize("lost", [None, "arena_full", "rows_gate_both"])
def test_a_run_that_ran_fewer_decode_steps_says_so_in_its_verdict(tmp_path, lost):
    """RUN's dump ends after decode step 2 of REF's 5 (a rank that hung, was stopped and flushed).
    Each missing step was a problem explained by RUN's prompt-phase drops ("RUN dropped its calls:
    suspended=4"), and the verdict read as a clean pass (a new user's TP bring-up). Now one note
    says RUN ran fewer decode steps, and the last line says how many step keys were not judged. A
    step lost to a full arena is still a problem per key."""
    captures = factory.model_captures(np.random.default_rng(4), layers=2, steps=5)
    ref_manifest = factory.manifest_for(captures)
    if lost == "rows_gate_both":  # a warm-up both sides skipped: no loss of RUN's
        for name in ("logits_<n>", "final_hidden_<n>"):
            ref_manifest["tags"][name]["drops"] = {"rows_gate": 1}
    ref = factory.write_compiledump(tmp_path / "ref", captures, manifest=ref_manifest)
    kept = [c for c in captures if c.step is None or c.step < 3]
    manifest = factory.manifest_for(kept)
    for name in ("logits_<n>", "final_hidden_<n>"):
        manifest["tags"][name]["drops"] = {"suspended": 4, **({"rows_gate": 1} if lost == "rows_gate_both" else
                                                               {lost: 2} if lost else {})}
    run = factory.write_compiledump(tmp_path / "run", kept, manifest=manifest)
    report = compare(ref, run)
    missing = sorted(p.key for p in report.problems if p.kind == "missing_in_run")
    last = format_report(report)[-1]
    assert report.first_divergence is None
    if lost != "arena_full":
        assert missing == []
        assert any("RUN ran fewer decode steps" in note and "final_hidden_3" in note for note in report.notes)
        assert "RUN ran fewer decode steps than REF (4 step keys of REF past them not judged)" in last
        assert report.to_json()["pairs"][0]["fewer_steps"].startswith("RUN ran fewer decode steps")
    else:
        assert missing == ["final_hidden_3", "final_hidden_4", "logits_3", "logits_4"]
        assert "fewer decode steps" not in last
