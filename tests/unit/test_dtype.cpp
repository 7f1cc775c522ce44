// dt::bf16 / dt::f16 conversions and dt::convert.
//
// References are independent of src/core/dtype.cpp:
//  * f16: the compiler's _Float16 (libgcc soft-float conversions, IEEE round to nearest even);
//  * bf16 (and, as a cross-check, f16): round_ref() below, a first-principles rounding in double
//    arithmetic (the two neighbouring representable values, the nearer one, ties to the even
//    significand, overflow to Inf when the rounded magnitude reaches 2^(emax+1));
//  * decode(): reads a 16-bit pattern as sign * significand * 2^exponent with std::ldexp.
// Large sweeps count mismatches and report the first one, so that one CHECK covers millions of
// patterns and the whole file runs in about a second.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "dt/dtype.hpp"
#include "dt/error.hpp"

namespace {

using u16 = std::uint16_t;
using u32 = std::uint32_t;

float f_from_bits(u32 u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
u32 bits_of(float f) {
  u32 u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- the two formats, described by their parameters only ----
struct Format {
  int ebits;  // exponent field width
  int mbits;  // stored mantissa bits
  int bias() const { return (1 << (ebits - 1)) - 1; }
  int emin() const { return 1 - bias(); }      // exponent of the smallest normal
  int emax() const { return bias(); }          // exponent of the largest finite
  int precision() const { return mbits + 1; }  // significant bits of a normal
  u32 exp_mask() const { return ((1u << ebits) - 1u) << mbits; }
  u32 man_mask() const { return (1u << mbits) - 1u; }
  u32 sign_bit() const { return 1u << (ebits + mbits); }
  u32 quiet_bit() const { return 1u << (mbits - 1); }
  bool is_nan(u32 b) const { return (b & exp_mask()) == exp_mask() && (b & man_mask()) != 0; }
};
constexpr Format kBF16{8, 7};
constexpr Format kF16{5, 10};

// Value of a 16-bit pattern (NaN for NaN patterns), from first principles.
double decode(u32 b, Format f) {
  const bool neg = (b & f.sign_bit()) != 0;
  const u32 e = (b & f.exp_mask()) >> f.mbits;
  const u32 m = b & f.man_mask();
  double v;
  if (e == (f.exp_mask() >> f.mbits))
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), f.emin() - f.mbits);
  else
    v = std::ldexp(static_cast<double>(m + (1u << f.mbits)),
                   static_cast<int>(e) - f.bias() - f.mbits);
  return neg ? -v : v;
}

// x (finite) rounded to the format, round to nearest, ties to even; +-Inf on overflow.
double round_ref(double x, Format f) {
  const double a = std::fabs(x);
  if (a == 0) return x;  // keeps the sign of zero
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const int E = std::max(e - 1, f.emin());
  const double q = std::ldexp(1.0, E - (f.precision() - 1));  // spacing of the format near a
  const double k = std::floor(a / q);                         // a / q is exact (power of two)
  const double lo = k * q, hi = (k + 1) * q;
  const double dlo = a - lo, dhi = hi - a;  // exact: a and lo share the grid of a
  double r;
  if (dlo < dhi)
    r = lo;
  else if (dhi < dlo)
    r = hi;
  else
    r = std::fmod(k, 2.0) == 0 ? lo : hi;
  if (r >= std::ldexp(1.0, f.emax() + 1)) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

// The reference f16 bits of a float, from the compiler.
u16 f16_ref(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  u16 b;
  std::memcpy(&b, &h, 2);
  return b;
}
float f16_ref_to_float(u16 b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

std::string hex(u32 v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

// Mismatch counter for sweeps: one CHECK at the end, the first bad input in the message.
struct Tally {
  std::uint64_t checked = 0, bad = 0;
  std::string first;
  void fail(const std::string& what) {
    if (bad++ == 0) first = what;
  }
};

// Checks dt's conversion of one float against the rounding reference `expect_value`, or, for a
// NaN input, against the documented NaN rule (NaN, quiet, sign kept).
void check_one(float in, u16 got, Format f, Tally& t, const char* name) {
  ++t.checked;
  const u32 in_bits = bits_of(in);
  if (std::isnan(in)) {
    const bool sign_ok = ((got & f.sign_bit()) != 0) == ((in_bits >> 31) != 0);
    if (!f.is_nan(got) || !(got & f.quiet_bit()) || !sign_ok)
      t.fail(std::string(name) + "(" + hex(in_bits) + ") = " + hex(got) +
             ", expected a quiet NaN with the input's sign");
    return;
  }
  const double want = round_ref(static_cast<double>(in), f);
  const double have = decode(got, f);
  if (f.is_nan(got) || have != want || std::signbit(have) != std::signbit(want))
    t.fail(std::string(name) + "(" + hex(in_bits) + ") = " + hex(got) + " (" +
           std::to_string(have) + "), expected " + std::to_string(want));
}

}  // namespace

// ------------------------------------------------------------------ sanity of the references

TEST_CASE("reference self-check: round_ref agrees with _Float16 on f16") {
  // If this fails the tests' own bf16 reference is wrong, not dt.
  Tally t;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 4099) {
    const float f = f_from_bits(static_cast<u32>(u));
    if (std::isnan(f)) continue;
    ++t.checked;
    const double r = round_ref(f, kF16);
    const double c = decode(f16_ref(f), kF16);
    if (r != c || std::signbit(r) != std::signbit(c)) t.fail(hex(static_cast<u32>(u)));
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
  CHECK(t.checked > 1000000);
}

// ------------------------------------------------------------------ dtype metadata

TEST_CASE("dtype sizes, names, parsing and floating flags") {
  struct Row {
    dt::DType t;
    std::size_t size;
    const char* name;
    bool floating;
  };
  const Row rows[] = {{dt::DType::f32, 4, "f32", true},   {dt::DType::f64, 8, "f64", true},
                      {dt::DType::bf16, 2, "bf16", true}, {dt::DType::f16, 2, "f16", true},
                      {dt::DType::i32, 4, "i32", false},  {dt::DType::i64, 8, "i64", false},
                      {dt::DType::u8, 1, "u8", false}};
  for (const auto& r : rows) {
    CAPTURE(r.name);
    CHECK(dt::dtype_size(r.t) == r.size);
    CHECK(std::string(dt::dtype_name(r.t)) == r.name);
    CHECK(dt::parse_dtype(r.name) == r.t);
    CHECK(dt::is_floating(r.t) == r.floating);
  }
  CHECK(std::size(dt::kAllDTypes) == 7);
  CHECK(dt::dtype_size(dt::dtype_v<float>) == sizeof(float));
  CHECK(dt::dtype_size(dt::dtype_v<double>) == sizeof(double));
  CHECK(dt::dtype_size(dt::dtype_v<std::int64_t>) == sizeof(std::int64_t));

  try {
    dt::parse_dtype("float32");
    FAIL("no throw");
  } catch (const dt::InvalidArgument& e) {
    CHECK(e.message().find("'float32'") != std::string::npos);
    CHECK(e.message().find("bf16") != std::string::npos);
  }
  CHECK_THROWS_AS(dt::parse_dtype(""), dt::InvalidArgument);
  CHECK_THROWS_AS(dt::parse_dtype("F32"), dt::InvalidArgument);
}

// ------------------------------------------------------------------ to float: exhaustive

TEST_CASE("bf16 -> float: all 65536 patterns are the top half of the float") {
  Tally t;
  for (u32 b = 0; b < 65536; ++b) {
    ++t.checked;
    const float got = dt::bf16::to_float(static_cast<u16>(b));
    if (bits_of(got) != (b << 16)) t.fail(hex(b));
    // And the value from first principles, for every non-NaN pattern.
    if (!kBF16.is_nan(b)) {
      const double v = decode(b, kBF16);
      if (static_cast<double>(got) != v || std::signbit(got) != std::signbit(v)) t.fail(hex(b));
    }
    // The wrapper type agrees with the static function.
    if (bits_of(static_cast<float>(dt::bf16::from_bits(static_cast<u16>(b)))) != (b << 16))
      t.fail("operator float " + hex(b));
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
  CHECK(t.checked == 65536);
}

TEST_CASE("f16 -> float: all 65536 patterns against _Float16 and first principles") {
  Tally t;
  int nans = 0;
  for (u32 b = 0; b < 65536; ++b) {
    ++t.checked;
    const u16 h = static_cast<u16>(b);
    const float got = dt::f16::to_float(h);
    const float ref = f16_ref_to_float(h);
    if (kF16.is_nan(b)) {
      ++nans;
      // NaN, sign kept, payload kept. (The quiet bit of a signalling f16 NaN is not compared:
      // _Float16 quiets it, dt widens the bits exactly as it does for bf16.)
      const u32 payload_mask = 0x003fffffu;  // float mantissa below the quiet bit
      if (!std::isnan(got) || std::signbit(got) != std::signbit(ref) ||
          (bits_of(got) & payload_mask) != (bits_of(ref) & payload_mask))
        t.fail("NaN " + hex(b) + " -> " + hex(bits_of(got)) + ", _Float16 gives " +
               hex(bits_of(ref)));
      continue;
    }
    if (bits_of(got) != bits_of(ref))
      t.fail(hex(b) + " -> " + hex(bits_of(got)) + ", _Float16 gives " + hex(bits_of(ref)));
    const double v = decode(b, kF16);
    if (static_cast<double>(got) != v || std::signbit(got) != std::signbit(v))
      t.fail(hex(b) + " differs from the decoded value");
    if (bits_of(static_cast<float>(dt::f16::from_bits(h))) != bits_of(ref))
      t.fail("operator float " + hex(b));
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
  CHECK(nans == 2 * 1023);
}

TEST_CASE("f16 -> float: named values") {
  CHECK(dt::f16::to_float(0x3c00) == 1.0f);
  CHECK(dt::f16::to_float(0xc000) == -2.0f);
  CHECK(dt::f16::to_float(0x7bff) == 65504.0f);
  CHECK(dt::f16::to_float(0x0400) == std::ldexp(1.0f, -14));     // smallest normal
  CHECK(dt::f16::to_float(0x0001) == std::ldexp(1.0f, -24));     // smallest subnormal
  CHECK(dt::f16::to_float(0x03ff) == std::ldexp(1023.0f, -24));  // largest subnormal
  CHECK(dt::f16::to_float(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(dt::f16::to_float(0x0200) == std::ldexp(1.0f, -15));
  CHECK(dt::f16::to_float(0x7c00) == std::numeric_limits<float>::infinity());
  CHECK(dt::f16::to_float(0xfc00) == -std::numeric_limits<float>::infinity());
  CHECK(bits_of(dt::f16::to_float(0x8000)) == 0x80000000u);  // -0 keeps its sign
  CHECK(bits_of(dt::f16::to_float(0x0000)) == 0x00000000u);
  const float qn = dt::f16::to_float(0xfe00);
  CHECK(std::isnan(qn));
  CHECK(std::signbit(qn));
}

// ------------------------------------------------------------------ float -> f16

TEST_CASE("float -> f16: strided sweep of all float patterns against _Float16") {
  Tally t;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 251) {
    const float f = f_from_bits(static_cast<u32>(u));
    const u16 got = dt::f16::from_float(f);
    if (std::isnan(f)) {
      check_one(f, got, kF16, t, "f16");
      continue;
    }
    ++t.checked;
    const u16 ref = f16_ref(f);
    if (got != ref)
      t.fail("f16(" + hex(static_cast<u32>(u)) + ") = " + hex(got) + ", _Float16 gives " +
             hex(ref));
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
  CHECK(t.checked > 17000000);
}

TEST_CASE("float -> f16: every f16 value and rounding boundary, with neighbours") {
  // For each positive f16 value v (and the Inf boundary 65520), the float patterns around v and
  // around the midpoint to the next value, both signs.
  Tally t;
  auto probe = [&](u32 centre, int radius) {
    for (int d = -radius; d <= radius; ++d) {
      for (u32 sign : {0u, 0x80000000u}) {
        const u32 u = (centre + static_cast<u32>(d)) | sign;
        const float f = f_from_bits(u);
        const u16 got = dt::f16::from_float(f);
        if (std::isnan(f)) {
          check_one(f, got, kF16, t, "f16");
          continue;
        }
        ++t.checked;
        const u16 ref = f16_ref(f);
        if (got != ref)
          t.fail("f16(" + hex(u) + ") = " + hex(got) + ", _Float16 gives " + hex(ref));
        check_one(f, got, kF16, t, "f16");  // and the first-principles reference
      }
    }
  };
  for (u32 h = 0; h < 0x7c00; ++h) {
    const double v = decode(h, kF16);
    const double next = h + 1 < 0x7c00 ? decode(h + 1, kF16) : 65536.0;  // Inf "neighbour"
    const float mid = static_cast<float>((v + next) / 2);                // exact in float (12 bits)
    REQUIRE(static_cast<double>(mid) == (v + next) / 2);
    probe(bits_of(static_cast<float>(v)), 3);
    probe(bits_of(mid), 40);
  }
  probe(0x7f800000u, 40);  // around Inf and the NaNs just above it
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
}

TEST_CASE("float -> f16: named edge values") {
  using dt::f16;
  CHECK(f16::from_float(1.0f) == 0x3c00);
  CHECK(f16::from_float(-2.0f) == 0xc000);
  CHECK(f16::from_float(0.0f) == 0x0000);
  CHECK(f16::from_float(-0.0f) == 0x8000);
  CHECK(f16::from_float(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(f16::from_float(-std::numeric_limits<float>::infinity()) == 0xfc00);
  // Overflow: 65504 is the largest f16; 65520 is the midpoint to 2^16 and ties away to Inf
  // (0x7bff is odd), anything below it rounds down.
  CHECK(f16::from_float(65504.0f) == 0x7bff);
  CHECK(f16::from_float(65519.0f) == 0x7bff);
  CHECK(f16::from_float(std::nextafter(65520.0f, 0.0f)) == 0x7bff);
  CHECK(f16::from_float(65520.0f) == 0x7c00);
  CHECK(f16::from_float(-65520.0f) == 0xfc00);
  CHECK(f16::from_float(-65519.0f) == 0xfbff);
  CHECK(f16::from_float(1e10f) == 0x7c00);
  CHECK(f16::from_float(std::numeric_limits<float>::max()) == 0x7c00);
  // Ties to even among normals.
  CHECK(f16::from_float(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);      // 1 + half ulp -> 1
  CHECK(f16::from_float(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // 1 + 1.5 ulp -> 1 + 2 ulp
  CHECK(f16::from_float(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)) == 0x3c01);
  // The tie that carries into the exponent: midway between 0x3bff (odd) and 2.0.
  CHECK(f16::from_float(2.0f - std::ldexp(1.0f, -11)) == 0x4000);
  CHECK(f16::from_float(-(2.0f - std::ldexp(1.0f, -11))) == 0xc000);
  // Subnormals: smallest, largest, and ties.
  CHECK(f16::from_float(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(f16::from_float(std::ldexp(1023.0f, -24)) == 0x03ff);
  CHECK(f16::from_float(std::ldexp(1.0f, -25)) == 0x0000);  // tie -> 0
  CHECK(f16::from_float(-std::ldexp(1.0f, -25)) == 0x8000);
  CHECK(f16::from_float(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);  // above tie
  CHECK(f16::from_float(std::ldexp(3.0f, -25)) == 0x0002);                        // 1.5 -> 2
  CHECK(f16::from_float(std::ldexp(5.0f, -25)) == 0x0002);                        // 2.5 -> 2
  CHECK(f16::from_float(std::ldexp(2047.0f, -25)) == 0x0400);  // 1023.5 -> carries to normal
  CHECK(f16::from_float(std::ldexp(1.0f, -26)) == 0x0000);
  CHECK(f16::from_float(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(f16::from_float(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(f16::from_float(std::numeric_limits<float>::min()) == 0x0000);
  // Every f16 value converts back to itself.
  for (u32 h = 0; h < 65536; ++h) {
    if (kF16.is_nan(h)) continue;
    const u16 back = f16::from_float(static_cast<float>(decode(h, kF16)));
    if (back != h) {
      FAIL_CHECK("round trip of ", hex(h), " gives ", hex(back));
      break;
    }
  }
  // Constructor and conversion operator.
  CHECK(f16(0.5f).bits == 0x3800);
  CHECK(static_cast<float>(f16(0.5f)) == 0.5f);
}

TEST_CASE("float -> f16: NaN stays NaN, quiet, sign kept") {
  const u32 nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu,
                      0xffffffffu, 0x7f802000u, 0x7fffe000u, 0x7f801fffu, 0xff812345u};
  for (u32 u : nans) {
    CAPTURE(hex(u));
    const u16 h = dt::f16::from_float(f_from_bits(u));
    CHECK(kF16.is_nan(h));
    CHECK((h & 0x0200u) != 0);                        // quiet
    CHECK(((h & 0x8000u) != 0) == ((u >> 31) != 0));  // sign
    CHECK(std::isnan(dt::f16::to_float(h)));
  }
}

// ------------------------------------------------------------------ float -> bf16

TEST_CASE("float -> bf16: strided sweep of all float patterns against first principles") {
  Tally t;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 251) {
    const float f = f_from_bits(static_cast<u32>(u));
    check_one(f, dt::bf16::from_float(f), kBF16, t, "bf16");
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
  CHECK(t.checked > 17000000);
}

TEST_CASE("float -> bf16: all patterns around every bf16 value and midpoint") {
  // bf16 values are the floats with zero low halves; midpoints have low half 0x8000.
  Tally t;
  for (u32 hi = 0; hi < 65536; ++hi) {
    for (int d = -12; d <= 12; ++d) {
      const u32 low = static_cast<u32>(d) & 0xffffu;  // around the value itself
      const u32 mid = static_cast<u32>(0x8000 + d);   // around the midpoint
      for (u32 lo : {low, mid}) {
        const u32 base = (d < 0 && lo == low) ? ((hi - 1) & 0xffffu) : hi;  // borrow below
        const u32 u = (base << 16) | lo;
        const float f = f_from_bits(u);
        check_one(f, dt::bf16::from_float(f), kBF16, t, "bf16");
      }
    }
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
  CHECK(t.checked == 65536ull * 25 * 2);
}

TEST_CASE("float -> bf16: float subnormals (every positive one, every 5th negative one)") {
  Tally t;
  for (u32 m = 1; m < 0x00800000u; ++m) {
    const float f = f_from_bits(m);
    check_one(f, dt::bf16::from_float(f), kBF16, t, "bf16");
    if (m % 5 == 0) {
      const float g = f_from_bits(0x80000000u | m);
      check_one(g, dt::bf16::from_float(g), kBF16, t, "bf16");
    }
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);
  CHECK(t.checked == 0x7fffffu + 0x7fffffu / 5);
}

TEST_CASE("float -> bf16: named edge values") {
  using dt::bf16;
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(bf16::from_float(1.0f) == 0x3f80);
  CHECK(bf16::from_float(-1.0f) == 0xbf80);
  CHECK(bf16::from_float(0.0f) == 0x0000);
  CHECK(bf16::from_float(-0.0f) == 0x8000);
  CHECK(bf16::from_float(inf) == 0x7f80);
  CHECK(bf16::from_float(-inf) == 0xff80);
  // Ties to even.
  CHECK(bf16::from_float(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);      // 1 + half ulp -> 1
  CHECK(bf16::from_float(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);  // 1 + 1.5 ulp -> 1 + 2 ulp
  CHECK(bf16::from_float(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)) == 0x3f81);
  CHECK(bf16::from_float(std::nextafter(1.0f + std::ldexp(1.0f, -8), 0.0f)) == 0x3f80);
  // The tie that carries into the exponent: midway between 0x3fff (odd) and 2.0.
  CHECK(bf16::from_float(2.0f - std::ldexp(1.0f, -8)) == 0x4000);
  CHECK(bf16::from_float(-(2.0f - std::ldexp(1.0f, -8))) == 0xc000);
  // Overflow: the largest bf16 is (2 - 2^-7) * 2^127; the midpoint to 2^128 ties up to Inf.
  const float bf16_max = std::ldexp(255.0f, 120);
  CHECK(bf16::from_float(bf16_max) == 0x7f7f);
  CHECK(bf16::from_float(std::ldexp(511.0f, 119)) == 0x7f80);  // the midpoint
  CHECK(bf16::from_float(std::nextafter(std::ldexp(511.0f, 119), 0.0f)) == 0x7f7f);
  CHECK(bf16::from_float(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(bf16::from_float(-std::numeric_limits<float>::max()) == 0xff80);
  // Subnormals: bf16 keeps 7 bits of a float subnormal, spacing 2^-133.
  const float q = std::ldexp(1.0f, -133);
  CHECK(bf16::from_float(q) == 0x0001);
  CHECK(bf16::from_float(q / 2) == 0x0000);  // tie -> even (0)
  CHECK(bf16::from_float(-q / 2) == 0x8000);
  CHECK(bf16::from_float(3 * q / 2) == 0x0002);  // 1.5 -> 2
  CHECK(bf16::from_float(5 * q / 2) == 0x0002);  // 2.5 -> 2
  CHECK(bf16::from_float(std::nextafter(q / 2, 1.0f)) == 0x0001);
  CHECK(bf16::from_float(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(bf16::from_float(255.5f * q) == 0x0100);  // largest subnormal + half: to normal
  CHECK(bf16::from_float(std::numeric_limits<float>::min()) == 0x0080);
  // Constructor and conversion operator.
  CHECK(bf16(3.0f).bits == 0x4040);
  CHECK(static_cast<float>(bf16(3.0f)) == 3.0f);
}

TEST_CASE("float -> bf16: NaN stays NaN, quiet, sign kept") {
  // Includes signalling NaNs whose payload lies only in the dropped low half: a plain truncation
  // would turn them into +-Inf.
  const u32 nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7f80ffffu,
                      0x7fbfffffu, 0xffffffffu, 0x7f810000u, 0xff812345u, 0x7fff8000u};
  for (u32 u : nans) {
    CAPTURE(hex(u));
    const u16 h = dt::bf16::from_float(f_from_bits(u));
    CHECK(kBF16.is_nan(h));
    CHECK((h & 0x0040u) != 0);                        // quiet
    CHECK(((h & 0x8000u) != 0) == ((u >> 31) != 0));  // sign
    CHECK(std::isnan(dt::bf16::to_float(h)));
  }
}

// ------------------------------------------------------------------ dt::convert

namespace {

// Writes v (exactly representable in t) as element i; the 16-bit encodings come from the float
// bit pattern (bf16) and _Float16 (f16), not from dt.
void put(dt::DType t, void* p, std::size_t i, double v) {
  switch (t) {
    case dt::DType::f32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case dt::DType::f64:
      static_cast<double*>(p)[i] = v;
      break;
    case dt::DType::bf16: {
      const u32 b = bits_of(static_cast<float>(v));
      REQUIRE((b & 0xffffu) == 0);
      static_cast<u16*>(p)[i] = static_cast<u16>(b >> 16);
      break;
    }
    case dt::DType::f16:
      static_cast<u16*>(p)[i] = f16_ref(static_cast<float>(v));
      break;
    case dt::DType::i32:
      static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v);
      break;
    case dt::DType::i64:
      static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v);
      break;
    case dt::DType::u8:
      static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v);
      break;
  }
}

double get(dt::DType t, const void* p, std::size_t i) {
  switch (t) {
    case dt::DType::f32:
      return static_cast<const float*>(p)[i];
    case dt::DType::f64:
      return static_cast<const double*>(p)[i];
    case dt::DType::bf16:
      return decode(static_cast<const u16*>(p)[i], kBF16);
    case dt::DType::f16:
      return decode(static_cast<const u16*>(p)[i], kF16);
    case dt::DType::i32:
      return static_cast<const std::int32_t*>(p)[i];
    case dt::DType::i64:
      return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case dt::DType::u8:
      return static_cast<const std::uint8_t*>(p)[i];
  }
  return 0;
}

bool representable(dt::DType t, double v) {
  switch (t) {
    case dt::DType::f32:
      return static_cast<double>(static_cast<float>(v)) == v;
    case dt::DType::f64:
      return true;
    case dt::DType::bf16:
      return round_ref(v, kBF16) == v;
    case dt::DType::f16:
      return round_ref(v, kF16) == v;
    case dt::DType::i32:
      return v == std::trunc(v) && v >= -2147483648.0 && v <= 2147483647.0;
    case dt::DType::i64:
      return v == std::trunc(v) && std::fabs(v) <= 9007199254740992.0;
    case dt::DType::u8:
      return v == std::trunc(v) && v >= 0 && v <= 255;
  }
  return false;
}

}  // namespace

TEST_CASE("convert: values representable in both types survive every dtype pair") {
  const double values[] = {0,     1,    -1,     2,          3,           5,
                           7,     17,   100,    127,        -128,        128,
                           200,   255,  256,    -3.5,       0.5,         -0.75,
                           0.125, 1024, 65504,  2147483647, -2147483648, 1099511627776.0,
                           -17,   0.1,  3.0e38, 1e-3};
  for (dt::DType from : dt::kAllDTypes) {
    for (dt::DType to : dt::kAllDTypes) {
      std::vector<double> vs;
      for (double v : values)
        if (representable(from, v) && representable(to, v)) vs.push_back(v);
      CAPTURE(dt::dtype_name(from));
      CAPTURE(dt::dtype_name(to));
      REQUIRE(vs.size() >= 4);
      std::vector<unsigned char> src(vs.size() * 8), dst(vs.size() * 8 + 8, 0xEE);
      for (std::size_t i = 0; i < vs.size(); ++i) put(from, src.data(), i, vs[i]);
      dt::convert(src.data(), from, dst.data(), to, vs.size());
      for (std::size_t i = 0; i < vs.size(); ++i) {
        CAPTURE(vs[i]);
        CHECK(get(to, dst.data(), i) == vs[i]);
      }
      // Nothing past the n elements is written.
      const std::size_t end = vs.size() * dt::dtype_size(to);
      CHECK(std::all_of(dst.begin() + static_cast<std::ptrdiff_t>(end), dst.end(),
                        [](unsigned char c) { return c == 0xEE; }));
    }
  }
}

TEST_CASE("convert: signed zero and infinities between floating types") {
  const dt::DType fl[] = {dt::DType::f32, dt::DType::f64, dt::DType::bf16, dt::DType::f16};
  const double inf = std::numeric_limits<double>::infinity();
  const double vals[] = {-0.0, inf, -inf};
  for (dt::DType from : fl)
    for (dt::DType to : fl) {
      CAPTURE(dt::dtype_name(from));
      CAPTURE(dt::dtype_name(to));
      unsigned char src[24], dst[24];
      for (std::size_t i = 0; i < 3; ++i) put(from, src, i, vals[i]);
      dt::convert(src, from, dst, to, 3);
      CHECK(get(to, dst, 0) == 0.0);
      CHECK(std::signbit(get(to, dst, 0)));
      CHECK(get(to, dst, 1) == inf);
      CHECK(get(to, dst, 2) == -inf);
    }
}

TEST_CASE("convert: floating to integer truncates toward zero and clamps") {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    double in;
    std::int64_t i32, i64, u8;
  };
  const std::int64_t I32MAX = 2147483647, I32MIN = -2147483647 - 1;
  const std::int64_t I64MAX = std::numeric_limits<std::int64_t>::max();
  const std::int64_t I64MIN = std::numeric_limits<std::int64_t>::min();
  const Case cases[] = {
      {2.75, 2, 2, 2},
      {-2.75, -2, -2, 0},
      {-0.5, 0, 0, 0},
      {0.99, 0, 0, 0},
      {255.5, 255, 255, 255},
      {256.0, 256, 256, 255},
      {300.0, 300, 300, 255},
      {-5.0, -5, -5, 0},
      {3.0e9, I32MAX, 3000000000, 255},
      {-3.0e9, I32MIN, -3000000000, 0},
      {2147483647.75, I32MAX, 2147483647, 255},
      {-2147483648.75, I32MIN, -2147483648LL, 0},
      {1.0e19, I32MAX, I64MAX, 255},
      {-1.0e19, I32MIN, I64MIN, 0},
      {9223372036854775808.0, I32MAX, I64MAX, 255},  // 2^63: one past the i64 range
      {-9223372036854775808.0, I32MIN, I64MIN, 0},   // -2^63: exactly the minimum
      {inf, I32MAX, I64MAX, 255},
      {-inf, I32MIN, I64MIN, 0},
  };
  for (const auto& c : cases) {
    CAPTURE(c.in);
    double d = c.in;
    std::int32_t a = 7;
    std::int64_t b = 7;
    std::uint8_t u = 7;
    dt::convert(&d, dt::DType::f64, &a, dt::DType::i32, 1);
    dt::convert(&d, dt::DType::f64, &b, dt::DType::i64, 1);
    dt::convert(&d, dt::DType::f64, &u, dt::DType::u8, 1);
    CHECK(a == c.i32);
    CHECK(b == c.i64);
    CHECK(u == c.u8);
    // The same through f32 where the value is a float.
    const float f = static_cast<float>(c.in);
    if (static_cast<double>(f) == c.in) {
      a = 7;
      b = 7;
      u = 7;
      dt::convert(&f, dt::DType::f32, &a, dt::DType::i32, 1);
      dt::convert(&f, dt::DType::f32, &b, dt::DType::i64, 1);
      dt::convert(&f, dt::DType::f32, &u, dt::DType::u8, 1);
      CHECK(a == c.i32);
      CHECK(b == c.i64);
      CHECK(u == c.u8);
    }
  }
  // 16-bit sources: bf16 -1.5e5 (exactly -149504), f16 -2.5 and 65504.
  u16 h[3] = {static_cast<u16>(bits_of(-149504.0f) >> 16), f16_ref(-2.5f), f16_ref(65504.0f)};
  REQUIRE(decode(h[0], kBF16) == -149504.0);
  std::int32_t out = 0;
  dt::convert(&h[0], dt::DType::bf16, &out, dt::DType::i32, 1);
  CHECK(out == -149504);
  std::uint8_t ub = 9;
  dt::convert(&h[0], dt::DType::bf16, &ub, dt::DType::u8, 1);
  CHECK(ub == 0);
  dt::convert(&h[1], dt::DType::f16, &out, dt::DType::i32, 1);
  CHECK(out == -2);
  dt::convert(&h[2], dt::DType::f16, &ub, dt::DType::u8, 1);
  CHECK(ub == 255);
}

TEST_CASE("convert: NaN becomes 0 in every integer type, from every floating type") {
  const u32 nan_bits[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u};
  for (u32 nb : nan_bits) {
    const float fn = f_from_bits(nb);
    const double dn = static_cast<double>(fn);
    const u16 bn = static_cast<u16>((nb >> 16) | 0x40u);
    const u16 hn = (nb >> 31) ? 0xfe00 : 0x7e00;
    const void* srcs[] = {&fn, &dn, &bn, &hn};
    const dt::DType types[] = {dt::DType::f32, dt::DType::f64, dt::DType::bf16, dt::DType::f16};
    for (int k = 0; k < 4; ++k) {
      CAPTURE(dt::dtype_name(types[k]));
      CAPTURE(hex(nb));
      std::int32_t a = 7;
      std::int64_t b = 7;
      std::uint8_t u = 7;
      dt::convert(srcs[k], types[k], &a, dt::DType::i32, 1);
      dt::convert(srcs[k], types[k], &b, dt::DType::i64, 1);
      dt::convert(srcs[k], types[k], &u, dt::DType::u8, 1);
      CHECK(a == 0);
      CHECK(b == 0);
      CHECK(u == 0);
    }
  }
}

TEST_CASE("convert: NaN stays NaN between floating types") {
  const float fn = f_from_bits(0xffc00000u);  // negative quiet NaN
  float f = 0;
  double d = 0;
  u16 b = 0, h = 0;
  dt::convert(&fn, dt::DType::f32, &d, dt::DType::f64, 1);
  dt::convert(&fn, dt::DType::f32, &b, dt::DType::bf16, 1);
  dt::convert(&fn, dt::DType::f32, &h, dt::DType::f16, 1);
  CHECK(std::isnan(d));
  CHECK(std::signbit(d));
  CHECK(kBF16.is_nan(b));
  CHECK((b & 0x8000u) != 0);
  CHECK(kF16.is_nan(h));
  CHECK((h & 0x8000u) != 0);
  dt::convert(&h, dt::DType::f16, &b, dt::DType::bf16, 1);
  CHECK(kBF16.is_nan(b));
  dt::convert(&b, dt::DType::bf16, &f, dt::DType::f32, 1);
  CHECK(std::isnan(f));
  dt::convert(&d, dt::DType::f64, &h, dt::DType::f16, 1);
  CHECK(kF16.is_nan(h));
}

TEST_CASE("convert: integer to integer clamps") {
  const std::int64_t big[] = {5000000000LL,
                              -5000000000LL,
                              std::numeric_limits<std::int64_t>::max(),
                              std::numeric_limits<std::int64_t>::min(),
                              -1,
                              256,
                              255,
                              0,
                              42};
  std::int32_t i32[9];
  std::uint8_t u8[9];
  dt::convert(big, dt::DType::i64, i32, dt::DType::i32, 9);
  dt::convert(big, dt::DType::i64, u8, dt::DType::u8, 9);
  const std::int32_t want32[] = {
      2147483647, -2147483647 - 1, 2147483647, -2147483647 - 1, -1, 256, 255, 0, 42};
  const std::uint8_t want8[] = {255, 0, 255, 0, 0, 255, 255, 0, 42};
  for (int i = 0; i < 9; ++i) {
    CAPTURE(big[i]);
    CHECK(i32[i] == want32[i]);
    CHECK(u8[i] == want8[i]);
  }
  const std::int32_t s[] = {-1, 300, 255, -2147483647 - 1};
  std::uint8_t su[4];
  std::int64_t s64[4];
  dt::convert(s, dt::DType::i32, su, dt::DType::u8, 4);
  dt::convert(s, dt::DType::i32, s64, dt::DType::i64, 4);
  CHECK(su[0] == 0);
  CHECK(su[1] == 255);
  CHECK(su[2] == 255);
  CHECK(su[3] == 0);
  CHECK(s64[0] == -1);
  CHECK(s64[1] == 300);
  CHECK(s64[3] == -2147483648LL);
  const std::uint8_t us[] = {0, 200, 255};
  std::int32_t ui[3];
  dt::convert(us, dt::DType::u8, ui, dt::DType::i32, 3);
  CHECK(ui[0] == 0);
  CHECK(ui[1] == 200);
  CHECK(ui[2] == 255);
  // Same type: a plain copy, exact for values no double can hold.
  const std::int64_t odd[] = {9007199254740993LL, std::numeric_limits<std::int64_t>::max()};
  std::int64_t copy[2] = {0, 0};
  dt::convert(odd, dt::DType::i64, copy, dt::DType::i64, 2);
  CHECK(copy[0] == odd[0]);
  CHECK(copy[1] == odd[1]);
}

TEST_CASE(
    "convert: float to bf16/f16 rounds like the scalar conversions; one rounding to 16 bits") {
  std::vector<float> in;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 65537 * 31)
    in.push_back(f_from_bits(static_cast<u32>(u)));
  in.push_back(1.0f + std::ldexp(1.0f, -8));
  in.push_back(2.0f - std::ldexp(1.0f, -11));
  in.push_back(65520.0f);
  std::vector<u16> b(in.size()), h(in.size());
  dt::convert(in.data(), dt::DType::f32, b.data(), dt::DType::bf16, in.size());
  dt::convert(in.data(), dt::DType::f32, h.data(), dt::DType::f16, in.size());
  Tally t;
  for (std::size_t i = 0; i < in.size(); ++i) {
    check_one(in[i], b[i], kBF16, t, "convert bf16");
    check_one(in[i], h[i], kF16, t, "convert f16");
  }
  INFO("first mismatch: ", t.first);
  CHECK(t.bad == 0);

  // f16 -> bf16 and bf16 -> f16 round once, from the exact value.
  const u16 f16_in[] = {f16_ref(1.0f + std::ldexp(1.0f, -8)),
                        f16_ref(1.0f + 3 * std::ldexp(1.0f, -8)),
                        f16_ref(1.0f + 5 * std::ldexp(1.0f, -10))};
  u16 f16_to_bf16[3];
  dt::convert(f16_in, dt::DType::f16, f16_to_bf16, dt::DType::bf16, 3);
  CHECK(f16_to_bf16[0] == 0x3f80);  // tie -> even
  CHECK(f16_to_bf16[1] == 0x3f82);  // tie -> even (up)
  CHECK(f16_to_bf16[2] == 0x3f81);  // 1.25 ulp -> 1 ulp
  const u16 bf16_in[] = {static_cast<u16>(bits_of(1.0e5f) >> 16),
                         static_cast<u16>(bits_of(std::ldexp(1.0f, -30)) >> 16),
                         static_cast<u16>(bits_of(3.0f) >> 16)};
  u16 bf16_to_f16[3];
  dt::convert(bf16_in, dt::DType::bf16, bf16_to_f16, dt::DType::f16, 3);
  CHECK(bf16_to_f16[0] == 0x7c00);  // 99840 overflows f16
  CHECK(bf16_to_f16[1] == 0x0000);  // 2^-30 underflows to +0
  CHECK(bf16_to_f16[2] == 0x4200);

  // f64 -> f32 rounds like the language's conversion.
  const double dd[] = {0.1, -1.0 / 3.0, 1e300, 1e-300};
  float ff[4];
  dt::convert(dd, dt::DType::f64, ff, dt::DType::f32, 4);
  for (int i = 0; i < 4; ++i) CHECK(bits_of(ff[i]) == bits_of(static_cast<float>(dd[i])));
}

TEST_CASE("convert: n == 0 touches nothing") {
  CHECK_NOTHROW(dt::convert(nullptr, dt::DType::f32, nullptr, dt::DType::bf16, 0));
  CHECK_NOTHROW(dt::convert(nullptr, dt::DType::i64, nullptr, dt::DType::i64, 0));
  CHECK_NOTHROW(dt::convert(nullptr, dt::DType::f16, nullptr, dt::DType::u8, 0));
}

TEST_CASE("convert rounds integers into 16-bit and f32 types once, not twice") {
  // 2^24 + 2^16 + 1 lies just above the midpoint of the bf16 neighbours 2^24 and 2^24 + 2^17;
  // rounding through float first lands exactly on the midpoint and ties down to 2^24.
  const std::int32_t i = (1 << 24) + (1 << 16) + 1;
  std::uint16_t out = 0;
  dt::convert(&i, dt::DType::i32, &out, dt::DType::bf16, 1);
  CHECK(dt::bf16::to_float(out) == static_cast<float>((1 << 24) + (1 << 17)));
  // 2^60 + 2^36 + 1 -> f32: through double it would tie down to 2^60.
  const std::int64_t j = (std::int64_t{1} << 60) + (std::int64_t{1} << 36) + 1;
  float f = 0;
  dt::convert(&j, dt::DType::i64, &f, dt::DType::f32, 1);
  CHECK(f == std::ldexp(1.0f, 60) + std::ldexp(1.0f, 37));
  // f64 -> f16 with a value just above an f16 midpoint that f32 would round onto it.
  const double d = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  dt::convert(&d, dt::DType::f64, &out, dt::DType::f16, 1);
  CHECK(dt::f16::to_float(out) == 1.0f + std::ldexp(1.0f, -10));
}
