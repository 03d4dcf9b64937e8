// The dump format's names: the C++ copy of compiledump/format/spec.py (tests/format/test_spec.py
// checks every constant here, and the drop-reason and kind names in dump.cpp, against Python).
#pragma once

namespace compiledump {

constexpr const char* kFormatName = "compiledump-dump";
constexpr int kFormatVersion = 1;
constexpr const char* kStemPrefix = "compiledump";
constexpr const char* kLiveSuffix = ".live";    // a process's crash-proof files: `<stem>.live/`
constexpr const char* kClaimSuffix = ".claim";  // `.<stem>.claim`: a name reserved by a running process

}  // namespace compiledump
