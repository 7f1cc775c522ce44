// dt::Tensor: a dtype, a shape and contiguous, 64-byte aligned host storage it owns.
// dt::TensorView / ConstTensorView: a non-owning (pointer, element count, dtype) window that
// communicators and kernels take, so a Tensor, a slice of a bucket or a plain vector can be passed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dt/dtype.hpp"
#include "dt/error.hpp"

namespace dt {

using Shape = std::vector<std::int64_t>;

/// Number of elements of a shape; throws InvalidArgument on a negative extent.
std::size_t shape_numel(const Shape& s);
/// "[2, 3, 4]"
std::string shape_str(const Shape& s);

struct ConstTensorView {
  const void* data = nullptr;
  std::size_t numel = 0;
  DType dtype = DType::f32;

  std::size_t nbytes() const noexcept { return numel * dtype_size(dtype); }
  template <class T>
  const T* as() const {
    DT_CHECK_EQ(InvalidArgument, dtype_name(dtype_v<T>), std::string(dtype_name(dtype)),
                "view element type mismatch");
    return static_cast<const T*>(data);
  }
};

struct TensorView {
  void* data = nullptr;
  std::size_t numel = 0;
  DType dtype = DType::f32;

  std::size_t nbytes() const noexcept { return numel * dtype_size(dtype); }
  operator ConstTensorView() const noexcept { return {data, numel, dtype}; }
  template <class T>
  T* as() const {
    DT_CHECK_EQ(InvalidArgument, dtype_name(dtype_v<T>), std::string(dtype_name(dtype)),
                "view element type mismatch");
    return static_cast<T*>(data);
  }
  /// Elements [offset, offset + count) of this view.
  TensorView slice(std::size_t offset, std::size_t count) const;
};

/// Views over a std::vector (or any contiguous T array) without copying.
template <class T>
TensorView view_of(T* p, std::size_t n) {
  return {p, n, dtype_v<T>};
}
template <class T>
ConstTensorView view_of(const T* p, std::size_t n) {
  return {p, n, dtype_v<T>};
}
template <class T>
TensorView view_of(std::vector<T>& v) {
  return {v.data(), v.size(), dtype_v<T>};
}
template <class T>
ConstTensorView view_of(const std::vector<T>& v) {
  return {v.data(), v.size(), dtype_v<T>};
}

class Tensor {
 public:
  Tensor() = default;
  /// Zero-filled tensor. Allocation failure throws std::bad_alloc.
  Tensor(Shape shape, DType dtype);
  static Tensor zeros(Shape shape, DType dtype) { return Tensor(std::move(shape), dtype); }
  template <class T>
  static Tensor from(const std::vector<T>& values, Shape shape) {
    Tensor t(std::move(shape), dtype_v<T>);
    DT_CHECK_EQ(InvalidArgument, t.numel(), values.size(), "Tensor::from: shape and value count");
    std::copy(values.begin(), values.end(), t.data<T>());
    return t;
  }

  /// A moved-from tensor is empty (numel 0, no storage).
  Tensor(Tensor&& o) noexcept { *this = std::move(o); }
  Tensor& operator=(Tensor&& o) noexcept {
    shape_ = std::move(o.shape_);
    numel_ = o.numel_;
    dtype_ = o.dtype_;
    storage_ = std::move(o.storage_);
    o.shape_.clear();
    o.numel_ = 0;
    return *this;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  /// Deep copy.
  Tensor clone() const;

  DType dtype() const noexcept { return dtype_; }
  const Shape& shape() const noexcept { return shape_; }
  std::size_t dim() const noexcept { return shape_.size(); }
  std::size_t numel() const noexcept { return numel_; }
  std::size_t nbytes() const noexcept { return numel_ * dtype_size(dtype_); }

  void* raw() noexcept { return storage_.get(); }
  const void* raw() const noexcept { return storage_.get(); }
  template <class T>
  T* data() {
    check_type(dtype_v<T>);
    return static_cast<T*>(raw());
  }
  template <class T>
  const T* data() const {
    check_type(dtype_v<T>);
    return static_cast<const T*>(raw());
  }

  TensorView view() noexcept { return {raw(), numel_, dtype_}; }
  ConstTensorView view() const noexcept { return {raw(), numel_, dtype_}; }
  operator TensorView() noexcept { return view(); }
  operator ConstTensorView() const noexcept { return view(); }

  /// Same data, new shape with the same element count.
  Tensor& reshape(Shape shape);
  /// A converted copy (round to nearest even into bf16/f16; see dt::convert).
  Tensor to(DType dtype) const;

 private:
  struct Free {
    void operator()(void* p) const noexcept;
  };
  void check_type(DType want) const;

  Shape shape_;
  std::size_t numel_ = 0;
  DType dtype_ = DType::f32;
  std::unique_ptr<void, Free> storage_;
};

}  // namespace dt
