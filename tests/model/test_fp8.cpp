// FP8 checkpoints on the CPU:
//  - the block-FP8 fixture (tools/make_fp8_fixtures.py, Qwen's published layout) reproduces
//    transformers' greedy tokens over the dequantized weights (sharded: test_sharded.cpp);
//  - WeightReader: exact block-scaled values for any row / column range (narrower than a block,
//    straddling blocks, partial edge blocks), block FP8 and MXFP8;
//  - bad input: a missing or misshaped scale, F8 without quantization_config, NaN scales, an
//    unknown fmt / block size / method, each naming the tensor or field;
//  - `tandem convert` (model/convert.h): MXFP8 and block FP8 from bf16 and from block FP8, round
//    trip within E4M3's rounding bound per element, the layout vLLM / ModelOpt read.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "engine/golden.h"
#include "model/config.h"
#include "model/convert.h"
#include "model/quant.h"
#include "model/qwen3_moe.h"
#include "model/safetensors.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string fp8_fixture() {
  return testing::source_dir() + "/tests/data/fixtures_fp8/hub_fp8_block128";
}
std::string bf16_fixture() {
  return testing::source_dir() + "/tests/data/fixtures/hub_gqa8_hd128_top8_bf16";
}

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("tandem_test_fp8_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << needles[0];
  } catch (const Error& e) {
    for (const std::string& n : needles) {
      EXPECT_NE(e.message().find(n), std::string::npos) << "'" << n << "' not in: " << e.what();
    }
  }
}

// ---- A minimal safetensors writer. ----

struct Entry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

template <typename T>
std::vector<uint8_t> raw(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

void write_st(const std::string& path, const std::vector<Entry>& entries) {
  Json h = Json::object();
  uint64_t off = 0;
  for (const Entry& e : entries) {
    h[e.name] = {
        {"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {off, off + e.bytes.size()}}};
    off += e.bytes.size();
  }
  std::string hs = h.dump();
  while (hs.size() % 8 != 0) hs += ' ';
  const uint64_t n = hs.size();
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(hs.data(), static_cast<std::streamsize>(hs.size()));
  for (const Entry& e : entries) {
    f.write(reinterpret_cast<const char*>(e.bytes.data()),
            static_cast<std::streamsize>(e.bytes.size()));
  }
}

// Rewrites the header of dir/model.safetensors (the data stays) with `edit`.
void edit_header(const std::string& path, const std::function<void(Json&)>& edit) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  Json h = Json::parse(bytes.substr(8, n));
  edit(h);
  std::string hs = h.dump();
  while (hs.size() % 8 != 0) hs += ' ';
  const uint64_t m = hs.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&m), 8);
  out << hs << bytes.substr(8 + n);
}

std::string copy_fixture(const std::string& from, const TempDir& dir) {
  const std::string to = dir.file("model");
  fs::copy(from, to, fs::copy_options::recursive);
  for (const auto& e : fs::directory_iterator(to)) {
    fs::permissions(e.path(), fs::perms::owner_read | fs::perms::owner_write);
  }
  return to;
}

void edit_config(const std::string& dir, const std::function<void(Json&)>& edit) {
  Json c = Json::parse(std::ifstream(dir + "/config.json"));
  edit(c);
  std::ofstream(dir + "/config.json", std::ios::trunc) << c.dump(2);
}

// ---- Greedy decoding on the CPU model (one sequence). ----

struct Greedy {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // the row behind each token
};

Greedy greedy(Model& m, const std::vector<int32_t>& prompt, int steps) {
  const int64_t v = m.config().vocab_size, page = 16;
  const int64_t max_len = static_cast<int64_t>(prompt.size()) + steps;
  const int64_t pages = (max_len + page - 1) / page;
  KvCache kv(m.kv_geometry(pages, page));
  std::vector<int32_t> table(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::vector<int32_t> toks = prompt;
  int64_t cached = 0;
  Greedy g;
  for (int s = 0; s < steps; ++s) {
    ForwardBatch b;
    ForwardSeq fs;
    fs.tokens = toks.data() + cached;
    fs.num_tokens = static_cast<int64_t>(toks.size()) - cached;
    fs.start_pos = cached;
    fs.block_table = table.data();
    fs.num_pages = pages;
    fs.logits = LogitsMode::kLast;
    b.seqs.push_back(fs);
    std::vector<float> lg;
    m.forward(b, kv, lg);
    cached = static_cast<int64_t>(toks.size());
    EXPECT_EQ(static_cast<int64_t>(lg.size()), v);
    const auto best = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
    g.tokens.push_back(best);
    g.logits.push_back(std::move(lg));
    toks.push_back(best);
  }
  return g;
}

std::vector<float> log_softmax(const std::vector<float>& x) {
  double mx = *std::max_element(x.begin(), x.end()), sum = 0;
  for (float v : x) sum += std::exp(static_cast<double>(v) - mx);
  const double lse = mx + std::log(sum);
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i] - lse);
  return out;
}

// ---- The block-FP8 fixture against transformers. ----

TEST(Fp8Checkpoint, ConfigDescribesBlockFp8) {
  ModelConfig c = ModelConfig::from_dir(fp8_fixture());
  EXPECT_EQ(c.quant.method, WeightQuant::kFp8Block);
  EXPECT_EQ(c.quant.block_rows, 128);
  EXPECT_EQ(c.quant.block_cols, 128);
  EXPECT_EQ(c.quant.not_converted,
            (std::vector<std::string>{"lm_head", "model.layers.2.self_attn.o_proj"}));
  EXPECT_EQ(c.quant.scale_name("x.weight"), "x.weight_scale_inv");
  Checkpoint ckpt(fp8_fixture());
  EXPECT_EQ(ckpt.get("model.layers.1.mlp.experts.3.up_proj.weight").dtype, DType::kF8E4M3);
  EXPECT_EQ(ckpt.get("model.layers.2.self_attn.o_proj.weight").dtype, DType::kBF16);
  EXPECT_EQ(ckpt.get("model.layers.1.mlp.gate.weight").dtype, DType::kBF16);
}

TEST(Fp8Checkpoint, GreedyMatchesTransformersExactly) {
  testing::Golden g = testing::load_golden(fp8_fixture());
  auto model = Qwen3MoeCpu::load(g.dir);
  ASSERT_EQ(g.cases.size(), 3u);
  for (size_t i = 0; i < g.cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const auto& c = g.cases[i];
    Greedy out = greedy(*model, c.prompt_ids, c.max_tokens);
    ASSERT_EQ(out.tokens, c.output_ids);
    for (size_t t = 0; t < out.logits.size(); ++t) {
      std::vector<float> lp = log_softmax(out.logits[t]);
      for (const TokenLogprob& want : c.top_logprobs[t]) {
        EXPECT_NEAR(lp[static_cast<size_t>(want.id)], want.logprob, 1e-3) << "step " << t;
      }
    }
  }
}

// The dequantized weights are the exact fp32 products q * scale_inv, per element's block.
TEST(Fp8Checkpoint, LoadedWeightsAreTheExactBlockProducts) {
  Checkpoint ckpt(fp8_fixture());
  ModelConfig c = ModelConfig::from_dir(fp8_fixture());
  WeightReader wr(ckpt, c.quant, "config.json");
  const std::string name = "model.layers.0.self_attn.q_proj.weight";  // [256, 128]: 2x1 blocks
  TensorView q = ckpt.get(name);
  TensorView s = ckpt.get(name + "_scale_inv");
  ASSERT_EQ(s.shape, Shape({2, 1}));
  std::vector<float> sc(2);
  Checkpoint::to_f32(s, sc.data());
  EXPECT_NE(sc[0], sc[1]);
  std::vector<float> w(256 * 128);
  wr.read(name, 256, 128, w.data());
  const auto* codes = q.ptr<uint8_t>();
  for (int64_t i = 0; i < 256; ++i) {
    for (int64_t j = 0; j < 128; ++j) {
      const float want = f8e4m3_to_f32(codes[i * 128 + j]) * sc[static_cast<size_t>(i / 128)];
      ASSERT_EQ(w[static_cast<size_t>(i * 128 + j)], want) << i << "," << j;
    }
  }
}

// ---- WeightReader on synthetic tensors: ranges of any width and partial blocks. ----

struct Synthetic {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;  // block FP8
  std::vector<uint8_t> e8m0;     // MXFP8
};

Synthetic synthetic(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  Synthetic s;
  for (int64_t i = 0; i < rows * cols; ++i) {
    uint8_t c;
    do {
      c = static_cast<uint8_t>(rng() & 0xff);
    } while ((c & 0x7f) == 0x7f);
    s.codes.push_back(c);
  }
  std::uniform_real_distribution<float> u(1e-3f, 2.f);
  for (int64_t i = 0; i < ((rows + 127) / 128) * ((cols + 127) / 128); ++i)
    s.scale_inv.push_back(u(rng));
  for (int64_t i = 0; i < rows * ((cols + 31) / 32); ++i)
    s.e8m0.push_back(static_cast<uint8_t>(110 + rng() % 30));
  return s;
}

QuantConfig quant_of(WeightQuant m) {
  QuantConfig q;
  q.method = m;
  q.block_rows = m == WeightQuant::kMxfp8 ? 1 : 128;
  q.block_cols = m == WeightQuant::kMxfp8 ? 32 : 128;
  return q;
}

TEST(WeightReader, AnyRangeTakesEachElementsOwnBlockScale) {
  const int64_t rows = 200, cols = 300;  // partial edge blocks both ways (2x3 and 10 of 32)
  Synthetic s = synthetic(rows, cols, 3);
  TempDir dir;
  write_st(dir.file("model.safetensors"),
           {{"fp8.weight", "F8_E4M3", {rows, cols}, s.codes},
            {"fp8.weight_scale_inv", "F32", {2, 3}, raw(s.scale_inv)},
            {"mx.weight", "F8_E4M3", {rows, cols}, s.codes},
            {"mx.weight_scale", "U8", {rows, 10}, s.e8m0},
            {"plain.weight", "F32", {3, 4}, raw(std::vector<float>(12, 0.5f))}});
  Checkpoint ckpt(dir.path());
  for (WeightQuant m : {WeightQuant::kFp8Block, WeightQuant::kMxfp8}) {
    SCOPED_TRACE(std::string(weight_quant_name(m)));
    WeightReader wr(ckpt, quant_of(m), "config.json");
    const std::string name = m == WeightQuant::kMxfp8 ? "mx.weight" : "fp8.weight";
    EXPECT_TRUE(wr.is_quantized(name));
    EXPECT_FALSE(wr.is_quantized("plain.weight"));
    auto want = [&](int64_t i, int64_t j) {
      const float v = f8e4m3_to_f32(s.codes[static_cast<size_t>(i * cols + j)]);
      return m == WeightQuant::kMxfp8
                 ? v * std::ldexp(1.0f, s.e8m0[static_cast<size_t>(i * 10 + j / 32)] - 127)
                 : v * s.scale_inv[static_cast<size_t>((i / 128) * 3 + j / 128)];
    };
    // Narrower than a block, straddling blocks, the partial edge, empty, the whole tensor.
    const std::vector<std::pair<IndexRange, IndexRange>> ranges = {
        {{0, 64}, {0, 300}},      {{64, 192}, {100, 260}}, {{127, 129}, {127, 129}},
        {{150, 200}, {256, 300}}, {{10, 10}, {0, 300}},    {{0, 200}, {0, 300}},
        {{5, 6}, {290, 300}}};
    for (const auto& [r, c] : ranges) {
      std::vector<float> out(static_cast<size_t>(r.size() * c.size()), NAN);
      wr.read(name, rows, cols, r, c, out.data());
      for (int64_t i = r.begin; i < r.end; ++i) {
        for (int64_t j = c.begin; j < c.end; ++j) {
          ASSERT_EQ(out[static_cast<size_t>((i - r.begin) * c.size() + j - c.begin)], want(i, j))
              << i << "," << j;
        }
      }
    }
    std::vector<float> p(12);
    wr.read("plain.weight", 3, 4, p.data());
    EXPECT_EQ(p, std::vector<float>(12, 0.5f));
  }
}

// The codes kept as stored (the GPU's FP8 linears): every element's code, and per row the scale
// of its block for each 128 columns of the range; column ranges on a block boundary or inside
// one block (a shard narrower than a block) load, a straddling one is refused naming the tensor.
TEST(WeightReader, Fp8CodesWithRowScales) {
  const int64_t rows = 200, cols = 300;
  Synthetic s = synthetic(rows, cols, 4);
  TempDir dir;
  write_st(dir.file("model.safetensors"),
           {{"fp8.weight", "F8_E4M3", {rows, cols}, s.codes},
            {"fp8.weight_scale_inv", "F32", {2, 3}, raw(s.scale_inv)},
            {"mx.weight", "F8_E4M3", {rows, cols}, s.codes},
            {"mx.weight_scale", "U8", {rows, 10}, s.e8m0},
            {"plain.weight", "F32", {3, 4}, raw(std::vector<float>(12, 0.5f))}});
  Checkpoint ckpt(dir.path());
  WeightReader wr(ckpt, quant_of(WeightQuant::kFp8Block), "config.json");
  const std::vector<std::pair<IndexRange, IndexRange>> ranges = {{{0, 200}, {0, 300}},
                                                                 {{64, 96}, {128, 300}},
                                                                 {{100, 164}, {64, 128}},
                                                                 {{199, 200}, {256, 300}},
                                                                 {{0, 3}, {0, 128}}};
  for (const auto& [r, c] : ranges) {
    SCOPED_TRACE(std::to_string(r.begin) + ".." + std::to_string(r.end) + " x " +
                 std::to_string(c.begin) + ".." + std::to_string(c.end));
    const int64_t kb = (c.size() + 127) / 128;
    std::vector<uint8_t> q(static_cast<size_t>(r.size() * c.size()), 0x7f);
    std::vector<float> rs(static_cast<size_t>(r.size() * kb), NAN);
    wr.read_fp8_codes("fp8.weight", rows, cols, r, c, q.data(), rs.data());
    for (int64_t i = r.begin; i < r.end; ++i) {
      for (int64_t j = c.begin; j < c.end; ++j) {
        const size_t o = static_cast<size_t>((i - r.begin) * c.size() + j - c.begin);
        ASSERT_EQ(q[o], s.codes[static_cast<size_t>(i * cols + j)]) << i << "," << j;
        // The dequantized value the CPU model loads: code times this row scale.
        const float scale = rs[static_cast<size_t>((i - r.begin) * kb + (j - c.begin) / 128)];
        ASSERT_EQ(scale, s.scale_inv[static_cast<size_t>((i / 128) * 3 + j / 128)])
            << i << "," << j;
      }
    }
  }
  EXPECT_TRUE(WeightReader::fp8_columns_splittable({64, 128}, 128));
  EXPECT_TRUE(WeightReader::fp8_columns_splittable({128, 300}, 128));
  EXPECT_FALSE(WeightReader::fp8_columns_splittable({64, 192}, 128));
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> rs(rows * 3);
  expect_error(
      [&] {
        wr.read_fp8_codes("fp8.weight", rows, cols, {0, 8}, {64, 192}, q.data(), rs.data());
      },
      {"fp8.weight", "straddle"});
  expect_error(
      [&] {
        wr.read_fp8_codes("plain.weight", 3, 4, {0, 3}, {0, 4}, q.data(), rs.data());
      },
      {"plain.weight", "F8_E4M3"});
}

// MXFP8 through read_fp8_codes (the GPU's "block" path): requantized to 128x128 block FP8 on the
// whole tensor's block grid, so every slice gives the codes and scales of the whole tensor's
// quantize_fp8_block over its dequantized values, and the values stay within E4M3's rounding of
// the MXFP8 ones (per element: half a step at the block's scale).
TEST(WeightReader, Mxfp8RequantizedToBlockFp8) {
  const int64_t rows = 200, cols = 300;
  Synthetic s = synthetic(rows, cols, 5);
  TempDir dir;
  write_st(dir.file("model.safetensors"), {{"mx.weight", "F8_E4M3", {rows, cols}, s.codes},
                                           {"mx.weight_scale", "U8", {rows, 10}, s.e8m0}});
  Checkpoint ckpt(dir.path());
  WeightReader mx(ckpt, quant_of(WeightQuant::kMxfp8), "config.json");
  std::vector<float> vals(static_cast<size_t>(rows * cols));
  mx.read("mx.weight", rows, cols, vals.data());
  std::vector<uint8_t> wq(vals.size());
  std::vector<float> ws(2 * 3);
  quantize_fp8_block(vals.data(), rows, cols, wq.data(), ws.data());
  const std::vector<std::pair<IndexRange, IndexRange>> ranges = {{{0, 200}, {0, 300}},
                                                                 {{64, 96}, {128, 300}},
                                                                 {{100, 164}, {64, 128}},
                                                                 {{199, 200}, {256, 300}}};
  for (const auto& [r, c] : ranges) {
    SCOPED_TRACE(std::to_string(r.begin) + ".." + std::to_string(r.end) + " x " +
                 std::to_string(c.begin) + ".." + std::to_string(c.end));
    const int64_t kb = (c.size() + 127) / 128;
    std::vector<uint8_t> q(static_cast<size_t>(r.size() * c.size()), 0x7f);
    std::vector<float> rs(static_cast<size_t>(r.size() * kb), NAN);
    mx.read_fp8_codes("mx.weight", rows, cols, r, c, q.data(), rs.data());
    for (int64_t i = r.begin; i < r.end; ++i) {
      for (int64_t j = c.begin; j < c.end; ++j) {
        const size_t o = static_cast<size_t>((i - r.begin) * c.size() + j - c.begin);
        ASSERT_EQ(q[o], wq[static_cast<size_t>(i * cols + j)]) << i << "," << j;
        const float scale = rs[static_cast<size_t>((i - r.begin) * kb + (j - c.begin) / 128)];
        ASSERT_EQ(scale, ws[static_cast<size_t>((i / 128) * 3 + j / 128)]) << i << "," << j;
        const float v = vals[static_cast<size_t>(i * cols + j)];
        ASSERT_LE(std::fabs(f8e4m3_to_f32(q[o]) * scale - v),
                  std::max(std::fabs(v) / 16, scale / 1024) * (1 + 1e-6))
            << i << "," << j;
      }
    }
  }
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> rs(rows * 3);
  expect_error(
      [&] {
        mx.read_fp8_codes("mx.weight", rows, cols, {0, 8}, {64, 192}, q.data(), rs.data());
      },
      {"mx.weight", "straddle"});
}

// MXFP8 kept as stored (the GPU's native path): codes and E8M0 codes of the range; columns on
// 32-column boundaries (or to the end), others refused naming the tensor; block FP8 refused.
TEST(WeightReader, Mxfp8CodesWithE8m0) {
  const int64_t rows = 200, cols = 300;
  Synthetic s = synthetic(rows, cols, 6);
  TempDir dir;
  write_st(dir.file("model.safetensors"),
           {{"mx.weight", "F8_E4M3", {rows, cols}, s.codes},
            {"mx.weight_scale", "U8", {rows, 10}, s.e8m0},
            {"bad.weight", "F8_E4M3", {rows, cols}, s.codes},
            {"bad.weight_scale", "U8", {rows, 9}, std::vector<uint8_t>(rows * 9, 127)}});
  Checkpoint ckpt(dir.path());
  WeightReader mx(ckpt, quant_of(WeightQuant::kMxfp8), "config.json");
  const std::vector<std::pair<IndexRange, IndexRange>> ranges = {
      {{0, 200}, {0, 300}}, {{64, 96}, {32, 300}}, {{100, 101}, {64, 128}}, {{5, 9}, {288, 300}}};
  for (const auto& [r, c] : ranges) {
    SCOPED_TRACE(std::to_string(r.begin) + ".." + std::to_string(r.end) + " x " +
                 std::to_string(c.begin) + ".." + std::to_string(c.end));
    const int64_t kb = (c.size() + 31) / 32;
    std::vector<uint8_t> q(static_cast<size_t>(r.size() * c.size()), 0x7f);
    std::vector<uint8_t> e(static_cast<size_t>(r.size() * kb), 0xff);
    mx.read_mxfp8_codes("mx.weight", rows, cols, r, c, q.data(), e.data());
    for (int64_t i = r.begin; i < r.end; ++i) {
      for (int64_t j = c.begin; j < c.end; ++j) {
        const size_t o = static_cast<size_t>((i - r.begin) * c.size() + j - c.begin);
        ASSERT_EQ(q[o], s.codes[static_cast<size_t>(i * cols + j)]) << i << "," << j;
        ASSERT_EQ(e[static_cast<size_t>((i - r.begin) * kb + (j - c.begin) / 32)],
                  s.e8m0[static_cast<size_t>(i * 10 + j / 32)])
            << i << "," << j;
      }
    }
  }
  std::vector<uint8_t> q(rows * cols), e(rows * 10);
  expect_error(
      [&] {
        mx.read_mxfp8_codes("mx.weight", rows, cols, {0, 8}, {16, 64}, q.data(), e.data());
      },
      {"mx.weight", "straddle"});
  expect_error(
      [&] {
        mx.read_mxfp8_codes("bad.weight", rows, cols, {0, 8}, {0, 64}, q.data(), e.data());
      },
      {"bad.weight_scale", "shape"});
  WeightReader blk(ckpt, quant_of(WeightQuant::kFp8Block), "cfg/config.json");
  expect_error(
      [&] {
        blk.read_mxfp8_codes("mx.weight", rows, cols, {0, 8}, {0, 64}, q.data(), e.data());
      },
      {"cfg/config.json", "MXFP8"});
}

TEST(WeightReader, BadScalesNameTheTensor) {
  Synthetic s = synthetic(64, 64, 5);
  std::vector<uint8_t> nan_codes(64 * 2, 127);
  nan_codes[77] = 0xff;
  std::vector<uint8_t> nan_weight = s.codes;
  nan_weight[100] = 0x7f;
  TempDir dir;
  write_st(dir.file("model.safetensors"),
           {{"noscale.weight", "F8_E4M3", {64, 64}, s.codes},
            {"shape.weight", "F8_E4M3", {64, 64}, s.codes},
            {"shape.weight_scale_inv", "F32", {1, 2}, raw(std::vector<float>{1.f, 1.f})},
            {"dtype.weight", "F8_E4M3", {64, 64}, s.codes},
            {"dtype.weight_scale_inv", "U8", {1, 1}, {3}},
            {"inf.weight", "F8_E4M3", {64, 64}, s.codes},
            {"inf.weight_scale_inv", "F32", {1, 1}, raw(std::vector<float>{INFINITY})},
            {"nanw.weight", "F8_E4M3", {64, 64}, nan_weight},
            {"nanw.weight_scale_inv", "F32", {1, 1}, raw(std::vector<float>{1.f})},
            {"mx.weight", "F8_E4M3", {64, 64}, s.codes},
            {"mx.weight_scale", "U8", {64, 2}, nan_codes}});
  Checkpoint ckpt(dir.path());
  WeightReader fp8(ckpt, quant_of(WeightQuant::kFp8Block), "cfg/config.json");
  WeightReader mx(ckpt, quant_of(WeightQuant::kMxfp8), "cfg/config.json");
  WeightReader none(ckpt, QuantConfig{}, "cfg/config.json");
  std::vector<float> out(64 * 64);
  expect_error([&] { fp8.read("noscale.weight", 64, 64, out.data()); },
               {"tensor 'noscale.weight'", "'noscale.weight_scale_inv' is missing"});
  expect_error([&] { fp8.read("shape.weight", 64, 64, out.data()); },
               {"scale tensor 'shape.weight_scale_inv' has shape [1, 2], expected [1, 1]"});
  expect_error([&] { fp8.read("dtype.weight", 64, 64, out.data()); },
               {"'dtype.weight_scale_inv' has dtype e8m0, expected f32"});
  expect_error([&] { fp8.read("inf.weight", 64, 64, out.data()); },
               {"'inf.weight_scale_inv': non-finite scale"});
  expect_error([&] { fp8.read("nanw.weight", 64, 64, out.data()); },
               {"tensor 'nanw.weight': E4M3 NaN code at [1, 36]"});
  expect_error([&] { mx.read("mx.weight", 64, 64, out.data()); },
               {"'mx.weight_scale': E8M0 code 0xff (NaN) at [38, 1]"});
  expect_error([&] { none.read("shape.weight", 64, 64, out.data()); },
               {"'shape.weight' is stored as F8_E4M3 but cfg/config.json has no "
                "quantization_config"});
  // The shape of the weight itself is checked as for any tensor.
  expect_error([&] { fp8.read("shape.weight", 64, 32, out.data()); },
               {"'shape.weight' has shape [64, 64], expected [64, 32]"});
}

// ---- Bad checkpoints through the model load. ----

TEST(Fp8Checkpoint, ModelLoadErrorsNameTheTensorOrField) {
  const std::string scale = "model.layers.0.self_attn.k_proj.weight_scale_inv";
  {
    TempDir tmp;
    const std::string d = copy_fixture(fp8_fixture(), tmp);
    edit_header(d + "/model.safetensors", [&](Json& h) {
      h["renamed_scale"] = h[scale];
      h.erase(scale);
    });
    expect_error([&] { Qwen3MoeCpu::load(d); },
                 {"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight'",
                  "'" + scale + "' is missing"});
  }
  {
    TempDir tmp;
    const std::string d = copy_fixture(fp8_fixture(), tmp);
    // q_proj [256, 128] has 2x1 scale blocks; [1, 2] keeps the bytes.
    const std::string q = "model.layers.1.self_attn.q_proj.weight_scale_inv";
    edit_header(d + "/model.safetensors", [&](Json& h) { h[q]["shape"] = {1, 2}; });
    expect_error([&] { Qwen3MoeCpu::load(d); },
                 {"scale tensor '" + q + "' has shape [1, 2], expected [2, 1]"});
  }
  {
    TempDir tmp;
    const std::string d = copy_fixture(fp8_fixture(), tmp);
    edit_config(d, [](Json& c) { c.erase("quantization_config"); });
    expect_error([&] { Qwen3MoeCpu::load(d); },
                 {"is stored as F8_E4M3 but", "config.json has no quantization_config"});
  }
  {
    TempDir tmp;
    const std::string d = copy_fixture(fp8_fixture(), tmp);
    edit_config(d, [](Json& c) { c["quantization_config"]["fmt"] = "e5m2"; });
    expect_error([&] { Qwen3MoeCpu::load(d); },
                 {"config.json: field 'quantization_config.fmt': unsupported FP8 format 'e5m2'"});
  }
}

TEST(Fp8Config, UnknownFormatsAreRefusedNamingTheField) {
  Json base = Json::parse(std::ifstream(fp8_fixture() + "/config.json"));
  auto parse_with = [&](const std::function<void(Json&)>& edit) {
    Json j = base;
    edit(j);
    return ModelConfig::from_json(j.dump(), "m/config.json");
  };
  auto bad = [&](const std::function<void(Json&)>& edit, const std::string& msg) {
    expect_error([&] { parse_with(edit); }, {"m/config.json: ", msg});
  };
  bad(
      [](Json& j) {
        j["quantization_config"]["weight_block_size"] = {64, 64};
      },
      "field 'quantization_config.weight_block_size': unsupported block size [64, 64] "
      "(supported: [128, 128])");
  bad([](Json& j) { j["quantization_config"]["weight_block_size"] = {128}; },
      "unsupported block size [128]");
  bad([](Json& j) { j["quantization_config"].erase("weight_block_size"); },
      "missing field 'quantization_config.weight_block_size'");
  bad([](Json& j) { j["quantization_config"]["weight_block_size"] = "128"; },
      "field 'quantization_config.weight_block_size': expected a list of integers");
  bad([](Json& j) { j["quantization_config"]["fmt"] = "e5m2"; },
      "field 'quantization_config.fmt': unsupported FP8 format 'e5m2' (supported: e4m3)");
  bad([](Json& j) { j["quantization_config"]["activation_scheme"] = "static"; },
      "field 'quantization_config.activation_scheme': unsupported activation scheme 'static'");
  bad([](Json& j) { j["quantization_config"]["quant_method"] = "awq"; },
      "field 'quantization_config.quant_method': unsupported quantization method 'awq'");
  bad([](Json& j) { j["quantization_config"].erase("quant_method"); },
      "missing field 'quantization_config.quant_method'");
  bad([](Json& j) { j["quantization_config"]["modules_to_not_convert"] = "lm_head"; },
      "field 'quantization_config.modules_to_not_convert': expected a list of strings");
  bad(
      [](Json& j) {
        j["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}};
      },
      "field 'quantization_config.quant_algo': unsupported ModelOpt quant_algo 'NVFP4'");
  bad(
      [](Json& j) {
        j["quantization_config"] = {{"quant_method", "modelopt"},
                                    {"quantization", {{"quant_algo", "FP8"}}}};
      },
      "field 'quantization_config.quantization.quant_algo': unsupported ModelOpt quant_algo 'FP8'");
  // The accepted spellings of MXFP8.
  for (const Json& q :
       {Json{{"quant_method", "modelopt"}, {"quant_algo", "MXFP8"}, {"ignore", {"lm_head"}}},
        Json{{"quant_method", "modelopt"},
             {"quantization", {{"quant_algo", "mxfp8"}, {"exclude_modules", {"lm_head"}}}}},
        Json{{"quant_method", "mxfp8"}, {"ignored_layers", {"lm_head"}}}}) {
    ModelConfig c = parse_with([&](Json& j) { j["quantization_config"] = q; });
    EXPECT_EQ(c.quant.method, WeightQuant::kMxfp8) << q.dump();
    EXPECT_EQ(c.quant.block_rows, 1);
    EXPECT_EQ(c.quant.block_cols, 32);
    EXPECT_EQ(c.quant.not_converted, std::vector<std::string>{"lm_head"});
    EXPECT_EQ(c.quant.scale_name("a.weight"), "a.weight_scale");
  }
  EXPECT_EQ(parse_with([](Json& j) { j.erase("quantization_config"); }).quant.method,
            WeightQuant::kNone);
  EXPECT_EQ(parse_with([](Json& j) { j["quantization_config"] = nullptr; }).quant.method,
            WeightQuant::kNone);
  // fmt and activation_scheme default to what Qwen writes.
  ModelConfig d = parse_with([](Json& j) {
    j["quantization_config"].erase("fmt");
    j["quantization_config"].erase("activation_scheme");
  });
  EXPECT_EQ(d.quant.method, WeightQuant::kFp8Block);
}

// ---- Quantizers. ----

TEST(Quantize, Mxfp8ScaleIsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(mxfp8_scale_code(448.f), 127);      // fits exactly at scale 1
  EXPECT_EQ(mxfp8_scale_code(448.0001f), 128);  // just over: scale 2
  EXPECT_EQ(mxfp8_scale_code(224.f), 126);      // 224 * 2 = 448 at scale 1/2
  EXPECT_EQ(mxfp8_scale_code(224.0001f), 127);
  EXPECT_EQ(mxfp8_scale_code(1.f), 127 - 8);  // 1 / 2^-8 = 256 <= 448 < 512
  EXPECT_EQ(mxfp8_scale_code(0.f), 127);
  EXPECT_EQ(mxfp8_scale_code(1e-40f), 0);         // clamped to 2^-127
  EXPECT_EQ(mxfp8_scale_code(3e38f), 127 + 120);  // 448 * 2^120 >= 3e38 > 448 * 2^119
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> mant(0.5f, 1.f);
  std::uniform_int_distribution<int> expo(-60, 60);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::ldexp(mant(rng), expo(rng));
    const int e = mxfp8_scale_code(amax) - 127;
    ASSERT_LE(amax, std::ldexp(448.0, e)) << amax;
    ASSERT_GT(amax, std::ldexp(448.0, e - 1)) << amax;
  }
}

TEST(Quantize, RoundTripWithinE4M3Bound) {
  const int64_t rows = 130, cols = 200;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = nd(rng) * std::ldexp(1.f, static_cast<int>(i % 7) - 3);
  w[5] = 0.f;
  // MXFP8.
  std::vector<uint8_t> q(w.size()), e(static_cast<size_t>(rows * 7));
  quantize_mxfp8(w.data(), rows, cols, q.data(), e.data());
  double worst = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float s = e8m0_to_f32(e[static_cast<size_t>(i * 7 + j / 32)]);
      const float x = w[static_cast<size_t>(i * cols + j)];
      const float d = f8e4m3_to_f32(q[static_cast<size_t>(i * cols + j)]) * s;
      const double bound = std::max(std::fabs(x) / 16.0, s / 1024.0);
      ASSERT_LE(std::fabs(d - x), bound) << i << "," << j;
      worst = std::max(worst, std::fabs(d - x) / bound);
      ASSERT_EQ(q[static_cast<size_t>(i * cols + j)], f32_to_f8e4m3(x / s));  // nearest code
    }
  }
  EXPECT_GT(worst, 0.5);  // the bound is tight: some elements round by almost half an ulp
  // Block FP8.
  std::vector<float> sinv(2 * 2);
  quantize_fp8_block(w.data(), rows, cols, q.data(), sinv.data());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float s = sinv[static_cast<size_t>((i / 128) * 2 + j / 128)];
      const float x = w[static_cast<size_t>(i * cols + j)];
      const float d = f8e4m3_to_f32(q[static_cast<size_t>(i * cols + j)]) * s;
      ASSERT_LE(std::fabs(d - x), std::max(std::fabs(x) / 16.0, s / 1024.0) * (1 + 1e-6))
          << i << "," << j;
    }
  }
}

// ---- tandem convert. ----

// Every quantized tensor of `out` dequantizes within E4M3's bound of the input's values.
void expect_round_trip(const std::string& in, const std::string& out, WeightQuant format,
                       int64_t* quantized_count) {
  ModelConfig ci = ModelConfig::from_dir(in), co = ModelConfig::from_dir(out);
  EXPECT_EQ(co.quant.method, format);
  Checkpoint a(in), b(out);
  WeightReader ra(a, ci.quant, in), rb(b, co.quant, out);
  int64_t n = 0;
  for (const std::string& name : b.names()) {
    const TensorView v = b.get(name);
    if (v.dtype != DType::kF8E4M3) continue;
    ++n;
    EXPECT_FALSE(linear_kind(name).empty()) << name;
    const int64_t rows = v.shape[0], cols = v.shape[1];
    std::vector<float> want(static_cast<size_t>(rows * cols)), got(want.size());
    ra.read(name, rows, cols, want.data());
    rb.read(name, rows, cols, got.data());
    const TensorView sv = b.get(co.quant.scale_name(name));
    std::vector<float> sc(static_cast<size_t>(sv.numel()));
    if (format == WeightQuant::kMxfp8) {
      ASSERT_EQ(sv.shape, Shape({rows, (cols + 31) / 32})) << name;
      for (size_t i = 0; i < sc.size(); ++i) sc[i] = e8m0_to_f32(sv.ptr<uint8_t>()[i]);
    } else {
      ASSERT_EQ(sv.shape, Shape({(rows + 127) / 128, (cols + 127) / 128})) << name;
      Checkpoint::to_f32(sv, sc.data());
    }
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const float s = format == WeightQuant::kMxfp8
                            ? sc[static_cast<size_t>(i * sv.shape[1] + j / 32)]
                            : sc[static_cast<size_t>((i / 128) * sv.shape[1] + j / 128)];
        const float x = want[static_cast<size_t>(i * cols + j)];
        const double bound = std::max(std::fabs(x) / 16.0, s / 1024.0) * (1 + 1e-6);
        ASSERT_LE(std::fabs(got[static_cast<size_t>(i * cols + j)] - x), bound)
            << name << " [" << i << ", " << j << "]";
      }
    }
  }
  *quantized_count = n;
}

TEST(Convert, Mxfp8FromBlockFp8RoundTripsAndServes) {
  TempDir tmp;
  const std::string out = tmp.file("mx");
  ConvertOptions o;
  o.in_dir = fp8_fixture();
  o.out_dir = out;
  o.format = WeightQuant::kMxfp8;
  int64_t calls = 0, last_done = 0, last_total = 0;
  o.progress = [&](int64_t done, int64_t total, uint64_t, uint64_t) {
    ++calls;
    EXPECT_EQ(done, last_done + 1);
    last_done = done;
    last_total = total;
  };
  ConvertReport r = convert_checkpoint(o);
  EXPECT_EQ(last_done, last_total);
  EXPECT_GT(calls, 0);
  // Layer 0: 4 attention + 3 dense MLP linears; layers 1-2: 4 (3 on layer 2: o_proj stays
  // bf16 as the input kept it) + 8 experts x 3.
  EXPECT_EQ(r.quantized_tensors, 7 + 28 + 27);
  EXPECT_EQ(r.kept_unquantized, std::vector<std::string>{"model.layers.2.self_attn.o_proj.weight"});
  for (const QuantErrorStats& s : r.kinds) {
    EXPECT_LE(s.max_bound_ratio, 1.0) << s.kind;
    EXPECT_GT(s.rel_rms(), 0.0) << s.kind;
    EXPECT_LT(s.rel_rms(), 0.05) << s.kind;
  }
  EXPECT_NE(format_report(r).find("experts.down_proj"), std::string::npos);
  int64_t n = 0;
  expect_round_trip(o.in_dir, out, WeightQuant::kMxfp8, &n);
  EXPECT_EQ(n, r.quantized_tensors);
  // The layout ModelOpt / vLLM read: quantization_config, hf_quant_config.json, U8 scales.
  Json cfg = Json::parse(std::ifstream(out + "/config.json"));
  EXPECT_EQ(cfg["quantization_config"]["quant_method"], "modelopt");
  EXPECT_EQ(cfg["quantization_config"]["quant_algo"], "MXFP8");
  Json hf = Json::parse(std::ifstream(out + "/hf_quant_config.json"));
  EXPECT_EQ(hf["quantization"]["quant_algo"], "MXFP8");
  EXPECT_TRUE(hf["quantization"].contains("kv_cache_quant_algo"));
  EXPECT_EQ(cfg["num_experts"], 8);  // the rest of config.json as it was
  EXPECT_TRUE(fs::exists(out + "/generation_config.json"));
  EXPECT_FALSE(fs::exists(out + "/golden.json"));
  Checkpoint b(out);
  EXPECT_EQ(b.get("model.layers.1.mlp.experts.0.gate_proj.weight_scale").dtype, DType::kE8M0);
  EXPECT_EQ(b.get("model.layers.1.mlp.gate.weight").dtype, DType::kBF16);
  EXPECT_FALSE(b.has("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"));
  // It loads and generates; tokens mostly agree with the block-FP8 golden.
  auto model = Qwen3MoeCpu::load(out);
  testing::Golden g = testing::load_golden(fp8_fixture());
  int agree = 0, total = 0;
  for (const auto& c : g.cases) {
    Greedy res = greedy(*model, c.prompt_ids, 4);
    for (size_t t = 0; t < res.tokens.size(); ++t) agree += res.tokens[t] == c.output_ids[t];
    total += static_cast<int>(res.tokens.size());
  }
  EXPECT_GE(agree, 1) << agree << " of " << total;
  // Converting into a non-empty directory is refused.
  expect_error([&] { convert_checkpoint(o); }, {"exists and is not empty"});
}

TEST(Convert, FromBf16BothFormatsAndShards) {
  for (WeightQuant f : {WeightQuant::kMxfp8, WeightQuant::kFp8Block}) {
    SCOPED_TRACE(std::string(weight_quant_name(f)));
    TempDir tmp;
    ConvertOptions o;
    o.in_dir = bf16_fixture();
    o.out_dir = tmp.file("out");
    o.format = f;
    o.shard_bytes = 256 * 1024;  // several files + index
    ConvertReport r = convert_checkpoint(o);
    EXPECT_GT(r.files.size(), 1u);
    EXPECT_TRUE(fs::exists(o.out_dir + "/model.safetensors.index.json"));
    EXPECT_TRUE(r.kept_unquantized.empty());
    int64_t n = 0;
    expect_round_trip(o.in_dir, o.out_dir, f, &n);
    EXPECT_EQ(n, r.quantized_tensors);
    EXPECT_EQ(n, 2 * (4 + 32 * 3));
    auto model = Qwen3MoeCpu::load(o.out_dir);
    testing::Golden g = testing::load_golden(bf16_fixture());
    Greedy res = greedy(*model, g.cases[0].prompt_ids, 2);
    EXPECT_EQ(res.tokens.size(), 2u);
    // Converting the converted checkpoint again reads its quantized weights.
    TempDir tmp2;
    ConvertOptions again = o;
    again.in_dir = o.out_dir;
    again.out_dir = tmp2.file("again");
    again.format = WeightQuant::kMxfp8;
    EXPECT_EQ(convert_checkpoint(again).quantized_tensors, n);
  }
}

TEST(Convert, LinearsWithoutWholeMxBlocksStayAsStored) {
  // hub_top8_mlponly_bf16: experts of width 16 (down_proj's input is not a multiple of 32).
  TempDir tmp;
  ConvertOptions o;
  o.in_dir = testing::source_dir() + "/tests/data/fixtures/hub_top8_mlponly_bf16";
  o.out_dir = tmp.file("out");
  ConvertReport r = convert_checkpoint(o);
  EXPECT_EQ(r.kept_unquantized.size(), 2u * 16u);  // MoE layers 1-2, 16 experts' down_proj
  Checkpoint b(o.out_dir);
  EXPECT_EQ(b.get("model.layers.1.mlp.experts.0.down_proj.weight").dtype, DType::kBF16);
  EXPECT_EQ(b.get("model.layers.1.mlp.experts.0.up_proj.weight").dtype, DType::kF8E4M3);
  Json cfg = Json::parse(std::ifstream(o.out_dir + "/config.json"));
  const auto& ignore = cfg["quantization_config"]["ignore"];
  EXPECT_NE(std::find(ignore.begin(), ignore.end(), "model.layers.1.mlp.experts.0.down_proj"),
            ignore.end());
  EXPECT_NO_THROW(Qwen3MoeCpu::load(o.out_dir));
}

TEST(Convert, LinearKinds) {
  EXPECT_EQ(linear_kind("model.layers.3.mlp.experts.7.up_proj.weight"), "experts.up_proj");
  EXPECT_EQ(linear_kind("model.layers.0.mlp.down_proj.weight"), "mlp.down_proj");
  EXPECT_EQ(linear_kind("model.layers.0.self_attn.k_proj.weight"), "k_proj");
  EXPECT_EQ(linear_kind("model.layers.0.mlp.gate.weight"), "");
  EXPECT_EQ(linear_kind("lm_head.weight"), "");
  EXPECT_EQ(linear_kind("model.layers.0.self_attn.q_norm.weight"), "");
  EXPECT_EQ(linear_kind("model.layers.0.self_attn.k_proj.weight_scale_inv"), "");
}

}  // namespace
}  // namespace tandem
