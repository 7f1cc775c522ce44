// The CUDA device (libdt_hal_cuda.so) against the CPU device.
//
//   dt_cuda_test --load      CI on any machine: the plugin loads through dt::Device (symbols
//                            resolve, ABI version 2 table); without a GPU, opening it fails with a
//                            message naming CUDA; with one, it opens and describes the GPU.
//   dt_cuda_test             differential test of every CUDA kernel against the CPU device on
//                            random inputs (same inputs, results compared within the tolerances
//                            below). Without a usable GPU it prints one "SKIP" line and exits 77,
//                            which ctest reports as skipped.
//
// Tolerances: |cuda - cpu| <= atol + rtol |cpu| per element, or bit-exact where both devices do
// the same IEEE operations in the same order (add, scale, bias_add, embedding_fwd, casts,
// scale_check_finite). Where the summation order differs (GEMMs, LayerNorm, softmax, column sums)
// the bound is a first-order one, 2 K u sum|terms| with u = 2^-24, computed per element from the
// inputs; where the CPU uses its own exp (softmax, GELU: a few ulp from libm's) rtol is 1e-5.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dt/device.hpp"

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
    std::string msg;
    try {
      r.gpu.call(&dt_hal_v1_t::synchronize, "synchronize");
    } catch (const dt::DeviceError& e) {
      msg = e.message();
    }
    report(
        "embedding_fwd reports a bad token at synchronize",
        msg.find("embedding_fwd: token 999 at position 5 is outside [0, 67)") != std::string::npos,
        msg);
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
    std::vector<float> out(BT * Cc), att(B * NH * T * T);
    r.cpu.call(&dt_hal_v1_t::attention_fwd, "attention_fwd", out.data(), att.data(),
               static_cast<const float*>(qkv.data()), B, T, Cc, NH);
    auto dq = r.up(qkv);
    dt::Device::Buffer dout(r.gpu, out.size() * 4), datt(r.gpu, att.size() * 4);
    r.gpu.call(&dt_hal_v1_t::attention_fwd, "attention_fwd", dout.as<float>(), datt.as<float>(),
               dq.as<const float>(), B, T, Cc, NH);
    compare_rel("attention_fwd att", r.down<float>(datt, att.size()), att, 1e-6, 1e-5);
    compare_rel("attention_fwd out", r.down<float>(dout, out.size()), out, 1e-5, 1e-5);
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
    const int64_t N = BT;
    auto logits = r.rand(N * V, -8, 8);
    std::vector<std::int32_t> tgt(N);
    for (auto& t : tgt) t = static_cast<std::int32_t>(r.rng() % V);
    std::vector<float> loss(N), probs(N * V);
    r.cpu.call(&dt_hal_v1_t::softmax_xent_fwd, "softmax_xent_fwd", loss.data(), probs.data(),
               static_cast<const float*>(logits.data()),
               static_cast<const std::int32_t*>(tgt.data()), N, V);
    auto dl = r.up(logits), dt_ = r.up(tgt);
    dt::Device::Buffer dloss(r.gpu, N * 4), dprobs(r.gpu, N * V * 4);
    r.gpu.call(&dt_hal_v1_t::softmax_xent_fwd, "softmax_xent_fwd", dloss.as<float>(),
               dprobs.as<float>(), dl.as<const float>(), dt_.as<const std::int32_t>(), N, V);
    compare_rel("softmax_xent_fwd losses", r.down<float>(dloss, N), loss, 1e-5, 1e-5);
    compare_rel("softmax_xent_fwd probs", r.down<float>(dprobs, N * V), probs, 1e-9, 1e-5);
    std::vector<float> dlog(N * V);
    r.cpu.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", dlog.data(),
               static_cast<const float*>(probs.data()),
               static_cast<const std::int32_t*>(tgt.data()), 1.0f / N, N, V);
    auto dp = r.up(probs);
    dt::Device::Buffer dd(r.gpu, N * V * 4);
    r.gpu.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", dd.as<float>(),
               dp.as<const float>(), dt_.as<const std::int32_t>(), 1.0f / N, N, V);
    compare_rel("softmax_xent_bwd", r.down<float>(dd, N * V), dlog, 0, 2 * kU);
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
    r.cpu.call(&dt_hal_v2_t::adamw_multi, "adamw_multi", count,
               static_cast<float* const*>(cp.data()), static_cast<const float* const*>(cg.data()),
               static_cast<float* const*>(cm.data()), static_cast<float* const*>(cv.data()),
               static_cast<const int64_t*>(sizes.data()), static_cast<const float*>(wd.data()),
               1e-2f, 0.9f, 0.95f, 1e-8f, int64_t{5});
    r.gpu.call(&dt_hal_v2_t::adamw_multi, "adamw_multi", count,
               static_cast<float* const*>(gp.data()), static_cast<const float* const*>(gg.data()),
               static_cast<float* const*>(gm.data()), static_cast<float* const*>(gv.data()),
               static_cast<const int64_t*>(sizes.data()), static_cast<const float*>(wd.data()),
               1e-2f, 0.9f, 0.95f, 1e-8f, int64_t{5});
    std::vector<float> all_c, all_g;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      auto got = r.down<float>(dP[k], sizes[k]);
      all_g.insert(all_g.end(), got.begin(), got.end());
      all_c.insert(all_c.end(), P[k].begin(), P[k].end());
    }
    compare_rel("adamw_multi params (50 tensors)", all_g, all_c, 1e-7, 1e-6);
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

}  // namespace

int main(int argc, char** argv) {
  const bool load_only = argc > 1 && std::string(argv[1]) == "--load";
  const std::string path = DT_PLUGIN_DIR;
  if (load_only) {
    try {
      dt::Device d = dt::Device::open("cuda", path);
      if (d.abi_version() != 2) {
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
    test_layers(*rig);
    test_optim_and_mixed(*rig);
    test_streams_graphs(*rig);
  } catch (const std::exception& e) {
    report("exception", false, e.what());
  }
  if (g_fails == 0)
    std::printf("cuda kernels: all %d checks passed\n", g_checks);
  else
    std::printf("cuda kernels: %d of %d checks FAILED\n", g_fails, g_checks);
  return g_fails == 0 ? 0 : 1;
}
