// Helpers shared by dt's fuzz targets: a reader over the fuzz input and a per-process scratch file.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace dt_fuzz {

/// Consumes the fuzz input front to back; past the end every value is 0.
class Reader {
 public:
  Reader(const std::uint8_t* d, std::size_t n) : d_(d), n_(n) {}
  std::uint8_t byte() { return pos_ < n_ ? d_[pos_++] : 0; }
  std::uint64_t u64(int bytes = 8) {
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(byte()) << (8 * i);
    return v;
  }
  std::string bytes(std::size_t n) {
    std::string s;
    while (n-- > 0 && pos_ < n_) s.push_back(static_cast<char>(d_[pos_++]));
    return s;
  }
  std::string rest() { return bytes(n_ - pos_); }
  std::size_t left() const { return n_ - pos_; }

 private:
  const std::uint8_t* d_;
  std::size_t n_;
  std::size_t pos_ = 0;
};

/// A scratch path unique to this process: <temp dir>/dt_fuzz_<tag>_<pid><suffix>. What is there
/// (a file or a folder) is removed when the process exits normally (a fuzzing run's end); a
/// crash leaves it beside its artifact.
inline std::string scratch(const char* tag, const char* suffix) {
  struct Made {
    std::vector<std::filesystem::path> paths;
    ~Made() {
      std::error_code ec;
      for (const auto& p : paths) std::filesystem::remove_all(p, ec);
    }
  };
  static Made made;
  const auto path = std::filesystem::temp_directory_path() /
                    ("dt_fuzz_" + std::string(tag) + "_" + std::to_string(::getpid()) + suffix);
  made.paths.push_back(path);
  return path.string();
}

inline void write_file(const std::string& path, const void* p, std::size_t n) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return;
  if (n) std::fwrite(p, 1, n, f);
  std::fclose(f);
}

}  // namespace dt_fuzz
