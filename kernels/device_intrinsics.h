// The device operations the CUDA kernel's body (capture_device.h) is written with, and their host
// stand-ins, so that one body compiles for nvcc and for a host C++ compiler (the tests run it on
// the CPU, one thread at a time: there plain read-modify-writes are the atomics, and IEEE add and
// division round to nearest as __fadd_rn and __fdiv_rn do).
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace compiledump {

#if defined(__CUDACC__)
#define CD_DEVICE __device__
// Loops over a vector's elements or a group of hc rows are unrolled (their arrays stay in registers).
#define CD_UNROLL _Pragma("unroll")
__device__ inline int32_t cd_atomic_add(int32_t* p, int32_t v) { return atomicAdd(p, v); }
// The bookkeeping writes whose old value nobody reads: a reduction and a relaxed store, which
// the memory does not answer. As atomicMax and atomicExch, nvcc made them atomics with a reply,
// and a thread's later wait on the payload's first loads (the same scoreboard) also waited for it.
__device__ inline void cd_red_max(int32_t* p, int32_t v) {
  asm volatile("red.relaxed.gpu.global.max.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ inline void cd_store_relaxed(int32_t* p, int32_t v) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
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
#define CD_UNROLL
inline int32_t cd_atomic_add(int32_t* p, int32_t v) { const int32_t old = *p; *p = old + v; return old; }
inline void cd_red_max(int32_t* p, int32_t v) { if (v > *p) *p = v; }
inline void cd_store_relaxed(int32_t* p, int32_t v) { *p = v; }
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

// N values of T at once: one 16-byte load (or a store of up to 16 bytes) on the device. The
// alignment the pack declares is what the host checked (vector_path).
template <typename T, int64_t N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int64_t N>
CD_DEVICE inline Pack<T, N> load_pack(const T* p) {
#if defined(__CUDACC__)
  return *reinterpret_cast<const Pack<T, N>*>(p);
#else
  Pack<T, N> out;
  std::memcpy(static_cast<void*>(&out), p, sizeof out);
  return out;
#endif
}

// The 16 bytes of `raw` as a pack of N values of T: what was loaded as plain words (nothing to
// convert, so nothing that waits for the load) is read as values where it is used.
template <typename T, int64_t N>
CD_DEVICE inline Pack<T, N> as_pack(const Pack<uint32_t, 4>& raw) {
  static_assert(sizeof(Pack<T, N>) == sizeof raw, "a fast-path vector is 16 bytes");
  Pack<T, N> out;
#if defined(__CUDACC__)
  memcpy(&out, &raw, sizeof out);
#else
  std::memcpy(static_cast<void*>(&out), &raw, sizeof out);
#endif
  return out;
}

// Stores N 4-byte words (float or int32) from `v` at `out`, 16 bytes (or N words) at a time.
template <typename W, int64_t N>
CD_DEVICE inline void store_words(W* out, const W (&v)[N]) {
  constexpr int64_t S = N < 4 ? N : 4;
  CD_UNROLL
  for (int64_t k = 0; k < N; k += S) {
    Pack<W, S> chunk;
    CD_UNROLL
    for (int64_t e = 0; e < S; ++e) chunk.v[e] = v[k + e];
#if defined(__CUDACC__)
    *reinterpret_cast<Pack<W, S>*>(out + k) = chunk;
#else
    std::memcpy(static_cast<void*>(out + k), &chunk, sizeof chunk);
#endif
  }
}

}  // namespace compiledump
