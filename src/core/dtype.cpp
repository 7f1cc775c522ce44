#include "dt/dtype.hpp"

#include <cmath>
#include <limits>
#include <type_traits>

#include "dt/error.hpp"

namespace dt {

std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  for (DType t : kAllDTypes)
    if (name == dtype_name(t)) return t;
  DT_THROW(InvalidArgument, "unknown dtype '", name,
           "' (expected one of f32 f64 bf16 f16 i32 i64 u8)");
}

bool is_floating(DType t) noexcept {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
}

namespace {
std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

std::uint16_t bf16::from_float(float f) noexcept {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  // Round to nearest even on the 16 dropped bits; a carry into the exponent gives Inf correctly.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

float bf16::to_float(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

std::uint16_t f16::from_float(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: Inf
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -25) return sign;  // below half the smallest subnormal: +-0
  std::uint32_t mant = (a & 0x7fffffu) | (exp > -127 ? 0x800000u : 0u);
  int shift;
  std::uint32_t base;
  if (exp < -14) {     // subnormal in f16: value = mant * 2^(exp-23), unit 2^-24
    shift = -exp - 1;  // 13 + (-14 - exp)
    base = 0;
  } else {
    shift = 13;
    base = static_cast<std::uint32_t>(exp + 15) << 10;
    mant &= 0x7fffffu;
  }
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // carries into the exponent correctly
  return static_cast<std::uint16_t>(sign | (base + q));
}

float f16::to_float(std::uint16_t b) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x8000u) << 16;
  const std::uint32_t exp = (b >> 10) & 0x1fu;
  std::uint32_t mant = b & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal: normalise.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return bits_float(sign | ((112u - static_cast<std::uint32_t>(e)) << 23) |
                    ((mant & 0x3ffu) << 13));
}

namespace {

// Every value of every dtype is exact in long double (x86-64: 64-bit significand).
template <class T>
long double load(const T& v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return static_cast<long double>(static_cast<float>(v));
  else
    return static_cast<long double>(v);
}

// Rounds to float with round-to-odd: a later round-to-nearest-even into a format with at least
// two fewer significand bits (bf16, f16) then equals one correct rounding of v.
float round_to_odd_float(long double v) {
  const float f = static_cast<float>(v);
  if (std::isnan(v) || static_cast<long double>(f) == v) return f;
  std::uint32_t u = float_bits(f);
  if (std::isinf(f) || std::fabs(static_cast<long double>(f)) > std::fabs(v)) --u;  // toward zero
  return bits_float(u | 1u);
}

template <class T>
T store(long double v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) {
    return T(round_to_odd_float(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(v);
  } else {
    if (std::isnan(v)) return T{0};
    if (v <= static_cast<long double>(std::numeric_limits<T>::min()))
      return std::numeric_limits<T>::min();
    if (v >= static_cast<long double>(std::numeric_limits<T>::max()))
      return std::numeric_limits<T>::max();
    return static_cast<T>(v);
  }
}

}  // namespace

void convert(const void* src, DType from, void* dst, DType to, std::size_t n) {
  if (n == 0) return;
  if (from == to) {
    std::memcpy(dst, src, n * dtype_size(from));
    return;
  }
  // f32 <-> 16-bit: direct paths (the common ones, exact semantics without double rounding).
  if (from == DType::f32 && (to == DType::bf16 || to == DType::f16)) {
    const float* s = static_cast<const float*>(src);
    std::uint16_t* d = static_cast<std::uint16_t*>(dst);
    if (to == DType::bf16)
      for (std::size_t i = 0; i < n; ++i) d[i] = bf16::from_float(s[i]);
    else
      for (std::size_t i = 0; i < n; ++i) d[i] = f16::from_float(s[i]);
    return;
  }
  // Everything else goes through long double, which holds every value exactly, and rounds once.
  visit_dtype(from, [&](auto fs) {
    using S = decltype(fs);
    visit_dtype(to, [&](auto fd) {
      using D = decltype(fd);
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      if constexpr (std::is_integral_v<S> && std::is_integral_v<D>) {
        for (std::size_t i = 0; i < n; ++i) {
          const long double v = static_cast<long double>(s[i]);
          d[i] = v < static_cast<long double>(std::numeric_limits<D>::min())
                     ? std::numeric_limits<D>::min()
                 : v > static_cast<long double>(std::numeric_limits<D>::max())
                     ? std::numeric_limits<D>::max()
                     : static_cast<D>(s[i]);
        }
      } else {
        for (std::size_t i = 0; i < n; ++i) d[i] = store<D>(load(s[i]));
      }
    });
  });
}

}  // namespace dt
