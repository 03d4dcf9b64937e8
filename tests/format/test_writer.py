"""The files a dump is written as (format/writer.py)."""

import os
import stat

import numpy as np
import pytest

from compiledump.format import writer


def _manifest() -> dict:
    return writer.build_manifest(keys={}, tags={}, drops={}, **{field: None for field in writer.REQUIRED_FIELDS})


def test_a_writer_that_forgets_a_field_is_an_error():
    """flush and recover each list the manifest's fields: one that gains a field the other lacks
    wrote dumps without it (a newcomer's audit); now build_manifest refuses."""
    fields = {field: None for field in writer.REQUIRED_FIELDS - {"first_nonfinite"}}
    with pytest.raises(TypeError, match="first_nonfinite"):
        writer.build_manifest(keys={}, tags={}, drops={}, **fields)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_dump_files_follow_the_umask_as_numpy_savez_does(tmp_path, umask):
    """tempfile.mkstemp made every dump 0600 whatever the umask: a dump written by a container's
    root or a service account could not be read by the user who compares it (the seed's
    np.savez follows the umask)."""
    arrays = {"a": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)}
    manifest = _manifest()
    previous = os.umask(umask)
    try:
        npz = writer.write_dump(tmp_path, "compiledump_rank0_pid1", arrays, manifest)
        np.savez(tmp_path / "seed.npz", **arrays)
    finally:
        os.umask(previous)
    seed_mode = stat.S_IMODE((tmp_path / "seed.npz").stat().st_mode)
    assert seed_mode == 0o666 & ~umask
    for path in (npz, npz.with_suffix(".json")):
        assert stat.S_IMODE(path.stat().st_mode) == seed_mode, path.name


def test_a_filesystem_that_refuses_the_mode_still_gets_the_dump(tmp_path, monkeypatch):
    """fchmod failing (a filesystem without Unix modes) failed the whole dump."""
    def refuse(fd, mode):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse)
    arrays = {"a": np.random.default_rng(1).standard_normal(4).astype(np.float32)}
    npz = writer.write_dump(tmp_path, "compiledump_rank0_pid1", arrays, _manifest())
    with np.load(npz) as data:
        np.testing.assert_array_equal(data["a"], arrays["a"])
