// Tensor views (non-owning) and host buffers (owning).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace tandem {

enum class Device : uint8_t { kCpu, kCuda };

/// A shape of up to kMaxDims dimensions, outermost first.
class Shape {
 public:
  static constexpr int kMaxDims = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(const std::vector<int64_t>& dims);

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i < 0 ? i + ndim_ : i)]; }
  int64_t numel() const;
  std::vector<int64_t> to_vector() const { return {dims_.begin(), dims_.begin() + ndim_}; }
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[2, 3]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

/// A non-owning view of contiguous (row-major) data. Ops validate views once where they
/// enter (shape, dtype, device) and then trust them.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Device device = Device::kCpu;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  /// Checks dtype and shape, naming `what` in the error.
  void expect(DType t, const Shape& s, const char* what) const;
};

/// An owning, 64-byte aligned host allocation.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t nbytes);
  HostBuffer(HostBuffer&&) noexcept = default;
  HostBuffer& operator=(HostBuffer&&) noexcept = default;

  void* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> data_;
  size_t size_ = 0;
};

/// A host tensor that owns its storage.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Shape shape);

  TensorView view() const { return {buf_.data(), dtype_, shape_, Device::kCpu}; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(buf_.data());
  }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return shape_.numel(); }
  bool empty() const { return buf_.data() == nullptr; }

 private:
  HostBuffer buf_;
  DType dtype_ = DType::kF32;
  Shape shape_;
};

}  // namespace tandem
