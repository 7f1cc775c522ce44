// CPU sets for the unit tests: what this thread may run on, and setting it (sched_getaffinity,
// sched_setaffinity), as the tests of binding and of QoS cpusets read and change them.
#pragma once

#include <doctest/doctest.h>
#include <sched.h>

#include <filesystem>
#include <string>
#include <vector>

namespace dt::test {

/// The CPUs the calling thread may run on, ascending.
inline std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

/// Lets the calling thread run on `cpus` only; with `all_threads`, every thread of the process,
/// as a launcher binds a process before it starts.
inline void allow_cpus(const std::vector<int>& cpus, bool all_threads = false) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  if (!all_threads) {
    REQUIRE(sched_setaffinity(0, sizeof set, &set) == 0);
    return;
  }
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task"))
    REQUIRE(sched_setaffinity(std::stoi(task.path().filename().string()), sizeof set, &set) == 0);
}

}  // namespace dt::test
