#include "abandon.hpp"

#include <mutex>
#include <vector>

namespace dt {

namespace {
struct Abandoned {
  std::mutex mu;
  std::vector<std::unique_ptr<std::uint8_t[]>> kept;
};
// Never destroyed: a transport may write into what it holds while the process exits.
Abandoned& abandoned() {
  static Abandoned* a = new Abandoned();
  return *a;
}
}  // namespace

void abandon(std::unique_ptr<std::uint8_t[]> p) noexcept {
  if (!p) return;
  Abandoned& a = abandoned();
  std::lock_guard<std::mutex> lk(a.mu);
  try {
    a.kept.push_back(std::move(p));
  } catch (...) {
    (void)p.release();  // no room to keep it reachable: never freed all the same
  }
}

}  // namespace dt
