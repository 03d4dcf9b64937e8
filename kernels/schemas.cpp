// Defines the `compiledump` op schemas in a process without Python (the C++ driver), where
// nothing else would. Never part of the library that Python loads: there Python defines them
// (compiledump/ops/schemas.py), and a second definition would be an error.
#include <torch/library.h>

#include "schemas.h"

TORCH_LIBRARY(compiledump, m) {
  for (const char* schema : compiledump::kSchemas) m.def(schema);
}
