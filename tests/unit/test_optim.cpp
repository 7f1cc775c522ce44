// dt::AdamW and the learning-rate schedule against references written out in double, and the
// contracts of the training step around them (StageEngine: a backward needs its forward).
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dt/device.hpp"
#include "dt/error.hpp"
#include "dt/graph.hpp"
#include "dt/optim.hpp"
#include "engine/pipeline.hpp"

namespace {

// Two parameters: a decayed matrix [0, 6) and a bias [6, 9) that is not decayed.
std::vector<dt::ParamInfo> table() { return {{"w", {2, 3}, 0, 6, true}, {"b", {3}, 6, 3, false}}; }

}  // namespace

TEST_CASE("lr_at: linear warmup, cosine to min_lr at decay_steps, then min_lr") {
  dt::OptimConfig c;
  c.lr = 0.6;
  c.min_lr = 0.1;
  c.warmup = 5;
  c.decay_steps = 25;
  for (std::int64_t s = 0; s < 5; ++s) CHECK(dt::lr_at(c, s) == doctest::Approx(0.6 * (s + 1) / 6));
  CHECK(dt::lr_at(c, 5) == doctest::Approx(0.6));
  CHECK(dt::lr_at(c, 15) == doctest::Approx(0.1 + 0.5 * 0.5));  // half-way: cos(pi / 2) = 0
  const double r = 7.0 / 20.0;
  CHECK(dt::lr_at(c, 12) == doctest::Approx(0.1 + 0.5 * (1 + std::cos(M_PI * r)) * 0.5));
  CHECK(dt::lr_at(c, 25) == doctest::Approx(0.1));
  CHECK(dt::lr_at(c, 1000) == doctest::Approx(0.1));
}

TEST_CASE("AdamW: a temporary parameter table is copied; decay only where marked") {
  const dt::Device dev = dt::Device::open("cpu", "");
  dt::AdamW opt(dev, table(), 9);  // the table dies here: the optimizer keeps its own
  dt::OptimConfig c;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.5;
  std::vector<float> p(9), g(9);
  std::vector<double> rp(9), rm(9, 0.0), rv(9, 0.0);
  for (int i = 0; i < 9; ++i) {
    p[i] = 0.25f * static_cast<float>(i) - 1.0f;
    rp[i] = p[i];
  }
  const double lr = 0.01;
  for (int t = 1; t <= 3; ++t) {
    for (int i = 0; i < 9; ++i) g[i] = 0.125f * static_cast<float>((i * 7 + t * 3) % 11) - 0.5f;
    opt.step(p.data(), g.data(), lr, c);
    for (int i = 0; i < 9; ++i) {
      rm[i] = c.beta1 * rm[i] + (1 - c.beta1) * g[i];
      rv[i] = c.beta2 * rv[i] + (1 - c.beta2) * double(g[i]) * g[i];
      const double mh = rm[i] / (1 - std::pow(c.beta1, t)), vh = rv[i] / (1 - std::pow(c.beta2, t));
      const double wd = i < 6 ? c.weight_decay : 0.0;
      rp[i] -= lr * (mh / (std::sqrt(vh) + c.eps) + wd * rp[i]);
    }
  }
  CHECK(opt.steps() == 3);
  for (int i = 0; i < 9; ++i) {
    CAPTURE(i);
    CHECK(p[i] == doctest::Approx(rp[i]).epsilon(1e-5));
  }
}

TEST_CASE(
    "AdamW: parameters that share elements are refused (the fused update runs them at once)") {
  const dt::Device dev = dt::Device::open("cpu", "");
  const std::vector<dt::ParamInfo> overlapping = {{"w", {2, 3}, 0, 6, true},
                                                  {"b", {3}, 4, 3, false}};
  try {
    dt::AdamW opt(dev, overlapping, 9);
    FAIL_CHECK("no InvalidArgument");
  } catch (const dt::InvalidArgument& e) {
    const std::string msg = e.message();
    CAPTURE(msg);
    CHECK(msg.find("parameters overlap at element 4") != std::string::npos);
  }
}

TEST_CASE("AdamW: a parameter outside the state is refused, naming it") {
  const dt::Device dev = dt::Device::open("cpu", "");
  try {
    dt::AdamW opt(dev, table(), 8);
    FAIL_CHECK("no InvalidArgument");
  } catch (const dt::InvalidArgument& e) {
    const std::string msg = e.message();
    CAPTURE(msg);
    CHECK(msg.find("parameter b [6, 9) lies outside the 8 elements") != std::string::npos);
  }
}

// ---- StageEngine: backward needs a finished forward with targets
// ---------------------------------

TEST_CASE("StageEngine: backward after no forward, or after one without targets, is refused") {
  dt::GptConfig c;
  c.vocab = 64;
  c.block = 8;
  c.layers = 1;
  c.heads = 2;
  c.embd = 16;
  const int B = 2, T = 8;
  namespace g = dt::graph;
  const g::Graph full = g::pipeline_split(g::tp_rewrite(g::build_gpt(c, B, T), 1), {0});
  const dt::Device dev = dt::Device::open("cpu", "");
  dt::StageEngine e(dev, g::stage_graph(full, 0), c, 0, 1, 2, dt::StageComms{});
  std::vector<std::int32_t> in(B * T), tgt(B * T);
  for (int i = 0; i < B * T; ++i) {
    in[i] = (i * 5) % 64;
    tgt[i] = (i * 3 + 1) % 64;
  }
  CHECK_THROWS_WITH_AS(e.backward(1, 0, 1.0f),
                       doctest::Contains("slot 1 holds no finished forward pass"),
                       dt::InvalidArgument);
  const double loss = e.forward(0, 0, in.data(), tgt.data(), B);
  CHECK(loss > 0);
  CHECK_NOTHROW(e.backward(0, 0, 1.0f));
  CHECK(e.forward(0, 1, in.data(), nullptr, B) == 0.0);  // evaluation without targets
  CHECK_THROWS_WITH_AS(e.backward(0, 1, 1.0f),
                       doctest::Contains("the forward pass of slot 0 had no targets"),
                       dt::InvalidArgument);
}

TEST_CASE("AdamW: the fused update gives the bits of one version-1 adamw per parameter") {
  const dt::Device dev = dt::Device::open("cpu", "");
  REQUIRE(static_cast<bool>(dev.table2().adamw_multi));
  // Neighbours with equal decay (merged into one range), a change of decay, an empty parameter,
  // and a gap of 5 elements that no parameter covers (left untouched).
  const std::vector<dt::ParamInfo> params = {{"a", {40}, 0, 40, true},   {"b", {33}, 40, 33, true},
                                             {"c", {7}, 73, 7, false},   {"d", {0}, 80, 0, true},
                                             {"e", {19}, 80, 19, false}, {"f", {64}, 104, 64, true},
                                             {"g", {3}, 168, 3, false}};
  const std::size_t n = 171;
  dt::OptimConfig c;
  c.weight_decay = 0.3;
  c.beta1 = 0.85;
  c.beta2 = 0.97;
  c.eps = 1e-6;
  dt::AdamW opt(dev, params, n);
  std::vector<float> p(n), rp, rm(n, 0.0f), rv(n, 0.0f), g(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = std::sin(0.37f * static_cast<float>(i));
  rp = p;
  for (int t = 1; t <= 4; ++t) {
    for (std::size_t i = 0; i < n; ++i)
      g[i] = std::cos(0.11f * static_cast<float>(i * static_cast<std::size_t>(t)) + 0.5f);
    const double lr = 0.02 / t;
    opt.step(p.data(), g.data(), lr, c);
    for (const dt::ParamInfo& q : params)
      dev.call(&dt_hal_v1_t::adamw, "adamw", rp.data() + q.offset,
               static_cast<const float*>(g.data() + q.offset), rm.data() + q.offset,
               rv.data() + q.offset, static_cast<std::int64_t>(q.numel), static_cast<float>(lr),
               static_cast<float>(c.beta1), static_cast<float>(c.beta2), static_cast<float>(c.eps),
               static_cast<float>(q.decay ? c.weight_decay : 0.0), std::int64_t{t});
  }
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(p[i] == rp[i]);  // bit for bit (the same kernel per element)
    CHECK(opt.m()[i] == rm[i]);
    CHECK(opt.v()[i] == rv[i]);
  }
  for (std::size_t i = 99; i < 104; ++i) CHECK(p[i] == std::sin(0.37f * static_cast<float>(i)));
}
