// The device-side gates of one capture, shared by the CPU and the CUDA kernel: which single
// counter of the slot a call increments (the precedence of ops.capture_reference and the
// Triton kernel) and which row it gathers. Reads only the header registers.
#pragma once
#include <c10/macros/Macros.h>

#include <cstdint>

#include "layout.h"

namespace compiledump {

struct Gate {
  int64_t counter;  // CNT_WRITTEN, or the drop reason counted
  int64_t row;      // the row to gather (meaningful when counter == CNT_WRITTEN)
};

C10_HOST_DEVICE inline Gate choose_counter(const int32_t* regs, int64_t kind, int64_t reason, int64_t T,
                                           int64_t row_reg) {
  const bool enabled = regs[REG_ENABLED] != 0;
  const bool rows_ok = kind != KIND_STEP || regs[REG_ROWS] <= regs[REG_MAX_ROWS];
  int64_t row = row_reg < 0 ? 0 : regs[row_reg];
  if (row < 0) row += T;
  const bool row_ok = row >= 0 && row < T;
  int64_t counter = CNT_WRITTEN;
  if (!enabled) counter = CNT_SUSPENDED;
  else if (reason != 0) counter = reason;
  else if (!rows_ok) counter = CNT_ROWS_GATE;
  else if (!row_ok) counter = CNT_ROW_OUT_OF_RANGE;
  return {counter, row};
}

}  // namespace compiledump
