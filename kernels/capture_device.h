// The CUDA capture kernel's body (kernels/capture_cuda.cu), in its three phases, written once for
// nvcc and for a host C++ compiler: tests/native/test_cuda_kernel_emulated.py compiles it for the
// CPU and runs it thread by thread, phase by phase, so the kernel's arithmetic, indexing, gates
// and counters are checked against the reference kernel without a GPU. Under nvcc the helpers
// below are the device intrinsics; on the host they are plain C++ (one thread at a time, so
// plain read-modify-writes are the atomics; IEEE add and division round to nearest as
// __fadd_rn and __fdiv_rn do). The native CPU kernel (capture_cpu.cpp) runs `claim` and `commit`
// too, around its own one-thread copy loops, so both native kernels decide alike.
//
//   claim  (thread 0 of block 0): pick exactly one counter of the slot, bump it (the claim),
//                      decide whether and where the block writes; the result goes to the block's
//                      shared state. The other blocks' thread 0 `observe`s the same registers
//                      instead (only launched when the write does not depend on the claimed value);
//   write  (every thread of the grid): its share of the row(s): gather, average over H in fp32 or
//                      copy, store, and count the NaN/Inf values read (or, with REG_CHECK_ALL, in
//                      the whole input);
//   commit (thread 0 of each block): the block's NaN/Inf bookkeeping, then, in block 0, the commit
//                      counter (system scope into a host-mapped arena).
//
// The grid (`blocks_for`): one block when whether or where the capture writes depends on the
// claimed counter value (steps, keep-first records) or the arena is host-mapped (the commit must
// follow every store); otherwise enough blocks of THREADS threads for one element of the payload
// per thread, so a wide row is read by many SMs with its loads in flight together, as the Triton
// kernel spreads it over programs. Block 0's commit is then ordered only with its own stores: the
// other blocks' are complete when the kernel is (what a reader after a synchronize sees).
#pragma once
#include <c10/macros/Macros.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "gates.h"
#include "layout.h"

namespace compiledump {

constexpr int64_t THREADS = 256;      // threads per block
constexpr int64_t MAX_BLOCKS = 1024;  // a larger payload is looped over by the grid

// A capture's arguments: what the host decided (kind, region, drop reason) and the [T, H, D]
// geometry (ops/geometry.py).
struct KernelArgs {
  int64_t kind, base, offset, capacity, reason, T, H, D, st, sh, sd, row_reg;
  bool mean, host_arena;
};

// What thread 0 decides and every thread reads after the barrier (the block's shared memory).
struct BlockDecision {
  bool write, check_all;
  int64_t row, dest, bad_step;
  unsigned long long bad;  // NaN/Inf values the block found (summed after the write phase)
};

#if defined(__CUDACC__)
#define CD_DEVICE __device__
__device__ inline int32_t cd_atomic_add(int32_t* p, int32_t v) { return atomicAdd(p, v); }
__device__ inline void cd_atomic_max(int32_t* p, int32_t v) { atomicMax(p, v); }
__device__ inline void cd_atomic_exch(int32_t* p, int32_t v) { atomicExch(p, v); }
__device__ inline int32_t cd_atomic_cas(int32_t* p, int32_t expected, int32_t v) { return atomicCAS(p, expected, v); }
__device__ inline float cd_add(float a, float b) { return __fadd_rn(a, b); }
__device__ inline float cd_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline bool cd_isfinite(float v) { return isfinite(v); }
__device__ inline void cd_commit(int32_t* p, bool host_arena) {
  // Device scope orders the stores for readers on the GPU. An arena in host memory (crash-proof
  // capture) is read by the host, possibly after the context died: a system-scope fence and a
  // system-scope atomic, so the payload reaches host memory before the commit does.
  if (host_arena) {
    __threadfence_system();
    atomicAdd_system(p, 1);
  } else {
    __threadfence();
    atomicAdd(p, 1);
  }
}
#else
#define CD_DEVICE
inline int32_t cd_atomic_add(int32_t* p, int32_t v) { const int32_t old = *p; *p = old + v; return old; }
inline void cd_atomic_max(int32_t* p, int32_t v) { if (v > *p) *p = v; }
inline void cd_atomic_exch(int32_t* p, int32_t v) { *p = v; }
inline int32_t cd_atomic_cas(int32_t* p, int32_t expected, int32_t v) {
  const int32_t old = *p;
  if (old == expected) *p = v;
  return old;
}
inline float cd_add(float a, float b) { return a + b; }
inline float cd_div(float a, float b) { return a / b; }
inline bool cd_isfinite(float v) { return std::isfinite(v); }
inline void cd_commit(int32_t* p, bool) {
  // The commit after the payload: the compiler must not move the stores before it past it (a
  // process killed between the two leaves a claimed, uncommitted write, which recover drops).
  std::atomic_signal_fence(std::memory_order_seq_cst);
  *p += 1;
}
#endif

C10_HOST_DEVICE inline int32_t kept_tokens_of(const KernelArgs& a) {
  // The record kinds note the token count of the capture the dump now holds (0: a tensor stored
  // whole has no token count).
  return a.row_reg == ROW_FIXED_ZERO ? 0 : static_cast<int32_t>(a.T);
}

// Thread 0 of block 0, before the barrier.
CD_DEVICE inline void claim(int32_t* ctrl, const KernelArgs& a, BlockDecision& s) {
  // Same gates and precedence as the CPU kernel: exactly one counter per call.
  const Gate gate = choose_counter(ctrl, a.kind, a.reason, a.T, a.row_reg);
  const int64_t words = a.mean ? a.D : a.H * a.D;
  // The one atomic (the claim): concurrent captures of a slot (other streams) each get their own step.
  const int64_t old = cd_atomic_add(ctrl + a.base + gate.counter, 1);
  const bool live = gate.counter == CNT_WRITTEN;
  // Decode steps begun: a step capture raises it past its own index.
  const int64_t steps_now = ctrl[REG_STEPS];
  if (live && a.kind == KIND_STEP) cd_atomic_max(ctrl + REG_STEPS, static_cast<int32_t>(old + 1));
  // record_once writes only on the first live call; a step only while the region has room.
  s.write = live && !(a.kind == KIND_RECORD_ONCE && old != 0) && !(a.kind == KIND_STEP && old >= a.capacity);
  s.check_all = gate.counter != CNT_SUSPENDED && ctrl[REG_CHECK_ALL] != 0 && a.kind != KIND_IDS;
  if (s.write && is_record_kind(a.kind)) cd_atomic_exch(ctrl + a.base + SLOT_KEPT_TOKENS, kept_tokens_of(a));
  s.row = gate.row;
  s.dest = a.offset + (a.kind == KIND_STEP ? old : 0) * words;
  s.bad_step = 1 + (live && a.kind == KIND_STEP ? old : steps_now);
  s.bad = 0;
}

// Thread 0 of every other block, before the barrier: the decision `claim` makes, for the kinds
// launched on several blocks (record, all-rows record, ids), whose write does not depend on the
// claimed counter value. Reads the same registers; counts nothing.
CD_DEVICE inline void observe(const int32_t* ctrl, const KernelArgs& a, BlockDecision& s) {
  const Gate gate = choose_counter(ctrl, a.kind, a.reason, a.T, a.row_reg);
  s.write = gate.counter == CNT_WRITTEN;
  s.check_all = gate.counter != CNT_SUSPENDED && ctrl[REG_CHECK_ALL] != 0 && a.kind != KIND_IDS;
  s.row = gate.row;
  s.dest = a.offset;
  s.bad_step = 1 + ctrl[REG_STEPS];
  s.bad = 0;
}

// The grid: see the top of this file.
C10_HOST_DEVICE inline int64_t blocks_for(const KernelArgs& a) {
  if (a.kind == KIND_STEP || a.kind == KIND_RECORD_ONCE || a.host_arena) return 1;
  const int64_t rows = a.row_reg == ROW_ALL ? a.T : 1, words = a.mean ? a.D : a.H * a.D;
  const int64_t blocks = (rows * words + THREADS - 1) / THREADS;
  return blocks < 1 ? 1 : blocks > MAX_BLOCKS ? MAX_BLOCKS : blocks;
}

// One row for thread `tid` of `threads`: `src` is row r of x, `dest` its first word in the arena.
// Returns this thread's count of non-finite values read (as fp32, what is stored).
template <typename scalar_t>
CD_DEVICE int64_t store_row(const scalar_t* src, float* arena, int64_t dest, const KernelArgs& a, int64_t tid,
                            int64_t threads) {
  const int64_t H = a.H, D = a.D, sh = a.sh, sd = a.sd, words = a.mean ? D : H * D;
  int64_t bad = 0;
  if (a.kind == KIND_IDS) {
    // ids keep their integer bits: stored as int32 in the float32 arena.
    int32_t* out = reinterpret_cast<int32_t*>(arena) + dest;
    for (int64_t i = tid; i < words; i += threads) {
      const int64_t h = i / D, d = i % D;
      out[i] = static_cast<int32_t>(src[h * sh + d * sd]);
    }
  } else if (a.mean) {
    // One thread per d: a sequential fp32 sum over h, then one IEEE division (round to nearest:
    // bit-identical to the CPU kernel whatever the compiler flags).
    float* out = arena + dest;
    for (int64_t d = tid; d < D; d += threads) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        const float v = static_cast<float>(src[h * sh + d * sd]);
        bad += !cd_isfinite(v);
        acc = cd_add(acc, v);
      }
      out[d] = cd_div(acc, static_cast<float>(H));
    }
  } else {
    float* out = arena + dest;
    for (int64_t i = tid; i < words; i += threads) {
      const int64_t h = i / D, d = i % D;
      const float v = static_cast<float>(src[h * sh + d * sd]);
      bad += !cd_isfinite(v);
      out[i] = v;
    }
  }
  return bad;
}

// Every thread of the grid (`tid` of `threads`), between the barriers: returns its NaN/Inf count.
template <typename scalar_t>
CD_DEVICE int64_t write_share(const scalar_t* x, float* arena, const KernelArgs& a, const BlockDecision& s,
                              int64_t tid, int64_t threads) {
  // COMPILEDUMP_NONFINITE=all: every element of the input, whatever is kept.
  int64_t bad = 0;
  if (s.check_all) {
    const int64_t hd = a.H * a.D;
    for (int64_t i = tid; i < a.T * hd; i += threads) {
      const int64_t t = i / hd, h = (i % hd) / a.D, d = i % a.D;
      bad += !cd_isfinite(static_cast<float>(x[t * a.st + h * a.sh + d * a.sd]));
    }
  }
  int64_t read_bad = 0;
  if (s.write) {  // uniform across the block: read after the barrier
    // All-rows records store every row, one after the other; everything else one row.
    const int64_t rows = a.row_reg == ROW_ALL ? a.T : 1, words = a.mean ? a.D : a.H * a.D;
    for (int64_t r = 0; r < rows; ++r)
      read_bad += store_row(x + (s.row + r) * a.st, arena, s.dest + r * words, a, tid, threads);
  }
  return s.check_all ? bad : read_bad;
}

// Thread 0 of each block, after the second barrier (every store of the block is issued); the
// commit in block 0 only.
CD_DEVICE inline void commit(int32_t* ctrl, const KernelArgs& a, const BlockDecision& s, bool first_block) {
  // The NaN/Inf bookkeeping first, then the commit (the Triton kernel's order).
  if (s.bad) {
    const int64_t seen = ctrl[a.base + SLOT_NONFINITE];
    if (seen < NONFINITE_CAP)
      cd_atomic_add(ctrl + a.base + SLOT_NONFINITE,
                    static_cast<int32_t>(s.bad < NONFINITE_CAP ? s.bad : NONFINITE_CAP));
    if (cd_atomic_cas(ctrl + a.base + SLOT_BAD_STEP, 0, static_cast<int32_t>(s.bad_step)) == 0)
      cd_atomic_exch(ctrl + a.base + SLOT_BAD_TOKENS, kept_tokens_of(a));
  }
  if (s.write && first_block) cd_commit(ctrl + a.base + SLOT_COMMITTED, a.host_arena);
}

}  // namespace compiledump
