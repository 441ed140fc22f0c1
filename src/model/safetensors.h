// Safetensors checkpoints, single-file or sharded (model.safetensors.index.json), mmapped.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem {

/// One .safetensors file mapped read-only. Tensor views point into the mapping.
class SafetensorsFile {
 public:
  /// Maps and parses the header; throws (naming the file) on a truncated or malformed file
  /// or on a tensor whose byte range lies outside the file.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  /// Throws kNotFound naming the file and tensor.
  TensorView get(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

/// All safetensors files of a checkpoint directory.
class Checkpoint {
 public:
  /// dir holds model.safetensors, or model.safetensors.index.json and its shards, or (as a
  /// fallback) any *.safetensors files. Reports its total bytes to the load observer
  /// (model/load_progress.h), when one is installed.
  explicit Checkpoint(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool has(const std::string& name) const;
  /// Throws kNotFound naming the directory and tensor.
  TensorView get(const std::string& name) const;
  /// get() plus a shape check; the error names the file, the tensor, both shapes. The loaders'
  /// read path: reports the tensor to the load observer (model/load_progress.h), if any.
  TensorView get(const std::string& name, const Shape& expected) const;
  /// Every tensor name, sorted.
  std::vector<std::string> names() const;
  /// The file a tensor lives in (for error messages).
  std::string file_of(const std::string& name) const;

  /// Converts a bf16/f16/f32 view to f32 into `dst` (numel floats), rows [row_begin,
  /// row_end) of the outermost dim only when given (for loading a shard).
  static void to_f32(const TensorView& src, float* dst, int64_t row_begin = 0,
                     int64_t row_end = -1);

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> index_;  // tensor name -> files_ position
};

}  // namespace tandem
