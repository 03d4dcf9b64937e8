"""Phase honesty: values of different phases or token counts are "not comparable", never a divergence.

End to end first: a padded-decode engine against a batch-1 reference, the built-in model, both
dumped by the capture runtime. With the token gate off, `record` keeps each side's last write, a
decode step of one token (reference) or of a padded batch of four whose last row is padding
(engine): never a divergence, "not comparable" with the fix, exit 3. With the default
(COMPILEDUMP_TOKENS=auto) both keep the prompt: no divergence, exit 0.

Then the comparator alone, on synthetic dumps whose manifests say each key's phase and token count
(issue 13): the report's reasons, the fix it names, mixed phases within one side, and the control
without those fields (a false divergence).
"""

import json
from pathlib import Path

import numpy as np
import pytest

import compiledump
from compiledump.cli import main
from compiledump.demo.model import ModelConfig, TinyMoE, make_session, run_session
from helpers import dumpfactory as factory
from helpers.cli import compare_json
from helpers.dumpfactory import write_pair

CFG = ModelConfig(layers=3, captures_per_layer=3)


def _dumps(tmp_path, tokens):
    session = make_session(CFG, prompt_len=7, steps=4, pad_rows=3)
    reference_session = type(session)(prompt=session.prompt, decode_tokens=session.decode_tokens,
                                      pad_tokens=session.pad_tokens[:, :0], pad_state=session.pad_state[:, :0],
                                      profile_tokens=session.profile_tokens)
    paths = []
    for name, run, engine in (("reference", reference_session, False), ("engine", session, True)):
        compiledump.reset()
        compiledump.configure(dir=str(tmp_path / name), tokens=tokens, moe_layers=CFG.layers)
        run_session(TinyMoE(CFG, dump=compiledump), compiledump, run, engine=engine)
        paths.append(compiledump.flush())
    return paths


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_token_gate_off_is_not_comparable(dump_dir, tmp_path, capsys):
    reference, engine = _dumps(tmp_path, tokens=0)
    manifest = json.loads(Path(engine).with_suffix(".json").read_text())
    assert (manifest["keys"]["layer1"]["tokens"], manifest["keys"]["layer1"]["phase"]) == (4, "decode")
    assert (manifest["keys"]["layer1_topk"]["tokens"], manifest["keys"]["layer1_topk"]["phase"]) == (7, "prefill")
    assert main(["compare", reference, engine]) == 3
    out = capsys.readouterr().out
    assert "first divergence" not in out and "COMPILEDUMP_TOKENS" in out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_default_auto_gate_keeps_the_prompt(dump_dir, tmp_path, capsys):
    reference, engine = _dumps(tmp_path, tokens="auto")
    manifest = json.loads(Path(engine).with_suffix(".json").read_text())
    assert manifest["prompt_tokens"] == 7 and manifest["keys"]["layer1"]["phase"] == "prefill"
    assert main(["compare", reference, engine]) == 0
    assert "no divergence" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# The comparator alone, on synthetic dumps
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def captures():
    return factory.model_captures(np.random.default_rng(1300))


def decode_pair(tmp_path: Path, captures, prompt: int | None, ref_tokens: int, run_tokens: int, diverge_step=None):
    """REF and RUN whose record keys hold values of different calls (independent random data, so a
    comparison would diverge); ids hold the prompt's on both sides."""
    rng = np.random.default_rng(6)
    run = factory.perturb(captures, rng, noise=1e-7, from_step=diverge_step)
    run = [factory.replace(c, array=(rng.standard_normal(c.array.shape) * 2).astype(np.float32))
           if c.kind in ("record",) else c for c in run]
    ids_tokens = captures[[c.key for c in captures].index("layer0_topk")].array.shape[0]
    ref_manifest = factory.manifest_for(captures, source_dtype="float32", prompt_tokens=prompt,
                                        key_fields=factory.call_fields(captures, ref_tokens, ids_tokens, prompt))
    run_manifest = factory.manifest_for(run, source_dtype="float32", prompt_tokens=prompt,
                                        key_fields=factory.call_fields(run, run_tokens, ids_tokens, prompt))
    return write_pair(tmp_path, captures, run, ref_manifest=ref_manifest, run_manifest=run_manifest), run


def test_padded_decode_with_the_gate_off_is_not_comparable_and_says_how_to_fix_it(tmp_path, capsys, captures):
    # COMPILEDUMP_TOKENS=0 on both sides: no prompt length known; the reference's last write is a
    # batch-1 decode step, the engine's a padded batch of 4 whose last row is padding.
    (ref_path, run_path), _ = decode_pair(tmp_path, captures, prompt=None, ref_tokens=1, run_tokens=4)
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 3 and report["exit_status"] == 3
    assert report["first_divergence"] is None and report["prefill_divergence"] is None
    assert not any(line.startswith(("first divergence", "prefill:")) for line in out)
    records = [c.key for c in captures if c.kind == "record"]  # record_once (logits) kept the prefill's
    assert sorted(item["key"] for item in report["not_comparable"]) == sorted(records)
    item = report["not_comparable"][0]
    assert (item["tokens_ref"], item["tokens_run"], item["phase_ref"], item["phase_run"]) == (1, 4, None, None)
    assert item["reason"] == "REF value from a call of 1 token, RUN value from a call of 4 tokens"
    (line,) = [line for line in out if line.startswith("not comparable:")]
    assert line.startswith(f"not comparable: {len(records)} keys hold values of different phases or token counts "
                           f"({len(records)} x REF call of 1 token vs RUN call of 4 tokens)")
    assert "COMPILEDUMP_TOKENS=<prompt length>" in line and "default auto (not 0) on both sides" in line
    assert out[-1].startswith(f"no divergence: {report['compared']} keys compared; closest: ")
    assert f"; {len(records)} keys NOT COMPARABLE (see above)" in out[-1]
    # Both sides mix phases: their record keys hold decode calls, their ids the prompt's 3 tokens.
    mixed = [problem for problem in report["problems"] if problem["kind"] == "mixed_phases"]
    assert [problem["side"] for problem in mixed] == ["REF", "RUN"]
    assert "12 record keys hold a call of 4 tokens while the ids of their layers hold a call of 3 tokens" in \
        mixed[1]["detail"]
    by_key = {record["key"]: record for record in report["keys"]}
    assert by_key["layer0"]["status"] == "not_comparable" and "rel_diff" not in by_key["layer0"]
    assert by_key["layer0_topk"]["status"] == "ok"  # ids of the same call on both sides are compared
    assert by_key["logits"]["status"] == "ok"


def test_without_the_phase_fields_the_same_pair_is_a_false_divergence(tmp_path, capsys, captures):
    """The control for the test above: the manifest fields are what makes the difference."""
    (ref_path, run_path), _ = decode_pair(tmp_path, captures, prompt=None, ref_tokens=1, run_tokens=4)
    for path in (ref_path, run_path):
        manifest = json.loads(path.with_suffix(".json").read_text())
        for entry in manifest["keys"].values():
            entry.pop("tokens", None)
            entry.pop("phase", None)
        path.with_suffix(".json").write_text(json.dumps(manifest))
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 1 and report["not_comparable"] == [] and report["first_divergence"]["key"] == "embed"


def test_prefill_against_decode_names_the_phases_and_the_prompt_length(tmp_path, capsys, captures):
    (ref_path, run_path), _ = decode_pair(tmp_path, captures, prompt=3, ref_tokens=3, run_tokens=4)
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 3
    assert report["not_comparable"][0]["reason"] == ("REF value from the prefill (3 tokens), RUN value from the "
                                                     "decode (4 tokens)")
    (line,) = [line for line in out if line.startswith("not comparable:")]
    assert "REF prefill of 3 tokens vs RUN decode of 4 tokens" in line
    assert "COMPILEDUMP_TOKENS=3 (the prompt length)" in line
    mixed = [problem for problem in report["problems"] if problem["kind"] == "mixed_phases"]
    assert [problem["side"] for problem in mixed] == ["RUN"]  # REF's record keys match its ids


def test_prompts_of_different_lengths_are_named_not_the_token_gate(tmp_path, capsys, captures):
    """Both sides at COMPILEDUMP_TOKENS=auto, each prefill its own prompt's (3 and 4 tokens): the
    fix is the same prompt on both sides, which each manifest's prompt_tokens shows; no setting of
    the token gate would make these values comparable."""
    rng = np.random.default_rng(6)
    run = [factory.replace(c, array=(rng.standard_normal(c.array.shape) * 2).astype(np.float32))
           if c.kind == "record" else c for c in captures]
    manifests = [factory.manifest_for(side, source_dtype="float32", prompt_tokens=prompt,
                                      key_fields=factory.call_fields(side, prompt, prompt, prompt))
                 for side, prompt in ((captures, 3), (run, 4))]
    ref_path, run_path = write_pair(tmp_path, captures, run, ref_manifest=manifests[0], run_manifest=manifests[1])
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 3
    assert (report["pairs"][0]["prompt_tokens_ref"], report["pairs"][0]["prompt_tokens_run"]) == (3, 4)
    (line,) = [line for line in out if line.startswith("not comparable:")]
    assert "REF prefill of 3 tokens vs RUN prefill of 4 tokens" in line, line
    assert line.endswith("fix: compare runs of the same prompt, each prefilled whole in one unpadded forward (REF's "
                         "prompt call has 3 tokens, RUN's 4 tokens)"), line
    assert "COMPILEDUMP_TOKENS" not in line


def test_a_divergence_among_comparable_keys_still_exits_1(tmp_path, capsys, captures):
    (ref_path, run_path), _ = decode_pair(tmp_path, captures, prompt=3, ref_tokens=3, run_tokens=4, diverge_step=2)
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 1 and report["first_divergence"]["step"] == 2 and len(report["not_comparable"]) > 0


def test_steps_are_compared_whatever_their_batch(tmp_path, capsys, captures):
    # A decode step is one row of its batch by construction: batch 1 against a padded batch is fine.
    rng = np.random.default_rng(7)
    run = factory.perturb(captures, rng, noise=1e-7)
    steps = {c.key: {"tokens": 1} for c in captures if c.kind == "step"}
    ref_manifest = factory.manifest_for(captures, source_dtype="float32", key_fields=steps)
    run_manifest = factory.manifest_for(run, source_dtype="float32",
                                        key_fields={key: {"tokens": 4} for key in steps})
    ref_path, run_path = write_pair(tmp_path, captures, run, ref_manifest=ref_manifest, run_manifest=run_manifest)
    code, _, report = compare_json(capsys, ref_path, run_path)
    assert code == 0 and report["not_comparable"] == [] and report["compared"] == len(captures)


def test_keys_the_other_sides_moe_filter_dropped_are_one_note_naming_the_setting(tmp_path, capsys, captures):
    """REF recorded layers 0-4's internals (COMPILEDUMP_MOE_LAYERS=5), RUN only layer 0's (1): the
    keys of layers 1-4 that RUN's filter dropped (every layer's output is kept) are one note naming
    both settings, not a problem per key; a key RUN lacks for another reason is still a problem;
    the rest is compared as before."""
    rng = np.random.default_rng(8)
    internals = [c.key for c in captures if c.key.startswith(("layer1_", "layer2_", "layer3_", "layer4_"))]
    lost = "final_norm"  # missing on RUN, not filtered
    run = [c for c in factory.perturb(captures, rng, noise=1e-7) if c.key not in internals and c.key != lost]
    ref_manifest = factory.manifest_for(captures, source_dtype="float32")
    ref_manifest["config"]["moe_layers"] = 5
    run_manifest = factory.manifest_for(run, source_dtype="float32",
                                        filtered_tags={key: "moe_layers" for key in internals})
    run_manifest["config"]["moe_layers"] = 1
    ref_path, run_path = write_pair(tmp_path, captures, run, ref_manifest=ref_manifest, run_manifest=run_manifest)
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 0
    problems = report["problems"]
    assert [(p["kind"], p["key"]) for p in problems if p["kind"] in ("missing_in_run", "extra_in_run")] == [
        ("missing_in_run", lost)]
    (line,) = [line for line in out if "filtered: not compared" in line]
    assert len(internals) == 8 and {"layer1", "layer4"} <= {record["key"] for record in report["keys"]}
    assert line == (f"note: REF has {len(internals)} keys whose tags RUN's COMPILEDUMP_MOE_LAYERS (REF 5, RUN 1) "
                    f"filtered: not compared; set the same COMPILEDUMP_MOE_LAYERS on both sides to compare them "
                    f"({', '.join(internals[:4])}, ... ({len(internals) - 4} more))"), line


@pytest.mark.parametrize("steps", [0, 3])
def test_no_divergence_over_the_prompt_alone_says_no_decode_step_was_recorded(tmp_path, capsys, steps):
    """Taps without record_step (defaults=False) record the prompt's call only: later forwards'
    calls are token-gated. "no divergence" must not read as covering them."""
    captures = factory.model_captures(np.random.default_rng(41), layers=3, steps=steps)
    manifests = []
    for later in (12, 15):
        manifest = factory.manifest_for(captures)
        manifest["drops"] = {"token_gate": later + 7}
        manifest["tags"]["layer1"].update(kept=1, drops={"token_gate": later})  # later forwards' calls
        manifest["tags"]["final_norm"].update(kept=0, drops={"token_gate": 7})  # never the token count
        manifests.append(manifest)
    ref_path, run_path = write_pair(tmp_path, captures, factory.perturb(captures, np.random.default_rng(2), 1e-9),
                                    ref_manifest=manifests[0], run_manifest=manifests[1])
    code, out, _ = compare_json(capsys, ref_path, run_path)
    said = "the prompt's keys only: no decode step recorded, other forwards' calls skipped by the token gate " \
           "(REF 12, RUN 15)"
    assert code == 0 and out[-1].startswith("no divergence:")
    assert (said in out[-1]) == (steps == 0), out[-1]


def test_a_tag_the_token_gate_never_kept_is_no_sign_of_later_forwards(tmp_path, capsys):
    """One forward per side; a tag whose first dim is never the token count is gated within it."""
    captures = factory.model_captures(np.random.default_rng(41), layers=3, steps=0)
    manifest = factory.manifest_for(captures)
    manifest["drops"] = {"token_gate": 1}
    manifest["tags"]["final_norm"].update(kept=0, drops={"token_gate": 1})
    ref_path, run_path = write_pair(tmp_path, captures, captures, ref_manifest=manifest, run_manifest=manifest)
    code, out, report = compare_json(capsys, ref_path, run_path)
    assert code == 0 and "no decode step recorded" not in out[-1]
    assert report["pairs"][0]["not_captured"]["REF"]["gated_after_kept"] == 0
