"""A dump's arrays as raw .npy members, without parsing them: two equal members are equal arrays.
tests/capture/test_crash.py compares 100 000 of them (100 recovered dumps against a reference);
parsing every header was most of that file's time."""

import io
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np


def members(path: Path) -> dict[str, bytes]:
    """The members of the .npz at `path`, keyed as np.load keys them.

    The file is read once and each member sliced out of it, checked as `ZipFile.read` checks it:
    the local header's signature and name, a stored (uncompressed) member, its CRC-32.
    (`ZipFile.read` opens and seeks per member: 5 times the time.)"""
    data = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = archive.infolist()
    found = {}
    for info in infos:
        # The local header: signature, 22 bytes, the name's length and the extra field's; 30 bytes.
        signature, name_length, extra_length = struct.unpack_from("<4s22xHH", data, info.header_offset)
        name = info.header_offset + 30
        assert signature == b"PK\x03\x04" and data[name : name + name_length] == info.filename.encode(), info
        start = name + name_length + extra_length
        member = data[start : start + info.compress_size]
        assert info.compress_type == zipfile.ZIP_STORED and zlib.crc32(member) == info.CRC, info
        found[info.filename.removesuffix(".npy")] = member
    return found


def array(member: bytes) -> np.ndarray:
    return np.lib.format.read_array(io.BytesIO(member), allow_pickle=False)


def assert_same(got: bytes, want: bytes, key: str) -> None:
    if got != want:  # other bytes can still be equal values (-0.0, another header): decide on those
        np.testing.assert_array_equal(array(got), array(want), err_msg=key)
