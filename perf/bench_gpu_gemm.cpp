// GEMM rate of a dt device plugin through its C ABI (hal/dt_hal_v2.h), the ceiling against which
// the GPU training benchmark's model FLOP utilisation is read. Built by perf/bench_gpu.sh with
//   g++ -O2 -std=c++17 -Ihal perf/bench_gpu_gemm.cpp -ldl
// Usage: bench_gpu_gemm PLUGIN.so [M N K [f32|bf16|f16 [reps]]]
// Prints the device line, then "gemm TYPE MxNxK: T ms per call, R TFLOP/s" (fp32 accumulation;
// C = A B^T as the model's linear layers call it). The operands are random (N(0, 1) rounded to the
// type: tensor cores draw less power, and so clock higher, on zeros), the GPU is warmed up for
// about a second from its idle clocks before timing, and the rate is the median of 5 rounds.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "dt_hal_v2.h"

namespace {
void check(const dt_hal_v2_t* t, void* ctx, int st, const char* what) {
  if (st == DT_HAL_OK) return;
  std::fprintf(stderr, "bench_gpu_gemm: %s failed: %s\n", what, t->v1.last_error(ctx));
  std::exit(1);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PLUGIN.so [M N K [f32|bf16|f16 [reps]]]\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "bench_gpu_gemm: cannot load %s: %s\n", argv[1], dlerror());
    return 1;
  }
  auto entry = reinterpret_cast<dt_hal_plugin_v2_fn>(dlsym(lib, DT_HAL_PLUGIN_V2_SYMBOL));
  if (!entry) {
    std::fprintf(stderr, "bench_gpu_gemm: %s has no %s\n", argv[1], DT_HAL_PLUGIN_V2_SYMBOL);
    return 1;
  }
  const dt_hal_v2_t* t = entry();
  const long M = argc > 2 ? std::atol(argv[2]) : 8192, N = argc > 3 ? std::atol(argv[3]) : 8192,
             K = argc > 4 ? std::atol(argv[4]) : 8192;
  const std::string type = argc > 5 ? argv[5] : "bf16";
  const int reps = argc > 6 ? std::atoi(argv[6]) : 20;
  const dt_hal_dtype dt = type == "f32" ? DT_HAL_F32 : type == "f16" ? DT_HAL_F16 : DT_HAL_BF16;
  const size_t es = dt == DT_HAL_F32 ? 4 : 2;
  void* ctx = nullptr;
  if (t->v1.open(0, &ctx) != DT_HAL_OK) {
    std::fprintf(stderr, "bench_gpu_gemm: open failed: %s\n", t->v1.last_error(nullptr));
    return 1;
  }
  char desc[256] = "";
  if (t->describe) t->describe(ctx, desc, sizeof desc);
  std::printf("device: %s\n", desc);
  void *a, *b, *c;
  check(t, ctx, t->v1.alloc(ctx, M * K * es, &a), "alloc");
  check(t, ctx, t->v1.alloc(ctx, N * K * es, &b), "alloc");
  check(t, ctx, t->v1.alloc(ctx, M * N * es, &c), "alloc");
  {  // random operands: fp32 on the host, rounded to the type by the plugin's cast
    std::mt19937_64 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> host(static_cast<size_t>(std::max(M, N) * K));
    void* staging = nullptr;
    check(t, ctx, t->v1.alloc(ctx, host.size() * sizeof(float), &staging), "alloc");
    for (void* dst : {a, b}) {
      const long rows = dst == a ? M : N;
      for (float& x : host) x = normal(rng);
      check(t, ctx,
            t->v1.copy(ctx, staging, host.data(), rows * K * sizeof(float), DT_HAL_HOST_TO_DEVICE),
            "copy");
      check(t, ctx, t->cast(ctx, dst, dt, staging, DT_HAL_F32, rows * K), "cast");
    }
    check(t, ctx, t->v1.synchronize(ctx), "synchronize");
    t->v1.release(ctx, staging);
  }
  auto run = [&] {
    check(t, ctx, t->gemm_ex(ctx, 0, 1, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N, dt, dt), "gemm_ex");
  };
  auto seconds_since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // Warm-up: cuBLAS's heuristics, then about a second of work to bring the clocks up.
  const auto w0 = std::chrono::steady_clock::now();
  do {
    for (int i = 0; i < 5; ++i) run();
    check(t, ctx, t->v1.synchronize(ctx), "synchronize");
  } while (seconds_since(w0) < 1.0);
  std::vector<double> per_call;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) run();
    check(t, ctx, t->v1.synchronize(ctx), "synchronize");
    per_call.push_back(seconds_since(t0) / reps);
  }
  std::sort(per_call.begin(), per_call.end());
  const double s = per_call[per_call.size() / 2];
  const double tflops = 2.0 * M * N * K / s / 1e12;
  std::printf("gemm %s %ldx%ldx%ld: %.3f ms per call, %.1f TFLOP/s (median of 5 rounds of %d)\n",
              type.c_str(), M, N, K, 1e3 * s, tflops, reps);
  t->v1.release(ctx, a);
  t->v1.release(ctx, b);
  t->v1.release(ctx, c);
  t->v1.close(ctx);
  return 0;
}
