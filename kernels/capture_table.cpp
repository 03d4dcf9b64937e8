// `compiledump::capture_v1` served from C++: the region table and the op's native kernel, on CPU
// and, when the library is built with CUDA, on CUDA (the decisions are host metadata either way).
//
// Python's tag registry (compiledump/capture/arena.py `Runtime.resolve`) decides, for each call
// of the capture op, the arena region, the token gate and the payload-shape check. Once a tag's
// region is claimed those decisions need nothing Python knows that C++ cannot be told: the
// region (offset, capacity, payload shape), the prompt length of the token gate, and whether a
// 3-D record may still need its layout warning. Python pushes them here (`table_region_v1`,
// `table_gate_v1`) and this kernel decides in C++, so a call from Inductor's generated code
// reaches the capture kernel without Python. A call the table cannot decide (a tag's first
// capture, a prompt length not yet learned, a layout that may need its warning, an arena that is
// not the bound one) goes once through `capture_resolve_v1`, the Python implementation, which
// decides it, runs the kernel and pushes what it learned.
#include <torch/library.h>
#include <torch/version.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "capture.h"
#include "layout.h"

namespace compiledump {
namespace {

struct Region {
  int64_t kind = 0, offset = -1, capacity = 0;
  std::vector<int64_t> payload;  // the shape one capture stores
  bool check_layout = false;     // a 3-D record whose reading may still need a warning (Python)
};

// The table of the process's one arena (Python's Runtime), bound to its control block: a call
// with another control block (a reset arena's, or opcheck's clones) is decided by Python. The
// table holds the bound control block, so its address is never reused while bound.
struct Table {
  std::mutex mutex;
  at::Tensor ctrl;
  int64_t prompt_tokens = -1;  // -1: not learned yet (a gated call goes to Python, which learns it)
  bool gate_on = false;
  std::unordered_map<int64_t, Region> regions;

  bool bound_to(const at::Tensor& block) const {
    return ctrl.defined() && ctrl.const_data_ptr() == block.const_data_ptr();
  }
};

Table& table() {
  // Never destroyed: the tensor it holds must not be freed after torch's allocator at exit.
  static Table* t = new Table;
  return *t;
}

// capture/layouts.py `doubtful_hc_reading` (MAX_HC_MULT 16).
bool doubtful_hc_reading(at::IntArrayRef shape, int64_t prompt_tokens) {
  const int64_t tokens = shape[0], middle = shape[1];
  return middle > 16 || (tokens == 1 && middle > 1) ||
         (prompt_tokens >= 0 && tokens != prompt_tokens && prompt_tokens == middle);
}

// The kernel arguments Runtime.resolve would return, or false when only Python can decide.
struct Decision {
  int64_t offset = -1, capacity = 0, reason = 0;
};

bool decide(const at::Tensor& x, const at::Tensor& arena, const at::Tensor& ctrl, int64_t slot, int64_t kind,
            int64_t reason, Decision& out) {
  if (x.device() != arena.device() || ctrl.device() != arena.device()) return false;  // Python raises
  Table& t = table();
  std::lock_guard<std::mutex> guard(t.mutex);
  if (!t.bound_to(ctrl)) return false;
  const auto found = t.regions.find(slot);
  if (reason != 0 || slot == 0) {
    if (slot != 0 && found == t.regions.end()) return false;  // Python checks the slot exists
    out.reason = reason;
    return true;
  }
  if (found == t.regions.end() || found->second.kind != kind) return false;
  const Region& region = found->second;
  if (is_token_gated_kind(kind) && x.dim() > 0) {
    if (t.prompt_tokens < 0) return false;
    if (t.gate_on && x.size(0) != t.prompt_tokens) {
      out.reason = CNT_TOKEN_GATE;
      return true;
    }
  }
  if (!payload_matches(x.sizes(), kind, region.payload)) {
    out.reason = CNT_SHAPE_CHANGED;
    return true;
  }
  if (region.offset < 0) {
    out.reason = CNT_ARENA_FULL;
    return true;
  }
  if (region.check_layout && x.dim() == 3 && doubtful_hc_reading(x.sizes(), t.prompt_tokens)) return false;
  out.offset = region.offset;
  out.capacity = region.capacity;
  return true;
}

void capture_from_table(const at::Tensor& x, at::Tensor& arena, at::Tensor& ctrl, int64_t slot, int64_t kind,
                        int64_t reason) {
  Decision d;
  if (!decide(x, arena, ctrl, slot, kind, reason, d)) {
    static auto resolve = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("compiledump::capture_resolve_v1", "")
                              .typed<void(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, int64_t, int64_t)>();
    resolve.call(x, arena, ctrl, slot, kind, reason);
    return;
  }
  const Geometry g = geometry(x, kind);
  capture_kernel_call(g, arena, ctrl, kind, slot_base(slot), d.offset, d.capacity, d.reason);
}

void table_gate(const at::Tensor& ctrl, int64_t prompt_tokens, bool gate_on, bool bind) {
  Table& t = table();
  std::lock_guard<std::mutex> guard(t.mutex);
  if (bind) {
    // A new arena: forget the last one's regions.
    t.regions.clear();
    t.ctrl = ctrl;
  }
  TORCH_CHECK(t.bound_to(ctrl), "compiledump: table_gate_v1 for a control block not bound");
  t.prompt_tokens = prompt_tokens;
  t.gate_on = gate_on;
}

void table_region(const at::Tensor& ctrl, int64_t slot, int64_t kind, int64_t offset, int64_t capacity,
                  at::IntArrayRef payload, bool check_layout) {
  Table& t = table();
  std::lock_guard<std::mutex> guard(t.mutex);
  TORCH_CHECK(t.bound_to(ctrl), "compiledump: table_region_v1 for a control block not bound");
  t.regions[slot] = Region{kind, offset, capacity, payload.vec(), check_layout};
}

}  // namespace
}  // namespace compiledump

TORCH_LIBRARY_IMPL(compiledump, CPU, m) {
  m.impl("capture_v1", &compiledump::capture_from_table);
  m.impl("table_gate_v1", &compiledump::table_gate);
  m.impl("table_region_v1", &compiledump::table_region);
}

// The control block's layout this library was built for (layout.h CONTROL_LAYOUT).
extern "C" int64_t compiledump_control_layout() { return compiledump::CONTROL_LAYOUT; }

// The torch release this library was built against, as text in the file: compiledump/ops/native.py
// reads it before loading the library, because a library built against another torch either
// fails to load (undefined symbols) or, worse, loads and disagrees with it on the C++ ABI.
#define COMPILEDUMP_STR2(x) #x
#define COMPILEDUMP_STR(x) COMPILEDUMP_STR2(x)
extern "C" __attribute__((used, visibility("default"))) const char compiledump_built_for_torch[] =
    "compiledump-built-for-torch=" COMPILEDUMP_STR(TORCH_VERSION_MAJOR) "." COMPILEDUMP_STR(
        TORCH_VERSION_MINOR) "." COMPILEDUMP_STR(TORCH_VERSION_PATCH) ";";

#ifdef COMPILEDUMP_WITH_CUDA
// The same table for an arena on a GPU: a call from Inductor's generated code (compiled without
// CUDA graphs, as engines run large prefills) is decided here and launches the CUDA kernel
// without Python; a CUDA graph records that one kernel node. The table ops take the control
// block, so they dispatch on its device. Python binds the table to a CUDA arena only with
// COMPILEDUMP_CUDA_KERNEL=native; otherwise every call finds it unbound and goes to
// `capture_resolve_v1`, which launches the Triton kernel.
TORCH_LIBRARY_IMPL(compiledump, CUDA, m) {
  m.impl("capture_v1", &compiledump::capture_from_table);
  m.impl("table_gate_v1", &compiledump::table_gate);
  m.impl("table_region_v1", &compiledump::table_region);
}
#endif
