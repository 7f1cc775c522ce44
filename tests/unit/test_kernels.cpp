// Differential tests of the CPU device (hal/cpu/cpu_device.cpp) through its dt_hal_v1_t table.
//
// Every forward kernel is compared with an independent float64 reference written here as plain
// loops; every backward kernel with central finite differences of that float64 forward
// (Richardson-extrapolated, step 1e-3, so the reference derivative is accurate to about 1e-11 and
// negligible against the float32 tolerances below). The kernels' inputs are float32 values, which
// the references read exactly.
//
// Tolerances are first-order error bounds in units of the float32 unit roundoff u = 2^-24: a float
// sum of n terms is within n u sum|terms| of the exact sum (Higham's gamma_n), a single operation
// within u |result|, and an error d in an exponent argument becomes a relative error d in the
// exponential. Each test builds its bound from the absolute values of the terms (a running error
// bound) and, where roundings compound, doubles it to cover second-order terms; where a backward
// kernel consumes a forward output (att, probs, mean, rstd), the forward's bound is propagated.
// The bounds are worst cases: measured errors sit at 1-50% of them. Nothing is tuned to pass.
//
// Shapes are small and odd (B=3, T=7, C=12, NH=3; N=5, C=13; V=11) plus one size per kernel that
// crosses its vector blocks (16 lanes), its bias_grad tiles (256 columns, 64 rows) and its
// attention row blocks (32 queries). The whole file runs in well under a second.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu_device.h"
#include "dt/dtype.hpp"

namespace {

constexpr double kU = 0x1p-24;      // float32 unit roundoff (round to nearest)
constexpr double kFdSlack = 1e-10;  // allowance for the finite-difference reference itself
// The kernels' exponentials flush results below FLT_MIN to zero (the float answer would be a
// subnormal or 0 anyway): values that small are allowed this absolute error.
constexpr double kFlush = 1.1754943508222875e-38;

using FVec = std::vector<float>;
using DVec = std::vector<double>;

// Opens device 0 of the CPU table; closes it at scope exit.
struct Dev {
  const dt_hal_v1_t* t = nullptr;
  void* ctx = nullptr;
  Dev() {
    t = dt_hal_cpu_v1();
    REQUIRE(t != nullptr);
    REQUIRE(t->open(0, &ctx) == DT_HAL_OK);
    REQUIRE(ctx != nullptr);
  }
  ~Dev() { t->close(ctx); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::string err() const { return t->last_error(ctx); }
};

FVec rand_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  FVec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

DVec to_d(const FVec& v) { return DVec(v.begin(), v.end()); }

// One CHECK per array: counts entries with |got - ref| > tol (NaN counts) and names the first.
void expect_within(const std::string& what, const FVec& got, const DVec& ref, const DVec& tol) {
  REQUIRE(got.size() == ref.size());
  REQUIRE(tol.size() == ref.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(static_cast<double>(got[i]) - ref[i]) <= tol[i])) {
      if (bad == 0) first = i;
      ++bad;
    }
  std::ostringstream os;
  os.precision(9);
  if (bad)
    os << what << ": " << bad << " of " << got.size() << " entries off; first [" << first
       << "] got " << got[first] << " ref " << ref[first] << " |diff| "
       << std::fabs(got[first] - ref[first]) << " tol " << tol[first];
  CHECK_MESSAGE(bad == 0, os.str());
}

// d f / d x at x0 by central differences with Richardson extrapolation:
// (4 D(h/2) - D(h)) / 3 has error O(h^4 f^(5)); with h = 1e-3 and O(1) inputs, about 1e-12. The
// rounding of f contributes about 1e-16 |f| / h = 1e-13 |f|: the losses below are sums of many
// terms, so they accumulate in long double and round to double once.
double fd(const std::function<double(double)>& f, double x0, double h = 1e-3) {
  const double d1 = (f(x0 + h) - f(x0 - h)) / (2 * h);
  const double d2 = (f(x0 + h / 2) - f(x0 - h / 2)) / h;
  return (4 * d2 - d1) / 3;
}

// Gradient of a scalar function of a double vector by fd() in every coordinate.
DVec fd_grad(const std::function<double(const DVec&)>& f, DVec x) {
  DVec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    g[i] = fd(
        [&](double v) {
          x[i] = v;
          const double r = f(x);
          x[i] = x0;
          return r;
        },
        x0);
  }
  return g;
}

}  // namespace

// ---- device and memory --------------------------------------------------------------------------

TEST_CASE("kernel: table, device count, alloc alignment, copy, fill_zero, threads") {
  const dt_hal_v1_t* t = dt_hal_cpu_v1();
  REQUIRE(t != nullptr);
  CHECK(t->api_version == DT_HAL_API_VERSION_1);
  CHECK(std::string(t->name) == "cpu");
  // Every entry is present (the CPU device implements the optional one too).
  const void* const entries[] = {reinterpret_cast<const void*>(t->open),
                                 reinterpret_cast<const void*>(t->close),
                                 reinterpret_cast<const void*>(t->last_error),
                                 reinterpret_cast<const void*>(t->device_count),
                                 reinterpret_cast<const void*>(t->alloc),
                                 reinterpret_cast<const void*>(t->release),
                                 reinterpret_cast<const void*>(t->copy),
                                 reinterpret_cast<const void*>(t->fill_zero),
                                 reinterpret_cast<const void*>(t->synchronize),
                                 reinterpret_cast<const void*>(t->set_threads),
                                 reinterpret_cast<const void*>(t->gemm),
                                 reinterpret_cast<const void*>(t->bias_add),
                                 reinterpret_cast<const void*>(t->bias_grad),
                                 reinterpret_cast<const void*>(t->add),
                                 reinterpret_cast<const void*>(t->scale),
                                 reinterpret_cast<const void*>(t->sum_squares),
                                 reinterpret_cast<const void*>(t->embedding_fwd),
                                 reinterpret_cast<const void*>(t->embedding_bwd),
                                 reinterpret_cast<const void*>(t->layernorm_fwd),
                                 reinterpret_cast<const void*>(t->layernorm_bwd),
                                 reinterpret_cast<const void*>(t->gelu_fwd),
                                 reinterpret_cast<const void*>(t->gelu_bwd),
                                 reinterpret_cast<const void*>(t->attention_fwd),
                                 reinterpret_cast<const void*>(t->attention_bwd),
                                 reinterpret_cast<const void*>(t->softmax_xent_fwd),
                                 reinterpret_cast<const void*>(t->softmax_xent_bwd),
                                 reinterpret_cast<const void*>(t->adamw),
                                 reinterpret_cast<const void*>(t->cast_f32_to_bf16),
                                 reinterpret_cast<const void*>(t->cast_bf16_to_f32)};
  for (const void* e : entries) CHECK(e != nullptr);

  int count = 0;
  CHECK(t->device_count(&count) == DT_HAL_OK);
  CHECK(count == 1);

  void* bad_ctx = nullptr;
  CHECK(t->open(1, &bad_ctx) == DT_HAL_ERR_INVALID);
  CHECK(bad_ctx == nullptr);
  CHECK(std::string(t->last_error(nullptr)).find("index 1") != std::string::npos);

  Dev d;
  CHECK(d.err().empty());
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{1000}}) {
    void* p = nullptr;
    REQUIRE(d.t->alloc(d.ctx, bytes, &p) == DT_HAL_OK);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0);
    if (bytes > 0) {
      REQUIRE(d.t->fill_zero(d.ctx, p, bytes) == DT_HAL_OK);
      std::vector<unsigned char> back(bytes, 0xff);
      REQUIRE(d.t->copy(d.ctx, back.data(), p, bytes, DT_HAL_DEVICE_TO_HOST) == DT_HAL_OK);
      CHECK(std::all_of(back.begin(), back.end(), [](unsigned char c) { return c == 0; }));
    }
    d.t->release(d.ctx, p);
  }
  d.t->release(d.ctx, nullptr);  // like free(nullptr)

  std::vector<int> src(100), mid(100), dst(100);
  for (int i = 0; i < 100; ++i) src[i] = i * 7 - 3;
  CHECK(d.t->copy(d.ctx, mid.data(), src.data(), 400, DT_HAL_HOST_TO_DEVICE) == DT_HAL_OK);
  CHECK(d.t->copy(d.ctx, dst.data(), mid.data(), 400, DT_HAL_DEVICE_TO_DEVICE) == DT_HAL_OK);
  CHECK(dst == src);
  CHECK(d.t->copy(d.ctx, nullptr, nullptr, 0, DT_HAL_DEVICE_TO_HOST) == DT_HAL_OK);
  CHECK(d.t->copy(d.ctx, nullptr, src.data(), 4, DT_HAL_DEVICE_TO_HOST) == DT_HAL_ERR_INVALID);
  CHECK(!d.err().empty());
  CHECK(d.t->copy(d.ctx, dst.data(), src.data(), 4, static_cast<dt_hal_copy_kind>(7)) ==
        DT_HAL_ERR_INVALID);

  CHECK(d.t->synchronize(d.ctx) == DT_HAL_OK);
  CHECK(d.t->set_threads(d.ctx, 1) == DT_HAL_OK);
  CHECK(d.t->set_threads(d.ctx, 0) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("threads") != std::string::npos);
}

// ---- gemm ---------------------------------------------------------------------------------------

TEST_CASE("kernel: gemm, all four transpose combinations, padded leading dimensions, beta") {
  Dev d;
  std::mt19937 rng(11);
  const int64_t M = 5, N = 7, K = 13;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (float beta : {0.0f, 0.75f}) {
        CAPTURE(ta);
        CAPTURE(tb);
        CAPTURE(beta);
        const float alpha = -1.25f;
        // Stored shapes (row-major): A is M x K, or K x M when transposed; padded rows.
        const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, lda = a_cols + 3;
        const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N, ldb = b_cols + 2;
        const int64_t ldc = N + 5;
        FVec A = rand_vec(rng, a_rows * lda), B = rand_vec(rng, b_rows * ldb);
        FVec C = rand_vec(rng, M * ldc);
        // With beta = 0 the old C is not read (BLAS convention): NaN there must not leak.
        if (beta == 0.0f)
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = std::nanf("");
        const FVec C0 = C;
        auto a = [&](int64_t i, int64_t k) { return double(ta ? A[k * lda + i] : A[i * lda + k]); };
        auto b = [&](int64_t k, int64_t j) { return double(tb ? B[j * ldb + k] : B[k * ldb + j]); };
        DVec ref(M * ldc), tol(M * ldc);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < ldc; ++j) {
            if (j >= N) {  // padding columns stay untouched
              ref[i * ldc + j] = C0[i * ldc + j];
              tol[i * ldc + j] = 0.0;
              continue;
            }
            double s = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
              s += a(i, k) * b(k, j);
              mag += std::fabs(a(i, k) * b(k, j));
            }
            const double c0 = beta == 0.0f ? 0.0 : double(C0[i * ldc + j]);
            ref[i * ldc + j] = alpha * s + beta * c0;
            // gamma_{K+2}: K products summed, then alpha and the beta term (one rounding each).
            tol[i * ldc + j] = 2 * (K + 2) * kU * (std::fabs(alpha) * mag + std::fabs(beta * c0));
          }
        REQUIRE(d.t->gemm(d.ctx, ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta,
                          C.data(), ldc) == DT_HAL_OK);
        expect_within("gemm", C, ref, tol);
      }
}

TEST_CASE("kernel: gemm edge sizes and argument errors") {
  Dev d;
  FVec A(6, 1.0f), B(6, 2.0f), C(4, 3.0f);
  // K = 0: C = beta C.
  REQUIRE(d.t->gemm(d.ctx, 0, 0, 2, 2, 0, 1.0f, A.data(), 1, B.data(), 2, 0.5f, C.data(), 2) ==
          DT_HAL_OK);
  CHECK(C == FVec(4, 1.5f));
  // M = 0 or N = 0: nothing happens, even with null pointers.
  CHECK(d.t->gemm(d.ctx, 0, 0, 0, 2, 3, 1.0f, nullptr, 3, nullptr, 2, 0.0f, nullptr, 2) ==
        DT_HAL_OK);
  CHECK(d.t->gemm(d.ctx, 0, 0, 2, 2, 3, 1.0f, A.data(), 2, B.data(), 2, 0.0f, C.data(), 2) ==
        DT_HAL_ERR_INVALID);  // lda < K
  CHECK(d.err().find("lda") != std::string::npos);
  CHECK(d.t->gemm(d.ctx, 0, 1, 2, 2, 3, 1.0f, A.data(), 3, B.data(), 2, 0.0f, C.data(), 2) ==
        DT_HAL_ERR_INVALID);  // ldb < K for a transposed N x K B
  CHECK(d.t->gemm(d.ctx, 0, 0, -1, 2, 3, 1.0f, A.data(), 3, B.data(), 2, 0.0f, C.data(), 2) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.t->gemm(d.ctx, 0, 0, 2, 2, 3, 1.0f, nullptr, 3, B.data(), 2, 0.0f, C.data(), 2) ==
        DT_HAL_ERR_INVALID);
  CHECK(!d.err().empty());
}

// ---- elementwise and reductions -----------------------------------------------------------------

TEST_CASE("kernel: bias_add, bias_grad, add, scale, sum_squares") {
  Dev d;
  std::mt19937 rng(12);
  // (N, C) pairs: odd sizes, and one crossing bias_grad's 64-row blocks and 256-column tiles.
  for (auto [N, C] : {std::pair<int64_t, int64_t>{5, 13}, {130, 300}}) {
    CAPTURE(N);
    CAPTURE(C);
    FVec out = rand_vec(rng, N * C), bias = rand_vec(rng, C);
    DVec ref(N * C), tol(N * C);
    for (int64_t i = 0; i < N * C; ++i) {
      ref[i] = double(out[i]) + bias[i % C];
      tol[i] = kU * std::fabs(ref[i]);  // one correctly rounded addition
    }
    REQUIRE(d.t->bias_add(d.ctx, out.data(), bias.data(), N, C) == DT_HAL_OK);
    expect_within("bias_add", out, ref, tol);

    // bias_grad is bias_add's backward: finite differences of L = sum dout * (out + bias).
    const FVec dout = rand_vec(rng, N * C), dbias0 = rand_vec(rng, C);
    FVec dbias = dbias0;
    const DVec outd = to_d(out);
    DVec gref = fd_grad(
        [&](const DVec& bb) {
          long double L = 0;
          for (int64_t i = 0; i < N * C; ++i) L += dout[i] * (outd[i] + bb[i % C]);
          return static_cast<double>(L);
        },
        to_d(bias));
    DVec gtol(C);
    for (int64_t c = 0; c < C; ++c) {
      double mag = std::fabs(dbias0[c]);
      for (int64_t n = 0; n < N; ++n) mag += std::fabs(dout[n * C + c]);
      gref[c] += dbias0[c];
      gtol[c] = (N + 2) * kU * mag + kFdSlack;  // gamma_{N+1}: N terms added to the old value
    }
    REQUIRE(d.t->bias_grad(d.ctx, dbias.data(), dout.data(), N, C) == DT_HAL_OK);
    expect_within("bias_grad", dbias, gref, gtol);
  }

  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{1000}}) {
    CAPTURE(n);
    FVec a = rand_vec(rng, n), b = rand_vec(rng, n, -4.0f, 4.0f), out(n);
    DVec ref(n), tol(n);
    for (int64_t i = 0; i < n; ++i) {
      ref[i] = double(a[i]) + b[i];
      tol[i] = kU * std::fabs(ref[i]);
    }
    REQUIRE(d.t->add(d.ctx, out.data(), a.data(), b.data(), n) == DT_HAL_OK);
    expect_within("add", out, ref, tol);
    // In place (out aliases a), as a residual connection uses it.
    FVec a2 = a;
    REQUIRE(d.t->add(d.ctx, a2.data(), a2.data(), b.data(), n) == DT_HAL_OK);
    CHECK(a2 == out);

    FVec x = a;
    for (int64_t i = 0; i < n; ++i) {
      ref[i] = double(a[i]) * -0.3f;
      tol[i] = kU * std::fabs(ref[i]);
    }
    REQUIRE(d.t->scale(d.ctx, x.data(), -0.3f, n) == DT_HAL_OK);
    expect_within("scale", x, ref, tol);

    double ss = -1, ref_ss = 0;
    for (float v : b) ref_ss += double(v) * v;
    REQUIRE(d.t->sum_squares(d.ctx, b.data(), n, &ss) == DT_HAL_OK);
    // Accumulated in double: squares of floats are exact, n additions of 2^-53 each.
    CHECK(std::fabs(ss - ref_ss) <= (n + 1) * 0x1p-53 * ref_ss);
  }
  double ss = -1;
  CHECK(d.t->sum_squares(d.ctx, nullptr, 0, &ss) == DT_HAL_OK);
  CHECK(ss == 0.0);
  CHECK(d.t->add(d.ctx, nullptr, nullptr, nullptr, -1) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("negative") != std::string::npos);
  CHECK(d.t->bias_add(d.ctx, nullptr, nullptr, 2, 3) == DT_HAL_ERR_INVALID);
  CHECK(d.t->sum_squares(d.ctx, nullptr, 3, &ss) == DT_HAL_ERR_INVALID);
}

// ---- embedding ----------------------------------------------------------------------------------

TEST_CASE("kernel: embedding forward and backward") {
  Dev d;
  std::mt19937 rng(13);
  const int64_t B = 3, T = 7, C = 12, V = 11;
  std::vector<int32_t> tok(B * T);
  std::uniform_int_distribution<int32_t> td(0, V - 1);
  for (auto& x : tok) x = td(rng);
  tok[0] = 0;
  tok[1] = V - 1;  // both ends of the range
  const FVec wte = rand_vec(rng, V * C), wpe = rand_vec(rng, T * C);
  FVec out(B * T * C);
  REQUIRE(d.t->embedding_fwd(d.ctx, out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V) ==
          DT_HAL_OK);
  auto ref_fwd = [&](const DVec& e, const DVec& p) {
    DVec o(B * T * C);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < C; ++c)
          o[(b * T + t) * C + c] = e[tok[b * T + t] * C + c] + p[t * C + c];
    return o;
  };
  const DVec ref = ref_fwd(to_d(wte), to_d(wpe));
  DVec tol(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) tol[i] = kU * std::fabs(ref[i]);  // one addition
  expect_within("embedding_fwd", out, ref, tol);

  // Backward against finite differences of L = sum dout * out (linear, so the FD is exact up to
  // double rounding); accumulation onto random initial gradients.
  const FVec dout = rand_vec(rng, B * T * C);
  FVec dwte = rand_vec(rng, V * C), dwpe = rand_vec(rng, T * C);
  const FVec dwte0 = dwte, dwpe0 = dwpe;
  REQUIRE(d.t->embedding_bwd(d.ctx, dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C) ==
          DT_HAL_OK);
  auto loss = [&](const DVec& e, const DVec& p) {
    const DVec o = ref_fwd(e, p);
    long double L = 0;
    for (size_t i = 0; i < o.size(); ++i) L += dout[i] * o[i];
    return static_cast<double>(L);
  };
  const DVec wpe_d = to_d(wpe), wte_d = to_d(wte);
  DVec ge = fd_grad([&](const DVec& e) { return loss(e, wpe_d); }, wte_d);
  DVec gp = fd_grad([&](const DVec& p) { return loss(wte_d, p); }, wpe_d);
  // Tolerance: each row is the old value plus at most B*T float additions: gamma_{B*T} * sum|.|.
  DVec te(ge.size()), tp(gp.size());
  for (int64_t v = 0; v < V; ++v)
    for (int64_t c = 0; c < C; ++c) te[v * C + c] = std::fabs(dwte0[v * C + c]);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) tp[t * C + c] = std::fabs(dwpe0[t * C + c]);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        te[tok[b * T + t] * C + c] += std::fabs(dout[(b * T + t) * C + c]);
        tp[t * C + c] += std::fabs(dout[(b * T + t) * C + c]);
      }
  for (size_t i = 0; i < ge.size(); ++i) {
    ge[i] += dwte0[i];
    te[i] = (B * T + 1) * kU * te[i] + kFdSlack;
  }
  for (size_t i = 0; i < gp.size(); ++i) {
    gp[i] += dwpe0[i];
    tp[i] = (B + 1) * kU * tp[i] + kFdSlack;
  }
  expect_within("embedding_bwd dwte", dwte, ge, te);
  expect_within("embedding_bwd dwpe", dwpe, gp, tp);
}

TEST_CASE("kernel: embedding rejects a token outside [0, V) and names it") {
  Dev d;
  const int64_t B = 2, T = 3, C = 4, V = 5;
  std::vector<int32_t> tok = {0, 1, 2, 3, 4, 0};
  FVec wte(V * C, 1.0f), wpe(T * C, 1.0f), out(B * T * C, -7.0f);
  tok[4] = 5;  // == V, at position 4 (b = 1, t = 1)
  CHECK(d.t->embedding_fwd(d.ctx, out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V) ==
        DT_HAL_ERR_INVALID);
  const std::string e = d.err();
  CHECK(e.find("token 5") != std::string::npos);
  CHECK(e.find("position 4") != std::string::npos);
  CHECK(out == FVec(B * T * C, -7.0f));  // validated before anything was written
  tok[4] = -2;
  CHECK(d.t->embedding_fwd(d.ctx, out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("token -2") != std::string::npos);
  CHECK(d.t->embedding_bwd(d.ctx, wte.data(), wpe.data(), out.data(), tok.data(), B, T, C) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("-2") != std::string::npos);
}

// ---- layernorm ----------------------------------------------------------------------------------

namespace {

struct LnRef {
  DVec out, mean, rstd;
};

LnRef ln_ref(const DVec& x, const DVec& w, const DVec& b, int64_t N, int64_t C) {
  LnRef r{DVec(N * C), DVec(N), DVec(N)};
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int64_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    const double rs = 1.0 / std::sqrt(v + 1e-5);
    for (int64_t c = 0; c < C; ++c) r.out[n * C + c] = (x[n * C + c] - m) * rs * w[c] + b[c];
    r.mean[n] = m;
    r.rstd[n] = rs;
  }
  return r;
}

}  // namespace

TEST_CASE("kernel: layernorm forward and backward") {
  Dev d;
  std::mt19937 rng(14);
  for (auto [N, C] : {std::pair<int64_t, int64_t>{5, 13}, {4, 40}}) {
    CAPTURE(N);
    CAPTURE(C);
    FVec x = rand_vec(rng, N * C, -2.0f, 2.0f);
    for (int64_t c = 0; c < C; ++c) x[c] = 30.0f + 0.5f * x[c];  // row 0: mean far from 0
    const FVec w = rand_vec(rng, C, 0.5f, 1.5f), b = rand_vec(rng, C);
    FVec out(N * C), mean(N), rstd(N);
    REQUIRE(d.t->layernorm_fwd(d.ctx, out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                               b.data(), N, C) == DT_HAL_OK);
    const LnRef r = ln_ref(to_d(x), to_d(w), to_d(b), N, C);
    // Bounds: the mean is a float sum of C terms: dm <= (C+1) u mean|x|. The variance sums C
    // squares of (x - m) (gamma_{C+2} relative; the first-order effect of dm cancels since
    // sum (x - m) = 0), and rstd = 1/sqrt(var + eps) halves that relative error and adds 2u.
    // out = (x - m) rs w + b: (dm + u|x - m|) rs |w| + |xhat w| drs/rs + 3u (|xhat w| + |b|).
    DVec tm(N), tr(N), to(N * C);
    for (int64_t n = 0; n < N; ++n) {
      double ax = 0;
      for (int64_t c = 0; c < C; ++c) ax += std::fabs(x[n * C + c]);
      const double dm = (C + 1) * kU * ax / C;
      const double drs = ((C + 2) * kU / 2 + 2 * kU) * r.rstd[n];
      tm[n] = 2 * dm;
      tr[n] = 2 * drs;
      for (int64_t c = 0; c < C; ++c) {
        const double xm = std::fabs(x[n * C + c] - r.mean[n]);
        const double xh = xm * r.rstd[n] * std::fabs(w[c]);
        to[n * C + c] = 2 * ((dm + kU * xm) * r.rstd[n] * std::fabs(w[c]) + xh * drs / r.rstd[n] +
                             3 * kU * (xh + std::fabs(b[c])));
      }
    }
    expect_within("layernorm_fwd mean", mean, r.mean, tm);
    expect_within("layernorm_fwd rstd", rstd, r.rstd, tr);
    expect_within("layernorm_fwd out", out, r.out, to);

    // Backward: finite differences of L = sum dout * out through the double forward.
    const FVec dout = rand_vec(rng, N * C);
    FVec dx = rand_vec(rng, N * C), dw = rand_vec(rng, C), db = rand_vec(rng, C);
    const FVec dx0 = dx, dw0 = dw, db0 = db;
    REQUIRE(d.t->layernorm_bwd(d.ctx, dx.data(), dw.data(), db.data(), dout.data(), x.data(),
                               w.data(), mean.data(), rstd.data(), N, C) == DT_HAL_OK);
    const DVec xd = to_d(x), wd = to_d(w), bd = to_d(b);
    auto L = [&](const DVec& xx, const DVec& ww, const DVec& bb) {
      const DVec o = ln_ref(xx, ww, bb, N, C).out;
      long double s = 0;
      for (size_t i = 0; i < o.size(); ++i) s += dout[i] * o[i];
      return static_cast<double>(s);
    };
    DVec gx = fd_grad([&](const DVec& v) { return L(v, wd, bd); }, xd);
    DVec gw = fd_grad([&](const DVec& v) { return L(xd, v, bd); }, wd);
    DVec gb = fd_grad([&](const DVec& v) { return L(xd, wd, v); }, bd);
    // Bounds, propagating the forward's dm, drs (the kernel reads the float mean and rstd):
    // xhat has error dxh = (dm + u|x-m|) rs + |x-m| drs + u|xhat|; g = w dout; the row means
    // mg = mean(g), mgx = mean(g xhat) carry (C+2)u mean|.| plus mean(|g| dxh); then
    // dx = (g - mg - xhat mgx) rs adds 4u of its terms and |.| drs. dw and db are sums over N
    // rows of xhat dout (with dxh) and dout, onto the old value: gamma_{N+1}.
    DVec tx(N * C), tw(C), tb(C);
    for (int64_t c = 0; c < C; ++c) {
      tw[c] = (N + 1) * kU * std::fabs(dw0[c]);
      tb[c] = (N + 1) * kU * std::fabs(db0[c]);
    }
    for (int64_t n = 0; n < N; ++n) {
      double ax = 0;
      for (int64_t c = 0; c < C; ++c) ax += std::fabs(x[n * C + c]);
      const double rs = r.rstd[n], dm = (C + 1) * kU * ax / C;
      const double drs = ((C + 2) * kU / 2 + 2 * kU) * rs;
      DVec xh(C), dxh(C), g(C);
      double mg = 0, mgx = 0, amg = 0, amgx = 0, edx = 0;
      for (int64_t c = 0; c < C; ++c) {
        const double xm = x[n * C + c] - r.mean[n];
        xh[c] = xm * rs;
        dxh[c] = (dm + kU * std::fabs(xm)) * rs + std::fabs(xm) * drs + kU * std::fabs(xh[c]);
        g[c] = double(w[c]) * dout[n * C + c];
        mg += g[c] / C;
        mgx += g[c] * xh[c] / C;
        amg += std::fabs(g[c]) / C;
        amgx += std::fabs(g[c] * xh[c]) / C;
        edx += std::fabs(g[c]) * dxh[c] / C;
      }
      const double dmg = (C + 2) * kU * amg, dmgx = (C + 2) * kU * amgx + edx;
      for (int64_t c = 0; c < C; ++c) {
        const double inner = std::fabs(g[c]) + std::fabs(mg) + std::fabs(xh[c] * mgx);
        const double e = (kU * std::fabs(g[c]) + dmg + dxh[c] * std::fabs(mgx) +
                          std::fabs(xh[c]) * dmgx + 4 * kU * inner) *
                             rs +
                         std::fabs(g[c] - mg - xh[c] * mgx) * drs;
        tx[n * C + c] = e + kU * (std::fabs(dx0[n * C + c]) + rs * inner);
        tw[c] +=
            dxh[c] * std::fabs(dout[n * C + c]) + (N + 2) * kU * std::fabs(xh[c] * dout[n * C + c]);
        tb[c] += (N + 1) * kU * std::fabs(dout[n * C + c]);
      }
    }
    auto finish = [](DVec& ref, const FVec& init, DVec& tol) {
      for (size_t i = 0; i < ref.size(); ++i) {
        ref[i] += init[i];
        tol[i] = 2 * tol[i] + kFdSlack;
      }
    };
    finish(gx, dx0, tx);
    finish(gw, dw0, tw);
    finish(gb, db0, tb);
    expect_within("layernorm_bwd dinp", dx, gx, tx);
    expect_within("layernorm_bwd dw", dw, gw, tw);
    expect_within("layernorm_bwd db", db, gb, tb);
  }
}

// ---- GELU ---------------------------------------------------------------------------------------

namespace {

constexpr double kGeluK = 0.7978845608028654;  // sqrt(2/pi)

double gelu_arg(double x) { return kGeluK * (x + 0.044715 * x * x * x); }
// 0.5 x (1 + tanh u) written as x / (1 + e^{-2u}) (an identity): the left side loses all digits
// to cancellation in double for u < -18, the right side none.
double gelu_ref(double x) { return x / (1.0 + std::exp(-2.0 * gelu_arg(x))); }

}  // namespace

TEST_CASE("kernel: gelu forward and backward") {
  Dev d;
  std::mt19937 rng(15);
  FVec x = rand_vec(rng, 61, -6.0f, 6.0f);
  for (float v : {0.0f, -0.0f, 1e-20f, -1e-20f, 10.0f, -10.0f, 30.0f, -30.0f, 3.0f, -3.0f})
    x.push_back(v);
  const int64_t n = static_cast<int64_t>(x.size());
  // The header's formula and the identity agree in double where the former is well conditioned.
  for (double v : {-3.0, -0.5, 0.0, 0.7, 2.5})
    CHECK(std::fabs(0.5 * v * (1 + std::tanh(gelu_arg(v))) - gelu_ref(v)) <= 1e-15);

  // Bound: gelu = x s(u), s = 1/(1+e^{-2u}). The float u carries about 4u relative error (x^3,
  // the sum, the factor), which moves s by s(1-s) 2 du; exp_approx and the division add
  // 4u to s; the final product u. So |err| <= 8u (|gelu| + |x| s(1-s) (1 + 2|u|)).
  FVec out(n);
  REQUIRE(d.t->gelu_fwd(d.ctx, out.data(), x.data(), n) == DT_HAL_OK);
  DVec ref(n), tol(n);
  for (int64_t i = 0; i < n; ++i) {
    const double u = gelu_arg(x[i]), s = 1.0 / (1.0 + std::exp(-2.0 * u));
    ref[i] = gelu_ref(x[i]);
    tol[i] = 8 * kU * (std::fabs(ref[i]) + std::fabs(x[i]) * s * (1 - s) * (1 + 2 * std::fabs(u))) +
             std::fabs(x[i]) * kFlush;
  }
  expect_within("gelu_fwd", out, ref, tol);
  FVec in_place = x;  // out == inp is allowed
  REQUIRE(d.t->gelu_fwd(d.ctx, in_place.data(), in_place.data(), n) == DT_HAL_OK);
  CHECK(std::memcmp(in_place.data(), out.data(), n * sizeof(float)) == 0);

  // Backward: dinp += dout * gelu'(x), gelu' from finite differences of gelu_ref. The kernel's
  // gelu' = s + 2 x s(1-s) u'(x); with the same du as above, s moves by s(1-s) 2du and s(1-s) by
  // |1-2s| s(1-s) 2du; every other factor adds a few u. Bound: 16u (s + |T2| (1 + 2|u|) +
  // s(1-s) 2|u|) |dout| plus u of the accumulated value.
  const FVec dout = rand_vec(rng, n);
  FVec dx = rand_vec(rng, n);
  const FVec dx0 = dx;
  REQUIRE(d.t->gelu_bwd(d.ctx, dx.data(), x.data(), dout.data(), n) == DT_HAL_OK);
  DVec gref(n), gtol(n);
  for (int64_t i = 0; i < n; ++i) {
    const double xi = x[i], u = gelu_arg(xi), s = 1.0 / (1.0 + std::exp(-2.0 * u));
    const double t2 = 2 * xi * s * (1 - s) * kGeluK * (1 + 3 * 0.044715 * xi * xi);
    const double g = fd([](double v) { return gelu_ref(v); }, xi);
    gref[i] = dx0[i] + double(dout[i]) * g;
    gtol[i] = 16 * kU *
                  (s + std::fabs(t2) * (1 + 2 * std::fabs(u)) + s * (1 - s) * 2 * std::fabs(u)) *
                  std::fabs(dout[i]) +
              kU * (std::fabs(dx0[i]) + std::fabs(gref[i])) + kFdSlack;
  }
  expect_within("gelu_bwd", dx, gref, gtol);
}

// ---- attention ----------------------------------------------------------------------------------

namespace {

// Causal attention of one (b, h) in double: out[t][d], att[t][j] for j <= t.
struct AttnRef {
  DVec out, att;  // T x hs, T x T
};

AttnRef attn_ref_bh(const DVec& qkv, int64_t b, int64_t h, int64_t T, int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  auto q = [&](int64_t t, int64_t i) { return qkv[(b * T + t) * 3 * C + h * hs + i]; };
  auto k = [&](int64_t t, int64_t i) { return qkv[(b * T + t) * 3 * C + C + h * hs + i]; };
  auto v = [&](int64_t t, int64_t i) { return qkv[(b * T + t) * 3 * C + 2 * C + h * hs + i]; };
  AttnRef r{DVec(T * hs, 0.0), DVec(T * T, 0.0)};
  for (int64_t t = 0; t < T; ++t) {
    DVec s(t + 1);
    double m = -1e300;
    for (int64_t j = 0; j <= t; ++j) {
      double dot = 0;
      for (int64_t i = 0; i < hs; ++i) dot += q(t, i) * k(j, i);
      s[j] = dot / std::sqrt(double(hs));
      m = std::max(m, s[j]);
    }
    double z = 0;
    for (int64_t j = 0; j <= t; ++j) z += std::exp(s[j] - m);
    for (int64_t j = 0; j <= t; ++j) r.att[t * T + j] = std::exp(s[j] - m) / z;
    for (int64_t i = 0; i < hs; ++i)
      for (int64_t j = 0; j <= t; ++j) r.out[t * hs + i] += r.att[t * T + j] * v(j, i);
  }
  return r;
}

}  // namespace

TEST_CASE("kernel: attention forward and backward") {
  Dev d;
  std::mt19937 rng(16);
  struct Shape {
    int64_t B, T, C, NH;
  };
  // One row block (T < 32), and T = 37: two row blocks, the second partial.
  for (Shape sh : {Shape{3, 7, 12, 3}, Shape{1, 37, 8, 2}}) {
    const int64_t B = sh.B, T = sh.T, C = sh.C, NH = sh.NH, hs = C / NH;
    CAPTURE(T);
    const FVec qkv = rand_vec(rng, B * T * 3 * C, -1.5f, 1.5f);
    const DVec qkv_d = to_d(qkv);
    FVec out(B * T * C), att(B * NH * T * T, std::nanf(""));
    REQUIRE(d.t->attention_fwd(d.ctx, out.data(), att.data(), qkv.data(), B, T, C, NH) ==
            DT_HAL_OK);

    // Forward bound. Scores: a float dot of hs terms, then the scale: ds = (hs+2)u scale
    // sum|q k|. The exponent argument s - max also rounds (u|s - max|) and takes the max's ds.
    // A probability's relative error: its argument's error plus the softmax-weighted mean of the
    // others (<= the row's max) plus exp_approx (2u) and the normalisation (len + 2)u.
    // out = sum_j p v: sum_j |v| dp + (len+1)u sum_j p|v|. Doubled for second order.
    DVec ref_out(B * T * C), tol_out(B * T * C), ref_att(B * NH * T * T), tol_att(B * NH * T * T);
    DVec relp(B * NH * T);  // per row: the bound on |dp| / p, reused by the backward
    const double scale = 1.0 / std::sqrt(double(hs));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h) {
        const AttnRef r = attn_ref_bh(qkv_d, b, h, T, C, NH);
        for (int64_t t = 0; t < T; ++t) {
          double m = -1e300, smax_err = 0;
          DVec s(t + 1), ds(t + 1);
          for (int64_t j = 0; j <= t; ++j) {
            double dot = 0, mag = 0;
            for (int64_t i = 0; i < hs; ++i) {
              const double a = qkv_d[(b * T + t) * 3 * C + h * hs + i];
              const double c = qkv_d[(b * T + j) * 3 * C + C + h * hs + i];
              dot += a * c;
              mag += std::fabs(a * c);
            }
            s[j] = dot * scale;
            ds[j] = (hs + 2) * kU * scale * mag;
            if (s[j] > m) {
              m = s[j];
              smax_err = ds[j];
            }
          }
          double worst = 0;
          for (int64_t j = 0; j <= t; ++j)
            worst = std::max(worst, ds[j] + smax_err + kU * std::fabs(s[j] - m));
          const double rel = 2 * (2 * worst + (t + 1 + 4) * kU);
          relp[(b * NH + h) * T + t] = rel;
          for (int64_t j = 0; j < T; ++j) {
            const int64_t ai = ((b * NH + h) * T + t) * T + j;
            ref_att[ai] = r.att[t * T + j];
            tol_att[ai] = j <= t ? rel * r.att[t * T + j] + kFlush : 0.0;  // exact 0 above
          }
          for (int64_t i = 0; i < hs; ++i) {
            double mag = 0, prop = 0;
            for (int64_t j = 0; j <= t; ++j) {
              const double vv = std::fabs(qkv_d[(b * T + j) * 3 * C + 2 * C + h * hs + i]);
              mag += r.att[t * T + j] * vv;
              prop += rel * r.att[t * T + j] * vv;
            }
            const int64_t oi = (b * T + t) * C + h * hs + i;
            ref_out[oi] = r.out[t * hs + i];
            tol_out[oi] = prop + 2 * (t + 3) * kU * mag;
          }
        }
      }
    expect_within("attention_fwd att", att, ref_att, tol_att);
    expect_within("attention_fwd out", out, ref_out, tol_out);
    for (int64_t row = 0; row < B * NH * T; ++row) {  // rows of att sum to 1, zeros above
      double s = 0;
      for (int64_t j = 0; j < T; ++j) s += att[row * T + j];
      CHECK(std::fabs(s - 1.0) <= 2 * (T + 4) * kU);
    }

    // Backward: finite differences of L = sum dout * out per (b, h), through the double forward.
    const FVec dout = rand_vec(rng, B * T * C);
    FVec dqkv = rand_vec(rng, B * T * 3 * C), scratch(B * NH * T * T, std::nanf(""));
    const FVec dqkv0 = dqkv;
    REQUIRE(d.t->attention_bwd(d.ctx, dqkv.data(), scratch.data(), dout.data(), qkv.data(),
                               att.data(), B, T, C, NH) == DT_HAL_OK);
    DVec gref(B * T * 3 * C, 0.0), gtol(B * T * 3 * C, 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h) {
        auto L = [&](const DVec& x) {
          const AttnRef r = attn_ref_bh(x, b, h, T, C, NH);
          long double s = 0;
          for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < hs; ++i)
              s += dout[(b * T + t) * C + h * hs + i] * r.out[t * hs + i];
          return static_cast<double>(s);
        };
        DVec x = qkv_d;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t part = 0; part < 3; ++part)
            for (int64_t i = 0; i < hs; ++i) {
              const int64_t idx = (b * T + t) * 3 * C + part * C + h * hs + i;
              const double x0 = x[idx];
              gref[idx] = fd(
                  [&](double val) {
                    x[idx] = val;
                    const double r = L(x);
                    x[idx] = x0;
                    return r;
                  },
                  x0);
            }

        // Backward bound (running error, kernel reads the float att with relative error relp):
        // datt_tj = dout_t . v_j: (hs+1)u sum|dout v|; rho_t = sum_j p datt: its terms' errors
        // plus (len+1)u sum|p datt|; dpre = scale p (datt - rho): p's error, datt's and rho's,
        // and 3u. dv_j = sum_t p_tj dout_t, dq_t = sum_j dpre_tj k_j, dk_j = sum_t dpre_tj q_t:
        // the summands' errors plus (T+1)u sum|summands|, and u of the accumulated value.
        const AttnRef r = attn_ref_bh(qkv_d, b, h, T, C, NH);
        auto Q = [&](int64_t t, int64_t i) { return qkv_d[(b * T + t) * 3 * C + h * hs + i]; };
        auto K = [&](int64_t t, int64_t i) { return qkv_d[(b * T + t) * 3 * C + C + h * hs + i]; };
        auto Vv = [&](int64_t t, int64_t i) {
          return qkv_d[(b * T + t) * 3 * C + 2 * C + h * hs + i];
        };
        auto dO = [&](int64_t t, int64_t i) { return double(dout[(b * T + t) * C + h * hs + i]); };
        DVec dpre(T * T, 0.0), edpre(T * T, 0.0);
        for (int64_t t = 0; t < T; ++t) {
          const double rel = relp[(b * NH + h) * T + t];
          DVec datt(t + 1), edatt(t + 1);
          double rho = 0, erho = 0, arho = 0;
          for (int64_t j = 0; j <= t; ++j) {
            double s = 0, mag = 0;
            for (int64_t i = 0; i < hs; ++i) {
              s += dO(t, i) * Vv(j, i);
              mag += std::fabs(dO(t, i) * Vv(j, i));
            }
            datt[j] = s;
            edatt[j] = (hs + 1) * kU * mag;
            const double p = r.att[t * T + j];
            rho += p * s;
            arho += std::fabs(p * s);
            erho += rel * p * std::fabs(s) + p * edatt[j];
          }
          erho += (t + 2) * kU * arho;
          for (int64_t j = 0; j <= t; ++j) {
            const double p = r.att[t * T + j], diff = datt[j] - rho;
            dpre[t * T + j] = scale * p * diff;
            edpre[t * T + j] = scale * (rel * p * std::fabs(diff) + p * (edatt[j] + erho) +
                                        3 * kU * p * (std::fabs(datt[j]) + std::fabs(rho)));
          }
        }
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < hs; ++i) {
            double eq = 0, aq = 0, ek = 0, ak = 0, ev = 0, av = 0;
            for (int64_t j = 0; j < T; ++j) {
              // dq_t: sum over keys j <= t; dk_t, dv_t: sum over queries j >= t.
              eq += edpre[t * T + j] * std::fabs(K(j, i));
              aq += std::fabs(dpre[t * T + j] * K(j, i));
              ek += edpre[j * T + t] * std::fabs(Q(j, i));
              ak += std::fabs(dpre[j * T + t] * Q(j, i));
              const double p = r.att[j * T + t];
              ev += relp[(b * NH + h) * T + j] * p * std::fabs(dO(j, i));
              av += p * std::fabs(dO(j, i));
            }
            const int64_t base = (b * T + t) * 3 * C + h * hs + i;
            gtol[base] = eq + (T + 1) * kU * aq;
            gtol[base + C] = ek + (T + 1) * kU * ak;
            gtol[base + 2 * C] = ev + (T + 1) * kU * av;
          }
      }
    for (size_t i = 0; i < gref.size(); ++i) {
      gref[i] += dqkv0[i];
      gtol[i] = 2 * (gtol[i] + kU * (std::fabs(dqkv0[i]) + std::fabs(gref[i]))) + kFdSlack;
    }
    expect_within("attention_bwd dqkv", dqkv, gref, gtol);
  }
}

TEST_CASE("kernel: attention with T = 70 (three row blocks) and large scores stays finite") {
  Dev d;
  std::mt19937 rng(17);
  const int64_t B = 1, T = 70, C = 16, NH = 2;
  FVec qkv = rand_vec(rng, B * T * 3 * C, -1.0f, 1.0f);
  for (int64_t i = 0; i < B * T * 3 * C; ++i) qkv[i] *= 12.0f;  // scores up to ~1000: needs max
  FVec out(B * T * C), att(B * NH * T * T);
  REQUIRE(d.t->attention_fwd(d.ctx, out.data(), att.data(), qkv.data(), B, T, C, NH) == DT_HAL_OK);
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return std::isfinite(v); }));
  const DVec qd = to_d(qkv);
  size_t bad = 0;
  for (int64_t h = 0; h < NH; ++h) {
    const AttnRef r = attn_ref_bh(qd, 0, h, T, C, NH);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < T; ++j) {
        const float got = att[(h * T + t) * T + j];
        if (j > t && got != 0.0f) ++bad;
        // Scores of magnitude ~1000 carry absolute float error ~ (hs+2) u 1000 ~ 1e-3 in the
        // exponent, so probabilities are compared at 5e-3 absolute (they are all in [0, 1]).
        if (j <= t && !(std::fabs(got - r.att[t * T + j]) <= 5e-3)) ++bad;
      }
  }
  CHECK(bad == 0);
}

// Exponentials of arguments far below -88 (whose true value is 0): in (-1.74e7, -8.7e6) the
// rounding that finds 2^k used to read garbage for k. GELU takes e^{-2|u|} (|x| in [496, 625] and
// beyond), the softmaxes e^{x - max}; and GELU's gradient multiplied that 0 by x^2 = +inf for
// |x| above 1.8e19.
TEST_CASE("kernel: gelu, attention and cross-entropy far out (exponentials of huge negatives)") {
  Dev d;
  FVec x;
  for (float v = 496.0f; v <= 626.0f; v += 0.25f) {
    x.push_back(v);
    x.push_back(-v);
  }
  for (float v : {1e4f, 1e7f, 1e12f, 2e19f, 1e30f, 3e38f}) {
    x.push_back(v);
    x.push_back(-v);
  }
  const int64_t n = static_cast<int64_t>(x.size());
  FVec out(n), dx(n, 0.0f);
  const FVec ones(n, 1.0f);
  REQUIRE(d.t->gelu_fwd(d.ctx, out.data(), x.data(), n) == DT_HAL_OK);
  REQUIRE(d.t->gelu_bwd(d.ctx, dx.data(), x.data(), ones.data(), n) == DT_HAL_OK);
  size_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    // GELU is x for these x > 0 (1 - s below 1e-200) and 0 for x < 0; its slope 1 and 0.
    const bool ok = x[i] > 0 ? out[i] == x[i] && dx[i] == 1.0f : out[i] == 0.0f && dx[i] == 0.0f;
    if (!ok && bad++ < 5) MESSAGE("gelu(" << x[i] << ") = " << out[i] << ", gelu' = " << dx[i]);
  }
  CHECK(bad == 0);

  // Cross-entropy: the target's logit is the row's largest, every other lies 8.7e6 to 2e7 below
  // it: loss 0, probabilities one-hot.
  const int64_t N = 2, V = 4;
  const FVec logits = {0.0f, -8.8e6f, -1.2e7f, -1.6e7f, -1.7e7f, 1.0f, -9e6f, -1.3e7f};
  const std::vector<int32_t> tgt = {0, 1};
  FVec losses(N), probs(N * V);
  REQUIRE(d.t->softmax_xent_fwd(d.ctx, losses.data(), probs.data(), logits.data(), tgt.data(), N,
                                V) == DT_HAL_OK);
  CHECK(losses == FVec{0.0f, 0.0f});
  CHECK(probs == FVec{1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f});

  // Attention, T = 2, one head of size 1: row 1's scores are q1 k0 = -1.6e7 and q1 k1 = 0, so it
  // takes v1 alone.
  const FVec qkv = {1.0f, -4000.0f, 10.0f, 4000.0f, 0.0f, 20.0f};  // per token: q, k, v
  FVec aout(2), att(4);
  REQUIRE(d.t->attention_fwd(d.ctx, aout.data(), att.data(), qkv.data(), 1, 2, 1, 1) == DT_HAL_OK);
  CHECK(aout == FVec{10.0f, 20.0f});
  CHECK(att == FVec{1.0f, 0.0f, 0.0f, 1.0f});
}

TEST_CASE("kernel: attention rejects NH not dividing C") {
  Dev d;
  FVec out(2 * 3 * 10), att(3 * 2 * 3 * 3), qkv(2 * 3 * 30);
  CHECK(d.t->attention_fwd(d.ctx, out.data(), att.data(), qkv.data(), 2, 3, 10, 3) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("NH = 3") != std::string::npos);
  CHECK(d.err().find("C = 10") != std::string::npos);
  CHECK(d.t->attention_bwd(d.ctx, qkv.data(), att.data(), out.data(), qkv.data(), att.data(), 2, 3,
                           10, 3) == DT_HAL_ERR_INVALID);
  CHECK(!d.err().empty());
  CHECK(d.t->attention_fwd(d.ctx, out.data(), att.data(), qkv.data(), 2, 3, 10, 0) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.t->attention_fwd(d.ctx, out.data(), nullptr, qkv.data(), 2, 3, 10, 2) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("att") != std::string::npos);
}

// ---- softmax cross-entropy ----------------------------------------------------------------------

TEST_CASE("kernel: softmax cross-entropy forward and backward") {
  Dev d;
  std::mt19937 rng(18);
  for (auto [N, V] : {std::pair<int64_t, int64_t>{5, 11}, {3, 50}}) {
    CAPTURE(V);
    FVec logits = rand_vec(rng, N * V, -3.0f, 3.0f);
    std::vector<int32_t> tgt(N);
    std::uniform_int_distribution<int32_t> td(0, int32_t(V) - 1);
    for (auto& x : tgt) x = td(rng);
    if (V == 50) {  // row 1: far-apart logits, the target's probability underflows float
      for (int64_t i = 0; i < V; ++i) logits[V + i] = -100.0f + 0.5f * logits[V + i];
      logits[V + 3] = 90.0f;
      tgt[1] = 7;
    }
    FVec losses(N), probs(N * V);
    REQUIRE(d.t->softmax_xent_fwd(d.ctx, losses.data(), probs.data(), logits.data(), tgt.data(), N,
                                  V) == DT_HAL_OK);
    auto row_loss = [&](const double* x, int32_t target) {
      double m = -1e300, z = 0;
      for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
      for (int64_t i = 0; i < V; ++i) z += std::exp(x[i] - m);
      return std::log(z) - (x[target] - m);
    };
    // Bound: the exponent argument x - max rounds once (u|x - max|); a probability moves by its
    // own argument's error plus the softmax-weighted mean of the others (<= the row's worst),
    // plus exp_approx (2u) and the normalisation sum of V terms ((V+2)u). The loss is
    // log(sum) - (x_t - max): the sum's relative error, plus u of |log sum|, |x_t - max|, |loss|.
    DVec rp(N * V), tp(N * V), rl(N), tl(N), relp(N);
    const DVec ld = to_d(logits);
    for (int64_t n = 0; n < N; ++n) {
      const double* x = ld.data() + n * V;
      double m = -1e300, z = 0, worst = 0;
      for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
      for (int64_t i = 0; i < V; ++i) {
        z += std::exp(x[i] - m);
        worst = std::max(worst, kU * std::fabs(x[i] - m));
      }
      relp[n] = 2 * (2 * worst + (V + 4) * kU);
      for (int64_t i = 0; i < V; ++i) {
        rp[n * V + i] = std::exp(x[i] - m) / z;
        tp[n * V + i] = relp[n] * rp[n * V + i] + kFlush;
      }
      rl[n] = row_loss(x, tgt[n]);
      tl[n] = 2 * (worst + (V + 3) * kU +
                   kU * (std::log(z) + std::fabs(x[tgt[n]] - m) + std::fabs(rl[n])));
    }
    expect_within("softmax_xent_fwd probs", probs, rp, tp);
    expect_within("softmax_xent_fwd losses", losses, rl, tl);
    CHECK(std::all_of(losses.begin(), losses.end(), [](float v) { return std::isfinite(v); }));

    // Backward: dlogits = (probs - onehot) dloss against finite differences of dloss * loss_n.
    const float dloss = 0.37f;
    FVec dlogits(N * V, std::nanf(""));
    REQUIRE(d.t->softmax_xent_bwd(d.ctx, dlogits.data(), probs.data(), tgt.data(), dloss, N, V) ==
            DT_HAL_OK);
    DVec g(N * V), tg(N * V);
    for (int64_t n = 0; n < N; ++n) {
      DVec row(ld.begin() + n * V, ld.begin() + (n + 1) * V);
      const DVec gr =
          fd_grad([&](const DVec& r) { return dloss * row_loss(r.data(), tgt[n]); }, row);
      for (int64_t i = 0; i < V; ++i) {
        g[n * V + i] = gr[i];
        // The kernel's probs carry relp; p - 1 and the product with dloss round once each.
        tg[n * V + i] =
            dloss * (relp[n] * rp[n * V + i] + 2 * kU * (rp[n * V + i] + 1.0)) + kFdSlack;
      }
    }
    expect_within("softmax_xent_bwd", dlogits, g, tg);
    FVec in_place = probs;  // dlogits == probs is allowed
    REQUIRE(d.t->softmax_xent_bwd(d.ctx, in_place.data(), in_place.data(), tgt.data(), dloss, N,
                                  V) == DT_HAL_OK);
    CHECK(in_place == dlogits);
  }
}

TEST_CASE("kernel: softmax cross-entropy rejects a bad target and names it") {
  Dev d;
  const int64_t N = 3, V = 4;
  FVec logits(N * V, 0.5f), probs(N * V), losses(N), dl(N * V);
  std::vector<int32_t> tgt = {0, 4, 1};
  CHECK(d.t->softmax_xent_fwd(d.ctx, losses.data(), probs.data(), logits.data(), tgt.data(), N,
                              V) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("target 4") != std::string::npos);
  CHECK(d.err().find("row 1") != std::string::npos);
  tgt[1] = -1;
  CHECK(d.t->softmax_xent_bwd(d.ctx, dl.data(), probs.data(), tgt.data(), 1.0f, N, V) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("target -1") != std::string::npos);
}

// ---- AdamW --------------------------------------------------------------------------------------

TEST_CASE("kernel: adamw matches a double reference over several steps") {
  Dev d;
  std::mt19937 rng(19);
  const int64_t n = 37;
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  FVec p = rand_vec(rng, n), m(n, 0.0f), v(n, 0.0f);
  for (int64_t t = 1; t <= 5; ++t) {
    CAPTURE(t);
    FVec g = rand_vec(rng, n, -2.0f, 2.0f);
    if (t == 3) g[0] = 0.0f;  // zero gradient: update from m alone
    // Reference in double from this step's float state (so each step is checked on its own).
    DVec rp(n), rm(n), rv(n), tp(n), tm(n), tv(n);
    const double bc1 = 1 - std::pow(double(b1), double(t)),
                 bc2 = 1 - std::pow(double(b2), double(t));
    for (int64_t i = 0; i < n; ++i) {
      rm[i] = b1 * double(m[i]) + (1 - double(b1)) * g[i];
      rv[i] = b2 * double(v[i]) + (1 - double(b2)) * double(g[i]) * g[i];
      const double mh = rm[i] / bc1, vh = rv[i] / bc2, upd = mh / (std::sqrt(vh) + eps);
      rp[i] = p[i] - lr * (upd + wd * double(p[i]));
      // m, v: two products and a sum (3u of the terms). The update: m and v's errors, the
      // bias corrections (float reciprocals, u each), sqrt, +eps and the division: 8u relative;
      // then the weight-decay term, lr and the subtraction: 3u of their magnitudes.
      tm[i] = 3 * kU * (std::fabs(b1 * m[i]) + std::fabs((1 - b1) * g[i]));
      tv[i] = 3 * kU * (std::fabs(b2 * v[i]) + std::fabs((1 - b2) * g[i] * g[i]));
      tp[i] = 2 * (kU * std::fabs(rp[i]) +
                   lr * (8 * kU * std::fabs(upd) + 3 * kU * std::fabs(wd * p[i])));
    }
    REQUIRE(d.t->adamw(d.ctx, p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, t) ==
            DT_HAL_OK);
    expect_within("adamw m", m, rm, tm);
    expect_within("adamw v", v, rv, tv);
    expect_within("adamw params", p, rp, tp);
  }
  CHECK(d.t->adamw(d.ctx, p.data(), p.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, 0) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("t = 0") != std::string::npos);
}

// ---- casts --------------------------------------------------------------------------------------

namespace {

uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_fbits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

TEST_CASE("kernel: bf16 casts match dt::bf16 (ties to even, NaN quiet, Inf, subnormals)") {
  Dev d;
  std::mt19937 rng(20);
  std::vector<uint32_t> pats = {
      0x00000000u, 0x80000000u,  // +-0
      0x7f800000u, 0xff800000u,  // +-Inf
      0x7fc00000u, 0xffc00000u,  // quiet NaN
      0x7f800001u, 0xff800001u,  // signalling NaN with only a low payload bit: must stay NaN
      0x7fa00000u,               // signalling NaN with a high payload bit
      0x7f7fffffu,               // FLT_MAX rounds up to Inf
      0x7f7f7fffu, 0x7f7f8000u,  // below / at the tie at the top of the range
      0x3f808000u, 0x3f818000u,  // ties: to even (down), to even (up)
      0x3f807fffu, 0x3f808001u,  // just below / above a tie
      0x00000001u, 0x00008000u, 0x00018000u, 0x807fffffu,  // subnormals and ties among them
      0x3f800000u, 0xbf800000u};
  for (int i = 0; i < 20000; ++i) pats.push_back(rng());
  FVec in(pats.size());
  for (size_t i = 0; i < pats.size(); ++i) in[i] = from_fbits(pats[i]);
  std::vector<uint16_t> out(in.size());
  REQUIRE(d.t->cast_f32_to_bf16(d.ctx, out.data(), in.data(), int64_t(in.size())) == DT_HAL_OK);
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = dt::bf16::from_float(in[i]);
    const bool nan_in = std::isnan(in[i]);
    const bool nan_ok = (out[i] & 0x7fffu) > 0x7f80u && (out[i] & 0x0040u) != 0;  // quiet NaN
    if (out[i] != want || (nan_in && !nan_ok)) {
      if (bad++ == 0) first = i;
    }
  }
  CHECK_MESSAGE(bad == 0, "f32->bf16: " << bad << " mismatches, first pattern 0x" << std::hex
                                        << pats[first] << " got 0x" << out[first]);
  CHECK(out[9] == 0x7f80u);  // FLT_MAX -> +Inf
  CHECK(out[12] == 0x3f80u);
  CHECK(out[13] == 0x3f82u);

  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  FVec back(65536);
  REQUIRE(d.t->cast_bf16_to_f32(d.ctx, back.data(), all.data(), 65536) == DT_HAL_OK);
  bad = 0;
  for (uint32_t i = 0; i < 65536; ++i)
    if (fbits(back[i]) != fbits(dt::bf16::to_float(uint16_t(i)))) ++bad;
  CHECK(bad == 0);
}
