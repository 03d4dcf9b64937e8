// C shims of the capture ops for AOTInductor (and Inductor's cpp_wrapper): generated code calls
// `aoti_torch_<device>_<op>` directly instead of going through the proxy executor, which builds a
// boxed argument stack per call (about 1.8 us per capture at dim 64; benchmarks/RESULTS.md).
//
// compiledump.aot.package declares them to Inductor (`aot_inductor.custom_ops_to_c_shims`, with
// the declarations in compiledump/ops/native.py C_SHIMS); the symbols are resolved when the package is
// loaded, from this library (loaded with RTLD_GLOBAL by compiledump/ops/native.py, or linked
// into a C++ driver). The argument lists follow Inductor's C-shim convention: tensors as
// handles, an int[] as a pointer and a length, then one pointer per output. An op returning
// nothing gets a trailing nullptr from some torch versions and nothing from others, so the
// shims end in `...` and ignore what follows `tokens` (integer and pointer arguments pass the
// same way to a variadic function on the C ABIs torch supports).
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include "capture.h"

using torch::aot_inductor::tensor_handle_to_tensor_pointer;

extern "C" {

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_capture_export_v1(
    AtenTensorHandle x, AtenTensorHandle arena, AtenTensorHandle ctrl, int64_t slot, int64_t kind, int64_t reason,
    int64_t offset, const int64_t* payload, int64_t payload_len_, int64_t capacity, int64_t tokens, ...) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    compiledump::capture_export(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(arena),
                                *tensor_handle_to_tensor_pointer(ctrl), slot, kind, reason, offset,
                                at::IntArrayRef(payload, payload_len_), capacity, tokens);
  });
}

#ifdef COMPILEDUMP_WITH_CUDA
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cuda_capture_export_v1(
    AtenTensorHandle x, AtenTensorHandle arena, AtenTensorHandle ctrl, int64_t slot, int64_t kind, int64_t reason,
    int64_t offset, const int64_t* payload, int64_t payload_len_, int64_t capacity, int64_t tokens, ...) {
  return aoti_torch_cpu_capture_export_v1(x, arena, ctrl, slot, kind, reason, offset, payload, payload_len_,
                                          capacity, tokens);  // the same host gates; the kernel by device
}
#endif

}  // extern "C"
