// The dump format's names: the C++ copy of compiledump/format/spec.py (tests/format/test_spec.py
// checks every constant here, and the drop-reason and kind names in dump.cpp, against Python).
#pragma once

namespace compiledump {

constexpr const char* kFormatName = "compiledump-dump";
constexpr int kFormatVersion = 1;
constexpr const char* kStemPrefix = "compiledump";

}  // namespace compiledump
