// .npy/.npz writing for the C++ flush (dump.cpp): the files numpy.save and numpy.savez write, and
// the atomic replace every dump file goes through.
#include "npz.h"

#include <c10/util/Exception.h>

#include <array>
#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <unistd.h>

namespace compiledump {

namespace {

uint32_t crc32(const std::string& data) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

void put16(std::string& out, uint32_t v) {
  out += static_cast<char>(v & 0xFF);
  out += static_cast<char>((v >> 8) & 0xFF);
}
void put32(std::string& out, uint32_t v) {
  put16(out, v & 0xFFFF);
  put16(out, v >> 16);
}

}  // namespace

// A .npy (format 1.0) holding `nbytes` little-endian elements of numpy type `descr`.
std::string npy(const char* descr, const std::vector<int64_t>& shape, const void* data, size_t nbytes) {
  std::string dims;  // numpy's tuple syntax: "()", "(64,)", "(7, 2)"
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) dims += ",";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Pad with spaces so that the data starts on a 64-byte boundary, as numpy does.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  put16(out, static_cast<uint32_t>(header.size()));
  out += header;
  out.append(static_cast<const char*>(data), nbytes);
  return out;
}

std::string zip_stored(const std::vector<Member>& members) {
  std::string out, directory;
  for (const auto& m : members) {
    TORCH_CHECK(m.data.size() < 0xFFFFFFFFull && out.size() < 0xFFFFFFFFull && members.size() < 0xFFFF,
                "compiledump: dump too large for the native writer (needs zip64); flush from Python");
    const uint32_t crc = crc32(m.data), size = static_cast<uint32_t>(m.data.size());
    const uint32_t local_offset = static_cast<uint32_t>(out.size());
    // Local file header: version 2.0, no flags, stored, 1980-01-01 00:00.
    put32(out, 0x04034b50);
    put16(out, 20), put16(out, 0), put16(out, 0), put16(out, 0), put16(out, 0x21);
    put32(out, crc), put32(out, size), put32(out, size);
    put16(out, static_cast<uint32_t>(m.name.size())), put16(out, 0);
    out += m.name;
    out += m.data;
    // Its central directory entry.
    put32(directory, 0x02014b50);
    put16(directory, 20), put16(directory, 20), put16(directory, 0), put16(directory, 0);
    put16(directory, 0), put16(directory, 0x21);
    put32(directory, crc), put32(directory, size), put32(directory, size);
    put16(directory, static_cast<uint32_t>(m.name.size())), put16(directory, 0), put16(directory, 0);
    put16(directory, 0), put16(directory, 0), put32(directory, 0), put32(directory, local_offset);
    directory += m.name;
  }
  const uint32_t directory_offset = static_cast<uint32_t>(out.size());
  out += directory;
  put32(out, 0x06054b50);
  put16(out, 0), put16(out, 0);
  put16(out, static_cast<uint32_t>(members.size())), put16(out, static_cast<uint32_t>(members.size()));
  put32(out, static_cast<uint32_t>(directory.size())), put32(out, directory_offset);
  put16(out, 0);
  return out;
}

// Temporary file in the same directory, fsync, rename: a reader sees the old or the new file.
void atomic_write(const std::filesystem::path& path, const std::string& content) {
  const std::filesystem::path tmp =
      path.parent_path() / ("." + path.filename().string() + "." + std::to_string(getpid()) + ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);  // less the umask, as Python's
  TORCH_CHECK(fd >= 0, "compiledump: cannot write ", tmp.string(), ": ", std::strerror(errno));
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      TORCH_CHECK(false, "compiledump: write failed for ", tmp.string(), ": ", std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  std::filesystem::rename(tmp, path);
}

}  // namespace compiledump
