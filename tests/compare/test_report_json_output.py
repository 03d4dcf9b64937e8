"""The ``--json`` report as written: strict JSON (no NaN or Infinity), and ``--json -`` into a pipe."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import dumpfactory as factory


def test_json_report_is_strict_json(tmp_path, capsys):
    from compiledump.cli import main

    rng = np.random.default_rng(62)
    ref = factory.model_captures(rng)
    ref[[c.key for c in ref].index("embed")].array[:] = np.nan  # no finite element: metrics are undefined
    ref[[c.key for c in ref].index("logits")].array[:] = -np.inf  # margin -inf - -inf is NaN
    run = [factory.replace(c, array=c.array.copy()) for c in ref]
    factory.write_compiledump(tmp_path / "ref", ref)
    factory.write_compiledump(tmp_path / "run", run)
    assert main(["compare", str(tmp_path / "ref"), str(tmp_path / "run"), "--json", str(tmp_path / "r.json")]) == 0
    capsys.readouterr()
    text = (tmp_path / "r.json").read_text()
    report = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    by_key = {record["key"]: record for record in report["keys"]}
    assert by_key["embed"]["max_abs"] is None and by_key["embed"]["nan_ref"] == by_key["embed"]["compared_elements"] + 48
    assert by_key["logits"]["margin_ref"] is None
    assert report["threshold_for"] == [] and report["near_tie"] == {"ulps_of_ref_top1": 4.0}


@pytest.mark.parametrize("command", ["compare", "inspect"])
def test_json_dash_writes_the_json_to_stdout_and_the_text_to_stderr(tmp_path, capsys, monkeypatch, command):
    """`--json -` is for a pipe into jq: stdout holds the JSON alone (the file written with a path
    holds the same), the text goes to stderr, and no file named '-' appears."""
    from compiledump.cli import main

    rng = np.random.default_rng(63)
    ref = factory.model_captures(rng)
    run = factory.perturb(ref, rng, noise=1e-7, from_step=2)
    ref_path, run_path = factory.write_pair(tmp_path, ref, run)
    paths = [str(ref_path), str(run_path)] if command == "compare" else [str(run_path)]
    monkeypatch.chdir(tmp_path)
    status = main([command, *paths, "--json", "-"])
    out, err = capsys.readouterr()
    assert main([command, *paths, "--json", str(tmp_path / "file.json")]) == status
    text = capsys.readouterr().out
    streamed, written = json.loads(out), json.loads((tmp_path / "file.json").read_text())
    for report in (streamed, written):
        report.pop("elapsed_s", None)  # the one field that differs between two runs
    assert streamed == written
    assert err.splitlines() == text.splitlines() and err.strip()
    assert not (tmp_path / "-").exists()
