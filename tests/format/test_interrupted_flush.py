"""What a flush killed between its two files leaves is never judged as something it is not.

flush() writes the npz, then its manifest (format/writer.py). A kill between the two leaves a
compiledump npz with no manifest (its first flush) or with the previous flush's manifest (a later
one). Read as a legacy file, the first would get the legacy thresholds, up to thousands of times
looser than its dtype's (a helper's audit: a x1.0001 bug in fp32 then exited 0); the keys a later
npz adds would be judged with inferred kinds. And of several files of one rank the newest run's is
read, which a recovery done later must not make the crashed run's.
"""

import json
import os

import numpy as np
import pytest

from compiledump.compare import compare
from compiledump.format.files import collect_dumps
from compiledump.format.reader import DumpError

from helpers import dumpfactory as factory


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(11)
    ref = factory.model_captures(rng, layers=3, dim=33, steps=2)
    run = factory.scaled(ref, "layer1", 1.0001)  # a bug the fp32 thresholds see, the legacy ones do not
    return factory.write_pair(tmp_path, ref, run)


def test_a_compiledump_npz_without_its_manifest_is_an_error_not_a_legacy_file(pair):
    ref, run = pair
    assert compare(ref, run).exit_status == 1  # complete: the bug is found
    run.with_suffix(".json").unlink()
    with pytest.raises(DumpError, match="manifest .* is missing: the flush that wrote it was cut.*compiledump recover"):
        compare(ref, run)
    with pytest.raises(DumpError, match="is missing"):
        compare(ref, run.parent)


def test_a_key_the_manifest_does_not_list_is_not_compared(pair):
    ref, run = pair
    manifest_path = run.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    # The npz of a later flush beside the manifest of the one before: layer1 was captured after it.
    later = [key for key in manifest["keys"] if key.startswith("layer1")]
    for key in later:
        del manifest["keys"][key]
    manifest_path.write_text(json.dumps(manifest))
    report = compare(ref, run)
    unreadable = {problem.key for problem in report.problems if problem.kind == "unreadable"}
    assert unreadable == set(later)
    assert report.first_divergence is None and report.exit_status == 3
    assert {record.key: record.status for record in report.keys if record.key in later} == dict.fromkeys(
        later, "skipped")


def test_the_newest_run_of_a_rank_is_read_whatever_file_was_written_last(tmp_path):
    rng = np.random.default_rng(2)
    captures = factory.model_captures(rng, layers=2, dim=9, steps=1)
    crashed = factory.write_compiledump(tmp_path, captures, pid=5, manifest={
        **factory.manifest_for(captures, pid=5), "created_unix": 1000.0, "recovered": {"cause": "SIGKILL"}})
    rerun = factory.write_compiledump(tmp_path, captures, pid=6, manifest={
        **factory.manifest_for(captures, pid=6), "created_unix": 2000.0})
    os.utime(rerun, (10, 10))  # the recovery of the crashed run came after the rerun's flush
    os.utime(crashed, (20, 20))
    chosen, duplicates = collect_dumps(tmp_path, "RUN")
    assert chosen == {"0": rerun} and [d.path for d in duplicates] == [crashed]
    legacy = factory.write_legacy(tmp_path / "legacy", captures, pid=1)
    newer = factory.write_legacy(tmp_path / "legacy", captures, pid=2)
    os.utime(legacy, (30, 30))
    os.utime(newer, (10, 10))
    assert collect_dumps(tmp_path / "legacy", "RUN")[0] == {"0": legacy}  # no manifest: the file's time
