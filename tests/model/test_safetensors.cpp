#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "model/safetensors.h"

namespace tandem {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

/// One tensor to write: raw little-endian bytes plus its header entry.
struct Spec {
  std::string name;
  std::string dtype;  // safetensors spelling
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

template <typename T>
std::vector<uint8_t> raw(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

Spec f32_spec(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  return {name, "F32", std::move(shape), raw(v)};
}
Spec bf16_spec(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  std::vector<uint16_t> h;
  for (float f : v) h.push_back(f32_to_bf16(f));
  return {name, "BF16", std::move(shape), raw(h)};
}
Spec f16_spec(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  std::vector<uint16_t> h;
  for (float f : v) h.push_back(f32_to_f16(f));
  return {name, "F16", std::move(shape), raw(h)};
}

/// The safetensors header JSON for `specs` laid out back to back.
Json header_for(const std::vector<Spec>& specs) {
  Json h = Json::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t off = 0;
  for (const Spec& s : specs) {
    h[s.name] = {
        {"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {off, off + s.bytes.size()}}};
    off += s.bytes.size();
  }
  return h;
}

/// Writes the file bytes: u64 LE header length, header (space-padded to 8), data.
std::string file_bytes(const std::string& header, const std::vector<Spec>& specs,
                       int64_t header_len_override = -1) {
  std::string hdr = header;
  while (hdr.size() % 8 != 0) hdr += ' ';
  uint64_t n = header_len_override >= 0 ? static_cast<uint64_t>(header_len_override) : hdr.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += hdr;
  for (const Spec& s : specs)
    out.append(reinterpret_cast<const char*>(s.bytes.data()), s.bytes.size());
  return out;
}

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("tandem_test_st_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream(path_ / name, std::ios::binary | std::ios::trunc) << bytes;
    return file(name);
  }
  std::string write_st(const std::string& name, const std::vector<Spec>& specs) const {
    return write(name, file_bytes(header_for(specs).dump(), specs));
  }

 private:
  fs::path path_;
};

void expect_error(const std::function<void()>& f, ErrorKind kind,
                  const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << needles[0];
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& n : needles) {
      EXPECT_NE(e.message().find(n), std::string::npos) << "'" << n << "' not in: " << e.what();
    }
  }
}

std::vector<float> read_all(const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.numel()));
  Checkpoint::to_f32(v, out.data());
  return out;
}

// Values exactly representable in the dtype they are stored in.
const std::vector<float> kF32 = {1.0f, -2.5f, 3.14159274f, 1e-30f, -7e20f, 0.0f};
const std::vector<float> kBf16 = {1.0f, -2.5f, 0.15625f, 65536.0f, -0.0078125f, 3.0f, 0.0f, 448.0f};
const std::vector<float> kF16 = {0.5f, -1.25f, 1024.0f, 6.103515625e-05f};

std::vector<Spec> sample_specs() {
  return {f32_spec("model.embed_tokens.weight", {2, 3}, kF32),
          bf16_spec("model.layers.0.mlp.gate.weight", {4, 2}, kBf16),
          f16_spec("model.norm.weight", {4}, kF16), f32_spec("empty", {0, 3}, {}),
          f32_spec("scalar", {}, {42.0f})};  // last in the data, last in the (sorted) header
}

TEST(Safetensors, SingleFileRoundTrip) {
  TempDir dir;
  const std::string path = dir.write_st("model.safetensors", sample_specs());
  SafetensorsFile f(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.names().size(), 5u);  // __metadata__ is not a tensor
  EXPECT_FALSE(f.has("__metadata__"));

  TensorView e = f.get("model.embed_tokens.weight");
  EXPECT_EQ(e.dtype, DType::kF32);
  EXPECT_EQ(e.shape, Shape({2, 3}));
  EXPECT_EQ(read_all(e), kF32);
  TensorView g = f.get("model.layers.0.mlp.gate.weight");
  EXPECT_EQ(g.dtype, DType::kBF16);
  EXPECT_EQ(g.shape, Shape({4, 2}));
  EXPECT_EQ(read_all(g), kBf16);
  TensorView n = f.get("model.norm.weight");
  EXPECT_EQ(n.dtype, DType::kF16);
  EXPECT_EQ(read_all(n), kF16);
  TensorView s = f.get("scalar");
  EXPECT_EQ(s.shape.ndim(), 0);
  EXPECT_EQ(read_all(s), std::vector<float>{42.0f});
  EXPECT_EQ(f.get("empty").numel(), 0);
  expect_error([&] { f.get("nope"); }, ErrorKind::kNotFound, {path, "nope"});

  Checkpoint ck(dir.path());
  EXPECT_TRUE(ck.has("model.norm.weight"));
  EXPECT_FALSE(ck.has("lm_head.weight"));
  EXPECT_EQ(ck.file_of("model.norm.weight"), path);
  EXPECT_EQ(read_all(ck.get("model.norm.weight", Shape({4}))), kF16);
}

TEST(Safetensors, RowRange) {
  TempDir dir;
  dir.write_st("model.safetensors", sample_specs());
  Checkpoint ck(dir.path());
  std::vector<float> out(4, -1.0f);
  Checkpoint::to_f32(ck.get("model.layers.0.mlp.gate.weight"), out.data(), 2, 4);
  EXPECT_EQ(out, std::vector<float>(kBf16.begin() + 4, kBf16.end()));
  Checkpoint::to_f32(ck.get("model.embed_tokens.weight"), out.data(), 1, 2);
  EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + 3),
            std::vector<float>(kF32.begin() + 3, kF32.end()));
  Checkpoint::to_f32(ck.get("model.norm.weight"), out.data(), 1, 3);
  EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + 2),
            std::vector<float>(kF16.begin() + 1, kF16.begin() + 3));
  Checkpoint::to_f32(ck.get("model.norm.weight"), out.data(), 2, 2);  // empty range: no-op
  expect_error([&] { Checkpoint::to_f32(ck.get("model.norm.weight"), out.data(), 3, 5); },
               ErrorKind::kInvalidArgument, {"row range"});
  expect_error([&] { Checkpoint::to_f32(ck.get("model.norm.weight"), out.data(), 3, 1); },
               ErrorKind::kInvalidArgument, {"row range"});
}

TEST(Safetensors, ToF32RejectsOtherDtypes) {
  std::vector<int32_t> ints = {1, 2};
  TensorView v{ints.data(), DType::kI32, Shape({2}), Device::kCpu};
  float out[2];
  expect_error([&] { Checkpoint::to_f32(v, out); }, ErrorKind::kUnsupported, {"i32"});
}

TEST(Safetensors, ShapeMismatchNamesFileTensorAndShapes) {
  TempDir dir;
  const std::string path = dir.write_st("model.safetensors", sample_specs());
  Checkpoint ck(dir.path());
  expect_error(
      [&] {
        ck.get("model.embed_tokens.weight", Shape({3, 2}));
      },
      ErrorKind::kInvalidArgument, {path, "model.embed_tokens.weight", "[2, 3]", "[3, 2]"});
  expect_error([&] { ck.get("lm_head.weight"); }, ErrorKind::kNotFound,
               {dir.path(), "lm_head.weight"});
  expect_error([&] { ck.get("lm_head.weight", Shape({1})); }, ErrorKind::kNotFound,
               {dir.path(), "lm_head.weight"});
  expect_error([&] { ck.file_of("lm_head.weight"); }, ErrorKind::kNotFound, {"lm_head.weight"});
}

Json index_json(const std::map<std::string, std::string>& weight_map) {
  Json j;
  j["metadata"] = {{"total_size", 1234}};
  j["weight_map"] = weight_map;
  return j;
}

TEST(Safetensors, ShardedWithIndex) {
  TempDir dir;
  std::vector<Spec> s1 = {f32_spec("a", {2, 3}, kF32), bf16_spec("b", {8}, kBf16)};
  std::vector<Spec> s2 = {f16_spec("c", {2, 2}, kF16)};
  const std::string p1 = dir.write_st("model-00001-of-00002.safetensors", s1);
  const std::string p2 = dir.write_st("model-00002-of-00002.safetensors", s2);
  dir.write("model.safetensors.index.json", index_json({{"a", "model-00001-of-00002.safetensors"},
                                                        {"b", "model-00001-of-00002.safetensors"},
                                                        {"c", "model-00002-of-00002.safetensors"}})
                                                .dump(2));
  Checkpoint ck(dir.path());
  EXPECT_EQ(ck.file_of("a"), p1);
  EXPECT_EQ(ck.file_of("c"), p2);
  EXPECT_EQ(read_all(ck.get("a", Shape({2, 3}))), kF32);
  EXPECT_EQ(read_all(ck.get("b", Shape({8}))), kBf16);
  EXPECT_EQ(read_all(ck.get("c", Shape({2, 2}))), kF16);
  expect_error([&] { ck.get("c", Shape({4})); }, ErrorKind::kInvalidArgument,
               {p2, "'c'", "[2, 2]", "[4]"});
}

TEST(Safetensors, ShardedErrors) {
  TempDir dir;
  dir.write_st("model-00001-of-00002.safetensors", {f32_spec("a", {2, 3}, kF32)});
  const std::string index = dir.file("model.safetensors.index.json");

  // A shard named in the index is missing.
  dir.write("model.safetensors.index.json",
            index_json({{"a", "model-00001-of-00002.safetensors"},
                        {"z.weight", "model-00002-of-00002.safetensors"}})
                .dump());
  expect_error([&] { Checkpoint ck(dir.path()); }, ErrorKind::kNotFound,
               {index, "model-00002-of-00002.safetensors", "z.weight"});

  // The index maps a tensor to a shard that does not hold it.
  dir.write("model.safetensors.index.json",
            index_json({{"a", "model-00001-of-00002.safetensors"},
                        {"ghost", "model-00001-of-00002.safetensors"}})
                .dump());
  expect_error([&] { Checkpoint ck(dir.path()); }, ErrorKind::kNotFound,
               {index, "ghost", "model-00001-of-00002.safetensors"});

  dir.write("model.safetensors.index.json", "{\"weight_map\": {");
  expect_error([&] { Checkpoint ck(dir.path()); }, ErrorKind::kIo, {index});
  dir.write("model.safetensors.index.json", "{\"metadata\": {}}");
  expect_error([&] { Checkpoint ck(dir.path()); }, ErrorKind::kIo, {index, "weight_map"});
  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  expect_error([&] { Checkpoint ck(dir.path()); }, ErrorKind::kIo, {index, "'a'"});
}

TEST(Safetensors, FallbackToAllFiles) {
  TempDir dir;
  const std::string pa = dir.write_st("a.safetensors", {f32_spec("x", {2, 3}, kF32)});
  const std::string pb = dir.write_st("b.safetensors", {f16_spec("y", {4}, kF16)});
  dir.write("notes.txt", "not a checkpoint");
  Checkpoint ck(dir.path());
  EXPECT_EQ(ck.file_of("x"), pa);
  EXPECT_EQ(ck.file_of("y"), pb);
  EXPECT_EQ(read_all(ck.get("y")), kF16);

  dir.write_st("c.safetensors", {f32_spec("x", {1}, {1.0f})});  // duplicate name
  expect_error([&] { Checkpoint ck2(dir.path()); }, ErrorKind::kIo, {"'x'", pa});
}

TEST(Safetensors, MissingCheckpoint) {
  TempDir dir;
  expect_error([&] { Checkpoint ck(dir.path()); }, ErrorKind::kNotFound, {dir.path()});
  expect_error([&] { Checkpoint ck(dir.file("nope")); }, ErrorKind::kNotFound, {"nope"});
  expect_error([&] { SafetensorsFile f(dir.file("nope.safetensors")); }, ErrorKind::kNotFound,
               {"nope.safetensors"});
}

TEST(Safetensors, CorruptFilesNameFileAndTensor) {
  TempDir dir;
  const std::vector<Spec> specs = sample_specs();
  const std::string good = file_bytes(header_for(specs).dump(), specs);
  const std::string path = dir.file("model.safetensors");
  auto open_it = [&] { SafetensorsFile f(path); };

  // Truncated data: the last tensor with bytes ("scalar") runs past the end.
  dir.write("model.safetensors", good.substr(0, good.size() - 2));
  expect_error(open_it, ErrorKind::kIo, {path, "scalar", "truncated"});
  // Too short for the length prefix.
  dir.write("model.safetensors", good.substr(0, 5));
  expect_error(open_it, ErrorKind::kIo, {path});
  dir.write("model.safetensors", "");
  expect_error(open_it, ErrorKind::kIo, {path});
  // Header length past EOF.
  dir.write("model.safetensors", file_bytes(header_for(specs).dump(), specs, 1 << 20));
  expect_error(open_it, ErrorKind::kIo, {path, "header length"});
  dir.write("model.safetensors", file_bytes(header_for(specs).dump(), specs, int64_t{1} << 62));
  expect_error(open_it, ErrorKind::kIo, {path, "header length"});
  // Bad JSON / not an object.
  dir.write("model.safetensors", file_bytes("{\"a\": {\"dtype\": ", {}));
  expect_error(open_it, ErrorKind::kIo, {path, "JSON"});
  dir.write("model.safetensors", file_bytes("[1, 2, 3]", {}));
  expect_error(open_it, ErrorKind::kIo, {path, "object"});

  auto with_entry = [&](const Json& entry, const std::vector<Spec>& data) {
    Json h = {{"w", entry}};
    dir.write("model.safetensors", file_bytes(h.dump(), data));
  };
  const std::vector<Spec> data = {f32_spec("w", {2}, {1.0f, 2.0f})};
  // Offsets out of range.
  with_entry({{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'", "data_offsets"});
  // Offsets that disagree with dtype * shape.
  with_entry({{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 8}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'", "[3]"});
  with_entry({{"dtype", "BF16"}, {"shape", {2}}, {"data_offsets", {0, 8}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'", "bf16"});
  // Reversed, negative, malformed offsets.
  with_entry({{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {8, 0}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry({{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {-8, 0}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry({{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry({{"dtype", "F32"}, {"shape", {2}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  // Malformed shape / dtype.
  with_entry({{"dtype", "F32"}, {"shape", {-2}}, {"data_offsets", {0, 8}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry({{"dtype", "F32"}, {"shape", "2"}, {"data_offsets", {0, 8}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry({{"dtype", "F32"}, {"shape", {1, 1, 1, 1, 1, 1, 2}}, {"data_offsets", {0, 8}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry({{"dtype", "F32"},
              {"shape", {uint64_t{1} << 40, uint64_t{1} << 40}},
              {"data_offsets", {0, 8}}},
             data);  // numel overflows 64 bits
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry({{"dtype", "F64"}, {"shape", {1}}, {"data_offsets", {0, 8}}}, data);
  expect_error(open_it, ErrorKind::kUnsupported, {path, "'w'", "F64"});
  with_entry({{"dtype", 3}, {"shape", {2}}, {"data_offsets", {0, 8}}}, data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});
  with_entry("not an object", data);
  expect_error(open_it, ErrorKind::kIo, {path, "'w'"});

  // Through Checkpoint the error still names the file and tensor.
  dir.write("model.safetensors", good.substr(0, good.size() - 2));
  expect_error([&] { Checkpoint ck(dir.path()); }, ErrorKind::kIo, {path, "scalar"});
}

// Every truncation and many random byte flips either load or throw tandem::Error.
TEST(Safetensors, FuzzedFilesNeverCrash) {
  TempDir dir;
  const std::vector<Spec> specs = sample_specs();
  const std::string good = file_bytes(header_for(specs).dump(), specs);
  const std::string path = dir.file("model.safetensors");
  int loaded = 0, rejected = 0;
  auto try_open = [&](const std::string& bytes) {
    dir.write("model.safetensors", bytes);
    try {
      SafetensorsFile f(path);
      for (const std::string& n : f.names()) {
        TensorView v = f.get(n);
        if (v.dtype == DType::kF32 || v.dtype == DType::kBF16 || v.dtype == DType::kF16) {
          std::vector<float> out(static_cast<size_t>(v.numel()));
          Checkpoint::to_f32(v, out.data());
        }
      }
      ++loaded;
    } catch (const Error& e) {
      EXPECT_NE(e.message().find(path), std::string::npos) << e.what();
      ++rejected;
    }
  };
  for (size_t len = 0; len < good.size(); ++len) try_open(good.substr(0, len));
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    std::string bytes = good;
    int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      size_t pos = rng() % bytes.size();
      bytes[pos] = static_cast<char>(rng() & 0xff);
    }
    try_open(bytes);
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(loaded, 0);  // the data bytes of the last tensor can change without breaking it
}

}  // namespace
}  // namespace tandem
