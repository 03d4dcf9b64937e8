// The plan: the tag registry an exported program was traced with, as compiledump.aot.package stores
// it in the package's metadata (compiledump/aot/plan.py writes the text; docs/export.md, "The plan").
#include "compiledump.h"

#include <algorithm>
#include <sstream>

namespace compiledump {

Plan Plan::parse(const std::string& plan_text, const std::string& config_json) {
  Plan plan;
  plan.config_json = config_json;
  std::istringstream lines(plan_text);
  std::string line;
  std::getline(lines, line);
  TORCH_CHECK(line == "compiledump-plan 1", "compiledump: not a compiledump plan (first line '", line, "')");
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    std::istringstream f(line);
    std::string what;
    f >> what;
    if (what == "slot") {
      PlanSlot s;
      int64_t ndim = 0, source_ndim = 0;
      f >> s.index >> s.kind >> s.order >> s.offset >> s.capacity >> s.source_dtype >> ndim;
      s.placed = ndim >= 0;
      s.shape.resize(std::max<int64_t>(ndim, 0));
      for (auto& d : s.shape) f >> d;
      f >> source_ndim;
      s.source_shape.resize(std::max<int64_t>(source_ndim, 0));
      for (auto& d : s.source_shape) f >> d;
      if (source_ndim < 0) s.source_shape = {-2};  // unknown: written as null
      if (s.source_dtype == "-") s.source_dtype.clear();
      f >> s.tag;
      TORCH_CHECK(!f.fail() && !s.tag.empty(), "compiledump: bad plan line '", line, "'");
      plan.slots[s.index] = s;
    } else if (what == "past_capacity") {
      int64_t index = -1;
      std::string reason;
      f >> index >> reason;
      const auto slot = plan.slots.find(index);
      TORCH_CHECK(!f.fail() && slot != plan.slots.end(), "compiledump: bad plan line '", line, "'");
      slot->second.past_capacity = reason;
    } else if (what == "filtered") {
      std::string tag, reason;
      f >> tag >> reason;
      plan.filtered.emplace_back(tag, reason);
    } else if (what == "overflow") {
      std::string tag;
      int64_t kind = -1;
      f >> tag;
      if (!(f >> kind)) kind = -1;
      plan.overflow.emplace_back(tag, kind);
    } else if (what == "version") {
      f >> plan.version;
    } else if (what == "arena_words") {
      f >> plan.arena_words;
    } else if (what == "ctrl_words") {
      f >> plan.ctrl_words;
    } else if (what == "used_words") {
      f >> plan.used_words;
    } else if (what == "max_rows") {
      f >> plan.max_rows;
    } else if (what == "prompt_tokens") {
      f >> plan.prompt_tokens;
    } else if (what == "device_type") {
      f >> plan.device_type;
    }  // other header lines: added by later versions, ignored
  }
  TORCH_CHECK(plan.arena_words > 0 && plan.ctrl_words > 0, "compiledump: plan without arena sizes");
  return plan;
}

Plan Plan::from_metadata(const std::unordered_map<std::string, std::string>& metadata) {
  const auto plan = metadata.find("compiledump.plan");
  const auto config = metadata.find("compiledump.config");
  TORCH_CHECK(plan != metadata.end() && config != metadata.end(),
              "compiledump: the package has no compiledump plan; package it with compiledump.aot.package");
  return parse(plan->second, config->second);
}

void Plan::merge(const Plan& other) {
  TORCH_CHECK(arena_words == other.arena_words && ctrl_words == other.ctrl_words,
              "compiledump: packages exported for different arena sizes");
  for (const auto& [index, slot] : other.slots) {
    auto it = slots.find(index);
    if (it == slots.end()) {
      slots[index] = slot;
    } else if (!it->second.placed && slot.placed) {
      it->second = slot;
    } else {
      TORCH_CHECK(it->second.tag == slot.tag && it->second.kind == slot.kind &&
                      (!slot.placed || (it->second.offset == slot.offset && it->second.shape == slot.shape)),
                  "compiledump: packages disagree about slot ", index, " (", it->second.tag, " / ", slot.tag,
                  "); export them in one process, against one registry");
    }
  }
  used_words = std::max(used_words, other.used_words);
  for (const auto& entry : other.filtered)
    if (std::find(filtered.begin(), filtered.end(), entry) == filtered.end()) filtered.push_back(entry);
  for (const auto& entry : other.overflow)
    if (std::find(overflow.begin(), overflow.end(), entry) == overflow.end()) overflow.push_back(entry);
}

}  // namespace compiledump
