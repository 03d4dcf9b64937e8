// Native CPU kernels for compiledump's capture ops (schemas defined by compiledump/ops/schemas.py).
//
// - `capture_kernel_v1`: the kernel layer. The caller has decided the slot, the arena region
//   and the [T, H, D] geometry with strides; this reads the header registers, bumps exactly one
//   counter of the slot and, for a kept capture, gathers the row, averages over H in fp32
//   (sequential in h, then one IEEE division) or copies it, and stores it into the arena: the
//   semantics of the Triton kernel (compiledump/ops/triton_kernel.py) and of the Python reference
//   (ops.capture_reference). Its decisions (gates, claim, NaN/Inf bookkeeping, commit) are the
//   CUDA kernel's code (capture_device.h); only the copy loops are its own, one thread's.
// - `capture_export_v1`: the capture op of exported programs. Its arguments carry the region,
//   the payload shape and the token gate, so it needs no Python registry: the host-side gates
//   and the geometry of ops.export_gates / ops.geometry, then the kernel above.
#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>

#include "capture.h"
#include "capture_device.h"
#include "gates.h"
#include "layout.h"

namespace compiledump {

std::mutex& capture_mutex() {
  static std::mutex mutex;
  return mutex;
}

namespace {

// One row, as store_row in capture_device.h but as one thread's loops (nested, unit stride: the
// compiler vectorizes them; the grid-strided loops of the device code would run 2-5x slower here).
// Returns the non-finite values among those read (as fp32, what is stored).
template <typename T>
int64_t store_row_cpu(const T* src, float* arena, int64_t dest, const KernelArgs& a) {
  const int64_t H = a.H, D = a.D, sh = a.sh, sd = a.sd;
  int64_t bad = 0;
  if (a.kind == KIND_IDS) {
    auto* out = reinterpret_cast<int32_t*>(arena) + dest;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<int32_t>(src[h * sh + d * sd]);
  } else if (a.mean) {
    float* out = arena + dest;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;  // a sequential fp32 sum over h, then one IEEE division: as every kernel
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

// The write phase (write_share in capture_device.h) on one thread: the non-finite values read,
// or with REG_CHECK_ALL those of the whole [T, H, D] input.
template <typename T>
int64_t write_cpu(const T* x, float* arena, const KernelArgs& a, const BlockDecision& s) {
  int64_t bad = 0;
  if (s.check_all)
    for (int64_t t = 0; t < a.T; ++t)
      for (int64_t h = 0; h < a.H; ++h)
        for (int64_t d = 0; d < a.D; ++d) bad += !std::isfinite(static_cast<float>(x[t * a.st + h * a.sh + d * a.sd]));
  int64_t read_bad = 0;
  if (s.write) {
    const int64_t rows = a.row_reg == ROW_ALL ? a.T : 1, words = a.mean ? a.D : a.H * a.D;
    for (int64_t r = 0; r < rows; ++r) read_bad += store_row_cpu(x + (s.gate.row + r) * a.st, arena, s.dest + r * words, a);
  }
  return s.check_all ? bad : read_bad;
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
  // The CUDA kernel's decisions (capture_device.h: claim, then commit), one thread's write between.
  const KernelArgs a{kind, base, offset, capacity, reason, T, H, D, st, sh, sd, row_reg, mean, /*host_arena=*/false};
  BlockDecision s;
  read_registers(regs, a, s);
  claim(regs, a, s);
  const int64_t rows = row_reg == ROW_ALL ? T : 1, words = mean ? D : H * D;
  TORCH_CHECK(!s.write || (s.dest >= 0 && s.dest + rows * words <= arena.numel()),
              "compiledump: arena region out of bounds");
  // The dtypes of the Triton and CUDA kernels: the usual floats and ints, bool, uint8..uint64 and
  // the four fp8 formats (untyped pointer: data_ptr<T> is not instantiated for all of them).
  AT_DISPATCH_V2(x.scalar_type(), "capture_kernel_cpu", AT_WRAP([&] {
    s.bad = write_cpu(static_cast<const scalar_t*>(x.const_data_ptr()), arena.data_ptr<float>(), a, s);
  }), AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, at::kBool, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
      at::kFloat8_e4m3fn, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2, at::kFloat8_e5m2fnuz);
  commit(regs, a, s, /*first_block=*/true);
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
