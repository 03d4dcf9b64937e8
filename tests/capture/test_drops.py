"""Acceptance 6: overflow, full arena, shape changes: no crash, every drop counted and warned once."""

import json
import warnings

import numpy as np
import pytest
import torch

import compiledump


def _flush(expect_warnings=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = compiledump.flush()
    messages = [str(w.message) for w in caught if "compiledump" in str(w.message)]
    with open(path.replace(".npz", ".json")) as handle:
        manifest = json.load(handle)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, manifest, messages


def _check_accounting(manifest):
    """Every call is either kept/overwritten (passed) or dropped for exactly one reason."""
    for name, info in manifest["tags"].items():
        if info["calls"] is None:
            continue
        dropped = sum(v for k, v in info["drops"].items() if k != "step_capacity")
        assert info["calls"] == info["passed"] + dropped, name


def test_more_steps_than_capacity(dump_dir):
    compiledump.configure(max_steps=4)
    rows = [torch.randn(3, 17) for _ in range(7)]
    for r in rows:
        compiledump.record_step("logits", r)
    arrays, manifest, messages = _flush()
    assert sorted(arrays) == [f"logits_{n}" for n in range(4)]
    for n in range(4):
        np.testing.assert_array_equal(arrays[f"logits_{n}"], rows[n][0].numpy())
    assert manifest["tags"]["logits_<n>"]["drops"] == {"step_capacity": 3}
    assert manifest["drops"] == {"step_capacity": 3}
    assert [m for m in messages if "step_capacity" in m] == [
        "compiledump: tag 'logits': 3 capture(s) dropped (step_capacity): raise COMPILEDUMP_MAX_STEPS (now 4); "
        "see the manifest's 'drops'"
    ]
    _check_accounting(manifest)
    # One warning per tag and reason: a second flush does not repeat it.
    compiledump.record_step("logits", rows[0])
    _, manifest, messages = _flush()
    assert manifest["drops"] == {"step_capacity": 4}
    assert messages == []


def test_full_arena(dump_dir):
    compiledump.configure(arena_mb=1)  # 262144 words
    big = torch.randn(2, 200_000)
    compiledump.record("big", big)
    compiledump.record("too_big", torch.randn(2, 100_000))
    compiledump.record("too_big", torch.randn(2, 100_000))
    compiledump.record("small", torch.randn(2, 1000))  # still fits after the refusal
    arrays, manifest, messages = _flush()
    assert sorted(arrays) == ["big", "small"]
    np.testing.assert_array_equal(arrays["big"], big[-1].numpy())
    assert manifest["tags"]["too_big"]["drops"] == {"arena_full": 2}
    (message,) = [m for m in messages if "arena_full" in m]
    assert message.startswith("compiledump: tag 'too_big': 2 capture(s) dropped (arena_full): raise "
                              "COMPILEDUMP_ARENA_MB (now 1), or keep fewer rows")
    _check_accounting(manifest)


def test_shape_change(dump_dir):
    first = torch.randn(4, 8)
    compiledump.record("h", first)
    compiledump.record("h", torch.randn(4, 9))
    compiledump.record_ids("ids", torch.randint(0, 9, (4, 2)))
    compiledump.record_ids("ids", torch.randint(0, 9, (4, 3)))  # same token count, other shape
    arrays, manifest, messages = _flush()
    np.testing.assert_array_equal(arrays["h"], first[-1].numpy())  # the kept shape's last write
    assert manifest["tags"]["h"]["drops"] == {"shape_changed": 1}
    assert manifest["tags"]["ids"]["drops"] == {"shape_changed": 1}
    assert sum("shape_changed" in m and "give each shape its own tag" in m for m in messages) == 2
    _check_accounting(manifest)


def test_tag_table_full(dump_dir):
    compiledump.configure(max_tags=2)
    for tag in ("a", "b", "c", "d"):
        compiledump.record(tag, torch.randn(2, 3))
    compiledump.record("c", torch.randn(2, 3))
    arrays, manifest, messages = _flush()
    assert sorted(arrays) == ["a", "b"]
    assert manifest["drops"]["tag_table_full"] == 3
    assert manifest["tags"]["c"]["drops"] == {"tag_table_full": None}
    assert any("'c': all captures dropped (tag_table_full): raise COMPILEDUMP_MAX_TAGS (now 2)" in m for m in messages)


def test_a_step_tag_past_the_table_keeps_the_entry_of_a_kept_record_of_its_name(dump_dir):
    """api.md's own pattern, `record("logits", once=True)` beside `record_step("logits")`: the step
    tag past the table is `logits_<n>`, and the kept record's entry, counts and key stay."""
    compiledump.configure(max_tags=2)
    x = torch.randn(3, 5)
    compiledump.record("logits", x, once=True)
    compiledump.record("other", x)
    for _ in range(2):
        compiledump.record_step("logits", x)
    arrays, manifest, messages = _flush()
    assert sorted(arrays) == ["logits", "other"]
    np.testing.assert_array_equal(arrays["logits"], x[-1].numpy())
    assert manifest["tags"]["logits"] == {**manifest["tags"]["logits"], "kind": "record_once", "kept": 1, "drops": {}}
    assert manifest["tags"]["logits_<n>"] == {"tag": "logits", "kind": "step", "order": None, "calls": None,
                                              "passed": 0, "kept": 0, "drops": {"tag_table_full": None}}
    assert manifest["drops"]["tag_table_full"] == 2
    assert [m for m in messages if "tag_table_full" in m] == [
        next(m for m in messages if "tag 'logits': all captures dropped (tag_table_full)" in m)]


def test_gates_and_suspension_are_counted(dump_dir):
    compiledump.configure(tokens=5)
    compiledump.record("h", torch.randn(5, 3))
    compiledump.record("h", torch.randn(2, 3))  # token gate
    compiledump.record_ids("ids", torch.randint(0, 4, (3, 2)))  # token gate, never kept
    compiledump.set_rows(4)
    compiledump.record_step("s", torch.randn(4, 3))  # rows gate
    compiledump.set_rows(1)
    with compiledump.profiling():
        compiledump.record("h", torch.randn(5, 3))
        compiledump.record_step("s", torch.randn(4, 3))
    compiledump.record_step("s", torch.randn(4, 3))
    arrays, manifest, messages = _flush()
    assert sorted(arrays) == ["h", "s_0"]
    assert manifest["tags"]["h"]["drops"] == {"token_gate": 1, "suspended": 1}
    assert manifest["tags"]["ids"]["drops"] == {"token_gate": 1}
    assert manifest["tags"]["s_<n>"]["drops"] == {"rows_gate": 1, "suspended": 1}
    assert messages[0] == "compiledump: captures skipped by filters (rows_gate: 1, suspended: 2, token_gate: 2)"
    # A tag the gate skipped every time is named, with the fix; "h" kept a capture, so it is not.
    assert len(messages) == 2 and messages[1].startswith(
        "compiledump: nothing kept of tag(s) 'ids': the token gate (COMPILEDUMP_TOKENS) skipped every capture, "
        "whose first dim was never the prompt's 5 token rows. Record a decode-only value with record_step")
    _check_accounting(manifest)


def test_row_out_of_range_is_counted_not_read(dump_dir):
    compiledump.set_gather_rows(record=6)
    compiledump.record("h", torch.randn(3, 4))
    compiledump.set_gather_rows(record=1)
    x = torch.randn(3, 4)
    compiledump.record("h", x)
    arrays, manifest, messages = _flush()
    np.testing.assert_array_equal(arrays["h"], x[1].numpy())
    assert manifest["tags"]["h"]["drops"] == {"row_out_of_range": 1}
    assert any("row_out_of_range" in m for m in messages)


@pytest.mark.parametrize("compiled", [False, True])
def test_overflow_under_compile(dump_dir, compiled):
    compiledump.configure(max_steps=3)

    def step(x):
        compiledump.record_step("s", x)
        return x + 1

    fn = torch.compile(step, fullgraph=True) if compiled else step
    for _ in range(5):
        fn(torch.randn(2, 6))
    arrays, manifest, _ = _flush()
    assert sorted(arrays) == ["s_0", "s_1", "s_2"]
    assert manifest["tags"]["s_<n>"]["calls"] == 5
    assert manifest["tags"]["s_<n>"]["drops"] == {"step_capacity": 2}


def test_profile_run_shapes_do_not_claim_the_region(dump_dir):
    """An engine's profile run (inside profiling(), other token count) must not fix the payload
    shape: the first real capture does (no token gate set here)."""
    with compiledump.profiling():
        compiledump.record_ids("layer0_topk", torch.randint(0, 8, (11, 2)))
    ids = torch.randint(0, 8, (7, 2))
    compiledump.record_ids("layer0_topk", ids)
    arrays, manifest, _ = _flush()
    np.testing.assert_array_equal(arrays["layer0_topk"], ids.numpy())
    assert manifest["tags"]["layer0_topk"]["drops"] == {"suspended": 1}
