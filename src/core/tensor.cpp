#include "dt/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

namespace dt {

std::size_t shape_numel(const Shape& s) {
  std::size_t n = 1;
  for (auto d : s) {
    DT_CHECK_GE(InvalidArgument, d, 0, "shape ", shape_str(s), " has a negative extent");
    n *= static_cast<std::size_t>(d);
  }
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

TensorView TensorView::slice(std::size_t offset, std::size_t count) const {
  // Two checks, not offset + count <= numel: that sum can wrap around and let a bad slice through.
  DT_CHECK_LE(InvalidArgument, offset, numel, "slice out of range (offset)");
  DT_CHECK_LE(InvalidArgument, count, numel - offset, "slice out of range (count)");
  return {static_cast<char*>(data) + offset * dtype_size(dtype), count, dtype};
}

void Tensor::Free::operator()(void* p) const noexcept { std::free(p); }

Tensor::Tensor(Shape shape, DType dtype)
    : shape_(std::move(shape)), numel_(shape_numel(shape_)), dtype_(dtype) {
  const std::size_t bytes = nbytes();
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded > 0) {
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, rounded);
    storage_.reset(p);
  }
}

Tensor Tensor::clone() const {
  Tensor t(shape_, dtype_);
  if (nbytes()) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

Tensor& Tensor::reshape(Shape shape) {
  DT_CHECK_EQ(InvalidArgument, shape_numel(shape), numel_, "reshape ", shape_str(shape_), " to ",
              shape_str(shape));
  shape_ = std::move(shape);
  return *this;
}

Tensor Tensor::to(DType dtype) const {
  Tensor t(shape_, dtype);
  convert(raw(), dtype_, t.raw(), dtype, numel_);
  return t;
}

void Tensor::check_type(DType want) const {
  DT_CHECK(InvalidArgument, want == dtype_, "tensor of dtype ", dtype_name(dtype_), " accessed as ",
           dtype_name(want));
}

}  // namespace dt
