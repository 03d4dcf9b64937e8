// Native CPU kernel for compiledump's capture (the `compiledump::capture_kernel_v1` op).
//
// Python owns the schema (compiledump/ops.py defines it) and decides everything host-side:
// the slot, the arena region and the [T, H, D] geometry with strides. This file only adds the
// CPU kernel, with exactly the semantics of the Triton kernel (compiledump/triton_kernel.py)
// and of the Python reference kernel (ops.capture_reference): read the header registers, bump
// exactly one counter of the slot, and, for a kept capture, gather the row, average over H in
// fp32 (sequential in h, then one IEEE division) or copy it, and store it into the arena.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

namespace {

// Keep in sync with compiledump/layout.py (tests compare this kernel with the Python one).
constexpr int64_t REG_ENABLED = 0, REG_ROWS = 1, REG_MAX_ROWS = 2;
constexpr int64_t CNT_WRITTEN = 0, CNT_SUSPENDED = 1, CNT_ROWS_GATE = 3, CNT_ROW_OUT_OF_RANGE = 4;
constexpr int64_t KIND_RECORD_ONCE = 1, KIND_STEP = 2, KIND_IDS = 3;

template <typename T>
void store_row(const T* src, float* arena, int64_t dest, int64_t H, int64_t D, int64_t sh, int64_t sd,
               bool mean, bool ids) {
  if (ids) {
    auto* out = reinterpret_cast<int32_t*>(arena) + dest;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<int32_t>(src[h * sh + d * sd]);
  } else if (mean) {
    float* out = arena + dest;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) acc += static_cast<float>(src[h * sh + d * sd]);
      out[d] = acc / static_cast<float>(H);
    }
  } else {
    float* out = arena + dest;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<float>(src[h * sh + d * sd]);
  }
}

void capture_kernel_cpu(const at::Tensor& x, at::Tensor& arena, at::Tensor& ctrl, int64_t kind, int64_t base,
                        int64_t offset, int64_t capacity, int64_t reason, int64_t T, int64_t H, int64_t D,
                        int64_t st, int64_t sh, int64_t sd, int64_t row_reg, bool mean) {
  TORCH_CHECK(arena.scalar_type() == at::kFloat && arena.is_contiguous(), "compiledump: bad arena");
  TORCH_CHECK(ctrl.scalar_type() == at::kInt && ctrl.is_contiguous(), "compiledump: bad control block");
  int32_t* regs = ctrl.data_ptr<int32_t>();
  const bool enabled = regs[REG_ENABLED] != 0;
  const bool rows_ok = kind != KIND_STEP || regs[REG_ROWS] <= regs[REG_MAX_ROWS];
  int64_t row = row_reg < 0 ? 0 : regs[row_reg];
  if (row < 0) row += T;
  const bool row_ok = row >= 0 && row < T;
  int64_t counter = CNT_WRITTEN;
  if (!enabled) counter = CNT_SUSPENDED;
  else if (reason != 0) counter = reason;
  else if (!rows_ok) counter = CNT_ROWS_GATE;
  else if (!row_ok) counter = CNT_ROW_OUT_OF_RANGE;
  const int64_t old = regs[base + counter]++;
  if (counter != CNT_WRITTEN) return;
  if (kind == KIND_RECORD_ONCE && old != 0) return;
  if (kind == KIND_STEP && old >= capacity) return;
  const int64_t words = mean ? D : H * D;
  const int64_t dest = offset + (kind == KIND_STEP ? old : 0) * words;
  TORCH_CHECK(dest >= 0 && dest + words <= arena.numel(), "compiledump: arena region out of bounds");
  float* out = arena.data_ptr<float>();
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, x.scalar_type(), "capture_kernel_cpu", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>() + row * st;
    store_row<scalar_t>(src, out, dest, H, D, sh, sd, mean, kind == KIND_IDS);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(compiledump, CPU, m) {
  m.impl("capture_kernel_v1", &capture_kernel_cpu);
}
