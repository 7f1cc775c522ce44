// Cost of one dt::trace::Scope (constructor + destructor) with tracing off and on, one thread.
//   bench_trace [N]     prints "off_ns on_ns" (nanoseconds per scope, best of 5 rounds of N)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "dt/trace.hpp"

namespace {
double ns_per_scope(long n) {
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) {
      const dt::trace::Scope s("bench", "bench", "i", i);
    }
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ns / static_cast<double>(n));
  }
  return best;
}
}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 200000;
  const double off = ns_per_scope(n);
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("dt_bench_trace_" + std::to_string(getpid())))
          .string();
  double on = 0;
  {
    dt::trace::start(0, dir);  // 5 rounds of n events stay under the per-thread limit for n <= 200k
    on = ns_per_scope(n);
    dt::trace::stop();
  }
  std::filesystem::remove_all(dir);
  std::printf("%.2f %.2f\n", off, on);
  return 0;
}
