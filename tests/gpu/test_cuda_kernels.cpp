// The CUDA device (libdt_hal_cuda.so) against the CPU device.
//
//   dt_cuda_test --load      CI on any machine: the plugin loads through dt::Device (symbols
//                            resolve, ABI version 4 table); without a GPU, opening it fails with a
//                            message naming CUDA; with one, it opens and describes the GPU.
//   dt_cuda_test             differential test of every CUDA kernel against the CPU device on
//                            random inputs (same inputs, results compared within the tolerances
//                            below). Without a usable GPU it prints one "SKIP" line and exits 77,
//                            which ctest reports as skipped.
//
// The plugin is looked for in the build's plugins/ folder, then in $DT_PLUGIN_PATH (where a copy
// of the build that was moved to another machine keeps it, as perf/gpu_payload.sh packs it).
//
// Tolerances: |cuda - cpu| <= atol + rtol |cpu| per element, or bit-exact where both devices do
// the same IEEE operations in the same order (add, scale, bias_add, embedding_fwd, casts,
// scale_check_finite). Where the summation order differs (GEMMs, LayerNorm, softmax, column sums)
// the bound is a first-order one, 2 K u sum|terms| with u = 2^-24, computed per element from the
// inputs; where the CPU uses its own exp (softmax, GELU: a few ulp from libm's) rtol is 1e-5.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention16_ref.hpp"
#include "dt/device.hpp"
#include "dt/optim.hpp"

namespace {

constexpr double kU = 0x1p-24;
int g_checks = 0, g_fails = 0;

void report(const std::string& what, bool ok, const std::string& detail = "") {
  ++g_checks;
  if (!ok) {
    ++g_fails;
    std::printf("FAIL %s%s%s\n", what.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  }
}

// Compares element-wise; tol(i) gives the allowed difference for element i.
void compare(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
             const std::function<double(std::size_t)>& tol) {
  if (got.size() != ref.size()) return report(what, false, "size mismatch");
  std::size_t bad = 0, first = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(d <= tol(i)) && !(std::isnan(got[i]) && std::isnan(ref[i]))) {
      if (bad++ == 0) first = i;
    }
    if (d > worst) worst = d;
  }
  char buf[256] = "";
  if (bad)
    std::snprintf(buf, sizeof buf,
                  "%zu of %zu outside tolerance; first [%zu]: cuda %.9g, cpu %.9g, tol %.3g", bad,
                  got.size(), first, got[first], ref[first], tol(first));
  report(what, bad == 0, buf);
}
void compare_rel(const std::string& what, const std::vector<float>& got,
                 const std::vector<float>& ref, double atol, double rtol) {
  compare(what, got, ref, [&](std::size_t i) { return atol + rtol * std::fabs(ref[i]); });
}

struct Rig {
  dt::Device cpu;
  dt::Device gpu;
  std::mt19937 rng{1234};

  std::vector<float> rand(std::size_t n, float lo = -1, float hi = 1) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  }
  template <class T>
  dt::Device::Buffer up(const std::vector<T>& v) {
    dt::Device::Buffer b(gpu, std::max<std::size_t>(1, v.size() * sizeof(T)));
    gpu.call(&dt_hal_v1_t::copy, "copy", b.get(), static_cast<const void*>(v.data()),
             v.size() * sizeof(T), DT_HAL_HOST_TO_DEVICE);
    return b;
  }
  template <class T>
  std::vector<T> down(const dt::Device::Buffer& b, std::size_t n) {
    std::vector<T> v(n);
    gpu.call(&dt_hal_v1_t::synchronize, "synchronize");
    gpu.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(v.data()),
             static_cast<const void*>(b.get()), n * sizeof(T), DT_HAL_DEVICE_TO_HOST);
    return v;
  }
};

// Reports `what`: an entry returned `rc`, which must be DT_HAL_ERR_INVALID with a last error
// that holds `needle`.
void report_invalid(Rig& r, const std::string& what, int rc, const std::string& needle) {
  const std::string msg = r.gpu.table2().v1.last_error(r.gpu.ctx());
  report(what, rc == DT_HAL_ERR_INVALID && msg.find(needle) != std::string::npos,
         "rc " + std::to_string(rc) + ": " + msg);
}

// Per-element first-order bound of a row-major product op(A) op(B), from the inputs.
std::vector<double> gemm_mag(int ta, int tb, int64_t M, int64_t N, int64_t K,
                             const std::vector<float>& A, const std::vector<float>& B) {
  std::vector<double> mag(static_cast<std::size_t>(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += std::fabs(static_cast<double>(ta ? A[k * M + i] : A[i * K + k]) *
                       (tb ? B[j * K + k] : B[k * N + j]));
      mag[i * N + j] = s;
    }
  return mag;
}

void test_gemm(Rig& r) {
  const int64_t M = 37, N = 53, K = 71;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      auto A = r.rand(M * K), B = r.rand(K * N), C0 = r.rand(M * N);
      auto mag = gemm_mag(ta, tb, M, N, K, A, B);
      auto C = C0;
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      r.cpu.call(&dt_hal_v1_t::gemm, "gemm", ta, tb, M, N, K, 0.5f,
                 static_cast<const float*>(A.data()), lda, static_cast<const float*>(B.data()), ldb,
                 1.0f, C.data(), N);
      auto dA = r.up(A), dB = r.up(B), dC = r.up(C0);
      r.gpu.call(&dt_hal_v1_t::gemm, "gemm", ta, tb, M, N, K, 0.5f, dA.as<const float>(), lda,
                 dB.as<const float>(), ldb, 1.0f, dC.as<float>(), N);
      compare(
          "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb), r.down<float>(dC, M * N),
          C, [&](std::size_t i) { return 2.0 * (K + 2) * kU * (0.5 * mag[i] + std::fabs(C0[i])); });
    }
  // gemm_ex: operands rounded to 16 bits on the CPU device first, so both see the same inputs.
  const dt_hal_dtype types[] = {DT_HAL_F32, DT_HAL_BF16, DT_HAL_F16};
  const char* names[] = {"f32", "bf16", "f16"};
  const double ulp[] = {0x1p-23, 0x1p-7, 0x1p-10};
  for (int ab = 0; ab < 3; ++ab)
    for (int c = 0; c < 3; ++c) {
      auto A = r.rand(M * K), B = r.rand(K * N);
      const std::size_t es = ab == 0 ? 4 : 2, cs = c == 0 ? 4 : 2;
      std::vector<std::uint8_t> a16(A.size() * es), b16(B.size() * es), c16(M * N * cs);
      r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(a16.data()), types[ab],
                 static_cast<const void*>(A.data()), DT_HAL_F32, static_cast<int64_t>(A.size()));
      r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(b16.data()), types[ab],
                 static_cast<const void*>(B.data()), DT_HAL_F32, static_cast<int64_t>(B.size()));
      // Widened back for the bound.
      std::vector<float> Aw(A.size()), Bw(B.size());
      r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(Aw.data()), DT_HAL_F32,
                 static_cast<const void*>(a16.data()), types[ab], static_cast<int64_t>(A.size()));
      r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(Bw.data()), DT_HAL_F32,
                 static_cast<const void*>(b16.data()), types[ab], static_cast<int64_t>(B.size()));
      auto mag = gemm_mag(0, 1, M, N, K, Aw, Bw);
      r.cpu.call(&dt_hal_v2_t::gemm_ex, "gemm_ex", 0, 1, M, N, K, 1.0f,
                 static_cast<const void*>(a16.data()), K, static_cast<const void*>(b16.data()), K,
                 0.0f, static_cast<void*>(c16.data()), N, types[ab], types[c]);
      auto dA = r.up(a16), dB = r.up(b16);
      dt::Device::Buffer dC(r.gpu, c16.size());
      r.gpu.call(&dt_hal_v2_t::gemm_ex, "gemm_ex", 0, 1, M, N, K, 1.0f,
                 static_cast<const void*>(dA.get()), K, static_cast<const void*>(dB.get()), K, 0.0f,
                 dC.get(), N, types[ab], types[c]);
      auto got16 = r.down<std::uint8_t>(dC, c16.size());
      std::vector<float> got(M * N), ref(M * N);
      r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(got.data()), DT_HAL_F32,
                 static_cast<const void*>(got16.data()), types[c], M * N);
      r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(ref.data()), DT_HAL_F32,
                 static_cast<const void*>(c16.data()), types[c], M * N);
      compare(std::string("gemm_ex ") + names[ab] + " -> " + names[c], got, ref,
              [&](std::size_t i) {
                return 2.0 * (K + 2) * kU * mag[i] + ulp[c] * std::fabs(ref[i]) + 1e-30;
              });
    }
}

void test_elementwise(Rig& r) {
  const int64_t N = 67, Cc = 45, n = N * Cc;
  auto a = r.rand(n), b = r.rand(n), bias = r.rand(Cc);
  {
    auto out = a;
    r.cpu.call(&dt_hal_v1_t::bias_add, "bias_add", out.data(),
               static_cast<const float*>(bias.data()), N, Cc);
    auto d = r.up(a), db = r.up(bias);
    r.gpu.call(&dt_hal_v1_t::bias_add, "bias_add", d.as<float>(), db.as<const float>(), N, Cc);
    compare_rel("bias_add", r.down<float>(d, n), out, 0, 0);
  }
  {
    auto g0 = r.rand(Cc), g = g0;
    r.cpu.call(&dt_hal_v1_t::bias_grad, "bias_grad", g.data(), static_cast<const float*>(a.data()),
               N, Cc);
    auto d = r.up(g0), da = r.up(a);
    r.gpu.call(&dt_hal_v1_t::bias_grad, "bias_grad", d.as<float>(), da.as<const float>(), N, Cc);
    compare_rel("bias_grad", r.down<float>(d, Cc), g, 2.0 * (N + 1) * kU * N, 0);
  }
  {
    std::vector<float> out(n);
    r.cpu.call(&dt_hal_v1_t::add, "add", out.data(), static_cast<const float*>(a.data()),
               static_cast<const float*>(b.data()), n);
    auto da = r.up(a), dbb = r.up(b);
    dt::Device::Buffer dout(r.gpu, n * 4);
    r.gpu.call(&dt_hal_v1_t::add, "add", dout.as<float>(), da.as<const float>(),
               dbb.as<const float>(), n);
    compare_rel("add", r.down<float>(dout, n), out, 0, 0);
    auto x = a;
    r.cpu.call(&dt_hal_v1_t::scale, "scale", x.data(), 0.3f, n);
    r.gpu.call(&dt_hal_v1_t::scale, "scale", da.as<float>(), 0.3f, n);
    compare_rel("scale", r.down<float>(da, n), x, 0, 0);
  }
  {
    double s_cpu = 0, s_gpu = 0;
    r.cpu.call(&dt_hal_v1_t::sum_squares, "sum_squares", static_cast<const float*>(a.data()), n,
               &s_cpu);
    auto da = r.up(a);
    r.gpu.call(&dt_hal_v1_t::sum_squares, "sum_squares", da.as<const float>(), n, &s_gpu);
    report("sum_squares", std::fabs(s_cpu - s_gpu) <= 1e-12 * s_cpu,
           std::to_string(s_gpu) + " vs " + std::to_string(s_cpu));
  }
  {
    auto x = r.rand(n, -6, 6);
    std::vector<float> y(n);
    r.cpu.call(&dt_hal_v1_t::gelu_fwd, "gelu_fwd", y.data(), static_cast<const float*>(x.data()),
               n);
    auto dx = r.up(x);
    dt::Device::Buffer dy(r.gpu, n * 4);
    r.gpu.call(&dt_hal_v1_t::gelu_fwd, "gelu_fwd", dy.as<float>(), dx.as<const float>(), n);
    compare_rel("gelu_fwd", r.down<float>(dy, n), y, 1e-6, 1e-5);
    auto g0 = r.rand(n), g = g0, dout = r.rand(n);
    r.cpu.call(&dt_hal_v1_t::gelu_bwd, "gelu_bwd", g.data(), static_cast<const float*>(x.data()),
               static_cast<const float*>(dout.data()), n);
    auto dg = r.up(g0), dd = r.up(dout);
    r.gpu.call(&dt_hal_v1_t::gelu_bwd, "gelu_bwd", dg.as<float>(), dx.as<const float>(),
               dd.as<const float>(), n);
    compare_rel("gelu_bwd", r.down<float>(dg, n), g, 1e-6, 1e-5);
  }
}

// The memory-bound kernels take several elements per thread (and bias_add and softmax_xent_bwd a
// block per row): every size's tail, pointers that start 1 or 3 elements into a buffer (so not
// 16-byte aligned, input and output misaligned differently), and add in place, against the CPU
// device, bit for bit where both devices do the same IEEE operations.
void test_elementwise_offsets(Rig& r) {
  auto name = [](const char* what, int64_t n, int64_t oi, int64_t oo) {
    return std::string(what) + " n=" + std::to_string(n) + " offsets " + std::to_string(oi) + "/" +
           std::to_string(oo);
  };
  const int64_t sizes[] = {1, 3, 5, 1031, 262147};
  const int64_t offs[][2] = {{0, 0}, {1, 3}, {3, 1}};
  for (int64_t n : sizes)
    for (const auto& o : offs) {
      const int64_t oi = o[0], oo = o[1];
      auto a = r.rand(n, -6, 6), b = r.rand(n), c = r.rand(n);
      a[static_cast<std::size_t>(n / 2)] = n > 2 ? INFINITY : a[0];
      // add, out of place (out at another offset) and in place (out == a).
      std::vector<float> sum(n), gsum(n);
      r.cpu.call(&dt_hal_v1_t::add, "add", sum.data(), static_cast<const float*>(a.data()),
                 static_cast<const float*>(b.data()), n);
      std::vector<float> ap(oi, 0.0f), bp(oo, 0.0f);
      ap.insert(ap.end(), a.begin(), a.end());
      bp.insert(bp.end(), b.begin(), b.end());
      auto da = r.up(ap), db = r.up(bp);
      dt::Device::Buffer dout(r.gpu, (n + oo) * 4);
      r.gpu.call(&dt_hal_v1_t::add, "add", dout.as<float>() + oo, da.as<const float>() + oi,
                 db.as<const float>() + oo, n);
      auto got = r.down<float>(dout, n + oo);
      report(name("add", n, oi, oo), std::vector<float>(got.begin() + oo, got.end()) == sum);
      r.gpu.call(&dt_hal_v1_t::add, "add", da.as<float>() + oi, da.as<const float>() + oi,
                 db.as<const float>() + oo, n);
      got = r.down<float>(da, n + oi);
      report(name("add in place", n, oi, oo),
             std::vector<float>(got.begin() + oi, got.end()) == sum);
      // scale and scale_check_finite (a has an Inf in the middle).
      auto x = b;
      r.cpu.call(&dt_hal_v1_t::scale, "scale", x.data(), -0.7f, n);
      auto dbs = r.up(bp);
      r.gpu.call(&dt_hal_v1_t::scale, "scale", dbs.as<float>() + oo, -0.7f, n);
      got = r.down<float>(dbs, n + oo);
      compare_rel(name("scale", n, oi, oo), std::vector<float>(got.begin() + oo, got.end()), x, 0,
                  0);
      auto xc = a;
      std::int32_t fc = 0;
      r.cpu.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", xc.data(), n, 0.5f, &fc);
      auto dac = r.up(ap);
      auto flag = r.up(std::vector<std::int32_t>{0});
      r.gpu.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", dac.as<float>() + oi, n,
                 0.5f, flag.as<std::int32_t>());
      got = r.down<float>(dac, n + oi);
      report(name("scale_check_finite", n, oi, oo),
             std::vector<float>(got.begin() + oi, got.end()) == xc &&
                 r.down<std::int32_t>(flag, 1)[0] == fc);
      // gelu forward into an output at another offset, backward accumulating.
      std::vector<float> y(n);
      r.cpu.call(&dt_hal_v1_t::gelu_fwd, "gelu_fwd", y.data(), static_cast<const float*>(c.data()),
                 n);
      std::vector<float> cp(oi, 0.0f);
      cp.insert(cp.end(), c.begin(), c.end());
      auto dc = r.up(cp);
      dt::Device::Buffer dy(r.gpu, (n + oo) * 4);
      r.gpu.call(&dt_hal_v1_t::gelu_fwd, "gelu_fwd", dy.as<float>() + oo, dc.as<const float>() + oi,
                 n);
      got = r.down<float>(dy, n + oo);
      compare_rel(name("gelu_fwd", n, oi, oo), std::vector<float>(got.begin() + oo, got.end()), y,
                  1e-6, 1e-5);
      auto g = b;
      r.cpu.call(&dt_hal_v1_t::gelu_bwd, "gelu_bwd", g.data(), static_cast<const float*>(c.data()),
                 static_cast<const float*>(c.data()), n);
      auto dg = r.up(bp);
      r.gpu.call(&dt_hal_v1_t::gelu_bwd, "gelu_bwd", dg.as<float>() + oo, dc.as<const float>() + oi,
                 dc.as<const float>() + oi, n);
      got = r.down<float>(dg, n + oo);
      compare_rel(name("gelu_bwd", n, oi, oo), std::vector<float>(got.begin() + oo, got.end()), g,
                  1e-6, 1e-5);
      // Casts: fp32 to each 16-bit type and back.
      const dt_hal_dtype half[] = {DT_HAL_BF16, DT_HAL_F16};
      for (dt_hal_dtype t : half) {
        const std::string tn = t == DT_HAL_BF16 ? "bf16" : "f16";
        std::vector<std::uint16_t> h(n);
        dt::Device::Buffer dh(r.gpu, (n + oo) * 2);
        r.gpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(dh.as<std::uint16_t>() + oo), t,
                   static_cast<const void*>(da.as<float>() + oi), DT_HAL_F32, n);
        // (da holds a + b now, with an Inf where a had one.)
        r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(h.data()), t,
                   static_cast<const void*>(sum.data()), DT_HAL_F32, n);
        auto gh = r.down<std::uint16_t>(dh, n + oo);
        report(name(("cast f32 -> " + tn).c_str(), n, oi, oo),
               std::vector<std::uint16_t>(gh.begin() + oo, gh.end()) == h);
        std::vector<float> back(n);
        r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(back.data()), DT_HAL_F32,
                   static_cast<const void*>(h.data()), t, n);
        dt::Device::Buffer dback(r.gpu, (n + oi) * 4);
        r.gpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(dback.as<float>() + oi),
                   DT_HAL_F32, static_cast<const void*>(dh.as<std::uint16_t>() + oo), t, n);
        got = r.down<float>(dback, n + oi);
        report(name((std::string("cast ") + tn + " -> f32").c_str(), n, oi, oo),
               std::memcmp(got.data() + oi, back.data(), n * 4) == 0);
      }
    }
  // bias_add: a block per row, rows narrower and wider than a block's elements, misaligned.
  const int64_t shapes[][2] = {{1, 1}, {3, 769}, {4097, 3}, {5, 5000}, {130, 768}};
  for (const auto& sh : shapes) {
    const int64_t N = sh[0], Cc = sh[1];
    auto x = r.rand(N * Cc), bias = r.rand(Cc);
    auto ref = x;
    r.cpu.call(&dt_hal_v1_t::bias_add, "bias_add", ref.data(),
               static_cast<const float*>(bias.data()), N, Cc);
    std::vector<float> xp(1, 0.0f), bp(3, 0.0f);
    xp.insert(xp.end(), x.begin(), x.end());
    bp.insert(bp.end(), bias.begin(), bias.end());
    auto dx = r.up(xp), dbias = r.up(bp);
    r.gpu.call(&dt_hal_v1_t::bias_add, "bias_add", dx.as<float>() + 1, dbias.as<const float>() + 3,
               N, Cc);
    auto got = r.down<float>(dx, N * Cc + 1);
    compare_rel("bias_add " + std::to_string(N) + " x " + std::to_string(Cc) + " offsets 1/3",
                std::vector<float>(got.begin() + 1, got.end()), ref, 0, 0);
  }
}

// Column sums (bias_grad, LayerNorm's dw and db) over many rows and a width that is not a
// multiple of the kernels' column tiles: against the CPU within the first-order bound, and the
// same bits on a second run (the partial sums are added in a fixed order).
void test_column_sums(Rig& r) {
  // bias_grad on multiples of 1/256 in [-1, 1] (and 0.5 to start from): every partial sum is
  // exact in fp32 (below 2^12 with 8 fraction bits), so any order gives the CPU's bits and a row
  // dropped or counted twice shows. Eight sentinels after the Cc sums must stay as they are.
  const int64_t N = 4099, Cc = 771;
  std::vector<float> x(N * Cc);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(r.rng() % 513) - 256) / 256.0f;
  std::vector<float> g0(Cc + 8, 0.5f);
  for (int k = 0; k < 8; ++k) g0[static_cast<std::size_t>(Cc + k)] = 1234.5f + k;
  auto g = g0;
  r.cpu.call(&dt_hal_v1_t::bias_grad, "bias_grad", g.data(), static_cast<const float*>(x.data()), N,
             Cc);
  auto dx = r.up(x);
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    auto d = r.up(g0);
    r.gpu.call(&dt_hal_v1_t::bias_grad, "bias_grad", d.as<float>(), dx.as<const float>(), N, Cc);
    auto got = r.down<float>(d, Cc + 8);
    if (run == 0) {
      report("bias_grad 4099 x 771, exact sums: the CPU's bits, sentinels kept", got == g);
      first = got;
    } else {
      report("bias_grad 4099 x 771: the same bits twice", got == first);
    }
  }
  const int64_t BT = 1000;
  auto xs = r.rand(BT * Cc, -3, 3), w = r.rand(Cc), bb = r.rand(Cc);
  std::vector<float> y(BT * Cc), mean(BT), rstd(BT);
  r.cpu.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", y.data(), mean.data(), rstd.data(),
             static_cast<const float*>(xs.data()), static_cast<const float*>(w.data()),
             static_cast<const float*>(bb.data()), BT, Cc);
  auto dout = r.rand(BT * Cc), gw0 = r.rand(Cc), gb0 = r.rand(Cc);
  std::vector<float> gx(BT * Cc, 0.0f), gw = gw0, gb = gb0;
  r.cpu.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", gx.data(), gw.data(), gb.data(),
             static_cast<const float*>(dout.data()), static_cast<const float*>(xs.data()),
             static_cast<const float*>(w.data()), static_cast<const float*>(mean.data()),
             static_cast<const float*>(rstd.data()), BT, Cc);
  auto ddo = r.up(dout), dxs = r.up(xs), dw = r.up(w), dmean = r.up(mean), drstd = r.up(rstd);
  const double ctol = 4.0 * (BT + 2) * kU * BT * 3;
  std::vector<float> fw, fb;
  for (int run = 0; run < 2; ++run) {
    auto dgx = r.up(std::vector<float>(BT * Cc, 0.0f)), dgw = r.up(gw0), dgb = r.up(gb0);
    r.gpu.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", dgx.as<float>(), dgw.as<float>(),
               dgb.as<float>(), ddo.as<const float>(), dxs.as<const float>(), dw.as<const float>(),
               dmean.as<const float>(), drstd.as<const float>(), BT, Cc);
    auto gotw = r.down<float>(dgw, Cc), gotb = r.down<float>(dgb, Cc);
    if (run == 0) {
      compare_rel("layernorm_bwd dw 1000 x 771", gotw, gw, ctol, 0);
      compare_rel("layernorm_bwd db 1000 x 771", gotb, gb, ctol, 0);
      fw = gotw;
      fb = gotb;
    } else {
      report("layernorm_bwd dw and db 1000 x 771: the same bits twice", gotw == fw && gotb == fb);
    }
  }
}

// softmax_xent_fwd and _bwd on N rows of V logits in [-8, 8] against the CPU device; `label`
// is appended to the check names. The row sum's order differs between the devices: its relative
// error is bounded by 2 V u to first order, which the probabilities carry relatively and the
// losses (log of the sum) absolutely, on top of the exponentials' few ulp (1e-5).
// The last `pad` columns of every row are -inf (a padded vocabulary, model.pad-vocab): they get
// probability 0 and gradient 0, and the rest the probabilities of the unpadded row.
void check_xent(Rig& r, int64_t N, int64_t V, const std::vector<std::int32_t>& tgt,
                const std::string& label, double probs_atol, float dloss_scale, int64_t pad = 0) {
  auto logits = r.rand(N * V, -8, 8);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V - pad; j < V; ++j) logits[n * V + j] = -INFINITY;
  std::vector<float> loss(N), probs(N * V);
  r.cpu.call(&dt_hal_v1_t::softmax_xent_fwd, "softmax_xent_fwd", loss.data(), probs.data(),
             static_cast<const float*>(logits.data()), static_cast<const std::int32_t*>(tgt.data()),
             N, V);
  auto dl = r.up(logits), dtg = r.up(tgt);
  dt::Device::Buffer dloss(r.gpu, N * 4), dprobs(r.gpu, N * V * 4);
  r.gpu.call(&dt_hal_v1_t::softmax_xent_fwd, "softmax_xent_fwd", dloss.as<float>(),
             dprobs.as<float>(), dl.as<const float>(), dtg.as<const std::int32_t>(), N, V);
  const double sum_rel = 2.0 * static_cast<double>(V) * kU;
  compare_rel("softmax_xent_fwd losses" + label, r.down<float>(dloss, N), loss, 1e-5 + sum_rel,
              1e-5);
  compare_rel("softmax_xent_fwd probs" + label, r.down<float>(dprobs, N * V), probs, probs_atol,
              1e-5 + sum_rel);
  std::vector<float> dlog(N * V);
  r.cpu.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", dlog.data(),
             static_cast<const float*>(probs.data()), static_cast<const std::int32_t*>(tgt.data()),
             dloss_scale, N, V);
  auto dp = r.up(probs);
  dt::Device::Buffer dd(r.gpu, N * V * 4);
  r.gpu.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", dd.as<float>(),
             dp.as<const float>(), dtg.as<const std::int32_t>(), dloss_scale, N, V);
  compare_rel("softmax_xent_bwd" + label, r.down<float>(dd, N * V), dlog, 0, 2 * kU);
}

// attention_fwd on `qkv` against the CPU device; leaves the CPU results in out/att and the
// device's inputs and weights in dq/datt for a backward check.
void check_attention_fwd(Rig& r, int64_t B, int64_t T, int64_t Cc, int64_t NH,
                         const std::vector<float>& qkv, const std::string& label,
                         std::vector<float>& out, std::vector<float>& att, dt::Device::Buffer& dq,
                         dt::Device::Buffer& datt) {
  out.assign(B * T * Cc, 0.0f);
  att.assign(B * NH * T * T, 0.0f);
  r.cpu.call(&dt_hal_v1_t::attention_fwd, "attention_fwd", out.data(), att.data(),
             static_cast<const float*>(qkv.data()), B, T, Cc, NH);
  dq = r.up(qkv);
  dt::Device::Buffer dout(r.gpu, out.size() * 4);
  datt = dt::Device::Buffer(r.gpu, att.size() * 4);
  r.gpu.call(&dt_hal_v1_t::attention_fwd, "attention_fwd", dout.as<float>(), datt.as<float>(),
             dq.as<const float>(), B, T, Cc, NH);
  compare_rel("attention_fwd att" + label, r.down<float>(datt, att.size()), att, 1e-6, 1e-5);
  compare_rel("attention_fwd out" + label, r.down<float>(dout, out.size()), out, 1e-5, 1e-5);
}

// x rounded to `t` and back, by the CPU device's cast (checked bit-exact in tests/unit).
std::vector<float> round16(Rig& r, const std::vector<float>& x, dt_hal_dtype t) {
  std::vector<std::uint16_t> h(x.size());
  std::vector<float> out(x.size());
  r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(h.data()), t,
             static_cast<const void*>(x.data()), DT_HAL_F32, static_cast<int64_t>(x.size()));
  r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(out.data()), DT_HAL_F32,
             static_cast<const void*>(h.data()), t, static_cast<int64_t>(x.size()));
  return out;
}

// attention_*_ex (ABI version 3) in bf16 and f16. The scores take the same rounded q and k on both
// devices, so att matches the CPU's as in fp32. out and dqkv are checked against float64 sums of
// the operands the GPU must have used: qkv and dout rounded, and its own probabilities (att) and
// softmax gradient (scratch, fp32 there) rounded; what is left is fp32 accumulation, a float sum
// of n terms being within n u sum|terms|. The softmax gradient itself, rounded, matches the CPU's
// within both devices' fp32 error bound plus one rounding each. F32 is the version-1 entry, bit
// for bit.
void test_attention_ex(Rig& r) {
  const int64_t B = 2, T = 33, Cc = 48, NH = 4, C3 = 3 * Cc, TT = T * T;
  for (dt_hal_dtype type : {DT_HAL_BF16, DT_HAL_F16}) {
    const std::string tn = type == DT_HAL_BF16 ? " bf16" : " f16";
    const int prec = type == DT_HAL_BF16 ? 8 : 11;      // significand bits
    const int emin = type == DT_HAL_BF16 ? -126 : -14;  // exponent of the smallest normal
    const auto qkv = r.rand(B * T * C3);
    const auto q16 = round16(r, qkv, type);
    std::vector<float> out(B * T * Cc), att(B * NH * TT);
    r.cpu.call(&dt_hal_v3_t::attention_fwd_ex, "attention_fwd_ex", out.data(), att.data(),
               static_cast<const float*>(qkv.data()), B, T, Cc, NH, type);
    auto dq = r.up(qkv);
    dt::Device::Buffer dout(r.gpu, out.size() * 4), datt(r.gpu, att.size() * 4);
    r.gpu.call(&dt_hal_v3_t::attention_fwd_ex, "attention_fwd_ex", dout.as<float>(),
               datt.as<float>(), dq.as<const float>(), B, T, Cc, NH, type);
    const auto att_g = r.down<float>(datt, att.size());
    compare_rel("attention_fwd_ex att" + tn, att_g, att, 1e-6, 1e-5);
    const auto a16 = round16(r, att_g, type);
    const dt_test::AttnShape shape{B, T, Cc, NH};
    std::vector<double> oref, otol;
    dt_test::attn16_out_ref(shape, q16, a16, oref, otol);
    const std::vector<float> ref(oref.begin(), oref.end());
    const std::vector<double>& tol = otol;
    compare("attention_fwd_ex out" + tn, r.down<float>(dout, out.size()), ref,
            [&](std::size_t i) { return tol[i]; });

    // Backward from the GPU's own att, on both devices.
    const auto go = r.rand(B * T * Cc), g0 = r.rand(B * T * C3);
    const auto o16 = round16(r, go, type);
    auto gq = g0;
    std::vector<float> scr(att.size());
    r.cpu.call(&dt_hal_v3_t::attention_bwd_ex, "attention_bwd_ex", gq.data(), scr.data(),
               static_cast<const float*>(go.data()), static_cast<const float*>(qkv.data()),
               static_cast<const float*>(att_g.data()), B, T, Cc, NH, type);
    auto dgo = r.up(go), dgq = r.up(g0);
    dt::Device::Buffer dscr(r.gpu, att.size() * 4);
    r.gpu.call(&dt_hal_v3_t::attention_bwd_ex, "attention_bwd_ex", dgq.as<float>(),
               dscr.as<float>(), dgo.as<const float>(), dq.as<const float>(),
               datt.as<const float>(), B, T, Cc, NH, type);
    const auto s16 = round16(r, r.down<float>(dscr, scr.size()), type);
    // Each device's fp32 S' is within e32 of the exact value (its terms' rounding errors), and
    // each rounding adds half an ulp at |value| + e32.
    std::vector<double> sref, stol;
    dt_test::attn16_sgrad_ref(shape, q16, o16, att_g, sref, stol);
    for (std::size_t k = 0; k < stol.size(); ++k)
      stol[k] = 2 * stol[k] + dt_test::format_ulp(std::fabs(sref[k]) + stol[k], prec, emin);
    compare("attention_bwd_ex softmax gradient" + tn, s16, scr,
            [&](std::size_t i) { return stol[i]; });
    std::vector<double> gref_d, gtol;
    dt_test::attn16_dqkv_ref(shape, q16, o16, a16, s16, g0, gref_d, gtol);
    const std::vector<float> gref(gref_d.begin(), gref_d.end());
    for (std::size_t k = 0; k < gtol.size(); ++k) gtol[k] += kU * std::fabs(gref_d[k]);
    compare("attention_bwd_ex dqkv" + tn, r.down<float>(dgq, g0.size()), gref,
            [&](std::size_t i) { return gtol[i]; });
  }
  // F32: the version-1 entries, bit for bit.
  const auto qkv = r.rand(B * T * C3), go = r.rand(B * T * Cc);
  auto dq = r.up(qkv), dgo = r.up(go);
  dt::Device::Buffer o1(r.gpu, B * T * Cc * 4), o2(r.gpu, B * T * Cc * 4);
  dt::Device::Buffer a1(r.gpu, B * NH * TT * 4), a2(r.gpu, B * NH * TT * 4);
  r.gpu.call(&dt_hal_v1_t::attention_fwd, "attention_fwd", o1.as<float>(), a1.as<float>(),
             dq.as<const float>(), B, T, Cc, NH);
  r.gpu.call(&dt_hal_v3_t::attention_fwd_ex, "attention_fwd_ex", o2.as<float>(), a2.as<float>(),
             dq.as<const float>(), B, T, Cc, NH, DT_HAL_F32);
  compare_rel("attention_fwd_ex f32 = attention_fwd", r.down<float>(o2, B * T * Cc),
              r.down<float>(o1, B * T * Cc), 0, 0);
  const auto g0 = r.rand(B * T * C3);
  auto dg1 = r.up(g0), dg2 = r.up(g0);
  dt::Device::Buffer s1(r.gpu, B * NH * TT * 4), s2(r.gpu, B * NH * TT * 4);
  r.gpu.call(&dt_hal_v1_t::attention_bwd, "attention_bwd", dg1.as<float>(), s1.as<float>(),
             dgo.as<const float>(), dq.as<const float>(), a1.as<const float>(), B, T, Cc, NH);
  r.gpu.call(&dt_hal_v3_t::attention_bwd_ex, "attention_bwd_ex", dg2.as<float>(), s2.as<float>(),
             dgo.as<const float>(), dq.as<const float>(), a1.as<const float>(), B, T, Cc, NH,
             DT_HAL_F32);
  compare_rel("attention_bwd_ex f32 = attention_bwd", r.down<float>(dg2, g0.size()),
              r.down<float>(dg1, g0.size()), 0, 0);
}

// flash_attention_* (ABI version 4) against dt_test::flash_ref, the float64 values of the operands
// the GPU must have used (qkv and dout rounded to the products' type, D from the fp32 dout and
// the GPU's own out as passed): with DT_CUDA_FLASH=tiled (gpu.cuda_kernels.tiled_lt) heads of 64
// and 128 in bf16 and f16 take the tiled tensor-core kernels (T not a multiple of the 64-row
// tile); the others (fp32, heads of 12), and every case without it, the default on
// attention_*_ex. The GPU's out also agrees with the CPU device's within both bounds.
void test_flash_attention(Rig& r) {
  struct Case {
    int64_t B, T, Cc, NH;
  };
  for (const Case& cs : {Case{2, 130, 128, 2}, Case{1, 70, 256, 2}, Case{2, 33, 48, 4}}) {
    for (dt_hal_dtype type : {DT_HAL_BF16, DT_HAL_F16, DT_HAL_F32}) {
      const int64_t B = cs.B, T = cs.T, Cc = cs.Cc, NH = cs.NH, C3 = 3 * Cc;
      const std::string tn = std::string(type == DT_HAL_BF16  ? " bf16"
                                         : type == DT_HAL_F16 ? " f16"
                                                              : " f32") +
                             " hs " + std::to_string(Cc / NH) + " T " + std::to_string(T);
      const double uh = type == DT_HAL_BF16 ? 0x1p-8 : type == DT_HAL_F16 ? 0x1p-11 : 0.0;
      const auto qkv = r.rand(B * T * C3, -2, 2);
      const auto q16 = type == DT_HAL_F32 ? qkv : round16(r, qkv, type);
      auto dq = r.up(qkv);
      dt::Device::Buffer dout(r.gpu, B * T * Cc * 4), dlse(r.gpu, B * NH * T * 4);
      r.gpu.call(&dt_hal_v4_t::flash_attention_fwd, "flash_attention_fwd", dout.as<float>(),
                 dlse.as<float>(), dq.as<const float>(), B, T, Cc, NH, type);
      const auto out_g = r.down<float>(dout, B * T * Cc);
      const auto lse_g = r.down<float>(dlse, B * NH * T);
      std::vector<float> out_c(out_g.size()), lse_c(lse_g.size());
      r.cpu.call(&dt_hal_v4_t::flash_attention_fwd, "flash_attention_fwd", out_c.data(),
                 lse_c.data(), static_cast<const float*>(qkv.data()), B, T, Cc, NH, type);
      const auto go = r.rand(B * T * Cc), g0 = r.rand(B * T * C3);
      const auto o16 = type == DT_HAL_F32 ? go : round16(r, go, type);
      const dt_test::AttnShape shape{B, T, Cc, NH};
      const dt_test::FlashRef ref = dt_test::flash_ref(shape, q16, go, o16, out_g, g0, uh);
      auto tol_of = [](const std::vector<double>& t) {
        return [&t](std::size_t i) { return t[i]; };
      };
      const std::vector<float> oref(ref.out.begin(), ref.out.end());
      const std::vector<float> lref(ref.lse.begin(), ref.lse.end());
      compare("flash_attention_fwd out" + tn, out_g, oref, tol_of(ref.out_tol));
      compare("flash_attention_fwd lse" + tn, lse_g, lref, tol_of(ref.lse_tol));
      compare("flash_attention_fwd out, cpu" + tn, out_g, out_c,
              [&](std::size_t i) { return 2 * ref.out_tol[i]; });
      // Backward, with out as the GPU left it: fp32, and for a 16-bit type also rounded.
      for (const bool out16 : {false, true}) {
        if (out16 && type == DT_HAL_F32) continue;
        const auto ow = out16 ? round16(r, out_g, type) : out_g;
        const dt_test::FlashRef bref =
            out16 ? dt_test::flash_ref(shape, q16, go, o16, ow, g0, uh) : ref;
        dt::Device::Buffer dow(r.gpu, out_g.size() * 4);
        if (out16)
          r.gpu.call(&dt_hal_v2_t::cast, "cast", dow.get(), type,
                     static_cast<const void*>(dout.get()), DT_HAL_F32,
                     static_cast<int64_t>(out_g.size()));
        auto dgo = r.up(go), dgq = r.up(g0);
        dt::Device::Buffer dscr(r.gpu, B * NH * T * 4);
        r.gpu.call(&dt_hal_v4_t::flash_attention_bwd, "flash_attention_bwd", dgq.as<float>(),
                   dscr.as<float>(), dgo.as<const float>(), dq.as<const float>(),
                   static_cast<const void*>(out16 ? dow.get() : dout.get()),
                   out16 ? type : DT_HAL_F32, dlse.as<const float>(), B, T, Cc, NH, type);
        const std::vector<float> gref(bref.dqkv.begin(), bref.dqkv.end());
        compare("flash_attention_bwd dqkv" + tn + (out16 ? " out16" : ""),
                r.down<float>(dgq, g0.size()), gref, tol_of(bref.dqkv_tol));
      }
    }
  }
}

void test_layers(Rig& r) {
  const int64_t B = 2, T = 33, Cc = 48, NH = 4, V = 67, BT = B * T;
  // Embedding.
  std::vector<std::int32_t> tok(BT);
  for (auto& t : tok) t = static_cast<std::int32_t>(r.rng() % V);
  auto wte = r.rand(V * Cc), wpe = r.rand(T * Cc);
  std::vector<float> emb(BT * Cc);
  r.cpu.call(&dt_hal_v1_t::embedding_fwd, "embedding_fwd", emb.data(),
             static_cast<const std::int32_t*>(tok.data()), static_cast<const float*>(wte.data()),
             static_cast<const float*>(wpe.data()), B, T, Cc, V);
  auto dtok = r.up(tok), dwte = r.up(wte), dwpe = r.up(wpe);
  dt::Device::Buffer demb(r.gpu, BT * Cc * 4);
  r.gpu.call(&dt_hal_v1_t::embedding_fwd, "embedding_fwd", demb.as<float>(),
             dtok.as<const std::int32_t>(), dwte.as<const float>(), dwpe.as<const float>(), B, T,
             Cc, V);
  compare_rel("embedding_fwd", r.down<float>(demb, BT * Cc), emb, 0, 0);
  {
    auto dout = r.rand(BT * Cc), gte0 = r.rand(V * Cc), gpe0 = r.rand(T * Cc);
    auto gte = gte0, gpe = gpe0;
    r.cpu.call(&dt_hal_v1_t::embedding_bwd, "embedding_bwd", gte.data(), gpe.data(),
               static_cast<const float*>(dout.data()), static_cast<const std::int32_t*>(tok.data()),
               B, T, Cc);
    auto dd = r.up(dout), dgte = r.up(gte0), dgpe = r.up(gpe0);
    r.gpu.call(&dt_hal_v1_t::embedding_bwd, "embedding_bwd", dgte.as<float>(), dgpe.as<float>(),
               dd.as<const float>(), dtok.as<const std::int32_t>(), B, T, Cc);
    compare_rel("embedding_bwd dwte", r.down<float>(dgte, V * Cc), gte, 4.0 * BT * kU * (BT + 1),
                0);
    compare_rel("embedding_bwd dwpe", r.down<float>(dgpe, T * Cc), gpe, 4.0 * B * kU * (B + 1), 0);
  }
  // A bad token is reported by the next synchronize, naming it.
  {
    auto bad = tok;
    bad[5] = 999;
    auto dbad = r.up(bad);
    r.gpu.call(&dt_hal_v1_t::embedding_fwd, "embedding_fwd", demb.as<float>(),
               dbad.as<const std::int32_t>(), dwte.as<const float>(), dwpe.as<const float>(), B, T,
               Cc, V);
    report_invalid(r, "embedding_fwd reports a bad token at synchronize",
                   r.gpu.table2().v1.synchronize(r.gpu.ctx()),
                   "embedding_fwd: token 999 at position 5 is outside [0, 67)");
  }
  // A copy to the host waits for the device too, and reports it the same way (the copy is done);
  // once reported it is cleared.
  {
    const auto& v1 = r.gpu.table2().v1;
    auto bad = tok;
    bad[3] = -7;
    auto dbad = r.up(bad);
    r.gpu.call(&dt_hal_v1_t::embedding_fwd, "embedding_fwd", demb.as<float>(),
               dbad.as<const std::int32_t>(), dwte.as<const float>(), dwpe.as<const float>(), B, T,
               Cc, V);
    std::vector<float> host(static_cast<std::size_t>(BT * Cc), -1.0f);
    report_invalid(r, "a copy to the host reports a bad token",
                   v1.copy(r.gpu.ctx(), host.data(), demb.get(), host.size() * sizeof(float),
                           DT_HAL_DEVICE_TO_HOST),
                   "embedding_fwd: token -7 at position 3 is outside [0, 67)");
    bool zeroed = true;
    for (int64_t c = 0; c < Cc; ++c)
      zeroed = zeroed && host[static_cast<std::size_t>(3 * Cc + c)] == 0.0f;
    report("the bad token's row is zero and the copy was made", zeroed);
    report("the error is reported once", v1.synchronize(r.gpu.ctx()) == DT_HAL_OK,
           v1.last_error(r.gpu.ctx()));
  }
  // LayerNorm.
  {
    auto x = r.rand(BT * Cc, -3, 3), w = r.rand(Cc), bb = r.rand(Cc);
    std::vector<float> y(BT * Cc), mean(BT), rstd(BT);
    r.cpu.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", y.data(), mean.data(), rstd.data(),
               static_cast<const float*>(x.data()), static_cast<const float*>(w.data()),
               static_cast<const float*>(bb.data()), BT, Cc);
    auto dx = r.up(x), dw = r.up(w), db = r.up(bb);
    dt::Device::Buffer dy(r.gpu, BT * Cc * 4), dm(r.gpu, BT * 4), dr(r.gpu, BT * 4);
    r.gpu.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", dy.as<float>(), dm.as<float>(),
               dr.as<float>(), dx.as<const float>(), dw.as<const float>(), db.as<const float>(), BT,
               Cc);
    const double tol = 4.0 * (Cc + 2) * kU;
    compare_rel("layernorm_fwd out", r.down<float>(dy, BT * Cc), y, 8 * tol, 8 * tol);
    compare_rel("layernorm_fwd mean", r.down<float>(dm, BT), mean, 3 * tol, tol);
    compare_rel("layernorm_fwd rstd", r.down<float>(dr, BT), rstd, 0, 2 * tol);
    auto dout = r.rand(BT * Cc), gx0 = r.rand(BT * Cc), gw0 = r.rand(Cc), gb0 = r.rand(Cc);
    auto gx = gx0, gw = gw0, gb = gb0;
    r.cpu.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", gx.data(), gw.data(), gb.data(),
               static_cast<const float*>(dout.data()), static_cast<const float*>(x.data()),
               static_cast<const float*>(w.data()), static_cast<const float*>(mean.data()),
               static_cast<const float*>(rstd.data()), BT, Cc);
    auto ddo = r.up(dout), dgx = r.up(gx0), dgw = r.up(gw0), dgb = r.up(gb0), dmean = r.up(mean),
         drstd = r.up(rstd);
    r.gpu.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", dgx.as<float>(), dgw.as<float>(),
               dgb.as<float>(), ddo.as<const float>(), dx.as<const float>(), dw.as<const float>(),
               dmean.as<const float>(), drstd.as<const float>(), BT, Cc);
    compare_rel("layernorm_bwd dinp", r.down<float>(dgx, BT * Cc), gx, 16 * tol, 8 * tol);
    const double ctol = 4.0 * (BT + 2) * kU * BT * 3;
    compare_rel("layernorm_bwd dw", r.down<float>(dgw, Cc), gw, ctol, 0);
    compare_rel("layernorm_bwd db", r.down<float>(dgb, Cc), gb, ctol, 0);
  }
  // Attention.
  {
    auto qkv = r.rand(BT * 3 * Cc);
    std::vector<float> out, att;
    dt::Device::Buffer dq, datt;
    check_attention_fwd(r, B, T, Cc, NH, qkv, "", out, att, dq, datt);
    auto go = r.rand(BT * Cc), gq0 = r.rand(BT * 3 * Cc), gq = gq0;
    std::vector<float> scratch(att.size());
    r.cpu.call(&dt_hal_v1_t::attention_bwd, "attention_bwd", gq.data(), scratch.data(),
               static_cast<const float*>(go.data()), static_cast<const float*>(qkv.data()),
               static_cast<const float*>(att.data()), B, T, Cc, NH);
    auto dgo = r.up(go), dgq = r.up(gq0);
    dt::Device::Buffer dscr(r.gpu, att.size() * 4);
    r.gpu.call(&dt_hal_v1_t::attention_bwd, "attention_bwd", dgq.as<float>(), dscr.as<float>(),
               dgo.as<const float>(), dq.as<const float>(), datt.as<const float>(), B, T, Cc, NH);
    compare_rel("attention_bwd", r.down<float>(dgq, gq.size()), gq, 2e-5, 2e-5);
  }
  // Softmax cross-entropy.
  {
    std::vector<std::int32_t> tgt(BT);
    for (auto& t : tgt) t = static_cast<std::int32_t>(r.rng() % V);
    check_xent(r, BT, V, tgt, "", 1e-9, 1.0f / BT);
  }
  // A bad target: softmax_xent_bwd still overwrites its row (zeros, where the CPU device refuses
  // the call before writing), and sum_squares, which waits for the device, reports it.
  {
    const auto& v1 = r.gpu.table2().v1;
    std::vector<std::int32_t> tgt(BT, 1);
    tgt[4] = V;
    auto probs = r.rand(BT * V, 0, 1);
    auto dp = r.up(probs), dtg = r.up(tgt), dd = r.up(std::vector<float>(BT * V, 5.0f));
    r.gpu.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", dd.as<float>(),
               dp.as<const float>(), dtg.as<const std::int32_t>(), 1.0f, BT, V);
    double ss = 0;
    report_invalid(r, "sum_squares reports a bad target of softmax_xent_bwd",
                   v1.sum_squares(r.gpu.ctx(), dd.as<const float>(), V, &ss),
                   "softmax_xent_bwd: target 67 at position 4 is outside [0, 67)");
    const std::vector<float> got = r.down<float>(dd, BT * V);
    bool zero = true, written = true;
    for (int64_t j = 0; j < V; ++j) {
      zero = zero && got[static_cast<std::size_t>(4 * V + j)] == 0.0f;
      written = written && got[static_cast<std::size_t>(3 * V + j)] != 5.0f;
    }
    report("softmax_xent_bwd overwrites a bad target's row with zeros, and the others",
           zero && written);
  }
}

void test_optim_and_mixed(Rig& r) {
  const int64_t n = 1000;
  auto p = r.rand(n), g = r.rand(n), m = r.rand(n), v = r.rand(n, 0, 1);
  {
    auto pc = p, mc = m, vc = v;
    auto dp = r.up(p), dg = r.up(g), dm = r.up(m), dv = r.up(v);
    for (int64_t t = 1; t <= 3; ++t) {
      r.cpu.call(&dt_hal_v1_t::adamw, "adamw", pc.data(), static_cast<const float*>(g.data()),
                 mc.data(), vc.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
      r.gpu.call(&dt_hal_v1_t::adamw, "adamw", dp.as<float>(), dg.as<const float>(), dm.as<float>(),
                 dv.as<float>(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    }
    compare_rel("adamw params", r.down<float>(dp, n), pc, 1e-7, 1e-6);
    compare_rel("adamw m", r.down<float>(dm, n), mc, 1e-7, 1e-6);
    compare_rel("adamw v", r.down<float>(dv, n), vc, 1e-9, 1e-6);
  }
  {
    // Sizes that cross the 48-tensor launch groups, one empty.
    std::vector<int64_t> sizes;
    for (int k = 0; k < 50; ++k) sizes.push_back(k == 7 ? 0 : 1 + (k * 37) % 300);
    sizes[11] = 300001;  // more elements than one launch's capped grid covers
    std::vector<std::vector<float>> P, G, M, Vv;
    std::vector<dt::Device::Buffer> dP, dG, dM, dV;
    std::vector<float*> cp, cm, cv, gp, gm, gv;
    std::vector<const float*> cg, gg;
    std::vector<float> wd;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      P.push_back(r.rand(sizes[k]));
      G.push_back(r.rand(sizes[k]));
      M.push_back(r.rand(sizes[k]));
      Vv.push_back(r.rand(sizes[k], 0, 1));
      wd.push_back(k % 2 ? 0.1f : 0.0f);
    }
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      dP.push_back(r.up(P[k]));
      dG.push_back(r.up(G[k]));
      dM.push_back(r.up(M[k]));
      dV.push_back(r.up(Vv[k]));
      cp.push_back(P[k].data());
      cg.push_back(G[k].data());
      cm.push_back(M[k].data());
      cv.push_back(Vv[k].data());
      gp.push_back(dP[k].as<float>());
      gg.push_back(dG[k].as<const float>());
      gm.push_back(dM[k].as<float>());
      gv.push_back(dV[k].as<float>());
    }
    const int count = static_cast<int>(sizes.size());
    // Two steps: the second reads the moments the first stored.
    for (int64_t t = 5; t <= 6; ++t) {
      r.cpu.call(&dt_hal_v2_t::adamw_multi, "adamw_multi", count,
                 static_cast<float* const*>(cp.data()), static_cast<const float* const*>(cg.data()),
                 static_cast<float* const*>(cm.data()), static_cast<float* const*>(cv.data()),
                 static_cast<const int64_t*>(sizes.data()), static_cast<const float*>(wd.data()),
                 1e-2f, 0.9f, 0.95f, 1e-8f, t);
      r.gpu.call(&dt_hal_v2_t::adamw_multi, "adamw_multi", count,
                 static_cast<float* const*>(gp.data()), static_cast<const float* const*>(gg.data()),
                 static_cast<float* const*>(gm.data()), static_cast<float* const*>(gv.data()),
                 static_cast<const int64_t*>(sizes.data()), static_cast<const float*>(wd.data()),
                 1e-2f, 0.9f, 0.95f, 1e-8f, t);
    }
    struct Part {
      const char* name;
      std::vector<std::vector<float>>* cpu;
      std::vector<dt::Device::Buffer>* gpu;
      double atol;
    };
    for (const Part& part :
         {Part{"params", &P, &dP, 1e-7}, Part{"m", &M, &dM, 1e-7}, Part{"v", &Vv, &dV, 1e-9}}) {
      std::vector<float> all_c, all_g;
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        auto got = r.down<float>((*part.gpu)[k], sizes[k]);
        all_g.insert(all_g.end(), got.begin(), got.end());
        all_c.insert(all_c.end(), (*part.cpu)[k].begin(), (*part.cpu)[k].end());
      }
      compare_rel(std::string("adamw_multi ") + part.name + " (50 tensors, 2 steps)", all_g, all_c,
                  part.atol, 1e-6);
    }
  }
  // Casts: bit-exact, every 16-bit pattern and random floats.
  {
    std::vector<std::uint16_t> h(65536);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::uint16_t>(i);
    std::vector<std::uint32_t> fb(200000);
    for (auto& u : fb) u = static_cast<std::uint32_t>(r.rng());
    const dt_hal_dtype types[] = {DT_HAL_F32, DT_HAL_BF16, DT_HAL_F16};
    for (auto from : types)
      for (auto to : types) {
        if (from == to) continue;
        const bool f32in = from == DT_HAL_F32;
        const std::size_t n2 = f32in ? fb.size() : h.size();
        const void* src = f32in ? static_cast<const void*>(fb.data()) : h.data();
        const std::size_t ob = to == DT_HAL_F32 ? 4 : 2;
        std::vector<std::uint8_t> ref(n2 * ob);
        r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(ref.data()), to, src, from,
                   static_cast<int64_t>(n2));
        dt::Device::Buffer din(r.gpu, n2 * (f32in ? 4 : 2)), dout(r.gpu, n2 * ob);
        r.gpu.call(&dt_hal_v1_t::copy, "copy", din.get(), src, n2 * (f32in ? 4 : 2),
                   DT_HAL_HOST_TO_DEVICE);
        r.gpu.call(&dt_hal_v2_t::cast, "cast", dout.get(), to, static_cast<const void*>(din.get()),
                   from, static_cast<int64_t>(n2));
        auto got = r.down<std::uint8_t>(dout, n2 * ob);
        report("cast " + std::to_string(from) + " -> " + std::to_string(to) + " bit-exact",
               got == ref);
      }
  }
  // scale_check_finite: bit-exact, and the flag.
  {
    auto x = r.rand(n, -100, 100);
    x[n - 1] = INFINITY;
    auto xc = x;
    std::int32_t fc = 0;
    r.cpu.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", xc.data(), n, 0.125f, &fc);
    auto dx = r.up(x);
    dt::Device::Buffer flag(r.gpu, 4);
    r.gpu.call(&dt_hal_v1_t::fill_zero, "fill_zero", flag.get(), std::size_t{4});
    r.gpu.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", dx.as<float>(), n, 0.125f,
               flag.as<std::int32_t>());
    report("scale_check_finite values", r.down<float>(dx, n) == xc);
    report("scale_check_finite flag", r.down<std::int32_t>(flag, 1)[0] == 1 && fc == 1);
    auto y = r.rand(n);
    auto dy = r.up(y);
    r.gpu.call(&dt_hal_v1_t::fill_zero, "fill_zero", flag.get(), std::size_t{4});
    r.gpu.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", dy.as<float>(), n, 2.0f,
               flag.as<std::int32_t>());
    report("scale_check_finite: no flag on finite values", r.down<std::int32_t>(flag, 1)[0] == 0);
    // Each way a value can stop being finite, alone in an otherwise finite vector: NaN, -Inf,
    // and a finite value that overflows only once scaled.
    const float bad[] = {NAN, -INFINITY, 3e38f};
    const char* bad_names[] = {"NaN", "-Inf", "3e38 x 4 (overflow after scaling)"};
    for (int k = 0; k < 3; ++k) {
      auto z = r.rand(n);
      z[n / 2] = bad[k];
      auto zc = z;
      std::int32_t zf = 0;
      r.cpu.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", zc.data(), n, 4.0f, &zf);
      auto dz = r.up(z);
      r.gpu.call(&dt_hal_v1_t::fill_zero, "fill_zero", flag.get(), std::size_t{4});
      r.gpu.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", dz.as<float>(), n, 4.0f,
                 flag.as<std::int32_t>());
      const auto got = r.down<float>(dz, n);
      bool same = true;
      for (int64_t i = 0; i < n; ++i)
        same = same &&
               (std::memcmp(&got[i], &zc[i], 4) == 0 || (std::isnan(got[i]) && std::isnan(zc[i])));
      report(std::string("scale_check_finite values, ") + bad_names[k], same);
      report(std::string("scale_check_finite flag, ") + bad_names[k],
             r.down<std::int32_t>(flag, 1)[0] == 1 && zf == 1);
    }
  }
}

// Streams, events and a captured graph replayed twice give what eager launches give.
void test_streams_graphs(Rig& r) {
  const auto& t = r.gpu.table2();
  void* s = nullptr;
  void* ev = nullptr;
  r.gpu.call(&dt_hal_v2_t::stream_create, "stream_create", &s);
  r.gpu.call(&dt_hal_v2_t::event_create, "event_create", &ev);
  const int64_t n = 4096;
  auto a = r.rand(n), b = r.rand(n);
  auto da = r.up(a), db = r.up(b);
  r.gpu.call(&dt_hal_v1_t::synchronize, "synchronize");
  r.gpu.call(&dt_hal_v2_t::set_stream, "set_stream", s);
  r.gpu.call(&dt_hal_v2_t::graph_begin, "graph_begin");
  r.gpu.call(&dt_hal_v1_t::scale, "scale", da.as<float>(), 0.5f, n);
  r.gpu.call(&dt_hal_v1_t::add, "add", da.as<float>(), da.as<const float>(), db.as<const float>(),
             n);
  void* graph = nullptr;
  r.gpu.call(&dt_hal_v2_t::graph_end, "graph_end", &graph);
  r.gpu.call(&dt_hal_v2_t::graph_launch, "graph_launch", graph);
  r.gpu.call(&dt_hal_v2_t::graph_launch, "graph_launch", graph);
  r.gpu.call(&dt_hal_v2_t::event_record, "event_record", ev);
  r.gpu.call(&dt_hal_v2_t::set_stream, "set_stream", static_cast<void*>(nullptr));
  r.gpu.call(&dt_hal_v2_t::stream_wait_event, "stream_wait_event", ev);
  r.gpu.call(&dt_hal_v2_t::event_synchronize, "event_synchronize", ev);
  auto got = r.down<float>(da, n);
  std::vector<float> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = (a[i] * 0.5f + b[i]) * 0.5f + b[i];
  report("graph captured once, replayed twice", got == want);
  t.graph_destroy(r.gpu.ctx(), graph);
  t.event_destroy(r.gpu.ctx(), ev);
  t.stream_destroy(r.gpu.ctx(), s);
}

// gemm_ex in the forms dt calls it: every transpose pairing, beta = 1 onto a random C, leading
// dimensions wider than the rows (+3, +1), with an fp32 C and a bf16 C (through the fp32 scratch,
// widened first because beta != 0). Among these, rows of 16-byte multiples and rows that are not
// (the CUDA device copies such A and B into aligned rows first), for A, B and C.
void test_gemm_ex_forms(Rig& r) {
  struct Form {
    int64_t M, N, K, pad;
  };
  for (const Form f : {Form{37, 53, 71, 3}, Form{37, 53, 71, 1}})
    for (dt_hal_dtype ct : {DT_HAL_F32, DT_HAL_BF16})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          const int64_t M = f.M, N = f.N, K = f.K, pad = f.pad;
          const int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
          const int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
          auto A = r.rand(ar * lda), B = r.rand(br * ldb), C0 = r.rand(M * ldc);
          const std::size_t cs = ct == DT_HAL_F32 ? 4 : 2;
          std::vector<std::uint16_t> a16(A.size()), b16(B.size());
          std::vector<std::uint8_t> c0(C0.size() * cs);
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(a16.data()), DT_HAL_BF16,
                     static_cast<const void*>(A.data()), DT_HAL_F32,
                     static_cast<int64_t>(A.size()));
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(b16.data()), DT_HAL_BF16,
                     static_cast<const void*>(B.data()), DT_HAL_F32,
                     static_cast<int64_t>(B.size()));
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(c0.data()), ct,
                     static_cast<const void*>(C0.data()), DT_HAL_F32,
                     static_cast<int64_t>(C0.size()));
          std::vector<float> Aw(A.size()), Bw(B.size()), Cw(C0.size());
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(Aw.data()), DT_HAL_F32,
                     static_cast<const void*>(a16.data()), DT_HAL_BF16,
                     static_cast<int64_t>(A.size()));
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(Bw.data()), DT_HAL_F32,
                     static_cast<const void*>(b16.data()), DT_HAL_BF16,
                     static_cast<int64_t>(B.size()));
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(Cw.data()), DT_HAL_F32,
                     static_cast<const void*>(c0.data()), ct, static_cast<int64_t>(C0.size()));
          auto cref = c0;
          r.cpu.call(&dt_hal_v2_t::gemm_ex, "gemm_ex", ta, tb, M, N, K, 0.5f,
                     static_cast<const void*>(a16.data()), lda,
                     static_cast<const void*>(b16.data()), ldb, 1.0f,
                     static_cast<void*>(cref.data()), ldc, DT_HAL_BF16, ct);
          auto dA = r.up(a16), dB = r.up(b16), dC = r.up(c0);
          r.gpu.call(&dt_hal_v2_t::gemm_ex, "gemm_ex", ta, tb, M, N, K, 0.5f,
                     static_cast<const void*>(dA.get()), lda, static_cast<const void*>(dB.get()),
                     ldb, 1.0f, dC.get(), ldc, DT_HAL_BF16, ct);
          auto got16 = r.down<std::uint8_t>(dC, c0.size());
          std::vector<float> got(C0.size()), ref(C0.size());
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(got.data()), DT_HAL_F32,
                     static_cast<const void*>(got16.data()), ct, static_cast<int64_t>(C0.size()));
          r.cpu.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(ref.data()), DT_HAL_F32,
                     static_cast<const void*>(cref.data()), ct, static_cast<int64_t>(C0.size()));
          // The bound per element from the widened operands; the padding columns must stay as
          // they were (bit for bit).
          const double ulp = ct == DT_HAL_F32 ? 0x1p-23 : 0x1p-7;
          compare(std::string("gemm_ex bf16 -> ") + (ct == DT_HAL_F32 ? "f32" : "bf16") +
                      " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " beta=1, " +
                      std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) +
                      ", ld +" + std::to_string(pad),
                  got, ref, [&](std::size_t i) {
                    const int64_t row = static_cast<int64_t>(i) / ldc,
                                  col = static_cast<int64_t>(i) % ldc;
                    if (col >= N) return 0.0;
                    double mag = std::fabs(Cw[i]);
                    for (int64_t k = 0; k < K; ++k)
                      mag += 0.5 * std::fabs(static_cast<double>(ta ? Aw[k * lda + row]
                                                                    : Aw[row * lda + k]) *
                                             (tb ? Bw[col * ldb + k] : Bw[k * ldb + col]));
                    return 2.0 * (K + 2) * kU * mag + ulp * std::fabs(ref[i]) + 1e-30;
                  });
        }
}

// Sizes past one block's threads and one grid: a GPT-2 vocabulary in the softmax rows, a long
// single-head sequence in attention.
void test_large_shapes(Rig& r) {
  check_xent(r, 3, 50257, {0, 25000, 50256}, ", V = 50257", 1e-12, 0.5f);
  // Fewer real columns than a block has threads: some threads see only -inf.
  check_xent(r, 3, 300, {0, 17, 99}, ", V = 300, the last 200 -inf", 1e-12, 0.5f, 200);
  check_xent(r, 2, 50304, {0, 50256}, ", V = 50304, the last 47 -inf", 1e-12, 0.5f, 47);
  std::vector<float> out, att;
  dt::Device::Buffer dq, datt;
  check_attention_fwd(r, 1, 300, 16, 1, r.rand(300 * 3 * 16), ", T = 300", out, att, dq, datt);
}

// More rows than one launch's grid has blocks (1,048,560): the rows past it are reached by the
// kernels' grid-stride loop over rows. bias_add bit-exact; softmax_xent_bwd as check_xent's.
void test_many_rows(Rig& r) {
  const int64_t N = 1100000, Cc = 2;
  auto x = r.rand(N * Cc), b = r.rand(Cc);
  auto xc = x;
  r.cpu.call(&dt_hal_v1_t::bias_add, "bias_add", xc.data(), static_cast<const float*>(b.data()), N,
             Cc);
  auto dx = r.up(x), db = r.up(b);
  r.gpu.call(&dt_hal_v1_t::bias_add, "bias_add", dx.as<float>(), db.as<const float>(), N, Cc);
  report("bias_add 1,100,000 x 2 rows (past one grid): bit-exact", r.down<float>(dx, N * Cc) == xc);
  std::vector<std::int32_t> tgt(static_cast<std::size_t>(N));
  for (int64_t n = 0; n < N; ++n) tgt[n] = static_cast<std::int32_t>(n % Cc);
  auto probs = r.rand(N * Cc, 0, 1);
  std::vector<float> ref(N * Cc);
  r.cpu.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", ref.data(),
             static_cast<const float*>(probs.data()), static_cast<const std::int32_t*>(tgt.data()),
             0.25f, N, Cc);
  auto dp = r.up(probs), dtg = r.up(tgt);
  dt::Device::Buffer dd(r.gpu, N * Cc * 4);
  r.gpu.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", dd.as<float>(),
             dp.as<const float>(), dtg.as<const std::int32_t>(), 0.25f, N, Cc);
  compare_rel("softmax_xent_bwd 1,100,000 rows (past one grid)", r.down<float>(dd, N * Cc), ref, 0,
              2 * kU);
}

// dt::AdamW (one fused adamw_multi over merged ranges, what the trainer calls) on the GPU against
// the same on the CPU device: a table with neighbours of equal decay, a change of decay, an empty
// parameter, a gap no parameter covers (left as it is) and one large tensor. rtol 1e-6: nvcc may
// contract the update's multiply-adds.
void test_adamw_class(Rig& r) {
  const std::vector<dt::ParamInfo> params = {
      {"a", {40}, 0, 40, true},    {"b", {33}, 40, 33, true},  {"c", {7}, 73, 7, false},
      {"d", {0}, 80, 0, true},     {"e", {19}, 80, 19, false}, {"f", {300001}, 104, 300001, true},
      {"g", {3}, 300105, 3, false}};
  const std::size_t n = 300108;
  dt::OptimConfig c;
  c.weight_decay = 0.3;
  c.beta1 = 0.85;
  c.beta2 = 0.97;
  c.eps = 1e-6;
  dt::AdamW oc(r.cpu, params, n), og(r.gpu, params, n);
  auto p = r.rand(n);
  auto pc = p;
  auto dp = r.up(p);
  for (int t = 1; t <= 3; ++t) {
    auto g = r.rand(n);
    auto dg = r.up(g);
    oc.step(pc.data(), g.data(), 0.02 / t, c);
    og.step(dp.as<float>(), dg.as<const float>(), 0.02 / t, c);
    r.gpu.call(&dt_hal_v1_t::synchronize, "synchronize");
  }
  const auto got = r.down<float>(dp, n);
  compare_rel("dt::AdamW::step (fused) params, 3 steps", got, pc, 1e-7, 1e-6);
  std::vector<float> gm(n), gv(n);
  r.gpu.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(gm.data()),
             static_cast<const void*>(og.m()), n * 4, DT_HAL_DEVICE_TO_HOST);
  r.gpu.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(gv.data()),
             static_cast<const void*>(og.v()), n * 4, DT_HAL_DEVICE_TO_HOST);
  compare_rel("dt::AdamW::step (fused) m", gm, std::vector<float>(oc.m(), oc.m() + n), 1e-7, 1e-6);
  compare_rel("dt::AdamW::step (fused) v", gv, std::vector<float>(oc.v(), oc.v() + n), 1e-9, 1e-6);
  bool gap = true;
  for (std::size_t i = 99; i < 104; ++i) gap = gap && got[i] == p[i];
  report("dt::AdamW::step leaves the elements no parameter covers", gap);
}

// Capture on a stream of the caller's: cuBLAS (fp32 and bf16 tensor-core products) and the layer
// kernels replayed twice equal eager launches, three captures in a row (a recapture must not
// need memory of its own), and what a graph may not hold is refused as the CPU device refuses it.
void test_capture_kernels(Rig& r) {
  const auto& t = r.gpu.table2();
  const int64_t N = 64, C = 96, T = 16, NH = 4, B = N / T, V = 80;
  auto x = r.rand(N * C), W = r.rand(3 * C * C), lw = r.rand(C), lb = r.rand(C), H = r.rand(V * C);
  std::vector<std::int32_t> tgt(N);
  for (auto& v : tgt) v = static_cast<std::int32_t>(r.rng() % V);
  auto dx = r.up(x), dW = r.up(W), dlw = r.up(lw), dlb = r.up(lb), dH = r.up(H), dtg = r.up(tgt);
  dt::Device::Buffer ln(r.gpu, N * C * 4), mean(r.gpu, N * 4), rstd(r.gpu, N * 4),
      qkv(r.gpu, N * 3 * C * 4), att(r.gpu, B * NH * T * T * 4), y(r.gpu, N * C * 4),
      logits(r.gpu, N * V * 4), probs(r.gpu, N * V * 4), losses(r.gpu, N * 4),
      w16(r.gpu, 3 * C * C * 2), x16(r.gpu, N * C * 2), qkv2(r.gpu, N * 3 * C * 4);
  // Flash attention on heads of 64 (the tiled kernels with DT_CUDA_FLASH=tiled) and, on the
  // block's own qkv, of 24 (the default path, whose probabilities live in the context's buffer),
  // forward and backward.
  const int64_t FC = 128, FH = 2;
  auto fq = r.up(r.rand(N * 3 * FC)), fdo = r.up(r.rand(N * FC));
  dt::Device::Buffer fo(r.gpu, N * FC * 4), flse(r.gpu, B * FH * T * 4), fdq(r.gpu, N * 3 * FC * 4),
      fscr(r.gpu, B * FH * T * 4), y2(r.gpu, N * C * 4), lse2(r.gpu, B * NH * T * 4),
      dq2(r.gpu, N * 3 * C * 4), scr2(r.gpu, B * NH * T * 4);
  // The work of a small block: LayerNorm, the qkv product in fp32 and in bf16, attention, the
  // head and the loss.
  auto work = [&] {
    r.gpu.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", ln.as<float>(), mean.as<float>(),
               rstd.as<float>(), dx.as<const float>(), dlw.as<const float>(), dlb.as<const float>(),
               N, C);
    r.gpu.call(&dt_hal_v1_t::gemm, "gemm", 0, 1, N, 3 * C, C, 1.0f, ln.as<const float>(), C,
               dW.as<const float>(), C, 0.0f, qkv.as<float>(), 3 * C);
    r.gpu.call(&dt_hal_v2_t::cast, "cast", w16.get(), DT_HAL_BF16,
               static_cast<const void*>(dW.get()), DT_HAL_F32, 3 * C * C);
    r.gpu.call(&dt_hal_v2_t::cast, "cast", x16.get(), DT_HAL_BF16,
               static_cast<const void*>(ln.get()), DT_HAL_F32, N * C);
    r.gpu.call(&dt_hal_v2_t::gemm_ex, "gemm_ex", 0, 1, N, 3 * C, C, 1.0f,
               static_cast<const void*>(x16.get()), C, static_cast<const void*>(w16.get()), C, 0.0f,
               qkv2.get(), 3 * C, DT_HAL_BF16, DT_HAL_F32);
    r.gpu.call(&dt_hal_v1_t::attention_fwd, "attention_fwd", y.as<float>(), att.as<float>(),
               qkv.as<const float>(), B, T, C, NH);
    r.gpu.call(&dt_hal_v1_t::gemm, "gemm", 0, 1, N, V, C, 1.0f, y.as<const float>(), C,
               dH.as<const float>(), C, 0.0f, logits.as<float>(), V);
    r.gpu.call(&dt_hal_v1_t::softmax_xent_fwd, "softmax_xent_fwd", losses.as<float>(),
               probs.as<float>(), logits.as<const float>(), dtg.as<const std::int32_t>(), N, V);
    r.gpu.call(&dt_hal_v4_t::flash_attention_fwd, "flash_attention_fwd", fo.as<float>(),
               flse.as<float>(), fq.as<const float>(), B, T, FC, FH, DT_HAL_BF16);
    r.gpu.call(&dt_hal_v1_t::fill_zero, "fill_zero", fdq.get(), fdq.bytes());
    r.gpu.call(&dt_hal_v4_t::flash_attention_bwd, "flash_attention_bwd", fdq.as<float>(),
               fscr.as<float>(), fdo.as<const float>(), fq.as<const float>(),
               static_cast<const void*>(fo.get()), DT_HAL_F32, flse.as<const float>(), B, T, FC, FH,
               DT_HAL_BF16);
    r.gpu.call(&dt_hal_v4_t::flash_attention_fwd, "flash_attention_fwd", y2.as<float>(),
               lse2.as<float>(), qkv.as<const float>(), B, T, C, NH, DT_HAL_BF16);
    r.gpu.call(&dt_hal_v1_t::fill_zero, "fill_zero", dq2.get(), dq2.bytes());
    r.gpu.call(&dt_hal_v4_t::flash_attention_bwd, "flash_attention_bwd", dq2.as<float>(),
               scr2.as<float>(), y.as<const float>(), qkv.as<const float>(),
               static_cast<const void*>(y2.get()), DT_HAL_F32, lse2.as<const float>(), B, T, C, NH,
               DT_HAL_BF16);
  };
  auto results = [&] {
    std::vector<float> all;
    for (const dt::Device::Buffer* b : {&qkv2, &y, &losses, &fo, &flse, &fdq, &y2, &lse2, &dq2}) {
      auto v = r.down<float>(*b, b->bytes() / 4);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  work();
  const auto eager = results();
  void* s = nullptr;
  r.gpu.call(&dt_hal_v2_t::stream_create, "stream_create", &s);
  r.gpu.call(&dt_hal_v2_t::set_stream, "set_stream", s);
  bool same = true;
  for (int capture = 0; capture < 3; ++capture) {
    for (dt::Device::Buffer* b :
         {&y, &qkv2, &logits, &probs, &losses, &fo, &flse, &fdq, &y2, &lse2, &dq2})
      r.gpu.call(&dt_hal_v1_t::fill_zero, "fill_zero", b->get(), b->bytes());
    r.gpu.call(&dt_hal_v2_t::graph_begin, "graph_begin");
    work();
    void* graph = nullptr;
    r.gpu.call(&dt_hal_v2_t::graph_end, "graph_end", &graph);
    for (int replay = 0; replay < 2; ++replay) {
      r.gpu.call(&dt_hal_v2_t::graph_launch, "graph_launch", graph);
      same = same && results() == eager;
    }
    t.graph_destroy(r.gpu.ctx(), graph);
  }
  report(
      "layer kernels, flash attention and cuBLAS captured on a caller's stream (3 captures x 2 "
      "replays) equal eager launches",
      same);
  // Refused inside a capture, with DT_HAL_ERR_UNSUPPORTED, each in a capture of its own, which
  // graph_end then refuses too, naming the call (as the CPU device does).
  void* ev = nullptr;
  r.gpu.call(&dt_hal_v2_t::event_create, "event_create", &ev);
  struct Refusal {
    const char* what;
    std::function<int()> call;
  };
  std::vector<float> host(16);
  double ss = 0;
  void* mem = nullptr;
  const Refusal refusals[] = {
      {"copy to the host",
       [&] { return t.v1.copy(r.gpu.ctx(), host.data(), y.get(), 64, DT_HAL_DEVICE_TO_HOST); }},
      {"copy from the host",
       [&] { return t.v1.copy(r.gpu.ctx(), y.get(), host.data(), 64, DT_HAL_HOST_TO_DEVICE); }},
      {"event_synchronize", [&] { return t.event_synchronize(r.gpu.ctx(), ev); }},
      {"sum_squares", [&] { return t.v1.sum_squares(r.gpu.ctx(), y.as<const float>(), 16, &ss); }},
      {"alloc", [&] { return t.v1.alloc(r.gpu.ctx(), 1024, &mem); }},
      {"synchronize", [&] { return t.v1.synchronize(r.gpu.ctx()); }},
  };
  for (const Refusal& f : refusals) {
    r.gpu.call(&dt_hal_v2_t::graph_begin, "graph_begin");
    const int rc = f.call();
    const std::string msg = t.v1.last_error(r.gpu.ctx());
    void* graph = nullptr;
    const int end = t.graph_end(r.gpu.ctx(), &graph);
    const std::string end_msg = t.v1.last_error(r.gpu.ctx());
    if (graph) t.graph_destroy(r.gpu.ctx(), graph);
    report(std::string("refused inside a capture: ") + f.what,
           rc == DT_HAL_ERR_UNSUPPORTED && msg.find("captured") != std::string::npos,
           "rc " + std::to_string(rc) + ": " + msg);
    report(std::string("graph_end refuses a capture that refused ") + f.what,
           end == DT_HAL_ERR_UNSUPPORTED && graph == nullptr &&
               end_msg.find("graph_end: the capture was invalidated: " + msg) != std::string::npos,
           "rc " + std::to_string(end) + ": " + end_msg);
  }
  t.event_destroy(r.gpu.ctx(), ev);
  if (mem) t.v1.release(r.gpu.ctx(), mem);
  // Memory released inside a capture (where cudaFree is not allowed) is refused there, and freed
  // when the capture ends: the GPU's free memory (cudaMemGetInfo, the device's whole) has it back.
  {
    const std::size_t big = std::size_t{512} << 20;
    void* block = nullptr;
    const int got = t.v1.alloc(r.gpu.ctx(), big, &block);
    std::size_t free_before = 0, free_after = 0, total = 0;
    cudaMemGetInfo(&free_before, &total);
    r.gpu.call(&dt_hal_v2_t::graph_begin, "graph_begin");
    t.v1.release(r.gpu.ctx(), block);
    const std::string msg = t.v1.last_error(r.gpu.ctx());
    void* graph = nullptr;
    const int end = t.graph_end(r.gpu.ctx(), &graph);
    if (graph) t.graph_destroy(r.gpu.ctx(), graph);
    cudaMemGetInfo(&free_after, &total);
    report("release inside a capture is refused, and frees the memory when the capture ends",
           got == DT_HAL_OK && msg.find("captured") != std::string::npos &&
               end == DT_HAL_ERR_UNSUPPORTED && free_after >= free_before + big / 2,
           "alloc rc " + std::to_string(got) + ", graph_end rc " + std::to_string(end) + ", free " +
               std::to_string(free_before >> 20) + " -> " + std::to_string(free_after >> 20) +
               " MiB: " + msg);
  }
  r.gpu.call(&dt_hal_v2_t::set_stream, "set_stream", static_cast<void*>(nullptr));
  t.stream_destroy(r.gpu.ctx(), s);
  // The stream is gone and the default one is current: the work still runs and gives the same.
  work();
  report("work after the stream's destruction equals eager", results() == eager);
}

}  // namespace

int main(int argc, char** argv) {
  const bool load_only = argc > 1 && std::string(argv[1]) == "--load";
  const char* env = std::getenv("DT_PLUGIN_PATH");
  const std::string path = std::string(DT_PLUGIN_DIR) + (env && *env ? ":" + std::string(env) : "");
  if (load_only) {
    try {
      dt::Device d = dt::Device::open("cuda", path);
      if (d.abi_version() != 4) {
        std::printf("FAIL: libdt_hal_cuda.so has ABI version %d\n", d.abi_version());
        return 1;
      }
      std::printf("cuda plugin: loaded and opened: %s\n", d.describe().c_str());
      return 0;
    } catch (const dt::DeviceError& e) {
      // Loaded (dlopen, symbol and table all fine), then open() failed: there must be a reason.
      const std::string m = e.message();
      const bool clear = m.find("device 'cuda'") != std::string::npos &&
                         m.find("open(0) failed") != std::string::npos &&
                         m.find("CUDA") != std::string::npos;
      std::printf("cuda plugin: loaded; opening device 0 failed as it must without a GPU: %s\n",
                  m.c_str());
      return clear ? 0 : 1;
    } catch (const std::exception& e) {
      std::printf("FAIL: the cuda plugin did not load: %s\n", e.what());
      return 1;
    }
  }
  dt::Device cpu = dt::Device::open("cpu", "");
  std::unique_ptr<Rig> rig;
  try {
    rig.reset(new Rig{std::move(cpu), dt::Device::open("cuda", path)});
  } catch (const dt::DeviceError& e) {
    std::printf("SKIP cuda kernel tests: no usable CUDA GPU (%s)\n", e.message().c_str());
    return 77;
  }
  std::printf("cuda kernels on %s\n", rig->gpu.describe().c_str());
  try {
    test_gemm(*rig);
    test_elementwise(*rig);
    test_elementwise_offsets(*rig);
    test_column_sums(*rig);
    test_layers(*rig);
    test_attention_ex(*rig);
    test_flash_attention(*rig);
    test_optim_and_mixed(*rig);
    test_streams_graphs(*rig);
    test_gemm_ex_forms(*rig);
    test_large_shapes(*rig);
    test_capture_kernels(*rig);
    test_many_rows(*rig);
    test_adamw_class(*rig);
  } catch (const std::exception& e) {
    report("exception", false, e.what());
  }
  if (g_fails == 0)
    std::printf("cuda kernels: all %d checks passed\n", g_checks);
  else
    std::printf("cuda kernels: %d of %d checks FAILED\n", g_fails, g_checks);
  return g_fails == 0 ? 0 : 1;
}
