// Native CUDA kernel for compiledump's capture (the `compiledump::capture_kernel_v1` op).
//
// The CUDA twin of kernels/capture_cpu.cpp, with exactly the semantics of the Triton kernel
// (compiledump/ops/triton_kernel.py) and of the Python reference (compiledump/ops/reference.py). Python
// owns the schema and decides everything host-side (slot, arena region, [T, H, D] geometry);
// everything that may change between CUDA-graph replays is read from `ctrl` by the kernel:
//
// 1. thread 0 reads the header registers, picks exactly one counter of the slot and bumps it
//    with one atomicAdd (the old written-counter is the step index, or says whether a
//    record_once capture is the first), then broadcasts the decision through shared memory;
// 2. the block gathers the row (strided, read in place; every row for an all-rows record),
//    averages over H in fp32 or copies it, and stores it into the arena;
// 3. thread 0 records the NaN/Inf values the block read (or, with REG_CHECK_ALL, found in the
//    whole input): their count and the first call's step; then it commits the write
//    (SLOT_COMMITTED; at system scope into a host-mapped arena).
//
// The host never reads `ctrl` and never synchronises, so a capture is one graph-capturable
// kernel node. The payload is one row, so a single block is enough; it also orders the counter
// update before the write without any grid-wide synchronisation.
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
#include "gates.h"
#include "layout.h"

namespace {

using namespace compiledump;

constexpr int THREADS = 256;

template <typename scalar_t>
__device__ int64_t store_row(const scalar_t* __restrict__ src, float* __restrict__ arena, int64_t s_dest,
                             int64_t kind, int64_t H, int64_t D, int64_t sh, int64_t sd, bool mean, int64_t words) {
  // One row: `src` is row r of x, `s_dest` its first word in the arena; every thread of the block.
  // Returns this thread's count of non-finite values read (as fp32, what is stored).
  int64_t bad = 0;
  if (kind == KIND_IDS) {
    // ids keep their integer bits: stored as int32 in the float32 arena.
    int32_t* out = reinterpret_cast<int32_t*>(arena) + s_dest;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
      const int64_t h = i / D, d = i % D;
      out[i] = static_cast<int32_t>(src[h * sh + d * sd]);
    }
  } else if (mean) {
    // One thread per d: a sequential fp32 sum over h, then one IEEE division. The explicit
    // round-to-nearest intrinsics keep this bit-identical to the CPU kernel whatever the
    // compiler flags (no contraction, no approximate division).
    float* out = arena + s_dest;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        const float v = static_cast<float>(src[h * sh + d * sd]);
        bad += !isfinite(v);
        acc = __fadd_rn(acc, v);
      }
      out[d] = __fdiv_rn(acc, static_cast<float>(H));
    }
  } else {
    float* out = arena + s_dest;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
      const int64_t h = i / D, d = i % D;
      const float v = static_cast<float>(src[h * sh + d * sd]);
      bad += !isfinite(v);
      out[i] = v;
    }
  }
  return bad;
}

template <typename scalar_t>
__global__ void capture_kernel(const scalar_t* __restrict__ x, float* __restrict__ arena,
                               int32_t* __restrict__ ctrl, int64_t kind, int64_t base, int64_t offset,
                               int64_t capacity, int64_t reason, int64_t T, int64_t H, int64_t D,
                               int64_t st, int64_t sh, int64_t sd, int64_t row_reg, bool mean,
                               bool host_arena) {
  __shared__ bool s_write, s_check_all;
  __shared__ int64_t s_row, s_dest, s_bad_step;
  __shared__ unsigned long long s_bad;
  const int64_t words = mean ? D : H * D;
  const int32_t kept_tokens = row_reg == ROW_FIXED_ZERO ? 0 : static_cast<int32_t>(T);

  if (threadIdx.x == 0) {
    // Same gates and precedence as the CPU kernel: exactly one counter per call.
    const Gate gate = choose_counter(ctrl, kind, reason, T, row_reg);
    const int64_t counter = gate.counter, row = gate.row;
    // The one atomic (the claim): concurrent captures of a slot (other streams) each get their own step.
    const int64_t old = atomicAdd(ctrl + base + counter, 1);
    const bool live = counter == CNT_WRITTEN;
    // Decode steps begun: a step capture raises it past its own index.
    const int64_t steps_now = ctrl[REG_STEPS];
    if (live && kind == KIND_STEP) atomicMax(ctrl + REG_STEPS, static_cast<int32_t>(old + 1));
    // record_once writes only on the first live call; a step only while the region has room.
    s_write = live && !(kind == KIND_RECORD_ONCE && old != 0) && !(kind == KIND_STEP && old >= capacity);
    s_check_all = counter != CNT_SUSPENDED && ctrl[REG_CHECK_ALL] != 0 && kind != KIND_IDS;
    // The record kinds note the token count of the capture the dump now holds.
    // (0: a tensor stored whole has no token count.)
    if (s_write && is_record_kind(kind)) atomicExch(ctrl + base + SLOT_KEPT_TOKENS, kept_tokens);
    s_row = row;
    s_dest = offset + (kind == KIND_STEP ? old : 0) * words;
    s_bad_step = 1 + (live && kind == KIND_STEP ? old : steps_now);
    s_bad = 0;
  }
  __syncthreads();

  // COMPILEDUMP_NONFINITE=all: every element of the input, whatever is kept.
  int64_t bad = 0;
  if (s_check_all) {
    const int64_t hd = H * D;
    for (int64_t i = threadIdx.x; i < T * hd; i += blockDim.x) {
      const int64_t t = i / hd, h = (i % hd) / D, d = i % D;
      bad += !isfinite(static_cast<float>(x[t * st + h * sh + d * sd]));
    }
  }
  int64_t read_bad = 0;
  if (s_write) {  // uniform across the block: read after the barrier
    // All-rows records store every row, one after the other; everything else one row.
    const int64_t rows = row_reg == ROW_ALL ? T : 1;
    for (int64_t r = 0; r < rows; ++r)
      read_bad += store_row(x + (s_row + r) * st, arena, s_dest + r * words, kind, H, D, sh, sd, mean, words);
  }
  if (!s_check_all) bad = read_bad;
  if (bad) atomicAdd(&s_bad, static_cast<unsigned long long>(bad));
  __syncthreads();  // every store of the block is issued before the commit below

  if (threadIdx.x == 0) {
    // The NaN/Inf bookkeeping first, then the commit (the Triton kernel's order).
    if (s_bad) {
      const int64_t seen = ctrl[base + SLOT_NONFINITE];
      if (seen < NONFINITE_CAP)
        atomicAdd(ctrl + base + SLOT_NONFINITE,
                  static_cast<int32_t>(s_bad < NONFINITE_CAP ? s_bad : NONFINITE_CAP));
      if (atomicCAS(ctrl + base + SLOT_BAD_STEP, 0, static_cast<int32_t>(s_bad_step)) == 0)
        atomicExch(ctrl + base + SLOT_BAD_TOKENS, kept_tokens);
    }
    if (s_write) {
      // Device scope orders the stores for readers on the GPU. An arena in host memory (crash-
      // proof capture) is read by the host, possibly after the context died: a system-scope fence
      // and a system-scope atomic, so the payload reaches host memory before the commit does.
      if (host_arena) {
        __threadfence_system();
        atomicAdd_system(ctrl + base + SLOT_COMMITTED, 1);
      } else {
        __threadfence();
        atomicAdd(ctrl + base + SLOT_COMMITTED, 1);  // the commit: the payload is complete
      }
    }
  }
}

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
  const bool host_arena = in_host_memory(arena.const_data_ptr());
  // The dtypes the Triton kernel takes (every real dtype Triton has a pointer type for): the
  // usual floats and ints, bool, uint8..uint64 and the four fp8 formats. Converted to fp32 by
  // c10's (host and device) conversions. The pointer is taken untyped: data_ptr<T> is not
  // instantiated for every one of these types.
  AT_DISPATCH_V2(x.scalar_type(), "capture_kernel_cuda", AT_WRAP([&] {
    // One block, always launched: even a dropped call bumps its counter on the device.
    capture_kernel<scalar_t><<<1, THREADS, 0, stream>>>(
        static_cast<const scalar_t*>(x.const_data_ptr()), arena.data_ptr<float>(), ctrl.data_ptr<int32_t>(),
        kind, base, offset, capacity, reason, T, H, D, st, sh, sd, row_reg, mean, host_arena);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }), AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, at::kBool, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
      at::kFloat8_e4m3fn, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2, at::kFloat8_e5m2fnuz);
}

}  // namespace compiledump

TORCH_LIBRARY_IMPL(compiledump, CUDA, m) {
  m.impl("capture_kernel_v1", &compiledump::capture_kernel_cuda);
}
