// GEMM rate of a dt device plugin through its C ABI (hal/dt_hal_v2.h), the ceiling against which
// the GPU training benchmark's model FLOP utilisation is read. Built by perf/bench_gpu.sh with
//   g++ -O2 -std=c++17 -Ihal perf/bench_gpu_gemm.cpp -ldl
// Usage: bench_gpu_gemm PLUGIN.so [M N K [f32|bf16|f16 [reps]]]
// Prints the device line, then "gemm TYPE MxNxK: T ms per call, R TFLOP/s" (fp32 accumulation;
// C = A B^T as the model's linear layers call it; inputs are zeros, which does not change the
// tensor-core rate).
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

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
  check(t, ctx, t->v1.fill_zero(ctx, a, M * K * es), "fill_zero");
  check(t, ctx, t->v1.fill_zero(ctx, b, N * K * es), "fill_zero");
  auto run = [&] {
    check(t, ctx, t->gemm_ex(ctx, 0, 1, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N, dt, dt), "gemm_ex");
  };
  for (int i = 0; i < 3; ++i) run();  // warm-up (cuBLAS heuristics, clocks)
  check(t, ctx, t->v1.synchronize(ctx), "synchronize");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) run();
  check(t, ctx, t->v1.synchronize(ctx), "synchronize");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tflops = 2.0 * M * N * K * reps / s / 1e12;
  std::printf("gemm %s %ldx%ldx%ld: %.3f ms per call, %.1f TFLOP/s\n", type.c_str(), M, N, K,
              1e3 * s / reps, tflops);
  t->v1.release(ctx, a);
  t->v1.release(ctx, b);
  t->v1.release(ctx, c);
  t->v1.close(ctx);
  return 0;
}
