// Layout of the control block and the capture kinds: the C++ copy of compiledump/ops/layout.py
// (tests/export/test_aot.py checks that every constant here equals the Python one).
#pragma once
#include <c10/macros/Macros.h>

#include <cstdint>

namespace compiledump {

// Header registers (word index into the control block).
constexpr int64_t REG_ENABLED = 0;
constexpr int64_t REG_ROWS = 1;
constexpr int64_t REG_MAX_ROWS = 2;
constexpr int64_t REG_RECORD_ROW = 3;
constexpr int64_t REG_STEP_ROW = 4;
constexpr int64_t REG_STEPS = 5;
constexpr int64_t REG_CHECK_ALL = 6;
constexpr int64_t HEADER_WORDS = 8;

// Per-slot counters (word offset inside a slot's record).
constexpr int64_t CNT_WRITTEN = 0;
constexpr int64_t CNT_SUSPENDED = 1;
constexpr int64_t CNT_TOKEN_GATE = 2;
constexpr int64_t CNT_ROWS_GATE = 3;
constexpr int64_t CNT_ROW_OUT_OF_RANGE = 4;
constexpr int64_t CNT_SHAPE_CHANGED = 5;
constexpr int64_t CNT_ARENA_FULL = 6;
constexpr int64_t CNT_TAG_TABLE_FULL = 7;
constexpr int64_t SLOT_COUNTERS = 8;
constexpr int64_t SLOT_KEPT_TOKENS = 8;
constexpr int64_t SLOT_COMMITTED = 9;
constexpr int64_t SLOT_NONFINITE = 10;
constexpr int64_t SLOT_BAD_STEP = 11;
constexpr int64_t SLOT_BAD_TOKENS = 12;
constexpr int64_t SLOT_CLAIM = 13;  // written by the split launches of the device kernels only
constexpr int64_t CLAIM_WRITES = 536870912;      // 1 << 29
constexpr int64_t CLAIM_CHECK_ALL = 1073741824;  // 1 << 30
constexpr int64_t SLOT_WORDS = 14;
constexpr int64_t NONFINITE_CAP = 1073741824;  // 1 << 30

// Capture kinds.
constexpr int64_t KIND_RECORD = 0;
constexpr int64_t KIND_RECORD_ONCE = 1;
constexpr int64_t KIND_STEP = 2;
constexpr int64_t KIND_IDS = 3;
constexpr int64_t KIND_RECORD_ROWS = 4;

// Launches of a capture (layout.py LAUNCH_*): whole, or a wide step or keep-first record split
// into a claim launch and a copy launch: rows of H x D >= SPLIT_MIN_READ elements over
// D >= SPLIT_MIN_COLUMNS columns (layout.py `splits`, measured there).
constexpr int64_t LAUNCH_WHOLE = 0;
constexpr int64_t LAUNCH_CLAIM = 1;
constexpr int64_t LAUNCH_COPY = 2;
constexpr int64_t SPLIT_MIN_READ = 8193;  // 4 * 2048 + 1
constexpr int64_t SPLIT_MIN_COLUMNS = 2049;  // 2048 + 1

inline bool splits(int64_t H, int64_t D) { return H * D >= SPLIT_MIN_READ && D >= SPLIT_MIN_COLUMNS; }

constexpr int64_t ROW_FIXED_ZERO = -1;
constexpr int64_t ROW_ALL = -2;

// Arena regions start on a multiple of this many words (16 bytes).
constexpr int64_t REGION_ALIGN_WORDS = 4;

inline int64_t slot_base(int64_t slot) { return HEADER_WORDS + slot * SLOT_WORDS; }

// What Python checks before it loads the library (compiledump/ops/native.py, exported as
// `compiledump_control_layout` by capture_table.cpp): a library built from older sources, say an
// editable install not rebuilt after a pull, would read and write the wrong control-block words.
constexpr int64_t CONTROL_LAYOUT = HEADER_WORDS * 1000 + SLOT_WORDS;

// The kinds the token gate applies to (ops/geometry.py TOKEN_GATED_KINDS).
C10_HOST_DEVICE inline bool is_token_gated_kind(int64_t kind) {
  return kind == KIND_RECORD || kind == KIND_RECORD_ROWS || kind == KIND_IDS;
}

// The kinds whose kept captures set SLOT_KEPT_TOKENS (layout.RECORD_KINDS).
C10_HOST_DEVICE inline bool is_record_kind(int64_t kind) {
  return kind == KIND_RECORD || kind == KIND_RECORD_ONCE || kind == KIND_RECORD_ROWS;
}

}  // namespace compiledump
