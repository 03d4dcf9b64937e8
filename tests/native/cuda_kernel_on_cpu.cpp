// The native CUDA kernel's body (kernels/capture_device.h) compiled for the CPU by
// test_cuda_kernel_emulated.py: one capture runs the kernel's three phases as the launch's grid
// of blocks of `threads` threads would, block after block and, in the write phase, thread after
// thread (they write disjoint words; each block's NaN/Inf counts are summed as its shared counter
// is).
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "capture_device.h"

using namespace compiledump;

namespace {

template <typename scalar_t>
void run_grid(const void* x, float* arena, int32_t* ctrl, const KernelArgs& a, int64_t threads) {
  // The launch's grid (blocks_for), each block's phases in turn: block 0 claims before the others
  // observe, one order the device may run them in (they read the same registers; a claim moves
  // REG_STEPS only for steps, which run one block).
  const int64_t blocks = blocks_for(a);
  for (int64_t b = 0; b < blocks; ++b) {
    BlockDecision s{};
    if (b == 0)
      claim(ctrl, a, s);
    else
      observe(ctrl, a, s);
    for (int64_t t = 0; t < threads; ++t)
      s.bad += static_cast<unsigned long long>(
          write_share(static_cast<const scalar_t*>(x), arena, a, s, b * threads + t, blocks * threads));
    commit(ctrl, a, s, b == 0);
  }
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
    case 0: run_grid<float>(x, arena, ctrl, a, threads); return 0;
    case 1: run_grid<double>(x, arena, ctrl, a, threads); return 0;
    case 2: run_grid<c10::Half>(x, arena, ctrl, a, threads); return 0;
    case 3: run_grid<c10::BFloat16>(x, arena, ctrl, a, threads); return 0;
    case 4: run_grid<int64_t>(x, arena, ctrl, a, threads); return 0;
    case 5: run_grid<int32_t>(x, arena, ctrl, a, threads); return 0;
    case 6: run_grid<int16_t>(x, arena, ctrl, a, threads); return 0;
    case 7: run_grid<int8_t>(x, arena, ctrl, a, threads); return 0;
    case 8: run_grid<uint8_t>(x, arena, ctrl, a, threads); return 0;
    case 9: run_grid<bool>(x, arena, ctrl, a, threads); return 0;
    case 10: run_grid<c10::Float8_e4m3fn>(x, arena, ctrl, a, threads); return 0;
    case 11: run_grid<c10::Float8_e5m2>(x, arena, ctrl, a, threads); return 0;
    default: return 1;
  }
}
