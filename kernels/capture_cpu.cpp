// Native CPU kernels for compiledump's capture ops (schemas defined by compiledump/ops/schemas.py).
//
// - `capture_kernel_v1`: the kernel layer. The caller has decided the slot, the arena region
//   and the [T, H, D] geometry with strides; this reads the header registers, bumps exactly one
//   counter of the slot and, for a kept capture, gathers the row, averages over H in fp32
//   (sequential in h, then one IEEE division) or copies it, and stores it into the arena: the
//   semantics of the Triton kernel (compiledump/ops/triton_kernel.py) and of the Python reference
//   (ops.capture_reference).
// - `capture_export_v1`: the capture op of exported programs. Its arguments carry the region,
//   the payload shape and the token gate, so it needs no Python registry: the host-side gates
//   and the geometry of ops.export_gates / ops.geometry, then the kernel above.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "capture.h"
#include "gates.h"
#include "layout.h"

namespace compiledump {

std::mutex& capture_mutex() {
  static std::mutex mutex;
  return mutex;
}

namespace {

// Stores one row and returns the non-finite values among those read (as fp32, what is stored).
template <typename T>
int64_t store_row(const T* src, float* arena, int64_t dest, int64_t H, int64_t D, int64_t sh, int64_t sd,
                  bool mean, bool ids) {
  int64_t bad = 0;
  if (ids) {
    auto* out = reinterpret_cast<int32_t*>(arena) + dest;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<int32_t>(src[h * sh + d * sd]);
  } else if (mean) {
    float* out = arena + dest;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        const float v = static_cast<float>(src[h * sh + d * sd]);
        bad += !std::isfinite(v);
        acc += v;
      }
      out[d] = acc / static_cast<float>(H);
    }
  } else {
    float* out = arena + dest;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const float v = static_cast<float>(src[h * sh + d * sd]);
        bad += !std::isfinite(v);
        out[h * D + d] = v;
      }
  }
  return bad;
}

// COMPILEDUMP_NONFINITE=all: the non-finite values of the whole [T, H, D] input.
template <typename T>
int64_t count_all(const T* x, int64_t rows, int64_t H, int64_t D, int64_t st, int64_t sh, int64_t sd) {
  int64_t bad = 0;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) bad += !std::isfinite(static_cast<float>(x[t * st + h * sh + d * sd]));
  return bad;
}

void capture_kernel_cpu(const at::Tensor& x, at::Tensor& arena, at::Tensor& ctrl, int64_t kind, int64_t base,
                        int64_t offset, int64_t capacity, int64_t reason, int64_t T, int64_t H, int64_t D,
                        int64_t st, int64_t sh, int64_t sd, int64_t row_reg, bool mean) {
  TORCH_CHECK(arena.scalar_type() == at::kFloat && arena.is_contiguous(), "compiledump: bad arena");
  TORCH_CHECK(ctrl.scalar_type() == at::kInt && ctrl.is_contiguous(), "compiledump: bad control block");
  TORCH_CHECK(base >= 0 && base + SLOT_WORDS <= ctrl.numel(), "compiledump: slot outside the control block");
  // The counter update and the row write are one step for a concurrent flush (dump.cpp).
  std::lock_guard<std::mutex> guard(capture_mutex());
  int32_t* regs = ctrl.data_ptr<int32_t>();
  const Gate gate = choose_counter(regs, kind, reason, T, row_reg);
  const int64_t counter = gate.counter, row = gate.row;
  const int64_t old = regs[base + counter]++;  // the claim
  const bool live = counter == CNT_WRITTEN;
  const int64_t steps_now = regs[REG_STEPS];
  if (live && kind == KIND_STEP) regs[REG_STEPS] = static_cast<int32_t>(std::max(steps_now, old + 1));
  const bool write = live && !(kind == KIND_RECORD_ONCE && old != 0) && !(kind == KIND_STEP && old >= capacity);
  const bool check_all = counter != CNT_SUSPENDED && regs[REG_CHECK_ALL] != 0 && kind != KIND_IDS;
  const int64_t kept_tokens = row_reg == ROW_FIXED_ZERO ? 0 : T;  // a tensor stored whole has none
  const int64_t words = mean ? D : H * D;
  const int64_t rows = row_reg == ROW_ALL ? T : 1;  // every row, or the one gathered
  const int64_t dest = offset + (kind == KIND_STEP ? old : 0) * words;
  TORCH_CHECK(!write || (dest >= 0 && dest + rows * words <= arena.numel()),
              "compiledump: arena region out of bounds");
  if (write && is_record_kind(kind)) regs[base + SLOT_KEPT_TOKENS] = static_cast<int32_t>(kept_tokens);
  float* out = arena.data_ptr<float>();
  int64_t bad = 0, read_bad = 0;
  // The dtypes of the Triton and CUDA kernels: the usual floats and ints, bool, uint8..uint64 and
  // the four fp8 formats (untyped pointer: data_ptr<T> is not instantiated for all of them).
  AT_DISPATCH_V2(x.scalar_type(), "capture_kernel_cpu", AT_WRAP([&] {
    const scalar_t* x0 = static_cast<const scalar_t*>(x.const_data_ptr());
    if (check_all) bad = count_all<scalar_t>(x0, T, H, D, st, sh, sd);
    if (write)
      for (int64_t r = 0; r < rows; ++r)
        read_bad += store_row<scalar_t>(x0 + (row + r) * st, out, dest + r * words, H, D, sh, sd, mean,
                                        kind == KIND_IDS);
  }), AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, at::kBool, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
      at::kFloat8_e4m3fn, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2, at::kFloat8_e5m2fnuz);
  if (write) {
    // The commit, after the payload: the compiler must not move the stores above past it (a
    // process killed between the two leaves a claimed, uncommitted write that recover drops).
    std::atomic_signal_fence(std::memory_order_seq_cst);
    regs[base + SLOT_COMMITTED] += 1;
  }
  if (!check_all) bad = read_bad;
  if (bad > 0) {
    regs[base + SLOT_NONFINITE] =
        static_cast<int32_t>(std::min<int64_t>(regs[base + SLOT_NONFINITE] + bad, NONFINITE_CAP));
    if (regs[base + SLOT_BAD_STEP] == 0) {
      regs[base + SLOT_BAD_STEP] = static_cast<int32_t>(1 + (live && kind == KIND_STEP ? old : steps_now));
      regs[base + SLOT_BAD_TOKENS] = static_cast<int32_t>(kept_tokens);
    }
  }
}

}  // namespace

bool payload_matches(at::IntArrayRef shape, int64_t kind, at::IntArrayRef payload) {
  // Whether `payload` is the shape one capture of a tensor of shape `shape` stores
  // (ops/geometry.py payload_shape), without building it (a per-capture check).
  const size_t n = shape.size();
  int64_t numel = 1;
  switch (kind) {
    case KIND_IDS: return shape.equals(payload);
    case KIND_STEP: return n >= 2 ? shape.slice(1).equals(payload) : shape.equals(payload);
    case KIND_RECORD_ROWS: return payload.size() == 2 && payload[0] == shape.front() && payload[1] == shape.back();
    default:
      if (n == 2 || n == 3) return payload.size() == 1 && payload[0] == shape.back();
      for (int64_t d : shape) numel *= d;
      return payload.size() == 1 && payload[0] == numel;
  }
}

Geometry geometry(const at::Tensor& input, int64_t kind) {
  at::Tensor x = input;
  const int64_t dim = x.dim();
  auto rows = [](const at::Tensor& t, int64_t row_reg, bool mean) {
    if (t.dim() == 2) return Geometry{t, t.size(0), 1, t.size(1), t.stride(0), 0, t.stride(1), row_reg, mean};
    return Geometry{t, t.size(0), t.size(1), t.size(2), t.stride(0), t.stride(1), t.stride(2), row_reg, mean};
  };
  if (kind == KIND_RECORD_ROWS) return rows(x, ROW_ALL, dim == 3);
  if ((kind == KIND_RECORD || kind == KIND_RECORD_ONCE) && (dim == 2 || dim == 3))
    return rows(x, REG_RECORD_ROW, dim == 3);
  if (kind == KIND_STEP && dim >= 2) {
    if (dim > 3) x = x.reshape({x.size(0), -1, x.size(-1)});
    return rows(x, REG_STEP_ROW, false);
  }
  // Stored whole: one row of H x D words.
  if (dim == 0) return Geometry{x, 1, 1, 1, 0, 0, 0, ROW_FIXED_ZERO, false};
  if (dim == 1) return Geometry{x, 1, 1, x.size(0), 0, 0, x.stride(0), ROW_FIXED_ZERO, false};
  // One flat row: copied as one contiguous run.
  if (x.is_contiguous()) return Geometry{x, 1, 1, x.numel(), 0, 0, 1, ROW_FIXED_ZERO, false};
  if (dim > 2) x = x.reshape({x.size(0), -1});
  return Geometry{x, 1, x.size(0), x.size(1), 0, x.stride(0), x.stride(1), ROW_FIXED_ZERO, false};
}

void capture_kernel_call(const Geometry& g, at::Tensor& arena, at::Tensor& ctrl, int64_t kind, int64_t base,
                         int64_t offset, int64_t capacity, int64_t reason) {
  if (arena.is_cpu()) {  // the kernel above, without a dispatcher hop
    capture_kernel_cpu(g.x, arena, ctrl, kind, base, offset, capacity, reason, g.T, g.H, g.D, g.stride_t,
                       g.stride_h, g.stride_d, g.row_reg, g.mean);
    return;
  }
#ifdef COMPILEDUMP_WITH_CUDA
  // The CUDA kernel (capture_cuda.cu), also without a dispatcher hop.
  capture_kernel_cuda(g.x, arena, ctrl, kind, base, offset, capacity, reason, g.T, g.H, g.D, g.stride_t, g.stride_h,
                      g.stride_d, g.row_reg, g.mean);
#else
  TORCH_CHECK(false, "compiledump: this native library was built without CUDA; the arena is on ", arena.device());
#endif
}

std::tuple<at::Tensor, at::Tensor> snapshot_cpu(const at::Tensor& arena, const at::Tensor& ctrl, int64_t words) {
  TORCH_CHECK(words >= 0 && words <= arena.numel(), "compiledump: snapshot past the arena's end");
  std::lock_guard<std::mutex> guard(capture_mutex());  // no capture between the two copies
  return {arena.narrow(0, 0, words).clone(), ctrl.clone()};
}

void capture_export(const at::Tensor& x, at::Tensor& arena, at::Tensor& ctrl, int64_t slot, int64_t kind,
                    int64_t reason, int64_t offset, at::IntArrayRef payload, int64_t capacity, int64_t tokens) {
  // The gates of ops.export_gates, decided from shapes (host metadata: no device access).
  if (reason == 0 && slot != 0) {
    if (tokens && is_token_gated_kind(kind) && x.dim() > 0 && x.size(0) != tokens)
      reason = CNT_TOKEN_GATE;
    else if (payload.empty() || payload[0] + 1 != static_cast<int64_t>(payload.size()) ||
             !payload_matches(x.sizes(), kind, payload.slice(1)))
      reason = CNT_SHAPE_CHANGED;
    else if (offset < 0)
      reason = CNT_ARENA_FULL;
  }
  if (reason != 0) {
    offset = -1;
    capacity = 0;
  }
  capture_kernel_call(geometry(x, kind), arena, ctrl, kind, slot_base(slot), offset, capacity, reason);
}

}  // namespace compiledump

TORCH_LIBRARY_IMPL(compiledump, CPU, m) {
  m.impl("capture_kernel_v1", &compiledump::capture_kernel_cpu);
  m.impl("capture_export_v1", &compiledump::capture_export);
  m.impl("snapshot_v1", &compiledump::snapshot_cpu);
}

#ifdef COMPILEDUMP_WITH_CUDA
TORCH_LIBRARY_IMPL(compiledump, CUDA, m) {
  m.impl("capture_export_v1", &compiledump::capture_export);
}
#endif
