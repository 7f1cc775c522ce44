// Whole-model checks of dt::Gpt on the CPU device: parameter table, initialisation statistics,
// and the gradient of every parameter tensor against central finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "dt/gpt.hpp"
#include "model/layers.hpp"

namespace {

dt::GptConfig micro() {
  dt::GptConfig c;
  c.vocab = 19;
  c.block = 8;
  c.layers = 2;
  c.heads = 2;
  c.embd = 16;
  return c;
}

}  // namespace

TEST_CASE("gpt parameter table follows nanoGPT names, shapes and order") {
  dt::GptConfig c = micro();
  auto p = dt::gpt_params(c);
  REQUIRE(p.size() == 2 + 12 * 2 + 2);
  CHECK(p[0].name == "transformer.wte.weight");
  CHECK(p[0].shape == dt::Shape{19, 16});
  CHECK(p[1].name == "transformer.wpe.weight");
  CHECK(p[1].shape == dt::Shape{8, 16});
  CHECK(p[4].name == "transformer.h.0.attn.c_attn.weight");
  CHECK(p[4].shape == dt::Shape{48, 16});  // [3E, E]: Linear weights are [out, in]
  CHECK(p[12].name == "transformer.h.0.mlp.c_proj.weight");
  CHECK(p[12].shape == dt::Shape{16, 64});
  CHECK(p.back().name == "transformer.ln_f.bias");
  std::size_t off = 0;
  for (const auto& i : p) {
    CHECK(i.offset == off);
    off += i.numel;
    CHECK(i.decay == (i.shape.size() == 2));
  }
  // Closed form of the GPT-2 parameter count with a tied head.
  const std::size_t V = 19, T = 8, C = 16, L = 2;
  CHECK(off == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C);
}

TEST_CASE("gpt initialisation: N(0, 0.02), scaled residual projections, unit norms") {
  auto dev = dt::Device::open("cpu", "");
  dt::GptConfig c = micro();
  c.embd = 64;
  c.layers = 4;
  c.vocab = 256;
  dt::Gpt m(dev, c, 1);
  m.init(7);
  auto stats = [&](const std::string& name) {
    const auto& pi = m.param(name);
    const float* d = m.param_data() + pi.offset;
    double s = 0, ss = 0;
    for (std::size_t i = 0; i < pi.numel; ++i) {
      s += d[i];
      ss += static_cast<double>(d[i]) * d[i];
    }
    const double mean = s / pi.numel;
    return std::pair<double, double>{mean, std::sqrt(ss / pi.numel - mean * mean)};
  };
  auto [m1, s1] = stats("transformer.wte.weight");  // 16384 draws: std within ~1.5% of 0.02
  CHECK(std::abs(m1) < 0.001);
  CHECK(s1 == doctest::Approx(0.02).epsilon(0.03));
  auto [m2, s2] = stats("transformer.h.1.mlp.c_fc.weight");
  CHECK(s2 == doctest::Approx(0.02).epsilon(0.03));
  auto [m3, s3] = stats("transformer.h.2.mlp.c_proj.weight");
  CHECK(s3 == doctest::Approx(0.02 / std::sqrt(8.0)).epsilon(0.03));
  auto [m4, s4] = stats("transformer.h.0.ln_1.weight");
  CHECK(m4 == 1.0);
  CHECK(s4 == 0.0);
  auto [m5, s5] = stats("transformer.h.3.attn.c_attn.bias");
  CHECK(m5 == 0.0);
  // Same seed, same weights; another seed, other weights.
  dt::Gpt m2b(dev, c, 1);
  m2b.init(7);
  CHECK(std::equal(m.param_data(), m.param_data() + m.num_params(), m2b.param_data()));
  m2b.init(8);
  CHECK(!std::equal(m.param_data(), m.param_data() + m.num_params(), m2b.param_data()));
}

// Attention keeping the log-sum-exp (the default) and keeping the probabilities.
TEST_CASE("gpt gradient of every parameter tensor matches central finite differences") {
  for (const bool flash : {true, false}) {
    auto dev = dt::Device::open("cpu", "");
    dt::GptConfig c = micro();
    c.flash_attention = flash;
    CAPTURE(flash);
    const int B = 2, T = 7;  // T below the block size, odd
    dt::Gpt m(dev, c, B);
    m.init(3);
    std::mt19937 rng(11);
    // Move every parameter off its initial value (norm weights 1, biases 0) so that all paths
    // carry signal.
    std::normal_distribution<float> nd(0.0f, 0.05f);
    for (std::size_t i = 0; i < m.num_params(); ++i) m.param_data()[i] += nd(rng);
    std::uniform_int_distribution<int> tok(0, c.vocab - 1);
    std::vector<std::int32_t> in(B * T), tg(B * T);
    for (auto& t : in) t = tok(rng);
    for (auto& t : tg) t = tok(rng);

    m.zero_grad();
    m.forward(in.data(), tg.data(), B, T);
    m.backward(1.0f);  // gradient of the loss SUM
    std::vector<float> grad(m.grad_data(), m.grad_data() + m.num_params());

    // For each tensor: the derivative along a random direction d restricted to that tensor,
    // (L(p + h d) - L(p - h d)) / 2h, against grad . d. The loss is summed in double from float32
    // per-token losses (about 1e-7 relative each), so with h = 1e-3 and |d| ~ sqrt(numel) the
    // difference quotient carries an absolute error of roughly 14 * 3 * 1e-7 / 1e-3 = 4e-3 plus an
    // O(h^2) truncation term; the bound below is 2% of |grad . d| plus 1e-2.
    for (const auto& pi : m.params()) {
      std::vector<float> d(pi.numel);
      for (auto& x : d) x = nd(rng) * 20.0f;  // N(0, 1)
      double an = 0;
      for (std::size_t k = 0; k < pi.numel; ++k)
        an += static_cast<double>(grad[pi.offset + k]) * d[k];
      float* p = m.param_data() + pi.offset;
      std::vector<float> saved(p, p + pi.numel);
      const float h = 1e-3f;
      for (std::size_t k = 0; k < pi.numel; ++k) p[k] = saved[k] + h * d[k];
      const double lp = m.forward(in.data(), tg.data(), B, T);
      for (std::size_t k = 0; k < pi.numel; ++k) p[k] = saved[k] - h * d[k];
      const double lm = m.forward(in.data(), tg.data(), B, T);
      std::copy(saved.begin(), saved.end(), p);
      const double fd = (lp - lm) / (2.0 * h);
      INFO(pi.name << ": analytic " << an << ", finite difference " << fd);
      CHECK(std::abs(fd - an) <= 0.02 * std::abs(an) + 1e-2);
      CHECK(std::abs(an) > 1e-3);  // the direction carries signal, so the check can fail
    }
  }
}

TEST_CASE("gpt with flash attention keeps B NH T floats a layer for attention, not B NH T T") {
  auto dev = dt::Device::open("cpu", "");
  dt::GptConfig c = micro();
  const int B = 3;
  c.flash_attention = true;
  const dt::Gpt flash(dev, c, B);
  c.flash_attention = false;
  const dt::Gpt full(dev, c, B);
  // Per layer its state, and once the backward's scratch of the same size.
  const std::size_t per = static_cast<std::size_t>(B) * c.heads * c.block;
  const std::size_t saved = (c.layers + 1) * (per * c.block - per) * sizeof(float);
  CHECK(full.activation_bytes() - flash.activation_bytes() == saved);
}

// The model's matrix products in bf16/f16 (src/model/layers.hpp): both operands rounded to the
// type, products accumulated in fp32. Reference: float64 products of the operands rounded with
// dt::bf16 / dt::f16 (core/dtype.cpp, not the device's cast).
TEST_CASE("matmul in bf16 and f16 rounds both operands once and accumulates in fp32") {
  dt::Device dev = dt::Device::open("cpu", "");
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::int64_t M = 5, N = 7, K = 33;
  for (dt::DType t : {dt::DType::f32, dt::DType::bf16, dt::DType::f16})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        CAPTURE(dt::dtype_name(t));
        CAPTURE(ta);
        CAPTURE(tb);
        std::vector<float> A(static_cast<std::size_t>(M * K)), B(static_cast<std::size_t>(K * N));
        for (float& v : A) v = nd(rng);
        for (float& v : B) v = nd(rng);
        std::vector<float> C(static_cast<std::size_t>(M * N), 0.5f);
        const std::int64_t lda = ta ? M : K, ldb = tb ? K : N;
        dt::GemmWorkspace ws;
        ws.compute = t;
        dt::matmul(dev, &ws, ta, tb, M, N, K, 2.0f, A.data(), lda, B.data(), ldb, 1.0f, C.data(),
                   N);
        auto round = [t](float v) -> double {
          if (t == dt::DType::bf16) return static_cast<float>(dt::bf16(v));
          if (t == dt::DType::f16) return static_cast<float>(dt::f16(v));
          return v;
        };
        double worst_rounded = 0, worst_exact = 0;
        for (std::int64_t i = 0; i < M; ++i)
          for (std::int64_t j = 0; j < N; ++j) {
            double want = 0, exact = 0, mag = 0;
            for (std::int64_t k = 0; k < K; ++k) {
              const float a = A[static_cast<std::size_t>(ta ? k * lda + i : i * lda + k)];
              const float b = B[static_cast<std::size_t>(tb ? j * ldb + k : k * ldb + j)];
              want += round(a) * round(b);
              exact += static_cast<double>(a) * b;
              mag += std::fabs(round(a) * round(b));
            }
            const double got = C[static_cast<std::size_t>(i * N + j)];
            // fp32 accumulation of K products, alpha and beta: within (K + 3) ulps of the sum of
            // magnitudes.
            const double bound = (K + 3) * 0x1p-24 * (2 * mag + 0.5);
            worst_rounded = std::max(worst_rounded, std::fabs(got - (2 * want + 0.5)) / bound);
            worst_exact = std::max(worst_exact, std::fabs(got - (2 * exact + 0.5)) / bound);
          }
        CHECK(worst_rounded <= 1.0);
        // The rounding is really applied: unrounded operands give a different result.
        if (t != dt::DType::f32) CHECK(worst_exact > 1.0);
      }
}

// GemmWorkspace::w16: an operand lying wholly inside the weights is read from their 16-bit copy
// (not cast); any other operand, one that only starts inside or runs past the range included,
// is cast. The copy here is deliberately not the weights' rounding, so the result shows which
// one a product read.
TEST_CASE("matmul reads an operand inside the weights from their 16-bit copy, casts the rest") {
  dt::Device dev = dt::Device::open("cpu", "");
  const std::int64_t M = 2, N = 3, K = 4;
  std::vector<float> weights(40, 1.0f);  // rounds to bf16 1.0
  std::vector<std::uint16_t> copy(40);
  for (std::size_t i = 0; i < copy.size(); ++i)
    copy[i] = dt::bf16(2.0f + static_cast<float>(i)).bits;
  std::vector<float> x(static_cast<std::size_t>(M * K), 1.0f);
  dt::GemmWorkspace ws;
  ws.compute = dt::DType::bf16;
  ws.w32 = weights.data();
  ws.w16 = copy.data();
  ws.wn = weights.size();
  // C[M, N] = x[M, K] @ B[K, N] with B at weights + off: the sum over k of B[k, j].
  auto product = [&](const float* B) {
    std::vector<float> C(static_cast<std::size_t>(M * N), -1.0f);
    dt::matmul(dev, &ws, 0, 0, M, N, K, 1.0f, x.data(), K, B, N, 0.0f, C.data(), N);
    return C;
  };
  for (std::int64_t off : {0, 10, 28}) {  // B = elements [off, off + 12): inside the range
    CAPTURE(off);
    const std::vector<float> C = product(weights.data() + off);
    for (std::int64_t j = 0; j < N; ++j) {
      double want = 0;
      for (std::int64_t k = 0; k < K; ++k)
        want += static_cast<float>(dt::bf16(2.0f + static_cast<float>(off + k * N + j)));
      CHECK(C[static_cast<std::size_t>(j)] == want);
      CHECK(C[static_cast<std::size_t>(N + j)] == want);
    }
  }
  // Past the end (elements 30..41 of a 40-element range), and an operand outside: cast.
  std::vector<float> outside(12, 1.0f);
  std::vector<float> tail(44, 1.0f);
  ws.w32 = tail.data();
  ws.wn = 40;
  for (const float* B :
       {static_cast<const float*>(tail.data() + 30), static_cast<const float*>(outside.data())}) {
    const std::vector<float> C = product(B);
    for (float c : C) CHECK(c == static_cast<float>(K));  // ones, cast: K per entry
  }
  // No copy: cast.
  ws.w16 = nullptr;
  const std::vector<float> C = product(tail.data());
  for (float c : C) CHECK(c == static_cast<float>(K));
}

// A padded head's loss runs over the padded vocabulary: a target among the padding's indices
// (its logit -inf) would give an infinite loss and gradients toward nothing. Refused, naming it,
// as the unpadded model's kernel refuses one outside the vocabulary.
TEST_CASE("gpt with a padded vocabulary refuses a target in the padding") {
  auto dev = dt::Device::open("cpu", "");
  dt::GptConfig c = micro();
  c.vocab = 37;
  c.pad_vocab = 16;
  REQUIRE(dt::padded_vocab(c) == 48);
  dt::Gpt m(dev, c, 1);
  m.init(5);
  std::vector<std::int32_t> in(static_cast<std::size_t>(c.block), 1), tgt = in;
  CHECK(std::isfinite(m.forward(in.data(), tgt.data(), 1, c.block)));
  tgt[3] = 40;
  CHECK_THROWS_WITH_AS(m.forward(in.data(), tgt.data(), 1, c.block),
                       doctest::Contains("target 40 at position 3 is outside [0, vocab = 37)"),
                       dt::InvalidArgument);
}
