// C++ API of the native library for processes without Python: create the arena that an exported
// program (compiledump.aot) writes into, set the registers the Python API sets, and flush the
// dump in the same files and format as compiledump.flush() (docs/format.md).
//
//   auto plan = compiledump::Plan::from_metadata(loader.get_metadata());
//   compiledump::Dump dump(plan, at::kCPU);
//   dump.set_rows(1);
//   loader.run({dump.arena(), dump.ctrl(), tokens});
//   std::string npz = dump.flush("dumps");
#pragma once
// The tensor type alone (ATen/ATen.h would pull every operator into each file that includes this one).
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace compiledump {

// One tag's slot and arena region, as exported (a `slot` line of the plan; docs/export.md).
struct PlanSlot {
  int64_t index = 0, kind = 0, order = 0, offset = -1, capacity = 1;
  std::string source_dtype;           // "" when unknown
  bool placed = false;                // false: no capture fixed the payload shape when exported
  std::vector<int64_t> shape;         // payload shape of one capture
  std::vector<int64_t> source_shape;  // -1 = a dimension that was dynamic when exported
  std::string tag;
  // The drop reason of steps past `capacity` (a `past_capacity` line; layer_steps for a layer's
  // step state bounded by COMPILEDUMP_LAYER_STEPS, a deliberate drop).
  std::string past_capacity = "step_capacity";
};

// The registry of an exported program: the `compiledump.plan` and `compiledump.config` entries
// of an AOTInductor package's metadata (written by compiledump.aot.package).
struct Plan {
  std::string version;
  int64_t arena_words = 0, ctrl_words = 0, used_words = 0, max_rows = 1;
  int64_t prompt_tokens = 0;  // the token gate's fixed prompt length when exported (0: none)
  std::string device_type = "cpu";
  std::map<int64_t, PlanSlot> slots;  // by slot index
  std::vector<std::pair<std::string, std::string>> filtered;  // tag, reason
  // Tags past max_tags (they share slot 0) and their kinds (-1: a plan written before it gave them).
  std::vector<std::pair<std::string, int64_t>> overflow;
  std::string config_json;            // the settings, without "dir"

  static Plan parse(const std::string& plan_text, const std::string& config_json);
  static Plan from_metadata(const std::unordered_map<std::string, std::string>& metadata);
  // Union with the plan of another package exported against the same registry (e.g. prefill
  // and decode); throws if they disagree about a slot or the arena's size.
  void merge(const Plan& other);
};

class Dump {
 public:
  // Allocates the arena and the control block on `device` and sets the registers to their
  // defaults (capture enabled, max_rows from the plan, record row -1, step row 0).
  Dump(Plan plan, c10::Device device);
  ~Dump();  // removes the name reservations of its flushes' directories

  at::Tensor& arena() { return arena_; }
  at::Tensor& ctrl() { return ctrl_; }
  const Plan& plan() const { return plan_; }

  // A one-word fill of the control block (a kernel on CUDA: no copy, no sync).
  void set_register(int64_t index, int64_t value);
  void set_rows(int64_t rows);              // compiledump.set_rows
  void set_enabled(bool enabled);           // false inside an engine's profile run (profiling())
  void set_gather_rows(int64_t record_row, int64_t step_row);  // compiledump.set_gather_rows

  // One device-to-host copy, then `<dir>/compiledump_rank<R>_pid<P>.npz` and `.json`, written
  // atomically (temporary file + rename). Returns the npz path; "" if the plan has no tags.
  // The first flush into a directory takes a name no other dump uses there (another Dump of this
  // process, or an earlier process of the same rank and pid: `..._pid<P>_2`, `_3`, ..., as
  // compiledump.flush() does); later flushes of this Dump rewrite that dump.
  std::string flush(const std::string& dir) const;

 private:
  std::string stem_in(const std::string& dir) const;

  Plan plan_;
  at::Tensor arena_, ctrl_;
  mutable std::mutex stems_mutex_;
  mutable std::map<std::string, std::string> stems_;  // directory -> the stem this Dump took there
};

}  // namespace compiledump
