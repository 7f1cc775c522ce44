// dt::LossScaler: the dynamic loss-scale policy step by step, its settings checks and its state.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "dt/loss_scale.hpp"

namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const dt::ConfigError& e) {
    return e.message();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("loss scaler: defaults are 2^16, x2 after 2000 clean steps, x0.5 on overflow") {
  dt::LossScaler s;
  CHECK(s.scale() == 65536.0f);
  CHECK(s.inv_scale() == 1.0f / 65536.0f);
  for (int i = 0; i < 1999; ++i) REQUIRE(s.update(false));
  CHECK(s.scale() == 65536.0f);
  CHECK(s.clean_steps_in_a_row() == 1999);
  CHECK(s.update(false));
  CHECK(s.scale() == 131072.0f);
  CHECK(s.clean_steps_in_a_row() == 0);
  CHECK_FALSE(s.update(true));  // overflow: skipped, halved
  CHECK(s.scale() == 65536.0f);
  CHECK(s.steps_skipped() == 1);
}

TEST_CASE("loss scaler: an overflow restarts the clean-step count") {
  dt::LossScaleConfig c;
  c.growth_interval = 3;
  dt::LossScaler s(c);
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 32768.0f);
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK(s.scale() == 32768.0f);  // only 2 clean steps since the overflow
  CHECK(s.update(false));
  CHECK(s.scale() == 65536.0f);
}

TEST_CASE("loss scaler: the scale never falls below the floor nor grows past the cap") {
  dt::LossScaleConfig c;
  c.initial = 4;
  c.growth_interval = 1;
  c.max_scale = 16;
  dt::LossScaler s(c);
  for (int i = 0; i < 10; ++i) CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 1.0f);
  CHECK(s.steps_skipped() == 10);
  for (int i = 0; i < 10; ++i) CHECK(s.update(false));
  CHECK(s.scale() == 16.0f);
}

TEST_CASE("loss scaler: hysteresis tolerates overflows until a growth restores it") {
  dt::LossScaleConfig c;
  c.hysteresis = 2;
  c.growth_interval = 4;
  dt::LossScaler s(c);
  CHECK_FALSE(s.update(true));  // first overflow: skipped, the scale kept
  CHECK(s.scale() == 65536.0f);
  CHECK(s.update(false));       // a clean step does not restore the tolerance by default
  CHECK_FALSE(s.update(true));  // second overflow: backs off
  CHECK(s.scale() == 32768.0f);
  CHECK_FALSE(s.update(true));  // tolerance used up: every further overflow backs off
  CHECK(s.scale() == 16384.0f);
  for (int i = 0; i < 4; ++i) CHECK(s.update(false));  // growth restores the tolerance
  CHECK(s.scale() == 32768.0f);
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 32768.0f);
  CHECK(s.steps_skipped() == 4);
}

TEST_CASE("loss scaler: consecutive hysteresis resets on every clean step") {
  dt::LossScaleConfig c;
  c.hysteresis = 2;
  c.reset_hysteresis_on_clean_step = true;
  dt::LossScaler s(c);
  for (int i = 0; i < 5; ++i) {
    CHECK_FALSE(s.update(true));
    CHECK(s.update(false));
  }
  CHECK(s.scale() == 65536.0f);  // never two overflows in a row
  CHECK_FALSE(s.update(true));
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 32768.0f);
}

TEST_CASE("loss scaler: a static scale only reports whether to step") {
  dt::LossScaleConfig c;
  c.dynamic = false;
  c.initial = 1;
  dt::LossScaler s(c);
  for (int i = 0; i < 5000; ++i) REQUIRE(s.update(false));
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 1.0f);
  CHECK(s.steps_skipped() == 1);
}

TEST_CASE("loss scaler: state round trip gives the same schedule") {
  dt::LossScaleConfig c;
  c.growth_interval = 5;
  c.hysteresis = 2;
  dt::LossScaler a(c), b(c);
  const bool pattern[] = {false, true, false, false, true, true, false, false, false};
  for (bool f : pattern) a.update(f);
  b.restore(a.state());
  for (int i = 0; i < 20; ++i) {
    const bool f = i % 7 == 3;
    CHECK(a.update(f) == b.update(f));
    CHECK(a.scale() == b.scale());
  }
  CHECK(a.steps_skipped() == b.steps_skipped());
}

TEST_CASE("loss scaler: bad settings and states are refused, naming the setting") {
  auto with = [](auto set) {
    dt::LossScaleConfig c;
    set(c);
    return error_of([&] { dt::LossScaler s(c); });
  };
  CHECK(with([](auto& c) { c.initial = 0; }).find("loss-scale.initial = 0") != std::string::npos);
  CHECK(with([](auto& c) { c.initial = NAN; }).find("loss-scale.initial") != std::string::npos);
  CHECK(with([](auto& c) { c.growth_interval = 0; }).find("loss-scale.growth-interval = 0") !=
        std::string::npos);
  CHECK(with([](auto& c) { c.growth_factor = 1; }).find("loss-scale.growth-factor") !=
        std::string::npos);
  CHECK(with([](auto& c) { c.backoff_factor = 1; }).find("loss-scale.backoff-factor") !=
        std::string::npos);
  CHECK(with([](auto& c) { c.min_scale = 1e9; }).find("loss-scale.min") != std::string::npos);
  CHECK(with([](auto& c) { c.max_scale = 2; }).find("loss-scale.max") != std::string::npos);
  CHECK(with([](auto& c) { c.hysteresis = 0; }).find("loss-scale.hysteresis = 0") !=
        std::string::npos);
  dt::LossScaler s;
  dt::LossScaler::State bad = s.state();
  bad.scale = 0.5;
  CHECK(error_of([&] { s.restore(bad); }).find("scale 0.5") != std::string::npos);
  bad = s.state();
  bad.growth_tracker = 2000;
  CHECK(error_of([&] { s.restore(bad); }).find("2000 clean steps") != std::string::npos);
  CHECK(s.scale() == 65536.0f);  // a refused state changes nothing
}
