"""The host-mapped CUDA arena (COMPILEDUMP_PERSIST=1 on CUDA) where the registration is refused,
without a GPU: a stand-in for torch's cudart bindings. Linux 6.5 and later refuse the NVIDIA
driver's long-term pin of a writable file mapping outside tmpfs and hugetlbfs, so this is the
common case on ext4/xfs/overlay directories: capture must go on in device memory, with one warning
that names the fix, and the CUDA runtime's last error must be reset (torch's next kernel-launch
check would raise it)."""

import errno
import os
import shutil
import subprocess
import types

import pytest
import torch

from compiledump.capture import persist
from compiledump.ops import variants

CUDA = torch.device("cuda", 0)


class RefusingCudart:
    """torch.cuda.cudart() whose cudaHostRegister fails as the driver does (cudaErrorInvalidValue)."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the CUDA name
        self.registered.append((ptr, nbytes, flags))
        return 1

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_refused_registration_falls_back_with_the_fix_and_resets_the_cuda_error(tmp_path, monkeypatch):
    cudart, cleared = RefusingCudart(), []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(persist, "_clear_cuda_error", lambda: cleared.append(1) or True)
    fds = _open_fds()
    with pytest.warns(RuntimeWarning, match="crash-proof capture is off.*tmpfs such as /dev/shm"):
        live = persist.open_live(str(tmp_path), "run", CUDA, 4096, 64, {})
    assert live is None and list(tmp_path.iterdir()) == []  # the live directory is gone
    assert cleared == [1] and len(cudart.registered) == 1  # the arena: refused, the error reset
    assert cudart.registered[0][1:] == (4096 * 4, 0x01 | 0x02)  # portable | mapped, the whole arena
    assert _open_fds() == fds


def test_a_refused_control_block_unregisters_the_arena(tmp_path, monkeypatch):
    mapped, unmapped = [], []

    def map_to_device(host, device):
        if mapped:  # the control block
            raise RuntimeError("cudaHostRegister failed")
        mapped.append(host)
        return host.clone()

    monkeypatch.setattr(persist, "_map_to_device", map_to_device)
    monkeypatch.setattr(persist, "_unmap_from_device", lambda host, device_view: unmapped.append(host))
    with pytest.warns(RuntimeWarning, match="crash-proof capture is off"):
        assert persist.open_live(str(tmp_path), "run", CUDA, 4096, 64, {}) is None
    assert len(unmapped) == 1 and unmapped[0] is mapped[0]


def _mapping_stand_ins(monkeypatch):
    """_map_to_device/_unmap_from_device that record what they were given (host tensors), and a
    device synchronize that records its calls: (mapped, unmapped, synchronized)."""
    mapped, unmapped, synchronized = [], [], []
    monkeypatch.setattr(persist, "_map_to_device", lambda host, device: mapped.append(host) or host.clone())
    monkeypatch.setattr(persist, "_unmap_from_device", lambda host, device_view: unmapped.append(host))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    return mapped, unmapped, synchronized


def test_a_failed_open_unregisters_what_it_mapped_and_closes_its_files(tmp_path, monkeypatch):
    """A failure after both files were registered (here the journal's first write) left their
    pages pinned by the driver and the arena's descriptor open."""
    mapped, unmapped, synchronized = _mapping_stand_ins(monkeypatch)

    def full(self, event):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persist.LiveFiles, "_append", full)
    fds = _open_fds()
    with pytest.warns(RuntimeWarning, match="crash-proof capture is off"):
        assert persist.open_live(str(tmp_path), "run", CUDA, 4096, 64, {}) is None
    assert len(mapped) == 2 and [id(host) for host in unmapped] == [id(host) for host in mapped]
    assert len(synchronized) == 2  # queued captures finish before the mapping goes
    mapped.clear(), unmapped.clear()  # the stand-ins' references to the mapped files
    assert _open_fds() == fds and list(tmp_path.iterdir()) == []


def test_reset_unregisters_the_mapping(tmp_path, monkeypatch):
    """reset() removed the crash-proof files but left them registered: a runtime created again maps
    new files (maybe at the same address, which CUDA then refuses as registered twice)."""
    from compiledump.capture.state import STATE

    mapped, unmapped, _ = _mapping_stand_ins(monkeypatch)
    live = persist.open_live(str(tmp_path), "run", CUDA, 4096, 64, {})
    assert live is not None and len(mapped) == 2 and unmapped == []
    monkeypatch.setattr(STATE, "runtime", types.SimpleNamespace(live=live))
    STATE.reset()
    assert [id(host) for host in unmapped] == [id(host) for host in mapped]
    assert live.arena is live.host_arena and live.ctrl is live.host_ctrl
    assert list(tmp_path.iterdir()) == []


def test_reset_in_a_forked_child_leaves_the_parents_registration(tmp_path, monkeypatch):
    """A forked child's reset() called CUDA (unusable there) to undo its parent's registration."""
    mapped, unmapped, synchronized = _mapping_stand_ins(monkeypatch)
    live = persist.open_live(str(tmp_path), "run", CUDA, 4096, 64, {})
    monkeypatch.setattr(live, "owner", os.getpid() + 1)  # as a forked child sees its parent's files
    live.unmap()
    assert unmapped == [] and synchronized == [] and live.arena is not live.host_arena
    monkeypatch.setattr(live, "owner", os.getpid())
    live.unmap()
    assert len(unmapped) == 2
    live.remove()


def test_an_error_that_cannot_be_reset_is_raised_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", RefusingCudart)
    monkeypatch.setattr(persist, "_clear_cuda_error", lambda: False)
    with pytest.raises(persist.CudaErrorNotCleared, match="COMPILEDUMP_PERSIST=0"):
        persist.open_live(str(tmp_path), "run", CUDA, 4096, 64, {})


def test_unmap_forgets_the_arena_and_unregisters_it(monkeypatch):
    cudart = RefusingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host, device_view = torch.zeros(8), types.SimpleNamespace(data_ptr=lambda: 12345)
    variants.MAPPED_ARENAS.add(12345)
    persist._unmap_from_device(host, device_view)
    assert 12345 not in variants.MAPPED_ARENAS and cudart.unregistered == [host.data_ptr()]


def test_clear_cuda_error_calls_the_libcudart_this_process_loaded(tmp_path):
    """The reset reaches the loaded library itself (found in /proc/self/maps), not a second copy:
    a stand-in libcudart counts its cudaGetLastError calls."""
    import ctypes

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = tmp_path / "fake_cudart.c"
    source.write_text("static int calls;\nint cudaGetLastError(void) { return ++calls; }\n"
                      "int calls_made(void) { return calls; }\n")
    library = tmp_path / "libcudart.so.99"
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=120)
    loaded = ctypes.CDLL(str(library))
    assert persist._clear_cuda_error() is True
    assert loaded.calls_made() == 1


def test_clear_cuda_error_without_libcudart_says_so(monkeypatch):
    real_open = open

    def maps_without_cudart(path, *args, **kwargs):
        if path == "/proc/self/maps":
            raise OSError(errno.ENOENT, "no /proc here")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", maps_without_cudart)
    assert persist._clear_cuda_error() is False
