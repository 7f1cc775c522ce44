#include <doctest/doctest.h>

#include <string>

#include "dt/error.hpp"

TEST_CASE("DT_CHECK throws the named type with the message and the location") {
  int steps = -3;
  try {
    DT_CHECK(dt::ConfigError, steps > 0, "train.steps must be positive, got ", steps);
    FAIL("no throw");
  } catch (const dt::ConfigError& e) {
    CHECK(e.message() == "train.steps must be positive, got -3");
    CHECK(std::string(e.what()).find("tests/unit/test_error.cpp:") != std::string::npos);
  }
}

TEST_CASE("DT_CHECK_EQ prints both operands") {
  try {
    DT_CHECK_EQ(dt::CommError, 3, 4, "counts differ");
    FAIL("no throw");
  } catch (const dt::CommError& e) {
    const std::string m = e.message();
    CHECK(m.find("counts differ") != std::string::npos);
    CHECK(m.find("3 vs 4") != std::string::npos);
  }
  CHECK_NOTHROW(DT_CHECK_EQ(dt::CommError, 4, 4));
}

TEST_CASE("DT_ASSERT is an internal error, distinct from input errors") {
  CHECK_THROWS_AS(DT_ASSERT(1 == 2), dt::InternalError);
  CHECK_THROWS_AS(DT_ASSERT(1 == 2), dt::Error);
  CHECK_NOTHROW(DT_ASSERT(2 == 2));
}
