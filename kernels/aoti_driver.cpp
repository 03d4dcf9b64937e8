// A C++-only engine run of the built-in model (compiledump/demo/model.py), with no Python in the
// process: it loads the prefill and decode AOTInductor packages written by
// examples/export_aoti.py (compiledump.aot), runs the same engine session as
// compiledump.demo.model.run_session (prefill, a profile run with capture suspended, a wide warm-up
// decode gated by set_rows, padded decode steps), and flushes the dump through the native
// library's C++ API. `compiledump compare` then compares it with the Python run.
//
//   compiledump_aoti_driver PREFILL.pt2 DECODE.pt2 INPUTS.txt OUT_DIR
//
// INPUTS.txt (written by examples/export_aoti.py): whitespace-separated
//   prompt N ids... | profile N ids... | warmup_rows R | decode STEPS ROWS ids... (row 0 real)
//   | pad_state LAYERS ROWS DIM floats...
//
// A second use, for the tests (tests/export/test_cpp_flush.py): flush an arena and a control block
// that a Python process captured into and saved raw (float32 and int32 words, as a `.live`
// directory holds them), named by its plan, through COPIES compiledump::Dump objects alive together
// (default 1), so that the C++ flush's dump is held equal to compiledump.flush()'s on any registry:
//
//   compiledump_aoti_driver --flush-snapshot PLAN.txt CONFIG.json CTRL.i32 ARENA.f32 OUT_DIR [COPIES]
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compiledump.h"

namespace {

struct Inputs {
  std::map<std::string, at::Tensor> tensors;
  int64_t warmup_rows = 0;
};

Inputs read_inputs(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "cannot read ", path);
  Inputs inputs;
  std::string name;
  auto read_longs = [&](std::vector<int64_t> shape) {
    at::Tensor t = at::empty(shape, at::kLong);
    for (int64_t i = 0; i < t.numel(); ++i) in >> t.data_ptr<int64_t>()[i];
    return t;
  };
  while (in >> name) {
    int64_t a = 0, b = 0, c = 0;
    if (name == "prompt" || name == "profile") {
      in >> a;
      inputs.tensors[name] = read_longs({a});
    } else if (name == "warmup_rows") {
      in >> inputs.warmup_rows;
    } else if (name == "decode") {
      in >> a >> b;
      inputs.tensors[name] = read_longs({a, b});
    } else if (name == "pad_state") {
      in >> a >> b >> c;
      at::Tensor t = at::empty({a, b, c}, at::kFloat);
      for (int64_t i = 0; i < t.numel(); ++i) in >> t.data_ptr<float>()[i];
      inputs.tensors[name] = t;
    } else {
      TORCH_CHECK(false, "unknown input '", name, "' in ", path);
    }
    TORCH_CHECK(!in.fail(), "bad input '", name, "' in ", path);
  }
  for (const char* required : {"prompt", "profile", "decode", "pad_state"})
    TORCH_CHECK(inputs.tensors.count(required), "missing input '", required, "' in ", path);
  return inputs;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot read ", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Copies the raw words of `path` into `tensor` (a CPU tensor of exactly that many bytes).
void load_words(const std::string& path, at::Tensor& tensor) {
  const std::string bytes = read_file(path);
  TORCH_CHECK(bytes.size() == static_cast<size_t>(tensor.numel() * tensor.element_size()), path, " holds ",
              bytes.size(), " bytes; the plan names ", tensor.numel() * tensor.element_size());
  std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
}

int flush_snapshot(int argc, char** argv) {
  const compiledump::Plan plan = compiledump::Plan::parse(read_file(argv[2]), read_file(argv[3]));
  const int copies = argc == 8 ? std::stoi(argv[7]) : 1;
  std::vector<std::unique_ptr<compiledump::Dump>> dumps;  // alive together, as an engine's arenas are
  for (int copy = 0; copy < copies; ++copy) {
    dumps.push_back(std::make_unique<compiledump::Dump>(plan, at::kCPU));
    load_words(argv[4], dumps.back()->ctrl());
    load_words(argv[5], dumps.back()->arena());
    std::cout << dumps.back()->flush(argv[6]) << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 7 && argc <= 8 && std::string(argv[1]) == "--flush-snapshot") {
    try {
      return flush_snapshot(argc, argv);
    } catch (const std::exception& error) {
      std::cerr << "compiledump_aoti_driver: " << error.what() << "\n";
      return 1;
    }
  }
  if (argc != 5) {
    std::cerr << "usage: " << argv[0] << " PREFILL.pt2 DECODE.pt2 INPUTS.txt OUT_DIR\n"
              << "       " << argv[0] << " --flush-snapshot PLAN.txt CONFIG.json CTRL.i32 ARENA.f32 OUT_DIR [COPIES]\n";
    return 2;
  }
  try {
    torch::inductor::AOTIModelPackageLoader prefill(argv[1]), decode(argv[2]);
    // Both packages were exported against one registry: their plans are parts of one plan.
    compiledump::Plan plan = compiledump::Plan::from_metadata(prefill.get_metadata());
    plan.merge(compiledump::Plan::from_metadata(decode.get_metadata()));
    // The device the packages were compiled for (their inputs must live there).
    const c10::Device device(plan.device_type == "cuda" ? "cuda:0" : plan.device_type);
    compiledump::Dump dump(plan, device);
    Inputs inputs = read_inputs(argv[3]);
    for (auto& [name, tensor] : inputs.tensors) tensor = tensor.to(device);
    c10::InferenceMode inference;  // no autograd bookkeeping for the run

    // 1. Prefill of the prompt.
    dump.set_rows(1);
    std::vector<at::Tensor> out = prefill.run({dump.arena(), dump.ctrl(), inputs.tensors["prompt"]});
    at::Tensor state = out.at(1);
    // 2. The engine's profile run: capture suspended (compiledump.profiling()).
    dump.set_enabled(false);
    prefill.run({dump.arena(), dump.ctrl(), inputs.tensors["profile"]});
    dump.set_enabled(true);
    // 3. A wide warm-up decode, reported through set_rows: record_step must skip it.
    if (inputs.warmup_rows > 0) {
      const int64_t rows = inputs.warmup_rows;
      dump.set_rows(rows);
      decode.run({dump.arena(), dump.ctrl(), at::zeros({rows}, at::TensorOptions(at::kLong).device(device)),
                  at::zeros({state.size(0), rows, state.size(2)}, state.options())});
    }
    // 4. Padded decode steps: row 0 is the real request.
    state = at::cat({state, inputs.tensors["pad_state"].to(state.dtype())}, 1);
    const at::Tensor& steps = inputs.tensors["decode"];
    for (int64_t step = 0; step < steps.size(0); ++step) {
      dump.set_rows(1);
      out = decode.run({dump.arena(), dump.ctrl(), steps[step].contiguous(), state});
      state = out.at(1);
    }
    std::cout << dump.flush(argv[4]) << std::endl;
  } catch (const std::exception& error) {
    std::cerr << "compiledump_aoti_driver: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
