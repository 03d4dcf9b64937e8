"""All-rows keys (``rows: "all"``): judged per token row, against a one-row key, and the row metrics against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compiledump import compare as cmp
from compiledump.compare.metrics import compare_rows
from helpers import dumpfactory as factory
from helpers.cli import compare_json
from helpers.dumpfactory import scaled, write_pair
from helpers.reference_metrics import norm_diff, rel_diff, row_metrics


@pytest.fixture
def captures():
    return factory.model_captures(np.random.default_rng(1300))


def test_all_rows_keys_are_judged_per_token_row(tmp_path, capsys, captures):
    rng = np.random.default_rng(10)
    rows = (rng.standard_normal((7, 48)) * 2 + 0.3).astype(np.float32)
    ref = captures[:4] + [factory.Capture("layer1_h", rows, "record", "layer1_h")] + captures[4:]
    run = factory.perturb(ref, rng, noise=1e-7)
    run = scaled(scaled(run, "layer1_h", 1.06, row=2), "layer1_h", 0.95, row=5)
    fields = {"layer1_h": {"rows": "all", "tokens": 7, "phase": "prefill"}}
    ref_path, run_path = write_pair(tmp_path, ref, run, "bfloat16", "bfloat16", key_fields=fields)
    x, y = rows, run[4].array
    # Over the whole key, the two rows are diluted below both bf16 thresholds: only rows tell.
    assert rel_diff(x, y) < 1e-3 and norm_diff(x, y) < 2e-2
    code, out, report = compare_json(capsys, ref_path, run_path)
    first = report["first_divergence"]
    assert code == 1 and first["key"] == "layer1_h" and first["divergent_rows"] == [2, 5] and first["row_count"] == 7
    assert first["metric"] == "norm_diff"
    row_rel, row_norm = row_metrics(x, y)
    assert first["value"] == pytest.approx(max(row_norm), rel=1e-9)
    assert "layer1_h (layer 1): norm_diff" in out[-1]
    assert out[-1].split("; last good")[0].endswith("at tokens 2, 5 of 7")
    record = {r["key"]: r for r in report["keys"]}["layer1_h"]
    assert record["row_rel_diff"] == pytest.approx(row_rel, rel=1e-9)
    assert record["row_norm_diff"] == pytest.approx(row_norm, rel=1e-9)
    # Without rows == "all" the same key is one vector and passes.
    plain = factory.write_compiledump(tmp_path / "plain", run, manifest=factory.manifest_for(run))
    assert cmp.compare(factory.write_compiledump(tmp_path / "plainref", ref), plain).exit_status == 0


@pytest.mark.parametrize("all_rows_side", ["ref", "run"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_row_against_all_rows_is_compared_at_the_last_row(tmp_path, capsys, captures, all_rows_side, dtype):
    """A one-row key holds the prompt's last row: against an all-rows key of the same tag (a
    dump of instrument's router_rows="all" against an older one) it is compared with that row,
    and said so, instead of skipped as a shape mismatch. Earlier rows cannot matter."""
    rng = np.random.default_rng(12)
    rows = (rng.standard_normal((9, 13)) * 1.5 + 0.2).astype(dtype).astype(np.float32)
    others = factory.perturb(captures, rng, noise=1e-7)
    wide = rows.copy()
    wide[3] *= 1.5  # far off in an earlier row: not what the one-row side holds
    for scale, divergent in ((1.0 + 1e-5, False), (1.05, True)):
        last = (rows[-1] * scale).astype(np.float32)
        one, every = factory.Capture("layer1_h", last, "record", "layer1_h"), \
            factory.Capture("layer1_h", wide, "record", "layer1_h")
        mine = {"ref": every, "run": one}
        ref, run = captures[:4] + [mine["ref"] if all_rows_side == "ref" else mine["run"]] + captures[4:], \
            others[:4] + [mine["run"] if all_rows_side == "ref" else mine["ref"]] + others[4:]
        ref_fields = {"layer1_h": {"tokens": 9, "phase": "prefill", **({"rows": "all"} if all_rows_side == "ref" else {})}}
        run_fields = {"layer1_h": {"tokens": 9, "phase": "prefill", **({"rows": "all"} if all_rows_side == "run" else {})}}
        ref_path, run_path = write_pair(tmp_path / f"{scale}", ref, run,
                                        ref_manifest=factory.manifest_for(ref, key_fields=ref_fields),
                                        run_manifest=factory.manifest_for(run, key_fields=run_fields))
        code, _, report = compare_json(capsys, ref_path, run_path)
        record = {r["key"]: r for r in report["keys"]}["layer1_h"]
        x, y = (wide[-1], last) if all_rows_side == "ref" else (last, wide[-1])
        assert record["rel_diff"] == pytest.approx(rel_diff(x, y), rel=1e-9)
        assert record["norm_diff"] == pytest.approx(norm_diff(x, y), rel=1e-9)
        assert "row_rel_diff" not in record and record["divergent"] is divergent and code == (1 if divergent else 0)
        (problem,) = [p for p in report["problems"] if p["key"] == "layer1_h"]
        shapes = "[9, 13] vs [13]" if all_rows_side == "ref" else "[13] vs [9, 13]"
        assert problem["kind"] == "shape_mismatch" and problem["detail"] == (
            f"{shapes}: one row against all rows, compared at the last row (the row a one-row record keeps)")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_compare_rows_matches_numpy_in_small_chunks(dtype):
    rng = np.random.default_rng(11)
    # Rows of very different norms, a non-contiguous view, values of the dtype (bf16 by rounding).
    x = (rng.standard_normal((9, 26)) * rng.uniform(0.05, 3.0, (9, 1)))[:, ::2]
    y = x * rng.uniform(0.9, 1.1, (9, 1)) + rng.standard_normal((9, 13)) * 0.01
    if dtype == "bfloat16":
        x, y = (torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16).float().numpy() for v in (x, y))
    else:
        x, y = x.astype(dtype), y.astype(dtype)
    expected_rel, expected_norm = row_metrics(x, y)
    for chunk in (1, 13, 40, 1 << 20):
        rows = compare_rows(x, y, chunk=chunk)
        assert rows.rel_diff == pytest.approx(expected_rel, rel=1e-9)
        assert rows.norm_diff == pytest.approx(expected_norm, rel=1e-9)
    # Rows at or above the median norm are judged by their own norm, as a one-row key is.
    median = np.median(np.linalg.norm(x.astype(np.float64), axis=1))
    for i in np.flatnonzero(np.linalg.norm(x.astype(np.float64), axis=1) >= median):
        assert rows.rel_diff[i] == pytest.approx(rel_diff(x[i], y[i]), rel=1e-9)
        assert rows.norm_diff[i] == pytest.approx(norm_diff(x[i], y[i]), rel=1e-9)


def test_a_row_small_by_cancellation_is_judged_at_the_keys_scale(tmp_path, capsys, captures):
    """Eight router logits of one token can nearly cancel: the same absolute rounding error is
    then a large error relative to that row. Rows are judged relative to the larger of their own
    norm and the median row norm, so that row passes while a 5 % error of a typical row does not."""
    rng = np.random.default_rng(13)
    rows = rng.standard_normal((11, 8)).astype(np.float32)
    rows[4] *= 0.05  # small by cancellation
    noise = rng.standard_normal((11, 8)).astype(np.float32) * 0.01  # the same absolute error in every row
    fields = {"layer1_router": {"rows": "all", "tokens": 11, "phase": "prefill"}}
    for bad_row, expected in ((None, []), (7, [7])):
        run_rows = rows + noise
        if bad_row is not None:
            run_rows[bad_row] = rows[bad_row] * 1.05
        ref = captures[:4] + [factory.Capture("layer1_router", rows, "record", "layer1_router")] + captures[4:]
        run = captures[:4] + [factory.Capture("layer1_router", run_rows, "record", "layer1_router")] + captures[4:]
        # Judged against its own norm alone, row 4 would be far over both bf16 thresholds.
        assert rel_diff(rows[4], run_rows[4]) > 1e-2 and norm_diff(rows[4], run_rows[4]) > 3e-2
        ref_path, run_path = write_pair(tmp_path / str(bad_row), ref, run, "bfloat16", "bfloat16", key_fields=fields)
        code, _, report = compare_json(capsys, ref_path, run_path)
        record = {r["key"]: r for r in report["keys"]}["layer1_router"]
        assert record["divergent_rows"] == expected and code == (1 if expected else 0)
        assert record["row_rel_diff"] == pytest.approx(row_metrics(rows, run_rows)[0], rel=1e-9)


def _step_router_pair(tmp_path, rows, steps, run_steps, prompt_fields):
    """A dump pair holding layer 1's prompt router logits `rows` (REF and RUN alike) and its step
    router logits `steps` (REF) / `run_steps` (RUN), no ids beside them: judged as float32 step keys."""
    def side(step_rows):
        return [factory.Capture("layer1_router", rows, "record", "layer1_router")] + [
            factory.Capture(f"layer1_step_router_{n}", row, "step", "layer1_step_router", n)
            for n, row in enumerate(step_rows)]
    fields = {"layer1_router": {"tokens": len(rows), "phase": "prefill", **prompt_fields}}
    return write_pair(tmp_path, side(steps), side(run_steps), "float32", "float32", key_fields=fields)


@pytest.mark.parametrize("width", [8, 13])
def test_a_steps_row_small_by_cancellation_is_judged_at_the_prompts_scale(tmp_path, capsys, width):
    """A decode step holds one token's row: its 8 router logits can nearly cancel as a prompt
    row's can. Judged against its own norm alone, the same row read as divergent at step 0 (which
    repeats the prompt's last row) and as within the thresholds in the all-rows prompt key
    (sweep_routing: 4 honest bf16 MoE pairs). A step row is judged relative to the larger of its
    own norm and the median REF row of the prompt's all-rows key at the same point; a typical
    row's bug and a small row's 5 % error still diverge, and without an all-rows prompt key
    nothing changes."""
    rng = np.random.default_rng(14)
    rows = rng.standard_normal((9, width)).astype(np.float32)
    rows[-1] *= 0.02  # the prompt's last token: small by cancellation
    steps = np.stack([rows[-1], rng.standard_normal(width) * 3, rng.standard_normal(width) * 0.02]).astype(np.float32)
    noise = lambda shape: (rng.standard_normal(shape) * 1e-5).astype(np.float32)  # noqa: E731  the same absolute error
    run_rows, run_steps = rows + noise(rows.shape), steps + noise(steps.shape)
    run_steps[0] = run_rows[-1]
    expected_rel, expected_norm = row_metrics(rows, run_rows)
    m2 = np.median(np.sum(rows.astype(np.float64) ** 2, axis=1))
    for n in (0, 2):  # alone, far over the fp32 thresholds
        assert rel_diff(steps[n], run_steps[n]) > 1e-8 or norm_diff(steps[n], run_steps[n]) > 1e-5
    code, _, report = compare_json(capsys, *_step_router_pair(tmp_path / "all", rows, steps, run_steps, {"rows": "all"}))
    keys = {r["key"]: r for r in report["keys"]}
    assert code == 0 and [keys[f"layer1_step_router_{n}"]["divergent"] for n in range(3)] == [False] * 3
    # Step 0 reads as the prompt's last row does; each step as numpy's row rule with the prompt's median.
    assert keys["layer1_step_router_0"]["rel_diff"] == pytest.approx(expected_rel[-1], rel=1e-9)
    assert keys["layer1_step_router_0"]["norm_diff"] == pytest.approx(expected_norm[-1], rel=1e-9)
    x, y = steps[2].astype(np.float64), run_steps[2].astype(np.float64)
    assert keys["layer1_step_router_2"]["rel_diff"] == pytest.approx(
        np.sum((x - y) ** 2) / max(x @ x + y @ y, 2 * m2), rel=1e-9)
    assert keys["layer1_step_router_2"]["norm_diff"] == pytest.approx(
        abs(np.linalg.norm(y) - np.linalg.norm(x)) / max(np.linalg.norm(x), np.sqrt(m2)), rel=1e-9)
    assert keys["layer1_step_router_2"]["scale_from"] == "layer1_router" and "scale_from" not in keys[
        "layer1_step_router_1"]  # a typical row keeps its own norm
    # Bugs: a typical row scaled by 1.001, the small row off by 5 %.
    for n, scale in ((1, 1.001), (2, 1.05)):
        bad = run_steps.copy()
        bad[n] = steps[n] * scale
        code, _, report = compare_json(capsys, *_step_router_pair(tmp_path / f"bug{n}", rows, steps, bad, {"rows": "all"}))
        assert code == 1 and report["first_divergence"]["key"] == f"layer1_step_router_{n}"
    # The prompt key holds its last row only (one-row mode): the step keeps its own norm.
    code, _, report = compare_json(capsys, *_step_router_pair(tmp_path / "one", rows[-1], steps, run_steps, {}))
    assert code == 1 and report["first_divergence"]["key"] == "layer1_step_router_0"


def test_a_two_row_prompt_with_a_sink_row_does_not_hide_a_decode_only_bug(tmp_path, capsys):
    """The median of an even count is the lower middle row's: of a 2-token prompt whose first row
    is an attention sink's (50x the norm), the other row's, not their mean, which would have
    taken every step's error relative to the sink and hidden a 30 % decode-only bug (a review's
    finding). The same rule holds for the prompt key's own rows (numpy reference)."""
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((2, 64)).astype(np.float32)
    prompt[0] *= 50.0
    steps = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
    bad = [step.copy() for step in steps]
    bad[1] = steps[1] + 0.3 * rng.standard_normal(64).astype(np.float32)
    run_prompt = prompt + (rng.standard_normal(prompt.shape) * 1e-3).astype(np.float32)

    def side(rows, step_rows):
        return [factory.Capture("layer3", rows, "record", "layer3")] + [
            factory.Capture(f"layer3_step_{n}", row, "step", "layer3_step", n) for n, row in enumerate(step_rows)]

    def manifest(captures):
        out = factory.manifest_for(captures, key_fields={"layer3": {"rows": "all", "tokens": 2, "phase": "prefill"}})
        out["routing"] = {"complete": True, "routed": []}  # dense: a step is judged at the prompt's thresholds
        return out
    ref, run = side(prompt, steps), side(run_prompt, bad)
    code, _, report = compare_json(capsys, *write_pair(tmp_path, ref, run, ref_manifest=manifest(ref),
                                                       run_manifest=manifest(run)))
    assert code == 1 and report["first_divergence"]["key"] == "layer3_step_1"
    record = {r["key"]: r for r in report["keys"]}["layer3"]
    assert record["row_rel_diff"] == pytest.approx(row_metrics(prompt, run_prompt)[0], rel=1e-9)
    assert record["row_norm_diff"] == pytest.approx(row_metrics(prompt, run_prompt)[1], rel=1e-9)


def test_a_merged_reference_gives_its_steps_the_prompts_scale(tmp_path):
    """Tensor parallelism replicates router logits on every rank: a REF merged from 2 ranks holds
    the prompt key twice, and its decode steps are judged at the prompt's row scale as a single
    process's are (one rank's copy; a review found the steps kept their own norm there)."""
    rng = np.random.default_rng(14)
    rows = rng.standard_normal((9, 8)).astype(np.float32)
    rows[-1] *= 0.02
    steps = np.stack([rows[-1], rng.standard_normal(8) * 0.02]).astype(np.float32)
    noise = lambda shape: (rng.standard_normal(shape) * 1e-5).astype(np.float32)  # noqa: E731
    run_rows, run_steps = rows + noise(rows.shape), steps + noise(steps.shape)
    up = rng.standard_normal(16).astype(np.float32)

    def side(prompt, step_rows, part=None):
        return [factory.Capture("layer0_up", up if part is None else np.array_split(up, 2)[part], "record", "layer0_up"),
                factory.Capture("layer1_router", prompt, "record", "layer1_router")] + [
            factory.Capture(f"layer1_step_router_{n}", row, "step", "layer1_step_router", n)
            for n, row in enumerate(step_rows)]
    fields = {"layer1_router": {"tokens": 9, "phase": "prefill", "rows": "all"}}
    run = side(run_rows, run_steps)
    run_path = factory.write_compiledump(tmp_path / "run", run, rank="x", pid=5, manifest=factory.manifest_for(
        run, "x", 5, source_dtype="float32", key_fields=fields))
    for rank in range(2):
        captures = side(rows, steps, rank)
        manifest = factory.manifest_for(captures, rank, pid=1000 + rank, source_dtype="float32", key_fields=fields)
        manifest["world_size"], manifest["parallel"] = 2, {"tp_rank": rank, "tp_size": 2}
        manifest["keys"]["layer0_up"]["shard"] = {"dim": 0, "how": "concat", "group": "tp"}
        factory.write_compiledump(tmp_path / "ref", captures, rank, 1000 + rank, manifest=manifest)
    report = cmp.compare(tmp_path / "ref", run_path)
    keys = {record.key: record for record in report.keys}
    assert report.exit_status == 0
    assert [keys[f"layer1_step_router_{n}"].scale_from for n in range(2)] == ["layer1_router"] * 2


@pytest.mark.parametrize("count", [1, 2, 7, 10])
def test_the_row_scale_is_the_lower_median_in_any_chunk(count):
    rng = np.random.default_rng(count)
    rows = (rng.standard_normal((count, 26)) * rng.uniform(0.1, 3.0, (count, 1)))[:, ::2].astype(np.float32)
    rows[0, 3] = np.inf  # non-finite positions count as 0
    squares = np.sort(np.sum(np.where(np.isfinite(rows), rows, 0.0).astype(np.float64) ** 2, axis=1))
    for chunk in (1, 13, 40, 1 << 20):
        assert compare_rows(rows, rows, chunk).scale == pytest.approx(squares[(count - 1) // 2], rel=1e-12)
