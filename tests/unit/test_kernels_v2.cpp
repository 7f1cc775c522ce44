// Differential tests of the CPU device's version-2 and version-3 entries (hal/dt_hal_v2.h,
// hal/dt_hal_v3.h) against float64 references written here: casts between f32, bf16 and f16
// (bit-exact against a rounding done in double with nearbyint), gemm_ex for every pairing of
// operand and result types (first-order bound as in test_kernels.cpp: a float sum of K terms is
// within K u sum|terms|, doubled for second-order terms; a 16-bit result adds half an ulp of its
// format), scale_check_finite (bit-exact, plus the flag), adamw_multi (bit-exact against the
// version-1 adamw, which test_kernels.cpp checks against float64), attention with its products
// in bf16 and f16, and (version 4, at the end) attention that keeps the log-sum-exp.
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
#include <thread>
#include <tuple>
#include <vector>

#include "attention16_ref.hpp"
#include "cpu_device.h"
#include "dt/device.hpp"

namespace {

constexpr double kU = 0x1p-24;

struct Dev2 {
  const dt_hal_v2_t* t = dt_hal_cpu_v2();
  void* ctx = nullptr;
  Dev2() {
    REQUIRE(t != nullptr);
    REQUIRE(t->v1.api_version == DT_HAL_API_VERSION_2);
    REQUIRE(t->v1.open(0, &ctx) == DT_HAL_OK);
  }
  ~Dev2() { t->v1.close(ctx); }
  Dev2(const Dev2&) = delete;
  Dev2& operator=(const Dev2&) = delete;
  std::string err() const { return t->v1.last_error(ctx); }
};

struct Format {
  int p;      // significand bits, the implicit one included
  int emin;   // exponent of the smallest normal
  int emax;   // exponent of the largest finite
  int ebits;  // exponent field width
};
constexpr Format kBf16{8, -126, 127, 8};
constexpr Format kF16{11, -14, 15, 5};

// x rounded to the format, to nearest even, as a double (Inf beyond the range).
double round_to(double x, const Format& f) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int k = 0;
  std::frexp(x, &k);
  const int e = std::max(k - 1, f.emin);
  const double q = std::ldexp(1.0, e - (f.p - 1));
  const double r = std::nearbyint(x / q) * q;
  const double maxf = std::ldexp(2.0 - std::ldexp(1.0, 1 - f.p), f.emax);
  if (std::fabs(r) > maxf) return std::copysign(INFINITY, x);
  return r;
}

// Bits of a double that the format represents exactly (finite, or +-Inf).
uint16_t encode(double x, const Format& f) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const int mbits = f.p - 1;
  const uint16_t inf = static_cast<uint16_t>(((1u << f.ebits) - 1) << mbits);
  if (std::isinf(x)) return sign | inf;
  const double a = std::fabs(x);
  if (a == 0) return sign;
  int k = 0;
  std::frexp(a, &k);
  const int e = k - 1;
  if (e < f.emin)  // subnormal: a = m * 2^(emin - mbits)
    return sign | static_cast<uint16_t>(std::ldexp(a, -(f.emin - mbits)));
  const int bias = (1 << (f.ebits - 1)) - 1;
  const auto m = static_cast<uint16_t>(std::ldexp(a, mbits - e) - std::ldexp(1.0, mbits));
  return sign | static_cast<uint16_t>((e + bias) << mbits) | m;
}

double decode(uint16_t h, const Format& f) {
  const int mbits = f.p - 1;
  const int bias = (1 << (f.ebits - 1)) - 1;
  const int e = (h >> mbits) & ((1 << f.ebits) - 1);
  const int m = h & ((1 << mbits) - 1);
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == (1 << f.ebits) - 1) return m ? NAN : s * INFINITY;
  if (e == 0) return s * std::ldexp(m, f.emin - mbits);
  return s * std::ldexp(1.0 + std::ldexp(m, -mbits), e - bias);
}

bool is_nan16(uint16_t h, const Format& f) {
  const int mbits = f.p - 1;
  const int e = (h >> mbits) & ((1 << f.ebits) - 1);
  return e == (1 << f.ebits) - 1 && (h & ((1 << mbits) - 1)) != 0;
}

float f_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t u_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Floats that exercise every rounding path of both formats.
std::vector<float> cast_inputs() {
  std::mt19937 rng(7);
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65519.99f,
                          65520.0f,
                          -65520.0f,
                          1e30f,
                          -3e38f,
                          INFINITY,
                          -INFINITY,
                          NAN,
                          -NAN,
                          std::numeric_limits<float>::denorm_min(),
                          1e-40f,
                          0x1p-14f,
                          0x1p-24f,
                          0x1p-25f,
                          0x1.8p-25f,
                          0x1p-26f,
                          0x1.ffcp-15f,
                          3.3895314e38f,
                          f_of(0x3f808000u),
                          f_of(0x3f818000u),
                          f_of(0x3f80ffffu),
                          f_of(0x7f7fffffu),
                          f_of(0x7f7f8000u),
                          f_of(0x3f801000u),
                          f_of(0x3f803000u)};
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-30, 20);
  for (int i = 0; i < 3000; ++i) v.push_back(std::ldexp(unit(rng), ex(rng)));
  for (int i = 0; i < 3000; ++i) v.push_back(f_of(bits(rng)));
  return v;
}

}  // namespace

TEST_CASE("v2 cast: f32 -> bf16 and f16 round to nearest even, bit-exact") {
  Dev2 d;
  const std::vector<float> in = cast_inputs();
  const auto n = static_cast<int64_t>(in.size());
  for (const auto& [type, fmt, label] :
       {std::tuple{DT_HAL_BF16, kBf16, "bf16"}, std::tuple{DT_HAL_F16, kF16, "f16"}}) {
    const char* fmt_name = label;
    CAPTURE(fmt_name);
    std::vector<uint16_t> out(in.size());
    REQUIRE(d.t->cast(d.ctx, out.data(), type, in.data(), DT_HAL_F32, n) == DT_HAL_OK);
    size_t bad = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      const double x = in[i];
      bool ok;
      if (std::isnan(x))
        ok = is_nan16(out[i], fmt) && ((out[i] & 0x8000) != 0) == std::signbit(x);
      else
        ok = out[i] == encode(round_to(x, fmt), fmt);
      if (!ok && bad++ < 5) {
        std::ostringstream os;
        os << fmt_name << ": input " << in[i] << " (0x" << std::hex << u_of(in[i]) << ") gave 0x"
           << out[i] << ", reference 0x" << encode(round_to(x, fmt), fmt);
        FAIL_CHECK(os.str());
      }
    }
    CHECK(bad == 0);
    // Back to f32 is exact.
    std::vector<float> back(in.size());
    REQUIRE(d.t->cast(d.ctx, back.data(), DT_HAL_F32, out.data(), type, n) == DT_HAL_OK);
    bad = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      const double ref = decode(out[i], fmt);
      const bool ok = std::isnan(ref) ? std::isnan(back[i])
                                      : static_cast<double>(back[i]) == ref &&
                                            std::signbit(back[i]) == ((out[i] & 0x8000) != 0);
      if (!ok) ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("v2 cast: bf16 <-> f16 rounds once, in place too") {
  Dev2 d;
  std::vector<uint16_t> h;
  for (uint32_t b = 0; b < 65536; b += 3) h.push_back(static_cast<uint16_t>(b));
  const auto n = static_cast<int64_t>(h.size());
  for (const auto& [from, ff, to, tf] : {std::tuple{DT_HAL_F16, kF16, DT_HAL_BF16, kBf16},
                                         std::tuple{DT_HAL_BF16, kBf16, DT_HAL_F16, kF16}}) {
    std::vector<uint16_t> out(h.size()), inplace = h;
    REQUIRE(d.t->cast(d.ctx, out.data(), to, h.data(), from, n) == DT_HAL_OK);
    REQUIRE(d.t->cast(d.ctx, inplace.data(), to, inplace.data(), from, n) == DT_HAL_OK);
    size_t bad = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      const double x = decode(h[i], ff);
      const bool ok = std::isnan(x) ? is_nan16(out[i], tf) : out[i] == encode(round_to(x, tf), tf);
      if (!ok || out[i] != inplace[i]) ++bad;
    }
    CHECK(bad == 0);
  }
  std::vector<uint16_t> same(h.size());
  REQUIRE(d.t->cast(d.ctx, same.data(), DT_HAL_F16, h.data(), DT_HAL_F16, n) == DT_HAL_OK);
  CHECK(same == h);
  CHECK(d.t->cast(d.ctx, same.data(), static_cast<dt_hal_dtype>(7), h.data(), DT_HAL_F16, n) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("unknown dtype") != std::string::npos);
}

TEST_CASE("v2 gemm_ex: every operand/result type pairing within the fp32-accumulation bound") {
  Dev2 d;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const dt_hal_dtype types[] = {DT_HAL_F32, DT_HAL_BF16, DT_HAL_F16};
  const Format* fmts[] = {nullptr, &kBf16, &kF16};
  const int64_t M = 7, N = 19, K = 37;  // K crosses OpenBLAS's inner blocks only a little
  for (int ab = 0; ab < 3; ++ab)
    for (int c = 0; c < 3; ++c)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (float beta : {0.0f, 0.75f}) {
            CAPTURE(ab);
            CAPTURE(c);
            CAPTURE(ta);
            CAPTURE(tb);
            CAPTURE(beta);
            const int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
            const int64_t lda = ac + 3, ldb = bc + 1, ldc = N + 2;
            // Values as the operand type holds them, and their exact doubles.
            auto make = [&](int64_t rows, int64_t ld, int type, std::vector<double>& exact) {
              std::vector<uint8_t> raw(static_cast<size_t>(rows * ld) * (type ? 2 : 4));
              exact.assign(static_cast<size_t>(rows * ld), 0.0);
              for (int64_t i = 0; i < rows * ld; ++i) {
                const float x = u(rng);
                if (type == 0) {
                  std::memcpy(raw.data() + i * 4, &x, 4);
                  exact[i] = x;
                } else {
                  const uint16_t h = encode(round_to(x, *fmts[type]), *fmts[type]);
                  std::memcpy(raw.data() + i * 2, &h, 2);
                  exact[i] = decode(h, *fmts[type]);
                }
              }
              return raw;
            };
            std::vector<double> ea, eb, ec;
            auto A = make(ar, lda, ab, ea);
            auto B = make(br, ldb, ab, eb);
            auto C = make(M, ldc, c, ec);
            if (beta == 0.0f)  // beta = 0 must ignore C, NaN included
              for (int64_t i = 0; i < M * ldc; ++i) {
                const float q = NAN;
                const uint16_t qh = 0x7e00;
                if (c == 0)
                  std::memcpy(C.data() + i * 4, &q, 4);
                else
                  std::memcpy(C.data() + i * 2, &qh, 2);
              }
            const float alpha = 1.25f;
            REQUIRE_MESSAGE(
                d.t->gemm_ex(d.ctx, ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta,
                             C.data(), ldc, types[ab], types[c]) == DT_HAL_OK,
                d.err());
            size_t bad = 0;
            for (int64_t i = 0; i < M; ++i)
              for (int64_t j = 0; j < N; ++j) {
                double ref = 0, mag = 0;
                for (int64_t k = 0; k < K; ++k) {
                  const double a = ta ? ea[k * lda + i] : ea[i * lda + k];
                  const double b = tb ? eb[j * ldb + k] : eb[k * ldb + j];
                  ref += a * b;
                  mag += std::fabs(a * b);
                }
                ref *= alpha;
                mag *= std::fabs(alpha);
                if (beta != 0.0f) {
                  ref += beta * ec[i * ldc + j];
                  mag += std::fabs(beta * ec[i * ldc + j]);
                }
                double tol = 2.0 * (K + 3) * kU * mag;
                double got;
                if (c == 0) {
                  float g;
                  std::memcpy(&g, C.data() + (i * ldc + j) * 4, 4);
                  got = g;
                } else {
                  uint16_t g;
                  std::memcpy(&g, C.data() + (i * ldc + j) * 2, 2);
                  got = decode(g, *fmts[c]);
                  const double uc = std::ldexp(1.0, -fmts[c]->p);
                  tol = tol * (1 + uc) + uc * std::fabs(ref) + std::ldexp(1.0, -25);
                }
                if (!(std::fabs(got - ref) <= tol) && bad++ < 3)
                  FAIL_CHECK("C[", i, ",", j, "] = ", got, ", reference ", ref, ", tolerance ",
                             tol);
              }
            CHECK(bad == 0);
            // The padding between rows of C is left alone.
            if (c != 0) {
              uint16_t pad;
              std::memcpy(&pad, C.data() + (0 * ldc + N) * 2, 2);
              if (beta == 0.0f) CHECK(pad == 0x7e00);
            }
          }
  CHECK(d.t->gemm_ex(d.ctx, 0, 0, 2, 2, 2, 1.0f, nullptr, 1, nullptr, 2, 0.0f, nullptr, 2,
                     DT_HAL_BF16, DT_HAL_F32) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("gemm_ex: lda = 1 < 2") != std::string::npos);
}

TEST_CASE("v2 scale_check_finite: exact products, the flag set by Inf, NaN and overflow only") {
  Dev2 d;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{16}, int64_t{61}}) {
    CAPTURE(n);
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = u(rng);
    const std::vector<float> x0 = x;
    int32_t flag = 0;
    REQUIRE(d.t->scale_check_finite(d.ctx, x.data(), n, 0.0078125f / 3, &flag) == DT_HAL_OK);
    CHECK(flag == 0);
    for (size_t i = 0; i < x.size(); ++i)
      CHECK(x[i] == static_cast<float>(static_cast<double>(x0[i]) * (0.0078125f / 3)));
    flag = 1;  // never cleared
    REQUIRE(d.t->scale_check_finite(d.ctx, x.data(), n, 1.0f, &flag) == DT_HAL_OK);
    CHECK(flag == 1);
    if (n == 0) continue;
    for (float bad : {INFINITY, -INFINITY, NAN, 3e38f}) {
      for (int64_t pos : {int64_t{0}, n - 1}) {
        std::vector<float> y = x0;
        y[static_cast<size_t>(pos)] = bad;
        flag = 0;
        REQUIRE(d.t->scale_check_finite(d.ctx, y.data(), n, 2.0f, &flag) == DT_HAL_OK);
        CHECK_MESSAGE(flag == 1, "value ", bad, " at ", pos);
        CHECK(y[n > 1 && pos == 0 ? 1 : 0] == x0[n > 1 && pos == 0 ? 1 : 0] * 2.0f);
      }
    }
  }
  CHECK(d.t->scale_check_finite(d.ctx, nullptr, 0, 1.0f, nullptr) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("found_inf is null") != std::string::npos);
}

TEST_CASE("v2 adamw_multi: the same bits as the version-1 adamw per tensor") {
  Dev2 d;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const std::vector<int64_t> sizes = {17, 0, 40, 1};
  const std::vector<float> wd = {0.1f, 0.1f, 0.0f, 0.3f};
  std::vector<std::vector<float>> p, g, m, v;
  for (int64_t s : sizes) {
    auto r = [&] {
      std::vector<float> x(static_cast<size_t>(s));
      for (auto& e : x) e = u(rng);
      return x;
    };
    p.push_back(r());
    g.push_back(r());
    m.push_back(r());
    auto vv = r();
    for (auto& e : vv) e = std::fabs(e);
    v.push_back(vv);
  }
  auto p1 = p, m1 = m, v1 = v;
  std::vector<float*> pp, mp, vp;
  std::vector<const float*> gp;
  for (size_t k = 0; k < sizes.size(); ++k) {
    pp.push_back(p[k].data());
    gp.push_back(g[k].data());
    mp.push_back(m[k].data());
    vp.push_back(v[k].data());
  }
  for (int64_t t = 1; t <= 3; ++t) {
    REQUIRE(d.t->adamw_multi(d.ctx, 4, pp.data(), gp.data(), mp.data(), vp.data(), sizes.data(),
                             wd.data(), 1e-2f, 0.9f, 0.95f, 1e-8f, t) == DT_HAL_OK);
    for (size_t k = 0; k < sizes.size(); ++k)
      REQUIRE(d.t->v1.adamw(d.ctx, p1[k].data(), g[k].data(), m1[k].data(), v1[k].data(), sizes[k],
                            1e-2f, 0.9f, 0.95f, 1e-8f, wd[k], t) == DT_HAL_OK);
  }
  CHECK(p == p1);
  CHECK(m == m1);
  CHECK(v == v1);
  // A bad tensor is found before anything is written.
  std::vector<int64_t> bad_sizes = sizes;
  bad_sizes[2] = -1;
  REQUIRE(d.t->adamw_multi(d.ctx, 4, pp.data(), gp.data(), mp.data(), vp.data(), bad_sizes.data(),
                           wd.data(), 1e-2f, 0.9f, 0.95f, 1e-8f, 4) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("sizes[2] = -1") != std::string::npos);
  CHECK(p == p1);
  CHECK(d.t->adamw_multi(d.ctx, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1e-2f,
                         0.9f, 0.95f, 1e-8f, 1) == DT_HAL_OK);
}

TEST_CASE("v2 through dt::Device: the built-in CPU has every training kernel in every dtype") {
  dt::Device dev = dt::Device::open("cpu", "");
  CHECK(dev.abi_version() == 4);
  for (dt::DType t : {dt::DType::f32, dt::DType::bf16, dt::DType::f16}) {
    CHECK(dt::missing_training_kernels(dev, t).empty());
    CHECK_NOTHROW(dt::require_training_kernels(dev, t));
    CHECK(dt::missing_training_kernels(dev, t, true).empty());  // graph capture too
  }
  CHECK_THROWS_AS(dt::require_training_kernels(dev, dt::DType::i32), dt::InvalidArgument);
  CHECK(dt::hal_dtype(dt::DType::bf16) == DT_HAL_BF16);
  CHECK_THROWS_AS(dt::hal_dtype(dt::DType::f64), dt::InvalidArgument);
  float x[3] = {1, 2, 3};
  int32_t flag = 0;
  dev.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", x, int64_t{3}, 0.5f, &flag);
  CHECK(x[2] == 1.5f);
  CHECK(flag == 0);
  CHECK(dev.describe().find("CPU") != std::string::npos);
}

TEST_CASE("v2 graphs: a capture records instead of running; each launch replays it") {
  Dev2 d;
  const auto& v1 = d.t->v1;
  std::vector<float> a = {1, 2, 3, 4}, b = {10, 20, 30, 40}, c(4, 0.0f);
  void* s = nullptr;
  REQUIRE(d.t->stream_create(d.ctx, &s) == DT_HAL_OK);
  REQUIRE(d.t->set_stream(d.ctx, s) == DT_HAL_OK);
  REQUIRE(d.t->graph_begin(d.ctx) == DT_HAL_OK);
  CHECK(d.t->graph_begin(d.ctx) == DT_HAL_ERR_INVALID);  // one capture at a time
  // c = 2 * (a + b), then a copied over b: nothing happens until the graph runs.
  REQUIRE(v1.add(d.ctx, c.data(), a.data(), b.data(), 4) == DT_HAL_OK);
  REQUIRE(v1.scale(d.ctx, c.data(), 2.0f, 4) == DT_HAL_OK);
  REQUIRE(v1.copy(d.ctx, b.data(), a.data(), 4 * sizeof(float), DT_HAL_DEVICE_TO_DEVICE) ==
          DT_HAL_OK);
  // Arrays of pointers are host memory read by the call: the graph keeps its own copies.
  std::vector<float> p = {1.0f}, g = {0.5f}, m = {0.0f}, v = {0.0f};
  float* P[1] = {p.data()};
  const float* G[1] = {g.data()};
  float* M[1] = {m.data()};
  float* V[1] = {v.data()};
  int64_t S[1] = {1};
  float W[1] = {0.0f};
  REQUIRE(d.t->adamw_multi(d.ctx, 1, P, G, M, V, S, W, 0.1f, 0.9f, 0.999f, 1e-8f, 1) == DT_HAL_OK);
  P[0] = nullptr;
  S[0] = -1;
  CHECK(c == std::vector<float>(4, 0.0f));
  CHECK(b == std::vector<float>({10, 20, 30, 40}));
  CHECK(p[0] == 1.0f);
  void* graph = nullptr;
  REQUIRE(d.t->graph_end(d.ctx, &graph) == DT_HAL_OK);
  REQUIRE(graph != nullptr);
  CHECK(c == std::vector<float>(4, 0.0f));
  REQUIRE(d.t->graph_launch(d.ctx, graph) == DT_HAL_OK);
  CHECK(c == std::vector<float>({22, 44, 66, 88}));
  CHECK(b == a);
  CHECK(p[0] < 1.0f);  // one AdamW step moved it against the gradient
  const float p1 = p[0];
  // The second launch reads the buffers as they are now: b holds a's values.
  REQUIRE(d.t->graph_launch(d.ctx, graph) == DT_HAL_OK);
  CHECK(c == std::vector<float>({4, 8, 12, 16}));
  CHECK(p[0] < p1);
  // Eager calls after the capture run at once again.
  REQUIRE(v1.scale(d.ctx, c.data(), 0.5f, 4) == DT_HAL_OK);
  CHECK(c == std::vector<float>({2, 4, 6, 8}));
  d.t->graph_destroy(d.ctx, graph);
  d.t->stream_destroy(d.ctx, s);
}

TEST_CASE("v2 graphs: host memory, waits and allocation invalidate the capture, naming the call") {
  Dev2 d;
  const auto& v1 = d.t->v1;
  std::vector<float> x = {1, 2, 3}, y(3);
  double ss = 0;
  void* ptr = nullptr;
  void* graph = nullptr;
  struct Case {
    const char* name;
    std::function<int()> call;
  };
  const std::vector<Case> cases = {
      {"copy cannot be captured into a graph: it reads host memory",
       [&] { return v1.copy(d.ctx, y.data(), x.data(), 12, DT_HAL_HOST_TO_DEVICE); }},
      {"copy cannot be captured into a graph: it writes host memory",
       [&] { return v1.copy(d.ctx, y.data(), x.data(), 12, DT_HAL_DEVICE_TO_HOST); }},
      {"sum_squares cannot be captured", [&] { return v1.sum_squares(d.ctx, x.data(), 3, &ss); }},
      {"synchronize cannot be captured", [&] { return v1.synchronize(d.ctx); }},
      {"alloc cannot be captured", [&] { return v1.alloc(d.ctx, 64, &ptr); }},
      {"event_synchronize cannot be captured",
       [&] {
         void* ev = nullptr;
         d.t->event_create(d.ctx, &ev);
         return d.t->event_synchronize(d.ctx, ev);
       }},
  };
  for (const Case& k : cases) {
    CAPTURE(k.name);
    REQUIRE(d.t->graph_begin(d.ctx) == DT_HAL_OK);
    REQUIRE(v1.scale(d.ctx, x.data(), 2.0f, 3) == DT_HAL_OK);
    CHECK(k.call() == DT_HAL_ERR_UNSUPPORTED);
    CHECK(d.err().find(k.name) != std::string::npos);
    CHECK(ss == 0.0);
    CHECK(ptr == nullptr);
    CHECK(d.t->graph_end(d.ctx, &graph) == DT_HAL_ERR_UNSUPPORTED);
    CHECK(graph == nullptr);
    CHECK(d.err().find("graph_end: the capture was invalidated") != std::string::npos);
    CHECK(d.err().find(k.name) != std::string::npos);
    CHECK(x == std::vector<float>({1, 2, 3}));  // the recorded scale never ran
  }
  // After a failed capture the device works eagerly and captures again.
  CHECK(v1.sum_squares(d.ctx, x.data(), 3, &ss) == DT_HAL_OK);
  CHECK(ss == 14.0);
  CHECK(d.t->graph_end(d.ctx, &graph) == DT_HAL_ERR_INVALID);  // no capture in progress
  REQUIRE(d.t->graph_begin(d.ctx) == DT_HAL_OK);
  REQUIRE(v1.scale(d.ctx, x.data(), 2.0f, 3) == DT_HAL_OK);
  REQUIRE(d.t->graph_end(d.ctx, &graph) == DT_HAL_OK);
  REQUIRE(d.t->graph_launch(d.ctx, graph) == DT_HAL_OK);
  CHECK(x == std::vector<float>({2, 4, 6}));
  d.t->graph_destroy(d.ctx, graph);
}

TEST_CASE(
    "v2 graphs: a bad argument fails the launch with the entry's message; other threads run") {
  Dev2 d;
  const auto& v1 = d.t->v1;
  std::vector<float> x = {1, 2, 3};
  REQUIRE(d.t->graph_begin(d.ctx) == DT_HAL_OK);
  REQUIRE(v1.scale(d.ctx, x.data(), 2.0f, 3) == DT_HAL_OK);
  REQUIRE(v1.scale(d.ctx, x.data(), 2.0f, -5) == DT_HAL_OK);  // checked when it runs
  // Work from another thread is not captured (CUDA's thread-local capture mode).
  std::vector<float> other = {5};
  std::thread([&] { CHECK(v1.scale(d.ctx, other.data(), 3.0f, 1) == DT_HAL_OK); }).join();
  CHECK(other[0] == 15.0f);
  void* graph = nullptr;
  REQUIRE(d.t->graph_end(d.ctx, &graph) == DT_HAL_OK);
  CHECK(d.t->graph_launch(d.ctx, graph) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("graph_launch: call 2 of 2 failed: scale: n = -5 is negative") !=
        std::string::npos);
  CHECK(x == std::vector<float>({2, 4, 6}));  // call 1 ran
  CHECK(d.t->graph_launch(d.ctx, nullptr) == DT_HAL_ERR_INVALID);
  d.t->graph_destroy(d.ctx, graph);
}

TEST_CASE("v2 graphs: the scratch memory does not grow while a graph lives, as on a GPU") {
  // gemm_ex widens 16-bit operands into the context's scratch. A CUDA graph holds the scratch
  // pointer it was captured with, so growing (freeing) it while a graph lives is refused; the CPU
  // device keeps the rule, so a capture order that would fail on a GPU fails here too.
  Dev2 d;
  auto gemm16 = [&](int64_t n) {  // C[n, n] = A B, bf16 operands of ones: a sum of n ones
    std::vector<std::uint16_t> a(static_cast<std::size_t>(n * n), 0x3f80);
    std::vector<float> c(static_cast<std::size_t>(n * n), -1.0f);
    const int st = d.t->gemm_ex(d.ctx, 0, 0, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f,
                                c.data(), n, DT_HAL_BF16, DT_HAL_F32);
    if (st == DT_HAL_OK) CHECK(c[0] == static_cast<float>(n));
    return st;
  };
  REQUIRE(gemm16(8) == DT_HAL_OK);  // grows the scratch to 8 x 8 operands
  void* graph = nullptr;
  REQUIRE(d.t->graph_begin(d.ctx) == DT_HAL_OK);
  REQUIRE(d.t->graph_end(d.ctx, &graph) == DT_HAL_OK);
  CHECK(gemm16(8) == DT_HAL_OK);  // the size it has
  CHECK(gemm16(4) == DT_HAL_OK);
  CHECK(gemm16(16) == DT_HAL_ERR_UNSUPPORTED);
  CHECK(d.err().find("gemm_ex: this call needs") != std::string::npos);
  CHECK(d.err().find("more than a live graph was captured with") != std::string::npos);
  d.t->graph_destroy(d.ctx, graph);
  CHECK(gemm16(16) == DT_HAL_OK);  // no graph lives: it grows
}

// ---- version 3: attention with its products in a 16-bit type ----------------------------------

namespace {

struct Dev3 {
  const dt_hal_v3_t* t = dt_hal_cpu_v3();
  void* ctx = nullptr;
  Dev3() {
    REQUIRE(t != nullptr);
    REQUIRE(t->v2.v1.api_version == DT_HAL_API_VERSION_3);
    REQUIRE(t->v2.v1.open(0, &ctx) == DT_HAL_OK);
  }
  ~Dev3() { t->v2.v1.close(ctx); }
  Dev3(const Dev3&) = delete;
  Dev3& operator=(const Dev3&) = delete;
};

std::vector<float> rand_f(std::mt19937& rng, std::size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

std::vector<float> rounded(const std::vector<float>& v, const Format& f) {
  std::vector<float> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<float>(round_to(v[i], f));
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Elements of got outside ref +- tol; names the first few (unless quiet).
std::size_t outside(const std::string& what, const std::vector<float>& got,
                    const std::vector<double>& ref, const std::vector<double>& tol,
                    bool quiet = false) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - ref[i]) <= tol[i]) && bad++ < 5 && !quiet)
      MESSAGE(what << "[" << i << "] = " << got[i] << ", reference " << ref[i] << " +- " << tol[i]);
  return bad;
}

}  // namespace

// The 16-bit forms against references built from the operands the kernel must have used: the
// probabilities (forward) and the softmax gradient (backward) the kernel itself returns in att and
// scratch, rounded here, and qkv and dout rounded here. What is then left is fp32 accumulation:
// a float sum of n terms is within n u sum|terms| of the exact one (doubled, plus u of the value
// accumulated onto). The scores take rounded q and k, so att equals the fp32 kernel's att on a
// rounded qkv, bit for bit; the F32 form is the version-1 entry, bit for bit.
TEST_CASE("v3 attention_fwd_ex / attention_bwd_ex: products on rounded operands, fp32 elsewhere") {
  Dev3 d;
  std::mt19937 rng(31);
  const dt_hal_v1_t& v1 = d.t->v2.v1;
  struct Shape {
    int64_t B, T, C, NH;
  };
  for (Shape sh : {Shape{2, 7, 12, 3}, Shape{1, 37, 8, 2}}) {
    for (auto [type, fmt] :
         {std::pair<dt_hal_dtype, Format>{DT_HAL_BF16, kBf16}, {DT_HAL_F16, kF16}}) {
      const int64_t B = sh.B, T = sh.T, C = sh.C, NH = sh.NH, C3 = 3 * C;
      CAPTURE(T);
      CAPTURE(static_cast<int>(type));
      const auto qkv = rand_f(rng, B * T * C3, -1.5f, 1.5f);
      const auto q16 = rounded(qkv, fmt);
      std::vector<float> out(B * T * C), att(B * NH * T * T);
      REQUIRE(d.t->attention_fwd_ex(d.ctx, out.data(), att.data(), qkv.data(), B, T, C, NH, type) ==
              DT_HAL_OK);
      // att: the fp32 kernel's on the rounded qkv.
      std::vector<float> out32(B * T * C), att32(B * NH * T * T);
      REQUIRE(v1.attention_fwd(d.ctx, out32.data(), att32.data(), q16.data(), B, T, C, NH) ==
              DT_HAL_OK);
      CHECK(same_bits(att, att32));
      // out = rounded(att) rounded(v), accumulated in fp32.
      const auto a16 = rounded(att, fmt);
      const dt_test::AttnShape shape{B, T, C, NH};
      std::vector<double> ref, tol;
      dt_test::attn16_out_ref(shape, q16, a16, ref, tol);
      CHECK(outside("attention_fwd_ex out", out, ref, tol) == 0);
      // The rounding is real: the fp32 products on the same rounded qkv give another out.
      CHECK(outside("fp32 out", out32, ref, tol, true) > 0);

      // Backward.
      const auto dout = rand_f(rng, B * T * C, -1.0f, 1.0f);
      const auto o16 = rounded(dout, fmt);
      const auto dqkv0 = rand_f(rng, B * T * C3, -1.0f, 1.0f);
      auto dqkv = dqkv0;
      std::vector<float> scr(B * NH * T * T, std::nanf(""));
      REQUIRE(d.t->attention_bwd_ex(d.ctx, dqkv.data(), scr.data(), dout.data(), qkv.data(),
                                    att.data(), B, T, C, NH, type) == DT_HAL_OK);
      // The softmax gradient the kernel used, from the fp32 att: its fp32 value is within e32 of
      // the exact one, and rounding it adds half an ulp at |value| + e32.
      std::vector<double> sref, stol;
      dt_test::attn16_sgrad_ref(shape, q16, o16, att, sref, stol);
      for (std::size_t k = 0; k < stol.size(); ++k)
        stol[k] += dt_test::format_ulp(std::fabs(sref[k]) + stol[k], fmt.p, fmt.emin) / 2;
      CHECK(outside("attention_bwd_ex softmax gradient", scr, sref, stol) == 0);
      for (std::size_t k = 0; k < scr.size(); ++k)  // it is rounded
        if (round_to(scr[k], fmt) != double(scr[k])) {
          FAIL_CHECK("scratch[" << k << "] = " << scr[k] << " is not a 16-bit value");
          break;
        }
      // dq += S' k, dk += S'^T q, dv += rounded(att)^T dout, on rounded operands.
      const auto s16 = rounded(scr, fmt);  // the same values (checked just above)
      std::vector<double> gref, gtol;
      dt_test::attn16_dqkv_ref(shape, q16, o16, a16, s16, dqkv0, gref, gtol);
      CHECK(outside("attention_bwd_ex dqkv", dqkv, gref, gtol) == 0);
    }
  }
  // F32 is the version-1 entry, bit for bit.
  const int64_t B = 2, T = 9, C = 8, NH = 2;
  const auto qkv = rand_f(rng, B * T * 3 * C, -1.0f, 1.0f);
  std::vector<float> o1(B * T * C), a1(B * NH * T * T), o2(o1.size()), a2(a1.size());
  REQUIRE(v1.attention_fwd(d.ctx, o1.data(), a1.data(), qkv.data(), B, T, C, NH) == DT_HAL_OK);
  REQUIRE(d.t->attention_fwd_ex(d.ctx, o2.data(), a2.data(), qkv.data(), B, T, C, NH, DT_HAL_F32) ==
          DT_HAL_OK);
  CHECK(same_bits(o1, o2));
  CHECK(same_bits(a1, a2));
  const auto dout = rand_f(rng, B * T * C, -1.0f, 1.0f);
  std::vector<float> g1(qkv.size(), 0.0f), g2(qkv.size(), 0.0f), s1(a1.size()), s2(a1.size());
  REQUIRE(v1.attention_bwd(d.ctx, g1.data(), s1.data(), dout.data(), qkv.data(), a1.data(), B, T, C,
                           NH) == DT_HAL_OK);
  REQUIRE(d.t->attention_bwd_ex(d.ctx, g2.data(), s2.data(), dout.data(), qkv.data(), a1.data(), B,
                                T, C, NH, DT_HAL_F32) == DT_HAL_OK);
  CHECK(same_bits(g1, g2));
  // A bad dtype and bad shapes are refused with the entry's name.
  CHECK(d.t->attention_fwd_ex(d.ctx, o2.data(), a2.data(), qkv.data(), B, T, C, NH,
                              static_cast<dt_hal_dtype>(7)) == DT_HAL_ERR_INVALID);
  CHECK(std::string(v1.last_error(d.ctx)).find("attention_fwd_ex: unknown dtype 7") !=
        std::string::npos);
  CHECK(d.t->attention_bwd_ex(d.ctx, g2.data(), s2.data(), dout.data(), qkv.data(), a1.data(), B, T,
                              C, 3, DT_HAL_BF16) == DT_HAL_ERR_INVALID);
}

// ---- version 4: attention that keeps the log-sum-exp --------------------------------------------

namespace {

struct Dev4 {
  const dt_hal_v4_t* t = dt_hal_cpu_v4();
  void* ctx = nullptr;
  Dev4() {
    REQUIRE(t != nullptr);
    REQUIRE(t->v3.v2.v1.api_version == DT_HAL_API_VERSION_4);
    REQUIRE(t->v3.v2.v1.open(0, &ctx) == DT_HAL_OK);
  }
  ~Dev4() { t->v3.v2.v1.close(ctx); }
  Dev4(const Dev4&) = delete;
  Dev4& operator=(const Dev4&) = delete;
  std::string err() const { return t->v3.v2.v1.last_error(ctx); }
};

}  // namespace

// flash_attention_fwd is attention_fwd_ex without the probabilities: the same out, bit for bit,
// and lse against float64; flash_attention_bwd against the float64 gradient of the rounded
// operands (dt_test::flash_ref), with out passed in fp32 and, for a 16-bit type, rounded; in fp32
// also against the version-1 attention_bwd (tested in test_kernels.cpp against finite differences).
TEST_CASE("v4 flash_attention_fwd / flash_attention_bwd against attention_fwd_ex and float64") {
  Dev4 d;
  std::mt19937 rng(47);
  const dt_hal_v1_t& v1 = d.t->v3.v2.v1;
  struct Case {
    dt_hal_dtype type;
    Format fmt;
    double uh;  // unit roundoff of the products' operands (0: fp32)
  };
  // (The last two: heads wider than a row block of scores, 32 x T floats: T 1 with head size
  // 64, T 2 with 128; the backward wrote out's row past its scratch there.)
  for (auto sh : {dt_test::AttnShape{2, 7, 12, 3}, dt_test::AttnShape{1, 70, 16, 2},
                  dt_test::AttnShape{1, 33, 8, 1}, dt_test::AttnShape{1, 1, 64, 1},
                  dt_test::AttnShape{2, 2, 256, 2}}) {
    for (const Case& k : {Case{DT_HAL_F32, kBf16, 0.0}, Case{DT_HAL_BF16, kBf16, 0x1p-8},
                          Case{DT_HAL_F16, kF16, 0x1p-11}}) {
      const int64_t B = sh.B, T = sh.T, C = sh.C, NH = sh.NH, C3 = 3 * C;
      CAPTURE(T);
      CAPTURE(static_cast<int>(k.type));
      const bool r16 = k.type != DT_HAL_F32;
      const auto qkv = rand_f(rng, B * T * C3, -2.0f, 2.0f);
      const auto q16 = r16 ? rounded(qkv, k.fmt) : qkv;
      std::vector<float> out(B * T * C), lse(B * NH * T), ox(out.size()), att(B * NH * T * T);
      REQUIRE(d.t->flash_attention_fwd(d.ctx, out.data(), lse.data(), qkv.data(), B, T, C, NH,
                                       k.type) == DT_HAL_OK);
      REQUIRE(d.t->v3.attention_fwd_ex(d.ctx, ox.data(), att.data(), qkv.data(), B, T, C, NH,
                                       k.type) == DT_HAL_OK);
      CHECK(same_bits(out, ox));
      const auto dout = rand_f(rng, B * T * C, -1.0f, 1.0f);
      const auto o16 = r16 ? rounded(dout, k.fmt) : dout;
      const auto dqkv0 = rand_f(rng, B * T * C3, -1.0f, 1.0f);
      for (const bool out16 : {false, true}) {
        if (out16 && !r16) continue;
        CAPTURE(out16);
        // out as the caller keeps it: fp32, or its 16-bit rounding (bits).
        std::vector<uint16_t> out_bits(out.size());
        if (out16)
          REQUIRE(d.t->v3.v2.cast(d.ctx, out_bits.data(), k.type, out.data(), DT_HAL_F32,
                                  static_cast<int64_t>(out.size())) == DT_HAL_OK);
        const auto ow = out16 ? rounded(out, k.fmt) : out;
        const dt_test::FlashRef ref = dt_test::flash_ref(sh, q16, dout, o16, ow, dqkv0, k.uh);
        if (!out16) {
          CHECK(outside("flash lse", lse, ref.lse, ref.lse_tol) == 0);
          CHECK(outside("flash out", out, ref.out, ref.out_tol) == 0);
        }
        auto dqkv = dqkv0;
        std::vector<float> scr(B * NH * T, std::nanf(""));
        const void* op = out16 ? static_cast<const void*>(out_bits.data()) : out.data();
        REQUIRE(d.t->flash_attention_bwd(d.ctx, dqkv.data(), scr.data(), dout.data(), qkv.data(),
                                         op, out16 ? k.type : DT_HAL_F32, lse.data(), B, T, C, NH,
                                         k.type) == DT_HAL_OK);
        CHECK(outside("flash dqkv", dqkv, ref.dqkv, ref.dqkv_tol) == 0);
        if (!r16) {  // the version-1 backward from the probabilities, within the same bound
          auto g1 = dqkv0;
          std::vector<float> s1(att.size());
          REQUIRE(v1.attention_bwd(d.ctx, g1.data(), s1.data(), dout.data(), qkv.data(), att.data(),
                                   B, T, C, NH) == DT_HAL_OK);
          CHECK(outside("attention_bwd dqkv", g1, ref.dqkv, ref.dqkv_tol) == 0);
        } else if (T > 1) {  // the products' rounding is real: the fp32 bound does not hold
          // (With one token P is exactly 1, dS 0 and dV = dO: nothing there is rounded.)
          const dt_test::FlashRef tight = dt_test::flash_ref(sh, q16, dout, o16, ow, dqkv0, 0.0);
          CHECK(outside("flash dqkv", dqkv, tight.dqkv, tight.dqkv_tol, true) > 0);
        }
      }
    }
  }
  // Bad arguments are refused with the entry's name, and nothing is written.
  const int64_t B = 1, T = 4, C = 8, NH = 2;
  const auto qkv = rand_f(rng, B * T * 3 * C, -1.0f, 1.0f);
  std::vector<float> out(B * T * C, 7.0f), lse(B * NH * T, 7.0f), g(qkv.size(), 0.0f),
      scr(B * NH * T);
  CHECK(d.t->flash_attention_fwd(d.ctx, out.data(), lse.data(), qkv.data(), B, T, C, NH,
                                 static_cast<dt_hal_dtype>(9)) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("flash_attention_fwd: unknown dtype 9") != std::string::npos);
  CHECK(d.t->flash_attention_fwd(d.ctx, out.data(), lse.data(), qkv.data(), B, T, C, 3,
                                 DT_HAL_F32) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("flash_attention_fwd: NH = 3 does not divide C = 8") != std::string::npos);
  CHECK(d.t->flash_attention_fwd(d.ctx, out.data(), nullptr, qkv.data(), B, T, C, NH, DT_HAL_F32) ==
        DT_HAL_ERR_INVALID);
  CHECK(d.err().find("flash_attention_fwd: lse is null") != std::string::npos);
  CHECK(out[0] == 7.0f);
  CHECK(d.t->flash_attention_bwd(d.ctx, g.data(), scr.data(), out.data(), qkv.data(), out.data(),
                                 DT_HAL_F16, lse.data(), B, T, C, NH,
                                 DT_HAL_BF16) == DT_HAL_ERR_INVALID);
  CHECK(d.err().find("flash_attention_bwd: out_dtype 2 must be F32 or the products' dtype 1") !=
        std::string::npos);
  CHECK(g[0] == 0.0f);
}
