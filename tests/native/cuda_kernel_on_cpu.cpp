// The native CUDA kernel's body (kernels/capture_device.h) compiled for the CPU by
// test_cuda_kernel_emulated.py: one capture runs as capture_cuda.cu launches it (the fast path
// decided on the host, then each launch of `launches_for` in stream order), each launch's grid of
// blocks of `threads` threads block after block and, in the early-load and write phases, thread
// after thread (they write disjoint words; each block's NaN/Inf counts are summed as its shared
// counter is).
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <vector>

#include "capture_device.h"

using namespace compiledump;

namespace {

// Filled by every capture: the launches it made, as (phase, blocks) pairs, and whether it took
// the fast path (the test reads them: compiledump_cuda_kernel_last_launches).
int64_t last_launches[4];
int last_count = 0;
bool last_vector = false;

// `only_phase`: -1 runs every launch; a LAUNCH_* value only that one (the test runs a split
// capture's claim and copy launches apart, to change the registers between them).
template <typename scalar_t>
void run_launches(const void* x, float* arena, int32_t* ctrl, KernelArgs a, int64_t threads, int64_t only_phase) {
  Launch launches[2];
  last_count = launches_for<scalar_t>(x, arena, a, launches);
  last_vector = a.vector;
  for (int i = 0; i < last_count; ++i) {
    last_launches[2 * i] = launches[i].phase;
    last_launches[2 * i + 1] = launches[i].blocks;
    a.phase = launches[i].phase;
    if (only_phase >= 0 && a.phase != only_phase) continue;
    // Block 0 decides before the others, one order the device may run them in (they read the
    // same registers; a claim moves REG_STEPS only for steps, which run one block).
    const int64_t blocks = launches[i].blocks;
    const scalar_t* input = static_cast<const scalar_t*>(x);
    std::vector<Early<scalar_t>> early(threads);
    for (int64_t b = 0; b < blocks; ++b) {
      BlockDecision s{};
      read_registers(ctrl, a, s);
      for (int64_t t = 0; t < threads; ++t) early[t] = load_early(input, a, s, b * threads + t);
      decide(ctrl, a, s, b == 0);
      for (int64_t t = 0; t < threads; ++t)
        s.bad += static_cast<unsigned long long>(
            write_share(input, arena, a, s, b * threads + t, blocks * threads, early[t]));
      commit(ctrl, a, s, b == 0);
    }
  }
}

}  // namespace

// dtype: the index in test_cuda_kernel_emulated.py's DTYPE_CODES; args: kind, base, offset,
// capacity, reason, T, H, D, stride_t, stride_h, stride_d, row_reg; only_phase: see run_launches.
// Returns 0, or 1 for an unknown dtype.
extern "C" int compiledump_cuda_kernel_on_cpu(int dtype, const void* x, float* arena, int32_t* ctrl,
                                              const int64_t* args, int mean, int64_t threads,
                                              int64_t only_phase) {
  const KernelArgs a{args[0], args[1], args[2], args[3], args[4],  args[5],  args[6],
                     args[7], args[8], args[9], args[10], args[11], mean != 0, false};
  switch (dtype) {
    case 0: run_launches<float>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 1: run_launches<double>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 2: run_launches<c10::Half>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 3: run_launches<c10::BFloat16>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 4: run_launches<int64_t>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 5: run_launches<int32_t>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 6: run_launches<int16_t>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 7: run_launches<int8_t>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 8: run_launches<uint8_t>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 9: run_launches<bool>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 10: run_launches<c10::Float8_e4m3fn>(x, arena, ctrl, a, threads, only_phase); return 0;
    case 11: run_launches<c10::Float8_e5m2>(x, arena, ctrl, a, threads, only_phase); return 0;
    default: return 1;
  }
}

// What the last capture launched, into `out`: whether it took the fast path (0 or 1), the number
// of launches, then (phase, blocks) for each.
extern "C" void compiledump_cuda_kernel_last_launches(int64_t* out) {
  out[0] = last_vector;
  out[1] = last_count;
  for (int i = 0; i < 2 * last_count; ++i) out[2 + i] = last_launches[i];
}
