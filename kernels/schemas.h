// The `compiledump` op schemas, for processes without Python (kernels/schemas.cpp defines
// them there). Generated from compiledump/ops/schemas.py SCHEMAS by
// `python scripts/write_schemas_header.py`; tests/export/test_aot.py checks it is current.
#pragma once

namespace compiledump {

constexpr const char* kSchemas[] = {
    "capture_v1(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason) -> ()",
    "set_register_v1(Tensor(a!) ctrl, int index, SymInt value) -> ()",
    "capture_kernel_v1(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int kind, int base, int offset, int capacity, int reason, int T, int H, int D, int stride_t, int stride_h, int stride_d, int row_reg, bool mean) -> ()",
    "capture_export_v1(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason, int offset, int[] payload, int capacity, int tokens) -> ()",
    "capture_resolve_v1(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason) -> ()",
    "table_gate_v1(Tensor ctrl, int prompt_tokens, bool gate_on, bool bind) -> ()",
    "table_region_v1(Tensor ctrl, int slot, int kind, int offset, int capacity, int[] payload, bool check_layout) -> ()",
    "snapshot_v1(Tensor arena, Tensor ctrl, int words) -> (Tensor, Tensor)",
};

}  // namespace compiledump
