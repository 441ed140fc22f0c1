#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "model/load_progress.h"

namespace tandem {

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// Same bound as the reference safetensors implementation (Rust crate).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

/// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/// Parses one tensor entry of the header into a view pointing into the mapping.
TensorView parse_entry(const std::string& path, const std::string& name, const Json& e,
                       unsigned char* data_begin, uint64_t data_size) {
  TANDEM_CHECK_KIND(kIo, e.is_object(), path, ": tensor '", name,
                    "': header entry is not a JSON object");
  auto dtype_it = e.find("dtype");
  auto shape_it = e.find("shape");
  auto offs_it = e.find("data_offsets");
  TANDEM_CHECK_KIND(kIo, dtype_it != e.end() && dtype_it->is_string(), path, ": tensor '", name,
                    "': missing or non-string 'dtype'");
  TANDEM_CHECK_KIND(kIo, shape_it != e.end() && shape_it->is_array(), path, ": tensor '", name,
                    "': missing or non-array 'shape'");
  TANDEM_CHECK_KIND(kIo,
                    offs_it != e.end() && offs_it->is_array() && offs_it->size() == 2 &&
                        (*offs_it)[0].is_number_unsigned() && (*offs_it)[1].is_number_unsigned(),
                    path, ": tensor '", name,
                    "': 'data_offsets' must be two non-negative integers");

  TensorView v;
  try {
    v.dtype = dtype_from_safetensors(dtype_it->get<std::string>());
  } catch (const Error& err) {
    TANDEM_THROW(kUnsupported, path, ": tensor '", name, "': ", err.message());
  }

  TANDEM_CHECK_KIND(kIo, shape_it->size() <= static_cast<size_t>(Shape::kMaxDims), path,
                    ": tensor '", name, "': ", shape_it->size(), " dimensions (at most ",
                    Shape::kMaxDims, " supported)");
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  bool overflow = false;
  for (const Json& d : *shape_it) {
    TANDEM_CHECK_KIND(kIo, d.is_number_unsigned(), path, ": tensor '", name,
                      "': shape entries must be non-negative integers");
    uint64_t u = d.get<uint64_t>();
    TANDEM_CHECK_KIND(kIo, u <= static_cast<uint64_t>(INT64_MAX), path, ": tensor '", name,
                      "': dimension out of range");
    dims.push_back(static_cast<int64_t>(u));
    if (__builtin_mul_overflow(numel, u, &numel)) overflow = true;
  }
  if (std::find(dims.begin(), dims.end(), 0) != dims.end()) {
    numel = 0;
    overflow = false;
  }
  v.shape = Shape(dims);

  uint64_t begin = (*offs_it)[0].get<uint64_t>();
  uint64_t end = (*offs_it)[1].get<uint64_t>();
  TANDEM_CHECK_KIND(kIo, begin <= end, path, ": tensor '", name, "': data_offsets [", begin, ", ",
                    end, ") are reversed");
  TANDEM_CHECK_KIND(kIo, end <= data_size, path, ": tensor '", name, "': data_offsets [", begin,
                    ", ", end, ") lie outside the file's ", data_size,
                    " data bytes (truncated file?)");
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(v.dtype)), &nbytes)) {
    overflow = true;
  }
  TANDEM_CHECK_KIND(kIo, !overflow && nbytes == end - begin, path, ": tensor '", name,
                    "': ", end - begin, " data bytes do not match dtype ", dtype_name(v.dtype),
                    " and shape ", v.shape.str());
  v.data = data_begin + begin;
  v.device = Device::kCpu;
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    TANDEM_CHECK_KIND(kNotFound, err != ENOENT, path, ": not found");
    TANDEM_THROW(kIo, path, ": cannot open: ", std::strerror(err));
  }
  FdCloser closer{fd};
  struct stat st {};
  TANDEM_CHECK_KIND(kIo, ::fstat(fd, &st) == 0, path, ": stat failed: ", std::strerror(errno));
  TANDEM_CHECK_KIND(kIo, S_ISREG(st.st_mode), path, ": not a regular file");
  uint64_t size = static_cast<uint64_t>(st.st_size);
  TANDEM_CHECK_KIND(kIo, size >= 8, path, ": file of ", size,
                    " bytes is too short for a safetensors header");

  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  TANDEM_CHECK_KIND(kIo, map != MAP_FAILED, path, ": mmap failed: ", std::strerror(errno));
  map_ = map;
  map_size_ = size;
  try {
    auto* bytes = static_cast<unsigned char*>(map_);
    uint64_t header_len = read_u64_le(bytes);
    TANDEM_CHECK_KIND(kIo, header_len <= kMaxHeaderBytes, path, ": header length ", header_len,
                      " exceeds the ", kMaxHeaderBytes, "-byte limit");
    TANDEM_CHECK_KIND(kIo, header_len <= size - 8, path, ": header length ", header_len,
                      " runs past the end of the file (", size, " bytes; truncated file?)");
    Json header;
    try {
      header = Json::parse(bytes + 8, bytes + 8 + header_len);
    } catch (const Json::exception& e) {
      TANDEM_THROW(kIo, path, ": invalid JSON header: ", e.what());
    }
    TANDEM_CHECK_KIND(kIo, header.is_object(), path, ": header is not a JSON object");
    unsigned char* data_begin = bytes + 8 + header_len;
    uint64_t data_size = size - 8 - header_len;
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      tensors_.emplace(it.key(), parse_entry(path, it.key(), it.value(), data_begin, data_size));
    }
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

TensorView SafetensorsFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  TANDEM_CHECK_KIND(kNotFound, it != tensors_.end(), path_, ": tensor '", name, "' not found");
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {
/// Tells the load observer (model/load_progress.h), if any, a checkpoint's total tensor bytes.
void report_opened(const std::string& dir, const std::map<std::string, size_t>& index,
                   const std::vector<std::unique_ptr<SafetensorsFile>>& files) {
  LoadObserver* obs = load_observer();
  if (obs == nullptr) return;
  uint64_t total = 0;
  for (const auto& [name, pos] : index) total += files[pos]->get(name).nbytes();
  obs->on_checkpoint(dir, total);
}
}  // namespace

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  TANDEM_CHECK_KIND(kNotFound, fs::is_directory(dir, ec), dir, ": checkpoint directory not found");
  const fs::path root(dir);
  const fs::path single = root / "model.safetensors";
  const fs::path index_path = root / "model.safetensors.index.json";

  // Same preference as transformers: the single file first, then the index.
  if (fs::is_regular_file(single, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
    for (const std::string& n : files_[0]->names()) index_.emplace(n, 0);
    report_opened(dir_, index_, files_);
    return;
  }

  if (fs::is_regular_file(index_path, ec)) {
    const std::string ipath = index_path.string();
    std::ifstream in(ipath, std::ios::binary);
    TANDEM_CHECK_KIND(kIo, in.good(), ipath, ": cannot open for reading");
    std::ostringstream os;
    os << in.rdbuf();
    Json j;
    try {
      j = Json::parse(os.str());
    } catch (const Json::exception& e) {
      TANDEM_THROW(kIo, ipath, ": invalid JSON: ", e.what());
    }
    TANDEM_CHECK_KIND(kIo, j.is_object(), ipath, ": not a JSON object");
    auto wm = j.find("weight_map");
    TANDEM_CHECK_KIND(kIo, wm != j.end() && wm->is_object(), ipath,
                      ": missing or non-object 'weight_map'");
    std::map<std::string, size_t> file_pos;  // shard file name -> files_ position
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      TANDEM_CHECK_KIND(kIo, it.value().is_string(), ipath, ": weight_map entry for tensor '",
                        it.key(), "' is not a string");
      const std::string shard = it.value().get<std::string>();
      auto pos = file_pos.find(shard);
      if (pos == file_pos.end()) {
        const fs::path shard_path = root / shard;
        TANDEM_CHECK_KIND(kNotFound, fs::is_regular_file(shard_path, ec), ipath, ": shard '", shard,
                          "' (holding tensor '", it.key(), "') not found at ", shard_path.string());
        files_.push_back(std::make_unique<SafetensorsFile>(shard_path.string()));
        pos = file_pos.emplace(shard, files_.size() - 1).first;
      }
      TANDEM_CHECK_KIND(kNotFound, files_[pos->second]->has(it.key()), ipath, ": tensor '",
                        it.key(), "' is mapped to shard '", shard, "' but ",
                        files_[pos->second]->path(), " does not contain it");
      index_.emplace(it.key(), pos->second);
    }
    report_opened(dir_, index_, files_);
    return;
  }

  // Fallback: every *.safetensors file of the directory, in name order.
  std::vector<fs::path> paths;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    if (e.is_regular_file(ec) && e.path().extension() == ".safetensors") paths.push_back(e.path());
  }
  TANDEM_CHECK_KIND(kNotFound, !paths.empty(), dir,
                    ": no model.safetensors, model.safetensors.index.json or *.safetensors");
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    files_.push_back(std::make_unique<SafetensorsFile>(p.string()));
    size_t pos = files_.size() - 1;
    for (const std::string& n : files_[pos]->names()) {
      auto [it, inserted] = index_.emplace(n, pos);
      TANDEM_CHECK_KIND(kIo, inserted, dir, ": tensor '", n, "' appears in both ",
                        files_[it->second]->path(), " and ", files_[pos]->path());
    }
  }
  report_opened(dir_, index_, files_);
}

bool Checkpoint::has(const std::string& name) const { return index_.count(name) != 0; }

TensorView Checkpoint::get(const std::string& name) const {
  auto it = index_.find(name);
  TANDEM_CHECK_KIND(kNotFound, it != index_.end(), dir_, ": tensor '", name,
                    "' not found in the checkpoint");
  return files_[it->second]->get(name);
}

TensorView Checkpoint::get(const std::string& name, const Shape& expected) const {
  TensorView v = get(name);
  TANDEM_CHECK_KIND(kInvalidArgument, v.shape == expected, file_of(name), ": tensor '", name,
                    "' has shape ", v.shape.str(), ", expected ", expected.str());
  if (LoadObserver* obs = load_observer()) obs->on_tensor(dir_, name, v.nbytes());
  return v;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, pos] : index_) out.push_back(name);
  return out;
}

std::string Checkpoint::file_of(const std::string& name) const {
  auto it = index_.find(name);
  TANDEM_CHECK_KIND(kNotFound, it != index_.end(), dir_, ": tensor '", name,
                    "' not found in the checkpoint");
  return files_[it->second]->path();
}

void Checkpoint::to_f32(const TensorView& src, float* dst, int64_t row_begin, int64_t row_end) {
  TANDEM_CHECK_KIND(kInvalidArgument, src.device == Device::kCpu,
                    "to_f32: the source must be a host view");
  const int64_t rows = src.shape.ndim() == 0 ? 1 : src.shape[0];
  int64_t row_elems = 1;
  for (int d = 1; d < src.shape.ndim(); ++d) row_elems *= src.shape[d];
  if (row_end < 0) row_end = rows;
  TANDEM_CHECK_KIND(kInvalidArgument, 0 <= row_begin && row_begin <= row_end && row_end <= rows,
                    "to_f32: row range [", row_begin, ", ", row_end, ") outside [0, ", rows,
                    ") of shape ", src.shape.str());
  const size_t first = static_cast<size_t>(row_begin * row_elems);
  const size_t count = static_cast<size_t>((row_end - row_begin) * row_elems);
  if (count == 0) return;
  // NOTE: safetensors does not promise element alignment; read through memcpy.
  switch (src.dtype) {
    case DType::kF32:
      std::memcpy(dst, static_cast<const unsigned char*>(src.data) + first * 4, count * 4);
      return;
    case DType::kBF16: {
      const auto* p = static_cast<const unsigned char*>(src.data) + first * 2;
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    }
    case DType::kF16: {
      const auto* p = static_cast<const unsigned char*>(src.data) + first * 2;
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      return;
    }
    case DType::kF8E4M3:
      TANDEM_THROW(kUnsupported,
                   "to_f32: an F8_E4M3 tensor holds quantized values: read it with its scales "
                   "(model/quant.h WeightReader)");
    default:
      TANDEM_THROW(kUnsupported, "to_f32: unsupported dtype ", dtype_name(src.dtype),
                   " (bf16, f16, f32 only)");
  }
}

}  // namespace tandem
