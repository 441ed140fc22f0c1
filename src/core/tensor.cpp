#include "core/tensor.h"

#include <cstdlib>

namespace tandem {

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::vector<int64_t>(dims)) {}

Shape::Shape(const std::vector<int64_t>& dims) {
  TANDEM_CHECK(dims.size() <= kMaxDims, "too many dims: ", dims.size());
  ndim_ = static_cast<int>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    TANDEM_CHECK(dims[i] >= 0, "negative dim ", dims[i]);
    dims_[i] = dims[i];
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i) {
    if (dims_[static_cast<size_t>(i)] != o.dims_[static_cast<size_t>(i)]) return false;
  }
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[static_cast<size_t>(i)]);
  }
  return s + "]";
}

void TensorView::expect(DType t, const Shape& s, const char* what) const {
  TANDEM_CHECK_KIND(kInvalidArgument, dtype == t, what, ": dtype ", dtype_name(dtype),
                    ", expected ", dtype_name(t));
  TANDEM_CHECK_KIND(kInvalidArgument, shape == s, what, ": shape ", shape.str(), ", expected ",
                    s.str());
}

void HostBuffer::Free::operator()(void* p) const { std::free(p); }

HostBuffer::HostBuffer(size_t nbytes) : size_(nbytes) {
  if (nbytes == 0) return;
  size_t rounded = (nbytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  TANDEM_CHECK_KIND(kOutOfResources, p != nullptr, "host allocation of ", nbytes, " bytes failed");
  data_.reset(p);
}

HostTensor::HostTensor(DType dtype, Shape shape)
    : buf_(static_cast<size_t>(shape.numel()) * dtype_size(dtype)), dtype_(dtype), shape_(shape) {}

}  // namespace tandem
