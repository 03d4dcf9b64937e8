// The native CUDA capture kernel itself and the input dtypes it is instantiated for, apart from
// the op that launches it (kernels/capture_cuda.cu), so that scripts/native_kernel_sass.py can
// compile exactly this template, for exactly these dtypes, with capture_cuda.cu's nvcc flags, in
// a translation unit that skips the torch/ATen headers the kernel does not use (compiling
// capture_cuda.cu itself took twice the CPU time, for the same SASS). Both translation units
// include this one file: one kernel body and one dtype list, nothing to keep in sync.
#pragma once
#include "capture_device.h"

// The dtypes the Triton kernel takes (every real dtype Triton has a pointer type for): the usual
// floats and ints, bool, uint8..uint64 and the four fp8 formats, converted to fp32 by c10's (host
// and device) conversions. AT_DISPATCH_V2's type list (ATen/Dispatch_v2.h, which the includer
// includes: this header does not need ATen), for capture_cuda.cu's dispatch and the script's
// instantiations alike.
#define CD_CAPTURE_DTYPES                                                                          \
  AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, at::kBool, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES), \
      at::kFloat8_e4m3fn, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2, at::kFloat8_e5m2fnuz

// Internal linkage, as it had in capture_cuda.cu before it moved here: each includer (the library's
// one .cu file, or the script's) has its own instantiations, and the kernel's symbol stays local.
namespace {

// The phases of kernels/capture_device.h, with a barrier between each.
template <typename scalar_t>
__global__ void capture_kernel(const scalar_t* __restrict__ x, float* __restrict__ arena,
                               int32_t* __restrict__ ctrl, compiledump::KernelArgs a) {
  using namespace compiledump;
  __shared__ BlockDecision s;
  const bool first_block = blockIdx.x == 0;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (threadIdx.x == 0) read_registers(ctrl, a, s);
  __syncthreads();
  // Every thread's first unit is in flight while thread 0 claims (payload first).
  const Early<scalar_t> early = load_early(x, a, s, tid);
  if (threadIdx.x == 0) decide(ctrl, a, s, first_block);
  __syncthreads();
  const int64_t bad = write_share(x, arena, a, s, tid, static_cast<int64_t>(gridDim.x) * blockDim.x, early);
  if (bad) atomicAdd(&s.bad, static_cast<unsigned long long>(bad));
  __syncthreads();  // every store of the block is issued before the commit
  if (threadIdx.x == 0) commit(ctrl, a, s, first_block);
}

}  // namespace
