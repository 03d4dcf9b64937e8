// Native CUDA kernel for compiledump's capture (the `compiledump::capture_kernel_v1` op).
//
// The CUDA twin of kernels/capture_cpu.cpp, with exactly the semantics of the Triton kernel
// (compiledump/ops/triton_kernel.py) and of the Python reference (compiledump/ops/reference.py). Python
// owns the schema and decides everything host-side (slot, arena region, [T, H, D] geometry);
// everything that may change between CUDA-graph replays is read from `ctrl` by the kernel, whose
// body (kernels/capture_device.h, also compiled for the CPU by the tests) runs in three phases:
//
// 1. thread 0 of block 0 reads the header registers, picks exactly one counter of the slot and
//    bumps it with one atomicAdd (the old written-counter is the step index, or says whether a
//    record_once capture is the first), then broadcasts the decision through shared memory; the
//    registers go to every thread first, so each loads its first unit of the payload while the
//    claim is in flight;
// 2. the grid gathers the row (strided, read in place; every row for an all-rows record; 16 bytes
//    per load where the rows are contiguous and aligned), averages over H in fp32 or copies it,
//    and stores it into the arena;
// 3. each block's thread 0 records the NaN/Inf values its block read (or, with REG_CHECK_ALL,
//    found in the whole input): their count and the first call's step; then block 0 commits the
//    write (SLOT_COMMITTED; at system scope into a host-mapped arena).
//
// The host never reads `ctrl` and never synchronises, so a capture is one graph-capturable
// kernel node (two for a wide step or keep-first record). No grid-wide synchronisation: block 0
// claims, and the other blocks (launched only when the write does not depend on the claimed value)
// decide from the same registers; a wide step's copy launch acts on what its claim launch
// published (capture_device.h, `launches_for`).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
// c10's stream and guard headers rather than ATen/cuda/CUDAContext.h: the latter pulls in
// cuBLAS/cuSPARSE/cuSOLVER headers this file does not need. at::cuda::getCurrentCUDAStream
// is this same c10::cuda function.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "capture.h"
#include "capture_device.h"
#include "capture_kernel.cuh"
#include "layout.h"

namespace {

using namespace compiledump;

// Whether `p` is host memory mapped into the device (the crash-proof arena, capture/persist.py).
// A driver query, no device work and no sync (allowed during graph capture), remembered for the
// last arena: a process captures into one.
bool in_host_memory(const void* p) {
  static thread_local const void* last = nullptr;
  static thread_local bool last_in_host = false;
  if (p != last) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) == cudaSuccess) {
      last_in_host = attributes.type == cudaMemoryTypeHost;
    } else {
      (void)cudaGetLastError();  // not a pointer CUDA knows: device memory of another allocator
      last_in_host = false;
    }
    last = p;
  }
  return last_in_host;
}

}  // namespace

namespace compiledump {

void capture_kernel_cuda(const at::Tensor& x, at::Tensor& arena, at::Tensor& ctrl, int64_t kind, int64_t base,
                         int64_t offset, int64_t capacity, int64_t reason, int64_t T, int64_t H, int64_t D,
                         int64_t st, int64_t sh, int64_t sd, int64_t row_reg, bool mean) {
  TORCH_CHECK(x.is_cuda() && arena.device() == x.device() && ctrl.device() == x.device(),
              "compiledump: x, arena and control block must be on the same CUDA device");
  TORCH_CHECK(arena.scalar_type() == at::kFloat && arena.is_contiguous(), "compiledump: bad arena");
  TORCH_CHECK(ctrl.scalar_type() == at::kInt && ctrl.is_contiguous(), "compiledump: bad control block");
  // Host-known metadata only (no device read): a kernel cannot raise, so the words it may touch
  // are checked here. The CPU kernel checks the one row it writes; here the whole region is
  // checked, which is the same thing for the regions Python hands out. With a host-decided
  // reason the kernel never writes (offset is -1 then), so the region is not checked.
  TORCH_CHECK(ctrl.numel() >= HEADER_WORDS && row_reg < HEADER_WORDS && base >= 0 &&
                  base + SLOT_WORDS <= ctrl.numel() && reason >= 0 && reason < SLOT_COUNTERS,
              "compiledump: control block index out of bounds");
  const int64_t words = mean ? D : H * D;
  const int64_t rows = kind == KIND_STEP ? std::max<int64_t>(capacity, 0) : row_reg == ROW_ALL ? T : 1;
  TORCH_CHECK(reason != 0 || (offset >= 0 && offset + rows * words <= arena.numel()),
              "compiledump: arena region out of bounds");

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  KernelArgs args{kind, base, offset, capacity, reason, T, H, D, st, sh, sd, row_reg, mean,
                  in_host_memory(arena.const_data_ptr())};
  // CD_CAPTURE_DTYPES (capture_kernel.cuh): the dtypes the Triton kernel takes. The
  // pointer is taken untyped: data_ptr<T> is not instantiated for every one of these types.
  AT_DISPATCH_V2(x.scalar_type(), "capture_kernel_cuda", AT_WRAP([&] {
    // Always launched (at least one block): even a dropped call bumps its counter on the device.
    // A wide step or keep-first record is a claim launch, then a copy launch (stream order).
    Launch launches[2];
    const int count = launches_for<scalar_t>(x.const_data_ptr(), arena.const_data_ptr(), args, launches);
    for (int i = 0; i < count; ++i) {
      KernelArgs launch_args = args;
      launch_args.phase = launches[i].phase;
      capture_kernel<scalar_t><<<launches[i].blocks, THREADS, 0, stream>>>(
          static_cast<const scalar_t*>(x.const_data_ptr()), arena.data_ptr<float>(), ctrl.data_ptr<int32_t>(),
          launch_args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }), CD_CAPTURE_DTYPES);
}

}  // namespace compiledump

TORCH_LIBRARY_IMPL(compiledump, CUDA, m) {
  m.impl("capture_kernel_v1", &compiledump::capture_kernel_cuda);
}
