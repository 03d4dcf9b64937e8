"""Shared test setup.

TRITON_INTERPRET must be set before triton is imported anywhere: it lets the Triton capture
kernel run on CPU tensors, which is how the suite checks it without a GPU.
"""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import compiledump  # noqa: E402
from compiledump import config as cd_config  # noqa: E402


@pytest.fixture
def dump_dir(tmp_path):
    """Capture enabled into a fresh directory, with default settings and fresh state."""
    torch._dynamo.reset()
    compiledump.reset()
    previous = compiledump.get_config()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(tmp_path / "dump"))))
    yield tmp_path / "dump"
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(previous))
    torch._dynamo.reset()


@pytest.fixture(params=["reference", "triton"])
def cpu_kernel(request, monkeypatch):
    """Run the CPU path with the reference kernel, or with the Triton kernel interpreted."""
    monkeypatch.setenv("COMPILEDUMP_CPU_KERNEL", request.param)
    return request.param
