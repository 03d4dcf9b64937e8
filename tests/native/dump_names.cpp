// The C++ flush's dump names (kernels/dump.cpp `Dump::flush`, `Dump::stem_in`), run by
// tests/native/test_dump_names.py in an empty working directory. Prints one line per flush:
// `<label> <npz path>`, then the files left when every Dump is gone.
#include "compiledump.h"

#include <filesystem>
#include <iostream>

int main() {
  const std::string plan_text =
      "compiledump-plan 1\nversion 0\narena_words 1024\nctrl_words 64\nused_words 4\nmax_rows 1\n"
      "prompt_tokens 0\ndevice_type cpu\nslot 1 1 0 0 1 float32 1 4 1 4 a\n";
  const auto plan = compiledump::Plan::parse(plan_text, "{}");
  {
    compiledump::Dump x(plan, at::kCPU), y(plan, at::kCPU);
    const std::filesystem::path first = x.flush("out");
    std::cout << "x " << first.string() << "\n";
    // Moved away between flushes (as an engine moves each session's dump): the name stays x's.
    std::filesystem::create_directories("moved");
    for (const char* suffix : {".npz", ".json"}) {
      const std::filesystem::path file = std::filesystem::path(first).replace_extension(suffix);
      std::filesystem::rename(file, std::filesystem::path("moved") / file.filename());
    }
    std::cout << "y " << y.flush("out") << "\n";
    std::cout << "x-slash " << x.flush("out/") << "\n";
    std::cout << "x-dot " << x.flush("./out") << "\n";
    // The directory removed: created again, the name kept. (File by file: torch 2.11's libtorch
    // exports a std::filesystem::remove_all that crashes when called from here.)
    for (const auto& entry : std::filesystem::directory_iterator("out")) std::filesystem::remove(entry.path());
    std::filesystem::remove("out");
    std::cout << "x-again " << x.flush("out") << "\n";
    std::cout << "y-again " << y.flush("out") << "\n";
  }
  for (const auto& entry : std::filesystem::directory_iterator("out")) std::cout << "left " << entry.path().filename().string() << "\n";
  return 0;
}
