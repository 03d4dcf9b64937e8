// The native CUDA kernel's body (kernels/capture_device.h) compiled for the CPU by
// test_cuda_kernel_emulated.py: one capture runs the kernel's three phases as one block of
// `threads` threads would, the threads of the write phase one after another (they write disjoint
// words; the NaN/Inf counts are summed as the block's shared counter is).
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "capture_device.h"

using namespace compiledump;

namespace {

template <typename scalar_t>
void run_block(const void* x, float* arena, int32_t* ctrl, const KernelArgs& a, int64_t threads) {
  BlockDecision s{};
  claim(ctrl, a, s);
  for (int64_t tid = 0; tid < threads; ++tid)
    s.bad += static_cast<unsigned long long>(write_share(static_cast<const scalar_t*>(x), arena, a, s, tid, threads));
  commit(ctrl, a, s);
}

}  // namespace

// dtype: the index in test_cuda_kernel_emulated.py's DTYPE_CODES; args: kind, base, offset,
// capacity, reason, T, H, D, stride_t, stride_h, stride_d, row_reg. Returns 0, or 1 for an
// unknown dtype.
extern "C" int compiledump_cuda_kernel_on_cpu(int dtype, const void* x, float* arena, int32_t* ctrl,
                                              const int64_t* args, int mean, int64_t threads) {
  const KernelArgs a{args[0], args[1], args[2], args[3], args[4],  args[5],  args[6],
                     args[7], args[8], args[9], args[10], args[11], mean != 0, false};
  switch (dtype) {
    case 0: run_block<float>(x, arena, ctrl, a, threads); return 0;
    case 1: run_block<double>(x, arena, ctrl, a, threads); return 0;
    case 2: run_block<c10::Half>(x, arena, ctrl, a, threads); return 0;
    case 3: run_block<c10::BFloat16>(x, arena, ctrl, a, threads); return 0;
    case 4: run_block<int64_t>(x, arena, ctrl, a, threads); return 0;
    case 5: run_block<int32_t>(x, arena, ctrl, a, threads); return 0;
    case 6: run_block<int16_t>(x, arena, ctrl, a, threads); return 0;
    case 7: run_block<int8_t>(x, arena, ctrl, a, threads); return 0;
    case 8: run_block<uint8_t>(x, arena, ctrl, a, threads); return 0;
    case 9: run_block<bool>(x, arena, ctrl, a, threads); return 0;
    case 10: run_block<c10::Float8_e4m3fn>(x, arena, ctrl, a, threads); return 0;
    case 11: run_block<c10::Float8_e5m2>(x, arena, ctrl, a, threads); return 0;
    default: return 1;
  }
}
