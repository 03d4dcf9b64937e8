// The CUDA capture kernel's body (kernels/capture_cuda.cu), in its phases, written once for
// nvcc and for a host C++ compiler: tests/native/test_cuda_kernel_emulated.py compiles it for the
// CPU and runs it thread by thread, phase by phase, so the kernel's arithmetic, indexing, gates
// and counters are checked against the reference kernel without a GPU (the device operations it
// uses, and their host stand-ins: device_intrinsics.h). The native CPU kernel (capture_cpu.cpp)
// runs `claim` and `commit` too, around its own one-thread copy loops, so both native kernels
// decide alike.
//
//   read_registers (thread 0 of each block): the header registers, once for the block, into its
//                      shared state; then every thread loads its first unit of the payload on the
//                      fast path (`load_early`), in flight while thread 0 decides;
//   decide (thread 0 of each block): block 0 claims (picks exactly one counter of the slot, bumps
//                      it, decides whether and where the block writes); the other blocks
//                      `observe` the same registers (only launched when the write does not depend
//                      on the claimed value); the result goes to the block's shared state;
//   write  (every thread of the grid): its share of the row(s): gather, average over H in fp32 or
//                      copy, store, and count the NaN/Inf values read (or, with REG_CHECK_ALL, in
//                      the whole input);
//   commit (thread 0 of each block): the block's NaN/Inf bookkeeping, then, in block 0, the commit
//                      counter (system scope into a host-mapped arena).
//
// The launches (`launches_for`, the Triton kernel's rule, ops/variants.py): one launch of one
// block when whether or where the capture writes depends on the claimed counter value (steps,
// keep-first records) or the arena is host-mapped (the commit must follow every store);
// otherwise one launch of enough blocks for one vector (or element) of the payload per thread, so
// a wide row is read by many SMs with its loads in flight together. A step or keep-first record of
// a wide row (layout.h `splits`) is two launches: a claim launch of one block publishes
// its decision in the slot (SLOT_CLAIM, the Triton kernel's encoding), then every block of a copy
// launch acts on it; so both device kernels leave the same control block. Block 0's commit is
// ordered only with its own stores: the other blocks' are complete when the kernel is (what a
// reader after a synchronize sees).
//
// The fast path (`vector_path`, decided on the host like the Triton kernel's VEC): an input whose
// rows are contiguous and 16-byte aligned is read 16 bytes per load, one vector of elements per
// thread, its hc rows loaded four at a time before any is added (in flight together).
#pragma once
#include <c10/macros/Macros.h>

#include <cstdint>

#include "device_intrinsics.h"
#include "gates.h"
#include "layout.h"

namespace compiledump {

constexpr int64_t THREADS = 256;      // threads per block
constexpr int64_t MAX_BLOCKS = 1024;  // a larger payload is looped over by the grid
constexpr int64_t HC_BLOCK = 4;       // hc rows loaded together on the fast path

// A capture's arguments: what the host decided (kind, region, drop reason, launch, fast path) and
// the [T, H, D] geometry (ops/geometry.py).
struct KernelArgs {
  int64_t kind, base, offset, capacity, reason, T, H, D, st, sh, sd, row_reg;
  bool mean, host_arena;
  int64_t phase = LAUNCH_WHOLE;  // layout.h LAUNCH_*
  bool vector = false;           // the fast path: see vector_path
};

// What thread 0 reads and decides and every thread reads after a barrier (the block's shared memory).
struct BlockDecision {
  Gate gate;                // the header registers, read once for the block (`read_registers`): the row
  int64_t steps_now;        // REG_STEPS when they were read
  bool check_reg, early;    // REG_CHECK_ALL set; the block loads its first unit before the decision
  bool write, check_all;
  int64_t dest, bad_step;
  unsigned long long bad;  // NaN/Inf values the block found (summed after the write phase)
};

// Elements of scalar_t in one 16-byte vector.
template <typename scalar_t>
C10_HOST_DEVICE constexpr int64_t vector_width() {
  return sizeof(scalar_t) >= 16 ? 1 : static_cast<int64_t>(16 / sizeof(scalar_t));
}

// Whether a capture of scalar_t elements takes the fast path (the Triton kernel's VEC > 1,
// ops/variants.py variant_for): the input at `x` is 16-byte aligned, contiguous along D, its row
// and hc strides and D are multiples of a vector, and the arena and the region's first word allow
// stores of a vector's worth of words (regions are REGION_ALIGN_WORDS-aligned). A misaligned
// vector access would be a device fault that kills the CUDA context. Host only.
template <typename scalar_t>
inline bool vector_path(const void* x, const void* arena, const KernelArgs& a) {
  constexpr int64_t width = vector_width<scalar_t>(), store = width < REGION_ALIGN_WORDS ? width : 4;
  return width > 1 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(arena) % 16 == 0 &&
         a.sd == 1 && a.D % width == 0 && a.st % width == 0 && (a.H == 1 || a.sh % width == 0) &&
         a.offset % store == 0;
}

C10_HOST_DEVICE inline int32_t kept_tokens_of(const KernelArgs& a) {
  // The record kinds note the token count of the capture the dump now holds (0: a tensor stored
  // whole has no token count).
  return a.row_reg == ROW_FIXED_ZERO ? 0 : static_cast<int32_t>(a.T);
}

C10_HOST_DEVICE inline int64_t row_words(const KernelArgs& a) { return a.mean ? a.D : a.H * a.D; }

// Thread 0 of each block, first (then a barrier): the header registers, read once for the block
// (the gate, with the same precedence as the CPU kernel; the steps begun; the check-all flag), and
// whether the block loads its first unit before the decision (payload first, `load_early`): on
// the fast path, where the registers alone say the launch copies (the claim may still drop it,
// counted), never for a keep-first record, whose later calls all drop.
CD_DEVICE inline void read_registers(const int32_t* ctrl, const KernelArgs& a, BlockDecision& s) {
  s.gate = choose_counter(ctrl, a.kind, a.reason, a.T, a.row_reg);
  s.steps_now = ctrl[REG_STEPS];
  s.check_reg = ctrl[REG_CHECK_ALL] != 0;
  const bool row_ok = s.gate.row >= 0 && s.gate.row < a.T;
  s.early = a.vector && a.kind != KIND_RECORD_ONCE &&
            (a.phase == LAUNCH_COPY ? row_ok : a.phase == LAUNCH_WHOLE && s.gate.counter == CNT_WRITTEN);
}

// Block 0's thread 0 of a whole or claim launch, between the barriers, on the registers it read.
CD_DEVICE inline void claim(int32_t* ctrl, const KernelArgs& a, BlockDecision& s) {
  const Gate gate = s.gate;  // exactly one counter per call
  // The one atomic (the claim): concurrent captures of a slot (other streams) each get their own step.
  const int64_t old = cd_atomic_add(ctrl + a.base + gate.counter, 1);
  const bool live = gate.counter == CNT_WRITTEN;
  // Decode steps begun: a step capture raises it past its own index.
  if (live && a.kind == KIND_STEP) cd_red_max(ctrl + REG_STEPS, static_cast<int32_t>(old + 1));
  // record_once writes only on the first live call; a step only while the region has room.
  s.write = live && !(a.kind == KIND_RECORD_ONCE && old != 0) && !(a.kind == KIND_STEP && old >= a.capacity);
  s.check_all = gate.counter != CNT_SUSPENDED && s.check_reg && a.kind != KIND_IDS;
  if (s.write && is_record_kind(a.kind)) cd_store_relaxed(ctrl + a.base + SLOT_KEPT_TOKENS, kept_tokens_of(a));
  s.dest = a.offset + (a.kind == KIND_STEP ? old : 0) * row_words(a);
  s.bad_step = 1 + (live && a.kind == KIND_STEP ? old : s.steps_now);
  s.bad = 0;
}

// Thread 0 of every other block of a whole launch, between the barriers: the decision `claim`
// makes, for the kinds launched on several blocks (record, all-rows record, ids), whose write
// does not depend on the claimed counter value. From the same registers; counts nothing.
CD_DEVICE inline void observe(const KernelArgs& a, BlockDecision& s) {
  s.write = s.gate.counter == CNT_WRITTEN;
  s.check_all = s.gate.counter != CNT_SUSPENDED && s.check_reg && a.kind != KIND_IDS;
  s.dest = a.offset;
  s.bad_step = 1 + s.steps_now;
  s.bad = 0;
}

// The claim launch's block, after `claim`: the decision goes to the slot's SLOT_CLAIM word (the
// date, clamped to its 29 bits; whether it writes; whether the whole input is checked) for the
// copy launch, and this launch reads and writes no payload.
CD_DEVICE inline void publish(int32_t* ctrl, const KernelArgs& a, BlockDecision& s) {
  const int64_t date = s.bad_step < CLAIM_WRITES - 1 ? s.bad_step : CLAIM_WRITES - 1;
  cd_store_relaxed(ctrl + a.base + SLOT_CLAIM,
                   static_cast<int32_t>(date | (s.write ? CLAIM_WRITES : 0) | (s.check_all ? CLAIM_CHECK_ALL : 0)));
  s.write = s.check_all = false;
}

// Thread 0 of every block of a copy launch: the decision its claim launch published (stream order
// makes it visible). The block still checks its own gather row, so a register write racing on
// another stream can never make it read past the input.
CD_DEVICE inline void take_published(const int32_t* ctrl, const KernelArgs& a, BlockDecision& s) {
  const int64_t claimed = ctrl[a.base + SLOT_CLAIM];
  s.write = (claimed & CLAIM_WRITES) != 0 && s.gate.row >= 0 && s.gate.row < a.T;
  s.check_all = (claimed & CLAIM_CHECK_ALL) != 0;
  s.bad_step = claimed & (CLAIM_WRITES - 1);  // a written step's index + 1
  s.dest = a.offset + (a.kind == KIND_STEP ? s.bad_step - 1 : 0) * row_words(a);
  s.bad = 0;
}

// Thread 0 of each block, after `read_registers`, between the barriers.
CD_DEVICE inline void decide(int32_t* ctrl, const KernelArgs& a, BlockDecision& s, bool first_block) {
  if (a.phase == LAUNCH_COPY) {
    take_published(ctrl, a, s);
  } else if (first_block) {
    claim(ctrl, a, s);
    if (a.phase == LAUNCH_CLAIM) publish(ctrl, a, s);
  } else {
    observe(a, s);
  }
}

// One launch of a capture: its phase (layout.h LAUNCH_*) and blocks.
struct Launch {
  int64_t phase, blocks;
};

// What the host decides for one capture of scalar_t elements from `x` into `arena`: whether it
// takes the fast path (sets a.vector) and its launches, in stream order, into `out`; returns how
// many (1 or 2). See the top of this file. capture_cuda.cu and the tests' CPU harness both call
// it, so the harness launches exactly what the CUDA launcher does. Host only.
template <typename scalar_t>
inline int launches_for(const void* x, const void* arena, KernelArgs& a, Launch out[2]) {
  a.vector = vector_path<scalar_t>(x, arena, a);
  const int64_t width = a.vector ? vector_width<scalar_t>() : 1;  // elements each thread reads at once
  const int64_t rows = a.row_reg == ROW_ALL ? a.T : 1, units = rows * row_words(a) / width;
  int64_t blocks = (units + THREADS - 1) / THREADS;  // a vector (or element) of the payload per thread
  blocks = blocks < 1 ? 1 : blocks > MAX_BLOCKS ? MAX_BLOCKS : blocks;
  if (a.host_arena) {
    out[0] = {LAUNCH_WHOLE, 1};
    return 1;
  }
  if (a.kind == KIND_STEP || a.kind == KIND_RECORD_ONCE) {
    if (splits(a.H, a.D)) {
      out[0] = {LAUNCH_CLAIM, 1};
      out[1] = {LAUNCH_COPY, blocks};
      return 2;
    }
    out[0] = {LAUNCH_WHOLE, 1};
    return 1;
  }
  out[0] = {LAUNCH_WHOLE, blocks};
  return 1;
}

// One row for thread `tid` of `threads`: `src` is row r of x, `dest` its first word in the arena.
// Returns this thread's count of non-finite values read (as fp32, what is stored).
template <typename scalar_t>
CD_DEVICE int64_t store_row(const scalar_t* src, float* arena, int64_t dest, const KernelArgs& a, int64_t tid,
                            int64_t threads) {
  const int64_t H = a.H, D = a.D, sh = a.sh, sd = a.sd, words = row_words(a);
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

// A thread's first unit of the fast path's write (its hc rows, or its one vector), loaded between
// the barriers while thread 0 claims, so the two round trips to memory overlap (payload first).
// Kept as plain 16-byte words: unpacking the values there would wait for the load, and thread 0
// would then claim only after it.
template <typename scalar_t>
struct Early {
  Pack<uint32_t, 4> raw[HC_BLOCK];
  bool valid;
};

template <typename scalar_t>
CD_DEVICE Early<scalar_t> load_early(const scalar_t* x, const KernelArgs& a, const BlockDecision& s, int64_t tid) {
  constexpr int64_t V = vector_width<scalar_t>();
  Early<scalar_t> e;
  const int64_t rows = a.row_reg == ROW_ALL ? a.T : 1, per_row = row_words(a) / V;
  e.valid = s.early && tid < rows * per_row;
  if (!e.valid) return e;
  // The unit u = tid of store_rows_vector.
  const int64_t r = rows == 1 ? 0 : tid / per_row, c = tid - r * per_row;
  const scalar_t* src = x + (s.gate.row + r) * a.st;
  // One load into raw[0] for both layouts: a load in each branch of an if made nvcc join them with
  // a register move, which waits for the load before the claim.
  const int64_t per_hc_row = a.D / V, h = a.mean || a.H == 1 ? 0 : c / per_hc_row;
  e.raw[0] = load_pack<uint32_t, 4>(reinterpret_cast<const uint32_t*>(src + h * a.sh + (c - h * per_hc_row) * V));
  if (a.mean) {
    CD_UNROLL
    for (int64_t k = 1; k < HC_BLOCK; ++k)
      if (k < a.H) e.raw[k] = load_pack<uint32_t, 4>(reinterpret_cast<const uint32_t*>(src + k * a.sh + c * V));
  }
  return e;
}

// The fast path's share of every stored row: one vector of V elements per thread and step of the
// grid-strided loop (unit u: row u / per_row, vector u % per_row of it). The same values, order
// and rounding as store_row. Returns this thread's count of non-finite values read.
template <typename scalar_t>
CD_DEVICE int64_t store_rows_vector(const scalar_t* x, float* arena, const KernelArgs& a, const BlockDecision& s,
                                    int64_t rows, int64_t tid, int64_t threads, const Early<scalar_t>& early) {
  constexpr int64_t V = vector_width<scalar_t>();
  const int64_t words = row_words(a), per_row = words / V, per_hc_row = a.D / V;
  int64_t bad = 0;
  for (int64_t u = tid; u < rows * per_row; u += threads) {
    const int64_t r = rows == 1 ? 0 : u / per_row, c = u - r * per_row;
    const scalar_t* src = x + (s.gate.row + r) * a.st;
    const int64_t dest = s.dest + r * words + c * V;
    const bool loaded = early.valid && u == tid;  // the first unit, loaded before the decision
    if (a.mean) {
      // HC_BLOCK hc rows loaded before any is added; each element summed in h order from 0.0f.
      float acc[V];
      CD_UNROLL
      for (int64_t e = 0; e < V; ++e) acc[e] = 0.0f;
      for (int64_t h0 = 0; h0 < a.H; h0 += HC_BLOCK) {
        Pack<scalar_t, V> q[HC_BLOCK];
        CD_UNROLL
        for (int64_t k = 0; k < HC_BLOCK; ++k)
          if (h0 + k < a.H)
            q[k] = loaded && h0 == 0 ? as_pack<scalar_t, V>(early.raw[k])
                                     : load_pack<scalar_t, V>(src + (h0 + k) * a.sh + c * V);
        CD_UNROLL
        for (int64_t k = 0; k < HC_BLOCK; ++k) {
          if (h0 + k >= a.H) break;
          CD_UNROLL
          for (int64_t e = 0; e < V; ++e) {
            const float v = static_cast<float>(q[k].v[e]);
            bad += !cd_isfinite(v);
            acc[e] = cd_add(acc[e], v);
          }
        }
      }
      CD_UNROLL
      for (int64_t e = 0; e < V; ++e) acc[e] = cd_div(acc[e], static_cast<float>(a.H));
      store_words(arena + dest, acc);
    } else {
      // A vector never straddles two hc rows: D is a multiple of V.
      const int64_t h = a.H == 1 ? 0 : c / per_hc_row;
      const Pack<scalar_t, V> q = loaded ? as_pack<scalar_t, V>(early.raw[0])
                                         : load_pack<scalar_t, V>(src + h * a.sh + (c - h * per_hc_row) * V);
      if (a.kind == KIND_IDS) {
        int32_t ids[V];
        CD_UNROLL
        for (int64_t e = 0; e < V; ++e) ids[e] = static_cast<int32_t>(q.v[e]);
        store_words(reinterpret_cast<int32_t*>(arena) + dest, ids);
      } else {
        float vals[V];
        CD_UNROLL
        for (int64_t e = 0; e < V; ++e) {
          vals[e] = static_cast<float>(q.v[e]);
          bad += !cd_isfinite(vals[e]);
        }
        store_words(arena + dest, vals);
      }
    }
  }
  return bad;
}

// Every thread of the grid (`tid` of `threads`), after the second barrier: returns its NaN/Inf count.
template <typename scalar_t>
CD_DEVICE int64_t write_share(const scalar_t* x, float* arena, const KernelArgs& a, const BlockDecision& s,
                              int64_t tid, int64_t threads, const Early<scalar_t>& early) {
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
    const int64_t rows = a.row_reg == ROW_ALL ? a.T : 1, words = row_words(a);
    if (a.vector) {
      read_bad = store_rows_vector(x, arena, a, s, rows, tid, threads, early);
    } else {
      for (int64_t r = 0; r < rows; ++r)
        read_bad += store_row(x + (s.gate.row + r) * a.st, arena, s.dest + r * words, a, tid, threads);
    }
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
      cd_store_relaxed(ctrl + a.base + SLOT_BAD_TOKENS, kept_tokens_of(a));
  }
  if (s.write && first_block) cd_commit(ctrl + a.base + SLOT_COMMITTED, a.host_arena);
}

}  // namespace compiledump
