#include "dt/error.hpp"

namespace dt {

namespace {
std::string with_location(const std::string& msg, const char* file, int line) {
  std::string f = file ? file : "?";
  // Keep the path from "src/", "include/", "apps/", "hal/" on for readable messages.
  for (const char* root : {"/src/", "/include/", "/apps/", "/hal/", "/tests/"}) {
    auto pos = f.rfind(root);
    if (pos != std::string::npos) {
      f = f.substr(pos + 1);
      break;
    }
  }
  return msg + " (" + f + ":" + std::to_string(line) + ")";
}
}  // namespace

Error::Error(const std::string& msg, const char* file, int line)
    : std::runtime_error(with_location(msg, file, line)), msg_(msg) {}

}  // namespace dt
