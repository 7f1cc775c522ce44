// dt::Tensor, TensorView / ConstTensorView, shape helpers.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dt/dtype.hpp"
#include "dt/error.hpp"
#include "dt/tensor.hpp"

namespace {

bool aligned64(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; }

bool all_zero(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != 0) return false;
  return true;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Element sizes written out here, not taken from dt.
std::size_t size_of(dt::DType t) {
  switch (t) {
    case dt::DType::f32:
      return 4;
    case dt::DType::f64:
      return 8;
    case dt::DType::bf16:
      return 2;
    case dt::DType::f16:
      return 2;
    case dt::DType::i32:
      return 4;
    case dt::DType::i64:
      return 8;
    case dt::DType::u8:
      return 1;
  }
  return 0;
}

template <class F>
void check_throws_invalid(F&& f, const std::string& needle) {
  try {
    f();
    FAIL_CHECK("no throw; expected dt::InvalidArgument mentioning '", needle, "'");
  } catch (const dt::InvalidArgument& e) {
    INFO("message: ", e.message());
    CHECK(e.message().find(needle) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("shape helpers") {
  CHECK(dt::shape_numel({}) == 1);
  CHECK(dt::shape_numel({7}) == 7);
  CHECK(dt::shape_numel({2, 3, 4}) == 24);
  CHECK(dt::shape_numel({2, 0, 4}) == 0);
  CHECK(dt::shape_str({}) == "[]");
  CHECK(dt::shape_str({5}) == "[5]");
  CHECK(dt::shape_str({2, 3, 4}) == "[2, 3, 4]");
  check_throws_invalid([] { dt::shape_numel({2, -1, 3}); }, "[2, -1, 3]");
  CHECK_THROWS_AS(dt::shape_numel({-1}), dt::InvalidArgument);
  CHECK_THROWS_AS(dt::shape_numel({0, -5}), dt::InvalidArgument);  // even after a zero extent
}

TEST_CASE("Tensor: shape, numel, nbytes for every dtype") {
  for (dt::DType t : dt::kAllDTypes) {
    CAPTURE(dt::dtype_name(t));
    dt::Tensor x({2, 3, 4}, t);
    CHECK(x.dtype() == t);
    CHECK(x.shape() == dt::Shape{2, 3, 4});
    CHECK(x.dim() == 3);
    CHECK(x.numel() == 24);
    CHECK(x.nbytes() == 24 * size_of(t));
    CHECK(x.raw() != nullptr);
    CHECK(aligned64(x.raw()));
    CHECK(all_zero(x.raw(), x.nbytes()));
    const dt::ConstTensorView v = x.view();
    CHECK(v.data == x.raw());
    CHECK(v.numel == 24);
    CHECK(v.dtype == t);
    CHECK(v.nbytes() == x.nbytes());
  }
  dt::Tensor s({}, dt::DType::f64);  // a scalar
  CHECK(s.dim() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.nbytes() == 8);
  CHECK(s.data<double>()[0] == 0.0);

  dt::Tensor empty({3, 0}, dt::DType::f32);
  CHECK(empty.numel() == 0);
  CHECK(empty.nbytes() == 0);
  CHECK(empty.dim() == 2);
  dt::Tensor e2 = empty.clone();
  CHECK(e2.numel() == 0);
  CHECK(e2.shape() == dt::Shape{3, 0});
  dt::Tensor e3 = empty.to(dt::DType::bf16);
  CHECK(e3.numel() == 0);
  CHECK(e3.dtype() == dt::DType::bf16);

  dt::Tensor def;
  CHECK(def.numel() == 0);
  CHECK(def.nbytes() == 0);
  CHECK(def.dim() == 0);
}

TEST_CASE("Tensor: storage is zero-filled and 64-byte aligned for odd sizes") {
  for (std::int64_t n : {1, 3, 15, 16, 17, 63, 64, 65, 1000, 4097, 100003}) {
    CAPTURE(n);
    {
      // Dirty a block of the same size first so that a reused block would show garbage.
      dt::Tensor dirty({n}, dt::DType::u8);
      std::memset(dirty.raw(), 0xAB, dirty.nbytes());
    }
    dt::Tensor x({n}, dt::DType::u8);
    CHECK(aligned64(x.raw()));
    CHECK(all_zero(x.raw(), x.nbytes()));
    dt::Tensor y = dt::Tensor::zeros({n, 3}, dt::DType::f16);
    CHECK(aligned64(y.raw()));
    CHECK(y.nbytes() == static_cast<std::size_t>(n) * 6);
    CHECK(all_zero(y.raw(), y.nbytes()));
  }
}

TEST_CASE("Tensor: a negative extent throws InvalidArgument naming the shape") {
  check_throws_invalid([] { dt::Tensor t({4, -2}, dt::DType::f32); }, "[4, -2]");
  CHECK_THROWS_AS(dt::Tensor::zeros({-1}, dt::DType::u8), dt::InvalidArgument);
}

TEST_CASE("Tensor::from and data<T>()") {
  dt::Tensor t = dt::Tensor::from(std::vector<std::int32_t>{1, -2, 3, 4, 5, 6}, {2, 3});
  CHECK(t.dtype() == dt::DType::i32);
  CHECK(t.shape() == dt::Shape{2, 3});
  const std::int32_t* p = t.data<std::int32_t>();
  CHECK(p[0] == 1);
  CHECK(p[1] == -2);
  CHECK(p[5] == 6);
  CHECK(static_cast<const void*>(p) == t.raw());

  check_throws_invalid(
      [] {
        dt::Tensor::from(std::vector<float>{1, 2, 3}, {2, 2});
      },
      "Tensor::from");
}

TEST_CASE("Tensor: data<T>() with the wrong type throws InvalidArgument") {
  dt::Tensor t({4}, dt::DType::f32);
  CHECK_NOTHROW(t.data<float>());
  check_throws_invalid([&] { t.data<double>(); }, "f64");
  check_throws_invalid([&] { t.data<std::int32_t>(); }, "f32");  // same size, other type
  CHECK_THROWS_AS(t.data<dt::bf16>(), dt::InvalidArgument);
  CHECK_THROWS_AS(t.data<std::uint8_t>(), dt::InvalidArgument);
  const dt::Tensor& ct = t;
  CHECK_NOTHROW(ct.data<float>());
  CHECK_THROWS_AS(ct.data<std::int32_t>(), dt::InvalidArgument);

  dt::Tensor h({2}, dt::DType::f16);
  CHECK_NOTHROW(h.data<dt::f16>());
  CHECK_THROWS_AS(h.data<dt::bf16>(), dt::InvalidArgument);  // same size, other format
}

TEST_CASE("Tensor: clone is a deep copy") {
  dt::Tensor a = dt::Tensor::from(std::vector<double>{1.5, 2.5, 3.5, 4.5}, {2, 2});
  dt::Tensor b = a.clone();
  CHECK(b.raw() != a.raw());
  CHECK(aligned64(b.raw()));
  CHECK(b.shape() == a.shape());
  CHECK(b.dtype() == a.dtype());
  CHECK(std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
  b.data<double>()[0] = -7;
  b.reshape({4});
  CHECK(a.data<double>()[0] == 1.5);
  CHECK(a.shape() == dt::Shape{2, 2});
  a.data<double>()[3] = 99;
  CHECK(b.data<double>()[3] == 4.5);
}

TEST_CASE("Tensor: move keeps the storage") {
  dt::Tensor a = dt::Tensor::from(std::vector<float>{1, 2, 3}, {3});
  const void* p = a.raw();
  dt::Tensor b(std::move(a));
  CHECK(b.raw() == p);
  CHECK(b.numel() == 3);
  CHECK(b.data<float>()[2] == 3.0f);
  dt::Tensor c;
  c = std::move(b);
  CHECK(c.raw() == p);
  CHECK(c.shape() == dt::Shape{3});
}

TEST_CASE("Tensor: reshape keeps the data and checks the element count") {
  dt::Tensor t =
      dt::Tensor::from(std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4});
  const void* p = t.raw();
  dt::Tensor& r = t.reshape({2, 2, 3});
  CHECK(&r == &t);
  CHECK(t.shape() == dt::Shape{2, 2, 3});
  CHECK(t.dim() == 3);
  CHECK(t.numel() == 12);
  CHECK(t.raw() == p);
  CHECK(t.data<std::int64_t>()[11] == 11);
  t.reshape({12});
  CHECK(t.shape() == dt::Shape{12});

  check_throws_invalid([&] { t.reshape({5, 3}); }, "[5, 3]");
  CHECK(t.shape() == dt::Shape{12});                          // unchanged after a failed reshape
  CHECK_THROWS_AS(t.reshape({-3, -4}), dt::InvalidArgument);  // product matches, extents do not
  CHECK_THROWS_AS(t.reshape({13}), dt::InvalidArgument);
  CHECK_THROWS_AS(t.reshape({0}), dt::InvalidArgument);
  CHECK(t.shape() == dt::Shape{12});
  t.reshape({1, 12, 1});
  CHECK(t.shape() == dt::Shape{1, 12, 1});
}

TEST_CASE("Tensor::to(bf16/f16) rounds each element like the scalar conversion") {
  // Ties, the tie that carries into the exponent, overflow, subnormals, signed zero, NaN.
  std::vector<float> v = {1.0f,
                          1.0f + std::ldexp(1.0f, -8),      // bf16 tie -> 1.0
                          1.0f + 3 * std::ldexp(1.0f, -8),  // bf16 tie -> up
                          2.0f - std::ldexp(1.0f, -8),      // bf16 tie carrying to 2.0
                          2.0f - std::ldexp(1.0f, -11),     // f16 tie carrying to 2.0
                          65520.0f,                         // f16 overflow
                          -0.0f,
                          std::ldexp(1.0f, -25),   // f16 subnormal tie -> 0
                          std::ldexp(3.0f, -134),  // float subnormal, bf16 tie
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          0.1f,
                          -123.456f};
  for (std::uint32_t u = 0x3f800000u; u < 0x3f800000u + 4096; u += 7) {
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
  }
  const std::int64_t n = static_cast<std::int64_t>(v.size());
  dt::Tensor a = dt::Tensor::from(v, {n});
  dt::Tensor b = a.to(dt::DType::bf16);
  dt::Tensor h = a.to(dt::DType::f16);
  CHECK(b.dtype() == dt::DType::bf16);
  CHECK(b.shape() == a.shape());
  CHECK(b.nbytes() == v.size() * 2);
  CHECK(aligned64(b.raw()));
  int bad = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (b.data<dt::bf16>()[i].bits != dt::bf16::from_float(v[i])) ++bad;
    if (h.data<dt::f16>()[i].bits != dt::f16::from_float(v[i])) ++bad;
  }
  CHECK(bad == 0);
  // A few by hand, from the definitions.
  CHECK(b.data<dt::bf16>()[0].bits == 0x3f80);
  CHECK(b.data<dt::bf16>()[1].bits == 0x3f80);
  CHECK(b.data<dt::bf16>()[2].bits == 0x3f82);
  CHECK(b.data<dt::bf16>()[3].bits == 0x4000);
  CHECK(h.data<dt::f16>()[4].bits == 0x4000);
  CHECK(h.data<dt::f16>()[5].bits == 0x7c00);
  CHECK(b.data<dt::bf16>()[6].bits == 0x8000);
  CHECK(h.data<dt::f16>()[7].bits == 0x0000);
  CHECK(b.data<dt::bf16>()[8].bits == 0x0002);  // 1.5 units of 2^-133 -> 2
  CHECK(b.data<dt::bf16>()[9].bits == 0x7f80);

  // Back to f32 is exact: the bf16 pattern shifted into the top half.
  dt::Tensor back = b.to(dt::DType::f32);
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (bits_of(back.data<float>()[i]) != static_cast<std::uint32_t>(b.data<dt::bf16>()[i].bits)
                                              << 16)
      ++bad;
  }
  CHECK(bad == 0);
  // The source is untouched.
  CHECK(std::memcmp(a.data<float>(), v.data(), v.size() * 4) == 0);
}

TEST_CASE("Tensor::to integer types truncates and clamps") {
  dt::Tensor a = dt::Tensor::from(std::vector<float>{2.9f, -2.9f, 300.0f, -1.0f, 1e20f}, {5});
  dt::Tensor i = a.to(dt::DType::i32);
  dt::Tensor u = a.to(dt::DType::u8);
  const std::int32_t wi[] = {2, -2, 300, -1, 2147483647};
  const std::uint8_t wu[] = {2, 0, 255, 0, 255};
  for (int k = 0; k < 5; ++k) {
    CHECK(i.data<std::int32_t>()[k] == wi[k]);
    CHECK(u.data<std::uint8_t>()[k] == wu[k]);
  }
  dt::Tensor same = a.to(dt::DType::f32);
  CHECK(same.raw() != a.raw());
  CHECK(std::memcmp(same.raw(), a.raw(), a.nbytes()) == 0);
}

TEST_CASE("views: fields, typed access, conversion to const") {
  dt::Tensor t = dt::Tensor::from(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7}, {2, 4});
  dt::TensorView v = t;  // implicit
  CHECK(v.data == t.raw());
  CHECK(v.numel == 8);
  CHECK(v.dtype == dt::DType::f32);
  CHECK(v.nbytes() == 32);
  CHECK(v.as<float>()[3] == 3.0f);
  check_throws_invalid([&] { v.as<double>(); }, "mismatch");
  CHECK_THROWS_AS(v.as<std::int32_t>(), dt::InvalidArgument);
  dt::ConstTensorView cv = v;
  CHECK(cv.data == t.raw());
  CHECK(cv.numel == 8);
  CHECK(cv.as<float>()[7] == 7.0f);
  CHECK_THROWS_AS(cv.as<std::int32_t>(), dt::InvalidArgument);
  const dt::Tensor& ct = t;
  dt::ConstTensorView cv2 = ct;
  CHECK(cv2.data == t.raw());

  std::vector<std::int64_t> vec{10, 20, 30};
  dt::TensorView vv = dt::view_of(vec);
  CHECK(vv.data == vec.data());
  CHECK(vv.numel == 3);
  CHECK(vv.dtype == dt::DType::i64);
  CHECK(vv.nbytes() == 24);
  const std::vector<std::uint8_t> cvec{1, 2};
  dt::ConstTensorView cvv = dt::view_of(cvec);
  CHECK(cvv.dtype == dt::DType::u8);
  CHECK(cvv.numel == 2);
  double arr[5] = {};
  dt::TensorView av = dt::view_of(arr, 5);
  CHECK(av.dtype == dt::DType::f64);
  CHECK(av.nbytes() == 40);
}

TEST_CASE("views: slice offsets, lengths and bounds") {
  std::vector<std::int32_t> vec{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  dt::TensorView v = dt::view_of(vec);
  dt::TensorView s = v.slice(3, 4);
  CHECK(s.data == static_cast<void*>(vec.data() + 3));
  CHECK(s.numel == 4);
  CHECK(s.dtype == dt::DType::i32);
  CHECK(s.as<std::int32_t>()[0] == 3);
  CHECK(s.as<std::int32_t>()[3] == 6);
  s.as<std::int32_t>()[0] = -3;  // a view, not a copy
  CHECK(vec[3] == -3);
  // Slices of slices.
  dt::TensorView ss = s.slice(1, 2);
  CHECK(ss.data == static_cast<void*>(vec.data() + 4));
  CHECK(ss.numel == 2);
  CHECK_THROWS_AS(s.slice(3, 2), dt::InvalidArgument);
  // Edges.
  CHECK(v.slice(0, 10).numel == 10);
  CHECK(v.slice(10, 0).numel == 0);
  CHECK(v.slice(10, 0).data == static_cast<void*>(vec.data() + 10));
  CHECK_THROWS_AS(v.slice(0, 11), dt::InvalidArgument);
  CHECK_THROWS_AS(v.slice(9, 2), dt::InvalidArgument);
  CHECK_THROWS_AS(v.slice(11, 0), dt::InvalidArgument);
  check_throws_invalid([&] { v.slice(7, 5); }, "slice out of range");
  // offset + count wrapping around size_t must not pass the check.
  const std::size_t huge = std::numeric_limits<std::size_t>::max();
  CHECK_THROWS_AS(v.slice(huge, 2), dt::InvalidArgument);
  CHECK_THROWS_AS(v.slice(2, huge), dt::InvalidArgument);
  CHECK_THROWS_AS(v.slice(huge, 1), dt::InvalidArgument);
  CHECK_THROWS_AS(v.slice(huge / 2 + 1, huge / 2 + 1), dt::InvalidArgument);

  // Byte offsets follow the element size.
  dt::Tensor t({6}, dt::DType::f64);
  dt::TensorView tv = t;
  CHECK(tv.slice(2, 3).data == static_cast<void*>(static_cast<char*>(t.raw()) + 16));
  CHECK(tv.slice(2, 3).nbytes() == 24);
  dt::Tensor h({6}, dt::DType::bf16);
  dt::TensorView hv = h;
  CHECK(hv.slice(5, 1).data == static_cast<void*>(static_cast<char*>(h.raw()) + 10));
}
