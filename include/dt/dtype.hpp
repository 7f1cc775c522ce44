// Element types and the 16-bit floating-point formats.
//
// bf16 and f16 are storage types: arithmetic happens in float. Conversions from float round to
// nearest, ties to even; NaN stays NaN (quiet, sign kept), overflow goes to +-Inf, f16 keeps
// subnormals. Conversions to float are exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dt {

enum class DType : std::uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

/// Every dtype, in declaration order (for tests and option help).
inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                       DType::i32, DType::i64, DType::u8};

/// Bytes per element.
std::size_t dtype_size(DType t) noexcept;
/// "f32", "bf16", ...
const char* dtype_name(DType t) noexcept;
/// Parses a dtype name; throws dt::InvalidArgument naming the text and the accepted names.
DType parse_dtype(std::string_view name);
bool is_floating(DType t) noexcept;

/// Brain float: 1 sign, 8 exponent, 7 mantissa bits.
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  static std::uint16_t from_float(float f) noexcept;
  static float to_float(std::uint16_t b) noexcept;
  static bf16 from_bits(std::uint16_t b) noexcept {
    bf16 h;
    h.bits = b;
    return h;
  }
};

/// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits.
struct f16 {
  std::uint16_t bits = 0;
  f16() = default;
  explicit f16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  static std::uint16_t from_float(float f) noexcept;
  static float to_float(std::uint16_t b) noexcept;
  static f16 from_bits(std::uint16_t b) noexcept {
    f16 h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2, "16-bit types must be packed");

/// Converts n elements of type `from` at src into type `to` at dst (no overlap), rounding once
/// to nearest even. Floating to integer truncates toward zero; values out of the integer range are
/// clamped; NaN becomes 0.
void convert(const void* src, DType from, void* dst, DType to, std::size_t n);

/// Maps a C++ element type to its DType.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<std::int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_of<std::uint8_t> {
  static constexpr DType value = DType::u8;
};
template <class T>
inline constexpr DType dtype_v = dtype_of<T>::value;

/// Calls f(T{}) with T the C++ type of `t`.
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      return f(float{});
    case DType::f64:
      return f(double{});
    case DType::bf16:
      return f(bf16{});
    case DType::f16:
      return f(f16{});
    case DType::i32:
      return f(std::int32_t{});
    case DType::i64:
      return f(std::int64_t{});
    case DType::u8:
      break;
  }
  return f(std::uint8_t{});
}

}  // namespace dt
