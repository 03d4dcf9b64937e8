// The native capture ops' host-side helpers, shared by the CPU and CUDA registrations.
#pragma once
#include <ATen/core/Tensor.h>

#include <mutex>
#include <vector>

namespace compiledump {

// How a kernel reads its input: `x` viewed as [T, H, D] with element strides; the row comes from
// register `row_reg` (ROW_FIXED_ZERO: row 0), averaged over H when `mean`. See ops.geometry.
struct Geometry {
  at::Tensor x;
  int64_t T, H, D, stride_t, stride_h, stride_d, row_reg;
  bool mean;
};

Geometry geometry(const at::Tensor& x, int64_t kind);

// Whether `payload` is the shape one capture of a tensor of shape `shape` stores
// (ops/geometry.py payload_shape; capture_export_v1's `payload` argument without its length).
bool payload_matches(at::IntArrayRef shape, int64_t kind, at::IntArrayRef payload);

// `compiledump::capture_kernel_v1` for a capture whose region and drop reason are decided: the CPU
// or the CUDA kernel, called directly (no dispatcher hop).
void capture_kernel_call(const Geometry& g, at::Tensor& arena, at::Tensor& ctrl, int64_t kind, int64_t base,
                         int64_t offset, int64_t capacity, int64_t reason);

#ifdef COMPILEDUMP_WITH_CUDA
// The CUDA kernel's launch (capture_cuda.cu): `capture_kernel_v1` for CUDA tensors.
void capture_kernel_cuda(const at::Tensor& x, at::Tensor& arena, at::Tensor& ctrl, int64_t kind, int64_t base,
                         int64_t offset, int64_t capacity, int64_t reason, int64_t T, int64_t H, int64_t D,
                         int64_t st, int64_t sh, int64_t sd, int64_t row_reg, bool mean);
#endif

// `compiledump::capture_export_v1`.
void capture_export(const at::Tensor& x, at::Tensor& arena, at::Tensor& ctrl, int64_t slot, int64_t kind,
                    int64_t reason, int64_t offset, at::IntArrayRef payload, int64_t capacity, int64_t tokens);

// Held by the CPU kernel while it updates a counter and writes a row, and by the C++ flush while
// it snapshots a CPU arena: a capture from another thread is never half-written in a dump.
std::mutex& capture_mutex();

}  // namespace compiledump
