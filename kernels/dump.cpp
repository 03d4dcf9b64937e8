// The C++ flush: the same .npz + .json dump as compiledump.flush() (compiledump/capture/flush.py
// `_collect`, compiledump/format/writer.py), for processes without Python. The plan (plan.cpp: the
// registry an exported program was traced with) names the arena's regions; the counters come from ctrl.
#include "compiledump.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/version.h>

#include <algorithm>
#include <cerrno>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <set>
#include <stdexcept>

#include <fcntl.h>   // open: the exclusive name reservation
#include <unistd.h>  // getpid

#include "capture.h"
#include "format.h"
#include "layout.h"
#include "npz.h"

#ifdef COMPILEDUMP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace compiledump {
namespace {

// Drop reasons by counter, in manifest order (compiledump/ops/layout.py DROP_REASONS).
const std::array<std::pair<int64_t, const char*>, 7> kDropReasons{{
    {CNT_SUSPENDED, "suspended"},
    {CNT_TOKEN_GATE, "token_gate"},
    {CNT_ROWS_GATE, "rows_gate"},
    {CNT_ROW_OUT_OF_RANGE, "row_out_of_range"},
    {CNT_SHAPE_CHANGED, "shape_changed"},
    {CNT_ARENA_FULL, "arena_full"},
    {CNT_TAG_TABLE_FULL, "tag_table_full"},
}};

const char* kind_name(int64_t kind) {
  switch (kind) {
    case KIND_RECORD: return "record";
    case KIND_RECORD_ROWS: return "record";
    case KIND_RECORD_ONCE: return "record_once";
    case KIND_STEP: return "step";
    case KIND_IDS: return "ids";
  }
  throw std::runtime_error("compiledump: unknown capture kind " + std::to_string(kind));
}

// The manifest's "tokens" of a token-gated key (capture/flush.py `_kept_tokens`): shape[0] of the
// call whose value was kept; -1 (null) for the other kinds and shapes.
int64_t kept_tokens(const PlanSlot& slot, int32_t kept_word) {
  if (slot.kind == KIND_IDS) return slot.shape.empty() ? -1 : slot.shape[0];
  if ((slot.kind == KIND_RECORD || slot.kind == KIND_RECORD_ROWS) && kept_word > 0) return kept_word;
  return -1;  // none kept, or a tensor stored whole
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string json_ints(const std::vector<int64_t>& v, bool negative_is_null = false) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ",";
    out += negative_is_null && v[i] < 0 ? "null" : std::to_string(v[i]);
  }
  return out + "]";
}

// The manifest's "phase" (capture/collect.py `phase_of`): prefill when the call had the prompt's
// token count, else decode; null when either is unknown.
std::string phase_json(int64_t tokens, int64_t prompt_tokens) {
  if (tokens <= 0 || prompt_tokens <= 0) return "null";
  return tokens == prompt_tokens ? "\"prefill\"" : "\"decode\"";
}

// Whether `tag` holds a sparse-attention indexer's scores (format/spec.py `masked_scores`).
bool masked_scores(const std::string& tag) {
  for (const std::string suffix : {"_index_router", "_index_step_router"})
    if (tag.size() >= suffix.size() && tag.compare(tag.size() - suffix.size(), suffix.size(), suffix) == 0)
      return true;
  return false;
}

// A tag's "nonfinite" manifest entry (capture/collect.py `_nonfinite`), "" when its kernels saw
// no NaN/Inf: the first such call's key, phase, step and token count, and how many values.
std::string nonfinite_json(const PlanSlot& slot, const int32_t* words, int64_t prompt_tokens) {
  const int64_t count = words[SLOT_NONFINITE], first = words[SLOT_BAD_STEP];
  if (!count || !first) return "";
  const int64_t step = first - 1, tokens = words[SLOT_BAD_TOKENS];
  const bool is_step = slot.kind == KIND_STEP;
  return "{\"key\":" + json_string(is_step ? slot.tag + "_" + std::to_string(step) : slot.tag) +
         ",\"tag\":" + json_string(slot.tag) +
         ",\"phase\":" + (is_step ? "\"decode\"" : phase_json(tokens, prompt_tokens)) +
         ",\"step\":" + std::to_string(step) + ",\"tokens\":" + (tokens ? std::to_string(tokens) : "null") +
         ",\"count\":" + std::to_string(count) + ",\"saturated\":" + (count >= NONFINITE_CAP ? "true" : "false") +
         "}";
}

// When the first non-finite call of a tag ran: -1 for the prompt's phase, else its step.
int64_t first_nonfinite_when(const PlanSlot& slot, const int32_t* words, int64_t prompt_tokens) {
  const int64_t tokens = words[SLOT_BAD_TOKENS];
  const bool prefill = slot.kind != KIND_STEP && tokens > 0 && prompt_tokens > 0 && tokens == prompt_tokens;
  return prefill ? -1 : words[SLOT_BAD_STEP] - 1;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value && *value ? value : fallback;
}

}  // namespace

Dump::Dump(Plan plan, c10::Device device) : plan_(std::move(plan)) {
  TORCH_CHECK(device.str().rfind(plan_.device_type, 0) == 0, "compiledump: the program was exported for ",
              plan_.device_type, ", not ", device.str());
  arena_ = at::empty({plan_.arena_words}, at::TensorOptions().dtype(at::kFloat).device(device));
  ctrl_ = at::zeros({plan_.ctrl_words}, at::TensorOptions().dtype(at::kInt).device(device));
  set_register(REG_ENABLED, 1);
  set_register(REG_MAX_ROWS, plan_.max_rows);
  set_register(REG_RECORD_ROW, -1);
  set_register(REG_STEP_ROW, 0);
}

void Dump::set_register(int64_t index, int64_t value) {
  TORCH_CHECK(index >= 0 && index < HEADER_WORDS, "compiledump: no register ", index);
  ctrl_[index].fill_(value);
}

void Dump::set_rows(int64_t rows) { set_register(REG_ROWS, rows); }
void Dump::set_enabled(bool enabled) { set_register(REG_ENABLED, enabled ? 1 : 0); }
void Dump::set_gather_rows(int64_t record_row, int64_t step_row) {
  set_register(REG_RECORD_ROW, record_row);
  set_register(REG_STEP_ROW, step_row);
}

std::string Dump::flush(const std::string& dir) const {
  if (plan_.slots.empty()) return "";
  at::Tensor arena, ctrl;
  {
    // One copy of each; on CPU under the kernel's lock, so no capture is half-written.
    std::unique_lock<std::mutex> guard(capture_mutex(), std::defer_lock);
    if (arena_.is_cpu()) guard.lock();
#ifdef COMPILEDUMP_WITH_CUDA
    if (arena_.is_cuda()) {
      // Captures may have been issued on any stream, not only the one the copy waits for.
      c10::cuda::CUDAGuard device_guard(arena_.device());
      c10::cuda::device_synchronize();
    }
#endif
    arena = arena_.narrow(0, 0, plan_.used_words).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    ctrl = ctrl_.to(at::kCPU, false, true);
  }
  const float* words = arena.data_ptr<float>();
  const int32_t* counts_all = ctrl.data_ptr<int32_t>();

  std::vector<const PlanSlot*> ordered;
  for (const auto& [index, slot] : plan_.slots) ordered.push_back(&slot);
  std::sort(ordered.begin(), ordered.end(), [](auto* a, auto* b) { return a->order < b->order; });

  std::vector<Member> members;
  std::string keys, tags;
  std::map<std::string, int64_t> totals;
  std::vector<std::string> total_order;
  auto add_total = [&](const std::string& name, int64_t count) {
    if (!totals.count(name)) total_order.push_back(name);
    totals[name] += count;
  };
  std::set<std::string> tag_names;  // the entries written, which an old plan's overflow tag must not replace
  std::string first_nonfinite;        // the manifest's first_nonfinite ("" : null)
  std::pair<int64_t, int64_t> first_when{0, 0};
  for (const PlanSlot* slot : ordered) {
    if (slot->index == 0) continue;
    const int32_t* counts = counts_all + slot_base(slot->index);
    int64_t calls = 0;
    for (int64_t c = 0; c < SLOT_COUNTERS; ++c) calls += counts[c];
    const int64_t written = counts[CNT_WRITTEN];
    std::vector<std::pair<std::string, int64_t>> drops;
    for (const auto& [counter, name] : kDropReasons)
      if (counts[counter]) drops.emplace_back(name, counts[counter]);
    int64_t kept = 0;
    if (slot->placed && slot->offset >= 0 && written) {
      kept = std::min(written, slot->capacity);
      if (slot->kind == KIND_STEP && written > slot->capacity)
        drops.emplace_back(slot->past_capacity, written - slot->capacity);
      int64_t numel = 1;
      for (int64_t d : slot->shape) numel *= d;
      const bool ids = slot->kind == KIND_IDS;
      const std::string source_shape =
          slot->source_shape == std::vector<int64_t>{-2} ? "null" : json_ints(slot->source_shape, true);
      const int64_t tokens = kept_tokens(*slot, counts[SLOT_KEPT_TOKENS]);
      const std::string phase = phase_json(tokens, plan_.prompt_tokens);
      for (int64_t n = 0; n < kept; ++n) {
        const bool step = slot->kind == KIND_STEP;
        const std::string key = step ? slot->tag + "_" + std::to_string(n) : slot->tag;
        members.push_back({key + ".npy", npy(ids ? "<i4" : "<f4", slot->shape, words + slot->offset + n * numel,
                                              static_cast<size_t>(numel) * 4)});
        if (!keys.empty()) keys += ",";
        keys += json_string(key) + ":{\"tag\":" + json_string(slot->tag) + ",\"kind\":\"" + kind_name(slot->kind) +
                "\",\"step\":" + (step ? std::to_string(n) : "null") + ",\"order\":" + std::to_string(slot->order) +
                ",\"source_dtype\":" + (slot->source_dtype.empty() ? "null" : json_string(slot->source_dtype)) +
                ",\"source_shape\":" + source_shape + ",\"dtype\":\"" + (ids ? "int32" : "float32") +
                "\",\"shape\":" + json_ints(slot->shape) + ",\"tokens\":" +
                (tokens < 0 ? "null" : std::to_string(tokens)) + ",\"phase\":" + phase +
                (slot->kind == KIND_RECORD_ROWS ? ",\"rows\":\"all\"" : "") + "}";
      }
    }
    std::string drop_json;
    for (const auto& [name, count] : drops) {
      drop_json += (drop_json.empty() ? "" : ",") + json_string(name) + ":" + std::to_string(count);
      add_total(name, count);
    }
    if (!tags.empty()) tags += ",";
    tag_names.insert(slot->kind == KIND_STEP ? slot->tag + "_<n>" : slot->tag);
    const std::string nonfinite = nonfinite_json(*slot, counts, plan_.prompt_tokens);
    tags += json_string(slot->kind == KIND_STEP ? slot->tag + "_<n>" : slot->tag) + ":{\"tag\":" +
            json_string(slot->tag) + ",\"kind\":\"" + kind_name(slot->kind) + "\",\"order\":" +
            std::to_string(slot->order) + ",\"calls\":" + std::to_string(calls) + ",\"passed\":" +
            std::to_string(written) + ",\"kept\":" + std::to_string(kept) + ",\"drops\":{" + drop_json + "}" +
            (nonfinite.empty() ? "" : ",\"nonfinite\":" + nonfinite) + "}";
    // The dump's first non-finite value: the prompt's phase first, then by step, then in forward
    // order (capture/collect.py); never a sparse-attention indexer's scores, -inf by design.
    if (!nonfinite.empty() && !masked_scores(slot->tag)) {
      const std::pair<int64_t, int64_t> when{first_nonfinite_when(*slot, counts, plan_.prompt_tokens), slot->order};
      if (first_nonfinite.empty() || when < first_when) first_nonfinite = nonfinite, first_when = when;
    }
  }
  if (!plan_.overflow.empty()) {
    // Tags past the table share slot 0: only the totals can report their calls.
    const int32_t* shared = counts_all + slot_base(0);
    for (const auto& [counter, name] : kDropReasons)
      if (shared[counter]) add_total(name, shared[counter]);
    for (const auto& [tag, kind] : plan_.overflow) {
      // Named as a kept tag of its kind is (a step tag `<tag>_<n>`): a record and a step tag of one
      // name are two entries, and a JSON object keeps only the last of two equal names.
      const std::string name = kind == KIND_STEP ? tag + "_<n>" : tag;
      if (kind < 0 && tag_names.count(name)) continue;  // an old plan's: never over a kept tag's entry
      if (!tags.empty()) tags += ",";
      tags += json_string(name) + ":{\"tag\":" + json_string(tag) + ",\"kind\":" +
              (kind < 0 ? std::string("null") : "\"" + std::string(kind_name(kind)) + "\"") +
              ",\"order\":null,\"calls\":null,\"passed\":0,\"kept\":0,\"drops\":{\"tag_table_full\":null}}";
    }
  }
  std::string drops_json, filtered_json;
  for (const auto& name : total_order)
    drops_json += (drops_json.empty() ? "" : ",") + json_string(name) + ":" + std::to_string(totals[name]);
  for (const auto& [tag, reason] : plan_.filtered)
    filtered_json += (filtered_json.empty() ? "" : ",") + json_string(tag) + ":" + json_string(reason);

  // The settings as exported, with this run's directory.
  std::string settings = plan_.config_json;
  const size_t open = settings.find('{'), close = settings.rfind('}');
  settings = open == std::string::npos || close == std::string::npos ? "" : settings.substr(open + 1, close - open - 1);
  const std::string rank = env_or("RANK", "x");
  const std::string world = env_or("WORLD_SIZE", "");
  const bool world_is_number = !world.empty() && world.find_first_not_of("0123456789") == std::string::npos;
  char created[64];
  std::snprintf(created, sizeof created, "%.6f",
                std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());

  const std::string manifest =
      std::string("{\"format\":\"") + kFormatName + "\",\"format_version\":" + std::to_string(kFormatVersion) +
      ",\"compiledump_version\":" +
      json_string(plan_.version) + ",\"torch_version\":" + json_string(TORCH_VERSION) + ",\"created_unix\":" +
      created + ",\"rank\":" + json_string(rank) + ",\"pid\":" + std::to_string(getpid()) +
      ",\"world_size\":" + (world_is_number ? world : "null") + ",\"device\":" + json_string(arena_.device().str()) +
      ",\"config\":{\"dir\":" + json_string(dir) + (settings.empty() ? "" : "," + settings) + "},\"keys\":{" + keys +
      "},\"tags\":{" + tags + "},\"drops\":{" + drops_json + "},\"filtered_tags\":{" + filtered_json +
      "},\"arena_words_used\":" + std::to_string(plan_.used_words) + ",\"prompt_tokens\":" +
      (plan_.prompt_tokens > 0 ? std::to_string(plan_.prompt_tokens) : "null") +
      ",\"parallel\":{},\"first_nonfinite\":" + (first_nonfinite.empty() ? "null" : first_nonfinite) +
      ",\"writer\":\"native\"}";

  const std::filesystem::path out(dir);
  const std::string stem = stem_in(dir);
  if (std::filesystem::create_directories(out)) {
    // Removed since the first flush: the reservation goes back with it (another Dump could take
    // the name otherwise).
    const int fd = ::open((out / ("." + stem + kClaimSuffix)).c_str(), O_CREAT | O_WRONLY, 0666);
    if (fd >= 0) ::close(fd);
  }
  const auto npz_path = out / (stem + ".npz");
  atomic_write(npz_path, zip_stored(members));  // npz first: a manifest never names a missing key
  atomic_write(out / (stem + ".json"), manifest);
  return npz_path.string();
}

Dump::~Dump() {
  // The name reservations (kept while this Dump lives: its dump may be moved away between flushes,
  // and another Dump must not take the name meanwhile).
  std::lock_guard<std::mutex> guard(stems_mutex_);
  for (const auto& [directory, stem] : stems_) {
    std::error_code ignored;
    std::filesystem::remove(std::filesystem::path(directory) / ("." + stem + kClaimSuffix), ignored);
  }
}

std::string Dump::stem_in(const std::string& dir) const {
  std::lock_guard<std::mutex> guard(stems_mutex_);
  // One key per directory however it is spelled ("out", "out/", "./out"; symbolic links resolved
  // where the directory exists, as the Python flush's journal does).
  std::error_code error;
  std::filesystem::path where = std::filesystem::weakly_canonical(std::filesystem::absolute(dir), error);
  if (error) where = std::filesystem::absolute(dir).lexically_normal();
  if (where.filename().empty()) where = where.parent_path();
  const std::string key = where.string();
  const auto known = stems_.find(key);
  if (known != stems_.end()) return known->second;
  std::filesystem::create_directories(dir);
  const std::string base = std::string(kStemPrefix) + "_rank" + env_or("RANK", "x") + "_pid" + std::to_string(getpid());
  for (int copy = 1;; ++copy) {
    const std::string stem = copy == 1 ? base : base + "_" + std::to_string(copy);
    const std::filesystem::path path(dir);
    bool taken = false;
    for (const char* suffix : {".npz", ".json", kLiveSuffix}) {
      std::error_code error;  // none: unreadable, which the writes below then report
      const auto type = std::filesystem::symlink_status(path / (stem + suffix), error).type();
      taken = taken || (type != std::filesystem::file_type::not_found && type != std::filesystem::file_type::none);
    }
    if (taken) continue;
    // Reserved exclusively: of two Dumps choosing a name at the same moment, one moves on.
    const int fd = ::open((path / ("." + stem + kClaimSuffix)).c_str(), O_CREAT | O_EXCL | O_WRONLY, 0666);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd >= 0) ::close(fd);
    stems_[key] = stem;
    return stem;
  }
}

}  // namespace compiledump
