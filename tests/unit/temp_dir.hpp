// A fresh directory under the system temp dir for one test, removed with everything in it.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

namespace dt::test {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag = "dt_test") {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           (tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// Writes `bytes` (binary) to a file `name` in the directory; returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    const auto p = path / name;
    std::ofstream out(p, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p.string();
  }
};

}  // namespace dt::test
