// .npy/.npz writing for the C++ flush: what numpy.save / numpy.savez write, without zlib or zip64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace compiledump {

// A .npy (format 1.0) holding `nbytes` little-endian elements of numpy type `descr` ("<f4", "<i4").
std::string npy(const char* descr, const std::vector<int64_t>& shape, const void* data, size_t nbytes);

// One member of an .npz: its file name inside the zip and its bytes.
struct Member {
  std::string name, data;
};

// A stored (uncompressed) zip of `members`, as numpy.savez writes; fails past the 4 GiB zip limit.
std::string zip_stored(const std::vector<Member>& members);

// Temporary file in the same directory, fsync, rename: a reader sees the old or the new file.
void atomic_write(const std::filesystem::path& path, const std::string& content);

}  // namespace compiledump
